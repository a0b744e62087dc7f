"""MXFP8 quantization, bit-exact with NVIDIA Transformer Engine (TE >= 2.13, generic cast kernel).

Blocks of 32 consecutive elements along one axis share an E8M0 scale byte ``e`` (decode multiplier
``2^(e-127)``); elements are stored as float8_e4m3fn or float8_e5m2. The algorithm:

    amax = max(+0, |x_i| for non-NaN x_i)
    e    = e8m0_round_up(RN_fp32(amax * fp32(1/448)))          # 1/57344 for e5m2
    q_i  = cvt_rn_satfinite(RN_fp32(x_i * 2^(127 - e)))       # NaN -> 0x7F

XLA:CPU flushes fp32 denormals on the inputs and outputs of float arithmetic, while TE does not. So the
scale and the element scaling are computed on the integer bits here and no float arithmetic ever sees a
denormal; the only float ops are ``clip`` on normal values and converts (XLA's f32 -> float8/f16 converts
were checked to match ml_dtypes/numpy on all 2^32 fp32 bit patterns on CPU). On a GPU, whose float
arithmetic keeps denormals, XLA's quantize multiplies as TE does (``encode``): the same bits at a fraction of
the integer emulation's instructions.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmoe.ints import round_up

BLOCK_SIZE = 32

_SIGN = np.uint32(0x80000000)
FP32_ABS_MASK = np.uint32(0x7FFFFFFF)  # bits & FP32_ABS_MASK: the bits of |x|
FP32_INF_BITS = np.uint32(0x7F800000)  # bits of +Inf: |x| bits above it are NaNs
_QNAN = np.uint32(0x7FC00000)
_MANT = np.uint32(0x7FFFFF)
_FP8_NAN_BYTE = 0x7F


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """An MXFP8 element format: its float8 dtype, largest finite value and scale-rule constants."""

    dtype: jnp.dtype
    max_normal: float
    # e8m0 rule constants, derived exactly from e8m0_round_up(RN_fp32(amax * R)) and checked against it
    # on every fp32 amax: e = E(amax) - exp_shift + [M(amax) > MANT_THRESHOLD] when amax > last_zero_amax.
    exp_shift: int
    last_zero_amax: int


# With R = fp32(1/448) (resp. 1/57344), RN(m * R) for a significand m in [1, 2) exceeds 2^-8 (resp. 2^-15)
# iff m > 1.75, i.e. mantissa field > 0x600000. last_zero_amax is the largest amax whose product rounds
# to at most 2^-127 in the fp32 subnormal range (e4m3: 0x04600001, one ulp above 448 * 2^-127).
_MANT_THRESHOLD = 0x600000
# The element formats by name ("e4m3", "e5m2").
FORMATS = {
    "e4m3": Fp8Format(jnp.float8_e4m3fn, 448.0, exp_shift=8, last_zero_amax=0x04600001),
    "e5m2": Fp8Format(jnp.float8_e5m2, 57344.0, exp_shift=15, last_zero_amax=0x07E00001),
}
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["axis", "fmt"]
)
@dataclasses.dataclass(frozen=True)
class MXTensor:
    """An MXFP8-quantized tensor.

    data:  float8_e4m3fn / float8_e5m2 array with the shape of the original tensor.
    scale: uint8 E8M0 biased exponents, the original shape with dim ``axis`` divided by 32 (compact, unpadded).
    axis:  the (non-negative) axis along which blocks of 32 run. Static pytree metadata.
    fmt:   "e4m3" or "e5m2". Static pytree metadata.
    """

    data: jax.Array
    scale: jax.Array
    axis: int
    fmt: str

    @property
    def shape(self):
        """Logical shape (that of ``data``)."""
        return self.data.shape

    @property
    def dtype(self):
        """Storage dtype of the elements (float8_e4m3fn or float8_e5m2)."""
        return self.data.dtype

    @property
    def ndim(self):
        """Number of dimensions of the logical tensor."""
        return self.data.ndim

    def dequantize(self, dtype=jnp.float32):
        """Same as ``dequantize(self, dtype)``."""
        return dequantize(self, dtype)


def _check_fmt(fmt):
    if fmt not in FORMATS:
        raise ValueError(f"unknown MXFP8 format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def _check_float_dtype(dtype, what):
    dtype = jnp.dtype(dtype)
    if dtype not in _INPUT_DTYPES:
        raise TypeError(f"{what} must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def float32_bits(x):
    """Bits of x widened exactly to fp32, as uint32."""
    if x.dtype == jnp.float32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    # fp16 subnormals are fp32 normals; XLA's f16 -> f32 convert is exact on all 2^16 inputs (tested).
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def e8m0_from_amax_bits(amax, fmt):
    """TE's scale byte e8m0_round_up(RN_fp32(amax * R)) from the bits of a non-NaN amax >= 0 (int32)."""
    a = amax.astype(jnp.int32)
    e = (a >> 23) - fmt.exp_shift + ((a & _MANT) > _MANT_THRESHOLD).astype(jnp.int32)
    e = jnp.where(a > fmt.last_zero_amax, e, 0)
    return jnp.where(a == FP32_INF_BITS, 254, e)


def _scale_by_pow2_bits(bits, shift):
    """fp32 bits of x * 2^shift, exact when the result is an fp32 normal, else ±0 (keeping the sign).

    The ±0 results stand in for fp32 subnormals, which round to ±0 in float8 anyway. Overflow gives ±Inf;
    ±Inf and NaN pass through.
    """
    sign = bits & _SIGN
    mag = bits & FP32_ABS_MASK
    exp = (mag >> 23).astype(jnp.int32)
    man = mag & _MANT
    # Normalise fp32 subnormals: their exponent becomes <= 0, a "virtual" exponent below the fp32 range.
    subnormal = (exp == 0) & (man != 0)
    # floor(log2(man)) from the exponent of float(man): exact (man < 2^23), no clz needed.
    lead = (
        lax.bitcast_convert_type(man.astype(jnp.int32).astype(jnp.float32), jnp.int32) >> 23
    ) - 127
    exp = jnp.where(subnormal, lead - 22, exp)
    man = jnp.where(subnormal, (man << (23 - lead).astype(jnp.uint32)) & _MANT, man)
    new_exp = exp + shift
    out = jnp.where(new_exp >= 1, (new_exp.astype(jnp.uint32) << 23) | man, jnp.uint32(0))
    out = jnp.where(new_exp >= 255, jnp.uint32(FP32_INF_BITS), out)
    out = jnp.where(mag == 0, jnp.uint32(0), out)
    out = jnp.where(mag >= FP32_INF_BITS, mag, out)
    return sign | out


def encode_elements(bits, e, fmt):
    """float8 elements cvt_rn_satfinite(x * 2^(127 - e)) from fp32 bits of x and scale bytes e
    (int32), on the integer bits (exact under XLA:CPU's flush-to-zero too)."""
    return _saturate(
        lax.bitcast_convert_type(_scale_by_pow2_bits(bits, 127 - e), jnp.float32), bits, fmt
    )


def reciprocal_scale_bits(e):
    """The fp32 bits of 2^(127 - e) for scale exponents e (int32, 0..254): the exponent field
    254 - e, or the subnormal 2^-127 for e = 254."""
    return jnp.where(e == 254, jnp.int32(0x00400000), (254 - e) << 23)


def encode_by_multiplying(bits, e, fmt):
    """`encode_elements`'s bits by TE's own arithmetic, RN_fp32(x * 2^(127 - e)): the same bits
    where float arithmetic keeps subnormals (GPUs; XLA:CPU flushes them), with a few
    instructions an element instead of the integer emulation's tens (which made XLA's quantize
    fusions ALU-bound on the H200)."""
    scale = lax.bitcast_convert_type(reciprocal_scale_bits(e), jnp.float32)
    return _saturate(lax.bitcast_convert_type(bits, jnp.float32) * scale, bits, fmt)


def encode(bits, e, fmt):
    """`encode_elements` in XLA: on the integer bits on CPU, by multiplying elsewhere."""
    return lax.platform_dependent(
        bits,
        e,
        cpu=functools.partial(encode_elements, fmt=fmt),
        default=functools.partial(encode_by_multiplying, fmt=fmt),
    )


def _saturate(y, bits, fmt):
    """float8 of the scaled values y: clipped to +-max (satfinite), NaN inputs (per `bits`) as
    0x7F."""
    # satfinite: only ±Inf reach beyond max_normal; XLA's float8 convert is RNE but not saturating.
    q = jnp.clip(y, -fmt.max_normal, fmt.max_normal).astype(fmt.dtype)
    # The NaN select runs on 16-bit values (GPU kernels share this code and Mosaic GPU has no
    # 8-bit selects).
    q = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint16)
    q = jnp.where((bits & FP32_ABS_MASK) > FP32_INF_BITS, jnp.uint16(_FP8_NAN_BYTE), q)
    return lax.bitcast_convert_type(q.astype(jnp.uint8), fmt.dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_impl(x, axis, fmt_name):
    fmt = FORMATS[fmt_name]
    shape = x.shape
    block_shape = shape[:axis] + (shape[axis] // BLOCK_SIZE, BLOCK_SIZE) + shape[axis + 1 :]
    bits = float32_bits(x).reshape(block_shape)
    mag = bits & FP32_ABS_MASK
    # |x| bits are monotone in |x|; NaNs count as 0, and the uint32 max is seeded with 0.
    amax = jnp.max(jnp.where(mag > FP32_INF_BITS, jnp.uint32(0), mag), axis=axis + 1, keepdims=True)
    e = e8m0_from_amax_bits(amax, fmt)
    data = encode(bits, e, fmt).reshape(shape)
    return data, jnp.squeeze(e, axis + 1).astype(jnp.uint8)


def quantize(x, axis=-1, fmt="e4m3"):
    """Quantize ``x`` (float32/bfloat16/float16) to MXFP8 with blocks of 32 along ``axis``.

    ``axis=-1`` is TE's rowwise usage and, for a 2-D [M, K] tensor, ``axis=-2`` (or 0) its columnwise usage
    (same shape, blocks along dim 0); any axis is accepted. Bitwise identical to TE's generic cast kernel:
    NaNs are ignored by amax and encode as 0x7F, ±Inf saturates to ±max with scale byte 0xFE, -0 gives 0x80,
    subnormal inputs are not flushed. Jittable.
    """
    _check_fmt(fmt)
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    _check_float_dtype(x.dtype, "MXFP8 quantize input")
    if np.ndim(x) == 0:
        raise ValueError(
            "MXFP8 quantize needs an input with at least one dimension, got a 0-d array"
        )
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an input of shape {x.shape}")
    axis %= x.ndim
    if x.shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"MXFP8 quantize: axis {axis} has length {x.shape[axis]}, which is not a multiple of {BLOCK_SIZE}"
        )
    data, scale = _quantize_impl(x, axis, fmt)
    return MXTensor(data=data, scale=scale, axis=axis, fmt=fmt)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequantize_impl(data, scale, axis, dtype):
    # Both are exact; multiplying is ~5x faster on the GPU, whose float arithmetic keeps
    # subnormals (checked on every data byte x scale byte on the H200); XLA:CPU flushes them.
    return lax.platform_dependent(
        data,
        scale,
        cpu=functools.partial(_dequantize_on_bits, axis=axis, dtype=dtype),
        default=functools.partial(dequantize_by_multiplying, axis=axis, dtype=dtype),
    )


def dequantize_by_multiplying(data, scale, axis, dtype):
    """``dequantize``'s values as ``float32(data) * scale_multipliers(scale)``, rounded to dtype:
    the same bits (NaN payloads aside) where float arithmetic keeps subnormals (GPUs; not XLA:CPU)."""
    multipliers = jnp.repeat(scale_multipliers(scale), BLOCK_SIZE, axis=axis)
    return (data.astype(jnp.float32) * multipliers).astype(dtype)


def _dequantize_on_bits(data, scale, axis, dtype):
    return decode_elements(data, jnp.repeat(scale.astype(jnp.int32), BLOCK_SIZE, axis=axis), dtype)


def decode_elements(data, e, dtype):
    """fp8 elements `data` times 2^(e - 127) (e: each element's scale byte, int32), exact in fp32
    and RNE-rounded to dtype, on the integer bits (so under XLA:CPU's flush-to-zero too)."""
    bits = lax.bitcast_convert_type(data.astype(jnp.float32), jnp.uint32)  # float8 -> fp32 is exact
    sign = bits & _SIGN
    mag = bits & FP32_ABS_MASK
    new_exp = (mag >> 23).astype(jnp.int32) + e - 127
    # Products below 2^-126 are exact fp32 subnormals: a float8 significand has at most 4 bits and the
    # shift is at most 10 (e4m3) / 17 (e5m2), so no bit is lost.
    subnormal = ((mag & _MANT) | 0x800000) >> jnp.clip(1 - new_exp, 0, 31).astype(jnp.uint32)
    out = jnp.where(new_exp >= 1, (new_exp.astype(jnp.uint32) << 23) | (mag & _MANT), subnormal)
    out = jnp.where(new_exp >= 255, jnp.uint32(FP32_INF_BITS), out)
    out = jnp.where(mag == 0, jnp.uint32(0), out)
    out = jnp.where(mag >= FP32_INF_BITS, mag, out)
    out = jnp.where(e == 255, jnp.uint32(_QNAN), sign | out)
    if dtype == jnp.float32:
        return lax.bitcast_convert_type(out, jnp.float32)
    if dtype == jnp.bfloat16:
        # RNE on the bits (fp32 subnormals included); NaN separately so the carry cannot turn it into Inf.
        rounded = (out + 0x7FFF + ((out >> 16) & 1)) >> 16
        nan = ((out & _SIGN) >> 16) | 0x7FC0
        out16 = jnp.where((out & FP32_ABS_MASK) > FP32_INF_BITS, nan, rounded).astype(jnp.uint16)
        return lax.bitcast_convert_type(out16, jnp.bfloat16)
    # XLA's f32 -> f16 convert is RNE and does not flush fp32 subnormal inputs (checked on all 2^32 inputs).
    return lax.bitcast_convert_type(out, jnp.float32).astype(jnp.float16)


def dequantize(t, dtype=jnp.float32):
    """Decode an MXTensor: ``fp8 * 2^(e-127)`` computed exactly in fp32, then RNE-rounded to ``dtype``
    (on the integer bits on CPU, by a float multiply elsewhere: the same bits, NaN payloads aside).

    Scale byte 0 decodes to 2^-127 and byte 255 to NaN, as in TE main after PR #3262 (TE 2.6-2.18 decode
    byte 0 as 0.0, so blocks with scale byte 0 would dequantize to zeros there). Products >= 2^128 give
    ±Inf, NaN elements give NaN. ``dtype``: float32, bfloat16 or float16.
    """
    _check_fmt(t.fmt)
    dtype = _check_float_dtype(dtype, "MXFP8 dequantize output dtype")
    return _dequantize_impl(t.data, t.scale, t.axis, dtype)


def scale_multipliers(scale):
    """The fp32 multipliers 2^(e-127) of E8M0 scale bytes, as `dequantize` applies them: byte 0 is
    2^-127 (an fp32 subnormal), byte 255 is NaN. Made from the bits, so no denormal is flushed."""
    e = scale.astype(jnp.uint32)
    out = jnp.where(e == 0, jnp.uint32(0x00400000), e << 23)
    out = jnp.where(e == 255, _QNAN, out)
    return lax.bitcast_convert_type(out, jnp.float32)


_SWIZZLE_PERM = (
    0,
    3,
    2,
    1,
    4,
)  # (row tile, 4 row groups, 32 rows, col tile, 4 cols) <-> swizzled; self-inverse


def swizzle_scales(scale):
    """Compact [..., R, C] scale matrix -> cuBLASLt/tcgen05 128x4-tiled layout, [..., R_pad * C_pad] flat.

    The matrix is padded with zero bytes to R_pad = roundup(R, 128), C_pad = roundup(C, 4); element (i, j)
    lands at ``((i//128)*(C_pad//4) + j//4)*512 + (i%32)*16 + ((i%128)//32)*4 + j%4``. Leading dims are
    batch dims. For TE rowwise scales R = M and C = K/32.
    """
    *batch, rows, cols = scale.shape
    rows_pad, cols_pad = round_up(rows, 128), round_up(cols, 4)
    nb = len(batch)
    padded = jnp.pad(scale, [(0, 0)] * nb + [(0, rows_pad - rows), (0, cols_pad - cols)])
    tiles = padded.reshape(*batch, rows_pad // 128, 4, 32, cols_pad // 4, 4)
    tiles = tiles.transpose(*range(nb), *(nb + p for p in _SWIZZLE_PERM))
    return tiles.reshape(*batch, rows_pad * cols_pad)


def unswizzle_scales(buf, shape):
    """Inverse of ``swizzle_scales``: flat [..., R_pad * C_pad] buffer -> compact [..., R, C] with shape=(R, C)."""
    rows, cols = shape
    rows_pad, cols_pad = round_up(rows, 128), round_up(cols, 4)
    *batch, size = buf.shape
    if size != rows_pad * cols_pad:
        raise ValueError(
            f"swizzled buffer of size {size} does not match scale shape {tuple(shape)}"
        )
    nb = len(batch)
    tiles = buf.reshape(*batch, rows_pad // 128, cols_pad // 4, 32, 4, 4)
    tiles = tiles.transpose(*range(nb), *(nb + p for p in _SWIZZLE_PERM))
    return tiles.reshape(*batch, rows_pad, cols_pad)[..., :rows, :cols]


def swizzled_scales(t):
    """GEMM-layout scales of a 2-D MXTensor, flat uint8.

    Rowwise (axis 1, scales [M, K/32]): ``swizzle_scales(scale)``. Columnwise (axis 0, scales [M/32, K]):
    TE pads to [roundup(M/32, 4), roundup(K, 128)] and swizzles the transpose, i.e. ``swizzle_scales(scale.T)``.
    """
    if t.ndim != 2:
        raise ValueError(f"swizzled_scales needs a 2-D MXTensor, got shape {t.shape}")
    return swizzle_scales(t.scale if t.axis == 1 else t.scale.T)
