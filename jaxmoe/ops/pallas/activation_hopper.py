"""The experts' weighted SwiGLU backward for Hopper (Pallas Mosaic GPU), in one pass over memory:
d h and the probability gradient's partial row sums from one read of h, the gradient and p.

For h [M, 2F] ([gate; up]), p [M] fp32 and g [M, F] (the gradient of
a = round(silu(gate) * up * p)):
  d_up   = round(g p silu(gate))
  d_gate = round(g p up s + (g p up gate) (s (1 - s)))     s = sigmoid(gate), as JAX's autodiff
  d_p    = sums over each row of g silu(gate) up, in `jaxmoe.ordered.row_sums_in_order`'s tree
Bandwidth-bound: tiles of ROWS rows by CHUNKS chunks of 32 columns of F stream through
`row_pipeline`, a chunk of each input one TMA; every array of a tile is a [ROWS, 32] chunk in
one register layout, so a thread holds the same row and lanes of every chunk. The tile's chunk
products are added in registers with the first log2(CHUNKS) levels of the row sums' tree
(adjacent chunks paired, as the tree pairs them) and stored as partials [M, F / CHUNKS] (each
row's [F / (32 CHUNKS), 32]; rows outermost, so that a TMA store of a ragged last row tile is
clipped at M: on the H200 a store into [F / (32 CHUNKS), M, 32] ran past M into the next
partial's first rows);
`jaxmoe.ops.activation` adds their remaining levels with `sum_in_order`: the same tree.
Given a live row count (`jaxmoe.ops.live_rows`), only the row tiles holding rows below it run.
docs/kernels.md describes the design."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    live_input,
    live_tiles,
    num_ctas,
    pipeline,
)

F32 = jnp.float32
# Tiling (read when a kernel is built; clear `_kernel`'s cache after changing them). A slot holds
# ~44 KB (h and g in, d h out, p and the partials); two slots, two CTAs an SM. Swept on the H200
# (2026-12-02): this beat 32 rows x 8 chunks in one CTA an SM by 1.3-1.45x and 4 chunks, 3-4
# slots or 8 rows by 10-15%.
ROWS = 16  # rows a tile: a [16, 32] chunk is one 4-element vector a thread
CHUNKS = 8  # 32-column chunks a tile: the row sums' first 3 tree levels in registers
STAGES = 2
CTAS_PER_SM = 2
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def swiglu_backward_problem(h_shape, h_dtype, g_shape, g_dtype) -> str | None:
    """Why `weighted_swiglu_backward_pallas` cannot take these operands (None: it can)."""
    if len(h_shape) != 2 or len(g_shape) != 2:
        return f"needs h [M, 2F] and g [M, F], got {tuple(h_shape)} and {tuple(g_shape)}"
    m, two_f = h_shape
    if jnp.dtype(h_dtype) not in _DTYPES or jnp.dtype(g_dtype) != jnp.dtype(h_dtype):
        return f"needs bf16 or fp16 h and g of one dtype, got {h_dtype} and {g_dtype}"
    if tuple(g_shape) != (m, two_f // 2) or two_f % 2:
        return f"needs h [M, 2F] and g [M, F], got {tuple(h_shape)} and {tuple(g_shape)}"
    if m == 0 or (two_f // 2) % (BLOCK_SIZE * CHUNKS):
        return f"needs M > 0 and F a multiple of {BLOCK_SIZE * CHUNKS}, got M={m}, F={two_f // 2}"
    return None


def weighted_swiglu_backward_pallas(h, probs, g, *, live_rows=None, interpret=None):
    """(d_h [M, 2F] in h.dtype, partial row sums [M, F / CHUNKS] fp32) of the weighted
    SwiGLU (module docstring); `swiglu_backward_problem` says what it takes. live_rows: an
    int32 scalar in [0, M], or None: rows at and past it are not written (unspecified)."""
    problem = swiglu_backward_problem(h.shape, h.dtype, g.shape, g.dtype)
    if problem or probs.shape != h.shape[:1]:
        raise ValueError(
            f"weighted SwiGLU backward kernel: {problem or f'p must be [M], got {probs.shape}'}"
        )
    m, two_f = h.shape
    kernel = _kernel(m, two_f // 2, jnp.dtype(h.dtype), live_rows is not None, interpret)
    # p spread over the 32 lanes of its row (M x 128 bytes), loaded as its chunk's layout.
    p = jnp.broadcast_to(probs.astype(F32)[:, None], (m, BLOCK_SIZE))
    return kernel(h, g, p, *live_input(live_rows))


def _push(stack, value):
    """Add `value` to the pairwise tree held in `stack` (level, sum): equal levels merge."""
    stack.append((0, value))
    while len(stack) >= 2 and stack[-1][0] == stack[-2][0]:
        (level, right), (_, left) = stack.pop(), stack.pop()
        stack.append((level + 1, left + right))


@functools.cache
def _kernel(m, f, dtype, counted, interpret):
    chunk_tiles = f // (BLOCK_SIZE * CHUNKS)
    num_tiles = cdiv(m, ROWS) * chunk_tiles
    ctas = num_ctas(num_tiles, per_sm=CTAS_PER_SM)
    layout = plgpu.Layout.WG_STRIDED((ROWS, BLOCK_SIZE), vec_size=ROWS * BLOCK_SIZE // 128)

    def place(t):
        """(rows, first column of F, chunk tile) of tile t; tiles walk a row band's chunks."""
        rows = pl.ds((t // chunk_tiles) * ROWS, ROWS)
        chunk_tile = lax.rem(t, chunk_tiles)
        return rows, chunk_tile * (BLOCK_SIZE * CHUNKS), chunk_tile

    def body(h_gmem, g_gmem, p_gmem, *refs):
        live_gmem, refs = (refs[0], refs[1:]) if counted else (None, refs)
        dh_gmem, part_gmem, in_smem, p_smem, out_smem, part_smem, loaded = refs

        def fetch(t):
            rows, col0, _ = place(t)
            sources = ((h_gmem, 0), (h_gmem, f), (g_gmem, 0))  # gate, up, gradient

            def issue(slot, barrier):
                for q in range(CHUNKS):
                    for a, (src, offset) in enumerate(sources):
                        column = pl.ds(offset + col0 + q * BLOCK_SIZE, BLOCK_SIZE)
                        plgpu.copy_gmem_to_smem(
                            src.at[rows, column], in_smem.at[slot, a, q], barrier
                        )
                plgpu.copy_gmem_to_smem(p_gmem.at[rows], p_smem.at[slot], barrier)

            return issue

        def compute(slot):
            p = plgpu.load(p_smem.at[slot], layout=layout)
            stack = []
            for q in range(CHUNKS):
                gate, up, g = (
                    plgpu.load(in_smem.at[slot, a, q], layout=layout).astype(F32) for a in range(3)
                )
                s = jax.nn.sigmoid(gate)
                act = gate * s
                ct = g * p
                d_act = ct * up
                d_gate = d_act * s + (d_act * gate) * (s * (1.0 - s))
                out_smem.at[slot, 0, q][...] = d_gate.astype(dtype)
                out_smem.at[slot, 1, q][...] = (ct * act).astype(dtype)
                _push(stack, g * (act * up))
            [(_, total)] = stack
            part_smem.at[slot][...] = total

        def store(t, slot):
            rows, col0, chunk_tile = place(t)
            for q in range(CHUNKS):
                for a, offset in ((0, 0), (1, f)):
                    column = pl.ds(offset + col0 + q * BLOCK_SIZE, BLOCK_SIZE)
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[slot, a, q], dh_gmem.at[rows, column], commit_group=False
                    )
            plgpu.copy_smem_to_gmem(
                part_smem.at[slot],
                part_gmem.at[rows, pl.ds(chunk_tile * BLOCK_SIZE, BLOCK_SIZE)],
                commit_group=False,
            )

        # Counted: the row tiles holding rows [0, live_rows).
        tiles = live_tiles(live_gmem, m, ROWS, chunk_tiles) if counted else num_tiles
        pipeline(tiles, ctas, loaded, fetch, compute, store, stages=STAGES)

    return plgpu.kernel(
        body,
        kernel_name="weighted_swiglu_backward",
        out_type=(
            jax.ShapeDtypeStruct((m, 2 * f), dtype),
            jax.ShapeDtypeStruct((m, chunk_tiles * BLOCK_SIZE), F32),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, 3, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, ROWS, BLOCK_SIZE), F32),
            plgpu.SMEM((STAGES, 2, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, ROWS, BLOCK_SIZE), F32),
            plgpu.Barrier(num_arrivals=3 * CHUNKS + 1, num_barriers=STAGES),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
