"""The experts' weighted activation on one GPU: its backward pass (d h and the probability
gradient, the row sums of `jaxmoe.ordered`) with the row sums laid out in several ways, next to
its forward and a copy of h, at the real layer sizes.

    python -m benchmarks.research.activation [--shapes qwen3_30b,...] [--variants REGEX]
        [--turns N] [--tag TAG] [--out DIR]

For each `jaxmoe.shapes` layer (M = tokens x top_k rows, F = ffn_hidden_size; random h [M, 2F]
bf16, incoming gradient [M, F] bf16, probabilities [M] fp32):
  lanesL_levelsV  the backward of `jaxmoe.experts.weighted_activation` (impl "xla") with
                  `row_sums_in_order` summing L interleaved lanes and materialising its partial
                  sums after every V tree levels (`ordered.LANES`, `ordered.LEVELS_PER_PASS`;
                  lanes 32 keeps the layer's bits whatever V is, other lane counts change the
                  probability gradient's order, recorded as `same_bits` against the first)
  kernel          `jaxmoe.ops.weighted_activation_backward(impl="pallas")`: the one-pass
                  Hopper kernel (silu GLU shapes; the CPU runs it interpreted), recorded with
                  how far it is from the first layout (`d_h_equal_fraction`, `d_p_max_rel`)
  forward_xla     the forward (act(gate) * up * p, rounded once), XLA's elementwise fusion
  forward_kernel  `jaxmoe.ops.weighted_activation_forward(impl="pallas")` (silu GLU shapes),
                  recorded with the fraction of its outputs bitwise XLA's (`a_equal_fraction`)
  forward_kernel_live_eighth  the kernel given a live row count of M / 8 (an expert-parallel
                  receiver's buffer at ep = 8 holds about that many live rows)
  quantized_two_passes  fc2's two FP8-blockwise copies of a as the layer made them before the
                  fused kernel: XLA's forward, then `quantize_1x128_with_transpose` (its kernel)
  quantized_fused[_VARIANT]  the same copies from h in one pass
                  (`weighted_activation_quantize_1x128_with_transpose(impl="pallas")`, and the
                  kernel in each of FUSED_VARIANTS' configurations), recorded with whether its
                  four outputs are the two passes' bits (`same_bits`)
  backward_quantized_two_passes  fc1's two FP8-blockwise copies of d h (and d p) as the layer
                  made them before the fused kernel: the backward's kernel, then
                  `quantize_1x128_with_transpose` (its kernel)
  backward_quantized_fused[_VARIANT]  the same from h and the gradient in one pass
                  (`weighted_activation_backward_quantize_1x128_with_transpose(impl="pallas")`,
                  and the kernel in each of FUSED_VARIANTS' configurations: its copies),
                  recorded with whether its outputs are the two passes' bits (`same_bits`)
  copy_h          h * 2: the memory bandwidth on the same bytes
--variants: only the variants whose names match REGEX (a variant compared with a reference
that is left out records `same_bits` null). Device time per call from the JAX profiler
(`benchmarks.timing.device_seconds`; on a CPU the wall time of one call, a smoke test only),
measured --turns times (default 1) in turns over the variants on the same data: `us` the
median, `us_turns` each. Writes activation_<date>[_tag].json to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

from benchmarks import report
from benchmarks.report import add_output_arguments, log
from benchmarks.timing import device_seconds
from jaxmoe import ordered
from jaxmoe.experts import weighted_activation
from jaxmoe.ops import (
    quantize_1x128_with_transpose,
    weighted_activation_backward,
    weighted_activation_backward_quantize_1x128_with_transpose,
    weighted_activation_forward,
    weighted_activation_quantize_1x128_with_transpose,
)
from jaxmoe.ops.pallas.swiglu_backward_quantize_hopper import (
    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.ops.pallas.swiglu_quantize_hopper import (
    weighted_swiglu_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.shapes import SHAPES

LAYOUTS = [(32, 3), (32, 4), (32, 5), (32, 6), (16, 4), (64, 3), (64, 4), (128, 3)]
CPU_ROWS, CPU_MAX_FFN = 128, 512  # smoke sizes on a CPU
# The fused kernels' ring sizes beside their default (`copies_pipeline`: three 32-row slots a
# warpgroup): two slots, the nearest (docs/notes/2026-12-07-kernel-experiments.md has the others).
FUSED_VARIANTS = {"two_slots": dict(slots=2)}


@contextlib.contextmanager
def row_sum_layout(lanes: int, levels: int):
    """`row_sums_in_order` with `lanes` lanes and `levels` levels a pass while tracing."""
    saved = ordered.LANES, ordered.LEVELS_PER_PASS
    ordered.LANES, ordered.LEVELS_PER_PASS = lanes, levels
    try:
        yield
    finally:
        ordered.LANES, ordered.LEVELS_PER_PASS = saved


def programs(config, rows: int) -> dict:
    """name -> jitted fn(h, p, g) of every variant, for h of `rows` rows."""

    def backward(lanes, levels):
        def fn(h, p, g):
            with row_sum_layout(lanes, levels):
                _, pull = jax.vjp(lambda h, p: weighted_activation(h, p, config, "xla"), h, p)
                return pull(g)

        return jax.jit(fn)

    fns = {f"lanes{lanes}_levels{levels}": backward(lanes, levels) for lanes, levels in LAYOUTS}
    swiglu = config.activation == "silu" and config.gated_linear_unit
    if swiglu:
        fns["kernel"] = jax.jit(
            lambda h, p, g: weighted_activation_backward(h, p, g, "silu", True, impl="pallas")
        )
    forward = lambda impl, live=None: jax.jit(  # noqa: E731
        lambda h, p, g: weighted_activation_forward(
            h, p, config.activation, config.gated_linear_unit, live_rows=live, impl=impl
        )
    )
    fns["forward_xla"] = forward("xla")
    if swiglu:
        fns["forward_kernel"] = forward("pallas")
        fns["forward_kernel_live_eighth"] = forward("pallas", jnp.int32(rows // 8))
    if swiglu:
        fns["quantized_two_passes"] = jax.jit(
            lambda h, p, g: quantize_1x128_with_transpose(
                weighted_activation_forward(h, p, "silu", True, impl="xla"), impl="pallas"
            )
        )
        fns["quantized_fused"] = jax.jit(
            lambda h, p, g: weighted_activation_quantize_1x128_with_transpose(
                h, p, "silu", True, impl="pallas"
            )
        )
        fns["backward_quantized_two_passes"] = jax.jit(
            lambda h, p, g: two_copies_of_backward(h, p, g)
        )
        fns["backward_quantized_fused"] = jax.jit(
            lambda h, p, g: weighted_activation_backward_quantize_1x128_with_transpose(
                h, p, g, "silu", True, impl="pallas"
            )
        )
        for name, options in FUSED_VARIANTS.items():
            fns[f"quantized_fused_{name}"] = jax.jit(
                lambda h, p, g, o=options: weighted_swiglu_quantize_1x128_with_transpose_pallas(
                    h, p, **o
                )
            )
            fns[f"backward_quantized_fused_{name}"] = jax.jit(
                lambda h, p, g, o=options: (
                    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas(h, p, g, **o)[0]
                )
            )
    fns["copy_h"] = jax.jit(lambda h, p, g: h * 2)
    return fns


def two_copies_of_backward(h, p, g):
    """fc1's two FP8-blockwise copies of d h and d p as the layer made them before the fused
    kernel: the backward's kernel, then `quantize_1x128_with_transpose` (its kernel)."""
    d_h, d_p = weighted_activation_backward(h, p, g, "silu", True, impl="pallas")
    return (*quantize_1x128_with_transpose(d_h, impl="pallas"), d_p)


def seconds(fn, args) -> float:
    """Device seconds per call on a GPU; one call's wall seconds elsewhere."""
    if jax.devices()[0].platform == "gpu":
        return device_seconds(lambda: fn(*args), iters=10)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def same_bits(arrays, references) -> bool:
    """Whether each array has its reference's dtype, shape and bits."""
    as_bits = lambda x: jax.lax.bitcast_convert_type(  # noqa: E731
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    )
    return all(
        a.dtype == b.dtype and bool(jnp.array_equal(as_bits(a), as_bits(b)))
        for a, b in zip(arrays, references, strict=True)
    )


def bench_shape(name: str, variants: str = "", turns: int = 1) -> dict:
    """The record of one layer shape: the variants whose names match the regex `variants`,
    checked, then timed `turns` times in turns."""
    config = SHAPES[name].config
    rows, ffn = SHAPES[name].num_tokens * config.top_k, config.ffn_hidden_size
    if jax.devices()[0].platform != "gpu":
        rows, ffn = CPU_ROWS, min(ffn, CPU_MAX_FFN)
    key_h, key_g, key_p = jax.random.split(jax.random.key(0), 3)
    args = (
        jax.random.normal(key_h, (rows, 2 * ffn), jnp.bfloat16),
        jax.random.uniform(key_p, (rows,), jnp.float32),
        jax.random.normal(key_g, (rows, ffn), jnp.bfloat16),
    )
    fns = {v: fn for v, fn in programs(config, rows).items() if re.search(variants, v)}
    record = {"rows": rows, "ffn": ffn, "variants": {}}
    references: dict = {}
    for variant, fn in fns.items():
        out = jax.block_until_ready(fn(*args))
        record["variants"][variant] = check(variant, out, references)
    for _ in range(turns):
        for variant, fn in fns.items():
            record["variants"][variant].setdefault("us_turns", []).append(seconds(fn, args) * 1e6)
    for variant, entry in record["variants"].items():
        entry["us"] = statistics.median(entry["us_turns"])
        log(f"{name} {variant}: {entry}")
    # One pass for the backward: read h and the gradient, write d h (bf16).
    record["one_pass_bytes"] = rows * 5 * ffn * 2
    # The fused forward-and-quantize: read h, write both fp8 copies (scales aside).
    record["quantized_fused_bytes"] = rows * ffn * (2 * 2 + 2)
    # The fused backward-and-quantize: read h and the gradient, write d h's two fp8 copies.
    record["backward_quantized_fused_bytes"] = rows * ffn * (2 * 2 + 2 + 2 * 2)
    return record


def check(variant: str, out, references: dict) -> dict:
    """A variant's checks against the reference variants run before it (`references`: name ->
    outputs, which a reference variant's outputs join)."""
    entry: dict = {}
    leaves = jax.tree.leaves(out)

    def compare(reference: str, count=None):
        want = references.get(reference)
        return None if want is None else same_bits(leaves, want[:count])

    if variant.startswith("lanes"):
        references.setdefault("lanes", out)
        entry["same_bits"] = all(
            bool(jnp.array_equal(a, b)) for a, b in zip(out, references["lanes"], strict=True)
        )
    elif variant in ("forward_xla", "quantized_two_passes", "backward_quantized_two_passes"):
        references[variant] = leaves
    elif variant == "forward_kernel" and "forward_xla" in references:
        entry["a_equal_fraction"] = float(jnp.mean(out == references["forward_xla"][0]))
    elif variant.startswith("quantized_fused"):
        entry["same_bits"] = compare("quantized_two_passes")
    elif variant == "backward_quantized_fused":
        entry["same_bits"] = compare("backward_quantized_two_passes")
    elif variant.startswith("backward_quantized_fused_"):  # the kernel's copies, not d p
        entry["same_bits"] = compare("backward_quantized_two_passes", len(leaves))
    elif variant == "kernel" and "lanes" in references:
        reference = references["lanes"]
        entry["d_h_equal_fraction"] = float(jnp.mean(out[0] == reference[0]))
        relative = jnp.abs(out[1] - reference[1]) / jnp.maximum(jnp.abs(reference[1]), 1e-30)
        entry["d_p_max_rel"] = float(jnp.max(relative))
    return entry


def main(argv=None):
    """Parse the command line (`argv`: None for sys.argv) and benchmark every shape in turn,
    writing the JSON after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default="", help="only the variants matching this regex")
    parser.add_argument("--turns", type=int, default=1, help="timings of each variant, in turns")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    result = report.environment("activation", layouts=LAYOUTS, shapes={})
    path = report.result_path(args.out, "activation", args.tag)
    for name in [s for s in args.shapes.split(",") if s]:
        result["shapes"][name] = bench_shape(name, args.variants, args.turns)
        report.write_result(result, path)
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
