"""The Hopper Pallas grouped-matmul kernels, run on CPU in Mosaic GPU interpret mode (barriers,
TMA and wgmma simulated, race detector on) against the XLA reference, plus lowering checks for
the real GPU shapes. Tests marked `gpu` repeat the properties on an H100/H200."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import MoEConfig
from jaxmoe.ops import GmmConfig, TgmmConfig, gmm, on_hopper, tgmm
from jaxmoe.ops.pallas.tiles import row_tiles
from bitwise import bits
from layer_grads import output_and_grads

ON_HOPPER = on_hopper()


def operands(m, k, n, g, seed=0, transpose_rhs=False):
    key_l, key_r = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(key_l, (m, k), jnp.float32).astype(jnp.bfloat16)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = jax.random.normal(key_r, shape, jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs


SMALL = GmmConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, grid_tile_width=2,
                  epilogue_tile_n=32, wg_split="m", num_sms=3)    # fp32 outputs: 128-byte rows
SMALL_T = TgmmConfig(tile_k=64, tile_n=64, tile_rows=32, max_concurrent_steps=2,
                     grid_tile_width=1, num_sms=3)
SIZES = {
    "ragged_tail_and_empty": [37, 0, 90, 50, 3],     # sum 180 of 200 rows: a zero tail
    "all_in_one": [0, 0, 200, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
    "tiny_groups": [1, 7, 9, 16, 167],
}


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dgrad_layout"])
def test_forward_matches_xla(interpret, sizes, transpose_rhs):
    lhs, rhs = operands(200, 128, 64, 5, transpose_rhs=transpose_rhs)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = None if ON_HOPPER else SMALL
    out = gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, impl="pallas", config=config)
    ref = gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[sum(sizes):] == 0)


def test_forward_with_default_config_and_rows_not_multiple_of_8(interpret):
    lhs, rhs = operands(203, 64, 128, 3, seed=1)
    group_sizes = jnp.array([100, 0, 99], jnp.int32)
    out = gmm(lhs, rhs, group_sizes, impl="pallas", preferred_element_type=jnp.bfloat16)
    ref = gmm(lhs, rhs, group_sizes, impl="xla", preferred_element_type=jnp.bfloat16)
    assert out.shape == (203, 128) and out.dtype == jnp.bfloat16
    # One bf16 rounding of an fp32 sum each; the sums' order may differ from XLA's GEMM, so
    # the roundings may land one bf16 ulp apart (<= 2^-7 relative).
    np.testing.assert_allclose(np.asarray(out, np.float32)[:199],
                               np.asarray(ref, np.float32)[:199], rtol=2 ** -7, atol=1e-6)
    assert np.all(np.asarray(out)[199:] == 0)


@pytest.mark.parametrize("sizes", [SIZES["ragged_tail_and_empty"], [40, 0, 0, 120, 40]])
def test_wgrad_matches_xla(interpret, sizes):
    lhs, _ = operands(200, 128, 64, 1, seed=2)
    rhs = jax.random.normal(jax.random.key(3), (200, 64), jnp.float32).astype(jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = tgmm(lhs, rhs, group_sizes, impl="pallas", config=None if ON_HOPPER else SMALL_T)
    ref = tgmm(lhs, rhs, group_sizes, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    for g, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(out)[g] == 0)


def test_nan_in_one_group_never_reaches_another(interpret):
    lhs, rhs = operands(200, 128, 64, 4, seed=4)
    lhs = lhs.at[63, 5].set(jnp.nan)                   # last row of group 0 (rows 0..63)
    dy = jax.random.normal(jax.random.key(5), (200, 64), jnp.float32).astype(jnp.bfloat16)
    dy = dy.at[64, 1].set(jnp.inf)                     # first row of group 1
    group_sizes = jnp.array([64, 40, 60, 36], jnp.int32)
    out = np.asarray(gmm(lhs, rhs, group_sizes, impl="pallas",
                         config=None if ON_HOPPER else SMALL))
    assert np.all(np.isnan(out[63])) and np.all(np.isfinite(np.delete(out, 63, axis=0)))
    grads = np.asarray(tgmm(lhs, dy, group_sizes, impl="pallas",
                            config=None if ON_HOPPER else SMALL_T))
    assert not np.all(np.isfinite(grads[0])) and not np.all(np.isfinite(grads[1]))
    assert np.all(np.isfinite(grads[2:]))


def test_row_bits_do_not_depend_on_other_groups_or_config(interpret):
    """Batch invariance: a row's output bits are the same when the groups around it grow,
    shrink or vanish, and under other tilings. (The CPU interpreter runs each wgmma as one numpy
    matmul over the whole tile_k block, so there tile_k must stay fixed; on the GPU every wgmma
    adds 16-wide K slices in order and tile_k is varied too.)"""
    lhs, rhs = operands(256, 128, 128, 4, seed=6)
    probe = 130                                        # a row of group 2 in every layout below
    layouts = {"a": [64, 40, 60, 36], "b": [0, 0, 200, 56], "c": [100, 7, 41, 9]}
    configs = [SMALL, GmmConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=1,
                                grid_tile_width=1, epilogue_tile_n=64, wg_split="n", num_sms=2)]
    if ON_HOPPER:
        configs = [GmmConfig(tile_m=tm, tile_n=64, tile_k=tk, wg_split=split,
                             max_concurrent_steps=2 if tk == 64 else 1)
                   for tm in (64, 128) for tk in (64, 128) for split in ("n", "m")]
    results = []
    for sizes in layouts.values():
        starts = np.cumsum([0] + sizes)
        assert starts[2] <= probe < starts[3]
        for config in configs:
            out = gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), impl="pallas", config=config)
            results.append(bits(out)[probe])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_negative_control_split_k_changes_bits(interpret):
    """The invariance check can fail: summing the same products in two K halves (what a
    split-K kernel chosen for some group sizes would do) gives different bits."""
    lhs, rhs = operands(64, 256, 64, 1, seed=7)
    sizes = jnp.array([64], jnp.int32)
    whole = gmm(lhs, rhs, sizes, impl="xla")
    halves = (gmm(lhs[:, :128], rhs[:, :128], sizes, impl="xla")
              + gmm(lhs[:, 128:], rhs[:, 128:], sizes, impl="xla"))
    assert np.any(bits(whole) != bits(halves))


def test_moe_layer_gradients_pallas_equal_xla(interpret):
    """jax.grad of the whole layer with every grouped matmul on the Pallas kernels."""
    config = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=64, aux_loss_coeff=1e-2)
    x = jax.random.normal(jax.random.key(8), (48, 64), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(9), (48, 64), jnp.float32)

    y_p, gx_p, *gm_p = output_and_grads(config, x, dy, "pallas")
    y_x, gx_x, *gm_x = output_and_grads(config, x, dy, "xla")
    # Forward: fp32 accumulation in both, one bf16 rounding: identical up to accumulation order
    # inside the GEMMs (at most 1 bf16 ulp where the fp32 sums straddle a rounding boundary).
    np.testing.assert_allclose(np.asarray(y_p, np.float32), np.asarray(y_x, np.float32),
                               rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gx_p, np.float32), np.asarray(gx_x, np.float32),
                               rtol=2 ** -6, atol=1e-5)
    for a, b in zip(gm_p, gm_x):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2 ** -6, atol=1e-5)


def test_tile_schedule_covers_every_row_once():
    sizes = jnp.array([37, 0, 90, 50, 3, 0, 17], jnp.int32)
    tiles = row_tiles(sizes, 232, 64)
    owner = np.full(232, -1)
    for group, row, rows in zip(*map(np.asarray, (tiles.group, tiles.row, tiles.rows))):
        if rows:
            assert np.all(owner[row:row + rows] == -1)
            owner[row:row + rows] = group
            assert row - row % 8 + 64 >= row + rows          # fits the 8-aligned window
    expected = np.repeat(np.arange(8), np.asarray(list(sizes) + [232 - int(sizes.sum())]))
    np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("num_groups", [8, 256])
def test_lowering_for_hopper_is_fast_for_many_experts(num_groups):
    """Full Pallas -> Mosaic GPU lowering on CPU (no GPU needed) at a real MoE shape: tile
    metadata is computed outside the kernel, so 256 experts lower as fast as 8."""
    shapes = (jax.ShapeDtypeStruct((65536, 2048), jnp.bfloat16),
              jax.ShapeDtypeStruct((num_groups, 2048, 1536), jnp.bfloat16),
              jax.ShapeDtypeStruct((num_groups,), jnp.int32))
    start = time.perf_counter()
    for transpose_rhs in (False, True):
        rhs = shapes[1] if not transpose_rhs else jax.ShapeDtypeStruct(
            (num_groups, 1536, 2048), jnp.bfloat16)
        fn = functools.partial(gmm, impl="pallas", transpose_rhs=transpose_rhs,
                               preferred_element_type=jnp.bfloat16, config=GmmConfig())
        jax.jit(fn).trace(shapes[0], rhs, shapes[2]).lower(lowering_platforms=("cuda",))
    wgrad = functools.partial(tgmm, impl="pallas", config=TgmmConfig())
    jax.jit(wgrad).trace(shapes[0], jax.ShapeDtypeStruct((65536, 1536), jnp.bfloat16),
                         shapes[2]).lower(lowering_platforms=("cuda",))
    assert time.perf_counter() - start < 10


def test_pallas_refuses_unsupported_problems():
    with pytest.raises(ValueError, match="shared memory"):
        GmmConfig(max_concurrent_steps=6).validate(4096, 1024, 1024)
    with pytest.raises(ValueError, match="128 bytes"):
        GmmConfig(epilogue_tile_n=32).validate(4096, 1024, 1024, out_dtype=jnp.bfloat16)
    lhs, rhs = operands(64, 96, 64, 2)
    with pytest.raises(ValueError, match="multiples of 64"):
        gmm(lhs, rhs, jnp.array([32, 32]), impl="pallas")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.array([32, 32]),
            impl="pallas")
    out = gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.array([32, 32]), impl="auto")
    assert out.shape == (64, 64)                       # auto falls back to XLA


@pytest.mark.gpu
def test_gpu_forward_dgrad_wgrad_and_invariance_on_hardware():
    """On an H100/H200: the same properties at a realistic size, default configs."""
    lhs, rhs = operands(4096, 1024, 512, 16, seed=10)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(4000, np.ones(16) / 16), jnp.int32)
    out = gmm(lhs, rhs, sizes, impl="pallas")
    ref = gmm(lhs, rhs, sizes, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-2)
    assert np.all(np.asarray(out)[4000:] == 0)
    dgrad = gmm(ref.astype(jnp.bfloat16), rhs, sizes, transpose_rhs=True, impl="pallas")
    np.testing.assert_allclose(dgrad, gmm(ref.astype(jnp.bfloat16), rhs, sizes,
                                          transpose_rhs=True, impl="xla"), rtol=1e-3, atol=1e-1)
    wgrad = tgmm(lhs, out.astype(jnp.bfloat16), sizes, impl="pallas")
    np.testing.assert_allclose(wgrad, tgmm(lhs, out.astype(jnp.bfloat16), sizes, impl="xla"),
                               rtol=1e-3, atol=1.0)
    moved = sizes.at[0].add(-5).at[15].add(5)          # every group from 1 on starts 5 rows earlier
    starts = np.cumsum(np.asarray(sizes)) - np.asarray(sizes)
    probe = int(starts[7]) + int(sizes[7]) // 2        # the middle of group 7 in both layouts
    moved_out = gmm(lhs.at[probe - 5].set(lhs[probe]), rhs, moved, impl="pallas")
    np.testing.assert_array_equal(bits(moved_out)[probe - 5], bits(out)[probe])
