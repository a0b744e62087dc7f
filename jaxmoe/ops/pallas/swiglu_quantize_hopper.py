"""The experts' weighted SwiGLU forward for Hopper (Pallas Mosaic GPU) that writes the activation
only as the two FP8-blockwise copies fc2 reads, never the activation itself:

  weighted_swiglu_quantize_1x128_with_transpose_pallas
      h [M, 2F] = [gate; up], p [M] fp32  ->
      `quantize_1x128_with_transpose_pallas(a)`'s two copies of a = round(silu(gate) * up * p)
      [M, F] (blocks along F for fprop, a^T [F, M] in blocks along M for wgrad), from one read
      of h and p.

a is the forward kernel's (the same arithmetic, `activation_tiles.weighted_swiglu`, rounded to
h's dtype), quantized with `quantize_transpose_hopper`'s rules, so both copies are bitwise those
of the forward then the two-copy quantize. A tile is 128 rows by 256 columns of F, its halves the
two 128-column blocks, made in one pass on `copies_pipeline` (one CTA an SM, two warpgroups
streaming 16 rows of every 32-row part of gate's and up's two blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.ops.device import compiled_for_gpu
from jaxmoe.ops.pallas.activation_tiles import weighted_swiglu
from jaxmoe.ops.pallas.copies_pipeline import copies_kernel, copies_problem
from jaxmoe.ops.pallas.copies_pipeline import ring_slots as pipeline_ring_slots
from jaxmoe.ops.pallas.quantize_hopper import checked_arithmetic
from jaxmoe.ops.pallas.quantize_transpose_hopper import as_format
from jaxmoe.ops.pallas.row_pipeline import live_input

_WINDOWS = 4  # a part's gate and up, two blocks each


def swiglu_quantize_problem(h_shape, h_dtype, probs_shape) -> str | None:
    """Why `weighted_swiglu_quantize_1x128_with_transpose_pallas` cannot take h [M, 2F] and
    probs [M] (None: it can)."""
    if len(h_shape) != 2 or h_shape[1] % 2 or tuple(probs_shape) != tuple(h_shape[:1]):
        return (
            "weighted SwiGLU 1x128 transpose quantize kernel: needs h [M, 2F] and probs [M], "
            f"got {tuple(h_shape)}, {tuple(probs_shape)}"
        )
    return copies_problem("weighted SwiGLU 1x128 transpose", h_shape, h_dtype)


def weighted_swiglu_quantize_1x128_with_transpose_pallas(
    h: jax.Array,
    probs: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    slots: int | None = None,
    live_rows=None,
    interpret=None,
):
    """((data [M, F], scale_inv [M, F/128]), (data_t [F, M], scale_inv_t [F, M/128])):
    `quantize_1x128_with_transpose_pallas(a)`'s two copies of the weighted SwiGLU
    a = round(silu(gate) * up * p) (`jaxmoe.ops.activation.weighted_activation_forward`'s
    values), h = [gate; up] [M, 2F] bf16, probs [M] (used in fp32), M a multiple of 128 and F
    of 256. slots (each warpgroup's ring of 32-row parts, None: as many as fit, at most 3) says
    how it runs, never its bits. live_rows: an int32 scalar, or None: only the 128-row bands
    holding rows below it run, the rest of both copies left unwritten."""
    problem = swiglu_quantize_problem(h.shape, h.dtype, probs.shape)
    arithmetic = checked_arithmetic(problem, fmt, arithmetic, interpret)
    m, two_f = h.shape
    compiled = compiled_for_gpu(interpret)
    kernel = _kernel(
        m, two_f // 2, fmt, arithmetic, slots, live_rows is not None, compiled, interpret
    )
    p_row = probs.astype(jnp.float32)[None, :]
    data, scale_row, data_t, scale_column = kernel(h, p_row, *live_input(live_rows))
    return (data, scale_row.T), (as_format(data_t, fmt), scale_column.T)


def ring_slots(slots: int | None) -> int:
    """Input slots of each warpgroup's ring: `slots`, or as many as fit the CTA's shared memory
    beside its tiles (at most 3)."""
    return pipeline_ring_slots(slots, _WINDOWS)


@functools.cache
def _kernel(m, f, fmt_name, arithmetic, slots, counted, compiled, interpret):
    """Tile column kb: columns [kb * 256, + 256) of F, half j its j-th 128-column block."""

    def compute(windows, p):
        gate, up = windows[:2], windows[2:]
        return *(weighted_swiglu(gate[j], up[j], p) for j in range(2)), None

    def sources(kb):
        blocks = [kb * 2 * BLOCK + j * BLOCK for j in range(2)]
        return [(0, column) for column in blocks] + [(0, f + column) for column in blocks]

    return copies_kernel(
        "weighted_swiglu_quantize_1x128_transpose",
        m,
        column_tiles=f // (2 * BLOCK),
        width=f,
        inputs=1,  # h
        sources=sources,
        compute=compute,
        half_column=lambda half, kb: (2 * kb + half) * BLOCK,
        fmt_name=fmt_name,
        arithmetic=arithmetic,
        slots=slots,
        counted=counted,
        compiled=compiled,
        interpret=interpret,
    )
