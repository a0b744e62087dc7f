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
    requantize_1x128_transposed,
)
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.hopper import MAX_SMEM_PER_CTA
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    TransposeQuantizeConfig,
    default_transpose_config,
    quantize_1x128_transposed_pallas,
    quantize_1x128_with_transpose_pallas,
    quantize_128x128_pallas,
    requantize_1x128_transposed_pallas,
)

from bitwise import assert_bitwise
from quantize_inputs import normal_range, tensor

BLOCK = fp8_blockwise.BLOCK
BF16 = jnp.bfloat16
KINDS = ["weights", "with_transpose", "transposed"]
# The activations kernels' alternatives to `default_transpose_config` (which every other test
# runs; for bf16 two CTAs with a split ring, C in place, the tile in registers): the field
# defaults (one CTA), each field away from them at least once, two CTAs with one slot, three.
VARIANTS = {
    "one_cta": TransposeQuantizeConfig(),
    "in_place": TransposeQuantizeConfig(transpose="in_place"),
    "registers": TransposeQuantizeConfig(column_source="registers"),
    "under_wgmma": TransposeQuantizeConfig(rowwise_encode="under_wgmma"),
    "two_ctas": TransposeQuantizeConfig(ctas_per_sm=2, transpose="in_place"),
    "three_ctas": TransposeQuantizeConfig(
        ctas_per_sm=3, transpose="in_place", rowwise_encode="under_wgmma"
    ),
}


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


def check_kernel(kind, x, fmt, arithmetic, config=None):
    """Run one kernel on x (an activations kernel under `config`) and compare every output bit
    for bit with the reference, computed on the host CPU."""
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
    got = kernel(x, fmt, arithmetic=arithmetic, **({} if config is None else dict(config=config)))
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


@pytest.mark.parametrize(
    "kind, variant",
    [("with_transpose", name) for name in VARIANTS]
    + [("transposed", "one_cta"), ("weights", "two_ctas"), ("weights", "registers")],
)
def test_variants_equal_the_reference_bitwise(interpret, kind, variant):
    """Each config, specials included, over 3 tiles more than the interpreter's CTAs hold at
    3 each: every input and output slot is reused, the split ring's at different steps."""
    tiles = 3 * VARIANTS[variant].ctas_per_sm * num_sms() + 3
    rows = 4 if kind == "weights" else 3  # the weights: two experts of whole blocks
    x = special_blocks(kind, tensor(shape_of(kind, (rows, -(-tiles // rows))), BF16, seed=8))
    check_kernel(kind, x, "e4m3", "exact", VARIANTS[variant])


def test_configs_are_checked():
    """Bad fields and rings that do not fit a CTA's shared memory raise clearly."""
    for fields, match in [
        (dict(ctas_per_sm=5), "ctas_per_sm must be one of"),
        (dict(rowwise_encode="later"), "rowwise_encode must be one of"),
        (dict(transpose="smem"), "transpose must be one of"),
        (dict(column_source="l2"), "column_source must be one of"),
        (dict(slots=0), "slots must be a positive int"),
        (dict(output_slots=1.5), "output_slots must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=match):
            TransposeQuantizeConfig(**fields)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    for config in [
        TransposeQuantizeConfig(ctas_per_sm=2),  # fp32, two copies and C: no slot fits
        TransposeQuantizeConfig(ctas_per_sm=2, slots=2, output_slots=1, transpose="in_place"),
    ]:
        with pytest.raises(ValueError, match="more than a CTA's 115712"):
            kernel = functools.partial(quantize_1x128_with_transpose_pallas, config=config)
            jax.eval_shape(kernel, x)
    four = functools.partial(
        quantize_1x128_with_transpose_pallas,
        config=TransposeQuantizeConfig(ctas_per_sm=4, transpose="in_place"),
    )
    with pytest.raises(ValueError, match="more than a CTA's 57344 at 4 CTA"):
        jax.eval_shape(four, jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16))
    assert TransposeQuantizeConfig(output_slots=2).ring(32768, 16896, 19456) == (4, 2)
    assert TransposeQuantizeConfig(ctas_per_sm=2).ring(32768, 33792, 3072) == (1, 1)


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


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_only_the_live_rows_are_quantized(interpret, monkeypatch, impl):
    """live_rows (`jaxmoe.ops.live_rows`): the three activations' ops give the full call's bits
    on the rows below it (the transposed copies' columns); the kernels leave the 128-row bands
    past it unwritten (the interpreter's NaN in the rowwise data and every scale), the
    references fill everything past it (DEAD_ROW_FILL = NaN). Control: the full call has no
    NaN."""
    from jaxmoe.ops import live_rows as live_rows_module

    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    x = normal_range((384, 256), jnp.bfloat16, seed=7)
    live, band_end = 150, 256
    copy = fp8_blockwise.quantize_1x128(x, 1)
    calls = {
        "with_transpose": lambda **kw: quantize_1x128_with_transpose(x, impl=impl, **kw),
        "transposed": lambda **kw: (quantize_1x128_transposed(x, impl=impl, **kw),),
        "requantize": lambda **kw: (requantize_1x128_transposed(copy, BF16, impl=impl, **kw),),
    }
    dead = live if impl == "xla" else band_end
    for name, call in calls.items():
        full, counted = call(), call(live_rows=jnp.int32(live))
        *rowwise, transposed = counted
        *rowwise_full, transposed_full = full
        for got, want in zip(rowwise, rowwise_full, strict=True):
            assert_bitwise(np.asarray(got.data[:live]), np.asarray(want.data[:live]))
            assert_bitwise(np.asarray(got.scale_inv[:live]), np.asarray(want.scale_inv[:live]))
            assert np.all(np.isnan(np.asarray(got.data[dead:], np.float32))), name
            assert np.all(np.isnan(np.asarray(got.scale_inv[dead:]))), name
        assert_bitwise(
            np.asarray(transposed.data[:, :live]), np.asarray(transposed_full.data[:, :live])
        )
        scales = np.asarray(transposed.scale_inv)
        assert_bitwise(scales[:, :2], np.asarray(transposed_full.scale_inv)[:, :2])
        assert np.all(np.isnan(scales[:, 2:])), name
        for t in jax.tree.leaves(full):
            assert not np.any(np.isnan(np.asarray(t, np.float32))), name


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
    [8, 14336, 4096]) and activations (also with a live row count), within a CTA's shared
    memory (the activations' kernels: its share under `default_transpose_config`, two CTAs an
    SM for bf16)."""
    activations_budget = default_transpose_config(dtype).smem_budget
    assert activations_budget == (115712 if dtype == jnp.bfloat16 else MAX_SMEM_PER_CTA)
    calls = [
        (quantize_128x128_pallas, (8, 4096, 2 * 14336), MAX_SMEM_PER_CTA),
        (quantize_128x128_pallas, (8, 14336, 4096), MAX_SMEM_PER_CTA),
    ]
    for shape in [(16384, 4096), (16384, 2 * 14336)]:
        calls += [
            (quantize_1x128_with_transpose_pallas, shape, activations_budget),
            (quantize_1x128_transposed_pallas, shape, activations_budget),
        ]
    for kernel, shape, budget in calls:
        with artificial_shared_memory_limit(budget):
            fn = functools.partial(kernel, arithmetic=arithmetic)
            x = jax.ShapeDtypeStruct(shape, dtype)
            jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))
            if kernel is not quantize_128x128_pallas:  # with a live row count
                counted = lambda x, live, fn=fn: fn(x, live_rows=live)  # noqa: E731
                live = jax.ShapeDtypeStruct((), jnp.int32)
                jax.jit(counted).trace(x, live).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_lower_at_real_shapes(variant):
    """Each config lowers for sm_90a within its CTA's share of the SM's shared memory: the
    activations kernels at mixtral's activations and fc1's output gradient, the weights' at
    fc2's weights (bf16)."""
    config = VARIANTS[variant]
    calls = [
        (kernel, shape)
        for shape in [(16384, 4096), (16384, 2 * 14336)]
        for kernel in (quantize_1x128_with_transpose_pallas, quantize_1x128_transposed_pallas)
    ] + [(quantize_128x128_pallas, (8, 14336, 4096))]
    with artificial_shared_memory_limit(config.smem_budget):
        for kernel, shape in calls:
            fn = functools.partial(kernel, arithmetic="float", config=config)
            x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))


GPU_SHAPES = {
    "weights": (8, 1024, 2048),
    "with_transpose": (4096, 2048),
    "transposed": (4096, 2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_kernels_equal_the_reference_bitwise(arithmetic):
    """The three kernels and both arithmetics on the H200, specials and denormals included,
    against the reference computed on the host CPU: long pipelines (many tiles a CTA); with a
    live row count, the full call's bits on its rows."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for fmt in ("e4m3", "e5m2"):
            for kind, shape in GPU_SHAPES.items():
                x = special_blocks(kind, tensor(shape, dtype, seed=3))
                check_kernel(kind, x, fmt, arithmetic)
    x = tensor(GPU_SHAPES["with_transpose"], BF16, seed=4)
    live = x.shape[0] // 3
    full = quantize_1x128_with_transpose_pallas(x, arithmetic=arithmetic)
    counted = quantize_1x128_with_transpose_pallas(
        x, arithmetic=arithmetic, live_rows=jnp.int32(live)
    )
    (data, _), (data_t, _) = full
    (data_c, _), (data_t_c, _) = counted
    assert_bitwise(np.asarray(data_c[:live]), np.asarray(data[:live]))
    assert_bitwise(np.asarray(data_t_c[:, :live]), np.asarray(data_t[:, :live]))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_variants_equal_the_reference_bitwise(variant):
    """Each config of the three kernels on the H200 (bf16, the GPU's float arithmetic)."""
    for kind in ("with_transpose", "transposed", "weights"):
        x = special_blocks(kind, tensor(GPU_SHAPES[kind], jnp.bfloat16, seed=4))
        check_kernel(kind, x, "e4m3", "float", VARIANTS[variant])


# ------------------------------------------------ the transposed copy of an fp8 copy's values
def wire_copy(shape, fmt, seed, special=True):
    """A 1 x 128 copy along K of a [M, K] tensor (specials, zero and denormal blocks when
    `special`) with its last 128 rows as the dispatch pads them: zero data, zero multipliers."""
    x = tensor(shape, jnp.float32, seed=seed)
    if special:
        x = special_blocks("transposed", x)
    q = fp8_blockwise.quantize_1x128(x, 1, fmt)
    return fp8_blockwise.BlockwiseTensor(
        q.data.at[-BLOCK:].set(0), q.scale_inv.at[-BLOCK:].set(0), (1,), fmt
    )


def check_requantize(q, dtype, arithmetic, config=None):
    """The kernel's transposed copy against the reference's bits: `quantize_1x128` (host CPU)
    of `dequantize(q, dtype)` computed on the default device, whose float arithmetic the
    kernel's shares (XLA:CPU, and the interpreter on it, flush subnormal products; GPUs keep
    them)."""
    values = np.asarray(fp8_blockwise.dequantize(q, dtype))
    with jax.default_device(jax.devices("cpu")[0]):
        ref = fp8_blockwise.quantize_1x128(jnp.asarray(values).T, 1, q.fmt)
    kwargs = {} if config is None else dict(config=config)
    got = requantize_1x128_transposed_pallas(
        q.data, q.scale_inv, dtype, q.fmt, arithmetic=arithmetic, **kwargs
    )
    assert got[0].dtype == ref.data.dtype
    assert_bitwise(np.asarray(got[0]), np.asarray(ref.data))
    assert_bitwise(np.asarray(got[1]), np.asarray(ref.scale_inv))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_requantize_equals_the_reference_bitwise(interpret, dtype, fmt):
    """Specials, zero and denormal blocks and padding rows (zero multipliers) in the copy; both
    dequantized dtypes; 4 x 3 tiles."""
    check_requantize(wire_copy((4 * BLOCK, 3 * BLOCK), fmt, seed=21), dtype, "exact")


@pytest.mark.parametrize("variant", ["one_cta", "registers"])
def test_requantize_variants_reuse_every_slot(interpret, variant):
    """The default config and two others over 3 tiles more than the CTAs hold in their rings."""
    config = VARIANTS[variant]
    tiles = 3 * config.ctas_per_sm * num_sms() + 3
    q = wire_copy((3 * BLOCK, -(-tiles // 3) * BLOCK), "e4m3", seed=22)
    check_requantize(q, jnp.bfloat16, "float", config)


def test_requantize_op_and_refusals(interpret):
    """`jaxmoe.ops.requantize_1x128_transposed` on "pallas" equals "xla", which equals
    `quantize_1x128_transposed` of the dequantized values; "auto" falls back for a copy the
    kernel cannot take; bad copies are refused with the reason."""
    q = wire_copy((2 * BLOCK, 2 * BLOCK), "e4m3", seed=23, special=False)
    want = quantize_1x128_transposed(fp8_blockwise.dequantize(q, jnp.bfloat16), impl="xla")
    for impl in ("pallas", "xla"):
        got = requantize_1x128_transposed(q, jnp.bfloat16, impl=impl)
        assert got.block_axes == (1,) and got.fmt == "e4m3"
        assert_bitwise(np.asarray(got.data), np.asarray(want.data))
        assert_bitwise(np.asarray(got.scale_inv), np.asarray(want.scale_inv))
    partial = fp8_blockwise.quantize_1x128(tensor((200, 256), jnp.bfloat16, seed=24), 1)
    fallback = requantize_1x128_transposed(partial, jnp.bfloat16)
    assert fallback.shape == (256, 200)
    with pytest.raises(ValueError, match="M, K multiples of 128"):
        requantize_1x128_transposed(partial, jnp.bfloat16, impl="pallas")
    with pytest.raises(ValueError, match="dequantized to bfloat16 or float32"):
        requantize_1x128_transposed(q, jnp.float16, impl="pallas")
    with pytest.raises(ValueError, match="1 x 128 blocks along axis 1"):
        requantize_1x128_transposed(fp8_blockwise.quantize_1x128(jnp.ones((256, 128)), 0), BF16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_requantize_lowers_at_real_shapes(dtype):
    """Lowering for sm_90a at the dispatched tokens of mixtral ([16384, 4096]) and dsv3_ep8
    ([32768, 7168]) within the default config's share of shared memory."""
    config = default_transpose_config(jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct
    with artificial_shared_memory_limit(config.smem_budget):
        for m, k in [(16384, 4096), (32768, 7168)]:
            fn = functools.partial(
                requantize_1x128_transposed_pallas, dequantized_dtype=dtype, arithmetic="float"
            )
            args = s((m, k), jnp.float8_e4m3fn), s((m, k // BLOCK), jnp.float32)
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_requantize_equals_the_reference_bitwise(arithmetic):
    """On the H200: both formats and dequantized dtypes, specials, denormal blocks (their
    products subnormal in fp32, kept by the GPU's arithmetic and by XLA's reference on it)."""
    for fmt in ("e4m3", "e5m2"):
        for dtype in (jnp.bfloat16, jnp.float32):
            check_requantize(wire_copy(GPU_SHAPES["transposed"], fmt, seed=25), dtype, arithmetic)
