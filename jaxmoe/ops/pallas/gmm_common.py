"""What the two Hopper grouped-matmul kernels (`gmm_hopper`: bf16/fp16, `gmm_mxfp8_hopper`:
MXFP8) share: their config, the persistent work loop over (row tile, column tile) items, the
warp-specialised TMA pipeline of each tile, and the epilogue that stores a tile's valid rows.
A kernel module supplies only how a tile's K steps are multiplied (`TileMatmul`).
docs/kernels/gmm.md describes the design."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ops.pallas.hopper import (
    MAX_SMEM_PER_CTA,
    NUM_SMS,
    REGISTERS_PER_SM,
    SWIZZLE_ROWS,
    TMA_SMEM_ALIGN,
    WARPGROUP_THREADS,
)
from jaxmoe.ops.pallas.tiles import COUNT, GROUP, START, banded_item, metadata_scope, row_tiles

NUM_COMPUTE_WGS = 2  # compute warpgroups per CTA; one more warpgroup issues the TMA loads
MEMORY_REGISTERS = 40  # registers per thread of the TMA warpgroup (setmaxnreg)
# What is left of the register file, split between the compute warpgroups (a multiple of 8),
# for kernels that set the registers of their warpgroups themselves (the weight gradients).
COMPUTE_REGISTERS = (
    (REGISTERS_PER_SM // WARPGROUP_THREADS - MEMORY_REGISTERS) // NUM_COMPUTE_WGS // 8 * 8
)
ROW_ALIGN = SWIZZLE_ROWS  # row offsets of lhs tile loads


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Tiling of the forward/dgrad kernels. Each compute warpgroup owns tile_m x tile_n outputs;
    the two warpgroups of a CTA sit side by side along N (wg_split="n": CTA tile
    tile_m x 2*tile_n) or along M (wg_split="m": 2*tile_m x tile_n). overlap_wgmma keeps a K
    step's wgmma running while the next one is issued (its SMEM slot is released one step
    late; bf16 kernel, max_concurrent_steps >= 2 only). epilogue_slots=2 double-buffers the
    epilogue's SMEM tile, so a column chunk is written while the previous one is stored.
    grid_tile_width: width (in column tiles) of the bands of the work order (`tiles.banded_item`).
    cluster_n=2 pairs the CTAs along N, multicasting the lhs tile; the work items then cover
    column-tile pairs. scale_lookahead: how many K steps ahead the FP8-blockwise kernel loads a
    step's scales (they are carried until their step). None of these change the K-reduction
    order. An op given config=None runs its kernel's shape heuristic
    (`gmm_hopper.default_config`, `gmm_mxfp8_hopper.default_mxfp8_config` /
    `default_fp8_blockwise_config`, `gmm_dequantize_hopper.default_dequantize_config`), whose
    choices depend on the shape; these field defaults are not one of them."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4
    epilogue_tile_n: int = 64
    wg_split: str = "n"
    overlap_wgmma: bool = False
    epilogue_slots: int = 1
    cluster_n: int = 1
    scale_lookahead: int = 1
    num_sms: int = NUM_SMS

    @property
    def cta_m(self) -> int:
        """Rows of the CTA tile."""
        return self.tile_m * (NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        """Columns of the CTA tile."""
        return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)

    def smem_bytes(self, in_dtype, out_dtype, scratch_bytes: int = 0) -> int:
        """Shared memory used: the TMA ring of lhs/rhs tiles, the epilogue tiles of both
        compute warpgroups and scratch_bytes of the kernel's own per-CTA scratch."""
        ring = (self.cta_m + self.cta_n) * self.tile_k * jnp.dtype(in_dtype).itemsize
        epilogue = NUM_COMPUTE_WGS * self.epilogue_slots * self.tile_m * self.epilogue_tile_n
        return (
            self.max_concurrent_steps * ring
            + epilogue * jnp.dtype(out_dtype).itemsize
            + scratch_bytes
        )

    def with_fitting_stages(self, in_dtype, out_dtype, scratch_bytes: int = 0) -> GmmConfig:
        """This config with max_concurrent_steps lowered until its shared memory fits a CTA."""
        config = self
        while config.smem_bytes(in_dtype, out_dtype, scratch_bytes) > MAX_SMEM_PER_CTA:
            config = dataclasses.replace(
                config, max_concurrent_steps=config.max_concurrent_steps - 1
            )
        return config

    def validate(
        self,
        num_rows: int,
        k: int,
        n: int,
        in_dtype=jnp.bfloat16,
        out_dtype=jnp.bfloat16,
        transpose_rhs: bool = False,
        scratch_bytes: int = 0,
    ) -> None:
        """Raise ValueError when this config cannot run on the given problem."""
        used = self.smem_bytes(in_dtype, out_dtype, scratch_bytes)
        if used > MAX_SMEM_PER_CTA:
            raise ValueError(
                f"gmm pallas: {self} needs {used} "
                f"bytes of shared memory (> {MAX_SMEM_PER_CTA}); use fewer "
                "max_concurrent_steps or smaller tiles"
            )
        if self.wg_split not in ("n", "m"):
            raise ValueError(f"gmm pallas: wg_split must be 'n' or 'm', got {self.wg_split!r}")
        if self.tile_k % 64:
            raise ValueError(f"gmm pallas: tile_k={self.tile_k} must be a multiple of 64")
        if self.tile_m not in (64, 128) or self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"gmm pallas: unsupported tiles {self}")
        if self.wg_split == "n" and not transpose_rhs and self.tile_n % 64:
            # Each warpgroup slices its columns out of a 128-byte-swizzled rhs tile.
            raise ValueError(f"gmm pallas: wg_split='n' needs tile_n % 64 == 0, got {self.tile_n}")
        if k % self.tile_k:
            raise ValueError(f"gmm pallas: K={k} must be a multiple of tile_k={self.tile_k}")
        if self.max_concurrent_steps > k // self.tile_k:
            raise ValueError(
                f"gmm pallas: max_concurrent_steps={self.max_concurrent_steps} "
                f"exceeds the {k // self.tile_k} K steps"
            )
        if self.scale_lookahead < 1:
            raise ValueError(f"gmm pallas: scale_lookahead={self.scale_lookahead} must be >= 1")
        if self.cluster_n not in (1, 2) or self.num_sms % self.cluster_n:
            raise ValueError(
                f"gmm pallas: cluster_n={self.cluster_n} must be 1 or 2 and divide "
                f"num_sms={self.num_sms}"
            )
        if n % (self.cta_n * self.cluster_n):
            raise ValueError(
                f"gmm pallas: N={n} must be a multiple of the CTA tile {self.cta_n}"
                f" times cluster_n={self.cluster_n}"
            )
        if self.tile_n % self.epilogue_tile_n:
            raise ValueError(
                f"gmm pallas: tile_n={self.tile_n} must be a multiple of "
                f"epilogue_tile_n={self.epilogue_tile_n}"
            )
        if self.epilogue_slots not in (1, 2) or (
            self.epilogue_slots == 2 and (self.tile_n // self.epilogue_tile_n) % 2
        ):
            # The slots alternate chunk by chunk across tiles, so that the newest store always
            # reads the other slot: a tile must have an even number of chunks.
            raise ValueError(
                f"gmm pallas: epilogue_slots={self.epilogue_slots} needs 1, or 2 "
                f"with an even number of epilogue chunks per tile"
            )
        if self.epilogue_tile_n * jnp.dtype(out_dtype).itemsize % TMA_SMEM_ALIGN:
            # The epilogue stores start at any row of the SMEM tile: rows must be 128-byte
            # multiples for TMA (the CPU interpreter does not check this; the GPU faults).
            raise ValueError(
                f"gmm pallas: epilogue_tile_n={self.epilogue_tile_n} x "
                f"{jnp.dtype(out_dtype).name} is not a multiple of "
                f"{TMA_SMEM_ALIGN} bytes"
            )
        if num_rows < self.cta_m or num_rows % ROW_ALIGN:
            raise ValueError(
                f"gmm pallas: M={num_rows} must be >= {self.cta_m} and a multiple of {ROW_ALIGN}"
            )


def aligned_epilogue_tile_n(out_dtype) -> int:
    """Columns of one 128-byte epilogue row (the narrowest TMA-aligned epilogue chunk)."""
    return TMA_SMEM_ALIGN // jnp.dtype(out_dtype).itemsize


def swizzled(dtype, minor_elems: int):
    """SMEM transforms of a tile whose rows of `minor_elems` elements are TMA-loaded: 8-row
    tiling and the widest swizzle the row allows."""
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


class TileGeometry(NamedTuple):
    """Where a work item's rows and columns are, seen by one compute warpgroup."""

    tile: jax.Array  # row tile index
    load_row: jax.Array  # first lhs row of the loaded cta_m-row window (8-aligned)
    gmem_row: jax.Array  # first output row this warpgroup stores
    smem_row: jax.Array  # the same row within the warpgroup's tile_m rows
    count: jax.Array  # rows this warpgroup stores (0 to tile_m)
    column: jax.Array  # first output column of the CTA tile
    wg_column: jax.Array  # first output column of this warpgroup's tile


class TileContext(NamedTuple):
    """What `TileMatmul` gets for one work item.

    run_pipeline(mma, compute_context): runs the tile's K steps through the TMA pipeline;
      mma(step, lhs_smem, rhs_smem, carry) -> carry multiplies one step (the SMEM slot is
      released after it); compute_context(eval_pipeline) wraps the K loop as in
      `plgpu.emit_pipeline_warp_specialized`.
    operands(lhs_smem, rhs_smem): this warpgroup's lhs [tile_m, tile_k] and rhs
      [tile_k, tile_n] views of a step's SMEM tiles.
    finish_pipeline(): after the last K step: retire the wgmma and release the slot kept back
      by a release delay.
    store(acc): the epilogue: stores the valid rows of this warpgroup's fp32 tile.
    group, rows, columns: the item's group and its CTA tile's lhs rows and output columns.
    wg_rows, wg_columns: this warpgroup's share of the CTA tile's rows and columns.
    config: the kernel's config; acc_shape: (tile_m, tile_n), this warpgroup's accumulator.
    release_delay: K steps an SMEM slot is kept after its step (`gmm_kernel_call`).
    inputs: the kernel's extra GMEM inputs (`gmm_kernel_call`).
    scratch: this warpgroup's SMEM scratch buffers (`gmm_kernel_call`'s scratch)."""

    run_pipeline: Callable
    operands: Callable
    finish_pipeline: Callable
    store: Callable
    group: jax.Array
    rows: pl.Slice
    columns: pl.Slice
    wg_rows: pl.Slice
    wg_columns: pl.Slice
    config: GmmConfig
    acc_shape: tuple[int, int]
    release_delay: int
    inputs: tuple
    scratch: tuple = ()


TileMatmul = Callable[[TileContext], None]


def gmm_kernel_call(
    tile_matmul: TileMatmul,
    kernel_name: str,
    lhs,
    rhs,
    extra_inputs,
    group_sizes,
    *,
    n: int,
    out_dtype,
    transpose_rhs: bool,
    swizzle_k: int,
    release_delay: int,
    config: GmmConfig,
    interpret,
    groups_per_weight: int = 1,
    scratch: tuple = (),
    write_rows_past_groups: bool = True,
):
    """Tile the rows by group, order the work items and run the grouped-matmul kernel named
    kernel_name whose tiles `tile_matmul` (a module-level function: it keys the kernel cache)
    multiplies. extra_inputs: GMEM arrays passed on to it (`TileContext.inputs`); swizzle_k:
    the K width the operand tiles are swizzled at; release_delay: K steps an SMEM slot is kept
    after its step (0, or 1 to keep a wgmma in flight); groups_per_weight: group g multiplies
    rhs[g // groups_per_weight] (and the extra inputs' entry of that index); scratch: SMEM
    buffers (`plgpu.SMEM(shape, dtype, transforms=...)`) each compute warpgroup gets for
    itself (`TileContext.scratch`); write_rows_past_groups: False leaves the output rows past
    sum(group_sizes) unwritten (`jaxmoe.ops.live_rows`) instead of zeroing them."""
    num_rows, k = lhs.shape
    with metadata_scope(group_sizes):
        tiles = row_tiles(group_sizes, num_rows, config.cta_m, ROW_ALIGN, interpret=interpret)
    kernel = _build_kernel(
        tile_matmul,
        kernel_name,
        num_rows,
        k,
        n,
        lhs.dtype,
        jnp.dtype(out_dtype),
        transpose_rhs,
        swizzle_k,
        release_delay,
        config,
        interpret,
        scratch,
        tiles.num_groups,
        groups_per_weight,
        write_rows_past_groups,
    )
    return kernel(tiles.bounds, tiles.fields, lhs, rhs, *extra_inputs)


@functools.cache
def _build_kernel(
    tile_matmul,
    kernel_name,
    num_rows,
    k,
    n,
    dtype,
    out_dtype,
    transpose_rhs,
    swizzle_k,
    release_delay,
    config: GmmConfig,
    interpret,
    scratch,
    num_groups: int,
    groups_per_weight: int,
    write_rows_past_groups: bool,
):
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n, epi_n = config.cta_m, config.cta_n, config.epilogue_tile_n
    split_m = config.wg_split == "m"
    num_clusters = config.num_sms // config.cluster_n
    k_steps = k // tile_k
    num_slots = config.max_concurrent_steps
    in_transforms = swizzled(dtype, swizzle_k)
    # Consecutive tiles of one CTA share one pipeline when the K steps divide evenly.
    chained = k_steps % num_slots == 0

    def pipeline(step_body, compute_context, state=None):
        rhs_block = (cta_n, tile_k) if transpose_rhs else (tile_k, cta_n)
        return plgpu.emit_pipeline_warp_specialized(
            step_body,
            grid=(k_steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, tile_k),
                    lambda ki: (0, ki),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                    collective_axes=("cluster",) if config.cluster_n > 1 else (),
                ),
                plgpu.BlockSpec(
                    rhs_block,
                    (lambda ki: (0, ki)) if transpose_rhs else (lambda ki: (ki, 0)),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=num_slots,
            compute_context=compute_context,
            pipeline_state=state,
            # The compute warpgroups release the slots themselves, which the pipeline's own
            # delay_release cannot do across chained pipelines.
            manual_consumed_barriers=True,
        )

    num_columns = n // (cta_n * config.cluster_n)  # column tiles of a cluster's width
    grid_width = config.grid_tile_width

    def grouped_matmul(
        tile_bounds_gmem,
        tile_fields_gmem,
        lhs_gmem,
        rhs_gmem,
        *inputs_and_out,
    ):
        *inputs, out_gmem = inputs_and_out
        ignore = lambda *_, **__: None
        lhs_view = lhs_gmem.at[pl.ds(0, cta_m), :]
        rhs_view = (
            rhs_gmem.at[0, pl.ds(0, cta_n), :]
            if transpose_rhs
            else rhs_gmem.at[0, :, pl.ds(0, cta_n)]
        )

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(lhs_view, rhs_view),
            out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, config.epilogue_slots, tile_m, epi_n), out_dtype),
            scratch_smem=[
                plgpu.SMEM((NUM_COMPUTE_WGS, *b.shape), b.dtype, transforms=b.transforms)
                for b in scratch
            ],
            collective_axes="wg",
        )
        def _scope(allocations, out_smem, scratch_smem):
            wg = lax.axis_index("wg")
            cluster = lax.axis_index("sm")  # one cluster of cluster_n CTAs per work lane
            cta_in_cluster = lax.axis_index("cluster")
            wg_rows = pl.ds(wg * tile_m, tile_m) if split_m else pl.ds(0, tile_m)
            wg_columns = pl.ds(0, tile_n) if split_m else pl.ds(wg * tile_n, tile_n)

            def release(step):
                """Tell the memory warpgroup that K step `step`'s SMEM slot may be refilled."""
                for barrier in allocations["flat_consumed_barrier_refs"]:
                    plgpu.barrier_arrive(barrier.at[lax.rem(step, num_slots)])

            def releasing(mma):
                """The pipeline body: `mma` on this step's tiles, then the slot release."""

                def step_body(step, lhs_smem, rhs_smem, _lhs_consumed, _rhs_consumed, carry):
                    carry = mma(step, lhs_smem, rhs_smem, carry)
                    if release_delay:
                        plgpu.wgmma_wait(1)  # the previous step's wgmma has retired

                        @pl.when(step[0] > 0)
                        def _():
                            release(step[0] - 1)
                    else:
                        release(step[0])
                    return carry

                return step_body

            def finish_pipeline():
                if release_delay:
                    plgpu.wgmma_wait(0)
                    release(k_steps - 1)

            def operands(lhs_smem, rhs_smem):
                rhs = (
                    rhs_smem.at[wg_columns, :].transpose((1, 0))
                    if transpose_rhs
                    else rhs_smem.at[:, wg_columns]
                )
                return lhs_smem.at[wg_rows, :], rhs

            def tile_geometry(tile, column_tile) -> TileGeometry:
                first_row = tile_fields_gmem[START, tile]
                valid_rows = tile_fields_gmem[COUNT, tile]
                # Load cta_m rows from the 8-aligned row at or below the tile's first row; near
                # the end of lhs, shift the window back so it stays in bounds. The valid rows
                # are rows [offset, offset + valid_rows) of the window.
                load_row = pl.multiple_of(
                    jnp.minimum(first_row - first_row % ROW_ALIGN, num_rows - cta_m), ROW_ALIGN
                )
                offset = first_row - load_row
                wg_row = wg * tile_m if split_m else 0
                lo = jnp.maximum(offset, wg_row)
                count = jnp.clip(jnp.minimum(offset + valid_rows, wg_row + tile_m) - lo, 0, tile_m)
                column = (column_tile * config.cluster_n + cta_in_cluster) * cta_n
                return TileGeometry(
                    tile=tile,
                    load_row=load_row,
                    gmem_row=first_row + lo - offset,
                    smem_row=lo - wg_row,
                    count=count,
                    column=column,
                    wg_column=column + (0 if split_m else wg * tile_n),
                )

            def store(acc, geo: TileGeometry):
                # A slot is refilled once the TMA stores that read it are done. Slots alternate
                # chunk by chunk (an even number per tile) and a warpgroup with no rows in the
                # tile skips it, so the newest store group always reads the other slot and
                # waiting for all but `slots - 1` groups suffices, however many stores the row
                # ladder issued. The last chunks' stores drain while the next tile runs.
                slots = config.epilogue_slots

                @pl.when(geo.count > 0)
                def _():
                    for chunk in range(tile_n // epi_n):
                        slot = out_smem.at[wg, chunk % slots]
                        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                        slot[...] = acc[:, chunk * epi_n : (chunk + 1) * epi_n].astype(out_dtype)
                        plgpu.commit_smem()
                        store_rows(
                            slot,
                            out_gmem,
                            geo.gmem_row,
                            geo.smem_row,
                            geo.count,
                            geo.wg_column + chunk * epi_n,
                            tile_m,
                            epi_n,
                        )

            def matmul_item(item, state):
                geo = tile_geometry(*banded_item(item, num_matmul, num_columns, grid_width))
                # The tile's rhs index (the zero region's, past the last, is never read).
                group = tile_fields_gmem[GROUP, geo.tile] // groups_per_weight
                rows, columns = pl.ds(geo.load_row, cta_m), pl.ds(geo.column, cta_n)
                rhs_group = rhs_gmem.at[group]
                rhs_tile = rhs_group.at[columns, :] if transpose_rhs else rhs_group.at[:, columns]

                def run_pipeline(mma, compute_context):
                    pipeline(releasing(mma), compute_context, state)(
                        lhs_gmem.at[rows, :], rhs_tile, allocations=allocations
                    )

                tile_matmul(
                    TileContext(
                        run_pipeline=run_pipeline,
                        operands=operands,
                        finish_pipeline=finish_pipeline,
                        store=lambda acc: store(acc, geo),
                        group=group,
                        rows=rows,
                        columns=columns,
                        wg_rows=wg_rows,
                        wg_columns=wg_columns,
                        config=config,
                        acc_shape=(tile_m, tile_n),
                        release_delay=release_delay,
                        inputs=tuple(inputs),
                        scratch=tuple(buffer.at[wg] for buffer in scratch_smem),
                    )
                )

            # Row tiles are [matmul tiles | zero-region tiles | unused]; each kind's items
            # (tile, column tile) go in `banded_item`'s order, and this CTA's cluster takes
            # every num_clusters-th item of each kind.
            num_matmul = tile_bounds_gmem[num_groups]
            num_zero = tile_bounds_gmem[num_groups + 1] - num_matmul
            item_of = lambda j: cluster + j * num_clusters
            mine = lambda tiles: (  # noqa: E731
                jnp.maximum(tiles * num_columns - cluster + num_clusters - 1, 0) // num_clusters
            )
            run_items(mine(num_matmul), lambda j, state: matmul_item(item_of(j), state), chained)

            if write_rows_past_groups:

                @pl.when(wg < NUM_COMPUTE_WGS)
                def _zero_region():
                    @pl.loop(0, mine(num_zero))
                    def _each_zero(j):
                        tile, column_tile = banded_item(
                            item_of(j), num_zero, num_columns, grid_width
                        )
                        geo = tile_geometry(num_matmul + tile, column_tile)
                        store(zero_accumulator(tile_m, tile_n), geo)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        grouped_matmul,
        kernel_name=kernel_name,
        out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        grid=(num_clusters,),
        grid_names=("sm",),
        cluster=(config.cluster_n,),
        cluster_names=("cluster",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )


def run_items(count, run_item: Callable, chained: bool) -> None:
    """run_item(j, state) for j in [0, count): one warp-specialized pipeline per item, or, when
    `chained`, one pipeline through all of them (`plgpu.PipelinePipeline` states START, STEADY
    ..., STOP; a single item runs alone), so that the memory warpgroup loads the next item's
    first steps while the current item's last ones run."""
    states = plgpu.PipelinePipeline
    if not chained:

        @pl.loop(0, count)
        def _each(j):
            run_item(j, None)

        return

    @pl.when(count == 1)
    def _single():
        run_item(0, None)

    @pl.when(count > 1)
    def _chain():
        run_item(0, states.START)

        @pl.loop(1, count - 1)
        def _steady(j):
            run_item(j, states.STEADY)

        run_item(count - 1, states.STOP)


def zero_accumulator(tile_m: int, tile_n: int) -> jax.Array:
    """An fp32 tile of zeros in the wgmma register layout."""
    return plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA)


def store_rows(tile_smem, out_gmem, gmem_row, smem_row, count, col, tile_m, tile_n):
    """TMA-store `count` rows of the SMEM tile, from smem_row, to out rows from gmem_row. TMA
    boxes have static shapes, so the count is written as a sum of powers of two, one
    conditional store per bit (each to a distinct row range)."""
    done = jnp.int32(0)
    for bit in reversed(range(int(math.log2(tile_m)) + 1)):
        size = 1 << bit
        take = (count & size) != 0

        @pl.when(take)
        def _():
            plgpu.copy_smem_to_gmem(
                tile_smem.at[pl.ds(smem_row + done, size)],
                out_gmem.at[pl.ds(gmem_row + done, size), pl.ds(col, tile_n)],
            )

        done = done + jnp.where(take, size, 0)
