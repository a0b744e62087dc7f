"""Grouped-matmul, quantize or SwiGLU-copies calls between cudaProfilerStart/Stop, for Nsight
Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python -m benchmarks.research.profile_gmm --shape mixtral --op fwd [--impl pallas|torch] \\
            [--config '{"cluster_n": 2}']

Same shapes, data and Dirichlet routing as benchmarks/gmm.py and benchmarks/research/gmm_mxfp8.py.
--op takes a comma-separated list (fwd, dgrad, wgrad, fwd_fp8_blockwise, wgrad_fp8_blockwise,
quantize_rowwise, quantize_columnwise, dispatch_quantize, swiglu_copies, swiglu_backward_copies,
copy); every call is compiled and run
once before the profiled ones, so only the measured calls' kernels are captured, in the order
given. The fp8_blockwise ops run the FP8-blockwise kernels on operands quantized beforehand, as
benchmarks/research/gmm_fp8_blockwise_tiling.py times them. "copy" is torch's device copy of the bytes a
quantize reads and writes (the bandwidth ceiling the quantize kernels are held to); the quantize,
fp8_blockwise and copy ops ignore --impl. swiglu_copies and swiglu_backward_copies run the
SwiGLU's FP8-blockwise copy kernels (`swiglu_quantize_hopper`, `swiglu_backward_quantize_hopper`)
on fc1's output h [M, N] (N = 2F), with p [M] and, for the backward, a's gradient [M, N/2].
--config (JSON) changes fields of the default Pallas
kernel config of the grouped-matmul ops (GmmConfig for fwd/dgrad/fwd_fp8_blockwise, TgmmConfig
for wgrad, BlockwiseTgmmConfig for wgrad_fp8_blockwise). Warp-stall samples by SASS line:

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o rep \\
        python -m benchmarks.research.profile_gmm --shape dsv3_ep8 --op wgrad_fp8_blockwise
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.research.ncu_stalls sass.csv --mix
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gmm import SHAPES, default_kernel_config, group_sizes_for
from benchmarks.research.gmm_fp8_blockwise_tiling import fprop_operands, wgrad_operands
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops import gmm, tgmm
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import (
    default_fp8_blockwise_config,
    gmm_block_scaled_fp8_pallas,
)
from jaxmoe.ops.pallas.quantize_hopper import (
    gather_quantize_rowwise_pallas,
    quantize_columnwise_pallas,
    quantize_rowwise_pallas,
)
from jaxmoe.ops.pallas.swiglu_backward_quantize_hopper import (
    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.ops.pallas.swiglu_quantize_hopper import (
    weighted_swiglu_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import (
    default_config as default_tgmm_config,
)
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import tgmm_fp8_blockwise_pallas

OPS = (
    "fwd",
    "dgrad",
    "wgrad",
    "fwd_fp8_blockwise",
    "wgrad_fp8_blockwise",
    "quantize_rowwise",
    "quantize_columnwise",
    "dispatch_quantize",
    "swiglu_copies",
    "swiglu_backward_copies",
    "copy",
)


def make_call(op, impl, shape, torch, changes=None):
    """(call, sync) for one op at one shape; `changes`: fields of the default Pallas config."""
    m, k, n, g = SHAPES[shape]
    sizes = group_sizes_for("dirichlet", m, g)
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    torch_sync = lambda out: torch.cuda.synchronize()
    if op.startswith("quantize") or op == "dispatch_quantize":
        if op == "dispatch_quantize":  # as benchmarks/research/gmm_mxfp8.py: m/2 tokens, each twice
            row_token = jax.random.permutation(jax.random.key(1), jnp.arange(m) % (m // 2))
            fn, tokens = jax.jit(gather_quantize_rowwise_pallas), x[: m // 2]
            return (lambda: fn(tokens, row_token)), jax.block_until_ready
        fn = jax.jit(
            quantize_rowwise_pallas if op == "quantize_rowwise" else quantize_columnwise_pallas
        )
        return (lambda: fn(x)), jax.block_until_ready
    if op.endswith("_fp8_blockwise"):
        return fp8_blockwise_call(op, m, k, n, g, changes), jax.block_until_ready
    if op.startswith("swiglu"):
        return swiglu_call(op, m, n), jax.block_until_ready
    if op == "copy":
        src = torch.empty(
            (x.size * 3 + x.size // BLOCK_SIZE) // 2, dtype=torch.uint8, device="cuda"
        )
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), torch_sync
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    if impl == "pallas":
        # Operands are arguments (as in benchmarks/gmm.py), so that the tile metadata is
        # computed at run time, not folded into constants.
        kw = dict(
            impl="pallas",
            preferred_element_type=jnp.bfloat16,
            config=dataclasses.replace(default_kernel_config(shape, op), **(changes or {})),
        )
        fn, args = {
            "fwd": (lambda a, b, s: gmm(a, b, s, **kw), (x, w, gs)),
            "dgrad": (lambda a, b, s: gmm(a, b, s, transpose_rhs=True, **kw), (dy, w, gs)),
            "wgrad": (lambda a, b, s: tgmm(a, b, s, **kw), (x, dy, gs)),
        }[op]
        fn = jax.jit(fn)
        return (lambda: fn(*args)), jax.block_until_ready
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    call = {
        "fwd": lambda: torch._grouped_mm(tx, tw, offs=offs),
        "dgrad": lambda: torch._grouped_mm(tdy, tw.transpose(-2, -1), offs=offs),
        "wgrad": lambda: torch._grouped_mm(tx.t(), tdy, offs=offs),
    }[op]
    return call, torch_sync


def fp8_blockwise_call(op, m, k, n, g, changes):
    """The FP8-blockwise fprop or wgrad kernel on operands quantized beforehand, under its
    default config with `changes`."""
    if op == "fwd_fp8_blockwise":
        _, _, _, operands = fprop_operands(m, k, n, g)
        config = default_fp8_blockwise_config(m, k, n, g, jnp.bfloat16)
        kernel = functools.partial(gmm_block_scaled_fp8_pallas, scale_block=128)
    else:
        _, _, _, operands = wgrad_operands(m, k, n, g)
        config = default_tgmm_config(k, n, jnp.bfloat16, rows_per_group=m // g)
        kernel = tgmm_fp8_blockwise_pallas
    config = dataclasses.replace(config, **(changes or {}))
    fn = jax.jit(functools.partial(kernel, out_dtype=jnp.bfloat16, config=config))
    return lambda: fn(*operands)


def swiglu_call(op, m, n):
    """The SwiGLU copy kernel of `op` on h [m, n] (fc1's output: n = 2F), p [m] and, for the
    backward, a's gradient [m, n / 2], random."""
    keys = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
    p = jax.random.uniform(keys[1], (m,), jnp.float32)
    if op == "swiglu_copies":
        fn = jax.jit(weighted_swiglu_quantize_1x128_with_transpose_pallas)
        return lambda: fn(h, p)
    g = jax.random.normal(keys[2], (m, n // 2), jnp.bfloat16)
    fn = jax.jit(weighted_swiglu_backward_quantize_1x128_with_transpose_pallas)
    return lambda: fn(h, p, g)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=list(SHAPES))
    parser.add_argument("--op", default="fwd", help=f"comma-separated, of {OPS}")
    parser.add_argument("--impl", default="pallas", choices=["pallas", "torch"])
    parser.add_argument("--config", default="{}", help="JSON: changes to the default config")
    args = parser.parse_args(argv)
    ops = args.op.split(",")
    if unknown := set(ops) - set(OPS):
        parser.error(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    import torch

    calls = [make_call(op, args.impl, args.shape, torch, json.loads(args.config)) for op in ops]
    for call, sync in calls:
        sync(call())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call, sync in calls:
        sync(call())
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
