"""The dispatch and combine kernels (`jaxmoe.ops.permute`, Hopper Mosaic GPU) against the XLA
references, bit for bit: on CPU in Mosaic GPU interpret mode with the race detector, on the
H200 when marked `gpu`; lowering at the real shapes; the layer's VJP pairing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

from jaxmoe.ops import on_hopper
from jaxmoe.ops.pallas import row_pipeline
from jaxmoe.ops.pallas.combine_hopper import combine_pallas, combine_plan
from jaxmoe.ops.pallas.dispatch_hopper import dispatch_pallas
from jaxmoe.ops.permute import combine_rows, dispatch_rows

from bitwise import assert_bitwise, differs

ON_HOPPER = on_hopper()
SPECIALS = [jnp.nan, jnp.inf, -jnp.inf, -0.0, 0.0, 3e38, -3e38]


def values(shape, dtype, seed=0):
    """Random values over many binades with some specials (NaN, +-Inf, +-0, huge)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], shape) * jnp.exp2(
        jax.random.randint(keys[1], shape, -10, 10).astype(jnp.float32)
    )
    flat = x.reshape(-1)
    picks = jax.random.randint(keys[2], (21,), 0, flat.size)
    flat = flat.at[picks].set(jnp.asarray(SPECIALS * 3))
    return flat.reshape(shape).astype(dtype)


def row_tokens(num_tokens, num_rows, seed=1):
    """Dispatch rows: random tokens, every 7th row a padding row (token T)."""
    tokens = jax.random.randint(jax.random.key(seed), (num_rows,), 0, num_tokens)
    return tokens.at[::7].set(num_tokens).astype(jnp.int32)


def token_rows(num_tokens, k, num_rows, seed=2):
    """Combine slots: distinct random rows per token, every third token with its last slot
    dropped (row M) and token 0 with all its slots dropped."""
    keys = jax.random.split(jax.random.key(seed), num_tokens)
    rows = jax.vmap(lambda key: jax.random.permutation(key, num_rows)[:k])(keys)
    rows = rows.at[::3, -1].set(num_rows).at[0].set(num_rows)
    return rows.astype(jnp.int32)


def xla_dispatch(x, rows):
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(dispatch_rows(np.asarray(x), np.asarray(rows), impl="xla"))


def xla_combine(rows, slots, out_dtype):
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(combine_rows(np.asarray(rows), np.asarray(slots), out_dtype, impl="xla"))


@pytest.mark.parametrize(
    "dtype,num_tokens,h,num_rows",
    [
        (jnp.bfloat16, 8, 128, 300),
        (jnp.float32, 16, 64, 40),
        (jnp.float16, 24, 256, 173),
        (jnp.float8_e4m3fn, 12, 256, 90),
        (jnp.bfloat16, 6, 2048, 20),
    ],
)
def test_dispatch_kernel_equals_the_reference(interpret, dtype, num_tokens, h, num_rows):
    """Partial last tiles (row counts that are no multiple of the tile), padding rows, specials;
    float8 (a quantized copy's data rows) too. Short rows make tiles of many TMA loads, issued
    by a loop; 2048 bf16 a tile of a few, unrolled."""
    tile, segment = row_pipeline.gather_plan(h, dtype)
    assert (tile // segment > row_pipeline.UNROLLED_GATHER_LOADS) == (h < 2048)
    x = values((num_tokens, h), dtype)
    rows = row_tokens(num_tokens, num_rows)
    out = dispatch_pallas(x, rows)
    assert_bitwise(np.asarray(out), xla_dispatch(x, rows))
    assert np.all(np.asarray(out, np.float32)[np.asarray(rows) == num_tokens] == 0)


def test_dispatch_reads_slots_and_divides_them_per_token(interpret):
    """per_token k: the rows' slots (t * k + j; T * k for a padding row) name their tokens, as
    the plan's row_slot does, on the kernel and on XLA; control: read as tokens, the same
    slots gather other rows."""
    num_tokens, k, h = 12, 3, 256
    x = values((num_tokens, h), jnp.bfloat16, seed=5)
    tokens = row_tokens(num_tokens, 70, seed=6)
    slots = tokens * k + jax.random.randint(jax.random.key(7), tokens.shape, 0, k)
    slots = jnp.where(tokens == num_tokens, num_tokens * k, slots).astype(jnp.int32)
    expected = xla_dispatch(x, tokens)
    for impl in ("pallas", "xla"):
        assert_bitwise(np.asarray(dispatch_rows(x, slots, per_token=k, impl=impl)), expected)
    assert differs(np.asarray(dispatch_rows(x, slots, impl="pallas")), expected)


def test_dispatch_long_pipeline_reuses_every_slot(interpret):
    """More tiles than STAGES per CTA of the interpreter's persistent grid, so every ring slot
    is refilled after its store (the copy pipeline's one-step delay)."""
    tiles = row_pipeline.STAGES * row_pipeline.num_ctas(10**6) + 3
    h = 256
    tile, _ = row_pipeline.gather_plan(h, jnp.bfloat16)
    num_rows = tiles * tile * 32 // h
    x = values((50, h), jnp.bfloat16, seed=3)
    rows = row_tokens(50, num_rows, seed=4)
    assert_bitwise(np.asarray(dispatch_pallas(x, rows)), xla_dispatch(x, rows))


@pytest.mark.parametrize("live", [0, 37, 300], ids=lambda n: f"live{n}")
def test_dispatch_gathers_only_the_live_rows(interpret, monkeypatch, live):
    """With live_rows the kernel writes the tiles holding rows [0, live) and no other: the
    live rows equal the reference's, every row of a tile past them keeps the interpreter's
    uninitialized NaN (the control that the count is honoured: without it they are zeros or
    tokens). The XLA reference fills rows at and past the count with DEAD_ROW_FILL."""
    from jaxmoe.ops import live_rows as live_rows_module

    num_tokens, h, num_rows = 16, 256, 300
    tile_rows = row_pipeline.gather_plan(h, jnp.bfloat16)[0] * 32 // h
    x = values((num_tokens, h), jnp.bfloat16, seed=20)
    x = jnp.where(jnp.isnan(x), 1.0, x).astype(jnp.bfloat16)  # no NaN of its own
    rows = row_tokens(num_tokens, num_rows, seed=21)
    expected = xla_dispatch(x, rows)
    out = np.asarray(dispatch_pallas(x, rows, live_rows=jnp.int32(live)), np.float32)
    assert_bitwise(out[:live], np.asarray(expected, np.float32)[:live])
    written = -(-live // tile_rows) * tile_rows
    assert np.all(np.isnan(out[written:]))
    assert not np.any(np.isnan(out[:written]))
    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    reference = np.asarray(dispatch_rows(x, rows, live_rows=jnp.int32(live), impl="xla"))
    assert_bitwise(reference[:live], expected[:live])
    assert np.all(np.isnan(np.asarray(reference, np.float32)[live:]))
    with pytest.raises(ValueError, match="live_rows"):
        dispatch_rows(x, rows, live_rows=jnp.ones(2, jnp.int32), impl="xla")


@pytest.mark.parametrize(
    "dtype,out_dtype,num_tokens,k,h,num_rows",
    [
        (jnp.bfloat16, jnp.bfloat16, 16, 2, 128, 40),
        (jnp.float32, jnp.bfloat16, 9, 8, 512, 300),
        (jnp.bfloat16, jnp.float32, 24, 4, 1024, 100),
        (jnp.bfloat16, jnp.bfloat16, 5, 1, 256, 8),
        (jnp.bfloat16, jnp.bfloat16, 7, 2, 64, 20),
        (jnp.float32, jnp.float32, 9, 3, 32, 20),
    ],
)
def test_combine_kernel_equals_the_reference(
    interpret, dtype, out_dtype, num_tokens, k, h, num_rows
):
    """Dropped slots (+0.0), a token with every slot dropped, specials, k from 1 to 8, short
    rows grouped several tokens to a tile (with a partial last tile)."""
    rows = values((num_rows, h), dtype)
    slots = token_rows(num_tokens, k, num_rows)
    out = combine_pallas(rows, slots, out_dtype)
    assert out.dtype == jnp.dtype(out_dtype)
    assert_bitwise(np.asarray(out), xla_combine(rows, slots, out_dtype))
    assert np.all(np.asarray(out, np.float32)[0] == 0)


def test_combine_long_pipeline_reuses_every_slot(interpret):
    k, h = 4, 256
    plan = combine_plan(h, k, jnp.bfloat16, jnp.bfloat16)
    tiles = row_pipeline.STAGES * row_pipeline.num_ctas(10**6) + 3
    num_tokens = tiles * plan.tokens * plan.segment * 32 // h
    rows = values((64, h), jnp.bfloat16, seed=5)
    slots = token_rows(num_tokens, k, 64, seed=6)
    assert_bitwise(np.asarray(combine_pallas(rows, slots)), xla_combine(rows, slots, jnp.bfloat16))


def test_combine_adds_in_slot_order_with_one_rounding(interpret):
    """The sum is fp32 from the first slot, left to right, rounded once: 1 + 2^-8 + 2^-8 is
    1 + 2^-7 in bf16, where a bf16 running sum would stay 1 (negative control); +-0.0 and a NaN
    row behave as in that sum."""
    one, tiny = 1.0, 2.0**-8
    rows = jnp.asarray(
        [[one] * 128, [tiny] * 128, [tiny] * 128, [-0.0] * 128, [jnp.nan] * 128], jnp.bfloat16
    )
    slots = jnp.asarray([[0, 1, 2], [3, 5, 5], [3, 3, 5], [4, 0, 5]], jnp.int32)
    out = np.asarray(combine_pallas(rows, slots), np.float32)
    assert np.all(out[0] == 1 + 2**-7)
    bf16_running = (jnp.bfloat16(one) + jnp.bfloat16(tiny)) + jnp.bfloat16(tiny)
    assert float(bf16_running) != 1 + 2**-7
    assert np.all(np.signbit(out[1]) == np.signbit(np.float32(-0.0) + np.float32(0.0)))
    assert np.all(np.signbit(out[2]) == np.signbit(np.float32(-0.0) + np.float32(-0.0) + 0.0))
    assert np.all(np.isnan(out[3]))
    assert_bitwise(np.asarray(combine_pallas(rows, slots)), xla_combine(rows, slots, jnp.bfloat16))


def test_negative_control_one_element_changes_the_bits(interpret):
    x = values((16, 256), jnp.bfloat16, seed=7)
    rows = row_tokens(16, 32, seed=8)
    picked = int(rows[1])
    moved = x.at[picked, 5].add(1.0)
    assert differs(np.asarray(dispatch_pallas(moved, rows)), xla_dispatch(x, rows))
    slots = token_rows(8, 2, 32)
    buffer = values((32, 256), jnp.bfloat16, seed=9)
    changed = buffer.at[int(slots[1, 0]), 3].add(1.0)
    assert differs(
        np.asarray(combine_pallas(changed, slots)), xla_combine(buffer, slots, jnp.bfloat16)
    )


def test_auto_falls_back_and_pallas_refuses_clearly():
    x = jnp.ones((4, 48), jnp.bfloat16)  # 96-byte rows: no TMA segment fits
    rows = jnp.asarray([0, 1, 4], jnp.int32)
    assert dispatch_rows(x, rows, impl="auto").shape == (3, 48)
    with pytest.raises(ValueError, match=r"dispatch_rows\(impl='pallas'\).*H % 64"):
        dispatch_rows(x, rows, impl="pallas")
    with pytest.raises(ValueError, match=r"combine_rows\(impl='pallas'\).*no tile fits"):
        combine_rows(jnp.ones((6, 48), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32), impl="pallas")
    with pytest.raises(ValueError, match="int8"):
        dispatch_rows(jnp.ones((4, 64), jnp.int8), rows, impl="pallas")
    with pytest.raises(ValueError, match=r"token_rows \[T, k >= 1\]"):
        combine_rows(jnp.ones((6, 128), jnp.bfloat16), jnp.zeros((2, 0), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        combine_rows(jnp.ones((6, 128), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32), impl="cuda")


@pytest.mark.parametrize(
    "num_tokens,h,k",
    [(8192, 4096, 2), (8192, 2048, 8), (4096, 7168, 8)],
    ids=["mixtral", "qwen3_30b", "dsv3"],
)
def test_lowering_at_real_shapes(num_tokens, h, k):
    """Mosaic GPU lowering at the benchmark shapes, within the shared memory that lets
    CTAS_PER_SM CTAs share an SM (the persistent grid assumes they do)."""
    s = jax.ShapeDtypeStruct
    num_rows = num_tokens * k
    with artificial_shared_memory_limit(row_pipeline.SMEM_PER_CTA):
        jax.jit(combine_pallas).trace(
            s((num_rows, h), jnp.bfloat16), s((num_tokens, k), jnp.int32)
        ).lower(lowering_platforms=("cuda",))
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            jax.jit(dispatch_pallas).trace(
                s((num_tokens, h), dtype), s((num_rows,), jnp.int32)
            ).lower(lowering_platforms=("cuda",))
        counted = lambda x, rows, live: dispatch_pallas(x, rows, live_rows=live)  # noqa: E731
        jax.jit(counted).trace(
            s((num_tokens, h), jnp.bfloat16), s((num_rows,), jnp.int32), s((), jnp.int32)
        ).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens,h,k",
    [(8192, 4096, 2), (8192, 2048, 8), (4096, 7168, 8), (1000, 1152, 6), (999, 64, 3)],
)
def test_gpu_kernels_equal_the_reference(num_tokens, h, k):
    """Both kernels on the H200 at the real sizes (and ragged ones) against the XLA references
    on the same GPU (a GPU's fp32 add returns one canonical NaN, a CPU keeps the payload); the
    dispatch with a live row count on its live rows."""
    num_rows = num_tokens * k + 3
    x = values((num_tokens, h), jnp.bfloat16, seed=10)
    rows = row_tokens(num_tokens, num_rows, seed=11)
    assert_bitwise(
        np.asarray(dispatch_rows(x, rows, impl="pallas")),
        np.asarray(dispatch_rows(x, rows, impl="xla")),
    )
    slots = (rows * k + jnp.arange(num_rows, dtype=jnp.int32) % k).astype(jnp.int32)
    slots = jnp.where(rows == num_tokens, num_tokens * k, slots)
    assert_bitwise(
        np.asarray(dispatch_rows(x, slots, per_token=k, impl="pallas")), xla_dispatch(x, rows)
    )
    assert_bitwise(np.asarray(dispatch_rows(x, rows, impl="pallas")), xla_dispatch(x, rows))
    live = num_rows // 3
    counted = dispatch_rows(x, rows, live_rows=jnp.int32(live), impl="pallas")
    assert_bitwise(np.asarray(counted)[:live], xla_dispatch(x, rows)[:live])
    if h % 128 == 0:  # float8 rows: a quantized copy's data
        x8 = values((num_tokens, h), jnp.float8_e4m3fn, seed=14)
        assert_bitwise(np.asarray(dispatch_rows(x8, rows, impl="pallas")), xla_dispatch(x8, rows))
    buffer = values((num_rows, h), jnp.bfloat16, seed=12)
    slots = token_rows(num_tokens, k, num_rows, seed=13)
    ours = np.asarray(combine_rows(buffer, slots, impl="pallas"))
    assert_bitwise(ours, np.asarray(combine_rows(buffer, slots, impl="xla")))
    on_cpu = xla_combine(buffer, slots, jnp.bfloat16)
    assert_bitwise(ours[~np.isnan(on_cpu)], on_cpu[~np.isnan(on_cpu)])
    assert np.array_equal(np.isnan(ours), np.isnan(on_cpu))


def test_layer_dispatch_and_combine_are_each_others_transpose(interpret):
    """jaxmoe.dispatch / combine on the kernels: their VJPs are each other, bit for bit with
    the XLA references."""
    from jaxmoe import MoEConfig
    from jaxmoe.dispatch import combine, dispatch
    from jaxmoe.plan import make_plan
    from jaxmoe.routing import route

    config = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=64, capacity_factor=0.5)
    logits = jax.random.normal(jax.random.key(14), (24, 4))
    plan = make_plan(route(logits, config), config)
    x = values((24, 128), jnp.bfloat16, seed=15)
    g = values((plan.num_rows, 128), jnp.bfloat16, seed=16)

    def both(impl):
        rows, vjp = jax.vjp(functools.partial(dispatch, plan=plan, impl=impl), x)
        y, vjp_c = jax.vjp(functools.partial(combine, plan=plan, impl=impl), g)
        return rows, vjp(g)[0], y, vjp_c(x)[0]

    for ours, ref in zip(both("pallas"), both("xla")):
        assert_bitwise(np.asarray(ours), np.asarray(ref))
