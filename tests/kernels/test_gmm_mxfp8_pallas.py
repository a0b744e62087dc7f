"""The Hopper MXFP8 grouped-matmul kernels (fp8 wgmma per 32-wide K block with the scales folded
into the fp32 accumulator; and dequantization in SMEM before bf16 wgmma), on CPU in Mosaic GPU
interpret mode with the race detector, against the dequantize-then-XLA reference; lowering at
the real shapes; `gpu`-marked tests on the H200 (the in-kernel dequantization bitwise equal to
dequantizing first, there).

Error bound. The reference sums the K exact products deq(a)deq(b) in fp32 in some order; the
kernel sums each 32-product block (one wgmma) and adds the scaled block sums in ascending K order.
Both are fp32 recursive sums of K terms with at most K + K/32 roundings, so each differs from the
exact sum by at most (K + K/32) u sum_k |a_k b_k| (u = 2^-24), and from each other by twice that.
On the GPU the fp8 tensor cores add a block's 32 products with fewer fraction bits than fp32
(about 2^-13 relative, measured by DeepSeek-V3 on Hopper), so the GPU bound per block is
2^-12 sum over the block of |a_k b_k|."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreter_tilings import FP8_GMM_SMALL
from layer_grads import output_and_grads

from jaxmoe import MoEConfig
from jaxmoe.mxfp8 import MXTensor, dequantize, quantize, scale_multipliers
from jaxmoe.ops import DecodeConfig, GmmConfig, Mxfp8Kernel, gmm, on_hopper, tgmm
from jaxmoe.ops.mxtensor_gmm import DECODE_MAX_ROWS_PER_GROUP, resolve_kernel
from jaxmoe.ops.pallas.gmm_decode_hopper import (
    default_decode_config,
    default_tile_rows,
    tile_weights,
    untile_weights,
)
from jaxmoe.ops.pallas.gmm_dequantize_hopper import default_dequantize_config
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import default_mxfp8_config

from bitwise import bits, differs

ON_HOPPER = on_hopper()
K = Mxfp8Kernel
U = 2.0**-24
# The operands below are quantized as the layer's fprop does: rhs^T [G, N, K], blocks along K.
gmm_nk = functools.partial(gmm, transpose_rhs=True)
KERNEL_ID = lambda kernel: kernel.value  # test ids: the kernels' names
DECODE_SMALL = DecodeConfig(tile_rows=16, wg_n=64, tile_k=128, max_concurrent_steps=2, num_sms=3)
SIZES = {
    "ragged_tail_and_empty": [37, 0, 90, 50, 3],
    "all_in_one": [0, 0, 200, 0, 0],
    "tiny_groups": [1, 7, 9, 16, 167],
}


def operands(m, k, n, g, seed=0):
    """lhs rows with magnitudes spread over 2^±6 (so blocks get different scales) and weights,
    quantized the way the layer's fprop does: lhs along K, rhs^T ([G, N, K]) along K."""
    keys = jax.random.split(jax.random.key(seed), 3)
    spread = jnp.exp2(jax.random.randint(keys[2], (m, k // 32, 1), -6, 7).astype(jnp.float32))
    lhs = (jax.random.normal(keys[0], (m, k // 32, 32)) * spread).reshape(m, k)
    rhs = jax.random.normal(keys[1], (g, n, k))
    return quantize(lhs.astype(jnp.bfloat16), axis=1), quantize(rhs.astype(jnp.bfloat16), axis=2)


def bound(lhs_q, rhs_q, sizes, per_block_rel=None):
    """Elementwise bound on |kernel - reference| (module docstring)."""
    a = jnp.abs(dequantize(lhs_q))
    b = jnp.abs(jnp.swapaxes(dequantize(rhs_q), 1, 2))
    absdot = np.asarray(jax.lax.ragged_dot(a, b, sizes, precision="highest"))
    k = lhs_q.shape[1]
    if per_block_rel is None:
        return 2 * (k + k // 32) * U * absdot + 1e-30
    return (per_block_rel + 2 * (k + k // 32) * U) * absdot + 1e-30


@pytest.mark.parametrize(
    "kernel", [K.FP8_WGMMA, K.DEQUANTIZE, K.FUSED_DEQUANTIZE, K.DECODE], ids=KERNEL_ID
)
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_forward_matches_dequantized_reference(interpret, sizes, kernel):
    lhs_q, rhs_q = operands(200, 256, 128, 5)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = None if ON_HOPPER else (DECODE_SMALL if kernel is K.DECODE else FP8_GMM_SMALL)
    out = gmm_nk(lhs_q, rhs_q, group_sizes, impl="pallas", config=config, kernel=kernel)
    ref = gmm_nk(lhs_q, rhs_q, group_sizes, impl="xla")
    err = np.abs(np.asarray(out) - np.asarray(ref))
    assert np.all(err <= bound(lhs_q, rhs_q, group_sizes, 2.0**-12 if ON_HOPPER else None))
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)


@pytest.mark.parametrize(
    "impl,kernel",
    [("pallas", K.DEQUANTIZE), ("pallas", K.DECODE), ("xla", K.AUTO)],
    ids=["dequantize", "decode", "xla"],
)
def test_lhs_values_stand_in_for_the_dequantized_lhs(interpret, impl, kernel):
    """lhs_values (the dispatch's one-pass rows) replace deq(lhs) where it is read: the same
    bits when they are deq(lhs); control: other values change the output, so they are read."""
    lhs_q, rhs_q = operands(200, 256, 128, 5)
    sizes = jnp.asarray(SIZES["ragged_tail_and_empty"], jnp.int32)
    config = (
        None
        if ON_HOPPER or impl == "xla"
        else (DECODE_SMALL if kernel is K.DECODE else FP8_GMM_SMALL)
    )
    run = lambda values: gmm_nk(
        lhs_q, rhs_q, sizes, impl=impl, config=config, kernel=kernel, lhs_values=values
    )
    values = dequantize(lhs_q, jnp.bfloat16)
    np.testing.assert_array_equal(bits(run(values)), bits(run(None)))
    assert differs(bits(run(values * 2)), bits(run(None)))
    with pytest.raises(ValueError, match="lhs_values"):
        run(values.astype(jnp.float32))


def test_decode_items_run_alike_at_any_ring_depth_and_in_narrow_tiles(interpret):
    """A CTA's items go through one ring of SMEM slots, whatever the slots' count against an
    item's K steps (DECODE_SMALL: 2 steps, 2 slots; 4 steps and 3 slots; 2 steps and 5 slots,
    more than an item has): the same bits either way; with narrower row tiles (8 rows) on tiled
    weights (`tile_weights`, one 128-row tile a step); with 256-column items on tiled weights
    (two tiles a step) spread over as few CTAs as their count needs (`balance_ctas`: 14 items
    on 5 of 6 CTAs), and on plain weights over all 6."""
    lhs_q, rhs_q = operands(200, 256, 256, 5)
    sizes = jnp.asarray(SIZES["ragged_tail_and_empty"], jnp.int32)  # 14 row tiles of 16
    unchained = DecodeConfig(tile_rows=16, wg_n=64, tile_k=64, max_concurrent_steps=3, num_sms=3)
    deep = dataclasses.replace(DECODE_SMALL, max_concurrent_steps=5)
    narrow = dataclasses.replace(DECODE_SMALL, tile_rows=8)
    wide = DecodeConfig(tile_rows=16, wg_n=128, tile_k=128, max_concurrent_steps=1, num_sms=6)
    configs = [
        DECODE_SMALL,
        unchained,
        deep,
        narrow,
        wide,
        dataclasses.replace(wide, balance_ctas=False),
    ]
    if ON_HOPPER:
        configs = [dataclasses.replace(c, num_sms=132) for c in configs]
    tiled = tile_weights(rhs_q.data)
    run = lambda config, tiles=None: gmm_nk(
        lhs_q, rhs_q, sizes, impl="pallas", config=config, kernel=K.DECODE, rhs_tiled=tiles
    )
    chained = run(configs[0])
    for config, tiles in zip(configs[1:], [None, tiled, tiled, tiled, None], strict=True):
        np.testing.assert_array_equal(bits(run(config, tiles)), bits(chained))
    assert 256 // unchained.tile_k % unchained.max_concurrent_steps  # slots do not divide steps
    with pytest.raises(ValueError, match="tiled weights need tile_k"):
        run(unchained, tiled)
    with pytest.raises(ValueError, match="rhs_tiled must be"):
        run(configs[0], tiled[:, :1])
    # Negative control: the same products summed in XLA's order differ somewhere.
    assert differs(bits(gmm_nk(lhs_q, rhs_q, sizes, impl="xla")), bits(chained))


@pytest.mark.parametrize("kernel", [K.FP8_WGMMA, K.FUSED_DEQUANTIZE], ids=KERNEL_ID)
def test_empty_experts_and_zero_padding_rows_give_exact_zeros(interpret, kernel):
    lhs_q, rhs_q = operands(192, 256, 128, 4, seed=1)
    padding = np.zeros(192, bool)
    padding[[5, 6, 70, 130]] = True  # zero rows inside groups, as the plan pads
    lhs = jnp.where(padding[:, None], 0, dequantize(lhs_q, jnp.bfloat16))
    lhs_q = quantize(lhs, axis=1)
    sizes = jnp.array([64, 0, 96, 0], jnp.int32)  # rows 160.. belong to no group
    out = np.asarray(
        gmm_nk(
            lhs_q,
            rhs_q,
            sizes,
            impl="pallas",
            kernel=kernel,
            config=None if ON_HOPPER else FP8_GMM_SMALL,
        )
    )
    assert np.all(out[padding] == 0) and np.all(out[160:] == 0)
    assert np.all(out[~padding][:150] != 0)


def row_bits_configs(kernel: Mxfp8Kernel) -> list:
    """Tilings of `kernel` whose results must agree bit for bit."""
    if kernel is K.DECODE:
        configs = [
            DECODE_SMALL,
            DecodeConfig(tile_rows=8, wg_n=128, tile_k=64, max_concurrent_steps=1, num_sms=2),
            DecodeConfig(tile_rows=64, wg_n=64, tile_k=128, max_concurrent_steps=2, num_sms=5),
        ]
        return [dataclasses.replace(c, num_sms=132) for c in configs] if ON_HOPPER else configs
    if ON_HOPPER:
        return [
            GmmConfig(tile_m=64, tile_n=64, tile_k=tk, wg_split=split, max_concurrent_steps=1)
            for tk in (128, 256)
            for split in "nm"
        ]
    return [
        FP8_GMM_SMALL,
        GmmConfig(
            tile_m=64,
            tile_n=64,
            tile_k=128,
            max_concurrent_steps=1,
            grid_tile_width=1,
            epilogue_tile_n=32,
            wg_split="n",
            num_sms=2,
        ),
    ]


@pytest.mark.parametrize(
    "kernel",
    [
        K.FP8_WGMMA,
        pytest.param(K.FUSED_DEQUANTIZE, marks=pytest.mark.exhaustive),
        pytest.param(K.DECODE, marks=pytest.mark.exhaustive),
    ],
    ids=KERNEL_ID,
)
def test_row_bits_do_not_depend_on_other_groups_or_config(interpret, kernel):
    """Batch invariance as for the bf16 kernel: a row's bits stay when the groups around it
    change and under other tilings (tile_k fixed in the interpreter, see test_gmm_pallas; the
    decode kernel's out^T tiles gathered back included)."""
    lhs_q, rhs_q = operands(256, 256, 256 if kernel is K.DECODE else 128, 4, seed=2)
    probe = 130
    layouts = {"a": [64, 40, 60, 36], "b": [0, 0, 200, 56], "c": [100, 7, 41, 9]}
    configs = row_bits_configs(kernel)
    results = []
    for sizes in layouts.values():
        assert np.cumsum([0] + sizes)[2] <= probe < np.cumsum(sizes)[2]
        for config in configs:
            out = gmm_nk(
                lhs_q,
                rhs_q,
                jnp.asarray(sizes, jnp.int32),
                impl="pallas",
                config=config,
                kernel=kernel,
            )
            results.append(bits(out)[probe])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    # Negative control: the same row summed in another order (XLA's) has other bits somewhere.
    ref = gmm_nk(lhs_q, rhs_q, jnp.asarray(layouts["a"], jnp.int32), impl="xla")
    assert differs(bits(ref)[probe], results[0])


def test_wgrad_matches_reference(interpret):
    keys = jax.random.split(jax.random.key(3), 2)
    x = quantize(jax.random.normal(keys[0], (192, 128)).astype(jnp.bfloat16), axis=0)
    dy = quantize(jax.random.normal(keys[1], (192, 128)).astype(jnp.bfloat16), axis=0)
    sizes = jnp.array([64, 0, 96, 32], jnp.int32)
    out = tgmm(x, dy, sizes, impl="pallas")
    ref = tgmm(x, dy, sizes, impl="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[1] == 0)


@pytest.mark.exhaustive
def test_moe_layer_mxfp8_pallas_matches_xla(interpret):
    """jax.grad of an MXFP8 layer with fprop/dgrad on the fp8 kernel and wgrad on the bf16
    tgmm kernel, against the same layer on XLA. The GEMMs differ only in accumulation order,
    but a last-bit difference can flip a later MXFP8 rounding (one e4m3 step, 2^-3 relative,
    seen on the H200 in ~1% of the input-gradient elements), so the comparison is normwise."""
    config = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_hidden_size=128,
        expert_precision="mxfp8",
        dispatch_dtype="mxfp8",
        combine_bwd_dtype="mxfp8",
        expert_row_alignment=32,
    )
    x = jax.random.normal(jax.random.key(4), (48, 128)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(5), (48, 128))

    for a, b in zip(
        output_and_grads(config, x, dy, "pallas"), output_and_grads(config, x, dy, "xla")
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2**-6 * np.linalg.norm(b)


@pytest.mark.parametrize(
    "kernel,default_config",
    [
        (K.FP8_WGMMA, default_mxfp8_config),
        (K.FUSED_DEQUANTIZE, default_dequantize_config),
        (K.DECODE, default_decode_config),
    ],
    ids=["fp8_wgmma", "fused_dequantize", "decode"],
)
@pytest.mark.parametrize(
    "shape",
    [
        (16384, 4096, 28672, 8),
        (65536, 2048, 1536, 128),
        (32768, 7168, 4096, 32),
        (512, 2048, 384, 128),
        (128, 4096, 28672, 8),
        (512, 768, 2048, 128),
    ],
    ids=["mixtral", "qwen3", "dsv3", "narrow_n", "mixtral_decode", "qwen3_fc2_decode"],
)
def test_lowering_at_real_shapes(shape, kernel, default_config):
    """Pallas -> Mosaic GPU lowering on CPU (its layout inference included) for the
    fp8-reading kernels at the benchmark shapes and at decode sizes (narrow_n: warpgroups
    stacked along M)."""
    lower_for_hopper(shape, kernel, default_config, jnp.bfloat16)


@pytest.mark.parametrize("shape", [(128, 4096, 28672, 8), (512, 768, 2048, 128)])
def test_decode_kernel_lowers_with_fp32_output(shape):
    """The decode kernel's epilogue transposes the output tile in SMEM; fp32 needs another
    register layout for that than bf16 (Mosaic's layout inference failed on it once)."""
    lower_for_hopper(shape, K.DECODE, default_decode_config, jnp.float32)


@pytest.mark.parametrize(
    "shape", [(128, 4096, 28672, 8), (512, 768, 2048, 128), (8, 2048, 1536, 128)]
)
def test_decode_kernel_lowers_reading_tiled_weights(shape):
    """At the decode shapes (qwen3_30b at one token: 128-column items), on the integer
    dequantization route as `mxfp8_inference` runs it."""
    lower_for_hopper(shape, K.DECODE, default_decode_config, jnp.bfloat16, tiled=True)


def lower_for_hopper(shape, kernel, default_config, out_dtype, tiled=False):
    m, k, n, g = shape
    s = jax.ShapeDtypeStruct
    fn = functools.partial(
        gmm_nk,
        impl="pallas",
        preferred_element_type=out_dtype,
        config=default_config(m, k, n, g, out_dtype),
        kernel=kernel,
        small_scales=tiled,
    )
    tiles = lambda rd: tile_weights(rd) if tiled else None
    jax.jit(
        lambda ld, ls, rd, rs, sizes: fn(mx(ld, ls, 1), mx(rd, rs, 2), sizes, rhs_tiled=tiles(rd))
    ).trace(
        s((m, k), jnp.float8_e4m3fn),
        s((m, k // 32), jnp.uint8),
        s((g, n, k), jnp.float8_e4m3fn),
        s((g, n, k // 32), jnp.uint8),
        s((g,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))


def mx(data, scale, axis):
    return MXTensor(data=data, scale=scale, axis=axis, fmt="e4m3")


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_dequantize_takes_the_weights_untransposed(interpret, impl):
    """rhs [G, K, N] with blocks along K (quantized without transposing the weights) gives the
    bits of its [G, N, K] copy; the fp8-reading kernels refuse it."""
    lhs_q, rhs_q = operands(200, 256, 128, 5, seed=3)
    sizes = jnp.asarray(SIZES["ragged_tail_and_empty"], jnp.int32)
    weights = jnp.swapaxes(dequantize(rhs_q, jnp.bfloat16), 1, 2)  # [G, K, N], exact
    rhs_kn = quantize(weights, axis=1)
    config = None if ON_HOPPER else FP8_GMM_SMALL
    run = functools.partial(gmm, impl=impl, config=config, kernel=K.DEQUANTIZE)
    out = {
        "nk": bits(run(lhs_q, rhs_q, sizes, transpose_rhs=True)),
        "kn": bits(run(lhs_q, rhs_kn, sizes)),
    }
    np.testing.assert_array_equal(out["kn"], out["nk"])
    one_scale_up = dataclasses.replace(rhs_kn, scale=rhs_kn.scale.at[2, 0, 0].add(1))
    assert differs(bits(run(lhs_q, one_scale_up, sizes)), out["nk"])
    for kernel in (K.FP8_WGMMA, K.FUSED_DEQUANTIZE, K.DECODE):
        with pytest.raises(ValueError, match="reads rhs as"):
            gmm(lhs_q, rhs_kn, sizes, impl="pallas", kernel=kernel)
    with pytest.raises(ValueError, match="pass transpose_rhs=False"):
        gmm(lhs_q, rhs_kn, sizes, transpose_rhs=True)


def test_refuses_bad_operands():
    lhs_q, rhs_q = operands(64, 128, 128, 2)
    sizes = jnp.array([32, 32], jnp.int32)
    with pytest.raises(ValueError, match="blocks along K"):
        gmm_nk(quantize(dequantize(lhs_q, jnp.bfloat16), axis=0), rhs_q, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm_nk(lhs_q, rhs_q, jnp.array([32, 32, 0], jnp.int32))
    lhs96, rhs96 = operands(64, 96, 128, 2)
    for kernel in (K.FP8_WGMMA, K.FUSED_DEQUANTIZE):
        with pytest.raises(ValueError, match="multiples of 128"):
            gmm_nk(lhs96, rhs96, sizes, impl="pallas", kernel=kernel)
    with pytest.raises(TypeError, match="kernel must be an Mxfp8Kernel"):
        gmm_nk(lhs_q, rhs_q, sizes, kernel="fp8_wgmma")
    with pytest.raises(ValueError, match="blocks"):
        tgmm(lhs_q, lhs_q, sizes)


@pytest.mark.gpu
def test_gpu_mxfp8_forward_and_invariance_on_hardware():
    lhs_q, rhs_q = operands(4096, 1024, 512, 16, seed=10)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(4000, np.ones(16) / 16), jnp.int32)
    out = gmm_nk(lhs_q, rhs_q, sizes, impl="pallas", kernel=K.FP8_WGMMA)
    ref = gmm_nk(lhs_q, rhs_q, sizes, impl="xla")
    err = np.abs(np.asarray(out) - np.asarray(ref))
    assert np.all(err <= bound(lhs_q, rhs_q, sizes, 2.0**-12))
    assert np.all(np.asarray(out)[4000:] == 0)
    moved = sizes.at[0].add(-5).at[15].add(5)
    starts = np.cumsum(np.asarray(sizes)) - np.asarray(sizes)
    probe = int(starts[7]) + int(sizes[7]) // 2
    shifted = mx(
        lhs_q.data.at[probe - 5].set(lhs_q.data[probe]),
        lhs_q.scale.at[probe - 5].set(lhs_q.scale[probe]),
        1,
    )
    moved_out = gmm_nk(shifted, rhs_q, moved, impl="pallas", kernel=K.FP8_WGMMA)
    np.testing.assert_array_equal(bits(moved_out)[probe - 5], bits(out)[probe])


def test_scale_multipliers_decode_every_byte_like_dequantize():
    """The kernels' fp32 scale operands decode all 256 E8M0 bytes as `dequantize` does (the
    same bits; byte 255 NaN on both sides, whose payload the GPU's multiply may change)."""
    scale = jnp.arange(256, dtype=jnp.uint8)[:, None]
    ones = MXTensor(data=jnp.ones((256, 32), jnp.float8_e4m3fn), scale=scale, axis=1, fmt="e4m3")
    got, want = np.asarray(scale_multipliers(scale)[:, 0]), np.asarray(dequantize(ones)[:, 0])
    assert np.isnan(got[255]) and np.isnan(want[255])
    np.testing.assert_array_equal(bits(got[:255]), bits(want[:255]))


@pytest.mark.gpu
def test_gpu_in_kernel_dequantization_equals_dequantizing_first_bitwise():
    """On the H200 the kernels that dequantize in SMEM (FUSED_DEQUANTIZE; DECODE, whose
    wgmma takes the weights as A and the rows as B) give the bits of dequantizing both operands
    to bf16 first and running the bf16 kernel (the same k16 wgmma chain in ascending K), at a
    training size and decode sizes, the decode kernel also on tiled weights and with its items
    on every CTA (`balance_ctas` off); control: the fp8 wgmma kernel, which folds the scales
    per 32-wide block, differs."""
    for m, k, n, g in [(8192, 2048, 1536, 128), (512, 2048, 1536, 128), (128, 4096, 2048, 8)]:
        lhs_q, rhs_q = operands(m, k, n, g, seed=11)
        sizes = jnp.asarray(np.random.default_rng(1).multinomial(m - 40, np.ones(g) / g), jnp.int32)
        run = functools.partial(gmm_nk, lhs_q, rhs_q, sizes, impl="pallas")
        kernels = (K.DEQUANTIZE, K.FUSED_DEQUANTIZE, K.DECODE, K.FP8_WGMMA)
        results = {kernel: run(kernel=kernel) for kernel in kernels}
        out = {kernel: bits(result) for kernel, result in results.items()}
        np.testing.assert_array_equal(out[K.FUSED_DEQUANTIZE], out[K.DEQUANTIZE])
        np.testing.assert_array_equal(out[K.DECODE], out[K.DEQUANTIZE])
        assert differs(out[K.FP8_WGMMA], out[K.DEQUANTIZE])
        plain = dataclasses.replace(
            default_decode_config(m, k, n, g, results[K.DECODE].dtype), balance_ctas=False
        )
        for config, tiled in [(None, tile_weights(rhs_q.data)), (plain, None)]:
            decode = run(kernel=K.DECODE, config=config, rhs_tiled=tiled)
            np.testing.assert_array_equal(bits(decode), out[K.DEQUANTIZE])


def test_auto_kernel_takes_the_decode_kernel_at_few_rows_per_group():
    per_group = DECODE_MAX_ROWS_PER_GROUP
    assert resolve_kernel(K.AUTO, 128 * per_group, 128, 2048, 1536) is K.DECODE
    assert resolve_kernel(K.AUTO, 128 * per_group + 8, 128, 2048, 1536) is K.DEQUANTIZE
    assert resolve_kernel(K.AUTO, 64, 8, 4096, 192) is K.DEQUANTIZE  # N not a multiple of 128
    assert resolve_kernel(K.AUTO, 64, 8, 4096, 256, k_major=False) is K.DEQUANTIZE
    assert resolve_kernel(K.FUSED_DEQUANTIZE, 64, 8, 4096, 256) is K.FUSED_DEQUANTIZE
    lhs_q, rhs_q = operands(32, 256, 128, 4)
    sizes = jnp.array([8, 8, 8, 8], jnp.int32)
    with pytest.raises(ValueError, match="name the kernel"):
        gmm_nk(lhs_q, rhs_q, sizes, impl="pallas", config=DECODE_SMALL)


def test_decode_config_refuses_what_the_kernel_cannot_run():
    valid = DecodeConfig(tile_rows=16, wg_n=64, tile_k=128, max_concurrent_steps=2)
    valid.validate(64, 256, 128, jnp.bfloat16)
    for bad, problem, match in [
        (dataclasses.replace(valid, tile_rows=12), (64, 256, 128), "tile_rows"),
        (dataclasses.replace(valid, wg_n=96), (64, 256, 128), "wg_n"),
        (valid, (64, 192, 128), "tile_k"),
        (valid, (64, 256, 192), "2 \\* wg_n"),
        (dataclasses.replace(valid, max_concurrent_steps=0), (64, 256, 128), "max_concurrent"),
        (valid, (12, 256, 128), "M=12"),
        (
            dataclasses.replace(valid, tile_rows=256, wg_n=128, max_concurrent_steps=2),
            (256, 4096, 256),
            "shared memory",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            bad.validate(*problem, jnp.bfloat16)


def test_tile_weights_puts_each_128_by_128_tile_in_one_piece_and_untiles_back():
    w = jnp.arange(2 * 256 * 384, dtype=jnp.int32).reshape(2, 256, 384)
    tiled = tile_weights(w)
    assert tiled.shape == (2, 2, 3, 128, 128)
    np.testing.assert_array_equal(tiled[1, 1, 2], w[1, 128:256, 256:384])
    np.testing.assert_array_equal(untile_weights(tiled), w)
    with pytest.raises(ValueError, match="multiples of 128"):
        tile_weights(w[:, :192])


def _share_of_groups_split(tokens, num_experts, top_k, tile_rows, draws=20):
    """Share of the non-empty groups that `row_tiles` splits over two tiles or more (so that
    the decode kernel reads their weights twice) under uniform top-k routing."""
    rng = np.random.default_rng(0)
    split = nonempty = 0
    for _ in range(draws):
        experts = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])
        sizes = np.bincount(experts.ravel(), minlength=num_experts)
        starts = np.cumsum(sizes) - sizes
        tiles = -(-(starts % 8 + sizes) // tile_rows)  # tiles anchored at the start's 8-row cell
        nonempty += np.sum(sizes > 0)
        split += np.sum(tiles > 1)
    return split / nonempty


@pytest.mark.parametrize("tokens", [1, 8, 64, 128, 256])
@pytest.mark.parametrize(
    "num_experts, top_k", [(128, 8), (8, 2), (32, 8)], ids=["qwen3", "mixtral", "dsv3_ep8"]
)
def test_default_decode_tile_rows_fit_usual_groups_at_any_offset(tokens, num_experts, top_k):
    """The default row tiles hold nearly every group whole (<= 3%), and are no larger than
    that needs; control: twice the mean, the rule before, split 38% of qwen3_30b's groups at
    T=64 and 10-14% of mixtral's and dsv3_ep8's at T=8."""
    rows = tokens * top_k
    tile_rows = default_tile_rows(rows, num_experts)
    assert _share_of_groups_split(tokens, num_experts, top_k, tile_rows) <= 0.03
    if tile_rows > 8:
        assert _share_of_groups_split(tokens, num_experts, top_k, tile_rows // 4) > 0.03
    twice_mean = min(128, max(8, 1 << (2 * max(1, rows // num_experts) - 1).bit_length()))
    if (tokens, num_experts) in {(64, 128), (8, 8), (8, 32)}:
        assert _share_of_groups_split(tokens, num_experts, top_k, twice_mean) > 0.09
