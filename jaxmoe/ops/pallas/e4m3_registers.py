"""MXFP8 weights dequantized to bf16 in registers with integer PTX (Hopper, Mosaic GPU).

For a pair of e4m3 bytes (one 16-bit register of the wgmma A layout) the bf16 pair is built in
three integer instructions and one bf16x2 multiply instead of the compiler's six (an e4m3x2 ->
f16x2 unpack, two f16 -> f32 converts, two fp32 multiplies, a bf16x2 pack):

- a byte permute spreads the two bytes into the two 16-bit halves with their sign bits
  replicated above them; a shift left by 4 and a mask keep, per half, the sign at bit 15 and
  the byte's 7 magnitude bits at bits 4-10. The e4m3 exponent field becomes the low 4 bits of
  the bf16 exponent field and the 3 mantissa bits the top of bf16's mantissa, so the half is
  the e4m3 value times 2^-120 exactly, subnormals included (an e4m3 subnormal 0.mmm x 2^-6
  becomes the bf16 subnormal 0.mmm x 2^-126);
- one bf16x2 multiply by 2^(s - 7) for the E8M0 scale 2^(s - 127) gives the value times its
  scale rounded once to bf16, the bits of the fp32 route (whose product is exact in fp32) when
  2^(s - 7) is a normal bf16: scale bytes up to `MAX_SCALE_BYTE` (a block amax of at most
  448 x 2^7), and when no weight is NaN (the permute would make a NaN byte a finite value).

The multiplier's bf16 bits (s + 120) << 7 in both halves are one integer multiply-add per scale
byte. `small_scale_dequantization_is_exact` says whether MXFP8 weights meet both conditions.

It shortens the decode kernel's device time at every layer shape tried
(the kernel experiments in docs/notes/), and gives the fp32 route's bits on every finite
byte and scale byte up to MAX_SCALE_BYTE (tests/kernels/test_e4m3_registers.py).
"""

from __future__ import annotations

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

MAX_SCALE_BYTE = 134
_E4M3_NAN_MAGNITUDE = 0x7F

# d = bf16x2(a.byte0 * 2^-120, a.byte1 * 2^-120) * m (bf16x2)
_DEQUANTIZE_PAIR = """{
.reg .b32 t;
prmt.b32 t, $1, 0, 0x9180;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mul.rn.bf16x2 $0, t, $2;
}"""


def small_scale_dequantization_is_exact(data: jax.Array, scale: jax.Array) -> jax.Array:
    """Whether `dequantize_small_scales` gives the fp32 route's bits for these MXFP8 weights
    (e4m3 data, uint8 E8M0 scale bytes): every scale byte at most MAX_SCALE_BYTE and no NaN
    weight. A scalar bool array."""
    if data.dtype != jnp.float8_e4m3fn or scale.dtype != jnp.uint8:
        raise ValueError(f"need e4m3 data and uint8 scales, got {data.dtype}, {scale.dtype}")
    magnitude = jax.lax.bitcast_convert_type(data, jnp.uint8) & 0x7F
    return jnp.all(scale <= MAX_SCALE_BYTE) & jnp.all(magnitude != _E4M3_NAN_MAGNITUDE)


def multipliers(scale_bytes: jax.Array) -> jax.Array:
    """uint32 words holding the bf16 2^(s - 7) in both halves for E8M0 bytes s <= MAX_SCALE_BYTE
    (inside a Mosaic GPU kernel or outside)."""
    return scale_bytes.astype(jnp.uint32) * jnp.uint32(0x00800080) + jnp.uint32(0x3C003C00)


def dequantize_small_scales(weights: jax.Array, multiplier_words: jax.Array) -> jax.Array:
    """bf16 weights * scale for e4m3 weights [rows, cols] and the `multipliers` of their scales
    broadcast to the same shape (uint32), both in the wgmma register layout, inside a Mosaic GPU
    kernel (GPU only: the interpreter cannot run inline PTX). Exact where
    `small_scale_dequantization_is_exact`."""
    if weights.dtype != jnp.float8_e4m3fn or multiplier_words.dtype != jnp.uint32:
        raise ValueError(
            "need e4m3 weights and uint32 multipliers, "
            f"got {weights.dtype} and {multiplier_words.dtype}"
        )

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
        return_type=plgpu.ShapeDtypeStruct(weights.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def dequantize(_, fp8: mgpu.FragmentedArray, words: mgpu.FragmentedArray):
        i16 = ir.IntegerType.get_signless(16)
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty_like(fp8.registers)
        for index, pair in np.ndenumerate(fp8.registers):
            if ir.VectorType(pair.type).shape != [2]:
                raise NotImplementedError(f"registers of {pair.type}: expected pairs")
            pair_bits = arith.extui(i32, mgpu_utils.bitcast(pair, i16))
            word = vector.extract(words.registers[index], [], [0])
            result = llvm.inline_asm(i32, [pair_bits, word], _DEQUANTIZE_PAIR, "=r,r,r")
            out[index] = mgpu_utils.bitcast(result, bf16x2)
        return mgpu.FragmentedArray(_registers=out, _layout=fp8.layout, _is_signed=None)

    return dequantize(weights, multiplier_words)
