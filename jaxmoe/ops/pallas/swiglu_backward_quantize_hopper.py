"""The experts' weighted SwiGLU backward for Hopper (Pallas Mosaic GPU) that writes d h as the two
FP8-blockwise copies fc1's backward GEMMs read, never d h itself:

  weighted_swiglu_backward_quantize_1x128_with_transpose_pallas
      h [M, 2F] = [gate; up], p [M] fp32, g [M, F]  ->
      `quantize_1x128_with_transpose_pallas(d h)`'s two copies of d h [M, 2F] (blocks along 2F
      for dgrad, d h^T [2F, M] in blocks along M for wgrad) and the probability gradient's
      partial row sums [M, F/4], from one read of h, g and p.

d h is `activation_backward_hopper`'s (the same arithmetic, `activation_tiles.
weighted_swiglu_backward`, rounded to h's dtype), quantized with `quantize_transpose_hopper`'s
rules, so both copies are bitwise those of the two kernels in turn. The partial sums are the
first two levels of `jaxmoe.ordered.row_sums_in_order`'s tree (the row's four 32-column chunks
of a 128-column block, paired as that tree pairs them); the op adds the rest.

A tile is 128 rows by 128 columns of F, whose halves are d gate's and d up's columns, made in one
pass on `copies_pipeline` (one CTA an SM, two warpgroups streaming 16 rows of every 32-row part
of gate, up and g): d gate and d up are computed once, the partial sums staged beside the
rowwise copies. In the pipeline's register layout a thread holds the same 4 columns of each
32-column chunk of its row, so the partial sums' chunk pairs are register adds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.device import compiled_for_gpu
from jaxmoe.ops.pallas.activation_tiles import weighted_swiglu_backward
from jaxmoe.ops.pallas.copies_pipeline import LAYOUT, copies_kernel, copies_problem
from jaxmoe.ops.pallas.copies_pipeline import ring_slots as pipeline_ring_slots
from jaxmoe.ops.pallas.quantize_hopper import checked_arithmetic
from jaxmoe.ops.pallas.quantize_transpose_hopper import as_format
from jaxmoe.ops.pallas.row_pipeline import live_input

F32 = jnp.float32
_WINDOWS = 3  # a part's gate, up and g


def swiglu_backward_quantize_problem(h_shape, h_dtype, probs_shape, g_shape, g_dtype):
    """Why `weighted_swiglu_backward_quantize_1x128_with_transpose_pallas` cannot take h [M, 2F],
    probs [M] and g [M, F] (None: it can)."""
    if (
        len(h_shape) != 2
        or h_shape[1] % 2
        or tuple(probs_shape) != tuple(h_shape[:1])
        or tuple(g_shape) != (h_shape[0], h_shape[1] // 2)
        or jnp.dtype(g_dtype) != jnp.dtype(h_dtype)
    ):
        return (
            "weighted SwiGLU backward 1x128 transpose quantize kernel: needs h [M, 2F], probs "
            f"[M] and g [M, F] of h's dtype, got {tuple(h_shape)}, {tuple(probs_shape)}, "
            f"{tuple(g_shape)} {jnp.dtype(g_dtype).name}"
        )
    return copies_problem("weighted SwiGLU backward 1x128 transpose", h_shape, h_dtype)


def weighted_swiglu_backward_quantize_1x128_with_transpose_pallas(
    h: jax.Array,
    probs: jax.Array,
    g: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    slots: int | None = None,
    live_rows=None,
    interpret=None,
):
    """(((data [M, 2F], scale_inv [M, 2F/128]), (data_t [2F, M], scale_inv_t [2F, M/128])),
    partials [M, F/4] fp32) for the weighted SwiGLU a = round(silu(gate) * up * p), h = [gate;
    up] [M, 2F] bf16, probs [M] (used in fp32), g [M, F] bf16 (a's gradient), M a multiple of
    128 and F of 256: `quantize_1x128_with_transpose_pallas(d h)` of `weighted_swiglu_backward_pallas`'s
    d h, and for each row and 128-column block of F the 32 lane sums
    ((c0 + c1) + (c2 + c3)) of its four 32-column chunks c of g * silu(gate) * up (module
    docstring). slots (each warpgroup's ring of 32-row parts, None: as many as fit, at most 3)
    says how it runs, never its bits. live_rows: an int32 scalar, or None: only the 128-row bands
    holding rows below it run, the rest of every output left unwritten."""
    problem = swiglu_backward_quantize_problem(h.shape, h.dtype, probs.shape, g.shape, g.dtype)
    arithmetic = checked_arithmetic(problem, fmt, arithmetic, interpret)
    m, two_f = h.shape
    counted = live_rows is not None
    compiled = compiled_for_gpu(interpret)
    kernel = _kernel(m, two_f // 2, fmt, arithmetic, slots, counted, compiled, interpret)
    p_row = probs.astype(F32)[None, :]
    data, scale_row, data_t, scale_column, partials = kernel(h, g, p_row, *live_input(live_rows))
    return ((data, scale_row.T), (as_format(data_t, fmt), scale_column.T)), partials


def ring_slots(slots: int | None) -> int:
    """Input slots of each warpgroup's ring: `slots`, or as many as fit the CTA's shared memory
    beside its tiles (at most 3)."""
    return pipeline_ring_slots(slots, _WINDOWS, BLOCK_SIZE)


@functools.cache
def _kernel(m, f, fmt_name, arithmetic, slots, counted, compiled, interpret):
    """Tile column kb: columns [kb * 128, + 128) of F, half 0 in d gate's columns of d h, half
    1 in d up's."""
    layout = LAYOUT if compiled else None

    def compute(windows, p):
        gate, up, g = windows
        d_gate, d_up, product = weighted_swiglu_backward(gate, up, g, p, layout)
        return d_gate, d_up, _first_tree_levels(product)

    return copies_kernel(
        "weighted_swiglu_backward_quantize_1x128_transpose",
        m,
        column_tiles=f // BLOCK,
        width=2 * f,
        inputs=2,  # h, g
        sources=lambda kb: [(0, kb * BLOCK), (0, f + kb * BLOCK), (1, kb * BLOCK)],
        compute=compute,
        half_column=lambda half, kb: half * f + kb * BLOCK,
        fmt_name=fmt_name,
        arithmetic=arithmetic,
        slots=slots,
        counted=counted,
        compiled=compiled,
        interpret=interpret,
        extra_columns=BLOCK_SIZE,
    )


def _first_tree_levels(product):
    """((c0 + c1) + (c2 + c3)) of the four 32-column chunks c of a [rows, 128] array: the
    first two levels of `row_sums_in_order`'s tree (its chunks are registers of one thread)."""
    chunk = lambda c: product[:, c * BLOCK_SIZE : (c + 1) * BLOCK_SIZE]  # noqa: E731
    return (chunk(0) + chunk(1)) + (chunk(2) + chunk(3))
