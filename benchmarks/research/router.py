"""Router matmul benchmark on one GPU: x [T, H] @ w [H, E] at decode and small batch sizes, as
the layer computes it (`jaxmoe.ops.dense`, the batch-invariant grouped-matmul kernel with one
group), its kernel configs around the default heuristic, and XLA's dot (cuBLAS; not
batch-invariant) in the same run.

    python -m benchmarks.research.router [--shapes qwen3_30b,mixtral,dsv3_ep8]
        [--tokens 64,256] [--iters 20] [--tag TAG] [--out DIR]

Per shape and token count: `dense` (the layer's op: at these sizes the narrow-tile kernel,
`dense_narrow_hopper.py`), `narrow[tile_n=..]` (that kernel with other column tiles),
`kernel[tile_k=..,tile_n=..]` (the grouped-matmul kernel with one group, dense's kernel before
2026-12-04, with those `GmmConfig` fields, 64-row warpgroup tiles stacked along M; with
`wg_split=n` side by side along N, so that 64 rows fill the CTA and fewer tokens are padded
only to 64; `same_bits` checks each against `dense`: a config never changes the reduction
order) and `xla_dot`. Device time per call from a JAX profile
(`benchmarks.timing.device_seconds`; host time off the GPU, for the CPU smoke test), median of
three turns. Writes router_<date>[_tag].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks.report import (
    add_output_arguments,
    environment,
    error_text,
    log,
    result_path,
    write_result,
)
from benchmarks.timing import device_seconds, time_it
from jaxmoe.ops.array_gmm import KERNEL_MULTIPLE, kernel_rows
from jaxmoe.ops.dense import dense
from jaxmoe.ops.pallas.dense_narrow_hopper import ROWS as NARROW_ROWS
from jaxmoe.ops.pallas.dense_narrow_hopper import (
    default_narrow_config,
    dense_narrow_pallas,
)
from jaxmoe.ops.pallas.gmm_hopper import default_config, gmm_pallas
from jaxmoe.shapes import SHAPES, TINY_SHAPES

BF16 = jnp.bfloat16
DEFAULT_SHAPES = ("qwen3_30b", "mixtral", "dsv3_ep8")


def candidates(tokens: int, hidden: int, experts: int):
    """name -> call, on one x and w: the layer's dense, kernel configs, XLA's dot."""
    kx, kw = jax.random.split(jax.random.key(tokens))
    x = jax.random.normal(kx, (tokens, hidden), BF16)
    w = jax.random.normal(kw, (hidden, experts), BF16)
    calls = {
        "dense": jax.jit(lambda x, w: dense(x, w, impl="pallas")),
        "xla_dot": jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
    }
    # The kernel on the operands as `dense` pads them: rows to the kernel's, E to its multiple;
    # the warpgroups side by side along N (a 64-row CTA) take rows padded to 64 only.
    n = -(-experts // KERNEL_MULTIPLE) * KERNEL_MULTIPLE
    narrow_rows = -(-tokens // NARROW_ROWS) * NARROW_ROWS
    for tile_n in (16, 32, 64):
        config = dataclasses.replace(default_narrow_config(hidden), tile_n=tile_n)

        def narrow(x, w, config=config):
            padded_x = jnp.pad(x, ((0, narrow_rows - tokens), (0, 0)))
            padded_w = jnp.pad(w, ((0, 0), (0, n - experts)))
            out = dense_narrow_pallas(padded_x, padded_w, out_dtype=BF16, config=config)
            return out[:tokens, :experts]

        calls[f"narrow[tile_n={tile_n}]"] = jax.jit(narrow)
    base = default_config(kernel_rows(tokens), hidden, n, 1)
    for tile_k in (64, 128):
        for tile_n, wg_split in sorted({(64, "m"), (n, "m"), (64, "n")}):
            config = dataclasses.replace(
                base,
                tile_k=tile_k,
                tile_n=tile_n,
                tile_m=64,
                wg_split=wg_split,
                epilogue_slots=1,
                epilogue_tile_n=min(base.epilogue_tile_n, tile_n),
                max_concurrent_steps=min(4, hidden // tile_k),
            ).with_fitting_stages(BF16, BF16)
            rows = kernel_rows(tokens) if wg_split == "m" else max(-(-tokens // 8) * 8, 64)
            try:
                config.validate(rows, hidden, n)
            except ValueError:
                continue

            def kernel(x, w, config=config, rows=rows):
                padded_x = jnp.pad(x, ((0, rows - tokens), (0, 0)))
                padded_w = jnp.pad(w, ((0, 0), (0, n - experts)))[None]
                sizes = jnp.full((1,), tokens, jnp.int32)
                out = gmm_pallas(
                    padded_x, padded_w, sizes, transpose_rhs=False, out_dtype=BF16, config=config
                )
                return out[:tokens, :experts]

            fields = dict(tile_k=tile_k, tile_n=tile_n) | (
                {"wg_split": "n"} if wg_split == "n" else {}
            )
            name = ",".join(f"{f}={v}" for f, v in fields.items())
            calls[f"kernel[{name}]"] = jax.jit(kernel)
    return calls, (x, w)


def main(argv=None) -> dict:
    """Parse the command line (`argv`: None for sys.argv), time every shape and token count,
    writing the JSON after each; returns the result (with `path`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--tokens", default="64,256")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--impls", default="", help='time only these ("a;b": names hold commas; dense always)'
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    wanted = {i for i in args.impls.split(";") if i}
    path = result_path(args.out, "router", args.tag)
    result = environment("router", command=" ".join(sys.argv), records=[])
    on_gpu = jax.devices()[0].platform == "gpu"
    for shape_name in args.shapes.split(","):
        shape = (SHAPES | TINY_SHAPES)[shape_name]
        for tokens in map(int, args.tokens.split(",")):
            calls, operands = candidates(tokens, shape.hidden_size, shape.config.num_experts)
            if wanted:
                if wanted - set(calls):
                    parser.error(f"unknown --impls {sorted(wanted - set(calls))}: {sorted(calls)}")
                calls = {k: v for k, v in calls.items() if k in wanted | {"dense"}}
            reference = calls["dense"](*operands)
            times = {name: [] for name in calls}
            bits = {}
            for name, call in calls.items():
                try:
                    out = call(*operands)
                    bits[name] = bool(jnp.array_equal(out.astype(BF16), reference))
                except Exception as e:  # recorded, the others go on
                    log(f"{shape_name} T={tokens} {name}: {error_text(e)}")
                    times.pop(name)
            for _ in range(3):
                for name in times:
                    call = calls[name]
                    run = lambda call=call: call(*operands)
                    seconds = (device_seconds if on_gpu else time_it)(run, iters=args.iters)
                    us = seconds * 1e6
                    times[name].append(us)
            for name, samples in times.items():
                us = statistics.median(samples)
                result["records"].append(
                    dict(
                        shape=shape_name,
                        tokens=tokens,
                        impl=name,
                        us=us,
                        same_bits=bits[name],
                    )
                )
                log(f"{shape_name} T={tokens:4d} {name:28s} {us:7.1f} us same_bits={bits[name]}")
            write_result(result, path)
    return dict(result, path=path)


if __name__ == "__main__":
    main()
