"""The Hopper Pallas grouped-matmul kernels, run on CPU in Mosaic GPU interpret mode (barriers,
TMA and wgmma simulated, race detector on) against the XLA reference, plus lowering checks for
the real GPU shapes. Tests marked `gpu` repeat the properties on an H100/H200."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreter_tilings import GMM_SMALL, TGMM_SMALL
from layer_grads import output_and_grads

from jaxmoe import MoEConfig
from jaxmoe.ops import GmmConfig, TgmmConfig, gmm, on_hopper, tgmm
from jaxmoe.ops.pallas.tgmm_hopper import boundary_pieces, default_tgmm_config
from jaxmoe.ops.pallas.tiles import row_tiles

from bitwise import bits

ON_HOPPER = on_hopper()


def operands(m, k, n, g, seed=0, transpose_rhs=False):
    key_l, key_r = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(key_l, (m, k), jnp.float32).astype(jnp.bfloat16)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = jax.random.normal(key_r, shape, jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs


SIZES = {
    "ragged_tail_and_empty": [37, 0, 90, 50, 3],  # sum 180 of 200 rows: a zero tail
    "all_in_one": [0, 0, 200, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
    "tiny_groups": [1, 7, 9, 16, 167],
}


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dgrad_layout"])
def test_forward_matches_xla(interpret, sizes, transpose_rhs):
    lhs, rhs = operands(200, 128, 64, 5, transpose_rhs=transpose_rhs)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = None if ON_HOPPER else GMM_SMALL
    out = gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, impl="pallas", config=config)
    ref = gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_rows_past_groups_are_left_unwritten_and_never_read(interpret, monkeypatch, impl):
    """write_rows_past_groups=False (a buffer with dead rows past its groups,
    `jaxmoe.ops.live_rows`): NaN in lhs's and the output gradient's dead rows, the forward,
    d lhs and d rhs equal the default's on every live row and matrix; the dead rows of out and
    d lhs are left unwritten (the interpreter's NaN) or filled (XLA, DEAD_ROW_FILL = NaN).
    Control: by default they are zeros."""
    from jaxmoe.ops import live_rows

    monkeypatch.setattr(live_rows, "DEAD_ROW_FILL", np.nan)
    sizes = [37, 0, 50, 3]  # 90 of 160 rows: a zero region of two row tiles
    live = sum(sizes)
    lhs, rhs = operands(160, 128, 64, 4, seed=7)
    lhs = lhs.at[live:].set(jnp.nan)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    grad = jax.random.normal(jax.random.key(8), (160, 64), jnp.float32).at[live:].set(jnp.nan)
    config = None if ON_HOPPER or impl == "xla" else GMM_SMALL

    def run(written):
        f = lambda a, b: gmm(  # noqa: E731
            a, b, group_sizes, impl=impl, config=config, write_rows_past_groups=written
        )
        out, pull = jax.vjp(f, lhs, rhs)
        return (out, *pull(grad))

    (out, d_lhs, d_rhs), (ref, ref_lhs, ref_rhs) = run(False), run(True)
    for ours, theirs in ((out, ref), (d_lhs, ref_lhs)):
        np.testing.assert_array_equal(bits(ours[:live]), bits(theirs[:live]))
        assert np.all(np.isnan(np.asarray(ours[live:], np.float32)))
        assert np.all(np.asarray(theirs[live:]) == 0)
    np.testing.assert_array_equal(bits(d_rhs), bits(ref_rhs))
    assert not np.any(np.isnan(np.asarray(d_rhs, np.float32)))


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dgrad_layout"])
def test_cluster_pairs_match_xla(interpret, transpose_rhs):
    """cluster_n=2: the two CTAs of a cluster share each row tile's lhs (multicast on the GPU)
    and take adjacent column tiles; every column pair, zero-region tile and group is covered.
    (Kept small: the CPU interpreter intermittently hangs on longer 2-CTA cluster runs, e.g.
    600 rows on 4 SMs; the GPU runs them, as in benchmarks/gmm.py --sweep.)"""
    lhs, rhs = operands(200, 128, 256, 5, seed=2, transpose_rhs=transpose_rhs)
    group_sizes = jnp.asarray(SIZES["ragged_tail_and_empty"], jnp.int32)
    run = functools.partial(gmm, lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    unpaired = run(impl="pallas", config=GMM_SMALL)
    out = run(impl="pallas", config=dataclasses.replace(GMM_SMALL, cluster_n=2, num_sms=4))  # raced
    np.testing.assert_array_equal(bits(out), bits(unpaired))
    np.testing.assert_allclose(out, run(impl="xla"), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[180:] == 0)


def test_forward_with_default_config_and_rows_not_multiple_of_8(interpret):
    lhs, rhs = operands(203, 64, 128, 3, seed=1)
    group_sizes = jnp.array([100, 0, 99], jnp.int32)
    out = gmm(lhs, rhs, group_sizes, impl="pallas", preferred_element_type=jnp.bfloat16)
    ref = gmm(lhs, rhs, group_sizes, impl="xla", preferred_element_type=jnp.bfloat16)
    assert out.shape == (203, 128) and out.dtype == jnp.bfloat16
    # One bf16 rounding of an fp32 sum each; the sums' order may differ from XLA's GEMM, so
    # the roundings may land one bf16 ulp apart (<= 2^-7 relative).
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[:199], np.asarray(ref, np.float32)[:199], rtol=2**-7, atol=1e-6
    )
    assert np.all(np.asarray(out)[199:] == 0)


@pytest.mark.parametrize("sizes", [SIZES["ragged_tail_and_empty"], [40, 0, 0, 120, 40]])
def test_wgrad_matches_xla(interpret, sizes):
    lhs, _ = operands(200, 128, 64, 1, seed=2)
    rhs = jax.random.normal(jax.random.key(3), (200, 64), jnp.float32).astype(jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = tgmm(lhs, rhs, group_sizes, impl="pallas", config=None if ON_HOPPER else TGMM_SMALL)
    ref = tgmm(lhs, rhs, group_sizes, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    for g, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(out)[g] == 0)


def test_nan_in_one_group_never_reaches_another(interpret):
    lhs, rhs = operands(200, 128, 64, 4, seed=4)
    lhs = lhs.at[63, 5].set(jnp.nan)  # last row of group 0 (rows 0..63)
    dy = jax.random.normal(jax.random.key(5), (200, 64), jnp.float32).astype(jnp.bfloat16)
    dy = dy.at[64, 1].set(jnp.inf)  # first row of group 1
    group_sizes = jnp.array([64, 40, 60, 36], jnp.int32)
    out = np.asarray(
        gmm(lhs, rhs, group_sizes, impl="pallas", config=None if ON_HOPPER else GMM_SMALL)
    )
    assert np.all(np.isnan(out[63])) and np.all(np.isfinite(np.delete(out, 63, axis=0)))
    grads = np.asarray(
        tgmm(lhs, dy, group_sizes, impl="pallas", config=None if ON_HOPPER else TGMM_SMALL)
    )
    assert not np.all(np.isfinite(grads[0])) and not np.all(np.isfinite(grads[1]))
    assert np.all(np.isfinite(grads[2:]))


# The warp-specialised wgrad kernel on small shapes (interpret mode): both warpgroup splits,
# boundary blocks loaded in 8-, 32- or 64-row pieces, the 64-byte swizzle of 32-wide warpgroup
# tiles, rings of 2-4 slots, one or two epilogue slots, bf16 and fp32 out,
# both schedules, more SMs than work items, the epilogue overlapped with the next item's first
# wgmma (after empty items too).
WGRAD_STRUCTURES = {
    "split_k_ring2_epi2": (
        TgmmConfig(
            tile_k=64,
            tile_n=64,
            wg_split="k",
            max_concurrent_steps=2,
            epilogue_slots=2,
            grid_tile_width=1,
            num_sms=3,
        ),
        jnp.float32,
    ),
    "split_k_128wide_ring4": (
        TgmmConfig(tile_k=64, tile_n=128, wg_split="k", max_concurrent_steps=4, num_sms=8),
        jnp.bfloat16,
    ),
    "split_n_ring3_unbalanced": (
        TgmmConfig(
            tile_k=64,
            tile_n=64,
            wg_split="n",
            max_concurrent_steps=3,
            grid_tile_width=2,
            balanced_schedule=False,
            piece_rows=64,
            num_sms=2,
        ),
        jnp.float32,
    ),
    "split_n_32wide": (
        TgmmConfig(tile_k=64, tile_n=32, wg_split="n", max_concurrent_steps=2, num_sms=3),
        jnp.bfloat16,
    ),
    "split_k_128rows": (
        TgmmConfig(
            tile_k=64,
            tile_n=64,
            wg_split="k",
            tile_rows=128,
            piece_rows=32,
            max_concurrent_steps=2,
            num_sms=3,
        ),
        jnp.bfloat16,
    ),
    "split_k_overlap_epilogue": (
        TgmmConfig(
            tile_k=64,
            tile_n=128,
            wg_split="k",
            max_concurrent_steps=3,
            epilogue_tile_n=128,
            overlap_epilogue=True,
            num_sms=3,
        ),
        jnp.bfloat16,
    ),
    "split_n_overlap_epilogue_epi2": (
        TgmmConfig(
            tile_k=64,
            tile_n=32,
            wg_split="n",
            max_concurrent_steps=2,
            epilogue_slots=2,
            overlap_epilogue=True,
            num_sms=2,
        ),
        jnp.bfloat16,
    ),
}
# 673 of 704 rows in groups (a zero tail); group 2 spans 7 row blocks (every ring slot is reused
# within one item); groups 0/2, 2/3, 5/6 and 6/tail share boundary blocks; two empty groups.
WGRAD_SIZES = [5, 0, 421, 37, 0, 150, 60]


def wgrad_operands():
    lhs, _ = operands(704, 128, 128, 1, seed=11)
    rhs = jax.random.normal(jax.random.key(12), (704, 128), jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs


def assert_wgrad_close(out, ref, lhs, rhs, sizes, out_dtype, groups=None):
    """|out - ref| within what two fp32 accumulations in different orders and two roundings to
    out_dtype allow, per element: 2 n 2^-24 sum_m |lhs[m, k] rhs[m, n]| over the group's n rows
    (the recursive-summation bound, for each side) plus 2 u |ref| (u = 2^-8 for bf16, 0 for
    fp32 outputs). With cancellation the first term exceeds any relative tolerance."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    lhs64, rhs64 = np.abs(np.asarray(lhs, np.float64)), np.abs(np.asarray(rhs, np.float64))
    rounding = 2.0**-8 if out_dtype == jnp.bfloat16 else 0.0
    for g in range(len(sizes)) if groups is None else groups:
        rows = slice(starts[g], starts[g] + sizes[g])
        magnitude = lhs64[rows].T @ rhs64[rows]
        bound = 2 * sizes[g] * 2.0**-24 * magnitude + 2 * rounding * np.abs(ref[g])
        assert np.all(np.abs(np.asarray(out[g], np.float64) - ref[g]) <= bound), g


@pytest.mark.parametrize("structure", WGRAD_STRUCTURES.values(), ids=WGRAD_STRUCTURES.keys())
def test_wgrad_structure_ring_reuse_boundaries_and_nan_isolation(interpret, structure):
    config, out_dtype = structure
    lhs, rhs = wgrad_operands()
    sizes = jnp.asarray(WGRAD_SIZES, jnp.int32)
    # NaN in group 2 at row 6 (inside group 0's only row block) and deep inside; Inf in group 5
    # at row 610 (inside group 6's first block); NaN in the zero tail (group 6's last block).
    bad_lhs = lhs.at[6, 3].set(jnp.nan).at[200, 0].set(jnp.nan).at[690, 5].set(jnp.nan)
    bad_rhs = rhs.at[610, 7].set(jnp.inf)
    out = np.asarray(
        tgmm(
            bad_lhs, bad_rhs, sizes, impl="pallas", config=config, preferred_element_type=out_dtype
        ),
        np.float32,
    )
    ref = np.asarray(
        tgmm(lhs, rhs, sizes, impl="xla", preferred_element_type=out_dtype), np.float32
    )
    assert_wgrad_close(out, ref, lhs, rhs, WGRAD_SIZES, out_dtype, groups=[0, 3, 6])
    assert not np.all(np.isfinite(out[2])) and not np.all(np.isfinite(out[5]))
    assert np.all(out[[1, 4]] == 0)
    # Without the bad values every group matches (the race detector checks this last run);
    # when a tile is stored does not change its bits.
    run = functools.partial(tgmm, lhs, rhs, sizes, impl="pallas", preferred_element_type=out_dtype)
    plain = run(config=dataclasses.replace(config, overlap_epilogue=False))
    out = run(config=config) if config.overlap_epilogue else plain
    assert_wgrad_close(np.asarray(out, np.float32), ref, lhs, rhs, WGRAD_SIZES, out_dtype)
    np.testing.assert_array_equal(bits(out), bits(plain))


@pytest.mark.parametrize("piece_rows", [8, 16, 64])
def test_wgrad_boundary_pieces_hold_only_the_groups_rows(piece_rows):
    """The zero-masked pieces holding each group's first and last row, which the wgrad kernel
    loads in place of pieces with other groups' rows: checked row by row against the sizes,
    incl. an empty group, a group inside one piece, a piece running past M and NaN in foreign
    rows; the last piece is all zeros."""
    x = jnp.arange(1, 201, dtype=jnp.float32)[:, None] * jnp.ones((1, 8))
    x = x.at[3, 2].set(jnp.nan)  # group 0's row, next to group 1's piece
    sizes = np.array([11, 0, 5, 150, 30])  # rows 196..199 belong to no group
    starts = np.cumsum(sizes) - sizes
    ends = starts + sizes
    anchors = starts - starts % 8
    out = np.asarray(boundary_pieces(x, *map(jnp.asarray, (starts, ends, anchors)), piece_rows))
    assert out.shape == ((2 * len(sizes) + 1) * piece_rows, 8)
    for g in range(len(sizes)):
        last_row = max(ends[g] - 1, anchors[g])
        firsts = (anchors[g], anchors[g] + (last_row - anchors[g]) // piece_rows * piece_rows)
        for which, first_row in enumerate(firsts):
            piece = out[(2 * g + which) * piece_rows : (2 * g + which + 1) * piece_rows]
            for i, values in enumerate(piece):
                row = first_row + i
                expected = np.asarray(x[row]) if starts[g] <= row < ends[g] else np.zeros(8)
                np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(out[-piece_rows:], 0)
    assert np.isnan(out[3, 2]) and not np.any(np.isnan(out[2 * piece_rows :]))  # group 0's only


def test_wgrad_bits_do_not_depend_on_config(interpret):
    """The reduction order (ascending rows, 16 per wgmma step, from the group's anchor) is the
    same for every warpgroup split, ring depth, piece size, epilogue, grid and tile order. (The CPU
    interpreter runs each wgmma as one numpy matmul of a warpgroup tile by a whole row block,
    whose rounding depends on the tile shape, so there the warpgroup tile and tile_rows stay
    fixed; on the GPU the tile shapes are varied too.)"""
    lhs, rhs = wgrad_operands()
    sizes = jnp.asarray(WGRAD_SIZES, jnp.int32)
    configs = [
        WGRAD_STRUCTURES["split_k_ring2_epi2"][0],
        WGRAD_STRUCTURES["split_n_ring3_unbalanced"][0],
        TgmmConfig(
            tile_k=64,
            tile_n=64,
            wg_split="k",
            max_concurrent_steps=3,
            epilogue_tile_n=32,
            grid_tile_width=2,
            piece_rows=16,
            num_sms=2,
        ),
    ]
    if ON_HOPPER:
        configs = [
            TgmmConfig(
                tile_k=tk,
                tile_n=tn,
                wg_split=split,
                max_concurrent_steps=steps,
                epilogue_slots=slots,
                piece_rows=pieces,
            )
            for tk, tn in ((128, 128), (64, 128), (64, 64))
            for split in ("k", "n")
            for steps, slots, pieces in ((4, 1, 8), (2, 2, 64))
            if 128 % (tk * (2 if split == "k" else 1)) == 0
            and 128 % (tn * (2 if split == "n" else 1)) == 0
        ]
    results = [bits(tgmm(lhs, rhs, sizes, impl="pallas", config=config)) for config in configs]
    assert len(results) >= 3
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    # 16-bit outputs: the epilogue overlapped with the next item or not.
    bf16 = [
        bits(
            tgmm(
                lhs,
                rhs,
                sizes,
                impl="pallas",
                preferred_element_type=jnp.bfloat16,
                config=dataclasses.replace(configs[0], overlap_epilogue=overlap),
            )
        )
        for overlap in (False, True)
    ]
    np.testing.assert_array_equal(bf16[1], bf16[0])


def test_row_bits_do_not_depend_on_other_groups_or_config(interpret):
    """Batch invariance: a row's output bits are the same when the groups around it grow,
    shrink or vanish, and under other tilings. (The CPU interpreter runs each wgmma as one numpy
    matmul over the whole tile_k block, so there tile_k must stay fixed; on the GPU every wgmma
    adds 16-wide K slices in order and tile_k is varied too.)"""
    lhs, rhs = operands(256, 128, 128, 4, seed=6)
    probe = 130  # a row of group 2 in every layout below
    layouts = {"a": [64, 40, 60, 36], "b": [0, 0, 200, 56], "c": [100, 7, 41, 9]}
    configs = [
        GMM_SMALL,
        dataclasses.replace(GMM_SMALL, overlap_wgmma=False, epilogue_slots=1),
        GmmConfig(
            tile_m=64,
            tile_n=64,
            tile_k=64,
            max_concurrent_steps=1,
            grid_tile_width=1,
            epilogue_tile_n=64,
            wg_split="n",
            num_sms=2,
        ),
    ]
    if ON_HOPPER:
        configs = [
            GmmConfig(
                tile_m=tm,
                tile_n=64,
                tile_k=tk,
                wg_split=split,
                max_concurrent_steps=2 if tk == 64 else 1,
                overlap_wgmma=overlap,
                epilogue_tile_n=32,
                epilogue_slots=1 if overlap else 2,
                cluster_n=2 if tk == 64 and split == "m" else 1,
            )
            for tm in (64, 128)
            for tk in (64, 128)
            for split in ("n", "m")
            for overlap in (True, False)
        ]
    for config in configs:
        config.validate(256, 128, 128, out_dtype=jnp.float32)
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
    halves = gmm(lhs[:, :128], rhs[:, :128], sizes, impl="xla") + gmm(
        lhs[:, 128:], rhs[:, 128:], sizes, impl="xla"
    )
    assert np.any(bits(whole) != bits(halves))


@pytest.mark.exhaustive
def test_moe_layer_gradients_pallas_equal_xla(interpret):
    """jax.grad of the whole layer with every grouped matmul on the Pallas kernels."""
    config = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=64, aux_loss_coeff=1e-2)
    x = jax.random.normal(jax.random.key(8), (48, 64), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(9), (48, 64), jnp.float32)

    y_p, gx_p, *gm_p = output_and_grads(config, x, dy, "pallas")
    y_x, gx_x, *gm_x = output_and_grads(config, x, dy, "xla")
    # Forward: fp32 accumulation in both, one bf16 rounding: identical up to accumulation order
    # inside the GEMMs (at most 1 bf16 ulp where the fp32 sums straddle a rounding boundary).
    np.testing.assert_allclose(
        np.asarray(y_p, np.float32), np.asarray(y_x, np.float32), rtol=2**-7, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(gx_p, np.float32), np.asarray(gx_x, np.float32), rtol=2**-6, atol=1e-5
    )
    for a, b in zip(gm_p, gm_x):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-6, atol=1e-5
        )


def test_tile_schedule_covers_every_row_once():
    sizes = jnp.array([37, 0, 90, 50, 3, 0, 17], jnp.int32)
    tiles = row_tiles(sizes, 232, 64)
    owner = np.full(232, -1)
    for group, row, rows in zip(*map(np.asarray, (tiles.group, tiles.start, tiles.count))):
        if rows:
            assert np.all(owner[row : row + rows] == -1)
            owner[row : row + rows] = group
            assert row - row % 8 + 64 >= row + rows  # fits the 8-aligned window
    expected = np.repeat(np.arange(8), np.asarray(list(sizes) + [232 - int(sizes.sum())]))
    np.testing.assert_array_equal(owner, expected)


def _lower_gmm_and_tgmm(num_rows, k, n, num_groups) -> float:
    """Seconds to lower the forward, dgrad and wgrad kernels (Pallas -> Mosaic GPU, on CPU)."""
    lhs = jax.ShapeDtypeStruct((num_rows, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((num_groups,), jnp.int32)
    start = time.perf_counter()
    for transpose_rhs in (False, True):
        rhs = jax.ShapeDtypeStruct(
            (num_groups, n, k) if transpose_rhs else (num_groups, k, n), jnp.bfloat16
        )
        fn = functools.partial(
            gmm,
            impl="pallas",
            transpose_rhs=transpose_rhs,
            preferred_element_type=jnp.bfloat16,
            config=GmmConfig(),
        )
        jax.jit(fn).trace(lhs, rhs, sizes).lower(lowering_platforms=("cuda",))
    wgrad = functools.partial(tgmm, impl="pallas", config=TgmmConfig())
    jax.jit(wgrad).trace(lhs, jax.ShapeDtypeStruct((num_rows, n), jnp.bfloat16), sizes).lower(
        lowering_platforms=("cuda",)
    )
    return time.perf_counter() - start


def test_lowering_for_hopper_is_as_fast_for_256_experts_as_for_8():
    """Full Pallas -> Mosaic GPU lowering on CPU (no GPU needed) at a real MoE shape: tile
    metadata is computed outside the kernel, so 256 experts lower about as fast as 8 (an
    in-kernel loop over the groups would take ~32x longer). A first lowering at another shape
    takes the one-time costs out of the ratio."""
    _lower_gmm_and_tgmm(4096, 1024, 512, 4)
    eight = _lower_gmm_and_tgmm(65536, 2048, 1536, 8)
    many = _lower_gmm_and_tgmm(65536, 2048, 1536, 256)
    assert many < 2 * eight, (many, eight)


def test_pallas_refuses_unsupported_problems():
    with pytest.raises(ValueError, match="shared memory"):
        GmmConfig(max_concurrent_steps=6).validate(4096, 1024, 1024)
    with pytest.raises(ValueError, match="128 bytes"):
        GmmConfig(epilogue_tile_n=32).validate(4096, 1024, 1024, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="cluster_n=3 must be 1 or 2"):
        GmmConfig(cluster_n=3).validate(4096, 1024, 1024)
    with pytest.raises(ValueError, match="scale_lookahead=0 must be >= 1"):
        GmmConfig(scale_lookahead=0).validate(4096, 1024, 1024)
    with pytest.raises(ValueError, match="times cluster_n=2"):
        GmmConfig(cluster_n=2).validate(4096, 1024, 768)  # three 256-wide CTA tiles
    lhs, rhs = operands(64, 96, 64, 2)
    with pytest.raises(ValueError, match="multiples of 64"):
        gmm(lhs, rhs, jnp.array([32, 32]), impl="pallas")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.array([32, 32]), impl="pallas")
    out = gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.array([32, 32]), impl="auto")
    assert out.shape == (64, 64)  # auto falls back to XLA


def test_tgmm_config_refuses_what_the_kernel_cannot_run():
    base = TgmmConfig()  # CTA tile 256 x 128, 4 ring slots of 64 rows
    base.validate(65536, 2048, 1536, out_dtype=jnp.bfloat16)
    base.validate(65536, 2048, 1536, out_dtype=jnp.float32)  # narrower epilogue chunks
    for out_dtype, overlapped in ((jnp.bfloat16, True), (jnp.float32, False)):
        default = default_tgmm_config(65536, 2048, 1536, out_dtype)
        assert default.overlap_epilogue == overlapped
        default.validate(65536, 2048, 1536, out_dtype=out_dtype)
    refusals = {
        "shared memory": dict(max_concurrent_steps=5),
        "multiple of 64": dict(tile_rows=32),
        "must be >= 2": dict(max_concurrent_steps=1),
        "wg_split": dict(wg_split="m"),
        "registers": dict(tile_k=128, tile_n=256),
        "epilogue chunks": dict(epilogue_tile_n=96),
        "16-bit output": dict(overlap_epilogue=True),
    }
    for message, change in refusals.items():
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(base, **change).validate(4096, 2048, 1536)
    with pytest.raises(ValueError, match="CTA tile"):
        base.validate(4096, 2048, 1600)  # N is not a multiple of 128
    lhs, _ = operands(64, 96, 64, 1)
    with pytest.raises(ValueError, match="multiples of 64"):
        tgmm(lhs, lhs[:, :64], jnp.array([64]), impl="pallas")


def accumulation_bound(lhs, rhs, sizes, *, transpose_rhs=False, wgrad=False):
    """Elementwise bound on |kernel - XLA| for fp32 results of bf16 operands. A bf16 x bf16
    product is exact in fp32, so both sum the same K exact products in fp32, in different
    orders. A recursive fp32 sum of K terms is within (K - 1) u sum_k |a_k b_k| of the exact sum,
    with u = 2^-24 for round-to-nearest adds and 2^-23 for adders that truncate (as tensor cores
    may): the two results differ by at most 2 K 2^-23 sum_k |a_k b_k|."""
    a, b = jnp.abs(lhs.astype(jnp.float32)), jnp.abs(rhs.astype(jnp.float32))
    if wgrad:
        contraction = int(np.max(np.asarray(sizes)))
        magnitude = tgmm(a, b, sizes, impl="xla")
    else:
        contraction = lhs.shape[1]
        magnitude = gmm(a, b, sizes, transpose_rhs=transpose_rhs, impl="xla")
    return 2 * contraction * 2.0**-23 * np.asarray(magnitude, np.float64) + 1e-30


def assert_within(got, want, bound):
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(error <= bound), f"worst error / bound {np.max(error / bound):.3g}"


@pytest.mark.gpu
def test_gpu_forward_dgrad_wgrad_and_invariance_on_hardware():
    """On an H100/H200: the same properties at a realistic size, default configs; results
    within the derived accumulation-order bound of XLA's (`accumulation_bound`); the rows past
    the groups left unwritten, the others the same bits."""
    lhs, rhs = operands(4096, 1024, 512, 16, seed=10)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(4000, np.ones(16) / 16), jnp.int32)
    out = gmm(lhs, rhs, sizes, impl="pallas")
    assert_within(out, gmm(lhs, rhs, sizes, impl="xla"), accumulation_bound(lhs, rhs, sizes))
    assert np.all(np.asarray(out)[4000:] == 0)
    unwritten = gmm(lhs, rhs, sizes, impl="pallas", write_rows_past_groups=False)
    np.testing.assert_array_equal(bits(unwritten)[:4000], bits(out)[:4000])
    grad = out.astype(jnp.bfloat16)
    dgrad = gmm(grad, rhs, sizes, transpose_rhs=True, impl="pallas")
    assert_within(
        dgrad,
        gmm(grad, rhs, sizes, transpose_rhs=True, impl="xla"),
        accumulation_bound(grad, rhs, sizes, transpose_rhs=True),
    )
    wgrad = tgmm(lhs, grad, sizes, impl="pallas")
    assert_within(
        wgrad, tgmm(lhs, grad, sizes, impl="xla"), accumulation_bound(lhs, grad, sizes, wgrad=True)
    )
    moved = sizes.at[0].add(-5).at[15].add(5)  # every group from 1 on starts 5 rows earlier
    starts = np.cumsum(np.asarray(sizes)) - np.asarray(sizes)
    probe = int(starts[7]) + int(sizes[7]) // 2  # the middle of group 7 in both layouts
    moved_out = gmm(lhs.at[probe - 5].set(lhs[probe]), rhs, moved, impl="pallas")
    np.testing.assert_array_equal(bits(moved_out)[probe - 5], bits(out)[probe])
