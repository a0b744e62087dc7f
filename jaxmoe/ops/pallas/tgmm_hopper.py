"""Grouped weight-gradient kernel for Hopper (Pallas Mosaic GPU), bf16/fp16 in, fp32 acc:
out[g] = lhs[rows of g]^T @ rhs[rows of g], lhs [M, K], rhs [M, N], out [G, K, N].

Persistent and warp specialised: one TMA ring runs across a CTA's work items; row blocks that
hold other groups' rows are loaded from zero-masked copies, so no group sees another's values.
A row's place in the reduction depends only on its group's rows and the group's start modulo
16, not on the config. docs/kernels/gmm.md describes the design."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.gmm_common import (
    COMPUTE_REGISTERS,
    MEMORY_REGISTERS,
    NUM_COMPUTE_WGS,
    ROW_ALIGN,
    swizzled,
)
from jaxmoe.ops.pallas.hopper import MAX_SMEM_PER_CTA, NUM_SMS
from jaxmoe.ops.pallas.tiles import metadata_scope

MIN_EPILOGUE_BYTES = 32  # narrowest epilogue row (bytes): one 32-byte swizzle span


class GroupWalk(NamedTuple):
    """Per group, in the order the work items walk the groups: the group, its rows
    [start, end), the anchor of its row blocks and their number. Stacked into one [5, G] int32
    kernel input (one load per field, no dependent index load)."""

    group: jax.Array
    start: jax.Array
    end: jax.Array
    anchor: jax.Array
    blocks: jax.Array


class TileDest(NamedTuple):
    """Where an output tile goes: out[group, ki-th K tile, ni-th N tile]."""

    group: jax.Array
    ki: jax.Array
    ni: jax.Array


class WorkItem(NamedTuple):
    """A work item: its group's `GroupWalk` fields and its output tile's K and N index."""

    walk: GroupWalk
    ki: jax.Array
    ni: jax.Array

    @property
    def dest(self) -> TileDest:
        return TileDest(self.walk.group, self.ki, self.ni)


class PendingTile(NamedTuple):
    """A finished tile (cast to the output dtype) waiting in registers to be stored."""

    values: jax.Array
    dest: TileDest
    valid: jax.Array


class ComputeCarry(NamedTuple):
    """The compute warpgroups' loop carry over their work items: `step` counts the CTA's row
    blocks; `item` and `next_item` are this and the next iteration's items; `acquired` says
    whether this item's first block was already acquired; `pending` is the previous item's
    finished tile with overlap_epilogue, else None."""

    step: jax.Array
    item: WorkItem
    next_item: WorkItem
    acquired: jax.Array
    pending: PendingTile | None


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
    """Tiling of the weight-gradient kernel. Each compute warpgroup owns tile_k x tile_n outputs
    (an fp32 accumulator in registers); the two sit along K (wg_split="k": CTA tile
    2*tile_k x tile_n) or along N (wg_split="n": tile_k x 2*tile_n). A pipeline step multiplies
    tile_rows rows; the ring has max_concurrent_steps SMEM slots. The epilogue stores
    epilogue_tile_n columns at a time through epilogue_slots SMEM buffers per warpgroup (None:
    the widest chunk that fits next to the ring). grid_tile_width: band width (in N tiles) of
    the snake order of a group's tiles. balanced_schedule: walk the groups by decreasing row
    count and deal each round of items to the SMs in alternating directions (else: groups in
    order, every round dealt from SM 0). overlap_epilogue: a warpgroup keeps its finished tile
    (cast to the 16-bit output dtype) in registers and stores it while the next item's first
    wgmma runs, instead of between the two items. piece_rows: rows per TMA copy of a row block
    that holds other groups' rows (docs/kernels/gmm.md). None of these change the
    reduction order. An op given config=None runs `default_tgmm_config`, the shape heuristic:
    these field defaults where the CTA tile divides K x N, with the epilogue overlapped for
    16-bit outputs and the machine's SM count."""

    tile_k: int = 128
    tile_n: int = 128
    wg_split: str = "k"
    tile_rows: int = 64
    max_concurrent_steps: int = 4
    epilogue_tile_n: int | None = None
    epilogue_slots: int = 1
    grid_tile_width: int = 8
    balanced_schedule: bool = True
    overlap_epilogue: bool = False
    piece_rows: int = 16
    num_sms: int = NUM_SMS

    @property
    def cta_k(self) -> int:
        return self.tile_k * (NUM_COMPUTE_WGS if self.wg_split == "k" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)

    def ring_bytes(self, in_dtype) -> int:
        """Shared memory of the TMA ring (an lhs and an rhs row block per slot)."""
        return (
            self.max_concurrent_steps
            * self.tile_rows
            * (self.cta_k + self.cta_n)
            * jnp.dtype(in_dtype).itemsize
        )

    def epilogue_bytes(self, epilogue_n: int, out_dtype) -> int:
        """Shared memory of the epilogue buffers with epilogue_n-column chunks."""
        return (
            NUM_COMPUTE_WGS
            * self.epilogue_slots
            * self.tile_k
            * epilogue_n
            * jnp.dtype(out_dtype).itemsize
        )

    def epilogue_n(self, in_dtype, out_dtype) -> int:
        """Columns per epilogue chunk: epilogue_tile_n, or for None the widest power-of-two
        fraction of tile_n (at least MIN_EPILOGUE_BYTES wide; an even number of chunks with two
        slots) that fits in shared memory next to the ring, else the narrowest such."""
        if self.epilogue_tile_n is not None:
            return self.epilogue_tile_n
        out_bytes = jnp.dtype(out_dtype).itemsize
        candidates = [
            self.tile_n >> i
            for i in range(self.tile_n.bit_length())
            if (self.tile_n >> i) * out_bytes >= MIN_EPILOGUE_BYTES
            and (self.epilogue_slots == 1 or i > 0)
        ]
        if not candidates:
            return self.tile_n
        for cols in candidates:
            if self.ring_bytes(in_dtype) + self.epilogue_bytes(cols, out_dtype) <= MAX_SMEM_PER_CTA:
                return cols
        return candidates[-1]

    def smem_bytes(self, in_dtype, out_dtype) -> int:
        """Shared memory used: the TMA ring plus the epilogue buffers."""
        return self.ring_bytes(in_dtype) + self.epilogue_bytes(
            self.epilogue_n(in_dtype, out_dtype), out_dtype
        )

    def validate(
        self, num_rows: int, k: int, n: int, in_dtype=jnp.bfloat16, out_dtype=jnp.float32
    ) -> None:
        """Raise ValueError when this config cannot run on the given problem."""
        if self.wg_split not in ("k", "n"):
            raise ValueError(f"tgmm pallas: wg_split must be 'k' or 'n', got {self.wg_split!r}")
        if self.tile_k not in (64, 128):
            raise ValueError(
                f"tgmm pallas: tile_k={self.tile_k} must be 64 or 128 (the wgmma "
                "M dimension of one warpgroup)"
            )
        if self.tile_n not in (32, 64, 128, 256) or self.tile_k * self.tile_n > 128 * 128:
            raise ValueError(
                f"tgmm pallas: tile_n={self.tile_n} must be 32, 64, 128 or 256 "
                "with tile_k * tile_n <= 128 * 128 (the fp32 accumulator takes "
                "tile_k * tile_n / 128 registers per thread)"
            )
        if self.tile_rows <= 0 or self.tile_rows % 64:
            # The rows are wgmma's K: a multiple of the 128-byte swizzle width (64 bf16 rows).
            raise ValueError(f"tgmm pallas: tile_rows={self.tile_rows} must be a multiple of 64")
        if self.piece_rows % ROW_ALIGN or self.piece_rows <= 0 or self.tile_rows % self.piece_rows:
            raise ValueError(
                f"tgmm pallas: piece_rows={self.piece_rows} must be a positive "
                f"multiple of {ROW_ALIGN} that divides tile_rows={self.tile_rows}"
            )
        if self.max_concurrent_steps < 2:
            raise ValueError(
                f"tgmm pallas: max_concurrent_steps={self.max_concurrent_steps} "
                "must be >= 2 (a slot stays in use while its wgmma is in flight)"
            )
        if self.num_sms < 1 or self.grid_tile_width < 1:
            raise ValueError(
                f"tgmm pallas: num_sms={self.num_sms} and grid_tile_width="
                f"{self.grid_tile_width} must be positive"
            )
        if k % self.cta_k or n % self.cta_n:
            raise ValueError(
                f"tgmm pallas: K={k}, N={n} must be multiples of the CTA tile "
                f"{self.cta_k} x {self.cta_n} (tile_k={self.tile_k}, "
                f"tile_n={self.tile_n}, wg_split={self.wg_split!r})"
            )
        if self.overlap_epilogue and jnp.dtype(out_dtype).itemsize != 2:
            # The finished tile waits in registers next to the next item's accumulator.
            raise ValueError(
                "tgmm pallas: overlap_epilogue needs a 16-bit output dtype, got "
                f"{jnp.dtype(out_dtype).name}"
            )
        if self.epilogue_slots not in (1, 2):
            raise ValueError(f"tgmm pallas: epilogue_slots={self.epilogue_slots} must be 1 or 2")
        epilogue_n = self.epilogue_n(in_dtype, out_dtype)
        if (
            epilogue_n <= 0
            or self.tile_n % epilogue_n
            or epilogue_n * jnp.dtype(out_dtype).itemsize < MIN_EPILOGUE_BYTES
            or (self.epilogue_slots == 2 and (self.tile_n // epilogue_n) % 2)
        ):
            # Two slots alternate chunk by chunk across items, so that the newest store in
            # flight always reads the other slot: an item must have an even number of chunks.
            raise ValueError(
                f"tgmm pallas: epilogue chunks of {epilogue_n} columns must divide "
                f"tile_n={self.tile_n}, be >= {MIN_EPILOGUE_BYTES} bytes wide and "
                f"come in an even number with epilogue_slots=2"
            )
        if self.smem_bytes(in_dtype, out_dtype) > MAX_SMEM_PER_CTA:
            raise ValueError(
                f"tgmm pallas: {self} needs {self.smem_bytes(in_dtype, out_dtype)} "
                f"bytes of shared memory (> {MAX_SMEM_PER_CTA}); use fewer "
                "max_concurrent_steps, a narrower epilogue or smaller tiles"
            )


def default_tgmm_config(num_rows: int, k: int, n: int, out_dtype=jnp.float32) -> TgmmConfig:
    """Shape-based heuristic: the largest CTA tile that divides K x N, 256 x 128 (two 128 x 128
    warpgroup tiles along K) first; 64-row steps, 4 of them in flight; the epilogue overlapped
    with the next item for 16-bit outputs; boundary blocks in 16-row pieces (8-, 32- and 64-row
    pieces were slower). The kernel experiments in docs/notes/ have the sweeps."""
    if k % 64 or n % 64:
        raise ValueError(f"tgmm pallas: K={k} and N={n} must be multiples of 64")
    for split, tile_k, tile_n in (
        ("k", 128, 128),
        ("n", 128, 128),
        ("k", 64, 128),
        ("k", 64, 64),
        ("n", 64, 64),
        ("n", 64, 32),
    ):
        config = TgmmConfig(
            tile_k=tile_k,
            tile_n=tile_n,
            wg_split=split,
            overlap_epilogue=jnp.dtype(out_dtype).itemsize == 2,
            num_sms=num_sms(),
        )
        if k % config.cta_k == 0 and n % config.cta_n == 0:
            return config
    raise AssertionError("unreachable: the last candidate divides multiples of 64")


def tgmm_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype,
    config: TgmmConfig | None = None,
    interpret=None,
) -> jax.Array:
    """The kernel behind `jaxmoe.ops.tgmm(impl="pallas")`: out [G, K, N] in out_dtype from
    lhs [M, K] and rhs [M, N] (both bf16 or both fp16). config: None for `default_tgmm_config`."""
    num_rows, k = lhs.shape
    n = rhs.shape[1]
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"tgmm pallas: lhs and rhs must both be bf16 or fp16, got {lhs.dtype}, {rhs.dtype}"
        )
    config = config or default_tgmm_config(num_rows, k, n, out_dtype)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype)
    with metadata_scope(group_sizes):
        sizes = group_sizes.astype(jnp.int32)
        starts = jnp.cumsum(sizes) - sizes
        ends = starts + sizes
        anchors = starts - starts % ROW_ALIGN
        num_blocks = jnp.where(sizes > 0, cdiv(ends - anchors, config.tile_rows), 0)
        # Work items are (group, K tile, N tile), group by group in this order. Items of one group
        # cost the same, so with the groups by decreasing size each round of num_sms consecutive
        # items is nearly uniform, and dealing alternate rounds in reverse evens out the rest.
        order = (
            jnp.argsort(-num_blocks, stable=True).astype(jnp.int32)
            if config.balanced_schedule
            else jnp.arange(sizes.shape[0], dtype=jnp.int32)
        )
        walk = jnp.stack(
            GroupWalk(
                group=order,
                start=starts[order],
                end=ends[order],
                anchor=anchors[order],
                blocks=num_blocks[order],
            )
        )
        bounds = (starts, ends, anchors, config.piece_rows)
        pieces = boundary_pieces(lhs, *bounds), boundary_pieces(rhs, *bounds)
    kernel = _build_kernel(
        num_rows, k, n, sizes.shape[0], lhs.dtype, jnp.dtype(out_dtype), config, interpret
    )
    return kernel(walk, lhs, rhs, *pieces)


def last_piece_row(start, end, anchor, piece_rows: int):
    """First row of the piece (on the anchor's grid) that holds the group's last row."""
    return anchor + lax.div(jnp.maximum(end - 1 - anchor, 0), piece_rows) * piece_rows


def boundary_pieces(x: jax.Array, starts, ends, anchors, piece_rows: int) -> jax.Array:
    """The pieces of x [M, W] that hold each group's first and last row (rows anchor + [0,
    piece_rows) and `last_piece_row` + [0, piece_rows)) with the rows outside the group
    [start, end) set to zero, then one zero piece: [(2G + 1) * piece_rows, W], group g's pieces
    at rows (2g + last) * piece_rows. The kernel loads these in place of pieces that hold
    foreign rows. (One gather and select: the zero piece is a piece with no rows kept.)"""
    firsts = jnp.stack([anchors, last_piece_row(starts, ends, anchors, piece_rows)], axis=1)
    firsts = jnp.append(firsts.reshape(-1), 0)
    lo = jnp.append(jnp.repeat(starts, 2), 0)
    hi = jnp.append(jnp.repeat(ends, 2), 0)
    rows = firsts[:, None] + jnp.arange(piece_rows)
    keep = (rows >= lo[:, None]) & (rows < hi[:, None])
    gathered = jnp.take(x, jnp.clip(rows, 0, x.shape[0] - 1).reshape(-1), axis=0)
    return jnp.where(keep.reshape(-1, 1), gathered, jnp.zeros((), x.dtype))


@functools.cache
def _build_kernel(num_rows, k, n, num_groups, dtype, out_dtype, config: TgmmConfig, interpret):
    tile_k, tile_n, tile_rows = config.tile_k, config.tile_n, config.tile_rows
    cta_k, cta_n = config.cta_k, config.cta_n
    split_k = config.wg_split == "k"
    grid_k, grid_n = k // cta_k, n // cta_n
    per_group = grid_k * grid_n
    num_items = num_groups * per_group
    num_sms, num_slots = config.num_sms, config.max_concurrent_steps
    epi_n, epi_slots = config.epilogue_n(dtype, out_dtype), config.epilogue_slots
    piece_rows = config.piece_rows
    pieces_per_block = tile_rows // piece_rows
    # Swizzle at the width one warpgroup multiplies (for the operand both share, its full
    # width), so that each warpgroup's slice starts on a swizzle tile; wgmma wants one swizzle
    # for both operands.
    lhs_transforms = rhs_transforms = swizzled(dtype, min(tile_k, tile_n))

    full_rounds, last_round = divmod(num_items, num_sms)

    def lane(sm, j):
        """The position of CTA `sm` in round j (alternate rounds reversed when balanced)."""
        if not config.balanced_schedule:
            return sm
        return jnp.where(j % 2 == 0, sm, num_sms - 1 - sm)

    def weight_gradient(walk_gmem, lhs_gmem, rhs_gmem, lhs_pieces_gmem, rhs_pieces_gmem, out_gmem):
        sm = lax.axis_index("sm")
        num_mine = full_rounds + (lane(sm, full_rounds) < last_round).astype(jnp.int32)

        def load_item(j) -> WorkItem:
            """The CTA's j-th work item (clamped to a valid item)."""
            idx = jnp.minimum(j * num_sms + lane(sm, j), num_items - 1)
            rank = lax.div(idx, per_group)
            ki, ni = plgpu.planar_snake(
                lax.rem(idx, per_group), (grid_k, grid_n), 1, config.grid_tile_width
            )
            walk = GroupWalk(*(walk_gmem[f, rank] for f in range(len(GroupWalk._fields))))
            return WorkItem(walk, ki, ni)

        @functools.partial(
            pl.run_scoped,
            lhs_ring=plgpu.SMEM((num_slots, tile_rows, cta_k), dtype, transforms=lhs_transforms),
            rhs_ring=plgpu.SMEM((num_slots, tile_rows, cta_n), dtype, transforms=rhs_transforms),
            out_smem=plgpu.SMEM(
                (NUM_COMPUTE_WGS, epi_slots, tile_k, epi_n),
                out_dtype,
                transforms=swizzled(out_dtype, epi_n),
            ),
            # TMA landed (an arrival per piece and operand, see load_block); slot free (both
            # compute warpgroups).
            produced=plgpu.Barrier(num_arrivals=2 * pieces_per_block, num_barriers=num_slots),
            consumed=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=num_slots),
            collective_axes="wg",
        )
        def _scope(lhs_ring, rhs_ring, out_smem, produced, consumed):
            wg = lax.axis_index("wg")

            def memory_warpgroup():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def copy_rows(sources, source_row, slot, dest_row, rows, item: WorkItem):
                    """TMA `rows` rows of the item's lhs and rhs columns from `sources` (an lhs
                    and an rhs array) at source_row into ring slot `slot` at dest_row."""
                    for src, ring, col in zip(
                        sources, (lhs_ring, rhs_ring), (item.ki * cta_k, item.ni * cta_n)
                    ):
                        plgpu.copy_gmem_to_smem(
                            src.at[
                                pl.ds(pl.multiple_of(source_row, ROW_ALIGN), rows),
                                pl.ds(col, ring.shape[2]),
                            ],
                            ring.at[slot, pl.ds(dest_row, rows)],
                            produced.at[slot],
                        )

                def load_block(item: WorkItem, slot, row):
                    """Load the row block at `row` (on the anchor's 8-row grid). A block inside
                    the group is one copy per operand; one holding foreign rows (or rows past M)
                    is copied piece by piece from the group's rows, its zero-masked boundary
                    pieces and the zero piece. The barrier counts pieces_per_block arrivals per
                    operand either way."""
                    start, end, anchor = item.walk.start, item.walk.end, item.walk.anchor
                    foreign = (start > row) | (end < row + tile_rows)

                    @pl.when(jnp.logical_not(foreign))
                    def _inside():
                        copy_rows((lhs_gmem, rhs_gmem), row, slot, 0, tile_rows, item)
                        for _ in range(2 * (pieces_per_block - 1)):
                            plgpu.barrier_arrive(produced.at[slot])

                    @pl.when(foreign)
                    def _boundary():
                        last = last_piece_row(start, end, anchor, piece_rows)
                        pieces = (lhs_pieces_gmem, rhs_pieces_gmem)
                        for p in range(pieces_per_block):
                            lo = row + p * piece_rows
                            inside = (lo >= start) & (lo + piece_rows <= end)
                            masked_piece = jnp.where(
                                lo == anchor,
                                2 * item.walk.group,
                                jnp.where(lo == last, 2 * item.walk.group + 1, 2 * num_groups),
                            )

                            @pl.when(inside)
                            def _group_rows():
                                copy_rows(
                                    (lhs_gmem, rhs_gmem), lo, slot, p * piece_rows, piece_rows, item
                                )

                            @pl.when(jnp.logical_not(inside))
                            def _masked_rows():
                                copy_rows(
                                    pieces,
                                    masked_piece * piece_rows,
                                    slot,
                                    p * piece_rows,
                                    piece_rows,
                                    item,
                                )

                def load_blocks(j, carry):
                    """TMA loads of all row blocks of item j; `step` counts the CTA's blocks."""
                    step, item = carry
                    next_item = load_item(j + 1)  # prefetched: used by the next iteration

                    @pl.loop(0, item.walk.blocks)
                    def _load_block(b):
                        t = step + b
                        slot = lax.rem(t, num_slots)

                        @pl.when(t >= num_slots)
                        def _wait_free():  # both compute warpgroups are done with t - slots
                            plgpu.barrier_wait(consumed.at[slot])

                        load_block(item, slot, item.walk.anchor + b * tile_rows)

                    return step + item.walk.blocks, next_item

                num_steps, _ = lax.fori_loop(0, num_mine, load_blocks, (jnp.int32(0), load_item(0)))

                # Observe the releases of the last slots too (the barriers' phases then match
                # in every warpgroup when they are deallocated).
                @pl.loop(jnp.maximum(num_steps - num_slots, 0), num_steps)
                def _quiesce(t):
                    plgpu.barrier_wait(consumed.at[lax.rem(t, num_slots)])

            def acquire(t):
                """Wait for the TMA of step t."""
                plgpu.barrier_wait(produced.at[lax.rem(t, num_slots)])

            def release(t):
                plgpu.barrier_arrive(consumed.at[lax.rem(t, num_slots)])

            def store(acc, dest: TileDest):
                """Cast and TMA-store this warpgroup's tile; the stores are left in flight."""
                row = dest.ki * cta_k + (wg * tile_k if split_k else 0)
                col = dest.ni * cta_n + (0 if split_k else wg * tile_n)
                for c in range(tile_n // epi_n):
                    # Slots alternate chunk by chunk (an even number per item with two slots),
                    # so the newest store in flight always reads the other slot.
                    slot = out_smem.at[wg, c % epi_slots]
                    plgpu.wait_smem_to_gmem(epi_slots - 1, wait_read_only=True)
                    slot[...] = acc[:, c * epi_n : (c + 1) * epi_n].astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        slot,
                        out_gmem.at[dest.group, pl.ds(row, tile_k), pl.ds(col + c * epi_n, epi_n)],
                    )

            def compute_warpgroup():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                def flush(pending: PendingTile):
                    """Store a finished tile if it is valid."""

                    @pl.when(pending.valid)
                    def _():
                        store(pending.values, pending.dest)

                def matmul_item(j, carry: ComputeCarry) -> ComputeCarry:
                    # Row block t + 1 is acquired while the wgmma of block t runs, across items
                    # too: `acquired` says whether this item's first block already was (it was
                    # unless this is the CTA's first item or the previous item was empty).
                    # With overlap_epilogue, `pending` is the previous item's finished tile,
                    # stored while this item's first wgmma runs.
                    # The next item's metadata was loaded an iteration ago (it is needed at
                    # this item's last block); the one after it loads now.
                    step, item, next_item, acquired, pending = carry
                    after_next = load_item(j + 2)
                    blocks = item.walk.blocks
                    next_step = step + blocks
                    has_next = (j + 1 < num_mine) & (next_item.walk.blocks > 0)

                    @pl.when(jnp.logical_not(acquired) & (blocks > 0))
                    def _acquire_first():
                        acquire(step)

                    if pending is not None:

                        @pl.when(blocks == 0)
                        def _flush_without_wgmma():
                            flush(pending)

                    def block(acc_ref, b, first):
                        t = step + b
                        slot = lax.rem(t, num_slots)
                        lhs_smem, rhs_smem = lhs_ring.at[slot], rhs_ring.at[slot]
                        if split_k:
                            a = lhs_smem.at[:, pl.ds(wg * tile_k, tile_k)]
                            b_op = rhs_smem
                        else:
                            a = lhs_smem
                            b_op = rhs_smem.at[:, pl.ds(wg * tile_n, tile_n)]
                        plgpu.wgmma(acc_ref, a.transpose((1, 0)), b_op)
                        plgpu.wgmma_wait(1)  # the previous block's wgmma retired
                        if first:
                            if pending is not None:
                                flush(pending)
                        else:
                            release(t - 1)

                        # Acquire block t + 1 (this item's next block, or the next item's
                        # first) under wgmma t. Its slot differs from t's (2+ slots) and its
                        # load only needed the slots released so far.
                        @pl.when((b < blocks - 1) | has_next)
                        def _acquire_next():
                            acquire(t + 1)

                    def acc_scope(acc_ref):
                        @pl.when(blocks > 0)
                        def _first_block():
                            block(acc_ref, 0, first=True)

                        @pl.loop(1, blocks)
                        def _block(b):
                            block(acc_ref, b, first=False)

                        @pl.when(blocks > 0)
                        def _release_last():
                            plgpu.wgmma_wait(0)
                            release(next_step - 1)

                        return acc_ref[...]

                    acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_k, tile_n)))  # starts at 0
                    tile = acc.astype(out_dtype)
                    if pending is not None:
                        pending = PendingTile(tile, item.dest, jnp.bool_(True))
                    else:
                        store(tile, item.dest)
                    return ComputeCarry(next_step, next_item, after_next, blocks > 0, pending)

                nothing = None
                if config.overlap_epilogue:
                    zero = jnp.int32(0)
                    nothing = PendingTile(
                        plgpu.layout_cast(
                            jnp.zeros((tile_k, tile_n), out_dtype), plgpu.Layout.WGMMA
                        ),
                        TileDest(zero, zero, zero),
                        jnp.bool_(False),
                    )
                carry = ComputeCarry(
                    jnp.int32(0), load_item(0), load_item(1), jnp.bool_(False), nothing
                )
                pending = lax.fori_loop(0, num_mine, matmul_item, carry).pending
                if pending is not None:
                    flush(pending)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            lax.cond(wg == NUM_COMPUTE_WGS, memory_warpgroup, compute_warpgroup)

    return plgpu.kernel(
        weight_gradient,
        kernel_name="tgmm",
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
