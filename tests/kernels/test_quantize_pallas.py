"""The Hopper MXFP8 quantize kernels (rowwise, columnwise, fused gather + rowwise) against the
TE-exact reference `jaxmoe.mxfp8.quantize`, bit for bit: on CPU in Mosaic GPU interpret mode with
the race detector, on the H200 when marked `gpu`; lowering at the real shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe import mxfp8
from jaxmoe.ops import dispatch_fake_quantize, dispatch_quantize, on_hopper, quantize
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas import quantize_hopper, row_pipeline
from jaxmoe.ops.pallas.quantize_hopper import (
    gather_fake_quantize_rowwise_pallas,
    gather_quantize_rowwise_pallas,
    quantize_columnwise_pallas,
    quantize_rowwise_pallas,
)

from bitwise import assert_bitwise, bits, differs
from quantize_inputs import gathered, normal_range, row_tokens, tensor

ON_HOPPER = on_hopper()


def assert_same_mx(ours, ref):
    assert ours.axis == ref.axis and ours.fmt == ref.fmt
    assert_bitwise(np.asarray(ours.data), np.asarray(ref.data))
    assert_bitwise(np.asarray(ours.scale), np.asarray(ref.scale))


def assert_same_values(ours, ref):
    """Same bits, NaN payloads aside (the "float" arithmetic's NaN comes from the multiply, as
    XLA's dequantization on a GPU; the reference's from the bits)."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    nan = np.isnan(ref.astype(np.float32))
    assert np.array_equal(np.isnan(ours.astype(np.float32)), nan)
    assert_bitwise(
        np.where(nan, 0, ours).astype(ours.dtype), np.where(nan, 0, ref).astype(ref.dtype)
    )


def check_kernel(kind, x, fmt, arithmetic, num_rows=None):
    """Run one kernel on x (gather: num_rows dispatch rows of x; fake_gather: their copy's
    values) and compare it bit for bit with the reference, computed on the host CPU."""
    host_x = np.asarray(x)
    if kind == "fake_gather":
        row_token = row_tokens(x.shape[0], num_rows)
        values = gather_fake_quantize_rowwise_pallas(x, row_token, fmt, arithmetic=arithmetic)
        with jax.default_device(jax.devices("cpu")[0]):
            ref = mxfp8.quantize(gathered(host_x, np.asarray(row_token)), axis=1, fmt=fmt)
            ref = mxfp8.dequantize(ref, x.dtype)
        assert_same_values(values, ref)
        return
    if kind == "gather":
        row_token = row_tokens(x.shape[0], num_rows)
        data, scale = gather_quantize_rowwise_pallas(x, row_token, fmt, arithmetic=arithmetic)
        with jax.default_device(jax.devices("cpu")[0]):
            ref = mxfp8.quantize(gathered(host_x, np.asarray(row_token)), axis=1, fmt=fmt)
        assert np.all(np.asarray(scale)[np.asarray(row_token) == x.shape[0]] == 0)
    else:
        kernel = quantize_rowwise_pallas if kind == "rowwise" else quantize_columnwise_pallas
        data, scale = kernel(x, fmt, arithmetic=arithmetic)
        with jax.default_device(jax.devices("cpu")[0]):
            ref = mxfp8.quantize(host_x, axis=1 if kind == "rowwise" else 0, fmt=fmt)
    assert_bitwise(np.asarray(data), np.asarray(ref.data))
    assert_bitwise(np.asarray(scale), np.asarray(ref.scale))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("axis", [1, 0], ids=["rowwise", "columnwise"])
def test_kernels_equal_the_reference_bitwise(interpret, axis, dtype, fmt):
    x = tensor((192, 256), dtype)
    assert_same_mx(
        quantize(x, axis=axis, fmt=fmt, impl="pallas"), mxfp8.quantize(x, axis=axis, fmt=fmt)
    )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["rowwise", "columnwise", "gather", "fake_gather"])
def test_float_arithmetic_equals_the_reference_on_normal_values(interpret, kind, fmt):
    check_kernel(kind, normal_range((192, 256), jnp.bfloat16, seed=7), fmt, "float", num_rows=300)


# (kind, x shape, dispatch rows): one partial tile (360 blocks: the shape whose scales the H200
# once mis-stored), K below and between column tiles, gathers of whole rows (bf16 K = 256: 32
# rows of 512 B per tile, 896: 8 rows of 1.75 KB, 192: 32 rows of 384 B) and of row segments
# (K = 8704: 16-block pieces), each with padding rows and a partial last tile.
PARTIAL_CASES = [
    ("rowwise", (120, 96), None),
    ("rowwise", (7, 32), None),
    ("columnwise", (64, 400), None),
    ("columnwise", (96, 48), None),
    ("gather", (50, 256), 37),
    ("gather", (30, 896), 45),
    ("gather", (30, 192), 45),
    ("gather", (6, 8704), 9),
    ("fake_gather", (50, 256), 37),
    ("fake_gather", (6, 8704), 9),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind,shape,num_rows", PARTIAL_CASES)
def test_partial_tiles(interpret, kind, shape, num_rows, dtype):
    check_kernel(kind, tensor(shape, dtype, seed=11), "e4m3", "exact", num_rows)


def long_pipeline(kind, dtype):
    """(x shape, dispatch rows) with a partial last tile and 3 tiles more than the interpreter's
    CTAs hold in their rings, so that every CTA reuses its SMEM slots."""
    k = {"rowwise": 256, "columnwise": 400, "gather": 2048, "fake_gather": 2048}[kind]
    tiles = row_pipeline.STAGES * row_pipeline.CTAS_PER_SM * num_sms() + 3
    if kind == "columnwise":
        return (32 * pl.cdiv(tiles, pl.cdiv(k, row_pipeline.tile_elems(dtype))), k), None
    tile = (
        row_pipeline.tile_elems(dtype)
        if kind == "rowwise"
        else row_pipeline.gather_plan(k, dtype)[0]
    )
    rows = tiles * tile * 32 // k - 1
    return ((64, k), rows) if kind.endswith("gather") else ((rows, k), None)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["rowwise", "columnwise", "gather", "fake_gather"])
def test_long_pipelines_reuse_every_slot(interpret, kind, dtype):
    shape, num_rows = long_pipeline(kind, dtype)
    check_kernel(kind, tensor(shape, dtype, seed=12), "e5m2", "exact", num_rows)


def test_rowwise_leading_dims_and_any_row_count(interpret):
    """3-D input (viewed as 2-D) whose 360 blocks are not a whole number of tiles (nor of 16)."""
    x = tensor((3, 40, 96), jnp.bfloat16, seed=1)
    assert_same_mx(quantize(x, axis=-1, impl="pallas"), mxfp8.quantize(x, axis=-1))


def test_blocks_along_the_next_to_last_axis_of_stacked_matrices(interpret):
    """[G, K, N] with blocks along K (the experts' weights as the fprop GEMM reads them) runs on
    the columnwise kernel as [G * K, N]: no block reaches across two matrices."""
    x = tensor((3, 64, 96), jnp.bfloat16)
    ours = quantize(x, axis=1, impl="pallas")
    assert ours.axis == 1 and ours.scale.shape == (3, 2, 96)
    assert_same_mx(ours, mxfp8.quantize(x, axis=1))


def test_negative_control_one_element_changes_its_block_alone(interpret):
    """A changed element changes the kernel's bits (the comparisons above can see a one-element
    difference), and only inside its own 32-element block: data and scale of every other block
    stay those of the reference (a kernel that mixed blocks, or a stale tile, would show here)."""
    x = tensor((64, 128), jnp.bfloat16, seed=2)
    changed = x.at[10, 7].set(x[10, 7] * 3 + 1)
    ours = quantize(changed, axis=1, impl="pallas")
    ref = mxfp8.quantize(x, axis=1)
    data_differs = bits(ours.data) != bits(ref.data)
    scale_differs = bits(ours.scale) != bits(ref.scale)
    assert data_differs.any()
    assert not data_differs[np.arange(64) != 10].any() and not data_differs[10, 32:].any()
    assert not scale_differs[np.arange(64) != 10].any() and not scale_differs[10, 1:].any()
    assert_same_mx(ours, mxfp8.quantize(changed, axis=1))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dispatch_quantize_equals_quantize_of_the_gathered_rows(interpret, fmt):
    x = tensor((50, 256), jnp.bfloat16, seed=3)
    row_token = jax.random.randint(jax.random.key(4), (128,), 0, 51).astype(jnp.int32)
    row_token = row_token.at[:5].set(50)  # padding rows
    out = dispatch_quantize(x, row_token, fmt, impl="pallas")
    assert_same_mx(out, mxfp8.quantize(gathered(x, row_token), axis=1, fmt=fmt))
    assert np.all(np.asarray(out.scale)[:5] == 0)


@pytest.mark.parametrize("per_token", [1, 4])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_dispatch_fake_quantize_gives_the_dispatched_copys_values(interpret, impl, per_token):
    """The one-pass rows equal the dequantized dispatch copy bitwise (padding rows zeros), on
    the kernel and on XLA, from tokens or from slots (per_token of them a token, as the plan's
    row_slot); control: the gathered rows themselves differ from them."""
    x = tensor((50, 256), jnp.bfloat16, seed=5)
    row_token = jax.random.randint(jax.random.key(6), (96,), 0, 51).astype(jnp.int32)
    row_token = row_token.at[:3].set(50)
    slots = row_token * per_token + jnp.arange(96, dtype=jnp.int32) % per_token
    slots = jnp.where(row_token == 50, 50 * per_token, slots)
    values = dispatch_fake_quantize(x, slots, per_token=per_token, impl=impl)
    copy = dispatch_quantize(x, slots, per_token=per_token, impl=impl)
    assert_same_mx(copy, mxfp8.quantize(gathered(x, row_token), axis=1))
    assert_same_values(values, mxfp8.dequantize(copy, jnp.bfloat16))
    assert np.all(np.asarray(values[:3], np.float32) == 0)
    finite = np.isfinite(np.asarray(values, np.float32))
    assert differs(np.asarray(values)[finite], np.asarray(gathered(x, row_token))[finite])
    with pytest.raises(ValueError, match="x must be"):
        dispatch_fake_quantize(x[0], row_token, impl=impl)


def test_gather_loads_whole_rows_at_the_benchmark_widths():
    """bf16 tiles of whole token rows: 2 x 8 KB (H 4096), 1 x 14 KB (7168), 4 x 4 KB (2048)."""
    plan = functools.partial(row_pipeline.gather_plan, dtype=jnp.bfloat16)
    assert [plan(h) for h in (4096, 7168, 2048)] == [(256, 128), (224, 224), (256, 64)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gather_plans_keep_every_tma_aligned(dtype):
    """For every row width the kernel takes: the tile fits the register layout and the ring
    slot, and every segment TMA starts on a 128-byte SMEM boundary and splits its bytes evenly
    over the warpgroup (the interpreter checks neither)."""
    itemsize = jnp.dtype(dtype).itemsize
    for k in range(32, 20000, 32):
        if quantize_hopper.gather_problem((1, k), dtype, 1):
            continue
        tile, segment = row_pipeline.gather_plan(k, dtype)
        assert tile % (64 // itemsize) == 0 and tile <= row_pipeline.tile_elems(dtype)
        assert tile % segment == 0 and (k // 32) % segment == 0
        assert segment * 32 * itemsize % 128 == 0


def test_auto_falls_back_and_pallas_refuses_clearly():
    x = tensor((96, 96), jnp.float16, seed=5)
    assert_same_mx(quantize(x, axis=0), mxfp8.quantize(x, axis=0))  # XLA on CPU / for fp16
    with pytest.raises(ValueError, match="bf16 or fp32"):
        quantize(x, axis=1, impl="pallas")
    with pytest.raises(ValueError, match="M % 32"):
        quantize(x[:48].astype(jnp.bfloat16), axis=0, impl="pallas")
    with pytest.raises(ValueError, match="K % 16"):
        quantize(x[:, :40].astype(jnp.bfloat16), axis=0, impl="pallas")
    with pytest.raises(ValueError, match="K % 64"):
        dispatch_quantize(x.astype(jnp.bfloat16), jnp.zeros(40, jnp.int32), impl="pallas")
    with pytest.raises(ValueError, match="non-empty"):
        quantize(jnp.zeros((0, 64), jnp.bfloat16), axis=1, impl="pallas")
    with pytest.raises(ValueError, match="at least one row"):
        dispatch_quantize(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros(0, jnp.int32), impl="pallas")


def test_float_arithmetic_leaves_the_clip_to_the_gpu_convert():
    """The "float" arithmetic is built without the clip when compiled for the GPU (whose
    convert saturates: the GPU tests below check the bits, specials included) and with it when
    interpreted."""
    check = functools.partial(quantize_hopper.checked_arithmetic, None, "e4m3")
    assert check("float", None) == "float_satfinite"
    assert check("float", True) == check("float_clipped", None) == "float_clipped"
    with plgpu.force_gpu_interpret_mode():
        assert check(None, None) == "exact" and check("float", None) == "float_clipped"
    with pytest.raises(ValueError, match="arithmetic must be one of"):
        check("float_satfinite", None)


@pytest.mark.parametrize("arithmetic", ["float", "exact"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["rowwise", "columnwise", "gather", "fake_gather"])
def test_lowering_at_real_shapes(kind, dtype, arithmetic):
    """Mosaic GPU lowering at the benchmark shapes, within the shared memory that lets
    CTAS_PER_SM CTAs share an SM (the persistent grid assumes they do)."""
    s = jax.ShapeDtypeStruct
    for m, k in [(16384, 4096), (65536, 2048), (32768, 7168)]:
        if kind.endswith("gather"):
            kernel = {
                "gather": gather_quantize_rowwise_pallas,
                "fake_gather": gather_fake_quantize_rowwise_pallas,
            }[kind]
            fn = functools.partial(kernel, arithmetic=arithmetic)
            args = (s((m // 2, k), dtype), s((m,), jnp.int32))
        else:
            fn = functools.partial(
                quantize_rowwise_pallas if kind == "rowwise" else quantize_columnwise_pallas,
                arithmetic=arithmetic,
            )
            args = (s((m, k), dtype),)
        with artificial_shared_memory_limit(row_pipeline.SMEM_PER_CTA):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# Many tiles per CTA of the persistent grid (every ring slot reused), then the partial cases.
GPU_CASES = [
    ("rowwise", (8192, 4096), None),
    ("columnwise", (8192, 4096), None),
    ("gather", (4096, 4096), 8192),
    ("gather", (2048, 7168), 4096),
    ("fake_gather", (4096, 4096), 8192),
    ("fake_gather", (64, 2048), 512),  # qwen3_30b's 64 decode tokens
    *PARTIAL_CASES,
]


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_kernels_equal_the_reference_bitwise(arithmetic):
    """Every kernel and both arithmetics on the H200, specials and denormals included, against
    the reference computed on the host CPU: long pipelines and partial tiles."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for fmt in ("e4m3", "e5m2"):
            for kind, shape, num_rows in GPU_CASES:
                check_kernel(kind, tensor(shape, dtype, seed=3), fmt, arithmetic, num_rows)
