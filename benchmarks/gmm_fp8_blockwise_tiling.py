"""Tilings of the FP8 blockwise grouped-matmul kernel next to jaxmoe's bf16 kernel, device time.

    python benchmarks/gmm_fp8_blockwise_tiling.py [--shapes mixtral,dsv3_ep8,mixtral:dgrad]
        [--variants "name:field=value,...;..."] [--tag TAG] [--out DIR]

For each shape of `benchmarks/gmm.py`'s `SHAPES` (":dgrad": the same sizes with the contraction
over N, as the layer's dgrad runs them), on operands quantized once (1 x 128 blocks for the
tokens, 128 x 128 for the weights, already K-major: no transpose is timed), the kernel
(`gmm_block_scaled_fp8_pallas(scale_block=128)`) runs under each tiling:
  heuristic       `default_fp8_blockwise_config`, what the layer uses
  mxfp8_tiling    `default_mxfp8_config` (CTA 64 x 256, 128-wide K steps; the heuristic before
                  2026-12-04)
  <name>          the heuristic with the given `GmmConfig` fields replaced (--variants)
and jaxmoe's bf16 kernel (`ops.gmm`, Pallas) on the same group sizes (Dirichlet-skewed, rounded
to the recipe's 128-row alignment). Each time is the device time of the call's GPU work
(`timing.device_seconds`); every tiling's output is compared bitwise with the heuristic's
(the tiling never changes the bits). Off the GPU (the interpreter) only the bits are compared.
Writes gmm_fp8_blockwise_<date>[_TAG].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402
from benchmarks.gmm import SHAPES, group_sizes_for  # noqa: E402
from benchmarks.report import error_text, log  # noqa: E402
from benchmarks.timing import device_seconds  # noqa: E402
from jaxmoe.fp8_blockwise import quantize_1x128, quantize_128x128  # noqa: E402
from jaxmoe.ops import gmm  # noqa: E402
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import (  # noqa: E402
    default_fp8_blockwise_config,
    default_mxfp8_config,
    gmm_block_scaled_fp8_pallas,
)

BF16 = jnp.bfloat16
DEFAULT_VARIANTS = "wg_split_m:wg_split=m,tile_k=128;k256_wg_split_n:wg_split=n"
BLOCK = 128


def parse_variants(text: str) -> dict[str, dict]:
    """ "name:field=value,...;..." -> {name: {field: value}} (ints where they parse)."""
    variants = {}
    for item in filter(None, text.split(";")):
        name, _, fields = item.partition(":")
        pairs = (f.split("=") for f in filter(None, fields.split(",")))
        variants[name] = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}
    return variants


def problem(shape: str):
    """(m, contraction, out_n, groups) of a --shapes entry."""
    name, _, op = shape.partition(":")
    m, k, n, g = SHAPES[name]
    return (m, n, k, g) if op == "dgrad" else (m, k, n, g)


def bench_shape(shape: str, variants: dict, iters: int, records: list) -> None:
    m, c, n, g = problem(shape)
    sizes = group_sizes_for("dirichlet", m, g) // BLOCK * BLOCK
    sizes[np.argmax(sizes)] += m - sizes.sum()
    group_sizes = jnp.asarray(sizes, jnp.int32)
    flops = 2.0 * float(sizes.sum()) * c * n
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, c), BF16)
    w = (jax.random.normal(kw, (g, c, n), BF16) * 0.02).astype(BF16)
    xq, wq = quantize_1x128(x), quantize_128x128(w)
    # The kernel's K-major operands: lhs [M, C] with scales [C/128, M], rhs [G, N, C] with
    # scales [G, C/128, N/128].
    operands = (
        xq.data,
        jnp.swapaxes(xq.scale_inv, 0, 1),
        jnp.swapaxes(wq.data, 1, 2),
        wq.scale_inv,
        group_sizes,
    )
    heuristic = default_fp8_blockwise_config(m, c, n, g, BF16)
    configs = {"heuristic": heuristic, "mxfp8_tiling": default_mxfp8_config(m, c, n, g, BF16)}
    for name, fields in variants.items():
        config = dataclasses.replace(heuristic, **fields)
        steps = min(config.max_concurrent_steps, c // config.tile_k)
        configs[name] = dataclasses.replace(config, max_concurrent_steps=steps).with_fitting_stages(
            jnp.float8_e4m3fn, BF16
        )

    on_gpu = jax.devices()[0].platform == "gpu"

    def record(impl, fn, **extra):
        if not on_gpu:
            records.append(dict(shape=shape, impl=impl, **extra))
            return
        try:
            seconds = device_seconds(fn, iters=iters)
        except Exception as e:  # a tiling that cannot run this shape
            records.append(dict(shape=shape, impl=impl, error=error_text(e), **extra))
            log(f"{shape} {impl}: FAILED {error_text(e)}")
            return
        tflops = flops / seconds / 1e12
        records.append(dict(shape=shape, impl=impl, us=seconds * 1e6, tflops=tflops, **extra))
        log(f"{shape:16s} {impl:18s} {seconds * 1e6:9.1f} us {tflops:7.1f} TFLOP/s")

    impl = "pallas" if on_gpu else "xla"
    bf16 = jax.jit(functools.partial(gmm, impl=impl, preferred_element_type=BF16))
    record("jaxmoe_bf16", lambda: bf16(x, w, group_sizes))
    reference = None
    for name, config in configs.items():
        kernel = jax.jit(
            functools.partial(
                gmm_block_scaled_fp8_pallas, scale_block=BLOCK, out_dtype=BF16, config=config
            )
        )
        try:
            out = np.asarray(kernel(*operands).astype(jnp.float32))
        except Exception as e:
            records.append(dict(shape=shape, impl=name, error=error_text(e), config=repr(config)))
            log(f"{shape} {name}: FAILED {error_text(e)}")
            continue
        reference = out if reference is None else reference
        record(
            name,
            lambda: kernel(*operands),  # noqa: B023
            config=repr(config),
            bitwise_heuristic=bool(np.array_equal(out, reference)),
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,dsv3_ep8,qwen3_30b,mixtral:dgrad")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    unknown = {problem_name.partition(":")[0] for problem_name in args.shapes.split(",")} - set(
        SHAPES
    )
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    result = report.environment(
        "gmm_fp8_blockwise", command=" ".join(sys.argv if argv is None else argv), records=[]
    )
    path = report.result_path(args.out, "gmm_fp8_blockwise", args.tag)
    for shape in args.shapes.split(","):
        bench_shape(shape, parse_variants(args.variants), args.iters, result["records"])
        report.write_result(result, path)
    result["path"] = path
    return result


if __name__ == "__main__":
    main()
