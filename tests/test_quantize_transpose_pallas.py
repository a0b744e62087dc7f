"""The transposing FP8-blockwise quantize kernels (weights in 128 x 128 blocks with their
[G, N, K] copy; activations in 1 x 128 blocks along K with the copy of x^T in 1 x 128 blocks
along M) against `jaxmoe.fp8_blockwise`, bit for bit: on CPU in Mosaic GPU interpret mode with
the race detector, on the H200 when marked `gpu`; lowering at the real shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

from jaxmoe import fp8_blockwise
from jaxmoe.ops import (
    quantize_1x128_transposed,
    quantize_1x128_with_transpose,
    quantize_128x128_with_transpose,
)
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.hopper import MAX_SMEM_PER_CTA
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    quantize_1x128_transposed_pallas,
    quantize_1x128_with_transpose_pallas,
    quantize_128x128_pallas,
)

from bitwise import assert_bitwise
from quantize_inputs import normal_range, tensor

BLOCK = fp8_blockwise.BLOCK
KINDS = ["weights", "with_transpose", "transposed"]


def special_blocks(kind, x):
    """x with whole blocks of zeros and of denormals: 128 x 128 ones for the weights, 1 x 128
    ones along each axis for the activations (x has at least 3 block columns)."""
    if kind == "weights":
        return x.at[0, :BLOCK, BLOCK : 2 * BLOCK].set(0).at[-1, BLOCK:, :BLOCK].set(1e-40)
    return (
        x.at[5, BLOCK : 2 * BLOCK]
        .set(0)
        .at[6, 2 * BLOCK : 3 * BLOCK]
        .set(1e-40)
        .at[BLOCK : 2 * BLOCK, 7]
        .set(0)
        .at[:BLOCK, 9]
        .set(-3e-39)
    )


def check_kernel(kind, x, fmt, arithmetic):
    """Run one kernel on x and compare every output bit for bit with the reference, computed
    on the host CPU."""
    host_x = np.asarray(x)
    with jax.default_device(jax.devices("cpu")[0]):
        if kind == "weights":
            ref = fp8_blockwise.quantize_128x128(host_x, fmt)
            want = (ref.data, ref.scale_inv, jnp.swapaxes(ref.data, 1, 2))
        else:
            ref_t = fp8_blockwise.quantize_1x128(host_x.T, 1, fmt)
            want = (ref_t.data, ref_t.scale_inv)
            if kind == "with_transpose":
                ref = fp8_blockwise.quantize_1x128(host_x, 1, fmt)
                want = ((ref.data, ref.scale_inv), want)
    kernel = {
        "weights": quantize_128x128_pallas,
        "with_transpose": quantize_1x128_with_transpose_pallas,
        "transposed": quantize_1x128_transposed_pallas,
    }[kind]
    got = kernel(x, fmt, arithmetic=arithmetic)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))


def shape_of(kind, tiles):
    """A small shape of (rows, columns) 128 x 128 tiles; weights: two experts."""
    rows, columns = tiles
    if kind == "weights":
        return (2, rows * BLOCK // 2, columns * BLOCK)
    return (rows * BLOCK, columns * BLOCK)


@pytest.mark.parametrize(
    "dtype, fmt",
    [(jnp.bfloat16, "e4m3"), (jnp.bfloat16, "e5m2"), (jnp.float32, "e4m3")],
    ids=["bf16-e4m3", "bf16-e5m2", "fp32-e4m3"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_equal_the_reference_bitwise(interpret, kind, dtype, fmt):
    """Specials (NaN, Inf, denormals, 448/449), whole zero and denormal blocks, with the
    reference's integer encoding; several tiles along both axes."""
    x = special_blocks(kind, tensor(shape_of(kind, (4, 3)), dtype, seed=1))
    check_kernel(kind, x, fmt, "exact")


@pytest.mark.parametrize("kind", KINDS)
def test_float_arithmetic_equals_the_reference_on_normal_values(interpret, kind):
    check_kernel(kind, normal_range(shape_of(kind, (2, 3)), jnp.bfloat16, seed=7), "e4m3", "float")


@pytest.mark.parametrize("kind", KINDS)
def test_long_pipelines_reuse_every_slot(interpret, kind):
    """3 tiles more than the interpreter's CTAs hold in their rings (at most 4 slots each),
    so that every CTA reuses its SMEM slots."""
    tiles = 4 * num_sms() + 3
    shape = shape_of(kind, (2, -(-tiles // 2)))
    check_kernel(kind, tensor(shape, jnp.bfloat16, seed=12), "e4m3", "exact")


def test_ops_return_the_references_blockwise_tensors(interpret):
    """`jaxmoe.ops` on "pallas": the BlockwiseTensors of the references (the transposed
    activations are `quantize_1x128(x, 0)` transposed; the transposed weights share their
    blocks), bitwise."""
    x = normal_range((256, 384), jnp.bfloat16, seed=3)
    rowwise, transposed = quantize_1x128_with_transpose(x, impl="pallas")
    columnwise = fp8_blockwise.quantize_1x128(x, 0)
    want = [fp8_blockwise.quantize_1x128(x, 1), fp8_blockwise.quantize_1x128(x.T, 1)]
    assert_bitwise(np.asarray(want[1].data), np.asarray(columnwise.data.T))
    assert_bitwise(np.asarray(want[1].scale_inv), np.asarray(columnwise.scale_inv.T))
    alone = quantize_1x128_transposed(x, impl="pallas")
    w = normal_range((2, 256, 384), jnp.bfloat16, seed=4)
    weights, weights_t = quantize_128x128_with_transpose(w, impl="pallas")
    xla = quantize_128x128_with_transpose(w, impl="xla")
    assert weights_t.shape == (2, 384, 256) and weights_t.scale_inv.shape == (2, 3, 2)
    for got, ref in zip(
        [rowwise, transposed, alone, weights, weights_t],
        [*want, want[1], *xla],
        strict=True,
    ):
        assert got.block_axes == ref.block_axes and got.fmt == ref.fmt
        assert_bitwise(np.asarray(got.data), np.asarray(ref.data))
        assert_bitwise(np.asarray(got.scale_inv), np.asarray(ref.scale_inv))


def test_auto_falls_back_and_pallas_refuses_clearly():
    """Partial blocks and fp16 run on XLA under "auto" (the reference's bits) and are refused
    by "pallas" with the reason; inputs of the wrong rank are refused by every impl."""
    x = tensor((192, 256), jnp.float16, seed=5)
    rowwise, transposed = quantize_1x128_with_transpose(x)
    assert_bitwise(np.asarray(transposed.data), np.asarray(fp8_blockwise.quantize_1x128(x.T).data))
    assert rowwise.scale_inv.shape == (192, 2) and transposed.scale_inv.shape == (256, 2)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        quantize_1x128_transposed(x, impl="pallas")
    with pytest.raises(ValueError, match="M and K multiples of 128"):
        quantize_1x128_with_transpose(x.astype(jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match="K and N multiples of 128"):
        quantize_128x128_with_transpose(jnp.ones((2, 256, 96), jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match=r"must be \[G, K, N\]"):
        quantize_128x128_with_transpose(jnp.ones((256, 128)), impl="xla")
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        quantize_1x128_transposed(jnp.ones((2, 128, 128)))
    with pytest.raises(ValueError, match="G > 0"):
        quantize_128x128_pallas(jnp.ones((0, 128, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="arithmetic must be one of"):
        quantize_1x128_transposed_pallas(jnp.ones((128, 128)), arithmetic="fast")


@pytest.mark.parametrize("arithmetic", ["float", "exact"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowering_at_real_shapes(dtype, arithmetic):
    """Mosaic GPU lowering (sm_90a) at mixtral's expert weights (fc1 [8, 4096, 2 x 14336], fc2
    [8, 14336, 4096]) and activations, within a CTA's shared memory."""
    s = jax.ShapeDtypeStruct
    calls = [
        (quantize_128x128_pallas, (8, 4096, 2 * 14336)),
        (quantize_128x128_pallas, (8, 14336, 4096)),
    ]
    for shape in [(16384, 4096), (16384, 2 * 14336)]:
        calls += [
            (quantize_1x128_with_transpose_pallas, shape),
            (quantize_1x128_transposed_pallas, shape),
        ]
    with artificial_shared_memory_limit(MAX_SMEM_PER_CTA):
        for kernel, shape in calls:
            fn = functools.partial(kernel, arithmetic=arithmetic)
            jax.jit(fn).trace(s(shape, dtype)).lower(lowering_platforms=("cuda",))


GPU_SHAPES = {
    "weights": (8, 1024, 2048),
    "with_transpose": (4096, 2048),
    "transposed": (4096, 2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_kernels_equal_the_reference_bitwise(arithmetic):
    """The three kernels and both arithmetics on the H200, specials and denormals included,
    against the reference computed on the host CPU: long pipelines (many tiles a CTA)."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for fmt in ("e4m3", "e5m2"):
            for kind, shape in GPU_SHAPES.items():
                x = special_blocks(kind, tensor(shape, dtype, seed=3))
                check_kernel(kind, x, fmt, arithmetic)
