"""The experts' weighted SwiGLU backward for Hopper (Pallas Mosaic GPU), in one pass over memory:
d h and the probability gradient's partial row sums from one read of h, the gradient and p.

For h [M, 2F] ([gate; up]), p [M] fp32 and g [M, F] (the gradient of
a = round(silu(gate) * up * p)):
  d_up   = round(g p silu(gate))
  d_gate = round(g p up s + (g p up gate) (s (1 - s)))     s = sigmoid(gate), as JAX's autodiff
  d_p    = sums over each row of g silu(gate) up, in `jaxmoe.ordered.row_sums_in_order`'s tree
Bandwidth-bound: `activation_tiles`' tiles (ROWS rows by CHUNKS chunks of 32 columns of F, a
chunk of each input one TMA, one register layout) stream through `row_pipeline`. The tile's chunk
products are added in registers with the first log2(CHUNKS) levels of the row sums' tree
(adjacent chunks paired, as the tree pairs them) and stored as partials [M, F / CHUNKS] (each
row's [F / (32 CHUNKS), 32]; rows outermost, so that a TMA store of a ragged last row tile is
clipped at M: on the H200 a store into [F / (32 CHUNKS), M, 32] ran past M into the next
partial's first rows);
`jaxmoe.ops.activation` adds their remaining levels with `sum_in_order`: the same tree.
Given a live row count (`jaxmoe.ops.live_rows`), only the row tiles holding rows below it run.
docs/kernels/activation.md describes the design."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.device import compiled_for_gpu
from jaxmoe.ops.pallas.activation_tiles import (
    CHUNKS,
    ROWS,
    ChunkTiles,
    layout,
    loads_per_tile,
    spread_rows,
    swiglu_problem,
    weighted_swiglu_backward,
)
from jaxmoe.ops.pallas.row_pipeline import COMPILER_PARAMS, live_input, num_ctas, pipeline

F32 = jnp.float32
# Tiling (read when a kernel is built; clear `_kernel`'s cache after changing them). A slot holds
# ~44 KB (h and g in, d h out, p and the partials); two slots, two CTAs an SM: with
# `activation_tiles`' 16 rows x 8 chunks the fastest of a sweep over rows, chunks, slots and CTAs.
STAGES = 2
CTAS_PER_SM = 2


def swiglu_backward_problem(h_shape, h_dtype, g_shape, g_dtype) -> str | None:
    """Why `weighted_swiglu_backward_pallas` cannot take these operands (None: it can)."""
    problem = swiglu_problem(h_shape, h_dtype)
    if problem:
        return problem
    if jnp.dtype(g_dtype) != jnp.dtype(h_dtype):
        return f"needs h and g of one dtype, got {h_dtype} and {g_dtype}"
    if tuple(g_shape) != (h_shape[0], h_shape[1] // 2):
        return f"needs h [M, 2F] and g [M, F], got {tuple(h_shape)} and {tuple(g_shape)}"
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
    counted = live_rows is not None
    kernel = _kernel(
        m, two_f // 2, jnp.dtype(h.dtype), counted, compiled_for_gpu(interpret), interpret
    )
    return kernel(h, g, spread_rows(probs), *live_input(live_rows))


def _push(stack, value):
    """Add `value` to the pairwise tree held in `stack` (level, sum): equal levels merge."""
    stack.append((0, value))
    while len(stack) >= 2 and stack[-1][0] == stack[-2][0]:
        (level, right), (_, left) = stack.pop(), stack.pop()
        stack.append((level + 1, left + right))


@functools.cache
def _kernel(m, f, dtype, counted, compiled, interpret):
    tiles = ChunkTiles(m, f)
    ctas = num_ctas(tiles.num_tiles, per_sm=CTAS_PER_SM)
    chunk_layout = layout()
    barrier_layout = chunk_layout if compiled else None

    def body(h_gmem, g_gmem, p_gmem, *refs):
        live_gmem, refs = (refs[0], refs[1:]) if counted else (None, refs)
        dh_gmem, part_gmem, in_smem, p_smem, out_smem, part_smem, loaded = refs
        sources = ((h_gmem, 0), (h_gmem, f), (g_gmem, 0))  # gate, up, gradient
        fetch = tiles.fetch(sources, in_smem, p_gmem, p_smem)

        def compute(slot):
            p = plgpu.load(p_smem.at[slot], layout=chunk_layout)
            stack = []
            for q in range(CHUNKS):
                gate, up, g = (
                    plgpu.load(in_smem.at[slot, a, q], layout=chunk_layout).astype(F32)
                    for a in range(3)
                )
                d_gate, d_up, product = weighted_swiglu_backward(gate, up, g, p, barrier_layout)
                out_smem.at[slot, 0, q][...] = d_gate.astype(dtype)
                out_smem.at[slot, 1, q][...] = d_up.astype(dtype)
                _push(stack, product)
            [(_, total)] = stack
            part_smem.at[slot][...] = total

        def store(t, slot):
            chunk_tile = tiles.store_chunks(t, slot, ((dh_gmem, 0), (dh_gmem, f)), out_smem)
            plgpu.copy_smem_to_gmem(
                part_smem.at[slot],
                part_gmem.at[tiles.place(t)[0], pl.ds(chunk_tile * BLOCK_SIZE, BLOCK_SIZE)],
                commit_group=False,
            )

        pipeline(tiles.count(live_gmem), ctas, loaded, fetch, compute, store, stages=STAGES)

    return plgpu.kernel(
        body,
        kernel_name="weighted_swiglu_backward",
        out_type=(
            jax.ShapeDtypeStruct((m, 2 * f), dtype),
            jax.ShapeDtypeStruct((m, tiles.chunk_tiles * BLOCK_SIZE), F32),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, 3, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, ROWS, BLOCK_SIZE), F32),
            plgpu.SMEM((STAGES, 2, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, ROWS, BLOCK_SIZE), F32),
            plgpu.Barrier(num_arrivals=loads_per_tile(3), num_barriers=STAGES),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
