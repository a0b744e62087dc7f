"""The Hopper FP8-blockwise quantize kernels (1 x 128 blocks along K, also fused with the
dispatch gather, and along the tokens) against the TE-exact reference
`jaxmoe.fp8_blockwise.quantize_1x128`, bit for bit: on CPU in Mosaic GPU interpret mode with the
race detector, on the H200 when marked `gpu`; lowering at the real shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

from jaxmoe import fp8_blockwise
from jaxmoe.ops import dispatch_quantize, quantize_1x128
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas import quantize_hopper, row_pipeline
from jaxmoe.ops.pallas.hopper import MAX_SMEM_PER_CTA
from jaxmoe.ops.pallas.quantize_hopper import (
    FP8_BLOCKWISE,
    gather_quantize_1x128_pallas,
    quantize_1x128_columnwise_pallas,
    quantize_1x128_pallas,
)

from bitwise import assert_bitwise, bits
from quantize_inputs import gathered, normal_range, row_tokens, tensor

BLOCK = fp8_blockwise.BLOCK


def check_kernel(kind, x, fmt, arithmetic, num_rows=None):
    """Run one kernel on x (gather: num_rows dispatch rows of x) and compare it bit for bit with
    the reference, computed on the host CPU."""
    host_x = np.asarray(x)
    if kind == "gather":
        row_token = row_tokens(x.shape[0], num_rows)
        data, scale_inv = gather_quantize_1x128_pallas(x, row_token, fmt, arithmetic=arithmetic)
        host_x = gathered(host_x, np.asarray(row_token))
        padding = np.asarray(row_token) == x.shape[0]
        assert padding.any() and np.all(np.asarray(scale_inv)[padding] == 1)  # zero rows
    elif kind == "columnwise":
        data, scale_inv = quantize_1x128_columnwise_pallas(x, fmt, arithmetic=arithmetic)
    else:
        data, scale_inv = quantize_1x128_pallas(x, fmt, arithmetic=arithmetic)
    with jax.default_device(jax.devices("cpu")[0]):
        ref = fp8_blockwise.quantize_1x128(host_x, 0 if kind == "columnwise" else 1, fmt)
    assert_bitwise(np.asarray(data), np.asarray(ref.data))
    assert_bitwise(np.asarray(scale_inv), np.asarray(ref.scale_inv))


@pytest.mark.parametrize(
    "dtype, fmt",
    [(jnp.bfloat16, "e4m3"), (jnp.bfloat16, "e5m2"), (jnp.float32, "e4m3")],
    ids=["bf16-e4m3", "bf16-e5m2", "fp32-e4m3"],
)
@pytest.mark.parametrize("kind", ["rowwise", "gather", "columnwise"])
def test_kernels_equal_the_reference_bitwise(interpret, kind, dtype, fmt):
    """Specials (NaN, Inf, denormals, 448/449, an all-zero and an all-denormal block), with the
    reference's integer encoding."""
    check_kernel(kind, tensor((128, 512), dtype), fmt, "exact", num_rows=150)


@pytest.mark.parametrize("kind", ["rowwise", "gather", "columnwise"])
def test_float_arithmetic_equals_the_reference_on_normal_values(interpret, kind):
    shape = (256, 512) if kind == "columnwise" else (96, 512)
    check_kernel(kind, normal_range(shape, jnp.bfloat16, seed=7), "e4m3", "float", 150)


# (kind, x shape, dispatch rows): a partial last tile and K of one or several blocks; gathers
# of whole rows (bf16 K = 256: 32 rows of 512 B a tile; 896: 8 rows of 1.75 KB) and of row
# segments (K = 8704: 17-block pieces), each with padding rows.
PARTIAL_CASES = [
    ("rowwise", (120, 384), None),
    ("rowwise", (7, 128), None),
    ("gather", (50, 256), 37),
    ("gather", (30, 896), 45),
    ("gather", (6, 8704), 9),
    ("columnwise", (128, 48), None),  # K below one column tile
    ("columnwise", (256, 400), None),  # K between column tiles
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind,shape,num_rows", PARTIAL_CASES)
def test_partial_tiles(interpret, kind, shape, num_rows, dtype):
    check_kernel(kind, tensor(shape, dtype, seed=11), "e4m3", "exact", num_rows)


@pytest.mark.parametrize("kind", ["rowwise", "gather", "columnwise"])
def test_long_pipelines_reuse_every_slot(interpret, kind):
    """A partial last tile and 3 tiles more than the interpreter's CTAs hold in their rings,
    so that every CTA reuses its SMEM slots."""
    dtype, k = jnp.bfloat16, 1024
    tiles = row_pipeline.STAGES * row_pipeline.CTAS_PER_SM * num_sms() + 3
    if kind == "columnwise":  # 4 column tiles a block row
        shape, num_rows = (BLOCK * (tiles // 4 + 1), k), None
    else:
        if kind == "rowwise":
            tile = row_pipeline.tile_elems(dtype, BLOCK)
        else:
            tile = row_pipeline.gather_plan(k, dtype, BLOCK)[0]
        rows = tiles * tile * BLOCK // k - 1
        shape, num_rows = ((64, k), rows) if kind == "gather" else ((rows, k), None)
    check_kernel(kind, tensor(shape, dtype, seed=12), "e5m2", "exact", num_rows)


def test_negative_control_one_element_changes_its_block_alone(interpret):
    """A changed element changes the kernel's bits, and only inside its own 128-element block:
    a kernel that mixed blocks, or took 32-wide ones, would show here."""
    x = normal_range((64, 512), jnp.bfloat16, seed=2)
    changed = x.at[10, 7].set(jnp.max(jnp.abs(x[10, :BLOCK])) * 1024)  # the block's new amax
    ours = quantize_1x128(changed, impl="pallas")
    ref = fp8_blockwise.quantize_1x128(x)
    data_differs = bits(ours.data) != bits(ref.data)
    scale_differs = bits(ours.scale_inv) != bits(ref.scale_inv)
    assert data_differs[10, :BLOCK].sum() > 1 and scale_differs[10, 0]  # the block rescaled
    assert not data_differs[np.arange(64) != 10].any() and not data_differs[10, BLOCK:].any()
    assert not scale_differs[np.arange(64) != 10].any() and not scale_differs[10, 1:].any()


def test_op_takes_leading_dims_and_dispatch_quantize_takes_the_recipe(interpret):
    """`jaxmoe.ops.quantize_1x128` on "pallas" for a 3-D input (viewed as 2-D) and
    `dispatch_quantize(recipe="fp8_blockwise")`: the reference's BlockwiseTensor bitwise."""
    x = tensor((3, 40, 256), jnp.bfloat16, seed=1)
    ours, ref = quantize_1x128(x, impl="pallas"), fp8_blockwise.quantize_1x128(x)
    assert ours.block_axes == ref.block_axes == (2,) and ours.scale_inv.shape == (3, 40, 2)
    assert_bitwise(np.asarray(ours.data), np.asarray(ref.data))
    assert_bitwise(np.asarray(ours.scale_inv), np.asarray(ref.scale_inv))
    tokens = x[0, :, :128]
    row_token = row_tokens(40, 24)
    out = dispatch_quantize(tokens, row_token, recipe="fp8_blockwise", impl="pallas")
    want = fp8_blockwise.quantize_1x128(gathered(tokens, row_token), 1)
    assert isinstance(out, fp8_blockwise.BlockwiseTensor) and out.block_axes == (1,)
    assert_bitwise(np.asarray(out.data), np.asarray(want.data))
    assert_bitwise(np.asarray(out.scale_inv), np.asarray(want.scale_inv))
    xla = dispatch_quantize(tokens, row_token, recipe="fp8_blockwise", impl="xla")
    assert_bitwise(np.asarray(xla.scale_inv), np.asarray(want.scale_inv))
    rows = tensor((300, 48), jnp.bfloat16, seed=6)  # along the tokens: a partial last block
    ours, ref = quantize_1x128(rows, 0, impl="pallas"), fp8_blockwise.quantize_1x128(rows, 0)
    assert ours.block_axes == (0,) and ours.scale_inv.shape == (3, 48)
    assert_bitwise(np.asarray(ours.data), np.asarray(ref.data))
    assert_bitwise(np.asarray(ours.scale_inv), np.asarray(ref.scale_inv))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gather_plans_keep_every_tma_aligned(dtype):
    """For every row width the kernel takes: the tile fits the 1 x 128 register layout and the
    ring slot, and every segment TMA starts on a 128-byte SMEM boundary and splits its bytes
    evenly over the warpgroup (the interpreter checks neither)."""
    itemsize = jnp.dtype(dtype).itemsize
    for k in range(BLOCK, 20000, BLOCK):
        assert not quantize_hopper.gather_problem((1, k), dtype, 1, FP8_BLOCKWISE)
        tile, segment = row_pipeline.gather_plan(k, dtype, BLOCK)
        assert tile % (16 // itemsize) == 0 and tile <= row_pipeline.tile_elems(dtype, BLOCK)
        assert tile % segment == 0 and (k // BLOCK) % segment == 0
        assert segment * BLOCK * itemsize % 128 == 0


def test_auto_falls_back_and_pallas_refuses_clearly():
    """Partial blocks, blocks along another axis and fp16 run on XLA under "auto" (the same
    bits) and are refused by "pallas" with the reason."""
    x = tensor((64, 192), jnp.float16, seed=5)
    for axis in (0, 1):
        got, want = quantize_1x128(x, axis), fp8_blockwise.quantize_1x128(x, axis)
        assert_bitwise(np.asarray(got.data), np.asarray(want.data))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        quantize_1x128(x, impl="pallas")
    with pytest.raises(ValueError, match="K % 128"):
        quantize_1x128(x.astype(jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match="the first of a 2-D array"):
        quantize_1x128(x[None, :, :128].astype(jnp.bfloat16), axis=1, impl="pallas")
    with pytest.raises(ValueError, match="K % 16"):
        quantize_1x128(x[:, :40].astype(jnp.bfloat16), axis=0, impl="pallas")
    with pytest.raises(ValueError, match="K % 128"):
        dispatch_quantize(
            x.astype(jnp.bfloat16), jnp.zeros(4, jnp.int32), recipe="fp8_blockwise", impl="pallas"
        )
    with pytest.raises(ValueError, match="recipe must be one of"):
        dispatch_quantize(x, jnp.zeros(4, jnp.int32), recipe="fp8")


@pytest.mark.parametrize("arithmetic", ["float", "exact"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["rowwise", "gather", "columnwise"])
def test_lowering_at_real_shapes(kind, dtype, arithmetic):
    """Mosaic GPU lowering at the benchmark shapes, within the shared memory that lets the
    kernel's CTAs share an SM (the persistent grid assumes they do: CTAS_PER_SM, one for the
    columnwise kernel)."""
    s = jax.ShapeDtypeStruct
    limit = MAX_SMEM_PER_CTA if kind == "columnwise" else row_pipeline.SMEM_PER_CTA
    for m, k in [(16384, 4096), (65536, 2048), (32768, 7168), (65536, 768)]:
        if kind == "gather":
            fn = functools.partial(gather_quantize_1x128_pallas, arithmetic=arithmetic)
            args = (s((m // 2, k), dtype), s((m,), jnp.int32))
        else:
            kernel = {
                "rowwise": quantize_1x128_pallas,
                "columnwise": quantize_1x128_columnwise_pallas,
            }
            fn = functools.partial(kernel[kind], arithmetic=arithmetic)
            args = (s((m, k), dtype),)
        with artificial_shared_memory_limit(limit):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


GPU_CASES = [
    ("rowwise", (8192, 4096), None),
    ("gather", (2048, 7168), 4096),
    ("columnwise", (8192, 4096), None),
    *PARTIAL_CASES,
]


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_kernels_equal_the_reference_bitwise(arithmetic):
    """Both kernels and arithmetics on the H200, specials and denormals included, against the
    reference computed on the host CPU: long pipelines and partial tiles."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for fmt in ("e4m3", "e5m2"):
            for kind, shape, num_rows in GPU_CASES:
                check_kernel(kind, tensor(shape, dtype, seed=3), fmt, arithmetic, num_rows)
