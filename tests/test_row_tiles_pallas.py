"""The row-tiles kernel (`jaxmoe/ops/pallas/row_tiles_hopper.py`): `row_tiles_xla`'s arrays to
the bit, in the CPU interpreter (race detector on) and, marked `gpu`, on an H100/H200 where
`row_tiles` takes it for traced group sizes, at the decode and training tilings of the benchmark
shapes; its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.pallas import row_tiles_hopper
from jaxmoe.ops.pallas.row_tiles_hopper import row_tiles_pallas
from jaxmoe.ops.pallas.tiles import max_row_tiles, row_tiles, row_tiles_xla


def group_sizes(kind, num_groups, num_rows, seed):
    """[G] int32 sizes adding up to at most num_rows: random with about a third of the groups
    empty, all empty, or all rows in the last group."""
    rng = np.random.default_rng(seed)
    if kind == "empty":
        return np.zeros(num_groups, np.int32)
    if kind == "last":
        sizes = np.zeros(num_groups, np.int32)
        sizes[-1] = num_rows
        return sizes
    sizes = rng.multinomial(int(rng.integers(0, num_rows + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    return sizes.astype(np.int32)


def assert_equal_tiles(got, want):
    num_groups = want.num_groups
    np.testing.assert_array_equal(np.asarray(got.fields), np.asarray(want.fields))
    np.testing.assert_array_equal(np.asarray(got.bounds)[: num_groups + 2], np.asarray(want.bounds))
    np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(want.counts))


# (G, M, tile_m, row_align): qwen3_30b, mixtral and dsv3_ep8 at 64 tokens in decode tiles, more
# groups than one pass's 64 positions, a row alignment of 1.
INTERPRETED = [(128, 512, 16, 8), (8, 128, 32, 8), (32, 512, 32, 8), (68, 200, 8, 1)]


@pytest.mark.parametrize("kind", ["random", "empty", "last"])
@pytest.mark.parametrize("num_groups,num_rows,tile_m,row_align", INTERPRETED)
def test_kernel_equals_xla(interpret, num_groups, num_rows, tile_m, row_align, kind):
    sizes = group_sizes(kind, num_groups, num_rows, seed=num_groups + tile_m)
    want = row_tiles_xla(jnp.asarray(sizes), num_rows, tile_m, row_align)
    num_tiles = max_row_tiles(num_rows, num_groups, tile_m, row_align)
    kernel = jax.jit(lambda s: row_tiles_pallas(s, num_rows, tile_m, row_align, num_tiles))
    fields, bounds = kernel(jnp.asarray(sizes))
    assert_equal_tiles(type(want)(fields=fields, bounds=bounds, num_groups=num_groups), want)
    # Negative control: a row moved from one group to another shows in the kernel's tiles.
    other = sizes.copy()
    other[num_groups // 2] += 1
    other[np.argmax(sizes)] -= 1 if sizes.any() else 0
    changed, _ = kernel(jnp.asarray(other))
    assert not np.array_equal(np.asarray(changed), np.asarray(want.fields))


def test_refuses_what_it_does_not_support():
    assert not row_tiles_hopper.supported(24, 8)  # tile_m not a power of two
    assert not row_tiles_hopper.supported(16, 3)
    with pytest.raises(ValueError, match="not supported"):
        row_tiles_pallas(jnp.zeros(8, jnp.int32), 64, 24, 8, 32)
    with pytest.raises(ValueError, match="not supported"):
        row_tiles_pallas(jnp.zeros(8, jnp.int32), 64, 16, 8, 30)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "empty", "last"])
@pytest.mark.parametrize(
    "num_groups,num_rows,tile_m",
    [(128, 512, 16), (8, 128, 32), (32, 512, 32), (256, 65536, 128), (128, 16384, 64)],
)
def test_gpu_row_tiles_of_traced_sizes_come_from_the_kernel(num_groups, num_rows, tile_m, kind):
    """On an H100/H200, `row_tiles` of traced sizes runs the kernel (its name in the lowered
    module) and gives `row_tiles_xla`'s arrays, at decode tiles and at training tiles of 256
    experts."""
    sizes = jnp.asarray(group_sizes(kind, num_groups, num_rows, seed=7))
    traced = jax.jit(lambda s: row_tiles(s, num_rows, tile_m))
    assert "row_tiles" in traced.lower(sizes).as_text()
    assert_equal_tiles(traced(sizes), row_tiles_xla(sizes, num_rows, tile_m))
