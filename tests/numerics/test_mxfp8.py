"""Bit-exactness tests of jaxmoe.mxfp8 against the numpy TE model (tests/support/mxfp8_numpy_reference.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmoe import mxfp8

import mxfp8_numpy_reference as ref

BF16 = ml_dtypes.bfloat16
F32 = np.float32
UINT_VIEW = {
    np.dtype(np.float32): np.uint32,
    np.dtype(BF16): np.uint16,
    np.dtype(np.float16): np.uint16,
}


def _bytes(t):
    return np.asarray(t.data).view(np.uint8), np.asarray(t.scale)


def _assert_matches_reference(x, axis, fmt, t=None):
    t = mxfp8.quantize(x, axis, fmt) if t is None else t
    data, scale = _bytes(t)
    with np.errstate(invalid="ignore", over="ignore"):
        want_data, want_scale = ref.quantize(x, axis, fmt)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(data, want_data)
    return t


def _assert_same_float_bits(got, want):
    """Bitwise equality, except that any NaN matches any NaN."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(F32))
    np.testing.assert_array_equal(np.isnan(got.astype(F32)), nan)
    view = UINT_VIEW[got.dtype]
    np.testing.assert_array_equal(
        np.where(nan, 0, got.view(view)), np.where(nan, 0, want.view(view))
    )


# ---------------------------------------------------------------------------------------------------
# Test vectors of the MX quantizer (hand-checked values at the format's edges: zeros, subnormals,
# the largest normal, saturation, NaN and Inf), typed in.


def _pattern(values, n=32):
    return np.resize(np.array(values, F32), n)


NAN, INF = np.nan, np.inf
# (input block, fmt, scale byte, first data bytes (the rest repeat the pattern), first dequantized values)
VECTORS = {
    1: ([0.0], "e4m3", 0x00, [0x00], [0.0]),
    2: ([-0.0], "e4m3", 0x00, [0x80], [-0.0]),
    3: ([1.0], "e4m3", 0x77, [0x78], [1.0]),
    4: (
        [1, -0.5, 0.3, 17, -100, 0.001, 3, -0.0],
        "e4m3",
        0x7D,
        [0x48, 0xC0, 0x3A, 0x68, 0xFC, 0x02, 0x54, 0x80],
        [1, -0.5, 0.3125, 16, -96, 0.0009765625, 3, -0.0],
    ),
    5: ([448] + [1] * 31, "e4m3", 0x7F, [0x7E] + [0x38] * 31, [448] + [1] * 31),
    6: ([480] + [1] * 31, "e4m3", 0x80, [0x77] + [0x30] * 31, [480] + [1] * 31),
    7: ([500, -17] + [1] * 30, "e4m3", 0x80, [0x78, 0xD0] + [0x30] * 30, [512, -16] + [1] * 30),
    8: ([449] + [1] * 31, "e4m3", 0x80, [0x76] + [0x30] * 31, [448] + [1] * 31),
    9: ([NAN] + [1] * 31, "e4m3", 0x77, [0x7F] + [0x78] * 31, [NAN] + [1] * 31),
    10: ([NAN], "e4m3", 0x00, [0x7F], [NAN]),
    11: (
        [INF, -1.0, 1e30, 3e38] + [1] * 28,
        "e4m3",
        0xFE,
        [0x7E, 0x80, 0x00, 0x3E] + [0x00] * 28,
        [INF, -0.0, 0.0, 1.75 * 2.0**127] + [0.0] * 28,
    ),  # 2.9775e38
    12: ([1e-40], "e4m3", 0x00, [0x09], [9 * 2.0**-136]),  # 1.0331e-40
    13: (
        [np.uint32(0x04600001).view(F32)] + [0] * 31,
        "e4m3",
        0x00,
        [0x7E] + [0x00] * 31,
        [448 * 2.0**-127] + [0] * 31,
    ),  # 2.6331e-36
    14: (
        [float(ml_dtypes.finfo(BF16).max)] + [1] * 31,
        "e4m3",
        0xF7,
        [0x78] + [0x00] * 31,
        [INF] + [0] * 31,
    ),
    15: ([1.0], "e5m2", 0x70, [0x78], [1.0]),
    16: ([71680] + [1] * 31, "e5m2", 0x80, [0x78] + [0x38] * 31, [65536] + [1] * 31),
}


def _vector_cases():
    for number, (block, fmt, scale, data, deq) in VECTORS.items():
        x = _pattern(block)
        dtypes = [np.float32, BF16] if number != 14 else [BF16]
        for dtype in dtypes:
            xd = x.astype(dtype)
            if np.array_equal(
                xd.astype(F32), x, equal_nan=True
            ):  # only where the dtype holds the block exactly
                yield pytest.param(
                    xd,
                    fmt,
                    scale,
                    _pattern(data).astype(np.uint8),
                    _pattern(deq),
                    id=f"v{number}-{np.dtype(dtype).name}",
                )


@pytest.mark.parametrize("x, fmt, scale, data, deq", list(_vector_cases()))
def test_spec_vectors(x, fmt, scale, data, deq):
    t = mxfp8.quantize(jnp.asarray(x), fmt=fmt)
    got_data, got_scale = _bytes(t)
    assert got_scale.tolist() == [scale]
    assert got_data.tolist() == data.tolist()
    _assert_same_float_bits(mxfp8.dequantize(t), deq.astype(F32))
    _assert_matches_reference(x, -1, fmt, t)


def test_spec_self_checks():
    assert (
        ref.RCP["e4m3"].view(np.uint32) == 0x3B124925
        and ref.RCP["e5m2"].view(np.uint32) == 0x37924925
    )
    amax = np.array([1.0, 448.0, np.nextafter(F32(448), F32(1000)), 0.0, np.inf], F32)
    blocks = np.zeros((5, 32), F32)
    blocks[:, 0] = amax
    assert np.asarray(mxfp8.quantize(blocks).scale)[:, 0].tolist() == [0x77, 0x7F, 0x80, 0x00, 0xFE]


# ---------------------------------------------------------------------------------------------------
# The e8m0 scale rule, through the public API: blocks [amax, 0, ..., 0].


def _amax_bits_cases():
    fields = np.array([0, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], np.uint32)
    every_exponent = (np.arange(255, dtype=np.uint32)[:, None] << 23 | fields).ravel()
    thresholds = np.array(
        [
            0x04600000,
            0x04600001,
            0x04600002,
            0x07E00000,
            0x07E00001,
            0x07E00002,
            0x04DFFFFE,
            0x04DFFFFF,
            0x04E00000,
            0x085FFFFE,
            0x085FFFFF,
            0x08600000,
            0x00000001,
            0x00400000,
            0x007FFFFF,
            0x7F7FFFFF,
            0x7F800000,
        ],
        np.uint32,
    )
    rand = np.random.default_rng(1).integers(0, 0x7F800001, 100_000, dtype=np.uint32)
    return np.concatenate([every_exponent, thresholds, rand])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scale_rule_boundaries(fmt):
    amax_bits = _amax_bits_cases()
    sign = np.random.default_rng(2).integers(0, 2, amax_bits.size, dtype=np.uint32) << 31
    blocks = np.zeros((amax_bits.size, 32), F32)
    blocks[:, 7] = (amax_bits | sign).view(F32)
    scale = np.asarray(mxfp8.quantize(blocks, fmt=fmt).scale)[:, 0]
    want = ref.e8m0_round_up((amax_bits.view(F32) * ref.RCP[fmt]).astype(F32))
    np.testing.assert_array_equal(scale, want)
    _assert_matches_reference(blocks, -1, fmt)


# ---------------------------------------------------------------------------------------------------
# Random inputs vs the numpy reference.


def _near_max_blocks(rng, fmt, n_blocks):
    """Blocks whose amax is max_normal * 2^k moved by a few ulps (k keeps it finite for both formats)."""
    k = rng.integers(-157, 113, n_blocks)
    peak = np.ldexp(F32(ref.MAXN[fmt]), k).astype(F32)
    peak = (peak.view(np.int32) + rng.integers(-3, 4, n_blocks).astype(np.int32)).view(F32)
    blocks = (rng.uniform(-1, 1, (n_blocks, 32)) * peak[:, None]).astype(F32)
    blocks[np.arange(n_blocks), rng.integers(0, 32, n_blocks)] = peak * rng.choice(
        [-1, 1], n_blocks
    )
    return blocks


def _random_blocks(rng, fmt, n_blocks=1024):
    """[6 * n_blocks, 32] fp32 blocks from several distributions, with specials sprinkled in."""
    scale = 10.0 ** rng.integers(-45, 38, (n_blocks, 1))
    families = [
        (rng.standard_normal((n_blocks, 32)) * scale)
        .clip(-3e38, 3e38)
        .astype(F32),  # normal * 10^k
        rng.integers(0, 0xFF800000, (n_blocks, 32), dtype=np.uint32).view(
            F32
        ),  # all finite bit patterns
        (
            np.ldexp(
                rng.choice([-1.0, 1.0], (n_blocks, 32)), rng.integers(-149, 128, (n_blocks, 32))
            )
            * rng.uniform(1, 2, (n_blocks, 32))
        ).astype(F32),  # log-uniform magnitude
        rng.integers(0, 0x00800000, (n_blocks, 32), dtype=np.uint32).view(F32)
        * rng.choice([-1, 1], (n_blocks, 32)).astype(F32),  # fp32 subnormals
        _near_max_blocks(rng, fmt, n_blocks),
        _near_max_blocks(rng, "e5m2" if fmt == "e4m3" else "e4m3", n_blocks),
    ]
    x = np.concatenate(families)
    x[~np.isfinite(x)] = (
        1.0  # the bit-pattern family may hit Inf/NaN; inject specials explicitly below
    )
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40], F32)
    mask = rng.random(x.shape) < 0.01
    x[mask] = rng.choice(specials, np.count_nonzero(mask))
    x[rng.random(x.shape[0]) < 0.01] = np.nan  # some all-NaN blocks
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_random_rowwise_columnwise_3d(fmt):
    rng = np.random.default_rng(3 if fmt == "e4m3" else 4)
    blocks = _random_blocks(rng, fmt)  # 6144 blocks = 196,608 values
    rows = blocks.reshape(-1, 256)
    rng.shuffle(rows)
    _assert_matches_reference(rows, -1, fmt)  # rowwise
    _assert_matches_reference(
        np.ascontiguousarray(rows.T), -2, fmt
    )  # columnwise, blocks along dim 0
    x3 = blocks.reshape(32, 32, 6, 32).transpose(0, 1, 3, 2).reshape(32, 32 * 32, 6)
    _assert_matches_reference(x3, 1, fmt)  # 3-D, axis=1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_random_half_precision_inputs(fmt, dtype):
    rng = np.random.default_rng(5)
    with np.errstate(over="ignore"):
        x = _random_blocks(rng, fmt, 512).astype(dtype).reshape(-1, 128)
    _assert_matches_reference(x, -1, fmt)
    _assert_matches_reference(x.reshape(128, -1), 0, fmt)


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_every_half_precision_bit_pattern(dtype):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype).reshape(-1, 32)
    for fmt in ("e4m3", "e5m2"):
        _assert_matches_reference(x, -1, fmt)
        # each value alone in its block (the other 31 are zero), so every value sets the scale
        alone = np.zeros((x.size, 32), dtype)
        alone[:, 3] = x.ravel()
        _assert_matches_reference(alone, -1, fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_random(fmt):
    rng = np.random.default_rng(6)
    x = _random_blocks(rng, fmt, 512).reshape(-1, 64)
    for axis in (-1, 0):
        t = mxfp8.quantize(x, axis, fmt)
        data, scale = _bytes(t)
        for dtype in (np.float32, BF16, np.float16):
            want = ref.dequantize(data, scale, axis, fmt, dtype)
            _assert_same_float_bits(mxfp8.dequantize(t, dtype), want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizing_dequantized_values_gives_them_back(fmt):
    """An MXFP8 tensor's values stored in fp32 or bf16 (as a checkpoint may hold an MXFP8
    weight) and quantized again have the same values, bit for bit: the GEMMs read only the
    values. The bytes may differ (a block whose largest code is small gets a smaller scale and
    larger codes), as the control shows. Scales 100..149 keep every value normal in bf16."""
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, size=(256, 64), dtype=np.uint8)
    finite = (data & 0x7F) != 0x7F if fmt == "e4m3" else (data & 0x7C) != 0x7C  # no NaN / Inf
    data = np.where(finite, data, 0).astype(np.uint8)
    data[::3] &= 0x3F  # blocks with small largest codes
    scale = rng.integers(100, 150, size=(256, 2), dtype=np.uint8)
    t = mxfp8.MXTensor(
        jnp.asarray(data.view(ref.FP8_DTYPES[fmt])), jnp.asarray(scale), axis=1, fmt=fmt
    )
    for dtype in (np.float32, BF16):
        values = mxfp8.dequantize(t, dtype)
        again = mxfp8.quantize(values, 1, fmt)
        _assert_same_float_bits(mxfp8.dequantize(again, dtype), np.asarray(values))
    assert np.any(_bytes(again)[1] != scale)


def _every_byte_and_scale(fmt):
    """MXTensor of all 256 data bytes x all 256 scale bytes (0 -> 2^-127, 255 -> NaN)."""
    data = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).repeat(32, axis=1)[
        :, ::8
    ]  # [256 scales, 1024]
    scale = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, data.shape[1] // 32))
    return mxfp8.MXTensor(
        jnp.asarray(data.view(ref.FP8_DTYPES[fmt])), jnp.asarray(scale), axis=1, fmt=fmt
    )


def _assert_dequantizes_every_byte_and_scale(fmt):
    t = _every_byte_and_scale(fmt)
    data, scale = _bytes(t)
    for dtype in (np.float32, BF16, np.float16):
        _assert_same_float_bits(
            mxfp8.dequantize(t, dtype), ref.dequantize(data, scale, 1, fmt, dtype)
        )
    deq = np.asarray(mxfp8.dequantize(t))
    assert np.isnan(deq[255]).all() and np.isinf(deq[254]).any() and deq[0][deq[0] != 0].size > 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_every_byte_and_scale(fmt):
    _assert_dequantizes_every_byte_and_scale(fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_dequantize_every_byte_and_scale(fmt):
    """On the GPU `dequantize` multiplies (XLA:CPU, which flushes subnormals, takes the bits)."""
    _assert_dequantizes_every_byte_and_scale(fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_by_multiplying_where_no_value_is_subnormal(fmt):
    """The GPU's formula gives the exact values wherever fp32 keeps them normal (all that XLA:CPU,
    which flushes subnormals, can check)."""
    t = _every_byte_and_scale(fmt)
    want = np.asarray(mxfp8.dequantize(t))
    normal = (np.abs(want) >= np.finfo(np.float32).tiny) | (want == 0) | ~np.isfinite(want)
    normal_rows = normal.all(axis=1)
    assert 100 < normal_rows.sum() < 256
    got = jax.jit(mxfp8.dequantize_by_multiplying, static_argnums=(2, 3))(
        t.data, t.scale, 1, jnp.float32
    )
    _assert_same_float_bits(np.asarray(got)[normal_rows], want[normal_rows])


def _every_bf16_with_exponents():
    """fp32 bits of every bf16 value, each with every scale exponent e of `exponents`."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(F32)
    exponents = np.array([0, 1, 60, 120, 127, 128, 134, 142, 200, 247, 253, 254], np.int32)
    bits = np.tile(x.view(np.uint32), (exponents.size, 1))
    return bits, np.broadcast_to(exponents[:, None], bits.shape)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_by_multiplying_where_no_value_is_subnormal(fmt):
    """TE's float arithmetic (what XLA runs on the GPU) gives the integer emulation's bytes
    wherever no input, multiplier or product is an fp32 subnormal (all that XLA:CPU, which
    flushes them, can check); NaN, +-Inf, +-0 and saturation included."""
    bits, e = _every_bf16_with_exponents()
    fmt_entry = mxfp8.FORMATS[fmt]
    want = np.asarray(mxfp8.encode_elements(jnp.asarray(bits), jnp.asarray(e), fmt_entry))
    got = np.asarray(
        jax.jit(mxfp8.encode_by_multiplying, static_argnums=2)(
            jnp.asarray(bits), jnp.asarray(e), fmt_entry
        )
    )
    x = bits.view(F32).astype(np.float64)
    product = np.abs(x * np.exp2(127.0 - e))
    tiny = np.finfo(F32).tiny
    normal = (
        ((np.abs(x) >= tiny) | (x == 0) | np.isnan(x))
        & ((product >= tiny) | (product == 0))
        & (e < 254)  # e = 254: the multiplier 2^-127 is itself subnormal
    )
    assert 0.75 < normal.mean() < 1
    np.testing.assert_array_equal(got.view(np.uint8)[normal], want.view(np.uint8)[normal])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_encode_by_multiplying_equals_the_integer_bits(fmt):
    """On the GPU (subnormals kept) the float arithmetic that XLA's quantize runs there gives the
    integer emulation's bytes for every bf16 input and scale exponent, subnormals included."""
    bits, e = _every_bf16_with_exponents()
    fmt_entry = mxfp8.FORMATS[fmt]
    args = jnp.asarray(bits), jnp.asarray(e)
    want = jax.jit(mxfp8.encode_elements, static_argnums=2)(*args, fmt_entry)
    encode = jax.jit(mxfp8.encode, static_argnums=2)
    got = encode(*args, fmt_entry)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    off_by_one = encode(args[0], jnp.minimum(args[1] + 1, 254), fmt_entry)  # negative control
    assert (np.asarray(off_by_one).view(np.uint8) != np.asarray(want).view(np.uint8)).any()


def test_zero_block_dequantizes_to_zeros():
    x = np.zeros((4, 64), F32)
    x[1] = -0.0
    out = np.asarray(mxfp8.dequantize(mxfp8.quantize(x)))
    np.testing.assert_array_equal(out.view(np.uint32), x.view(np.uint32))


# ---------------------------------------------------------------------------------------------------
# jit, pytree, and a negative control.


def test_under_jit():
    rng = np.random.default_rng(7)
    x = _random_blocks(rng, "e4m3", 256).reshape(64, -1)

    @jax.jit
    def roundtrip(v):
        t = mxfp8.quantize(v, axis=0, fmt="e4m3")
        return t, mxfp8.dequantize(t, jnp.bfloat16)

    t, deq = roundtrip(jnp.asarray(x))
    assert isinstance(t, mxfp8.MXTensor) and t.axis == 0 and t.fmt == "e4m3"
    _assert_matches_reference(x, 0, "e4m3", t)
    data, scale = _bytes(t)
    _assert_same_float_bits(deq, ref.dequantize(data, scale, 0, "e4m3", BF16))


def test_mxtensor_pytree():
    t = mxfp8.quantize(jnp.ones((2, 64), jnp.bfloat16), fmt="e5m2")
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert [leaf.dtype for leaf in leaves] == [jnp.float8_e5m2, jnp.uint8]
    t2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (t2.axis, t2.fmt, t2.shape, t2.dtype, t2.ndim) == (
        1,
        "e5m2",
        (2, 64),
        jnp.float8_e5m2,
        2,
    )
    assert t.scale.shape == (2, 2)
    same = jax.jit(lambda v: v)(t)
    assert same.axis == 1 and same.fmt == "e5m2"
    np.testing.assert_array_equal(np.asarray(same.dequantize()), np.ones((2, 64), F32))


def _naive_quantize(x):
    """What a straightforward port does: jnp.max amax, float log2/ceil, divide by the materialized scale."""
    blk = x.reshape(-1, 32)
    amax = jnp.max(jnp.abs(blk), axis=-1, keepdims=True)
    e = jnp.clip(jnp.ceil(jnp.log2(amax * ref.RCP["e4m3"])), -127, 127)
    y = jnp.clip(blk / jnp.exp2(e), -448, 448).astype(jnp.float8_e4m3fn)
    with np.errstate(invalid="ignore"):
        scale = np.asarray(e + 127).astype(np.uint8)[:, 0]
    return np.asarray(y).view(np.uint8).reshape(x.shape), scale


def test_negative_control_naive_port_fails_on_cpu():
    blocks = np.stack(
        [
            np.zeros(32, F32),
            np.full(32, 1e-40, F32),
            _pattern([np.nan] + [1.0] * 31),
            _pattern([2.0**-130, -3e-39, 0.0, 1e-38]),
        ]
    )
    want_data, want_scale = ref.quantize(blocks)
    with jax.default_device(jax.devices("cpu")[0]):  # XLA:CPU flushes subnormals; GPUs need not
        naive_data, naive_scale = _naive_quantize(jnp.asarray(blocks))
    naive_wrong = (naive_data != want_data).any(axis=1) | (naive_scale != want_scale)
    assert naive_wrong.all(), naive_wrong  # every one of these blocks trips the naive port
    _assert_matches_reference(blocks, -1, "e4m3")


# ---------------------------------------------------------------------------------------------------
# Errors.


def test_errors():
    with pytest.raises(ValueError, match=r"axis 1 has length 48"):
        mxfp8.quantize(jnp.ones((32, 48)))
    with pytest.raises(ValueError, match=r"axis 0 has length 20"):
        mxfp8.quantize(jnp.ones((20, 64)), axis=0)
    for bad in (
        np.ones((2, 32), np.float64),
        np.ones((2, 32), np.int32),
        jnp.ones((2, 32), jnp.int8),
        np.ones((2, 32), np.complex64),
    ):
        with pytest.raises(TypeError):
            mxfp8.quantize(bad)
    with pytest.raises(ValueError, match="format"):
        mxfp8.quantize(jnp.ones((2, 32)), fmt="e3m4")
    with pytest.raises(ValueError, match="0-d"):
        mxfp8.quantize(jnp.float32(1.0))
    with pytest.raises(ValueError, match="out of range"):
        mxfp8.quantize(jnp.ones((2, 32)), axis=2)
    with pytest.raises(TypeError):
        mxfp8.dequantize(mxfp8.quantize(jnp.ones((2, 32))), jnp.float64)


# ---------------------------------------------------------------------------------------------------
# GEMM scale layout.


def _swizzle_by_formula(scale):
    """TE's scale-layout offset formula (docs/numerics.md, "MXFP8"), element by element
    (vectorized)."""
    rows, cols = scale.shape
    rows_pad, cols_pad = -(-rows // 128) * 128, -(-cols // 4) * 4
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    offset = (
        ((i // 128) * (cols_pad // 4) + j // 4) * 512
        + (i % 32) * 16
        + ((i % 128) // 32) * 4
        + (j % 4)
    )
    out = np.zeros(rows_pad * cols_pad, np.uint8)
    out[offset.ravel()] = scale.ravel()
    return out


SWIZZLE_SHAPES = [(1, 1), (100, 3), (128, 4), (129, 5), (300, 7), (256, 12)]


@pytest.mark.parametrize("shape", SWIZZLE_SHAPES)
def test_swizzle_matches_formula_and_roundtrips(shape):
    scale = np.random.default_rng(8).integers(
        1, 256, shape, dtype=np.uint8
    )  # nonzero: padding must be 0
    buf = np.asarray(mxfp8.swizzle_scales(jnp.asarray(scale)))
    np.testing.assert_array_equal(buf, _swizzle_by_formula(scale))
    assert np.count_nonzero(buf) == scale.size
    np.testing.assert_array_equal(
        np.asarray(mxfp8.unswizzle_scales(jnp.asarray(buf), shape)), scale
    )


def test_swizzle_batched():
    scale = np.random.default_rng(9).integers(0, 256, (3, 130, 6), dtype=np.uint8)
    buf = np.asarray(mxfp8.swizzle_scales(jnp.asarray(scale)))
    np.testing.assert_array_equal(buf, np.stack([_swizzle_by_formula(s) for s in scale]))
    np.testing.assert_array_equal(
        np.asarray(mxfp8.unswizzle_scales(jnp.asarray(buf), (130, 6))), scale
    )


def test_swizzled_scales_rowwise_and_columnwise():
    m, k = 160, 96
    x = np.random.default_rng(10).standard_normal((m, k)).astype(F32) * np.logspace(
        -3, 3, k, dtype=F32
    )
    rowwise = mxfp8.quantize(x, axis=-1)
    columnwise = mxfp8.quantize(x, axis=-2)
    np.testing.assert_array_equal(
        np.asarray(mxfp8.swizzled_scales(rowwise)), _swizzle_by_formula(np.asarray(rowwise.scale))
    )  # [M, K/32]
    # columnwise [M/32, K]: element (r, c) goes to row i = c, column j = r of the transposed matrix
    col_scale = np.asarray(columnwise.scale)
    want = _swizzle_by_formula(col_scale.T)
    assert want.size == (-(-(m // 32) // 4) * 4) * (-(-k // 128) * 128)
    np.testing.assert_array_equal(np.asarray(mxfp8.swizzled_scales(columnwise)), want)
    with pytest.raises(ValueError):
        mxfp8.swizzled_scales(mxfp8.quantize(np.ones((2, 2, 32), F32)))
