"""The Hopper MXFP8 quantize kernels (rowwise, columnwise, fused gather + rowwise) against the
TE-exact reference `jaxmoe.mxfp8.quantize`, bit for bit: on CPU in Mosaic GPU interpret mode with
the race detector, on the H200 when marked `gpu`; lowering at the real shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import mxfp8
from jaxmoe.ops import dispatch_quantize, on_hopper, quantize
from jaxmoe.ops.pallas.quantize_hopper import (gather_quantize_rowwise_pallas,
                                               quantize_columnwise_pallas,
                                               quantize_rowwise_pallas)
from bitwise import assert_bitwise, differs

ON_HOPPER = on_hopper()
SPECIALS = [jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, -0.0, 1e-40, -3e-39, 2e-45, 3e38, 448.0,
            449.0, 57344.0, 1.0]


def tensor(shape, dtype, seed=0):
    """Random values over many binades, with whole blocks of specials, zeros and denormals."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], shape) * jnp.exp2(
        jax.random.randint(keys[1], shape, -20, 20).astype(jnp.float32))
    flat = x.reshape(-1)
    picks = jax.random.randint(keys[2], (64,), 0, flat.size)
    flat = flat.at[picks].set(jnp.asarray(SPECIALS * 5)[:64])
    flat = flat.at[:32].set(0.0).at[32:64].set(1e-40)            # an all-zero and a denormal block
    return flat.reshape(shape).astype(dtype)


def normal_range(shape, dtype, seed=0):
    """Finite values whose scaled copies stay fp32 normals: what the "float" arithmetic can be
    checked on in the CPU interpreter (XLA:CPU flushes denormals; the GPU does not)."""
    keys = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(keys[0], shape) * jnp.exp2(jax.random.randint(
        keys[1], shape, -20, 20).astype(jnp.float32))).astype(dtype)


def assert_same_mx(ours, ref):
    assert ours.axis == ref.axis and ours.fmt == ref.fmt
    assert_bitwise(np.asarray(ours.data), np.asarray(ref.data))
    assert_bitwise(np.asarray(ours.scale), np.asarray(ref.scale))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("axis", [1, 0], ids=["rowwise", "columnwise"])
def test_kernels_equal_the_reference_bitwise(interpret, axis, dtype, fmt):
    x = tensor((192, 256), dtype)
    assert_same_mx(quantize(x, axis=axis, fmt=fmt, impl="pallas"),
                   mxfp8.quantize(x, axis=axis, fmt=fmt))


KERNELS = {
    "rowwise": lambda x, fmt, arithmetic: quantize_rowwise_pallas(x, fmt, arithmetic=arithmetic),
    "columnwise": lambda x, fmt, arithmetic: quantize_columnwise_pallas(x, fmt,
                                                                        arithmetic=arithmetic),
}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", KERNELS)
def test_float_arithmetic_equals_the_reference_on_normal_values(interpret, kind, fmt):
    x = normal_range((192, 256), jnp.bfloat16, seed=7)
    data, scale = KERNELS[kind](x, fmt, "float")
    ref = mxfp8.quantize(x, axis=1 if kind == "rowwise" else 0, fmt=fmt)
    assert_bitwise(np.asarray(data), np.asarray(ref.data))
    assert_bitwise(np.asarray(scale), np.asarray(ref.scale))


def test_rowwise_leading_dims_and_partial_tiles(interpret):
    """3-D input (viewed as 2-D); a shape that is not a whole number of 128-block tiles goes to
    XLA on "auto" and is refused on "pallas" (the H200 mis-stored scales of a partial tile)."""
    x = tensor((2, 64, 96), jnp.bfloat16, seed=1)
    assert_same_mx(quantize(x, axis=-1, impl="pallas"), mxfp8.quantize(x, axis=-1))
    partial = tensor((3, 40, 96), jnp.bfloat16, seed=1)
    assert_same_mx(quantize(partial, axis=-1), mxfp8.quantize(partial, axis=-1))
    with pytest.raises(ValueError, match="multiple of 128 blocks"):
        quantize(partial, axis=-1, impl="pallas")


def test_negative_control_one_element_changes_the_bits(interpret):
    x = tensor((64, 128), jnp.bfloat16, seed=2)
    changed = x.at[10, 7].set(x[10, 7] * 3 + 1)
    assert differs(np.asarray(quantize(changed, axis=1, impl="pallas").data),
                   np.asarray(mxfp8.quantize(x, axis=1).data))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dispatch_quantize_equals_quantize_of_the_gathered_rows(interpret, fmt):
    x = tensor((50, 256), jnp.bfloat16, seed=3)
    row_token = jax.random.randint(jax.random.key(4), (128,), 0, 51).astype(jnp.int32)
    row_token = row_token.at[:5].set(50)                         # padding rows
    padded = jnp.concatenate([x, jnp.zeros((1, 256), x.dtype)])
    out = dispatch_quantize(x, row_token, fmt, impl="pallas")
    assert_same_mx(out, mxfp8.quantize(padded[row_token], axis=1, fmt=fmt))
    assert np.all(np.asarray(out.scale)[:5] == 0)


def test_auto_falls_back_and_pallas_refuses_clearly():
    x = tensor((96, 96), jnp.float16, seed=5)
    assert_same_mx(quantize(x, axis=0), mxfp8.quantize(x, axis=0))  # XLA on CPU / for fp16
    with pytest.raises(ValueError, match="bf16 or fp32"):
        quantize(x, axis=1, impl="pallas")
    with pytest.raises(ValueError, match="M % 64"):
        quantize(x.astype(jnp.bfloat16), axis=0, impl="pallas")
    with pytest.raises(ValueError, match="M % 64"):
        dispatch_quantize(x.astype(jnp.bfloat16), jnp.zeros(40, jnp.int32), impl="pallas")


@pytest.mark.parametrize("op", ["rowwise", "columnwise", "dispatch"])
def test_lowering_at_real_shapes(op):
    s = jax.ShapeDtypeStruct
    x = s((16384, 4096), jnp.bfloat16)
    if op == "dispatch":
        fn = functools.partial(dispatch_quantize, impl="pallas")
        args = (s((8192, 4096), jnp.bfloat16), s((16384,), jnp.int32))
    else:
        fn = functools.partial(quantize, axis=1 if op == "rowwise" else 0, impl="pallas")
        args = (x,)
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_kernels_equal_the_reference_bitwise(arithmetic):
    """Every kernel and both arithmetics on the H200, specials and denormals included, against
    the reference computed on the host CPU."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for fmt in ("e4m3", "e5m2"):
            x = tensor((4096, 1024), dtype, seed=3)
            with jax.default_device(jax.devices("cpu")[0]):
                refs = [mxfp8.quantize(np.asarray(x), axis=axis, fmt=fmt) for axis in (1, 0)]
            for kind, ref in zip(KERNELS, refs):
                data, scale = KERNELS[kind](x, fmt, arithmetic)
                assert_bitwise(np.asarray(data), np.asarray(ref.data))
                assert_bitwise(np.asarray(scale), np.asarray(ref.scale))
            row_token = jax.random.randint(jax.random.key(9), (8192,), 0, 4097).astype(jnp.int32)
            padded = np.concatenate([np.asarray(x), np.zeros((1, 1024), x.dtype)])
            with jax.default_device(jax.devices("cpu")[0]):
                ref = mxfp8.quantize(padded[np.asarray(row_token)], axis=1, fmt=fmt)
            data, scale_t = gather_quantize_rowwise_pallas(x, row_token, fmt,
                                                           arithmetic=arithmetic)
            assert_bitwise(np.asarray(data), np.asarray(ref.data))
            assert_bitwise(np.asarray(scale_t).T, np.asarray(ref.scale))
