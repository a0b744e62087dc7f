"""The decode kernel's integer dequantization of e4m3 weights (`ops/pallas/e4m3_registers.py`):
its arithmetic modelled in numpy against `dequantize` on every e4m3 byte and scale byte (CPU),
the kernel with it bitwise equal to its fp32 route and to dequantizing first on the H200 (`gpu`),
and the condition under which the caller may ask for it."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmoe.mxfp8 import MXTensor, dequantize, quantize
from jaxmoe.ops import DecodeConfig, on_hopper
from jaxmoe.ops.device import compiled_for_gpu
from jaxmoe.ops.pallas import e4m3_registers
from jaxmoe.ops.pallas.gmm_decode_hopper import gmm_decode_pallas

from bitwise import bits, differs

ALL_BYTES = np.arange(256, dtype=np.uint8)
FINITE_BYTES = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]
SMALL_SCALES = np.arange(e4m3_registers.MAX_SCALE_BYTE + 1, dtype=np.uint8)


def dequantize_ready(rhs):
    """(e4m3 data [G, N, K], block-major scale bytes [G, K/32, N]) of bf16 weights."""
    q = quantize(rhs, axis=2)
    return q.data, jnp.swapaxes(q.scale, 1, 2)


def modelled_pairs(pair_bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """numpy model of the PTX: prmt with sign replication, shl 4, and with 0x87F087F0, then
    bf16x2 multiply by the multiplier word rounded to nearest even (the product of two bf16
    values is exact in fp32 here, so rounding it once to bf16 is the bf16 multiply)."""
    b0, b1 = (pair_bits & 0xFF).astype(np.uint32), (pair_bits >> 8).astype(np.uint32)
    sign = lambda b: np.where(b & 0x80, np.uint32(0xFF), np.uint32(0))
    permuted = b0 | sign(b0) << 8 | b1 << 16 | sign(b1) << 24
    halves = ((permuted << 4) & 0x87F087F0).astype(np.uint32)
    words = np.asarray(e4m3_registers.multipliers(jnp.asarray(scale)))
    as_bf16 = lambda h: (h & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    product = lambda a, m: (as_bf16(a) * as_bf16(m)).astype(ml_dtypes.bfloat16)
    return np.stack([product(halves, words), product(halves >> 16, words >> 16)], -1)


def test_modelled_arithmetic_equals_dequantize_on_every_finite_byte_and_small_scale():
    data, scale = np.meshgrid(FINITE_BYTES, SMALL_SCALES, indexing="ij")
    got = modelled_pairs(data.astype(np.uint16) | data.astype(np.uint16) << 8, scale)
    weights = MXTensor(
        data=jnp.asarray(data[..., None].repeat(32, -1).view(ml_dtypes.float8_e4m3fn)),
        scale=jnp.asarray(scale[..., None]),
        axis=2,
        fmt="e4m3",
    )
    want = np.asarray(dequantize(weights, jnp.bfloat16)[..., :2])
    np.testing.assert_array_equal(bits(got), bits(want))
    # Control: one scale byte past the limit makes the multiplier's exponent field overflow.
    past = modelled_pairs(np.full(1, 0x3838, np.uint16), np.full(1, 135, np.uint8))
    assert not np.array_equal(bits(past), bits(np.full((1, 2), 2.0**8, ml_dtypes.bfloat16)))


def test_exactness_condition_refuses_large_scales_and_nan_weights():
    data = jnp.zeros((2, 64, 64), jnp.float8_e4m3fn)
    scale = jnp.full((2, 64, 2), e4m3_registers.MAX_SCALE_BYTE, jnp.uint8)
    assert bool(e4m3_registers.small_scale_dequantization_is_exact(data, scale))
    assert not bool(e4m3_registers.small_scale_dequantization_is_exact(data, scale.at[1, 3].add(1)))
    nan = data.at[0, 5, 7].set(jnp.nan)
    assert not bool(e4m3_registers.small_scale_dequantization_is_exact(nan, scale))
    with pytest.raises(ValueError, match="e4m3"):
        e4m3_registers.small_scale_dequantization_is_exact(data.astype(jnp.float8_e5m2), scale)


def test_small_scales_needs_e4m3_weights():
    rhs = jnp.zeros((1, 256, 128), jnp.float8_e5m2)
    with pytest.raises(ValueError, match="small_scales needs e4m3"):
        gmm_decode_pallas(
            jnp.zeros((16, 128), jnp.bfloat16),
            rhs,
            jnp.zeros((1, 4, 256), jnp.uint8),
            jnp.array([16], jnp.int32),
            out_dtype=jnp.bfloat16,
            small_scales=True,
        )


def test_interpreter_takes_the_fp32_route(interpret):
    """Interpreted, small_scales changes nothing (the interpreter cannot run inline PTX)."""
    assert not compiled_for_gpu(interpret=True)
    if not on_hopper():
        assert not compiled_for_gpu(interpret=None)
    rhs = jax.random.normal(jax.random.key(1), (2, 128, 256), jnp.bfloat16)
    weights = dequantize_ready(rhs)
    lhs = jax.random.normal(jax.random.key(2), (32, 256), jnp.bfloat16)
    config = DecodeConfig(tile_rows=16, wg_n=64, tile_k=128, max_concurrent_steps=2, num_sms=3)
    outs = [
        gmm_decode_pallas(
            lhs,
            *weights,
            jnp.array([9, 20], jnp.int32),
            out_dtype=jnp.float32,
            config=config,
            small_scales=small,
        )
        for small in (False, True)
    ]
    np.testing.assert_array_equal(bits(outs[0]), bits(outs[1]))


@pytest.mark.gpu
def test_gpu_register_dequantization_is_the_fp32_routes_bits_on_every_byte_and_scale():
    """On the H200: one-hot rows read every weight of a [N=1024, K=256] matrix whose row n has
    every finite e4m3 byte (the two NaN bytes replaced by zeros) and scale byte n % 135: the
    kernel with small_scales gives exactly its fp32 route's output and the dequantized weights
    (-0 summed with the zero products is +0). Then at decode sizes of real shapes, random weights: the same
    bits as the fp32 route (which the other GPU tests hold to dequantizing first); control: one
    weight changed changes the output."""
    n, k = 1024, 256
    row_bytes = np.resize(np.where((ALL_BYTES & 0x7F) == 0x7F, 0, ALL_BYTES), k).astype(np.uint8)
    data = jnp.asarray(np.tile(row_bytes, (1, n, 1)).view(ml_dtypes.float8_e4m3fn))
    scale = jnp.asarray(np.tile((np.arange(n) % 135).astype(np.uint8), (1, k // 32, 1)))
    lhs = jnp.eye(k, dtype=jnp.bfloat16)
    sizes = jnp.array([k], jnp.int32)
    call = lambda small: gmm_decode_pallas(
        lhs, data, scale, sizes, out_dtype=jnp.float32, small_scales=small
    )
    routes = [np.asarray(call(small)) for small in (False, True)]
    weights = MXTensor(data=data, scale=jnp.swapaxes(scale, 1, 2), axis=2, fmt="e4m3")
    want = np.asarray(dequantize(weights, jnp.bfloat16)[0].T.astype(jnp.float32)) + np.float32(0)
    np.testing.assert_array_equal(bits(routes[0]), bits(want))
    np.testing.assert_array_equal(bits(routes[1]), bits(want))

    for m, k, n, g in [(512, 2048, 1536, 128), (512, 4096, 28672, 8), (64, 7168, 4096, 32)]:
        keys = jax.random.split(jax.random.key(m + n), 2)
        rhs = jax.random.normal(keys[0], (g, n, k), jnp.bfloat16) * 0.02
        lhs = jax.random.normal(keys[1], (m, k), jnp.bfloat16)
        data, scale = dequantize_ready(rhs)
        assert bool(e4m3_registers.small_scale_dequantization_is_exact(data, scale))
        sizes = jnp.asarray(np.random.default_rng(g).multinomial(m - 8, np.ones(g) / g), jnp.int32)
        out = {
            small: bits(
                gmm_decode_pallas(
                    lhs, data, scale, sizes, out_dtype=jnp.bfloat16, small_scales=small
                )
            )
            for small in (False, True)
        }
        np.testing.assert_array_equal(out[True], out[False])
        busiest = int(jnp.argmax(sizes))
        changed = gmm_decode_pallas(
            lhs,
            data.at[busiest, 0, 0].set(jnp.float8_e4m3fn(100.0)),
            scale,
            sizes,
            out_dtype=jnp.bfloat16,
            small_scales=True,
        )
        assert differs(bits(changed), out[True])
