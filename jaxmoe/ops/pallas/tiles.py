"""Tile metadata for grouped matmuls, computed with XLA ops outside the kernels.

Kernels stay small: they read, per tile, which group it belongs to and which rows it covers, from
a few int32 arrays. No Python loop over groups is traced, so 256 experts compile as fast as 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RowTiles:
    """A static-length list of row tiles over an M-row operand.

    Tile i covers rows [row[i], row[i] + rows[i]) of group group[i]; rows[i] <= tile_m and never
    crosses a group boundary, so every output row is owned by exactly one tile (no atomics).
    Tiles sit on a grid of tile_m rows anchored at the group's start rounded down to `row_align`
    (TMA into swizzled SMEM needs row offsets that are multiples of 8), so the window
    [load_row(i), load_row(i) + tile_m) with load_row = row rounded down to row_align always
    contains the tile's rows. Tiles of group G (one past the
    last) cover the rows past sum(group_sizes), whose output is zero. Unused tail entries have
    rows == 0. Real tiles come first, in ascending row order.
    """

    group: jax.Array   # [num_tiles] int32
    row: jax.Array     # [num_tiles] int32
    rows: jax.Array    # [num_tiles] int32

    @property
    def num_tiles(self) -> int:
        return self.group.shape[0]


def max_row_tiles(num_rows: int, num_groups: int, tile_m: int, row_align: int = 8) -> int:
    """Static upper bound on the number of tiles of `row_tiles`: each of the G groups and the
    zero region may start misaligned and end in a partial tile."""
    return -(-(num_rows + (row_align - 1) * (num_groups + 1)) // tile_m) + num_groups + 1


def row_tiles(group_sizes: jax.Array, num_rows: int, tile_m: int,
              row_align: int = 8) -> RowTiles:
    """Split every group (and the zero region past the groups) into tiles of at most tile_m
    rows on a tile_m grid anchored at the group's start rounded down to row_align."""
    num_groups = group_sizes.shape[0]
    sizes = jnp.concatenate([group_sizes.astype(jnp.int32),
                             (num_rows - jnp.sum(group_sizes)).astype(jnp.int32)[None]])
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)[:-1]])
    ends = starts + sizes
    anchors = starts - starts % row_align
    tiles_per_group = jnp.where(sizes > 0, -(-(ends - anchors) // tile_m), 0)
    first_tile = jnp.cumsum(tiles_per_group) - tiles_per_group
    total_tiles = jnp.sum(tiles_per_group)

    num_tiles = max_row_tiles(num_rows, num_groups, tile_m, row_align)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # One fused comparison of every tile with every group end: the default binary search is a
    # loop of small kernels, which cost more than the grouped matmul's tail at 128 experts.
    group = jnp.searchsorted(first_tile + tiles_per_group, tile, side="right",
                             method="compare_all").astype(jnp.int32)
    group = jnp.minimum(group, num_groups)
    grid_row = anchors[group] + (tile - first_tile[group]) * tile_m
    row = jnp.maximum(starts[group], grid_row)
    rows = jnp.clip(jnp.minimum(ends[group], grid_row + tile_m) - row, 0, tile_m)
    used = tile < total_tiles
    return RowTiles(group=jnp.where(used, group, num_groups),
                    row=jnp.where(used, row, 0).astype(jnp.int32),
                    rows=jnp.where(used, rows, 0).astype(jnp.int32))


@struct.dataclass
class WorkList:
    """Work items (row tile, column tile) of a grouped matmul, in execution order.

    Items [0, counts[0]) need a matmul, items [counts[0], counts[0] + counts[1]) cover the rows
    past the groups (zeros), the rest are unused. Within each kind, items go by bands of
    `band_width` column tiles, row tiles ascending (descending in every other band), so that
    CTAs running side by side share lhs rows and rhs columns in L2.
    """

    tile: jax.Array      # [num_items] int32 row-tile index
    column: jax.Array    # [num_items] int32 column-tile index
    counts: jax.Array    # [2] int32: matmul items, zero-region items

    @property
    def num_items(self) -> int:
        return self.tile.shape[0]


def work_list(tiles: RowTiles, num_columns: int, band_width: int, num_groups: int) -> WorkList:
    """Order the (row tile, column tile) pairs as described in `WorkList`."""
    num_tiles = tiles.num_tiles
    width = min(band_width, num_columns)
    item = jnp.arange(num_tiles * num_columns, dtype=jnp.int32)
    band = item // (num_tiles * width)
    band_start = band * width
    band_cols = jnp.minimum(width, num_columns - band_start)   # the last band may be narrower
    within = item - band * num_tiles * width
    row = within // band_cols
    column = band_start + within % band_cols
    row = jnp.where(band % 2 == 1, num_tiles - 1 - row, row)
    has_rows = tiles.rows[row] > 0
    is_matmul = has_rows & (tiles.group[row] < num_groups)
    is_zero = has_rows & (tiles.group[row] == num_groups)
    # A stable partition by kind (matmul, zero, unused) without a sort: each item's position is
    # the number of earlier kinds' items plus its rank within its kind (one scan, one scatter).
    kinds = jnp.stack([is_matmul, is_zero, ~(is_matmul | is_zero)]).astype(jnp.int32)
    rank = jnp.cumsum(kinds, axis=1) - 1
    totals = rank[:, -1] + 1
    kind_start = jnp.cumsum(totals) - totals
    position = jnp.sum(kinds * (rank + kind_start[:, None]), axis=0)
    ordered = jnp.zeros((item.shape[0], 2), jnp.int32).at[position].set(
        jnp.stack([row, column], axis=1).astype(jnp.int32), unique_indices=True)
    return WorkList(tile=ordered[:, 0], column=ordered[:, 1], counts=totals[:2])
