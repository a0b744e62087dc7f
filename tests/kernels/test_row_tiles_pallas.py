"""The row-tiles kernel (`jaxmoe/ops/pallas/row_tiles_hopper.py`): `row_tiles_xla`'s arrays to
the bit, in the CPU interpreter (race detector on) and, marked `gpu`, on an H100/H200 where
`row_tiles` takes it for traced group sizes (decode tilings of mixtral and dsv3_ep8) and
where it does not (qwen3_30b's 128 groups, training tilings); its refusals."""

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


# (G, M, tile_m, row_align): mixtral and dsv3_ep8 at 64 tokens in decode tiles, the most groups
# and tiles the kernel takes with a row alignment of 1, a few groups in 8-row tiles.
INTERPRETED = [(8, 128, 32, 8), (32, 512, 32, 8), (60, 64, 32, 1), (4, 64, 8, 8)]


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


def test_takes_one_pass_of_owners_and_tiles_only():
    assert row_tiles_hopper.supported(62, 64, 16, 8)
    assert not row_tiles_hopper.supported(63, 64, 16, 8)  # 65 owners
    assert not row_tiles_hopper.supported(8, 68, 16, 8)  # 68 tiles
    assert not row_tiles_hopper.supported(8, 30, 16, 8)  # not whole 16-byte stores
    assert not row_tiles_hopper.supported(8, 32, 24, 8)  # tile_m not a power of two
    assert not row_tiles_hopper.supported(8, 32, 16, 3)
    assert max_row_tiles(128, 8, 32) % row_tiles_hopper.STORE_ALIGN == 0
    with pytest.raises(ValueError, match="not supported"):
        row_tiles_pallas(jnp.zeros(8, jnp.int32), 64, 24, 8, 32)
    with pytest.raises(ValueError, match="not supported"):
        row_tiles_pallas(jnp.zeros(128, jnp.int32), 512, 16, 8, 220)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "empty", "last"])
@pytest.mark.parametrize(
    "num_groups,num_rows,tile_m,kernel",
    [
        (8, 128, 32, True),
        (32, 512, 32, True),
        (40, 64, 32, True),
        (128, 512, 16, False),
        (256, 65536, 128, False),
    ],
)
def test_gpu_row_tiles_of_traced_sizes(num_groups, num_rows, tile_m, kernel, kind):
    """On an H100/H200, `row_tiles` of traced sizes runs the kernel where it takes them (its
    name in the lowered module), XLA elsewhere, with `row_tiles_xla`'s arrays either way."""
    sizes = jnp.asarray(group_sizes(kind, num_groups, num_rows, seed=7))
    traced = jax.jit(lambda s: row_tiles(s, num_rows, tile_m))
    assert ("row_tiles" in traced.lower(sizes).as_text()) == kernel
    assert_equal_tiles(traced(sizes), row_tiles_xla(sizes, num_rows, tile_m))
