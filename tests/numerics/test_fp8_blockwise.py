"""FP8 blockwise quantization (`jaxmoe.fp8_blockwise`, TE's Float8BlockScaling at its defaults):
the integer-bit scale rule against the float division it replaces on every mantissa at many
exponents; the quantizers bitwise against a numpy port of TE's kernels (float arithmetic, which
numpy does without flushing subnormals) on the edge cases (zeros, NaN, +-Inf, subnormal inputs,
amax mantissas at and around 1.75, amax whose quotient overflows, partial blocks); the reference
GEMMs exact on inputs whose partials are exact, and within the fp32 bound on random data; the
Hopper kernels (fprop/dgrad, wgrad) against them in the interpreter and lowered at real
shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from interpreter_tilings import FP8_GMM_SMALL

import jaxmoe.ops.device
from jaxmoe import fp8_blockwise as fb
from jaxmoe.ops import gmm, on_hopper, tgmm
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import BlockwiseTgmmConfig
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import default_config as default_tgmm_config

F32, BF16 = np.float32, ml_dtypes.bfloat16
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAX_FP8 = {"e4m3": 448.0, "e5m2": 57344.0}


# ------------------------------------------------------------------- a numpy port of TE's kernel
def te_scale(amax, fmt, x_dtype):
    """compute_scale_from_amax(amax, max_fp8, pow2=True, eps=0, max of x_dtype), elementwise."""
    amax = np.asarray(amax, F32)
    with np.errstate(divide="ignore", over="ignore"):
        scale = F32(MAX_FP8[fmt]) / amax
    scale = np.where(np.isinf(scale), F32(ml_dtypes.finfo(x_dtype).max), scale).astype(F32)
    scale = (scale.view(np.uint32) & np.uint32(0xFF800000)).view(F32)
    return np.where((amax == 0) | np.isinf(amax) | np.isnan(amax), F32(1), scale)


def te_quantize(x, block_axes, fmt="e4m3"):
    """(data bytes, scale_inv) as TE's blockwise kernels compute them."""
    x = np.asarray(x)
    shape = x.shape
    padded = [-(-n // 128) * 128 if a in block_axes else n for a, n in enumerate(shape)]
    xf = np.pad(x.astype(F32), [(0, p - n) for p, n in zip(padded, shape)])
    blocked, within = [], []
    for a, n in enumerate(padded):
        blocked += [n // 128, 128] if a in block_axes else [n]
        if a in block_axes:
            within.append(len(blocked) - 1)
    xb = xf.reshape(blocked)
    amax = np.fmax.reduce(np.abs(xb), axis=tuple(within), keepdims=True, initial=F32(0))
    scale = te_scale(amax, fmt, x.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(xb * scale, -MAX_FP8[fmt], MAX_FP8[fmt]).astype(F32)  # satfinite
    q = y.astype(FP8[fmt]).view(np.uint8)
    q = np.where(np.isnan(xb), np.uint8(0x7F), q).reshape(padded)[tuple(slice(0, n) for n in shape)]
    scale_inv = (F32(1) / scale).astype(F32)
    return q, np.squeeze(scale_inv, tuple(within))


def assert_matches_te(x, block_axes, fmt="e4m3"):
    t = (
        fb.quantize_1x128(jnp.asarray(x), block_axes[0], fmt)
        if len(block_axes) == 1
        else fb.quantize_128x128(jnp.asarray(x), fmt)
    )
    q, scale_inv = te_quantize(x, block_axes, fmt)
    np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8), q)
    np.testing.assert_array_equal(
        np.asarray(t.scale_inv).view(np.uint32), scale_inv.view(np.uint32)
    )
    return t


# --------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("exponent", [0, 1, 2, 3, 4, 9, 10, 60, 126, 127, 128, 200, 253, 254])
def test_scale_rule_equals_the_division_on_every_mantissa(fmt, exponent):
    """amax = every mantissa at this biased exponent (0: the fp32 subnormals, whose quotient
    overflows to the dtype's max)."""
    bits = (np.uint32(exponent) << 23) | np.arange(1 << 23, dtype=np.uint32)
    k = np.asarray(fb.scale_exponent_from_amax_bits(jnp.asarray(bits), fmt))
    want = te_scale(bits.view(F32), fmt, F32)
    got = (np.exp2(k.astype(np.float64))).astype(F32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_scale_rule_special_amax():
    k = fb.scale_exponent_from_amax_bits(jnp.array([0, 0x7F800000], jnp.uint32))
    np.testing.assert_array_equal(np.asarray(k), [0, 0])  # scale 1 for amax 0 and +Inf


# ----------------------------------------------------------------------------- quantizers
def edge_blocks(dtype):
    """Rows of 128 covering TE's special cases, one block per row."""
    rng = np.random.default_rng(0)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    rows = [
        np.zeros(128),
        -np.zeros(128),
        np.r_[np.nan, rng.normal(size=127)],
        np.full(128, np.nan),
        np.r_[np.inf, rng.normal(size=127)],
        np.r_[-np.inf, np.nan, rng.normal(size=126)],
        np.r_[tiny, -tiny, np.zeros(126)],
        np.r_[3 * tiny, tiny, np.zeros(126)],
        rng.normal(size=128) * 1e-38,
        np.r_[float(ml_dtypes.finfo(dtype).max), rng.normal(size=127)],
        np.r_[1.75, rng.uniform(-1.75, 1.75, 127)],
        np.r_[np.nextafter(F32(1.75), F32(2)), rng.uniform(-1, 1, 127)],
        np.r_[np.nextafter(F32(1.75), F32(1)), rng.uniform(-1, 1, 127)],
        rng.normal(size=128) * 2.0 ** rng.integers(-30, 30),
    ]
    return np.stack([np.asarray(r, np.float64) for r in rows]).astype(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [F32, BF16, np.float16])
def test_1x128_equals_te_on_edge_cases(dtype, fmt):
    with np.errstate(over="ignore", invalid="ignore"):
        x = edge_blocks(dtype)
    assert_matches_te(x, (1,), fmt)
    assert_matches_te(np.ascontiguousarray(x.T), (0,), fmt)  # the token-direction copy


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_128x128_equals_te_and_transposes_exactly(dtype):
    rng = np.random.default_rng(1)
    with np.errstate(over="ignore", invalid="ignore"):
        rows = np.tile(edge_blocks(dtype).astype(F32), (15, 2))[:200, :160]  # partial blocks
        w = (rows * 2.0 ** rng.integers(-8, 8, (2, 200, 1))).astype(dtype)
    t = assert_matches_te(w, (1, 2))
    assert t.scale_inv.shape == (2, 2, 2)
    transposed = fb.quantize_128x128(jnp.swapaxes(jnp.asarray(w), 1, 2))
    np.testing.assert_array_equal(
        np.asarray(transposed.data).view(np.uint8),
        np.swapaxes(np.asarray(t.data).view(np.uint8), 1, 2),
    )
    np.testing.assert_array_equal(
        np.asarray(transposed.scale_inv), np.swapaxes(np.asarray(t.scale_inv), 1, 2)
    )


@pytest.mark.parametrize("shape, axis", [((3, 300), 1), ((300, 5), 0), ((2, 130, 4), 1)])
def test_partial_blocks_and_random_values(shape, axis):
    x = (np.random.default_rng(2).standard_t(3, size=shape) * 10).astype(BF16)
    t = assert_matches_te(x, (axis,))
    np.testing.assert_array_equal(
        np.asarray(fb.dequantize(t)),
        np.asarray(t.data).astype(F32) * np.asarray(fb.block_multipliers(t)),
    )


def test_one_element_changes_its_block_alone():
    """Negative control: raising one element's magnitude past its block's amax changes that
    block's scale and data, and no other block."""
    x = np.random.default_rng(3).normal(size=(2, 256)).astype(F32)
    before = fb.quantize_1x128(jnp.asarray(x))
    x[0, 5] = 1000.0
    after = fb.quantize_1x128(jnp.asarray(x))
    changed = np.asarray(before.scale_inv) != np.asarray(after.scale_inv)
    np.testing.assert_array_equal(changed, [[True, False], [False, False]])
    np.testing.assert_array_equal(np.asarray(before.data)[:, 128:], np.asarray(after.data)[:, 128:])


def test_refusals():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        fb.quantize_1x128(jnp.zeros((2, 128), jnp.int32))
    with pytest.raises(ValueError, match="out of range"):
        fb.quantize_1x128(jnp.zeros((2, 128)), axis=2)
    with pytest.raises(ValueError, match="two axes"):
        fb.quantize_128x128(jnp.zeros(128))
    with pytest.raises(ValueError, match="empty"):
        fb.quantize_1x128(jnp.zeros((0, 128)))
    with pytest.raises(ValueError, match="fmt"):
        fb.quantize_1x128(jnp.zeros((2, 128)), fmt="e3m4")


# ------------------------------------------------------------------------ reference GEMMs
def exact_operands(m, k, n, g, seed):
    """Integers in [-7, 7] scaled by a power of two per block (lhs per 1x128 block, rhs per
    128x128 block): every quantized value is exact, and so is every partial and fold."""
    rng = np.random.default_rng(seed)
    lhs = rng.integers(-7, 8, (m, k)) * 2.0 ** rng.integers(-2, 3, (m, k // 128)).repeat(128, 1)
    rhs = rng.integers(-7, 8, (g, k, n)) * 2.0 ** rng.integers(
        -2, 3, (g, k // 128, 1, n // 128)
    ).repeat(128, 2).repeat(128, 3).reshape(g, k, n)
    return lhs.astype(F32), rhs.astype(F32)


def grouped_product(lhs, rhs, sizes, transpose_rhs=False):
    out = np.zeros((lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        w = rhs[g].T if transpose_rhs else rhs[g]
        out[start : start + size] = lhs[start : start + size].astype(np.float64) @ w
        start += size
    return out


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fprop", "dgrad"])
def test_gmm_reference_is_exact_on_exact_operands(transpose_rhs):
    lhs, rhs = exact_operands(96, 384, 256, 3, seed=4)
    if transpose_rhs:  # dgrad: contract the weights' N; lhs is a gradient [M, N]
        lhs = lhs[:, :256]
    sizes = np.array([40, 0, 50])  # rows 90.. belong to no group
    out = fb.gmm_reference(
        fb.quantize_1x128(jnp.asarray(lhs)),
        fb.quantize_128x128(jnp.asarray(rhs)),
        jnp.asarray(sizes),
        transpose_rhs=transpose_rhs,
    )
    np.testing.assert_array_equal(np.asarray(out), grouped_product(lhs, rhs, sizes, transpose_rhs))


def test_gmm_reference_scales_each_block_by_its_own_scales():
    """Negative control: moving one lhs block's scale to its neighbour changes the result."""
    lhs, rhs = exact_operands(32, 256, 128, 1, seed=5)
    lq, rq = fb.quantize_1x128(jnp.asarray(lhs)), fb.quantize_128x128(jnp.asarray(rhs))
    swapped = fb.BlockwiseTensor(lq.data, lq.scale_inv[:, ::-1], lq.block_axes)
    sizes = jnp.array([32])
    assert np.any(
        np.asarray(fb.gmm_reference(swapped, rq, sizes))
        != np.asarray(fb.gmm_reference(lq, rq, sizes))
    )


def test_gmm_reference_within_the_fp32_bound_on_random_data():
    rng = np.random.default_rng(6)
    lhs = rng.normal(size=(64, 512)).astype(F32)
    rhs = rng.normal(size=(2, 512, 256)).astype(F32)
    lq, rq = fb.quantize_1x128(jnp.asarray(lhs)), fb.quantize_128x128(jnp.asarray(rhs))
    sizes = np.array([30, 34])
    out = np.asarray(fb.gmm_reference(lq, rq, jnp.asarray(sizes)))
    a, b = np.asarray(fb.dequantize(lq), np.float64), np.asarray(fb.dequantize(rq), np.float64)
    exact = grouped_product(a, b, sizes)
    absdot = grouped_product(np.abs(a), np.abs(b), sizes)
    k = lhs.shape[1]
    assert np.all(np.abs(out - exact) <= (k + k // 128) * 2.0**-24 * absdot + 1e-30)


def test_tgmm_reference_is_exact_on_exact_operands():
    rng = np.random.default_rng(7)
    x = rng.integers(-7, 8, (384, 128)) * 2.0 ** rng.integers(-4, 4, (3, 1, 128)).repeat(
        128, 1
    ).reshape(384, 128)
    dy = rng.integers(-7, 8, (384, 256)).astype(F32)
    sizes = np.array([256, 0, 128])
    out = fb.tgmm_reference(
        fb.quantize_1x128(jnp.asarray(x, jnp.float32), 0),
        fb.quantize_1x128(jnp.asarray(dy), 0),
        sizes,
    )
    want = np.stack([x[:256].T @ dy[:256], np.zeros((128, 256)), x[256:].T @ dy[256:]])
    np.testing.assert_array_equal(np.asarray(out), want)
    with pytest.raises(ValueError, match="multiples of 128"):
        fb.tgmm_reference(
            fb.quantize_1x128(jnp.asarray(x, jnp.float32), 0),
            fb.quantize_1x128(jnp.asarray(dy), 0),
            np.array([100, 284]),
        )


# ------------------------------------------------------------------------- the Hopper kernel


@pytest.mark.parametrize(
    "transpose_rhs,wg_split,tile_k,lookahead",
    [(False, "m", 128, 1), (False, "m", 256, 2), (True, "m", 128, 2), (True, "n", 128, 3)],
    ids=["fprop", "fprop-two-blocks-a-step", "dgrad", "dgrad-wg_n"],
)
def test_kernel_equals_the_reference_on_exact_operands(
    interpret, transpose_rhs, wg_split, tile_k, lookahead
):
    """The 128-wide scale blocks' kernel (one fp8 wgmma per block, folded with the product of
    its scales; a warpgroup's columns share one weight block's scale, whichever way the
    warpgroups split the tile; one or two blocks a K step, the default tiling's two; the
    scales loaded 1, 2 (the default) or 3 K steps ahead, past the last step too) against
    the reference: equal where every partial is exact (the
    weight blocks' scales differ), zeros past the groups, empty groups; control: the reference
    with one lhs block's scale moved differs."""
    lhs, rhs = exact_operands(200, 256, 384, 3, seed=8)
    if transpose_rhs:
        lhs = np.tile(lhs, (1, 2))[:, :384]
    lq, rq = fb.quantize_1x128(jnp.asarray(lhs)), fb.quantize_128x128(jnp.asarray(rhs))
    assert len(np.unique(np.asarray(rq.scale_inv))) > 2
    sizes = jnp.array([70, 0, 100])
    # wg_split "n": 128 output columns a warpgroup (dgrad's 256), so the two warpgroups read
    # different weight blocks' scales
    tile_n = 128 if wg_split == "n" else FP8_GMM_SMALL.tile_n
    config = None
    if not on_hopper():
        steps = min(FP8_GMM_SMALL.max_concurrent_steps, lhs.shape[1] // tile_k)
        config = dataclasses.replace(
            FP8_GMM_SMALL,
            wg_split=wg_split,
            tile_n=tile_n,
            tile_k=tile_k,
            max_concurrent_steps=steps,
            scale_lookahead=lookahead,
        )
    got = gmm(lq, rq, sizes, transpose_rhs=transpose_rhs, impl="pallas", config=config)
    want = gmm(lq, rq, sizes, transpose_rhs=transpose_rhs, impl="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(want), grouped_product(lhs, rhs, [70, 0, 100], transpose_rhs)
    )
    moved = fb.BlockwiseTensor(lq.data, jnp.roll(lq.scale_inv, 1, axis=1), lq.block_axes)
    assert np.any(
        np.asarray(gmm(moved, rq, sizes, transpose_rhs=transpose_rhs, impl="xla"))
        != np.asarray(want)
    )


def test_kernel_within_the_error_bound_on_random_data(interpret):
    rng = np.random.default_rng(9)
    lq = fb.quantize_1x128(jnp.asarray(rng.normal(size=(130, 256)), jnp.bfloat16))
    rq = fb.quantize_128x128(jnp.asarray(rng.normal(size=(2, 256, 128)), jnp.bfloat16))
    sizes = np.array([64, 60])
    config = None if on_hopper() else FP8_GMM_SMALL
    got = np.asarray(gmm(lq, rq, jnp.asarray(sizes), impl="pallas", config=config))
    a, b = np.asarray(fb.dequantize(lq), np.float64), np.asarray(fb.dequantize(rq), np.float64)
    exact = grouped_product(a, b, sizes)
    # The fp32 bound of K + K/128 roundings; on the H200 the fp8 tensor cores add each k32
    # wgmma's products with fewer fraction bits (2^-12 relative, as tests/kernels/test_gmm_mxfp8_pallas.py
    # derives), four of them per 128-wide K block before the scaled block sum leaves them.
    per_block_rel = 4 * 2.0**-12 if on_hopper() else 0.0
    rel = per_block_rel + 2 * (256 + 2) * 2.0**-24
    bound = rel * grouped_product(np.abs(a), np.abs(b), sizes) + 1e-30
    assert np.all(np.abs(got - exact) <= bound) and np.all(got[124:] == 0)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_rows_past_the_groups_left_unwritten(interpret, monkeypatch, impl):
    """write_rows_past_groups=False (`jaxmoe.ops.live_rows`): the rows of the groups the
    default call's bits, the rows past them left unwritten (the interpreter's NaN) or filled
    (the reference, DEAD_ROW_FILL = NaN); by default zeros (control)."""
    from jaxmoe.ops import live_rows

    monkeypatch.setattr(live_rows, "DEAD_ROW_FILL", np.nan)
    rng = np.random.default_rng(10)
    lq = fb.quantize_1x128(jnp.asarray(rng.normal(size=(256, 256)), jnp.bfloat16))
    rq = fb.quantize_128x128(jnp.asarray(rng.normal(size=(2, 256, 128)), jnp.bfloat16))
    sizes = jnp.array([128, 0])
    config = None if on_hopper() or impl == "xla" else FP8_GMM_SMALL
    run = lambda written: np.asarray(  # noqa: E731
        gmm(lq, rq, sizes, impl=impl, config=config, write_rows_past_groups=written)
    )
    got, default = run(False), run(True)
    np.testing.assert_array_equal(got[:128], default[:128])
    assert np.all(np.isnan(got[128:])) and np.all(default[128:] == 0)


def test_gmm_refuses_bad_operands():
    lq = fb.quantize_1x128(jnp.ones((32, 256)))
    rq = fb.quantize_128x128(jnp.ones((2, 256, 128)))
    with pytest.raises(ValueError, match="1x128 blocks along C"):
        gmm(fb.quantize_1x128(jnp.ones((32, 256)), 0), rq, jnp.array([16, 16]))
    with pytest.raises(ValueError, match="contract 128"):
        gmm(lq, rq, jnp.array([16, 16]), transpose_rhs=True)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lq, rq, jnp.array([16, 16, 0]))
    odd = fb.quantize_128x128(jnp.ones((2, 256, 96)))
    with pytest.raises(ValueError, match="multiples of 128"):
        gmm(lq, odd, jnp.array([16, 16]), impl="pallas")


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fprop", "dgrad"])
def test_kernel_lowers_at_real_shapes(transpose_rhs):
    """Pallas -> Mosaic GPU lowering on CPU at the mixtral and dsv3 expert shapes."""
    s = jax.ShapeDtypeStruct
    for m, k, n, g in [(16384, 4096, 14336, 8), (32768, 7168, 2048, 32)]:
        c = n if transpose_rhs else k

        def run(ld, ls, rd, rs, sizes):
            lq = fb.BlockwiseTensor(ld, ls, (1,))
            rq = fb.BlockwiseTensor(rd, rs, (1, 2))
            return gmm(
                lq,
                rq,
                sizes,
                transpose_rhs=transpose_rhs,
                impl="pallas",
                preferred_element_type=jnp.bfloat16,
            )

        jax.jit(run).trace(
            s((m, c), jnp.float8_e4m3fn),
            s((m, c // 128), jnp.float32),
            s((g, k, n), jnp.float8_e4m3fn),
            s((g, k // 128, n // 128), jnp.float32),
            s((g,), jnp.int32),
        ).lower(lowering_platforms=("cuda",))


# ------------------------------------------------------------------- the Hopper wgrad kernel
# Interpreter tiling: 64 x 64 outputs a warpgroup, a 2-slot ring that runs across the items of
# 3 CTAs (each takes several items, so the ring and its barriers carry over between items).
WGRAD_SMALL = BlockwiseTgmmConfig(tile_k=64, tile_n=64, slots=2, epilogue_n=32, num_sms=3)


def exact_token_operands(m, k, n, seed):
    """x [M, K] and dy [M, N], integers in [-7, 7] times a power of two per 1 x 128 block along
    the tokens: every quantized value, partial and fold is exact."""
    rng = np.random.default_rng(seed)
    scale = lambda cols: 2.0 ** rng.integers(-2, 3, (m // 128, 1, cols)).repeat(128, 1)
    x = rng.integers(-7, 8, (m, k)) * scale(k).reshape(m, k)
    dy = rng.integers(-7, 8, (m, n)) * scale(n).reshape(m, n)
    return x.astype(F32), dy.astype(F32)


WGRAD_TILINGS = {  # BlockwiseTgmmConfig changes
    # side by side along N the CTA tile is 256 columns wide, N's 256 hold no pair of them
    "split_n": dict(wg_split="n", blocks_per_step=1, cluster_n=1),
    "split_k": dict(wg_split="k", blocks_per_step=1),
    "two_blocks": dict(wg_split="k", blocks_per_step=2),
    "unpaired": dict(cluster_n=1),
    "banded": dict(wg_split="k", blocks_per_step=2, grid_tile_width=3),
    "pairs": dict(wg_split="k", blocks_per_step=2, cluster_n=2, grid_tile_width=1),
    "l2_scales": dict(wg_split="k", blocks_per_step=2, scales="l2"),
    "l2_scales_split_n": dict(wg_split="n", blocks_per_step=1, scales="l2", cluster_n=1),
    "l2_banded_pairs": dict(scales="l2", grid_tile_width=1, cluster_n=2),
}


@pytest.mark.parametrize("tiling", WGRAD_TILINGS)
def test_wgrad_kernel_equals_the_reference_on_exact_operands(interpret, tiling):
    """out[g] = x_g^T dy_g from the 1 x 128-along-tokens copies: the kernel (its warpgroups
    side by side along N or K; one or two blocks a ring slot; items in bands of N tiles; CTA
    pairs multicasting the lhs tile; scales from the ring or from L2), the reference and the
    exact product agree bitwise, with an empty group, groups of odd block counts, rows past the
    groups and M not a multiple of 128, or groups up to M; control: the reference with one
    block's scales moved differs."""
    changes = WGRAD_TILINGS[tiling]
    k = 256 if "grid_tile_width" in changes else 128  # bands of N tiles over two K tiles
    x, dy = exact_token_operands(640, k, 256, seed=3)
    base = default_tgmm_config(k, 256) if on_hopper() else WGRAD_SMALL
    pair = changes.get("cluster_n", 1)
    config = dataclasses.replace(base, num_sms=base.num_sms + base.num_sms % pair, **changes)
    for rows, group_sizes in [(600, [256, 0, 128, 128]), (640, [256, 0, 256, 128])]:
        xq = fb.quantize_1x128(jnp.asarray(x[:rows]), 0)
        dq = fb.quantize_1x128(jnp.asarray(dy[:rows]), 0)
        sizes = jnp.array(group_sizes)
        got = tgmm(xq, dq, sizes, impl="pallas", config=config)
        want = tgmm(xq, dq, sizes, impl="xla")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        x_t, dy_t = (fb.quantize_1x128(jnp.asarray(a[:rows].T), 1) for a in (x, dy))
        got_t = tgmm(
            x_t, dy_t, sizes, tokens_last=True, impl="pallas", config=config
        )  # the K-major copies as the layer passes them
        np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want))
        bounds = np.concatenate([[0], np.cumsum(group_sizes)])
        exact = np.stack(
            [x[a:b].astype(np.float64).T @ dy[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        )
        np.testing.assert_array_equal(np.asarray(want), exact)
    moved = fb.BlockwiseTensor(xq.data, jnp.roll(xq.scale_inv, 1, axis=0), xq.block_axes)
    assert np.any(np.asarray(tgmm(moved, dq, sizes, impl="xla")) != exact)


def test_wgrad_kernel_within_the_error_bound_on_random_data(interpret):
    """Random bf16 operands: within the fp32 bound of the per-block folds (and, on the H200,
    the fp8 tensor cores' 2^-12 per k32 product sum, four per block); bf16 output."""
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.normal(size=(384, 128)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(384, 128)) * 2.0 ** rng.integers(-3, 3, (1, 128)))
    xq, dq = fb.quantize_1x128(x, 0), fb.quantize_1x128(dy.astype(jnp.bfloat16), 0)
    sizes = np.array([128, 256])
    config = None if on_hopper() else WGRAD_SMALL
    got = np.asarray(tgmm(xq, dq, jnp.asarray(sizes), impl="pallas", config=config))
    a, b = np.asarray(fb.dequantize(xq), np.float64), np.asarray(fb.dequantize(dq), np.float64)
    exact = np.stack([a[:128].T @ b[:128], a[128:].T @ b[128:]])
    absdot = np.stack([np.abs(a[:128]).T @ np.abs(b[:128]), np.abs(a[128:]).T @ np.abs(b[128:])])
    per_block_rel = 4 * 2.0**-12 if on_hopper() else 0.0
    bound = (per_block_rel + 2 * (128 + 3) * 2.0**-24) * absdot + 1e-30
    assert np.all(np.abs(got - exact) <= bound)


def test_wgrad_refuses_bad_operands():
    xq = fb.quantize_1x128(jnp.ones((256, 128)), 0)
    with pytest.raises(ValueError, match="blocks along M"):
        tgmm(fb.quantize_1x128(jnp.ones((256, 128)), 1), xq, jnp.array([256]))
    with pytest.raises(ValueError, match="multiples of 128"):  # sizes on the host: checked
        tgmm(xq, xq, np.array([100, 156]))
    with pytest.raises(ValueError, match=r"lhs\^T \[K, M\]"):  # not the K-major copies
        tgmm(xq, xq, jnp.array([256]), tokens_last=True)
    with pytest.raises(ValueError, match="N=96 of 128"):
        tgmm(xq, fb.quantize_1x128(jnp.ones((256, 96)), 0), jnp.array([256]), impl="pallas")
    with pytest.raises(ValueError, match="cluster_n=2 must be 1 or 2 and divide num_sms=3"):
        dataclasses.replace(WGRAD_SMALL, cluster_n=2).validate(128, 256, F32)
    with pytest.raises(ValueError, match="N=192 of its 64 columns times cluster_n=2"):
        dataclasses.replace(WGRAD_SMALL, cluster_n=2, num_sms=4).validate(128, 192, F32)
    with pytest.raises(ValueError, match="scales must be 'ring' or 'l2'"):
        dataclasses.replace(WGRAD_SMALL, scales="smem").validate(128, 256, F32)
    with pytest.raises(ValueError, match="grid_tile_width=-1 must be >= 0"):
        dataclasses.replace(WGRAD_SMALL, grid_tile_width=-1).validate(128, 256, F32)


def test_wgrad_heuristic_bands_only_groups_larger_than_half_the_l2():
    """Items go in bands of 4 N tiles where a group's rhs copy (N x its rows, fp8) exceeds half
    the L2 (mixtral's fc1: 28672 x 2048 bytes), and all of N at once where it fits (dsv3_ep8,
    qwen3_30b) or the rows are unknown."""
    bands = {
        (k, n, rows): default_tgmm_config(k, n, jnp.bfloat16, rows_per_group=rows).grid_tile_width
        for k, n, rows in [(4096, 28672, 2048), (7168, 4096, 1024), (2048, 1536, 512)]
    }
    assert bands == {(4096, 28672, 2048): 4, (7168, 4096, 1024): 0, (2048, 1536, 512): 0}
    assert default_tgmm_config(4096, 28672, jnp.bfloat16).grid_tile_width == 0


@pytest.mark.parametrize("sms", [132, 133])
def test_wgrad_heuristic_pairs_ctas_where_n_and_the_sm_count_allow(sms):
    """CTA pairs (cluster_n=2) when the SMs pair up and N holds a pair of CTA tiles: at the
    three shapes' fc1 and fc2 on 132 SMs; never on an odd SM count or N of 384."""

    class Hopper:
        platform, compute_capability, core_count = "gpu", "9.0", sms

    with jaxmoe.ops.device.compiling_for(Hopper()):
        pairs = {
            (k, n): default_tgmm_config(k, n, jnp.bfloat16).cluster_n
            for k, n in [(4096, 28672), (14336, 4096), (7168, 4096), (2048, 1536), (2048, 384)]
        }
    even = sms % 2 == 0
    assert pairs == {
        (4096, 28672): 2 if even else 1,
        (14336, 4096): 2 if even else 1,
        (7168, 4096): 2 if even else 1,
        (2048, 1536): 2 if even else 1,
        (2048, 384): 1,
    }


@pytest.mark.parametrize("tiling", WGRAD_TILINGS)
def test_wgrad_kernel_lowers_at_real_shapes(tiling):
    """Pallas -> Mosaic GPU lowering on CPU at mixtral's and dsv3's fc1 weight gradients."""
    s = jax.ShapeDtypeStruct
    for m, k, n, g in [(16384, 4096, 28672, 8), (32768, 7168, 4096, 32)]:
        config = dataclasses.replace(
            default_tgmm_config(k, n, jnp.bfloat16, rows_per_group=m // g),
            num_sms=132,
            **WGRAD_TILINGS[tiling],
        ).with_fitting_slots(jnp.bfloat16)

        def run(xd, xs, dd, ds, sizes):
            return tgmm(
                fb.BlockwiseTensor(xd, xs, (0,)),
                fb.BlockwiseTensor(dd, ds, (0,)),
                sizes,
                impl="pallas",
                preferred_element_type=jnp.bfloat16,
                config=config,  # noqa: B023
            )

        jax.jit(run).trace(
            s((m, k), jnp.float8_e4m3fn),
            s((m // 128, k), jnp.float32),
            s((m, n), jnp.float8_e4m3fn),
            s((m // 128, n), jnp.float32),
            s((g,), jnp.int32),
        ).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", ["two_blocks", "unpaired", "banded", "pairs", "l2_scales"])
def test_gpu_wgrad_kernel_equals_the_reference_on_exact_operands(tiling):
    """On the GPU, at a size with many items per CTA: the kernel (the default: CTA pairs
    multicasting the lhs tile; unpaired, items in bands, scales from L2) equals the exact
    products."""
    x, dy = exact_token_operands(4096, 512, 1024, seed=5)
    xq, dq = fb.quantize_1x128(jnp.asarray(x), 0), fb.quantize_1x128(jnp.asarray(dy), 0)
    sizes = jnp.array([1024, 0, 2048, 640, 384])  # the last group's odd blocks end at M
    config = dataclasses.replace(default_tgmm_config(512, 1024), **WGRAD_TILINGS[tiling])
    got = np.asarray(tgmm(xq, dq, sizes, impl="pallas", config=config))
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    exact = np.stack([x[a:b].astype(np.float64).T @ dy[a:b] for a, b in zip(bounds, bounds[1:])])
    np.testing.assert_array_equal(got, exact)
