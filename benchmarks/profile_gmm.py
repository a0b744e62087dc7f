"""One grouped-matmul call between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python benchmarks/profile_gmm.py --shape mixtral --op fwd [--impl pallas|torch]

Same shapes and Dirichlet routing as benchmarks/gmm.py; the call is compiled and run once
before the profiled one, so only the measured call's kernels are captured.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax                                                        # noqa: E402
import jax.numpy as jnp                                           # noqa: E402
import numpy as np                                                # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gmm import SHAPES, group_sizes_for                # noqa: E402
from jaxmoe.ops import gmm, tgmm                                  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=list(SHAPES))
    parser.add_argument("--op", default="fwd", choices=["fwd", "dgrad", "wgrad"])
    parser.add_argument("--impl", default="pallas", choices=["pallas", "torch"])
    args = parser.parse_args(argv)
    import torch
    m, k, n, g = SHAPES[args.shape]
    sizes = group_sizes_for("dirichlet", m, g)
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    if args.impl == "pallas":
        kw = dict(impl="pallas", preferred_element_type=jnp.bfloat16)
        call = {"fwd": jax.jit(lambda: gmm(x, w, gs, **kw)),
                "dgrad": jax.jit(lambda: gmm(dy, w, gs, transpose_rhs=True, **kw)),
                "wgrad": jax.jit(lambda: tgmm(x, dy, gs, **kw))}[args.op]
        sync = jax.block_until_ready
    else:
        tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
        offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
        call = {"fwd": lambda: torch._grouped_mm(tx, tw, offs=offs),
                "dgrad": lambda: torch._grouped_mm(tdy, tw.transpose(-2, -1), offs=offs),
                "wgrad": lambda: torch._grouped_mm(tx.t(), tdy, offs=offs)}[args.op]
        sync = lambda out: torch.cuda.synchronize()
    sync(call())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    sync(call())
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
