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

A tile is 128 rows by 128 columns of F: gate's, up's and g's tiles give d gate's and d up's
tiles, one after the other (a pass of its own over the inputs for each, the second reading
them from L2; one loop body for both, d picked by its bits). A pass streams the tile's 32-row
parts through a ring of SMEM slots (gate, up and g parts and the rows' p, 24.1 KB for bf16;
two a CTA, two CTAs an SM). Per part the registers take the inputs in a layout where a thread
holds the same 4 columns of each 32-column chunk of its row (`_LAYOUT`), so that the partial
sums' chunk pairs are register adds, and the slot is refilled at once; then, 16 rows at a
time, the half's d is computed and rounded, written to a bf16 tile in SMEM, its rowwise copy
(a row's 128 columns are in registers) and the partial sums written to a staging buffer and
stored by TMA, and its column magnitudes kept as a running maximum. After the fourth part the
column scales are known: the SMEM tile is encoded into the output tile, transposed there by
the tensor core (`quantize_transpose_hopper.store_transposed`) and stored. The halves, the
parts and the column encode are loops, not unrolled: a fully unrolled tile (each part's
values waiting in registers) spilled and, at about 13,000 instructions a tile, stalled on
instruction fetch (docs/kernels.md, where the variants are measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.mxfp8 import BLOCK_SIZE, FORMATS, FP32_ABS_MASK, FP32_INF_BITS, float32_bits
from jaxmoe.ops.pallas.activation_tiles import COLUMNS, weighted_swiglu_backward
from jaxmoe.ops.pallas.quantize_hopper import (
    FP8_BLOCKWISE,
    block_amax_bits,
    checked_arithmetic,
    encode_blocks,
    kernel_problem,
)
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    BYTE_TILE,
    COMPILER_PARAMS,
    REDUCTION_SCRATCH,
    SMEM_SLACK,
    as_format,
    identity_halves,
    store_transposed,
)
from jaxmoe.ops.pallas.row_pipeline import live_input, live_tiles, num_ctas, smem_per_cta

F32 = jnp.float32
_PART = 32  # rows a ring slot
_PARTS = BLOCK // _PART
_PIECE = 16  # rows computed at a time (the layout's base tile): fewer live registers
# 16 rows by 32 columns a base tile: warps take 4-row groups, a warp's lanes 4 rows by 8 groups
# of 4 consecutive columns; a part's four chunks are four registers of the same lanes.
_LAYOUT = plgpu.Layout.TILED(
    plgpu.Tiling(((16, BLOCK_SIZE), (4, BLOCK_SIZE), (4,))),
    warp_dims=(-5,),
    lane_dims=(-3, -2),
    vector_dim=-1,
)
_STAGING = 1  # parts whose rowwise copies and partial sums may be storing at once (2: slower)
_MAX_SLOTS = 8
DEFAULT_CTAS_PER_SM = 2


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
    m, two_f = h_shape
    return kernel_problem(
        "weighted SwiGLU backward 1x128 transpose",
        (m, two_f // 2),
        h_dtype,
        [
            ("bfloat16", lambda m, f: jnp.dtype(h_dtype) == jnp.dtype(jnp.bfloat16)),
            # F as the backward's kernel takes it, so that "auto" runs this kernel exactly
            # where it would run that one (their d h bits are not XLA's).
            (
                f"M a multiple of {BLOCK} and F of {COLUMNS}",
                lambda m, f: m % BLOCK == 0 and f % COLUMNS == 0,
            ),
        ],
        "FP8 blockwise",
    )


def weighted_swiglu_backward_quantize_1x128_with_transpose_pallas(
    h: jax.Array,
    probs: jax.Array,
    g: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    ctas_per_sm: int = DEFAULT_CTAS_PER_SM,
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
    docstring). ctas_per_sm (1 or 2) and slots (32-row parts in flight, None: as many as fit)
    say how it runs, never its bits. live_rows: an int32 scalar, or None: only the 128-row bands
    holding rows below it run, the rest of every output left unwritten."""
    problem = swiglu_backward_quantize_problem(h.shape, h.dtype, probs.shape, g.shape, g.dtype)
    arithmetic = checked_arithmetic(problem, fmt, arithmetic, interpret)
    m, two_f = h.shape
    kernel = _kernel(
        m, two_f // 2, fmt, arithmetic, ctas_per_sm, slots, live_rows is not None, interpret
    )
    p_row = probs.astype(F32)[None, :]
    data, scale_row, data_t, scale_column, partials = kernel(h, g, p_row, *live_input(live_rows))
    return ((data, scale_row.T), (as_format(data_t, fmt), scale_column.T)), partials


def ring_slots(ctas_per_sm: int, slots: int | None) -> int:
    """Input slots a CTA runs with: `slots`, or as many as fit its share of shared memory;
    ValueError where they do not fit."""
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm!r}")
    budget = smem_per_cta(ctas_per_sm) - _fixed_smem_bytes()
    fit = min(_MAX_SLOTS, budget // _SLOT_BYTES)
    chosen = fit if slots is None else slots
    if not isinstance(chosen, int) or chosen < 1 or chosen > fit:
        raise ValueError(
            f"{slots!r} input slots of {_SLOT_BYTES} bytes do not fit the "
            f"{budget} bytes left to a CTA at {ctas_per_sm} CTA(s) an SM (at most {fit})"
        )
    return chosen


_SLOT_BYTES = 3 * _PART * BLOCK * 2 + _PART * 4  # gate, up, g parts (bf16) and p


def _fixed_smem_bytes() -> int:
    tile = BLOCK * BLOCK
    held_and_transposed = 2 * tile + tile + BLOCK * 4  # a half's bf16 d, bytes, scales
    staging = _STAGING * (_PART * BLOCK + _PART * 4 + _PART * BLOCK_SIZE * 4)
    return held_and_transposed + staging + REDUCTION_SCRATCH + SMEM_SLACK


@functools.cache
def _kernel(m, f, fmt_name, arithmetic, ctas_per_sm, slots, counted, interpret):
    """Tile t: block row rb = t // (F/128), block column kb = t % (F/128) of F; part i of the
    CTA's s-th tile in the pass for d gate (half 0) or d up (half 1) is its ring entry
    (2 s + half) 4 + i."""
    fmt = FORMATS[fmt_name]
    dtype = jnp.dtype(jnp.bfloat16)
    column_tiles = f // BLOCK
    num_tiles = m // BLOCK * column_tiles
    ctas = num_ctas(num_tiles, ctas_per_sm)
    slots = ring_slots(ctas_per_sm, slots)
    row_layout = _LAYOUT.reduce(1)

    def body(h_gmem, g_gmem, p_gmem, *refs, in_smem, p_smem, held_smem, t_smem, **staging):
        live_gmem, outputs = (refs[0], refs[1:]) if counted else (None, refs)
        data_gmem, row_scale_gmem, data_t_gmem, column_scale_gmem, part_gmem = outputs
        data_smem, row_scale_smem = staging["data_smem"], staging["row_scale_smem"]
        part_smem, column_scale_smem = staging["part_smem"], staging["column_scale_smem"]
        loaded = staging["loaded"]
        cta = lax.axis_index("cta")
        tiles = live_tiles(live_gmem, m, BLOCK, column_tiles) if counted else num_tiles
        steps = lax.div(jnp.maximum(tiles - cta + ctas - 1, 0), ctas)
        entries = steps * 2 * _PARTS  # per tile: d gate's parts, then d up's

        def place(entry):
            """(rows of the part, block row, block column) of the CTA's ring entry."""
            t = cta + (entry // (2 * _PARTS)) * ctas
            rb, kb = t // column_tiles, t % column_tiles
            return pl.ds(rb * BLOCK + (entry % _PARTS) * _PART, _PART), rb, kb

        def issue(entry, slot):
            rows, _, kb = place(entry)
            barrier = loaded.at[slot]
            sources = (h_gmem, kb * BLOCK), (h_gmem, f + kb * BLOCK), (g_gmem, kb * BLOCK)
            for a, (src, column) in enumerate(sources):
                plgpu.copy_gmem_to_smem(
                    src.at[rows, pl.ds(column, BLOCK)], in_smem.at[slot * 3 + a], barrier
                )
            plgpu.copy_gmem_to_smem(p_gmem.at[pl.ds(0, 1), rows], p_smem.at[slot], barrier)

        for entry in range(slots):
            pl.when(entry < entries)(functools.partial(issue, entry, entry))

        def part(step, half, i, maxima):
            """Part i of the step's tile for d gate (half 0, with the partial sums) or d up
            (half 1, traced): its rounded values into held_smem, their rowwise copy and
            partial sums stored; `maxima` updated with their column magnitudes."""
            entry = (step * 2 + half) * _PARTS + i
            slot = lax.rem(entry, slots)
            plgpu.barrier_wait(loaded.at[slot])
            inputs = [plgpu.load(in_smem.at[slot * 3 + a], layout=_LAYOUT) for a in range(3)]
            p_rows = plgpu.load(p_smem.at[slot, 0], layout=row_layout)
            plgpu.commit_smem()  # every thread has read the slot before the TMA refills it
            pl.when(entry + slots < entries)(functools.partial(issue, entry + slots, slot))
            # The staging buffer's last stores (the previous part's) have read it.
            r = lax.rem(i, _STAGING)
            plgpu.wait_smem_to_gmem(_STAGING - 1, wait_read_only=True)
            for piece in range(_PART // _PIECE):
                at = slice(piece * _PIECE, (piece + 1) * _PIECE)
                gate, up, g = (x[at].astype(F32) for x in inputs)
                p = plgpu.layout_cast(lax.broadcast_in_dim(p_rows[at], gate.shape, (0,)), _LAYOUT)
                d_gate, d_up, product = weighted_swiglu_backward(gate, up, g, p)
                # d gate or d up by its bits (all ones picks d up), one body for both halves.
                as_u16 = lambda x: lax.bitcast_convert_type(x.astype(dtype), jnp.uint16)  # noqa: E731
                pick = jnp.uint16(0) - half.astype(jnp.uint16)
                d = lax.bitcast_convert_type(
                    (as_u16(d_gate) & ~pick) | (as_u16(d_up) & pick), dtype
                )
                held_smem.at[pl.ds(i * _PART + piece * _PIECE, _PIECE)][...] = d
                bits = float32_bits(d)
                e = FP8_BLOCKWISE.exponent(block_amax_bits(bits, 1), fmt)
                rows_at = pl.ds(piece * _PIECE, _PIECE)
                row_scale_smem.at[r, 0, rows_at][...] = FP8_BLOCKWISE.stored(e)
                encoded = encode_blocks(bits, e, 1, _LAYOUT, fmt, arithmetic)
                data_smem.at[r, rows_at][...] = encoded
                partial = _first_tree_levels(product)

                @pl.when(half == 0)
                def _(partial=partial, rows_at=rows_at):
                    part_smem.at[r, rows_at][...] = partial

                maxima = jnp.maximum(maxima, _magnitudes(bits))
            plgpu.commit_smem()
            rows, _, kb = place(entry)
            column = half * f + kb * BLOCK
            plgpu.copy_smem_to_gmem(
                data_smem.at[r], data_gmem.at[rows, pl.ds(column, BLOCK)], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                row_scale_smem.at[r],
                row_scale_gmem.at[pl.ds(column // BLOCK, 1), rows],
                commit_group=False,
            )

            @pl.when(half == 0)
            def _():
                plgpu.copy_smem_to_gmem(
                    part_smem.at[r],
                    part_gmem.at[rows, pl.ds(kb * BLOCK_SIZE, BLOCK_SIZE)],
                    commit_group=False,
                )

            plgpu.commit_smem_to_gmem_group()
            return maxima

        def transposed_copy(step, half, maxima):
            """The half's tile (held_smem) encoded with its column scales into the output
            tile, transposed there, and both stored."""
            _, rb, kb = place((step * 2 + half) * _PARTS)
            e = FP8_BLOCKWISE.exponent(jnp.max(maxima, axis=0), fmt)
            # The previous transposed stores have read the output tile (the half's part
            # stores since may still run).
            plgpu.wait_smem_to_gmem(_PARTS, wait_read_only=True)
            column_scale_smem.at[0][...] = FP8_BLOCKWISE.stored(e)

            @pl.loop(0, BLOCK // _PIECE)
            def _(j):
                rows_at = pl.ds(j * _PIECE, _PIECE)
                d = plgpu.load(held_smem.at[rows_at], layout=_LAYOUT)
                encoded = encode_blocks(float32_bits(d), e, 0, _LAYOUT, fmt, arithmetic)
                t_smem.at[rows_at][...] = lax.bitcast_convert_type(encoded, jnp.int8)

            store_transposed(identity_halves(), t_smem, t_smem, in_place=True)
            plgpu.commit_smem()
            column = half * f + kb * BLOCK
            plgpu.copy_smem_to_gmem(
                t_smem,
                data_t_gmem.at[pl.ds(column, BLOCK), pl.ds(rb * BLOCK, BLOCK)],
                commit_group=False,
            )
            plgpu.copy_smem_to_gmem(
                column_scale_smem,
                column_scale_gmem.at[pl.ds(rb, 1), pl.ds(column, BLOCK)],
                commit_group=False,
            )
            plgpu.commit_smem_to_gmem_group()

        zeros = plgpu.layout_cast(jnp.zeros((_PIECE, BLOCK), jnp.uint32), _LAYOUT)

        def run_step(step, carry):
            @pl.loop(0, 2)
            def _(half):
                maxima = lax.fori_loop(
                    0, _PARTS, lambda i, maxima: part(step, half, i, maxima), zeros
                )
                # Every thread's held values are in SMEM before any thread encodes them.
                plgpu.commit_smem()
                transposed_copy(step, half, maxima)

            return carry

        lax.fori_loop(0, steps, run_step, None)
        plgpu.wait_smem_to_gmem(0)

    two_f = 2 * f
    return plgpu.kernel(
        body,
        kernel_name="weighted_swiglu_backward_quantize_1x128_transpose",
        out_type=(
            jax.ShapeDtypeStruct((m, two_f), fmt.dtype),
            jax.ShapeDtypeStruct((two_f // BLOCK, m), F32),
            jax.ShapeDtypeStruct((two_f, m), jnp.int8),
            jax.ShapeDtypeStruct((m // BLOCK, two_f), F32),
            jax.ShapeDtypeStruct((m, column_tiles * BLOCK_SIZE), F32),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=dict(
            in_smem=plgpu.SMEM((slots * 3, _PART, BLOCK), dtype),
            p_smem=plgpu.SMEM((slots, 1, _PART), F32),
            held_smem=plgpu.SMEM((BLOCK, BLOCK), dtype),
            t_smem=plgpu.SMEM((BLOCK, BLOCK), jnp.int8, transforms=BYTE_TILE),
            column_scale_smem=plgpu.SMEM((1, BLOCK), F32),
            data_smem=plgpu.SMEM((_STAGING, _PART, BLOCK), fmt.dtype),
            row_scale_smem=plgpu.SMEM((_STAGING, 1, _PART), F32),
            part_smem=plgpu.SMEM((_STAGING, _PART, BLOCK_SIZE), F32),
            loaded=plgpu.Barrier(num_arrivals=4, num_barriers=slots),
        ),
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )


def _magnitudes(bits):
    """fp32 magnitude bits, NaNs as 0: a tile's pieces meet elementwise (a thread's own
    registers), so that the column amax crosses the lanes and warps once a tile."""
    magnitudes = bits & FP32_ABS_MASK
    return jnp.where(magnitudes > FP32_INF_BITS, jnp.uint32(0), magnitudes)


def _first_tree_levels(product):
    """((c0 + c1) + (c2 + c3)) of the four 32-column chunks c of a [rows, 128] array: the
    first two levels of `row_sums_in_order`'s tree (its chunks are registers of one thread)."""
    chunk = lambda c: product[:, c * BLOCK_SIZE : (c + 1) * BLOCK_SIZE]  # noqa: E731
    return (chunk(0) + chunk(1)) + (chunk(2) + chunk(3))
