"""Tilings of the FP8 blockwise grouped-matmul kernels next to jaxmoe's bf16 kernels, device time.

    python -m benchmarks.research.gmm_fp8_blockwise_tiling [--shapes mixtral,dsv3_ep8,mixtral:dgrad,...]
        [--variants "name:field=value,...;..."] [--wgrad-shapes mixtral,dsv3_ep8]
        [--wgrad-variants "name:field=value,...;..."] [--tag TAG] [--out DIR]

For each shape of `benchmarks/gmm.py`'s `SHAPES` (fc1's forward; ":dgrad": the same sizes with
the contraction over N, as the layer's dgrad runs them; ":fc2" and ":fc2_dgrad": fc2's forward,
F -> H, and its dgrad, H -> F), on operands quantized once (1 x 128 blocks for the
tokens, 128 x 128 for the weights, already K-major: no transpose is timed), the kernel
(`gmm_block_scaled_fp8_pallas(scale_block=128)`) runs under each tiling:
  heuristic       `default_fp8_blockwise_config`, what the layer uses
  mxfp8_tiling    `default_mxfp8_config` (CTA 64 x 256, 128-wide K steps; the heuristic before
                  2026-12-04)
  <name>          the heuristic with the given `GmmConfig` fields replaced (--variants)
and jaxmoe's bf16 kernel (`ops.gmm`, Pallas) on the same group sizes (Dirichlet-skewed, rounded
to the recipe's 128-row alignment). For each of --wgrad-shapes, the weight-gradient kernel
(`tgmm_fp8_blockwise_pallas`, on the transposed 1 x 128-along-the-tokens copies, made once)
under its `default_config` ("heuristic") and each `BlockwiseTgmmConfig` change of
--wgrad-variants, next to jaxmoe's bf16 `ops.tgmm` (shape names get ":wgrad"). Each time is
the device time of the call's GPU work (`timing.device_seconds`); every tiling's output is
compared bitwise with the heuristic's (the tiling never changes the bits); the calls take turns
over --repeats rounds (median). Off the GPU (the interpreter) only the bits are compared.
Writes gmm_fp8_blockwise_<date>[_TAG].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.gmm import SHAPES, group_sizes_for
from benchmarks.report import add_output_arguments, error_text, log, parse_variants
from benchmarks.timing import device_seconds
from jaxmoe.fp8_blockwise import quantize_1x128, quantize_128x128
from jaxmoe.ops import gmm, tgmm
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import (
    default_fp8_blockwise_config,
    default_mxfp8_config,
    gmm_block_scaled_fp8_pallas,
)
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import (
    default_config as default_tgmm_config,
)
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import tgmm_fp8_blockwise_pallas

BF16 = jnp.bfloat16
DEFAULT_VARIANTS = "wg_split_m:wg_split=m,tile_k=128;k256_wg_split_n:wg_split=n"
# The wgrad heuristic against no bands and no CTA pairs (docs/notes/2026-12-07-kernel-experiments.md).
DEFAULT_WGRAD_VARIANTS = "unbanded:grid_tile_width=0;unpaired:cluster_n=1"
BLOCK = 128


PROBLEMS = ("", "dgrad", "fc2", "fc2_dgrad")  # a --shapes entry's suffixes after ":"


def problem(shape: str):
    """(m, contraction, out_n, groups) of a --shapes entry NAME[:SUFFIX] (`PROBLEMS`): NAME's
    fc1 forward (`SHAPES`: M, H -> 2F, G), its dgrad (2F -> H), fc2's forward (F -> H) or fc2's
    dgrad (H -> F)."""
    name, _, op = shape.partition(":")
    m, h, two_f, g = SHAPES[name]
    f = two_f // 2
    sizes = {"": (h, two_f), "dgrad": (two_f, h), "fc2": (f, h), "fc2_dgrad": (h, f)}
    return (m, *sizes[op], g)


def aligned_group_sizes(m: int, g: int) -> np.ndarray:
    """Dirichlet-skewed sizes summing to m, each a multiple of 128 (the recipe's alignment)."""
    sizes = group_sizes_for("dirichlet", m, g) // BLOCK * BLOCK
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes


def compare_tilings(
    shape, kernels: dict, bf16, flops: float, iters: int, repeats: int, records: list
) -> None:
    """Record the bf16 call and each tiling's kernel call (name -> (call, config)): whether the
    output has the first tiling's bits, and on the GPU the median device time over `repeats`
    rounds in which the calls take turns (the H200 runs at its power limit: a slow drift of the
    clock then falls on all of them alike)."""
    entries = {"jaxmoe_bf16": dict(shape=shape, impl="jaxmoe_bf16")}
    calls = {"jaxmoe_bf16": bf16}
    reference = None
    for name, (call, config) in kernels.items():
        entry = dict(shape=shape, impl=name, config=repr(config))
        try:
            out = np.asarray(call().astype(jnp.float32))
        except Exception as e:  # a tiling that cannot run this shape
            records.append(dict(entry, error=error_text(e)))
            log(f"{shape} {name}: FAILED {error_text(e)}")
            continue
        reference = out if reference is None else reference
        entries[name] = dict(entry, bitwise_heuristic=bool(np.array_equal(out, reference)))
        calls[name] = call
    if jax.devices()[0].platform != "gpu":
        records.extend(entries.values())
        return
    runs = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            runs[name].append(device_seconds(call, iters=iters))
    for name, entry in entries.items():
        seconds = statistics.median(runs[name])
        tflops = flops / seconds / 1e12
        us_runs = [t * 1e6 for t in runs[name]]
        records.append(dict(entry, us=seconds * 1e6, us_runs=us_runs, tflops=tflops))
        log(f"{shape:16s} {name:18s} {seconds * 1e6:9.1f} us {tflops:7.1f} TFLOP/s")


def fprop_operands(m: int, c: int, n: int, g: int):
    """(sizes, x [M, C], w [G, C, N], the fprop kernel's operands) for M rows in G aligned
    groups: x quantized in 1 x 128 blocks, w in 128 x 128 blocks, K-major as the kernel reads
    them (lhs [M, C] with scales [C/128, M], rhs [G, N, C] with scales [G, C/128, N/128])."""
    sizes = aligned_group_sizes(m, g)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, c), BF16)
    w = (jax.random.normal(kw, (g, c, n), BF16) * 0.02).astype(BF16)
    xq, wq = quantize_1x128(x), quantize_128x128(w)
    operands = (
        xq.data,
        jnp.swapaxes(xq.scale_inv, 0, 1),
        jnp.swapaxes(wq.data, 1, 2),
        wq.scale_inv,
        jnp.asarray(sizes, jnp.int32),
    )
    return sizes, x, w, operands


def wgrad_operands(m: int, k: int, n: int, g: int):
    """(sizes, x [M, K], dy [M, N], the wgrad kernel's operands) for M rows in G aligned
    groups: the copies along the tokens, transposed (tokens last) as the kernel reads them."""
    sizes = aligned_group_sizes(m, g)
    kx, kd = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), BF16)
    dy = jax.random.normal(kd, (m, n), BF16)
    xq, dq = quantize_1x128(x, 0), quantize_1x128(dy, 0)
    operands = (xq.data.T, xq.scale_inv, dq.data.T, dq.scale_inv, jnp.asarray(sizes, jnp.int32))
    return sizes, x, dy, operands


def replaced_tiling(heuristic, contraction: int, fields: dict):
    """The forward kernel's config `heuristic` with `fields` replaced, its ring then cut to the
    K steps of `contraction` and to the shared memory (`GmmConfig.with_fitting_stages`)."""
    config = dataclasses.replace(heuristic, **fields)
    steps = min(config.max_concurrent_steps, contraction // config.tile_k)
    return dataclasses.replace(config, max_concurrent_steps=steps).with_fitting_stages(
        jnp.float8_e4m3fn, BF16
    )


def bench_shape(shape: str, variants: dict, iters: int, repeats: int, records: list) -> None:
    """The fprop/dgrad kernel's tilings at one --shapes entry."""
    m, c, n, g = problem(shape)
    sizes, x, w, operands = fprop_operands(m, c, n, g)
    group_sizes = operands[-1]
    heuristic = default_fp8_blockwise_config(m, c, n, g, BF16)
    configs = {"heuristic": heuristic, "mxfp8_tiling": default_mxfp8_config(m, c, n, g, BF16)}
    for name, fields in variants.items():
        configs[name] = replaced_tiling(heuristic, c, fields)
    kernels = {}
    for name, config in configs.items():
        kernel = jax.jit(
            functools.partial(
                gmm_block_scaled_fp8_pallas, scale_block=BLOCK, out_dtype=BF16, config=config
            )
        )
        kernels[name] = (functools.partial(kernel, *operands), config)
    impl = "pallas" if jax.devices()[0].platform == "gpu" else "xla"
    bf16 = jax.jit(functools.partial(gmm, impl=impl, preferred_element_type=BF16))
    flops = 2.0 * float(sizes.sum()) * c * n
    compare_tilings(shape, kernels, lambda: bf16(x, w, group_sizes), flops, iters, repeats, records)


def bench_wgrad_shape(name: str, variants: dict, iters: int, repeats: int, records: list) -> None:
    """The weight-gradient kernel's tilings at one --wgrad-shapes entry."""
    m, k, n, g = SHAPES[name]
    sizes, x, dy, operands = wgrad_operands(m, k, n, g)
    group_sizes = operands[-1]
    heuristic = default_tgmm_config(k, n, BF16, rows_per_group=m // g)
    configs = {"heuristic": heuristic}
    for variant, fields in variants.items():
        configs[variant] = dataclasses.replace(heuristic, **fields).with_fitting_slots(BF16)
    kernels = {}
    for variant, config in configs.items():
        kernel = jax.jit(
            functools.partial(tgmm_fp8_blockwise_pallas, out_dtype=BF16, config=config)
        )
        kernels[variant] = (functools.partial(kernel, *operands), config)
    impl = "pallas" if jax.devices()[0].platform == "gpu" else "xla"
    bf16 = jax.jit(functools.partial(tgmm, impl=impl, preferred_element_type=BF16))
    flops = 2.0 * float(sizes.sum()) * k * n
    compare_tilings(
        f"{name}:wgrad", kernels, lambda: bf16(x, dy, group_sizes), flops, iters, repeats, records
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,dsv3_ep8,qwen3_30b,mixtral:dgrad")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--wgrad-shapes", default="mixtral,dsv3_ep8,qwen3_30b")
    parser.add_argument("--wgrad-variants", default=DEFAULT_WGRAD_VARIANTS)
    parser.add_argument("--iters", type=int, default=10, help="calls per device-time record")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the calls in turns")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    shapes = [entry for entry in args.shapes.split(",") if entry]
    wgrad_shapes = [entry for entry in args.wgrad_shapes.split(",") if entry]
    unknown = ({entry.partition(":")[0] for entry in shapes} | set(wgrad_shapes)) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    bad = sorted({e.partition(":")[2] for e in shapes} - set(PROBLEMS))
    if bad:
        parser.error(f"unknown problems {bad} after ':'; known: {[p for p in PROBLEMS if p]}")
    result = report.environment(
        "gmm_fp8_blockwise", command=" ".join(sys.argv if argv is None else argv), records=[]
    )
    path = report.result_path(args.out, "gmm_fp8_blockwise", args.tag)
    for shape in shapes:
        bench_shape(
            shape, parse_variants(args.variants), args.iters, args.repeats, result["records"]
        )
        report.write_result(result, path)
    for shape in wgrad_shapes:
        bench_wgrad_shape(
            shape, parse_variants(args.wgrad_variants), args.iters, args.repeats, result["records"]
        )
        report.write_result(result, path)
    result["path"] = path
    return result


if __name__ == "__main__":
    main()
