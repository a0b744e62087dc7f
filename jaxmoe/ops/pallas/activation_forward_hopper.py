"""The experts' weighted SwiGLU forward for Hopper (Pallas Mosaic GPU): for h [M, 2F]
([gate; up]) and p [M] fp32,
  a = round(silu(gate) * up * p)      silu(x) = x * sigmoid(x), every step in fp32,
in `jaxmoe.ops.activation.gated_activation`'s order (silu(gate) * up, then * p), rounded once to
h's dtype. Bandwidth-bound: `activation_tiles`' tiles (ROWS rows by CHUNKS chunks of 32 columns
of F, a chunk of gate and up one TMA each) stream through `row_pipeline`. Given a live row count
(`jaxmoe.ops.live_rows`), only the row tiles holding rows below it run: XLA's elementwise
forward goes over every row of the expert-parallel receiver's buffer, about R x the live ones.
docs/kernels/activation.md describes the design."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.activation_tiles import (
    CHUNKS,
    HALF_DTYPES,
    ROWS,
    ChunkTiles,
    layout,
    loads_per_tile,
    spread_rows,
    swiglu_problem,
    weighted_swiglu,
)
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    live_input,
    num_ctas,
    pipeline,
    smem_per_cta,
)

F32 = jnp.float32
DTYPES = HALF_DTYPES + (jnp.dtype(F32),)
# Tiling (read when a kernel is built; clear `_kernel`'s cache after changing them): up to
# MAX_STAGES ring slots (a slot holds gate and up in, a out and p: 26 KB in bf16, 50 in fp32) as
# fit CTAS_PER_SM CTAs an SM.
MAX_STAGES = 3
CTAS_PER_SM = 2


def forward_problem(h_shape, h_dtype) -> str | None:
    """Why `weighted_swiglu_forward_pallas` cannot take h (None: it can)."""
    return swiglu_problem(h_shape, h_dtype, DTYPES)


def weighted_swiglu_forward_pallas(h, probs, *, live_rows=None, interpret=None):
    """a [M, F] in h.dtype (module docstring) for h in bf16, fp16 or fp32 (`forward_problem`
    says what it takes). probs: [M]. live_rows: an int32 scalar in [0, M], or None: rows at and
    past it are not written (unspecified)."""
    problem = forward_problem(h.shape, h.dtype)
    if problem or probs.shape != h.shape[:1]:
        raise ValueError(
            f"weighted SwiGLU forward kernel: {problem or f'p must be [M], got {probs.shape}'}"
        )
    m, two_f = h.shape
    kernel = _kernel(m, two_f // 2, jnp.dtype(h.dtype), live_rows is not None, interpret)
    return kernel(h, spread_rows(probs), *live_input(live_rows))


def _stages(dtype) -> int:
    slot = (3 * dtype.itemsize * CHUNKS + 4) * ROWS * BLOCK_SIZE
    return min(MAX_STAGES, smem_per_cta(CTAS_PER_SM) // slot)


@functools.cache
def _kernel(m, f, dtype, counted, interpret):
    stages = _stages(dtype)
    tiles = ChunkTiles(m, f)
    ctas = num_ctas(tiles.num_tiles, per_sm=CTAS_PER_SM)
    chunk_layout = layout()

    def body(h_gmem, p_gmem, *refs):
        live_gmem, refs = (refs[0], refs[1:]) if counted else (None, refs)
        a_gmem, in_smem, p_smem, out_smem, loaded = refs
        fetch = tiles.fetch(((h_gmem, 0), (h_gmem, f)), in_smem, p_gmem, p_smem)

        def compute(slot):
            p = plgpu.load(p_smem.at[slot], layout=chunk_layout)
            for q in range(CHUNKS):
                gate, up = (
                    plgpu.load(in_smem.at[slot, a, q], layout=chunk_layout).astype(F32)
                    for a in range(2)
                )
                out_smem.at[slot, 0, q][...] = weighted_swiglu(gate, up, p).astype(dtype)

        def store(t, slot):
            tiles.store_chunks(t, slot, ((a_gmem, 0),), out_smem)

        pipeline(tiles.count(live_gmem), ctas, loaded, fetch, compute, store, stages=stages)

    return plgpu.kernel(
        body,
        kernel_name="weighted_swiglu_forward",
        out_type=jax.ShapeDtypeStruct((m, f), dtype),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((stages, 2, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.SMEM((stages, ROWS, BLOCK_SIZE), F32),
            plgpu.SMEM((stages, 1, CHUNKS, ROWS, BLOCK_SIZE), dtype),
            plgpu.Barrier(num_arrivals=loads_per_tile(2), num_barriers=stages),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
