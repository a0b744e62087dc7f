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

CHUNK = 64  # positions and owners of a pass's tile in registers: a wgmma layout's 64 rows
STORE_ALIGN = 4  # int32 elements in the 16 bytes a TMA store of the results moves at least
LOAD_ALIGN = 32  # int32 elements in the 128 bytes (a byte a thread) a Lane-semantics TMA load
# Rows of the per-owner table; _THROUGH: the tiles up to and including the owner's (the next
# owner's bounds, computed rather than read one element ahead: a misaligned vector load).
_STARTS, _ENDS, _ANCHORS, _TILES, _BOUNDS, _THROUGH = range(6)


def _round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def supported(tile_m: int, row_align: int) -> bool:
    """Whether the kernel takes these tiles: powers of two for tile_m and row_align."""
    power_of_two = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return power_of_two(tile_m) and power_of_two(row_align)


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
    integer group_sizes [G] (`supported` must hold; num_tiles a multiple of STORE_ALIGN). The
    entries of bounds past G + 1 are unspecified. G not a multiple of LOAD_ALIGN costs an XLA
    pad of the sizes."""
    (num_groups,) = group_sizes.shape
    if not supported(tile_m, row_align) or num_tiles % STORE_ALIGN:
        raise ValueError(
            f"row tiles pallas: tile_m={tile_m}, row_align={row_align}, num_tiles={num_tiles} "
            "not supported"
        )
    sizes = group_sizes.astype(jnp.int32)
    sizes = jnp.pad(sizes, (0, _round_up(num_groups, LOAD_ALIGN) - num_groups))
    kernel = _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret)
    return kernel(sizes)


@functools.cache
def _build_kernel(num_groups, num_rows, tile_m, row_align, num_tiles, interpret):
    owners = num_groups + 2  # the groups, the zero region, "unused"
    loaded = _round_up(num_groups, LOAD_ALIGN)
    owners_len = _round_up(
        max(owners, loaded), CHUNK
    )  # positions and columns of the per-owner passes
    bounds_len = _round_up(owners, STORE_ALIGN)
    tiles_len = _round_up(num_tiles, CHUNK)
    tile_layout = plgpu.Layout.WGMMA
    per_position = tile_layout.reduce(1)
    per_column = tile_layout.reduce(0)
    i32 = jnp.int32

    def column_values(ref, offset):
        """[CHUNK, CHUNK]: entry (p, o) = ref[offset + o]."""
        v = plgpu.load(ref.at[pl.ds(offset, CHUNK)], layout=per_column, optimized=False)
        return lax.broadcast_in_dim(v, (CHUNK, CHUNK), (1,))

    def sums_over_owners(first, terms, width):
        """For the CHUNK positions from `first`: the sums over the owners o < width of each of
        terms(position, owner, first owner) ([CHUNK, CHUNK] arrays of one chunk of owners), a
        chunk of owners at a time so that a thread holds few registers."""
        shape = (CHUNK, CHUNK)
        position = first + plgpu.broadcasted_iota(i32, shape, 0, layout=tile_layout)
        sums = None
        for first_owner in range(0, width, CHUNK):
            owner = first_owner + plgpu.broadcasted_iota(i32, shape, 1, layout=tile_layout)
            parts = [jnp.sum(t, axis=1) for t in terms(position, owner, first_owner)]
            sums = parts if sums is None else [a + b for a, b in zip(sums, parts)]
        return sums

    def positions_of(first):
        return first + plgpu.broadcasted_iota(i32, (CHUNK,), 0, layout=per_position)

    def body(sizes_gmem, fields_gmem, bounds_gmem, sizes_smem, table, fields_smem, barrier):
        plgpu.copy_gmem_to_smem(sizes_gmem, sizes_smem.at[pl.ds(0, loaded)], barrier)
        plgpu.barrier_wait(barrier)

        @pl.loop(0, owners_len, step=CHUNK)
        def _per_owner(first):
            """1. Owner p's first row, end row, tile-grid anchor and number of tiles."""

            def terms(p, h, first_h):
                sizes = jnp.where(h < num_groups, column_values(sizes_smem, first_h), 0)
                return jnp.where(h < p, sizes, 0), jnp.where(h == p, sizes, 0)

            starts, own = sums_over_owners(first, terms, owners_len)
            p = positions_of(first)
            ends = jnp.where(p < num_groups, starts + own, num_rows)
            anchors = starts - lax.rem(starts, i32(row_align))
            used = (p <= num_groups) & (ends > starts)
            tiles = jnp.where(used, lax.div(ends - anchors + tile_m - 1, i32(tile_m)), 0)
            for row, value in (
                (_STARTS, starts),
                (_ENDS, ends),
                (_ANCHORS, anchors),
                (_TILES, tiles),
            ):
                table.at[row, pl.ds(first, CHUNK)][...] = value

        plgpu.commit_smem()

        @pl.loop(0, owners_len, step=CHUNK)
        def _bounds(first):
            """2. The tiles before owner p."""

            def terms(p, g, first_g):
                tiles = column_values(table.at[_TILES], first_g)
                return jnp.where(g < p, tiles, 0), jnp.where(g <= p, tiles, 0)

            bounds, through = sums_over_owners(first, terms, owners_len)
            table.at[_BOUNDS, pl.ds(first, CHUNK)][...] = bounds
            table.at[_THROUGH, pl.ds(first, CHUNK)][...] = through

        plgpu.commit_smem()

        @pl.loop(0, tiles_len, step=CHUNK)
        def _per_tile(first):
            """3. Tile t's owner o and its fields; owner G + 1 ("unused") takes the tiles past
            all others and gives (G, 0, 0)."""

            def terms(t, o, first_o):
                first_tile = column_values(table.at[_BOUNDS], first_o)
                last_tile = jnp.where(
                    o == num_groups + 1, num_tiles, column_values(table.at[_THROUGH], first_o)
                )
                owner = (first_tile <= t) & (t < last_tile) & (o < owners)
                real = owner & (o <= num_groups)
                grid_row = column_values(table.at[_ANCHORS], first_o) + (t - first_tile) * tile_m
                first_row = jnp.maximum(column_values(table.at[_STARTS], first_o), grid_row)
                end_row = jnp.minimum(column_values(table.at[_ENDS], first_o), grid_row + tile_m)
                count = jnp.clip(end_row - first_row, 0, tile_m)
                return (
                    jnp.where(owner, jnp.minimum(o, num_groups), 0),
                    jnp.where(real, first_row, 0),
                    jnp.where(real, count, 0),
                )

            for row, value in enumerate(sums_over_owners(first, terms, owners_len)):
                fields_smem.at[row, pl.ds(first, CHUNK)][...] = value

        plgpu.commit_smem()
        for row in range(3):
            plgpu.copy_smem_to_gmem(fields_smem.at[row, pl.ds(0, num_tiles)], fields_gmem.at[row])
        plgpu.copy_smem_to_gmem(table.at[_BOUNDS, pl.ds(0, bounds_len)], bounds_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        kernel_name="row_tiles",
        # Lane semantics: the layouts are the ones given here (Warpgroup semantics' layout
        # inference did not finish on this kernel in minutes).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        out_type=(
            jax.ShapeDtypeStruct((3, num_tiles), i32),
            jax.ShapeDtypeStruct((bounds_len,), i32),
        ),
        scratch_types=(
            plgpu.SMEM((owners_len,), i32),
            plgpu.SMEM((6, owners_len), i32),
            plgpu.SMEM((3, tiles_len), i32),
            plgpu.Barrier(),
        ),
        interpret=interpret,
    )
