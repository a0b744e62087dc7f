"""Row tiles of a grouped matmul with few groups and tiles in one small Pallas Mosaic GPU kernel
(Hopper).

`tiles.row_tiles` lists, from the group sizes, every row tile's group, first row and row count,
and how many tiles come before each group. With XLA that is three dependent reductions, which
XLA on the H200 compiles into five reduce kernels and a few elementwise ones, each a launch of
about a microsecond at decode sizes. Here one warpgroup computes the same arrays in three passes
over a [64, 64] int32 tile in registers, each a masked sum along its second axis, the per-owner
results going through shared memory from one pass to the next:

1. each owner's first row, end row, tile-grid anchor and tile count (positions: the G groups,
   the zero region past them and the "unused" owner; columns: the groups);
2. the tiles before each owner (`RowTiles.bounds`) and through it (columns: the owners);
3. each tile's owner and its (group, first row, row count) (`RowTiles.fields`; positions: the
   tiles, columns: the owners).

The passes are serial work for one warpgroup, so the kernel takes only what fits one tile: at
most 62 groups and 64 row tiles (`supported`). In the decode layer it is faster than XLA's
kernels at mixtral's 8 and dsv3_ep8's 32 groups; a version looping over 64 x 64 pieces was
slower than XLA's kernels at qwen3_30b's 128 groups.

The output equals `tiles.row_tiles_xla`'s to the bit (`tests/kernels/test_row_tiles_pallas.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv, is_power_of_two

CHUNK = 64  # a pass's tile is [CHUNK, CHUNK]: the wgmma register layout's 64 rows
STORE_ALIGN = 4  # int32 elements in the 16 bytes a TMA store of the results moves at least
LOAD_ALIGN = 32  # int32 elements in the 128 bytes (a byte a thread) a Lane-semantics TMA load
# Rows of the per-owner table; _THROUGH: the tiles up to and including the owner's (the next
# owner's bounds, computed rather than read one element ahead: a misaligned vector load).
_STARTS, _ENDS, _ANCHORS, _TILES, _BOUNDS, _THROUGH = range(6)


def _round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def supported(num_groups: int, num_tiles: int, tile_m: int, row_align: int) -> bool:
    """Whether the kernel takes these tiles: G + 2 owners and num_tiles tiles (a multiple of
    STORE_ALIGN) within one [CHUNK, CHUNK] pass, powers of two for tile_m and row_align."""
    return (
        num_groups + 2 <= CHUNK
        and num_tiles <= CHUNK
        and num_tiles % STORE_ALIGN == 0
        and is_power_of_two(tile_m)
        and is_power_of_two(row_align)
    )


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
    integer group_sizes [G] where `supported`. The entries of bounds past G + 1 are
    unspecified. G not a multiple of LOAD_ALIGN costs an XLA pad of the sizes."""
    (num_groups,) = group_sizes.shape
    if not supported(num_groups, num_tiles, tile_m, row_align):
        raise ValueError(
            f"row tiles pallas: G={num_groups}, num_tiles={num_tiles}, tile_m={tile_m}, "
            f"row_align={row_align} not supported"
        )
    sizes = group_sizes.astype(jnp.int32)
    sizes = jnp.pad(sizes, (0, _round_up(num_groups, LOAD_ALIGN) - num_groups))
    kernel = _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret)
    return kernel(sizes)


@functools.cache
def _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret):
    owners = num_groups + 2  # the groups, the zero region, "unused"
    loaded = _round_up(num_groups, LOAD_ALIGN)
    bounds_len = _round_up(owners, STORE_ALIGN)
    i32 = jnp.int32
    shape = (CHUNK, CHUNK)
    tile_layout = plgpu.Layout.WGMMA
    per_position = tile_layout.reduce(1)

    def across(ref):
        """[CHUNK, CHUNK]: entry (p, o) = ref[o]."""
        v = plgpu.load(ref, layout=tile_layout.reduce(0), optimized=False)
        return lax.broadcast_in_dim(v, shape, (1,))

    def sum_where(mask, values):
        return jnp.sum(jnp.where(mask, values, 0), axis=1)

    def body(sizes_gmem, fields_gmem, bounds_gmem, sizes_smem, table, fields_smem, barrier):
        plgpu.copy_gmem_to_smem(sizes_gmem, sizes_smem.at[pl.ds(0, loaded)], barrier)
        position = plgpu.broadcasted_iota(i32, shape, 0, layout=tile_layout)
        column = plgpu.broadcasted_iota(i32, shape, 1, layout=tile_layout)
        p = plgpu.broadcasted_iota(i32, (CHUNK,), 0, layout=per_position)
        plgpu.barrier_wait(barrier)

        # 1. Owner p's first row, end row, tile-grid anchor and number of tiles.
        sizes = jnp.where(column < num_groups, across(sizes_smem), 0)
        starts = sum_where(column < position, sizes)
        ends = jnp.where(p < num_groups, starts + sum_where(column == position, sizes), num_rows)
        anchors = starts - lax.rem(starts, i32(row_align))
        used = (p <= num_groups) & (ends > starts)
        tiles = jnp.where(used, lax.div(ends - anchors + tile_m - 1, i32(tile_m)), 0)
        for row, value in ((_STARTS, starts), (_ENDS, ends), (_ANCHORS, anchors), (_TILES, tiles)):
            table.at[row][...] = value
        plgpu.commit_smem()

        # 2. The tiles before owner p and through it.
        tiles = across(table.at[_TILES])
        table.at[_BOUNDS][...] = sum_where(column < position, tiles)
        table.at[_THROUGH][...] = sum_where(column <= position, tiles)
        plgpu.commit_smem()

        # 3. Tile t's owner o and its fields; owner G + 1 ("unused") takes the tiles past all
        # others and gives (G, 0, 0).
        t, o = position, column
        first_tile = across(table.at[_BOUNDS])
        last_tile = jnp.where(o == num_groups + 1, num_tiles, across(table.at[_THROUGH]))
        owner = (first_tile <= t) & (t < last_tile) & (o < owners)
        real = owner & (o <= num_groups)
        grid_row = across(table.at[_ANCHORS]) + (t - first_tile) * tile_m
        first_row = jnp.maximum(across(table.at[_STARTS]), grid_row)
        end_row = jnp.minimum(across(table.at[_ENDS]), grid_row + tile_m)
        fields = (
            jnp.minimum(o, num_groups),
            first_row,
            jnp.clip(end_row - first_row, 0, tile_m),
        )
        for row, value in enumerate(fields):
            fields_smem.at[row][...] = sum_where(real if row else owner, value)
        plgpu.commit_smem()
        for row in range(3):
            plgpu.copy_smem_to_gmem(fields_smem.at[row, pl.ds(0, num_tiles)], fields_gmem.at[row])
        plgpu.copy_smem_to_gmem(table.at[_BOUNDS, pl.ds(0, bounds_len)], bounds_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        kernel_name="row_tiles",
        out_type=(
            jax.ShapeDtypeStruct((3, num_tiles), i32),
            jax.ShapeDtypeStruct((bounds_len,), i32),
        ),
        scratch_types=(
            plgpu.SMEM((CHUNK,), i32),
            plgpu.SMEM((6, CHUNK), i32),
            plgpu.SMEM((3, CHUNK), i32),
            plgpu.Barrier(),
        ),
        # Lane semantics: the layouts are the ones given here (Warpgroup semantics' layout
        # inference did not finish on this kernel in minutes).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
