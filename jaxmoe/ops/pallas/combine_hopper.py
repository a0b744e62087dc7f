"""The combine for Hopper (Pallas Mosaic GPU): y[t] = round(sum over j of f32
rows[token_rows[t, j]]), the k rows of token t added in fp32 in the order j = 0, 1, ..., k-1
and rounded once; a slot whose row is M (dropped, or no row) adds +0.0. Bitwise equal to that
sum in XLA (the reference of `jaxmoe.ops.permute.combine_rows`). Bandwidth-bound: tiles of
token rows stream through `row_pipeline`. docs/kernels/permute.md describes the design."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.hopper import MAX_TMA_BOX, TMA_SMEM_ALIGN, WARPGROUP_THREADS
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    SMEM_PER_CTA,
    STAGES,
    TILE_BYTES,
    num_ctas,
    pipeline,
)

F32 = jnp.float32
_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


class CombinePlan(NamedTuple):
    """A combine tile: `tokens` consecutive tokens x `segment` 32-element blocks of each (the
    whole row when tokens > 1), summed in register accesses of `vector` elements."""

    tokens: int
    segment: int
    vector: int


def combine_plan(h: int, k: int, dtype, out_dtype) -> CombinePlan | None:
    """The tile for tokens of H elements and k slots, or None when none fits. A slot's piece of
    a token (`segment` blocks, dividing H / 32) is a multiple of 128 bytes (a TMA); a tile holds
    a multiple of 128 elements (one or more per thread), at most 256 blocks (a TMA box): short
    rows are grouped `tokens` to a tile. The largest tile with k pieces within TILE_BYTES wins
    (else the smallest, when STAGES of them fit SMEM); `vector` is the most elements per thread
    access that divide the tile evenly (16 bytes at most)."""
    itemsize = jnp.dtype(dtype).itemsize
    if h % BLOCK_SIZE:
        return None
    row_blocks = h // BLOCK_SIZE
    plans = []
    for segment in range(1, min(row_blocks, MAX_TMA_BOX) + 1):
        if row_blocks % segment or segment * BLOCK_SIZE * itemsize % TMA_SMEM_ALIGN:
            continue
        for tokens in (1, 2, 4) if segment == row_blocks else (1,):
            blocks = tokens * segment
            if blocks * BLOCK_SIZE % WARPGROUP_THREADS == 0 and blocks <= MAX_TMA_BOX:
                plans.append((tokens, segment))
                break
    if not plans:
        return None
    size = lambda plan: plan[0] * plan[1]
    within = [p for p in plans if k * size(p) * BLOCK_SIZE * itemsize <= TILE_BYTES]
    tokens, segment = max(within, key=size) if within else min(plans, key=size)
    blocks = tokens * segment
    out_itemsize = jnp.dtype(out_dtype).itemsize
    if STAGES * blocks * BLOCK_SIZE * (k * itemsize + out_itemsize) > SMEM_PER_CTA - 1024:
        return None
    vector = max(
        v
        for v in (1, 2, 4, 8)
        if v * itemsize <= 16 and blocks * BLOCK_SIZE % (WARPGROUP_THREADS * v) == 0
    )
    return CombinePlan(tokens, segment, vector)


def combine_problem(rows_shape, dtype, token_rows_shape, out_dtype) -> str | None:
    """Why `combine_pallas` cannot combine these shapes / dtypes (None: it can)."""
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
    if len(rows_shape) != 2 or dtype not in _DTYPES or out_dtype not in _DTYPES:
        return (
            f"combine kernel: needs 2-D bf16/fp16/fp32 rows and output, got rows "
            f"{tuple(rows_shape)} {dtype.name} -> {out_dtype.name}"
        )
    if len(token_rows_shape) != 2 or 0 in token_rows_shape or 0 in rows_shape:
        return (
            f"combine kernel: needs a non-empty [T, k] token_rows and [M, H] rows, got "
            f"{tuple(token_rows_shape)} and {tuple(rows_shape)}"
        )
    if combine_plan(rows_shape[1], token_rows_shape[1], dtype, out_dtype) is None:
        return (
            f"combine kernel: no tile fits H = {rows_shape[1]}, k = {token_rows_shape[1]} "
            f"at {dtype.name} (H must be a multiple of 32 elements and of 128 bytes, "
            f"and STAGES tiles of k pieces must fit SMEM)"
        )
    return None


def combine_pallas(
    rows: jax.Array, token_rows: jax.Array, out_dtype=None, *, interpret=None
) -> jax.Array:
    """y [T, H] in out_dtype (default rows.dtype): y[t] = round(f32 rows[token_rows[t, 0]] +
    ... + f32 rows[token_rows[t, k-1]]), left to right, where a slot with token_rows[t, j] == M
    adds +0.0. rows: [M, H]; token_rows: [T, k] int32 in [0, M]."""
    out_dtype = jnp.dtype(out_dtype or rows.dtype)
    problem = combine_problem(rows.shape, rows.dtype, token_rows.shape, out_dtype)
    if problem:
        raise ValueError(problem)
    num_rows, h = rows.shape
    num_tokens, k = token_rows.shape
    kernel = _combine_kernel(
        num_rows, num_tokens, k, h // BLOCK_SIZE, jnp.dtype(rows.dtype), out_dtype, interpret
    )
    out = kernel(token_rows.astype(jnp.int32), rows.reshape(num_rows * h // BLOCK_SIZE, BLOCK_SIZE))
    return out.reshape(num_tokens, h)


@functools.cache
def _combine_kernel(num_rows, num_tokens, k, row_blocks, dtype, out_dtype, interpret):
    tokens, segment, vector = combine_plan(row_blocks * BLOCK_SIZE, k, dtype, out_dtype)
    parts = row_blocks // segment  # tiles per token (1 when tokens > 1)
    blocks = tokens * segment  # output blocks per tile
    num_tiles = cdiv(num_tokens * parts, tokens)
    ctas = num_ctas(num_tiles)
    layout = plgpu.Layout.WG_STRIDED((blocks, BLOCK_SIZE), vec_size=vector)

    def combine(token_rows_gmem, rows_gmem, out_gmem, x_smem, out_smem, loaded):
        def fetch(t):
            sources = []
            for i in range(tokens):
                # Tokens past the end (a partial last tile) load real rows; their sums are
                # dropped by the clipped store.
                token = jnp.minimum((t * tokens + i) // parts, num_tokens - 1)
                offset = lax.rem(t * tokens + i, parts) * segment
                sources.append([token_rows_gmem[token, j] * row_blocks + offset for j in range(k)])

            def issue(slot, barrier):
                for i, token_sources in enumerate(sources):
                    for j, source in enumerate(token_sources):
                        plgpu.copy_gmem_to_smem(
                            rows_gmem.at[pl.ds(source, segment)],
                            x_smem.at[slot, j, pl.ds(i * segment, segment)],
                            barrier,
                        )

            return issue

        def compute(slot):
            total = plgpu.load(x_smem.at[slot, 0], layout=layout).astype(F32)
            for j in range(1, k):
                total = total + plgpu.load(x_smem.at[slot, j], layout=layout).astype(F32)
            out_smem.at[slot][...] = total.astype(out_dtype)

        def store(t, slot):
            plgpu.copy_smem_to_gmem(
                out_smem.at[slot], out_gmem.at[pl.ds(t * blocks, blocks)], commit_group=False
            )

        pipeline(num_tiles, ctas, loaded, fetch, compute, store)

    return plgpu.kernel(
        combine,
        kernel_name="combine",
        out_type=jax.ShapeDtypeStruct((num_tokens * row_blocks, BLOCK_SIZE), out_dtype),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, k, blocks, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, blocks, BLOCK_SIZE), out_dtype),
            plgpu.Barrier(num_arrivals=k * tokens, num_barriers=STAGES),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
