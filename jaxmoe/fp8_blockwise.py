"""FP8 blockwise quantization, bit-exact with Transformer Engine's `Float8BlockScaling` recipe at its
defaults (e4m3, power-of-two scales, amax_epsilon 0): the DeepSeek-V3 recipe, whose one scale per
128 K elements lets a Hopper fp8 GEMM fold the scales once per 128-wide K block.

Activations and gradients are quantized in 1 x 128 blocks along one axis (`quantize_1x128`),
weights in 128 x 128 blocks over their last two axes (`quantize_128x128`; a matrix and its
transpose share them, so dgrad needs no second copy). Each block has one fp32 `scale_inv`, the
multiplier that dequantizes it. TE's rule (`compute_scale_from_amax` in
common/recipe/recipe_common.cuh, applied by quantize_transpose_{vector,square}_blockwise.cu):

    amax      = max(+0, |x_i| over the block's non-NaN x_i)     (missing elements of a partial
                                                                 block count as 0)
    scale     = 1                                                if amax is 0 or +Inf
              = pow2_round_down(RN_fp32(max_fp8 / amax))         else (an fp32 overflow of the
                                                                 quotient becomes the input
                                                                 dtype's max first: 2^127)
    q_i       = cvt_rn_satfinite(RN_fp32(x_i * scale))           (NaN -> 0x7F)
    scale_inv = 1 / scale                                        (2^-127 .. 2^120, exact)

Here on the integer bits, as `jaxmoe.mxfp8` does (XLA:CPU flushes fp32 subnormals, TE does not):
with amax = m * 2^E (m in [1, 2)) and max_fp8 = 1.75 * 2^S (e4m3: S = 8),
RN(max_fp8 / amax) = (1.75 / m) * 2^(S - E) rounds to a power of two at or above 2^(S - E) when
m <= 1.75 and stays below it otherwise (the largest m above 1.75 gives 1 - 1.14 * 2^-24, more
than half an ulp below 1), so scale = 2^k with k = min(S - E - [mantissa field > 0x600000], 127)
(`tests/numerics/test_fp8_blockwise.py` checks this against the division on every mantissa at many
exponents). x_i * 2^k is then the MXFP8 element encoding with the same power of two
(`jaxmoe.mxfp8.encode_elements`), exact but for fp32 subnormal products, which round to 0 in
e4m3 either way; on a GPU the element scaling is TE's own float multiply
(`jaxmoe.mxfp8.encode`). docs/numerics.md, "FP8 blockwise", has the recipe around it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmoe.mxfp8 import (
    FORMATS,
    FP32_ABS_MASK,
    FP32_INF_BITS,
    encode,
    float32_bits,
    scale_multipliers,
)
from jaxmoe.ops.checks import check_group_sizes

BLOCK = 128
_MANT = np.uint32(0x7FFFFF)
_MANT_THRESHOLD = 0x600000  # 1.75: max_fp8's significand, for e4m3 and e5m2 alike
_MAX_SCALE_EXPONENT = 127  # the input dtype's max (bf16, fp32) rounded down to a power of two
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale_inv"],
    meta_fields=["block_axes", "fmt"],
)
@dataclasses.dataclass(frozen=True)
class BlockwiseTensor:
    """An FP8-blockwise tensor: `data` (float8, the shape of the original) and `scale_inv`
    (fp32, the dequantize multipliers), one per block of 128 along each of `block_axes` (one
    axis: 1 x 128 blocks; the last two: 128 x 128); scale_inv's shape is data's with each
    blocked axis n replaced by ceil(n / 128)."""

    data: jax.Array
    scale_inv: jax.Array
    block_axes: tuple[int, ...]
    fmt: str = "e4m3"

    @property
    def shape(self):
        """The original tensor's shape (data's)."""
        return self.data.shape

    @property
    def ndim(self):
        """The original tensor's rank."""
        return self.data.ndim

    def dequantize(self, dtype=jnp.float32):
        """data * scale_inv per block, in `dtype` (`dequantize`)."""
        return dequantize(self, dtype)


def scale_exponent_from_amax_bits(amax, fmt="e4m3"):
    """k with TE's scale 2^k (module docstring) from the fp32 bits of amax >= 0 (non-NaN); fmt:
    a name of `jaxmoe.mxfp8.FORMATS` or its entry."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    a = amax.astype(jnp.int32)
    k = fmt.exp_shift + 127 - (a >> 23) - ((a & _MANT) > _MANT_THRESHOLD)
    k = jnp.minimum(k, _MAX_SCALE_EXPONENT)
    return jnp.where((a == 0) | (a == FP32_INF_BITS), 0, k)


def _check_input(x, fmt):
    if fmt not in FORMATS:
        raise ValueError(f"FP8 blockwise: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in _INPUT_DTYPES:
        raise TypeError(
            "FP8 blockwise quantize: the input must be float32, bfloat16 or float16, got "
            f"{getattr(x, 'dtype', type(x))}"
        )
    if x.size == 0:
        raise ValueError(f"FP8 blockwise quantize: the input is empty, shape {x.shape}")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_impl(x, block_axes, fmt):
    shape = x.shape
    padded = [-(-n // BLOCK) * BLOCK if a in block_axes else n for a, n in enumerate(shape)]
    x = jnp.pad(x, [(0, p - n) for p, n in zip(padded, shape)])  # zeros: amax unchanged
    blocked, within = [], []  # each blocked axis n as (n / 128, 128); within: the 128s
    for a, n in enumerate(padded):
        if a in block_axes:
            blocked += [n // BLOCK, BLOCK]
            within.append(len(blocked) - 1)
        else:
            blocked.append(n)
    within = tuple(within)
    bits = float32_bits(x).reshape(blocked)
    mag = bits & FP32_ABS_MASK
    # |x| bits are monotone in |x|; NaNs count as 0.
    amax = jnp.max(jnp.where(mag > FP32_INF_BITS, jnp.uint32(0), mag), axis=within, keepdims=True)
    k = scale_exponent_from_amax_bits(amax, fmt)
    data = encode(bits, 127 - k, FORMATS[fmt]).reshape(padded)
    data = data[tuple(slice(0, n) for n in shape)]
    scale_inv = scale_multipliers((127 - k).astype(jnp.uint8))  # 2^-k from the bits
    return data, jnp.squeeze(scale_inv, within)


def quantize_1x128(x, axis=-1, fmt="e4m3"):
    """x (float32/bfloat16/float16) in 1 x 128 blocks along `axis` (activations and gradients;
    axis=-1 rowwise along K, axis=0 along the tokens for wgrad). A partial last block is
    allowed. Bitwise TE's `Float8BlockwiseQTensor` with block_scaling_dim=1. Jittable."""
    _check_input(x, fmt)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"FP8 blockwise quantize: axis {axis} is out of range for {x.shape}")
    axes = (axis % x.ndim,)
    data, scale_inv = _quantize_impl(x, axes, fmt)
    return BlockwiseTensor(data, scale_inv, axes, fmt)


def quantize_128x128(x, fmt="e4m3"):
    """x [..., K, N] (float32/bfloat16/float16; weights: [G, K, N] for G experts) in 128 x 128
    blocks over its last two axes. Partial edge blocks are allowed. Bitwise TE's
    `Float8BlockwiseQTensor` with block_scaling_dim=2. Jittable."""
    _check_input(x, fmt)
    if x.ndim < 2:
        raise ValueError(f"FP8 blockwise 128x128: the input needs two axes, got {x.shape}")
    axes = (x.ndim - 2, x.ndim - 1)
    data, scale_inv = _quantize_impl(x, axes, fmt)
    return BlockwiseTensor(data, scale_inv, axes, fmt)


def block_multipliers(t: BlockwiseTensor) -> jax.Array:
    """t.scale_inv broadcast to every element of t (fp32, t's shape)."""
    s = t.scale_inv
    for a in t.block_axes:
        s = jnp.repeat(s, BLOCK, axis=a)
    return s[tuple(slice(0, n) for n in t.shape)]


def dequantize(t: BlockwiseTensor, dtype=jnp.float32):
    """fp8 * scale_inv, exact in fp32 (a power-of-two scale) where float arithmetic keeps
    subnormals (GPUs; XLA:CPU flushes products below 2^-126), rounded to `dtype`. The GEMMs
    (`gmm_reference`, `tgmm_reference` and their kernels) never dequantize: they fold the scales
    into each block's fp32 product."""
    return (t.data.astype(jnp.float32) * block_multipliers(t)).astype(dtype)


def gmm_reference(lhs: BlockwiseTensor, rhs: BlockwiseTensor, group_sizes, *, transpose_rhs=False):
    """The blockwise GEMM's reference: out[m] = sum over 128-wide contraction blocks b, in
    order, of P_b[m, n] * (lhs.scale_inv[m, b] * rhs.scale_inv[g(m), b, n // 128]) in fp32,
    P_b the block's fp32 dot of the fp8 values. lhs [M, K] in 1 x 128 blocks along K; rhs
    [G, K, N] in 128 x 128 blocks (fprop), or, with transpose_rhs, [G, N, K] contracted over
    its last axis (dgrad: the weights' blocks transposed). Rows past sum(group_sizes): 0.
    K must be a multiple of 128. fp32 [M, N]."""
    if lhs.block_axes != (1,) or rhs.block_axes != (1, 2) or lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(
            "gmm_reference: lhs must be [M, K] in 1x128 blocks along K and rhs [G, K, N] in "
            "128x128 blocks"
        )
    w, w_scale = rhs.data, rhs.scale_inv
    if transpose_rhs:
        w, w_scale = jnp.swapaxes(w, 1, 2), jnp.swapaxes(w_scale, 1, 2)
    (m, k), n = lhs.shape, w.shape[2]
    if w.shape[1] != k or k % BLOCK:
        raise ValueError(
            f"gmm_reference: contraction {k} vs {w.shape[1]}; must be a multiple of 128"
        )
    ends = jnp.cumsum(group_sizes)
    group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"), w.shape[0] - 1)
    a = lhs.data.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    b = w.astype(jnp.float32).reshape(w.shape[0], k // BLOCK, BLOCK, n)
    column_scale = jnp.repeat(w_scale, BLOCK, axis=2)[:, :, :n]  # [G, K/128, N]

    def fold(acc, block):
        partial = lax.ragged_dot(
            a[:, block],
            b[:, block],
            group_sizes,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )  # rows past the groups: 0
        scale = lhs.scale_inv[:, block, None] * column_scale[group, block]
        return acc + partial * scale, None

    out, _ = lax.scan(fold, jnp.zeros((m, n), jnp.float32), jnp.arange(k // BLOCK))
    return out


def tgmm_reference(lhs: BlockwiseTensor, rhs: BlockwiseTensor, group_sizes):
    """The blockwise weight gradient's reference: out[g] = sum over g's 128-row blocks b, in
    order, of P_b^T * (lhs.scale_inv[b, k] * rhs.scale_inv[b, n]) in fp32, for lhs [M, K] and
    rhs [M, N] in 1 x 128 blocks along M (the tokens); P_b the block's fp32 product of the fp8
    values. Group sizes: multiples of 128 (no block mixes two experts; the plan pads each
    expert's rows), checked when known on the host; rows past their sum are not read. M a
    multiple of 128. Jittable (a scan over the row blocks). fp32 [G, K, N]."""
    if lhs.block_axes != (0,) or rhs.block_axes != (0,) or lhs.shape[0] != rhs.shape[0]:
        raise ValueError("tgmm_reference: lhs [M, K] and rhs [M, N] in 1x128 blocks along M")
    (m, k), n = lhs.shape, rhs.shape[1]
    if m % BLOCK:
        raise ValueError(f"tgmm_reference: M={m} must be a multiple of {BLOCK}")
    check_group_sizes(group_sizes, None, m, "tgmm_reference", multiple=BLOCK)
    num_groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    block_group = jnp.searchsorted(ends, jnp.arange(0, m, BLOCK), side="right")  # G: past
    a = lhs.data.astype(jnp.float32).reshape(m // BLOCK, BLOCK, k)
    b = rhs.data.astype(jnp.float32).reshape(m // BLOCK, BLOCK, n)

    def fold(out, block):
        a_b, b_b, lhs_scale, rhs_scale, group = block
        partial = jnp.einsum("mk,mn->kn", a_b, b_b, precision=lax.Precision.HIGHEST)
        scaled = partial * (lhs_scale[:, None] * rhs_scale[None, :])
        return out.at[group].add(scaled, mode="drop"), None

    out, _ = lax.scan(
        fold,
        jnp.zeros((num_groups, k, n), jnp.float32),
        (a, b, lhs.scale_inv, rhs.scale_inv, block_group),
    )
    return out
