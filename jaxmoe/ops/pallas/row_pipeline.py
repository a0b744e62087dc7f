"""The TMA pipeline shared by the bandwidth-bound Hopper kernels (MXFP8 quantize, the dispatch
gather, the combine): a persistent grid of CTAs of one warpgroup, each walking its tiles through
a ring of SMEM slots, and the row gather that loads a tile from token rows picked by an index.
Arrays are viewed as [N, B] blocks of B consecutive elements (B = 32, the MXFP8 block, unless
a kernel says otherwise); a tile is a run of blocks.
docs/kernels/permute.md describes the design."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.hopper import SMEM_PER_SM, SMEM_RESERVED_PER_CTA, TMA_SMEM_ALIGN

# Tuning knobs (the kernels are built on first use; clear their lru caches after changing them).
# Keep CTAS_PER_SM x STAGES x (tile SMEM) within SMEM_PER_CTA, or fewer CTAs share an SM than
# the grid assumes; TILE_BYTES a multiple of 16 KB (the columnwise quantize layout's span).
TILE_BYTES = 16 * 1024  # input bytes per tile
STAGES = 4  # SMEM ring slots per CTA: tiles in flight
UNROLLED_GATHER_LOADS = 8  # a gather tile of more TMA loads issues them in a loop
CTAS_PER_SM = 2  # persistent CTAs per SM


def smem_per_cta(per_sm: int) -> int:
    """One CTA's share of an SM's shared memory when `per_sm` CTAs share it."""
    return SMEM_PER_SM // per_sm - SMEM_RESERVED_PER_CTA


SMEM_PER_CTA = smem_per_cta(CTAS_PER_SM)  # one CTA's share of the SM
# No automatic warpgroup barriers around SMEM accesses: the pipelines place the ones they need.
# No reduction crosses warps, so no SMEM is reserved for reductions.
COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Lane,
    unsafe_no_auto_barriers=True,
    reduction_scratch_bytes=0,
)


def tile_elems(dtype, block: int = BLOCK_SIZE) -> int:
    """Blocks per tile: TILE_BYTES of `dtype` in `block`-element blocks."""
    return TILE_BYTES // (block * jnp.dtype(dtype).itemsize)


def num_ctas(num_tiles: int, per_sm: int = CTAS_PER_SM) -> int:
    """Size of the persistent grid: `per_sm` CTAs per SM, at most one per tile."""
    return min(num_tiles, per_sm * num_sms())


def live_input(live_rows) -> tuple:
    """A kernel's live row count input (`jaxmoe.ops.live_rows`): (int32 [1],), or () without
    one."""
    return () if live_rows is None else (jnp.reshape(live_rows, (1,)).astype(jnp.int32),)


def live_tiles(live_gmem, num_rows: int, band: int, tiles_per_band: int = 1, row_units: int = 1):
    """The tiles that hold the rows below the count in live_gmem (read in the kernel), the rows
    [0, num_rows) taken as `row_units` units each (e.g. 32-element blocks) and the tiles going
    band by band over bands of `band` units, `tiles_per_band` a band."""
    live = jnp.clip(live_gmem[0], 0, num_rows) * row_units
    return lax.div(live + band - 1, band) * tiles_per_band


def _start(num_tiles, ctas, loaded, fetch, stages=STAGES):
    """This CTA's (tile of a step, step count), with the loads of its first `stages` tiles
    issued into slots 0..stages-1. num_tiles may be traced (a count read in the kernel, at most
    the static count the grid was sized for): CTAs past it run no step."""
    cta = lax.axis_index("cta")
    steps = lax.div(jnp.maximum(num_tiles - cta + ctas - 1, 0), ctas)

    def tile(step):
        return cta + step * ctas

    for step in range(stages):
        issue = fetch(tile(step))
        pl.when(step < steps)(functools.partial(issue, step, loaded.at[step]))
    return tile, steps


def pipeline(num_tiles, ctas, loaded, fetch, compute, store, stages=STAGES):
    """Run this CTA's tiles (c, c + ctas, ...) through a ring of `stages` SMEM slots (STAGES
    unless a kernel's tiles are too large for that many), computing each loaded tile into a
    separate output slot.

    fetch(tile) returns issue(slot, barrier), which starts the tile's TMA loads into `slot`,
    arriving on `barrier`; fetch runs at the start of the step that ends with issue, so that
    GMEM reads it makes (the gather's row tokens) are in flight during the compute. compute(slot)
    turns a loaded slot into the slot's output buffers and store(tile, slot) starts their TMA
    stores. Step i waits for its loads and for the stores of step i - stages (same output slot),
    computes, stores, then reuses the input slot for tile i + stages.
    `loaded`: stages barriers. No thread reads SMEM that another writes within a step, so the
    only warpgroup barriers needed are those of the waits and of commit_smem."""
    split_pipeline(
        num_tiles,
        ctas,
        loaded,
        fetch,
        lambda slot, out: compute(slot),
        store,
        stages,
        stages,
    )


def split_pipeline(num_tiles, ctas, loaded, fetch, compute, store, stages, output_slots):
    """`pipeline` with `output_slots` output buffers next to the `stages` input slots (fewer
    outputs leave SMEM for more loads in flight): step i reads input slot i % stages into
    output slot i % output_slots (compute(slot, out), then store(tile, out)), once the stores
    of step i - output_slots have read that output slot."""
    tile, steps = _start(num_tiles, ctas, loaded, fetch, stages)

    def run_step(step, carry):
        slot = lax.rem(step, stages)
        out = lax.rem(step, output_slots)
        issue_next = fetch(tile(step + stages))
        plgpu.barrier_wait(loaded.at[slot])
        plgpu.wait_smem_to_gmem(output_slots - 1, wait_read_only=True)
        compute(slot, out)
        plgpu.commit_smem()
        store(tile(step), out)
        plgpu.commit_smem_to_gmem_group()
        pl.when(step + stages < steps)(functools.partial(issue_next, slot, loaded.at[slot]))
        return carry

    lax.fori_loop(0, steps, run_step, None)
    plgpu.wait_smem_to_gmem(0)


def copy_pipeline(num_tiles, ctas, loaded, fetch, store):
    """Like `pipeline` without a compute: each loaded slot is stored as it is. A slot is
    refilled one step after its store was issued, once that store has read it, so STAGES - 1
    tiles are loading while a store drains."""
    tile, steps = _start(num_tiles, ctas, loaded, fetch)

    def run_step(step, carry):
        slot = lax.rem(step, STAGES)
        previous = lax.rem(step + STAGES - 1, STAGES)
        issue_next = fetch(tile(step - 1 + STAGES))
        plgpu.barrier_wait(loaded.at[slot])
        store(tile(step), slot)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the previous step's store read
        refill = (step >= 1) & (step - 1 + STAGES < steps)
        pl.when(refill)(functools.partial(issue_next, previous, loaded.at[previous]))
        return carry

    lax.fori_loop(0, steps, run_step, None)
    plgpu.wait_smem_to_gmem(0)


def gather_plan(k, dtype, block: int = BLOCK_SIZE):
    """(tile, segment) for gathering rows of K elements (K * itemsize a multiple of 128): a tile
    of `tile` blocks of `block` elements (a multiple of the 2048 bytes one warpgroup holds of a
    row-per-block layout, at most tile_elems) is loaded as tile / segment TMAs of `segment`
    consecutive blocks of one token row. The largest segment wins, then the largest tile: whole
    rows when they fit (bf16: K = 4096 gives 2 rows of 8 KB per tile, 7168 one row of 14 KB,
    2048 four rows of 4 KB). A segment is a multiple of 128 bytes: the SMEM alignment of a TMA,
    and its byte count must split evenly over the 128 threads that arrive on the barrier."""
    itemsize = jnp.dtype(dtype).itemsize
    row_blocks = k // block
    unit = max(1, 2048 // (block * itemsize))
    plans = [
        (math.gcd(tile, row_blocks), tile)
        for tile in range(unit, tile_elems(dtype, block) + 1, unit)
    ]
    segment, tile = max(plan for plan in plans if plan[0] * block * itemsize % TMA_SMEM_ALIGN == 0)
    return tile, segment


def gather_fetch(token_gmem, x_gmem, x_smem, tile, segment, gather):
    """Gather loads: output blocks [t * tile, (t + 1) * tile) as tile / segment TMAs of
    `segment` blocks, each inside one output row r, read from row row_token[r] // P of x
    ([T * R, B] blocks, R per row); gather = (T, M, R, P) (P > 1: row_token holds the rows'
    slots, P a token, as the plan's `row_slot`, and the division needs no kernel of its own).
    Rows past M and padding rows (token T) read past the end of x: the TMA fills them with
    zeros. Up to UNROLLED_GATHER_LOADS loads a tile are
    unrolled, their tokens read before the slot is free; more (short rows: a tile of many
    rows) are issued by a loop, so that the kernel's size does not grow with them."""
    num_tokens, num_rows, row_blocks, per_token = gather
    loads = tile // segment

    def source(t, j):
        block = t * tile + j * segment
        row = block // row_blocks
        token = token_gmem[jnp.minimum(row, num_rows - 1)]
        if per_token > 1:
            token = token // per_token
        token = jnp.where(row < num_rows, token, num_tokens)
        return token * row_blocks + block % row_blocks

    def load(j, start, slot, barrier):
        plgpu.copy_gmem_to_smem(
            x_gmem.at[pl.ds(start, segment)],
            x_smem.at[slot, pl.ds(j * segment, segment)],
            barrier,
        )

    def fetch(t):
        if loads > UNROLLED_GATHER_LOADS:

            def issue_looped(slot, barrier):
                @pl.loop(0, loads)
                def _(j):
                    load(j, source(t, j), slot, barrier)

            return issue_looped

        sources = [source(t, j) for j in range(loads)]

        def issue(slot, barrier):
            for j, start in enumerate(sources):
                load(j, start, slot, barrier)

        return issue

    return fetch
