"""Row tiles of a grouped matmul in one small Pallas Mosaic GPU kernel (Hopper).

`tiles.row_tiles` lists, from the group sizes, every row tile's group, first row and row count,
and how many tiles come before each group. With XLA that is three dependent reductions, which
XLA on the H200 compiles into five reduce kernels and a few elementwise ones, each a launch of
about a microsecond at decode sizes. Here one CTA of one warpgroup computes the same arrays in
three passes over [64, C] int32 tiles in registers (64 positions by C groups), each a masked sum
along the groups, with the per-group results going through shared memory from one pass to the
next:

1. each group's first row, end row, tile-grid anchor and tile count (positions: the G groups,
   the zero region past them and the "unused" owner);
2. the tiles before each owner (`RowTiles.bounds`);
3. each tile's owner and its (group, first row, row count) (`RowTiles.fields`).

The output equals `tiles.row_tiles`'s to the bit (`tests/test_row_tiles_pallas.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv

POSITIONS = 64  # the rows of a pass's tile: a wgmma layout's 64 rows
STORE_ALIGN = 4  # int32 elements in the 16 bytes a TMA store of the results moves at least
_STARTS, _ENDS, _ANCHORS, _TILES, _BOUNDS = range(5)  # rows of the per-owner table


def _round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def supported(num_groups: int, tile_m: int, row_align: int) -> bool:
    """Whether the kernel takes these tiles: group sizes a multiple of STORE_ALIGN (the TMA
    load), powers of two for tile_m and row_align."""
    power_of_two = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return num_groups % STORE_ALIGN == 0 and power_of_two(tile_m) and power_of_two(row_align)


def row_tiles_pallas(
    group_sizes: jax.Array,
    num_rows: int,
    tile_m: int,
    row_align: int,
    num_tiles: int,
    *,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """(fields [3, num_tiles], bounds [round_up(G + 2, STORE_ALIGN)]) of `tiles.row_tiles` for
    int32 group_sizes [G] (`supported` must hold; num_tiles a multiple of STORE_ALIGN). The
    entries of bounds past G + 1 are unspecified."""
    (num_groups,) = group_sizes.shape
    if not supported(num_groups, tile_m, row_align) or num_tiles % STORE_ALIGN:
        raise ValueError(
            f"row tiles pallas: G={num_groups}, tile_m={tile_m}, row_align={row_align}, "
            f"num_tiles={num_tiles} not supported"
        )
    kernel = _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret)
    return kernel(group_sizes.astype(jnp.int32))


@functools.cache
def _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret):
    owners = num_groups + 2  # the groups, the zero region, "unused"
    columns = _round_up(owners, 8)  # a pass's tile: [POSITIONS, columns]
    positions = _round_up(owners, POSITIONS)
    table_width = max(positions, columns + 8)  # room for the bounds read one owner ahead
    bounds_len = _round_up(owners, STORE_ALIGN)
    tiles_len = _round_up(num_tiles, POSITIONS)
    tile_layout = plgpu.Layout.WGMMA
    per_position = tile_layout.reduce(1)
    per_column = tile_layout.reduce(0)
    i32 = jnp.int32

    def column_values(ref, offset=0):
        """[POSITIONS, columns]: entry (p, o) = ref[offset + o]."""
        v = plgpu.load(ref.at[pl.ds(offset, columns)], layout=per_column, optimized=False)
        return jnp.broadcast_to(v[None, :], (POSITIONS, columns))

    def iotas(first):
        position = first + plgpu.broadcasted_iota(i32, (POSITIONS, columns), 0, layout=tile_layout)
        column = plgpu.broadcasted_iota(i32, (POSITIONS, columns), 1, layout=tile_layout)
        return position, column

    def masked_sum(mask, values):
        return jnp.sum(jnp.where(mask, values, 0), axis=1)

    def body(
        sizes_gmem, fields_gmem, bounds_gmem, sizes_smem, table, fields_smem, bounds_smem, barrier
    ):
        plgpu.copy_gmem_to_smem(sizes_gmem, sizes_smem.at[pl.ds(0, num_groups)], barrier)
        plgpu.barrier_wait(barrier)

        # 1. Per owner p: first row, end row, anchor, tiles.
        for first in range(0, positions, POSITIONS):
            p, h = iotas(first)
            sizes = jnp.where(h < num_groups, column_values(sizes_smem), 0)
            starts = masked_sum(h < p, sizes)
            own = masked_sum(h == p, sizes)
            p = first + plgpu.broadcasted_iota(i32, (POSITIONS,), 0, layout=per_position)
            ends = jnp.where(p < num_groups, starts + own, num_rows)
            anchors = starts - lax.rem(starts, row_align)
            used = (p <= num_groups) & (ends > starts)
            tiles = jnp.where(used, lax.div(ends - anchors + tile_m - 1, i32(tile_m)), 0)
            for row, value in (
                (_STARTS, starts),
                (_ENDS, ends),
                (_ANCHORS, anchors),
                (_TILES, tiles),
            ):
                table.at[row, pl.ds(first, POSITIONS)][...] = value
        plgpu.commit_smem()

        # 2. Tiles before each owner.
        for first in range(0, positions, POSITIONS):
            p, g = iotas(first)
            bounds = masked_sum(g < p, column_values(table.at[_TILES]))
            table.at[_BOUNDS, pl.ds(first, POSITIONS)][...] = bounds
        plgpu.commit_smem()

        # 3. Each tile's owner o and its fields; owner G + 1 ("unused") takes the tiles past
        # all others and gives (G, 0, 0).
        first_tile = column_values(table.at[_BOUNDS])
        last_tile = column_values(table.at[_BOUNDS], 1)
        starts = column_values(table.at[_STARTS])
        ends = column_values(table.at[_ENDS])
        anchors = column_values(table.at[_ANCHORS])
        for first in range(0, tiles_len, POSITIONS):
            t, o = iotas(first)
            last = jnp.where(o == num_groups + 1, num_tiles, last_tile)
            owner = (first_tile <= t) & (t < last) & (o < owners)
            real = owner & (o <= num_groups)
            grid_row = anchors + (t - first_tile) * tile_m
            first_row = jnp.maximum(starts, grid_row)
            count = jnp.clip(jnp.minimum(ends, grid_row + tile_m) - first_row, 0, tile_m)
            rows = pl.ds(first, POSITIONS)
            fields_smem.at[0, rows][...] = masked_sum(owner, jnp.minimum(o, num_groups))
            fields_smem.at[1, rows][...] = masked_sum(real, first_row)
            fields_smem.at[2, rows][...] = masked_sum(real, count)
        bounds_smem[...] = plgpu.load(table.at[_BOUNDS, pl.ds(0, bounds_len)], optimized=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(fields_smem.at[:, pl.ds(0, num_tiles)], fields_gmem)
        plgpu.copy_smem_to_gmem(bounds_smem, bounds_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        kernel_name="row_tiles",
        out_type=(
            jax.ShapeDtypeStruct((3, num_tiles), i32),
            jax.ShapeDtypeStruct((bounds_len,), i32),
        ),
        scratch_types=(
            plgpu.SMEM((table_width,), i32),
            plgpu.SMEM((5, table_width + 8), i32),
            plgpu.SMEM((3, tiles_len), i32),
            plgpu.SMEM((bounds_len,), i32),
            plgpu.Barrier(),
        ),
        interpret=interpret,
    )
