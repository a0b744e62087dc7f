"""Tile metadata of the grouped-matmul kernels (`jaxmoe.ops.pallas.tiles`), against numpy
restatements of its documented order."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.pallas.tiles import banded_item, max_row_tiles, row_tiles


def random_groups(rng, max_groups, max_row_cells):
    """(num_groups, num_rows, sizes): a multiple of 8 rows, some past the groups, about 30% of
    the groups empty."""
    num_groups = int(rng.integers(1, max_groups))
    num_rows = int(rng.integers(1, max_row_cells)) * 8
    sizes = rng.multinomial(int(rng.integers(0, num_rows + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    return num_groups, num_rows, sizes


def reference_work_order(rows, group, num_groups, num_columns, grid_tile_width):
    """Items in bands of `grid_tile_width` columns (rows reversed in odd bands), then stably sorted
    by kind: matmul items, zero-region items, unused items."""
    num_tiles = rows.shape[0]
    width = min(grid_tile_width, num_columns)
    item = np.arange(num_tiles * num_columns)
    band = item // (num_tiles * width)
    band_cols = np.minimum(width, num_columns - band * width)
    within = item - band * num_tiles * width
    row = within // band_cols
    column = band * width + within % band_cols
    row = np.where(band % 2 == 1, num_tiles - 1 - row, row)
    is_matmul = (rows[row] > 0) & (group[row] < num_groups)
    is_zero = (rows[row] > 0) & (group[row] == num_groups)
    order = np.argsort(np.where(is_matmul, 0, np.where(is_zero, 1, 2)), kind="stable")
    return row[order], column[order], [int(is_matmul.sum()), int(is_zero.sum())]


@pytest.mark.parametrize("seed", range(8))
def test_banded_items_are_the_banded_order_stably_partitioned_by_kind(seed):
    """The kernels' items: each kind's positions through `banded_item`, matmul tiles first."""
    rng = np.random.default_rng(seed)
    num_groups, num_rows, sizes = random_groups(rng, 20, 250)
    tiles = row_tiles(jnp.asarray(sizes, jnp.int32), num_rows, 64)
    num_columns, grid_tile_width = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    num_matmul, num_zero = np.asarray(tiles.counts).tolist()
    rows, columns = [], []
    for first, kind_tiles in [(0, num_matmul), (num_matmul, num_zero)]:
        position = jnp.arange(kind_tiles * num_columns, dtype=jnp.int32)
        row, column = banded_item(position, kind_tiles, num_columns, grid_tile_width)
        rows.append(first + np.asarray(row))
        columns.append(np.asarray(column))
    row, column, counts = reference_work_order(
        np.asarray(tiles.count), np.asarray(tiles.group), num_groups, num_columns, grid_tile_width
    )
    assert counts == [num_matmul * num_columns, num_zero * num_columns]
    np.testing.assert_array_equal(np.concatenate(rows), row[: sum(counts)])
    np.testing.assert_array_equal(np.concatenate(columns), column[: sum(counts)])


@pytest.mark.parametrize("seed", range(4))
def test_row_tiles_come_as_matmul_then_zero_region_then_unused_runs(seed):
    """The kernels' items rely on each kind of row tile being one contiguous run of counts[k]
    tiles."""
    rng = np.random.default_rng(100 + seed)
    num_groups, num_rows, sizes = random_groups(rng, 40, 300)
    tiles = row_tiles(jnp.asarray(sizes, jnp.int32), num_rows, 64)
    group, rows = np.asarray(tiles.group), np.asarray(tiles.count)
    kind = np.where(rows == 0, 2, np.where(group < num_groups, 0, 1))
    num_matmul, num_zero = np.asarray(tiles.counts).tolist()
    expected = np.repeat([0, 1, 2], [num_matmul, num_zero, len(kind) - num_matmul - num_zero])
    np.testing.assert_array_equal(kind, expected)
    assert (num_zero > 0) == (num_rows > sizes.sum())


def reference_row_tiles(sizes, num_rows, tile_m, row_align):
    """A loop over the groups and the zero region: (group, first row, rows) of each tile."""
    num_groups, tiles = len(sizes), []
    sizes = list(sizes) + [num_rows - sum(sizes)]
    start = 0
    for group, size in enumerate(sizes):
        anchor, end = start - start % row_align, start + size
        for grid_row in range(anchor, end if size else anchor, tile_m):
            first = max(start, grid_row)
            tiles.append((group, first, min(end, grid_row + tile_m) - first))
        start = end
    counts = [sum(g < num_groups for g, _, _ in tiles), sum(g == num_groups for g, _, _ in tiles)]
    unused = max_row_tiles(num_rows, num_groups, tile_m, row_align) - len(tiles)
    return np.array(tiles + [(num_groups, 0, 0)] * unused).T, counts


@pytest.mark.parametrize("seed", range(8))
def test_row_tiles_equal_a_loop_over_the_groups(seed):
    rng = np.random.default_rng(200 + seed)
    num_groups, num_rows, sizes = random_groups(rng, 140, 300)
    if seed == 0:
        sizes[:] = 0  # every row past the groups
    if seed == 1:
        sizes[:] = 0
        sizes[-1] = num_rows  # no zero region
    tile_m, row_align = [(8, 8), (16, 8), (64, 8), (128, 8), (16, 1), (32, 4), (24, 8), (48, 6)][
        seed
    ]
    tiles = row_tiles(jnp.asarray(sizes, jnp.int32), num_rows, tile_m, row_align)
    fields, counts = reference_row_tiles(sizes.tolist(), num_rows, tile_m, row_align)
    got = np.stack([np.asarray(tiles.group), np.asarray(tiles.start), np.asarray(tiles.count)])
    np.testing.assert_array_equal(got, fields)
    np.testing.assert_array_equal(np.asarray(tiles.fields), fields)
    assert np.asarray(tiles.counts).tolist() == counts
