"""Tile metadata for grouped matmuls, computed outside the matmul kernels.

Kernels stay small: they read, per tile, which group it belongs to and which rows it covers, from
a few int32 arrays. No Python loop over groups is traced, so 256 experts compile as fast as 8.
Group sizes known on the host (numpy, e.g. a dense product's one group) give metadata computed
at trace time (`metadata_scope`): constants of the executable, no kernels at run time. On a
GPU the row tiles of traced group sizes come from one small kernel (`row_tiles_hopper`), off
it from XLA ops.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.ints import cdiv, cdiv_fusible, round_down_fusible
from jaxmoe.ops.checks import known_on_host
from jaxmoe.ops.device import compiled_for_gpu, on_gpu
from jaxmoe.ops.pallas import row_tiles_hopper
from jaxmoe.ops.pallas.hopper import SWIZZLE_ROWS


def metadata_scope(group_sizes):
    """Context for computing tile metadata from group_sizes: evaluated at trace time when their
    values are known on the host (XLA does not fold these reductions of constants itself: on
    the H200 a dense product at 64 tokens ran four small kernels and a copy for them), else
    traced like any other op."""
    return (
        jax.ensure_compile_time_eval() if known_on_host(group_sizes) else contextlib.nullcontext()
    )


GROUP, START, COUNT = range(3)  # the rows of RowTiles.fields


@struct.dataclass
class RowTiles:
    """A static-length list of row tiles over an M-row operand.

    Tile i covers rows [start[i], start[i] + count[i]) of group group[i]; count[i] <= tile_m
    and a tile never crosses a group boundary, so every output row is owned by exactly one tile
    (no atomics). Tiles sit on a grid of tile_m rows anchored at the group's start rounded down
    to `row_align` (TMA into swizzled SMEM needs row offsets that are multiples of 8), so the
    window [load_row(i), load_row(i) + tile_m) with load_row = start rounded down to row_align
    always contains the tile's rows. Tiles of group G (one past the last) cover the rows past
    sum(group_sizes), whose output is zero. Unused tail entries have count == 0. The tiles
    come in ascending row order, so as three contiguous runs:
    [counts[0] matmul tiles | counts[1] zero-region tiles | unused tiles].
    """

    fields: jax.Array  # [3, num_tiles] int32: each tile's group, first row, number of rows
    # [>= G + 2] int32: tiles before group g (g = G: the zero region; G + 1: all); entries past
    # G + 1 unspecified
    bounds: jax.Array
    num_groups: int = struct.field(pytree_node=False)

    @property
    def group(self) -> jax.Array:
        return self.fields[GROUP]

    @property
    def start(self) -> jax.Array:
        return self.fields[START]

    @property
    def count(self) -> jax.Array:
        return self.fields[COUNT]

    @property
    def counts(self) -> jax.Array:
        """[2] int32: matmul tiles, zero-region tiles."""
        matmul, through_zero = self.bounds[self.num_groups], self.bounds[self.num_groups + 1]
        return jnp.stack([matmul, through_zero - matmul])

    @property
    def num_tiles(self) -> int:
        return self.fields.shape[1]


def max_row_tiles(
    num_rows: int, num_groups: int, tile_m: int, row_align: int = SWIZZLE_ROWS
) -> int:
    """Static upper bound on the number of tiles of `row_tiles`: each of the G groups and the
    zero region may start misaligned and end in a partial tile; rounded up to whole TMA stores
    of the list (`row_tiles_hopper.STORE_ALIGN`)."""
    bound = cdiv(num_rows + (row_align - 1) * (num_groups + 1), tile_m) + num_groups + 1
    return cdiv(bound, row_tiles_hopper.STORE_ALIGN) * row_tiles_hopper.STORE_ALIGN


def row_tiles(
    group_sizes: jax.Array,
    num_rows: int,
    tile_m: int,
    row_align: int = SWIZZLE_ROWS,
    *,
    interpret=None,
) -> RowTiles:
    """Split every group (and the zero region past the groups) into tiles of at most tile_m
    rows on a tile_m grid anchored at the group's start rounded down to row_align.

    Traced group sizes on a GPU (`interpret` as the kernels that read the tiles take it): one
    `row_tiles_hopper` kernel where it takes them (few groups and tiles: decode sizes of up to
    62 experts); otherwise `row_tiles_xla`."""
    num_groups = group_sizes.shape[0]
    num_tiles = max_row_tiles(num_rows, num_groups, tile_m, row_align)
    if (
        not known_on_host(group_sizes)
        and on_gpu()
        and compiled_for_gpu(interpret)
        and row_tiles_hopper.supported(num_groups, num_tiles, tile_m, row_align)
    ):
        fields, bounds = row_tiles_hopper.row_tiles_pallas(
            group_sizes, num_rows, tile_m, row_align, num_tiles
        )
        return RowTiles(fields=fields, bounds=bounds, num_groups=num_groups)
    return row_tiles_xla(group_sizes, num_rows, tile_m, row_align)


def row_tiles_xla(
    group_sizes: jax.Array, num_rows: int, tile_m: int, row_align: int = SWIZZLE_ROWS
) -> RowTiles:
    """`row_tiles` in XLA ops, on any device and at trace time.

    Written for XLA's fusion on the GPU, in three passes: (1) each group's first and end row
    from the running sum of the sizes, the same `jnp.cumsum` as the layer plan's block starts
    (`jaxmoe.plan.make_plan`), which XLA computes once for both when the groups are the plan's
    experts; (2) the tile bounds and (3) each tile's fields as a sum of its one owner's values
    (a group, the zero region, or, past all tiles, "unused"), each a comparison of every
    position with every owner summed along the owners (no search or gather). Each pass
    stacks its outputs on a leading axis, one reduction a pass, and the kernels read the
    stacked arrays as they are. (Compiled for Hopper, qwen3_30b's MXFP8 decode forward: two
    kernels for the row tiles of both GEMMs, none for (1), once the divisions by powers of two
    are shifts: `jaxmoe.ints.cdiv_fusible`.)"""
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    group = jnp.arange(num_groups + 1, dtype=jnp.int32)  # the last one: the zero region
    through_groups = jnp.cumsum(sizes)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), through_groups])
    through = jnp.concatenate([through_groups, through_groups[-1:]])
    ends = jnp.where(group < num_groups, through, num_rows)
    anchors = round_down_fusible(starts, row_align)
    tiles_per_group = jnp.where(ends > starts, cdiv_fusible(ends - anchors, tile_m), 0)
    bound = jnp.arange(num_groups + 2, dtype=jnp.int32)
    bounds = jnp.sum(jnp.where(bound[:, None] > group[None, :], tiles_per_group, 0), axis=1)
    num_tiles = max_row_tiles(num_rows, num_groups, tile_m, row_align)
    # Owners: the groups, the zero region and, past all tiles, "unused" (G, 0, 0).
    first_tile, last_tile = bounds, jnp.append(bounds[1:], num_tiles)
    pad = lambda per_group: jnp.append(per_group, 0)  # noqa: E731
    t = jnp.arange(num_tiles, dtype=jnp.int32)[:, None]
    owner = (first_tile <= t) & (t < last_tile)  # [tiles, owners]: one owner per tile
    grid_row = pad(anchors) + (t - first_tile) * tile_m
    first_row = jnp.maximum(pad(starts), grid_row)
    count = jnp.clip(jnp.minimum(pad(ends), grid_row + tile_m) - first_row, 0, tile_m)
    used = bound <= num_groups
    per_owner = jnp.stack(  # GROUP, START, COUNT
        jnp.broadcast_arrays(jnp.minimum(bound, num_groups), jnp.where(used, first_row, 0), count)
    )
    fields = jnp.sum(jnp.where(owner, per_owner, 0), axis=2)
    return RowTiles(fields=fields, bounds=bounds, num_groups=num_groups)


def banded_item(position, kind_tiles, num_columns: int, grid_tile_width: int):
    """The work item at `position` among one kind's items (the matmul tiles' or the zero
    region's: `kind_tiles` row tiles times `num_columns` column tiles): items go by bands of
    `grid_tile_width` column tiles, row tiles ascending (descending in every other band), so
    that CTAs running side by side share lhs rows and rhs columns in L2. Returns (the row tile
    within the kind, the column tile). Integer arithmetic only, on scalars or arrays: each
    kernel computes its items so (no work list, no kernel making one)."""
    width = min(grid_tile_width, num_columns)
    band = position // jnp.maximum(kind_tiles * width, 1)
    band_start = band * width
    band_cols = jnp.minimum(width, num_columns - band_start)  # the last band may be narrower
    within_band = position - band_start * kind_tiles
    row = within_band // band_cols
    row = jnp.where(band % 2 == 1, kind_tiles - 1 - row, row)
    return row, band_start + within_band % band_cols
