"""The dispatch gather for Hopper (Pallas Mosaic GPU): rows[r] = x[row_token[r] // per_token],
zeros where that is T (a padding row); bitwise a copy. A pure TMA copy through
`row_pipeline.copy_pipeline`; given a live row count (`jaxmoe.ops.live_rows`), only the tiles
that hold live rows. docs/kernels/permute.md describes the design."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.hopper import TMA_SMEM_ALIGN
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    STAGES,
    copy_pipeline,
    gather_fetch,
    gather_plan,
    live_input,
    live_tiles,
    num_ctas,
)

_DTYPES = tuple(
    jnp.dtype(d)
    for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)
)  # the copy moves bytes; float8: a quantized copy's data rows


def dispatch_problem(shape, dtype, num_rows) -> str | None:
    """Why `dispatch_pallas` cannot gather num_rows rows of an x of this shape / dtype (None: it
    can): x must be a non-empty 2-D bf16 / fp16 / fp32 / float8 array whose rows are whole
    multiples of 128 bytes and of 32 elements (the TMA segments of `row_pipeline.gather_plan`)."""
    dtype = jnp.dtype(dtype)
    if len(shape) != 2 or dtype not in _DTYPES or 0 in shape:
        return (
            f"dispatch kernel: needs a non-empty 2-D bf16/fp16/fp32/float8 array, got "
            f"{tuple(shape)} {dtype.name}"
        )
    multiple = max(BLOCK_SIZE, TMA_SMEM_ALIGN // dtype.itemsize)
    if shape[1] % multiple:
        return f"dispatch kernel: needs H % {multiple} == 0 for {dtype.name}, got H = {shape[1]}"
    if num_rows < 1:
        return "dispatch kernel: needs at least one row to gather"
    return None


def dispatch_pallas(
    x: jax.Array,
    row_token: jax.Array,
    *,
    per_token: int = 1,
    live_rows: jax.Array | None = None,
    interpret=None,
) -> jax.Array:
    """rows [M, H]: row r is x[row_token[r] // per_token] (x [T, H]), or zeros where that is T.
    row_token: [M] int32 in [0, T * per_token] (per_token > 1: the rows' slots). live_rows: an
    int32 scalar in [0, M], or None: rows at and past it are not written (unspecified)."""
    problem = dispatch_problem(x.shape, x.dtype, row_token.shape[0])
    if problem:
        raise ValueError(problem)
    num_tokens, h = x.shape
    (num_rows,) = row_token.shape
    kernel = _dispatch_kernel(
        num_tokens,
        num_rows,
        h // BLOCK_SIZE,
        per_token,
        jnp.dtype(x.dtype),
        live_rows is not None,
        interpret,
    )
    blocks = x.reshape(num_tokens * h // BLOCK_SIZE, BLOCK_SIZE)
    return kernel(row_token.astype(jnp.int32), blocks, *live_input(live_rows)).reshape(num_rows, h)


@functools.cache
def _dispatch_kernel(num_tokens, num_rows, row_blocks, per_token, dtype, counted, interpret):
    tile, segment = gather_plan(row_blocks * BLOCK_SIZE, dtype)
    num_blocks = num_rows * row_blocks
    num_tiles = cdiv(num_blocks, tile)
    ctas = num_ctas(num_tiles)

    def dispatch(token_gmem, x_gmem, *refs):
        live_gmem, (out_gmem, x_smem, loaded) = (refs[0], refs[1:]) if counted else (None, refs)
        gather = (num_tokens, num_rows, row_blocks, per_token)
        fetch = gather_fetch(token_gmem, x_gmem, x_smem, tile, segment, gather)
        # Counted: the tiles (of `tile` blocks, row_blocks a row) holding rows [0, live_rows).
        tiles = (
            live_tiles(live_gmem, num_rows, tile, row_units=row_blocks) if counted else num_tiles
        )

        def store(t, slot):
            plgpu.copy_smem_to_gmem(
                x_smem.at[slot], out_gmem.at[pl.ds(t * tile, tile)], commit_group=False
            )

        copy_pipeline(tiles, ctas, loaded, fetch, store)

    return plgpu.kernel(
        dispatch,
        kernel_name="dispatch",
        out_type=jax.ShapeDtypeStruct((num_blocks, BLOCK_SIZE), dtype),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, tile, BLOCK_SIZE), dtype),
            plgpu.Barrier(num_arrivals=tile // segment, num_barriers=STAGES),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
