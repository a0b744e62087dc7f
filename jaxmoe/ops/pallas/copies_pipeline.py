"""The pipeline of the Hopper kernels that compute a tile of bf16 values from streamed inputs and
write only its two FP8-blockwise 1 x 128 copies (rowwise, and transposed in blocks along the
rows), never the values themselves: the weighted SwiGLU's forward (`swiglu_quantize_hopper.py`)
and backward (`swiglu_backward_quantize_hopper.py`).

A tile is 128 rows by two 128-column halves of the copies' columns, made in one pass by the
CTA's two warpgroups (one CTA an SM). Each streams its 16 rows of every 32-row part of the tile
(the kernel's 128-column input windows, and the part's p) through a ring of its own (its own TMA
loads and barriers), computes both halves' values from them (`compute`), rounds them to bf16,
writes them to SMEM tiles, writes their rowwise copies (and a kernel's extra fp32 output)
through a staging buffer of its own, and keeps both halves' running column maxima. In the
register layout (`LAYOUT`) a thread holds the same 4 columns of each 32-column chunk of its row,
so a row's 128 columns (a rowwise block) are in registers. After the fourth part the warpgroups
meet: each hands the other its maxima of the other's half through SMEM, and warpgroup w encodes
half w's SMEM tile with the column scales, transposes it on the tensor core
(`quantize_transpose_hopper.store_transposed`) and stores it. Mosaic GPU's cross-warp reductions
share one SMEM scratch in the CTA, so the warpgroups take the column amax in turn. The parts and
the column encode are loops, not unrolled (an unrolled tile spilled and stalled on instruction
fetch: the kernel experiments in docs/notes/, where the variants are measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.mxfp8 import BLOCK_SIZE, FORMATS, float32_bits
from jaxmoe.ops.pallas.activation_tiles import COLUMNS
from jaxmoe.ops.pallas.quantize_hopper import (
    FP8_BLOCKWISE,
    encode_blocks,
    kernel_problem,
    magnitude_bits,
)
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    BYTE_TILE,
    COMPILER_PARAMS,
    REDUCTION_SCRATCH,
    SMEM_SLACK,
    identity_halves,
    store_transposed,
)
from jaxmoe.ops.pallas.row_pipeline import live_tiles, num_ctas, smem_per_cta

F32 = jnp.float32
BF16 = jnp.dtype(jnp.bfloat16)
_PART = 32  # rows a ring entry
_PARTS = BLOCK // _PART
_WGS = 2  # warpgroups a CTA: each takes 16 rows of every part and one half's transposed copy
_ROWS = _PART // _WGS
_PIECE = 16  # rows the column encode takes at a time: fewer live registers
_MAX_SLOTS = 3  # a fourth slot (it fits the backward) was slower
# 16 rows by 32 columns a base tile: warps take 4-row groups, a warp's lanes 4 rows by 8 groups
# of 4 consecutive columns; a part's four chunks are four registers of the same lanes.
LAYOUT = plgpu.Layout.TILED(
    plgpu.Tiling(((16, BLOCK_SIZE), (4, BLOCK_SIZE), (4,))),
    warp_dims=(-5,),
    lane_dims=(-3, -2),
    vector_dim=-1,
)


def copies_problem(name: str, h_shape, h_dtype) -> str | None:
    """Why the SwiGLU copies kernel `name` cannot take h [M, 2F] of h_dtype (None: it can): bf16,
    M a multiple of 128 and F of 256, as the activation backward's kernel takes F, so that "auto"
    runs these kernels exactly where it would run that one."""
    m, two_f = h_shape
    return kernel_problem(
        name,
        (m, two_f // 2),
        h_dtype,
        [
            ("bfloat16", lambda m, f: jnp.dtype(h_dtype) == BF16),
            (
                f"M a multiple of {BLOCK} and F of {COLUMNS}",
                lambda m, f: m % BLOCK == 0 and f % COLUMNS == 0,
            ),
        ],
        "FP8 blockwise",
    )


def ring_slots(slots: int | None, windows: int, extra_columns: int = 0) -> int:
    """Input slots of each warpgroup's ring when a part loads `windows` 128-column windows and
    the kernel stages `extra_columns` fp32 columns a row: `slots`, or as many as fit the CTA's
    shared memory beside its tiles (at most 3)."""
    budget = smem_per_cta(1) - _fixed_smem_bytes(extra_columns)
    fit = min(_MAX_SLOTS, budget // (_WGS * _slot_bytes(windows)))
    chosen = fit if slots is None else slots
    if not isinstance(chosen, int) or chosen < 1 or chosen > fit:
        raise ValueError(
            f"{slots!r} slots a warpgroup: the ring takes 1 to {fit} (as many as fit the CTA's "
            f"shared memory, at most {_MAX_SLOTS})"
        )
    return chosen


def _slot_bytes(windows: int) -> int:
    return windows * _ROWS * BLOCK * BF16.itemsize + _PART * 4  # a warpgroup's rows; p


def _fixed_smem_bytes(extra_columns: int) -> int:
    tile = BLOCK * BLOCK
    held = 2 * tile * BF16.itemsize  # both halves' bf16 values
    transposed = 2 * tile + 2 * BLOCK * 4  # a byte tile and column scales per half
    maxima = 2 * _ROWS * BLOCK * 4
    staging = _WGS * (2 * _ROWS * BLOCK + 2 * _ROWS * 4 + _ROWS * extra_columns * 4)
    return held + transposed + maxima + staging + REDUCTION_SCRATCH + SMEM_SLACK


def copies_kernel(
    name: str,
    m: int,
    *,
    column_tiles: int,
    width: int,
    inputs: int,
    sources,
    compute,
    half_column,
    fmt_name: str,
    arithmetic: str,
    slots: int | None,
    counted: bool,
    compiled: bool,
    interpret,
    extra_columns: int = 0,
):
    """The kernel `name` over tiles t of 128 rows (block row rb = t // column_tiles) by column
    tile kb = t % column_tiles. It takes `inputs` bf16 arrays, then p [1, M] fp32, then (with
    `counted`) the live row count [1] int32 (only the 128-row bands holding rows below it run).
    A part loads the windows `sources(kb)`, a list of (input index, first column) of 128
    columns each, and `compute(windows, p)` (fp32 [16, 128] arrays in `LAYOUT`, p broadcast
    along the columns) gives (half 0, half 1, extra) in fp32; the halves are rounded to bf16 and
    are the columns [half_column(h, kb), + 128) of the copies' [M, width] source; extra (fp32
    [16, extra_columns], or None without them) is stored at [rows, kb * extra_columns]. Outputs:
    data [M, width], its scales [width / 128, M], data_t [width, M] (int8) and its scales
    [M / 128, width], then the extra [M, column_tiles * extra_columns]. `compiled`: built for
    the GPU (`jaxmoe.ops.device.compiled_for_gpu`), where the amaxes' magnitudes are PTX
    (`quantize_hopper.magnitude_bits`)."""
    fmt = FORMATS[fmt_name]
    windows = len(sources(0))
    num_tiles = m // BLOCK * column_tiles
    ctas = num_ctas(num_tiles, 1)
    slots = ring_slots(slots, windows, extra_columns)
    row_layout = LAYOUT.reduce(1)

    def body(*refs, in_smem, p_smem, held_smem, t_smem, **scratch):
        arrays, p_gmem = refs[:inputs], refs[inputs]
        live_gmem = refs[inputs + 1] if counted else None
        outputs = refs[inputs + 1 + counted :]
        data_gmem, row_scale_gmem, data_t_gmem, column_scale_gmem = outputs[:4]
        data_smem, row_scale_smem = scratch["data_smem"], scratch["row_scale_smem"]
        column_scale_smem = scratch["column_scale_smem"]
        maxima_smem, loaded = scratch["maxima_smem"], scratch["loaded"]
        parts_done, encodes_done = scratch["parts_done"], scratch["encodes_done"]
        reduced = scratch["reduced"]
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
        tiles = live_tiles(live_gmem, m, BLOCK, column_tiles) if counted else num_tiles
        steps = lax.div(jnp.maximum(tiles - cta + ctas - 1, 0), ctas)
        entries = steps * _PARTS

        def place(entry):
            """(this warpgroup's rows of the part, block row, column tile) of ring entry."""
            t = cta + (entry // _PARTS) * ctas
            rb, kb = t // column_tiles, t % column_tiles
            first = rb * BLOCK + (entry % _PARTS) * _PART + wg * _ROWS
            return pl.ds(first, _ROWS), rb, kb

        def issue(entry, slot):
            rows, _, kb = place(entry)
            part_rows = pl.ds(rows.start - wg * _ROWS, _PART)  # p's copy: 128 bytes at least
            ring = wg * slots + slot
            barrier = loaded.at[ring]
            for a, (source, column) in enumerate(sources(kb)):
                plgpu.copy_gmem_to_smem(
                    arrays[source].at[rows, pl.ds(column, BLOCK)],
                    in_smem.at[ring * windows + a],
                    barrier,
                )
            plgpu.copy_gmem_to_smem(p_gmem.at[pl.ds(0, 1), part_rows], p_smem.at[ring], barrier)

        for entry in range(slots):
            pl.when(entry < entries)(functools.partial(issue, entry, entry))

        def part(step, i, maxima):
            """Part i of the step's tile: this warpgroup's 16 rows of both halves into
            held_smem, their rowwise copies (and the extra) stored; `maxima` (per half)
            updated with their column magnitudes."""
            entry = step * _PARTS + i
            slot = lax.rem(entry, slots)
            ring = wg * slots + slot
            plgpu.barrier_wait(loaded.at[ring])
            loads = [
                plgpu.load(in_smem.at[ring * windows + a], layout=LAYOUT).astype(F32)
                for a in range(windows)
            ]
            p_rows = plgpu.load(p_smem.at[ring, 0, pl.ds(wg * _ROWS, _ROWS)], layout=row_layout)
            plgpu.commit_smem()  # every thread has read the slot before the TMA refills it
            pl.when(entry + slots < entries)(functools.partial(issue, entry + slots, slot))
            p = plgpu.layout_cast(lax.broadcast_in_dim(p_rows, loads[0].shape, (0,)), LAYOUT)
            *halves, extra = compute(loads, p)
            # The staging buffer's last stores (the previous part's) have read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            # Both warpgroups' encodes of the previous tile have read held_smem.
            @pl.when(jnp.logical_and(i == 0, step > 0))
            def _():
                plgpu.barrier_wait(encodes_done.at[0])

            held_rows = pl.ds(i * _PART + wg * _ROWS, _ROWS)
            updated = []
            for half, values in enumerate(halves):
                values = values.astype(BF16)
                held_smem.at[half, held_rows][...] = values
                bits = float32_bits(values)
                magnitudes = magnitude_bits(bits, LAYOUT if compiled else None)
                e = FP8_BLOCKWISE.exponent(jnp.max(magnitudes, axis=1), fmt)
                row_scale_smem.at[wg, half, 0][...] = FP8_BLOCKWISE.stored(e)
                data_smem.at[wg, half][...] = encode_blocks(bits, e, 1, LAYOUT, fmt, arithmetic)
                updated.append(jnp.maximum(maxima[half], magnitudes))
            if extra_columns:
                scratch["extra_smem"].at[wg][...] = extra
            plgpu.commit_smem()
            rows, _, kb = place(entry)
            for half in range(2):
                column = half_column(half, kb)
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
            if extra_columns:
                plgpu.copy_smem_to_gmem(
                    scratch["extra_smem"].at[wg],
                    outputs[4].at[rows, pl.ds(kb * extra_columns, extra_columns)],
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
            met = jnp.maximum(mine, plgpu.load(maxima_smem.at[wg], layout=LAYOUT))

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
                values = plgpu.load(held.at[rows_at], layout=LAYOUT)
                encoded = encode_blocks(float32_bits(values), e, 0, LAYOUT, fmt, arithmetic)
                out.at[rows_at][...] = lax.bitcast_convert_type(encoded, jnp.int8)

            plgpu.barrier_arrive(encodes_done.at[0])
            store_transposed(identity_halves(), out, out, in_place=True)
            plgpu.commit_smem()
            column = half_column(wg, kb)
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

        zeros = plgpu.layout_cast(jnp.zeros((_ROWS, BLOCK), jnp.uint32), LAYOUT)

        def run_step(step, carry):
            maxima = lax.fori_loop(0, _PARTS, lambda i, mx: part(step, i, mx), (zeros, zeros))
            transposed_copy(step, maxima)
            return carry

        lax.fori_loop(0, steps, run_step, None)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(encodes_done.at[0])  # the last tile's, which no part waited for

        plgpu.wait_smem_to_gmem(0)

    out_type = [
        jax.ShapeDtypeStruct((m, width), fmt.dtype),
        jax.ShapeDtypeStruct((width // BLOCK, m), F32),
        jax.ShapeDtypeStruct((width, m), jnp.int8),
        jax.ShapeDtypeStruct((m // BLOCK, width), F32),
    ]
    scratch = dict(
        in_smem=plgpu.SMEM((_WGS * slots * windows, _ROWS, BLOCK), BF16),
        p_smem=plgpu.SMEM((_WGS * slots, 1, _PART), F32),
        held_smem=plgpu.SMEM((2, BLOCK, BLOCK), BF16),
        t_smem=plgpu.SMEM((2, BLOCK, BLOCK), jnp.int8, transforms=BYTE_TILE),
        column_scale_smem=plgpu.SMEM((2, 1, BLOCK), F32),
        maxima_smem=plgpu.SMEM((2, _ROWS, BLOCK), jnp.uint32),
        data_smem=plgpu.SMEM((_WGS, 2, _ROWS, BLOCK), fmt.dtype),
        row_scale_smem=plgpu.SMEM((_WGS, 2, 1, _ROWS), F32),
        loaded=plgpu.Barrier(num_arrivals=windows + 1, num_barriers=_WGS * slots),
        parts_done=plgpu.Barrier(num_arrivals=_WGS, num_barriers=1),
        encodes_done=plgpu.Barrier(num_arrivals=_WGS, num_barriers=1),
        reduced=plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )
    if extra_columns:
        out_type.append(jax.ShapeDtypeStruct((m, column_tiles * extra_columns), F32))
        scratch["extra_smem"] = plgpu.SMEM((_WGS, _ROWS, extra_columns), F32)
    return plgpu.kernel(
        body,
        kernel_name=name,
        out_type=tuple(out_type),
        grid=(ctas,),
        grid_names=("cta",),
        num_threads=_WGS,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
