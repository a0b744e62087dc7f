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

A tile is 128 rows by 128 columns of F, made in one pass by the CTA's two warpgroups (one CTA
an SM). Each streams its 16 rows of every 32-row part of the tile (gate, up and g, and the
part's p) through a ring of its own (its own TMA loads and barriers), computes d gate and d up
once from them, writes both halves' rows to bf16 tiles in SMEM, writes their rowwise copies and
the partial sums through a staging buffer of its own, and keeps both halves' running column
maxima. In the register layout (`_LAYOUT`) a thread holds the same 4 columns of each 32-column
chunk of its row, so that the partial sums' chunk pairs are register adds and a row's 128
columns (a rowwise block) are in registers. After the fourth part the warpgroups meet: each
hands the other its maxima of the other's half through SMEM, and warpgroup w encodes half w's
SMEM tile with the column scales, transposes it on the tensor core
(`quantize_transpose_hopper.store_transposed`) and stores it. Mosaic GPU's cross-warp
reductions share one SMEM scratch in the CTA, so the warpgroups take the column amax in turn.
The parts and the column encode are loops, not unrolled (an unrolled tile spilled and stalled
on instruction fetch: docs/kernels.md, where the variants are measured).
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
from jaxmoe.ops.device import compiled_for_gpu
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
    docstring). slots (each warpgroup's ring of 32-row parts, None: as many as fit, at most 4)
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


_WGS = 2  # warpgroups a CTA: each takes 16 rows of every part and one half's transposed copy
_ROWS = _PART // _WGS


def ring_slots(slots: int | None) -> int:
    """Input slots of each warpgroup's ring: `slots`, or as many as fit the CTA's shared memory
    beside its tiles (at most 4)."""
    budget = smem_per_cta(1) - _fixed_smem_bytes()
    fit = min(4, budget // (_WGS * _SLOT_BYTES))
    chosen = fit if slots is None else slots
    if not isinstance(chosen, int) or chosen < 1 or chosen > fit:
        raise ValueError(f"{slots!r} slots do not fit (at most {fit})")
    return chosen


_SLOT_BYTES = 3 * _ROWS * BLOCK * 2 + _PART * 4  # a warpgroup's gate, up, g rows; the part's p


def _fixed_smem_bytes() -> int:
    tile = BLOCK * BLOCK
    held = 2 * tile * 2  # both halves' bf16 d
    transposed = 2 * tile + 2 * BLOCK * 4  # a byte tile and column scales per half
    maxima = 2 * _ROWS * BLOCK * 4
    staging = _WGS * (2 * _ROWS * BLOCK + 2 * _ROWS * 4 + _ROWS * BLOCK_SIZE * 4)
    return held + transposed + maxima + staging + REDUCTION_SCRATCH + SMEM_SLACK


@functools.cache
def _kernel(m, f, fmt_name, arithmetic, slots, counted, compiled, interpret):
    """Tile t: block row rb = t // (F/128), block column kb = t % (F/128) of F. Warpgroup w
    loads and computes rows [16 w, 16 w + 16) of each 32-row part of the CTA's tiles (both
    halves), then encodes, transposes and stores half w of the tile."""
    fmt = FORMATS[fmt_name]
    dtype = jnp.dtype(jnp.bfloat16)
    column_tiles = f // BLOCK
    num_tiles = m // BLOCK * column_tiles
    ctas = num_ctas(num_tiles, 1)
    slots = ring_slots(slots)
    row_layout = _LAYOUT.reduce(1)
    barrier_layout = _LAYOUT if compiled else None

    def body(h_gmem, g_gmem, p_gmem, *refs, in_smem, p_smem, held_smem, t_smem, **scratch):
        live_gmem, outputs = (refs[0], refs[1:]) if counted else (None, refs)
        data_gmem, row_scale_gmem, data_t_gmem, column_scale_gmem, part_gmem = outputs
        data_smem, row_scale_smem = scratch["data_smem"], scratch["row_scale_smem"]
        part_smem, column_scale_smem = scratch["part_smem"], scratch["column_scale_smem"]
        maxima_smem, loaded = scratch["maxima_smem"], scratch["loaded"]
        parts_done, encodes_done = scratch["parts_done"], scratch["encodes_done"]
        reduced = scratch["reduced"]
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
        tiles = live_tiles(live_gmem, m, BLOCK, column_tiles) if counted else num_tiles
        steps = lax.div(jnp.maximum(tiles - cta + ctas - 1, 0), ctas)
        entries = steps * _PARTS

        def place(entry):
            """(this warpgroup's rows of the part, block row, block column) of ring entry."""
            t = cta + (entry // _PARTS) * ctas
            rb, kb = t // column_tiles, t % column_tiles
            first = rb * BLOCK + (entry % _PARTS) * _PART + wg * _ROWS
            return pl.ds(first, _ROWS), rb, kb

        def issue(entry, slot):
            rows, _, kb = place(entry)
            part_rows = pl.ds(rows.start - wg * _ROWS, _PART)  # p's copy: 128 bytes at least
            barrier = loaded.at[wg * slots + slot]
            sources = (h_gmem, kb * BLOCK), (h_gmem, f + kb * BLOCK), (g_gmem, kb * BLOCK)
            for a, (src, column) in enumerate(sources):
                plgpu.copy_gmem_to_smem(
                    src.at[rows, pl.ds(column, BLOCK)],
                    in_smem.at[(wg * slots + slot) * 3 + a],
                    barrier,
                )
            plgpu.copy_gmem_to_smem(
                p_gmem.at[pl.ds(0, 1), part_rows], p_smem.at[wg * slots + slot], barrier
            )

        for entry in range(slots):
            pl.when(entry < entries)(functools.partial(issue, entry, entry))

        def part(step, i, maxima):
            """Part i of the step's tile: this warpgroup's 16 rows of d gate and d up into
            held_smem, their rowwise copies and partial sums stored; `maxima` (per half)
            updated with their column magnitudes."""
            entry = step * _PARTS + i
            slot = lax.rem(entry, slots)
            ring = wg * slots + slot
            plgpu.barrier_wait(loaded.at[ring])
            gate, up, g = (
                plgpu.load(in_smem.at[ring * 3 + a], layout=_LAYOUT).astype(F32) for a in range(3)
            )
            p_rows = plgpu.load(p_smem.at[ring, 0, pl.ds(wg * _ROWS, _ROWS)], layout=row_layout)
            plgpu.commit_smem()  # every thread has read the slot before the TMA refills it
            pl.when(entry + slots < entries)(functools.partial(issue, entry + slots, slot))
            p = plgpu.layout_cast(lax.broadcast_in_dim(p_rows, gate.shape, (0,)), _LAYOUT)
            d_gate, d_up, product = weighted_swiglu_backward(gate, up, g, p, barrier_layout)
            # The staging buffer's last stores (the previous part's) have read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            # Both warpgroups' encodes of the previous tile have read held_smem.
            @pl.when(jnp.logical_and(i == 0, step > 0))
            def _():
                plgpu.barrier_wait(encodes_done.at[0])

            held_rows = pl.ds(i * _PART + wg * _ROWS, _ROWS)
            updated = []
            for half, d in enumerate((d_gate, d_up)):
                d = d.astype(dtype)
                held_smem.at[half, held_rows][...] = d
                bits = float32_bits(d)
                e = FP8_BLOCKWISE.exponent(block_amax_bits(bits, 1), fmt)
                row_scale_smem.at[wg, half, 0][...] = FP8_BLOCKWISE.stored(e)
                data_smem.at[wg, half][...] = encode_blocks(bits, e, 1, _LAYOUT, fmt, arithmetic)
                updated.append(jnp.maximum(maxima[half], _magnitudes(bits)))
            part_smem.at[wg][...] = _first_tree_levels(product)
            plgpu.commit_smem()
            rows, _, kb = place(entry)
            for half in range(2):
                column = half * f + kb * BLOCK
                plgpu.copy_smem_to_gmem(
                    data_smem.at[wg, half],
                    data_gmem.at[rows, pl.ds(column, BLOCK)],
                    commit_group=False,
                )
                plgpu.copy_smem_to_gmem(
                    row_scale_smem.at[wg, half],
                    row_scale_gmem.at[pl.ds(column // BLOCK, 1), rows],
                    commit_group=False,
                )
            plgpu.copy_smem_to_gmem(
                part_smem.at[wg],
                part_gmem.at[rows, pl.ds(kb * BLOCK_SIZE, BLOCK_SIZE)],
                commit_group=False,
            )
            plgpu.commit_smem_to_gmem_group()
            return tuple(updated)

        def transposed_copy(step, maxima):
            """Half wg of the step's tile: its column maxima met with the other warpgroup's,
            its bf16 tile encoded with the column scales, transposed and stored."""
            _, rb, kb = place(step * _PARTS)
            # The other warpgroup's maxima of this half, and every row of both halves, are in
            # SMEM; Mosaic's cross-warp reduction has one scratch for the CTA, so the
            # warpgroups reduce in turn (the first one's next reduction comes after the
            # second's, past the next tile's meeting).
            ones = jnp.uint32(0) - wg.astype(jnp.uint32)  # all ones in warpgroup 1
            mine = (maxima[0] & ~ones) | (maxima[1] & ones)
            maxima_smem.at[1 - wg][...] = (maxima[0] & ones) | (maxima[1] & ~ones)
            plgpu.barrier_arrive(parts_done.at[0])
            plgpu.barrier_wait(parts_done.at[0])
            met = jnp.maximum(mine, plgpu.load(maxima_smem.at[wg], layout=_LAYOUT))

            @pl.when(wg == 1)
            def _():
                plgpu.barrier_wait(reduced.at[0])

            e = FP8_BLOCKWISE.exponent(jnp.max(met, axis=0), fmt)

            @pl.when(wg == 0)
            def _():
                plgpu.barrier_arrive(reduced.at[0])
                plgpu.barrier_wait(reduced.at[0])  # its own arrival: every thread sees each phase

            # The previous transposed stores have read the output tile.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            column_scale_smem.at[wg, 0][...] = FP8_BLOCKWISE.stored(e)
            held, out = held_smem.at[wg], t_smem.at[wg]

            @pl.loop(0, BLOCK // _PIECE)
            def _(j):
                rows_at = pl.ds(j * _PIECE, _PIECE)
                d = plgpu.load(held.at[rows_at], layout=_LAYOUT)
                encoded = encode_blocks(float32_bits(d), e, 0, _LAYOUT, fmt, arithmetic)
                out.at[rows_at][...] = lax.bitcast_convert_type(encoded, jnp.int8)

            plgpu.barrier_arrive(encodes_done.at[0])
            store_transposed(identity_halves(), out, out, in_place=True)
            plgpu.commit_smem()
            column = wg * f + kb * BLOCK
            plgpu.copy_smem_to_gmem(
                out,
                data_t_gmem.at[pl.ds(column, BLOCK), pl.ds(rb * BLOCK, BLOCK)],
                commit_group=False,
            )
            plgpu.copy_smem_to_gmem(
                column_scale_smem.at[wg],
                column_scale_gmem.at[pl.ds(rb, 1), pl.ds(column, BLOCK)],
                commit_group=False,
            )
            plgpu.commit_smem_to_gmem_group()

        zeros = plgpu.layout_cast(jnp.zeros((_ROWS, BLOCK), jnp.uint32), _LAYOUT)

        def run_step(step, carry):
            maxima = lax.fori_loop(0, _PARTS, lambda i, mx: part(step, i, mx), (zeros, zeros))
            transposed_copy(step, maxima)
            return carry

        lax.fori_loop(0, steps, run_step, None)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(encodes_done.at[0])  # the last tile's, which no part waited for

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
        num_threads=_WGS,
        thread_name="wg",
        scratch_types=dict(
            in_smem=plgpu.SMEM((_WGS * slots * 3, _ROWS, BLOCK), dtype),
            p_smem=plgpu.SMEM((_WGS * slots, 1, _PART), F32),
            held_smem=plgpu.SMEM((2, BLOCK, BLOCK), dtype),
            t_smem=plgpu.SMEM((2, BLOCK, BLOCK), jnp.int8, transforms=BYTE_TILE),
            column_scale_smem=plgpu.SMEM((2, 1, BLOCK), F32),
            maxima_smem=plgpu.SMEM((2, _ROWS, BLOCK), jnp.uint32),
            data_smem=plgpu.SMEM((_WGS, 2, _ROWS, BLOCK), fmt.dtype),
            row_scale_smem=plgpu.SMEM((_WGS, 2, 1, _ROWS), F32),
            part_smem=plgpu.SMEM((_WGS, _ROWS, BLOCK_SIZE), F32),
            loaded=plgpu.Barrier(num_arrivals=4, num_barriers=_WGS * slots),
            parts_done=plgpu.Barrier(num_arrivals=_WGS, num_barriers=1),
            encodes_done=plgpu.Barrier(num_arrivals=_WGS, num_barriers=1),
            reduced=plgpu.Barrier(num_arrivals=1, num_barriers=1),
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
