"""The weighted SwiGLU kernels (ops/pallas/activation_forward_hopper.py and
activation_backward_hopper.py, interpreted on CPU with the race detector) against the references
(`weighted_activation_forward` / `weighted_activation_backward(impl="xla")`): the forward
bitwise; the one-pass backward's d h within a bf16 rounding, the probability gradient within the
sigmoid's rounding, and its tree bitwise where the products are exact on both sides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import ordered
from jaxmoe.ops import registry, weighted_activation_backward, weighted_activation_forward

BF16, F32 = jnp.bfloat16, jnp.float32


def operands(m, f, seed=0, saturated=False):
    kh, kg, kp = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (m, 2 * f), BF16)
    if saturated:  # sigmoid(gate) == 1 exactly: every product the same bits on both sides
        h = h.at[:, :f].set(jnp.abs(h[:, :f]) + 20)
    return h, jax.random.uniform(kp, (m,), F32), jax.random.normal(kg, (m, f), BF16)


def assert_close_to_reference(h, p, g, d_h, d_p, ref_h, ref_p):
    """d h within one bf16 rounding of the reference's; d p within 2^-18 of the row's sum of
    |g act(h)| (the sigmoid's few fp32 ulps in each product, and both trees' roundings)."""
    np.testing.assert_allclose(np.asarray(d_h, F32), np.asarray(ref_h, F32), rtol=2**-7, atol=0)
    gate, up = np.split(np.asarray(h, np.float64), 2, axis=1)
    magnitude = np.abs(np.asarray(g, np.float64) * gate / (1 + np.exp(-gate)) * up).sum(1)
    error = np.abs(np.asarray(d_p, np.float64) - np.asarray(ref_p, np.float64))
    assert np.all(error <= 2**-18 * magnitude), f"worst {np.max(error / magnitude):.3g}"


def both(h, p, g):
    run = lambda impl: weighted_activation_backward(h, p, g, "silu", True, impl=impl)
    return run("pallas"), run("xla")


@pytest.mark.parametrize("m,f", [(48, 512), (70, 768)], ids=["two_chunk_tiles", "three_ragged"])
def test_kernel_matches_the_reference(interpret, m, f):
    h, p, g = operands(m, f)
    (d_h, d_p), (ref_h, ref_p) = both(h, p, g)
    assert d_h.dtype == BF16 and d_h.shape == (m, 2 * f) and d_p.shape == (m,)
    assert_close_to_reference(h, p, g, d_h, d_p, ref_h, ref_p)


def assert_reference_tree(m, f):
    """With exact products the kernel's probability gradient is the reference's bits: its
    registers and the tiles' partials add in `row_sums_in_order`'s tree. Control: the reference
    with 64 lanes (another tree) differs."""
    h, p, g = operands(m, f, seed=1, saturated=True)
    (d_h, d_p), (ref_h, ref_p) = both(h, p, g)
    np.testing.assert_array_equal(np.asarray(d_p), np.asarray(ref_p))
    np.testing.assert_array_equal(np.asarray(d_h, F32), np.asarray(ref_h, F32))
    lanes = ordered.LANES
    try:
        ordered.LANES = 64
        _, other_p = weighted_activation_backward(h, p, g, "silu", True, impl="xla")
    finally:
        ordered.LANES = lanes
    assert not np.array_equal(np.asarray(other_p), np.asarray(ref_p))


def test_row_sums_take_the_reference_tree(interpret):
    assert_reference_tree(70, 768)


def forward(h, p, impl, **kw):
    return weighted_activation_forward(h, p, "silu", True, impl=impl, **kw)


def assert_forward_is_the_reference(m, f, seed):
    """The kernel's a is XLA's bits. Control: rounding twice (silu(gate) * up rounded to bf16
    before the product with p) differs somewhere."""
    h, p, _ = operands(m, f, seed=seed)
    a, ref = forward(h, p, "pallas"), forward(h, p, "xla")
    assert a.dtype == BF16 and a.shape == (m, f)
    np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(ref, F32))
    gate, up = jnp.split(h.astype(F32), 2, axis=1)
    twice = ((jax.nn.silu(gate) * up).astype(BF16).astype(F32) * p[:, None]).astype(BF16)
    assert not np.array_equal(np.asarray(twice, F32), np.asarray(ref, F32))


def test_forward_kernel_is_the_reference(interpret):
    assert_forward_is_the_reference(70, 512, seed=4)


def test_forward_kernel_in_fp32(interpret):
    """fp32 h (two ring slots): the kernel's a is the reference's, a bf16 gate's silu in
    every fp32 bit (the first 16 rows of `fp32_silu_cases`)."""
    h, p = fp32_silu_cases()
    h, p = h[:16], p[:16]
    a = forward(h, p, "pallas")
    assert a.dtype == F32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(forward(h, p, "xla")))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_only_the_live_rows_are_computed_forward(interpret, monkeypatch, impl):
    """The forward with live_rows: the full call's bits below it; the kernel leaves the row tiles
    past them unwritten (NaN in the interpreter), the reference fills the rows past the count
    (DEAD_ROW_FILL = NaN). Control: without the count no row is NaN."""
    from jaxmoe.ops import live_rows as live_rows_module
    from jaxmoe.ops.pallas.activation_tiles import ROWS

    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    m, f, live = 70, 256, 37
    h, p, _ = operands(m, f, seed=5)
    a, full = forward(h, p, impl, live_rows=jnp.int32(live)), forward(h, p, impl)
    np.testing.assert_array_equal(np.asarray(a[:live], F32), np.asarray(full[:live], F32))
    dead = -(-live // ROWS) * ROWS if impl == "pallas" else live
    assert np.all(np.isnan(np.asarray(a[dead:], F32)))
    assert not np.any(np.isnan(np.asarray(full, F32)))
    with pytest.raises(ValueError, match="live_rows"):
        forward(h, p, impl, live_rows=jnp.float32(3))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_only_the_live_rows_are_computed(interpret, monkeypatch, impl):
    """live_rows: the rows below it equal the full call's bits; the kernel leaves the row tiles
    past them unwritten (the interpreter's NaN; a ragged last tile is computed whole), the
    reference fills every row past the count (DEAD_ROW_FILL = NaN). Control: without the count
    no row is NaN."""
    from jaxmoe.ops import live_rows as live_rows_module
    from jaxmoe.ops.pallas.activation_tiles import ROWS

    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    m, f, live = 70, 256, 37
    h, p, g = operands(m, f, seed=3)
    run = lambda **kw: weighted_activation_backward(h, p, g, "silu", True, impl=impl, **kw)
    (d_h, d_p), (full_h, full_p) = run(live_rows=jnp.int32(live)), run()
    np.testing.assert_array_equal(np.asarray(d_h[:live], F32), np.asarray(full_h[:live], F32))
    np.testing.assert_array_equal(np.asarray(d_p[:live]), np.asarray(full_p[:live]))
    dead = -(-live // ROWS) * ROWS if impl == "pallas" else live
    assert np.all(np.isnan(np.asarray(d_h[dead:], F32))) and np.all(np.isnan(d_p[dead:]))
    assert not np.any(np.isnan(np.asarray(full_h, F32))) and not np.any(np.isnan(full_p))
    with pytest.raises(ValueError, match="live_rows"):
        run(live_rows=jnp.float32(3))


def test_what_the_kernels_take():
    h, p, g = operands(16, 256)
    call = (h.shape, h.dtype, g.shape, g.dtype)
    [kernel] = registry.kernels("weighted_activation_backward")
    assert kernel.problem(*call, "silu", True) is None
    assert "SwiGLU" in kernel.problem(*call, "gelu", True)
    assert "SwiGLU" in kernel.problem(*call, "silu", False)
    [forward_kernel] = registry.kernels("weighted_activation_forward")
    assert forward_kernel.problem(h.shape, h.dtype, "silu", True) is None
    assert "SwiGLU" in forward_kernel.problem(h.shape, h.dtype, "gelu", True)
    assert forward_kernel.problem(h.shape, F32, "silu", True) is None
    assert "bfloat16 or float16 or float32" in forward_kernel.problem(
        h.shape, jnp.float64, "silu", True
    )
    assert "bfloat16 or float16" in kernel.problem(h.shape, F32, g.shape, F32, "silu", True)
    with pytest.raises(ValueError, match="SwiGLU"):
        weighted_activation_backward(h, p, g, "gelu", True, impl="pallas")
    with pytest.raises(ValueError, match="SwiGLU"):
        weighted_activation_forward(h, p, "gelu", True, impl="pallas")
    h2, p2, g2 = operands(16, 96)
    with pytest.raises(ValueError, match="multiple of 256"):
        weighted_activation_backward(h2, p2, g2, "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="multiple of 256"):
        forward(h2, p2, "pallas")
    with pytest.raises(ValueError, match="one dtype"):
        weighted_activation_backward(h, p, g.astype(jnp.float16), "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="probs"):
        weighted_activation_backward(h, p[:4], g, "silu", True, impl="xla")
    with pytest.raises(ValueError, match="probs"):
        forward(h, p[:4], "xla")


@pytest.mark.gpu
def test_gpu_kernel_on_hardware():
    """On an H100/H200 at a layer's size (dsv3_ep8's F, a ragged last row tile): close to the
    reference (`assert_close_to_reference`); with exact products bitwise the reference's, and the
    reference with 64 lanes (control) differs; with a live row count, the full call's bits on
    its rows."""
    h, p, g = operands(4100, 2048, seed=2)
    (d_h, d_p), (ref_h, ref_p) = both(h, p, g)
    assert_close_to_reference(h, p, g, d_h, d_p, ref_h, ref_p)
    assert_reference_tree(4100, 2048)
    live = 1500  # a live row count: its rows the full call's bits
    counted_h, counted_p = weighted_activation_backward(
        h, p, g, "silu", True, live_rows=jnp.int32(live), impl="pallas"
    )
    np.testing.assert_array_equal(np.asarray(counted_h[:live], F32), np.asarray(d_h[:live], F32))
    np.testing.assert_array_equal(np.asarray(counted_p[:live]), np.asarray(d_p[:live]))


def every_finite_bf16(rows_of: int):
    """Every finite bf16 value once, as [M, rows_of] (M = 65280 / rows_of), in bit order."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(jnp.bfloat16)
    finite = values[np.isfinite(values.astype(np.float32))]
    return jnp.asarray(finite.reshape(-1, rows_of))


def fp32_silu_cases():
    """(h [M, 512] fp32, p [M]): every finite bf16 value as a gate (in bit order, 256 a row)
    with up = 1 and p = 1, so that a = silu(gate) in fp32, every bit of the sigmoid exposed."""
    gate = every_finite_bf16(256).astype(F32)
    return jnp.concatenate([gate, jnp.ones_like(gate)], axis=1), jnp.ones(gate.shape[:1], F32)


@pytest.mark.gpu
def test_gpu_forward_on_hardware():
    """On an H100/H200 the forward kernel gives XLA's bits: in fp32 for every finite bf16 gate
    value (`fp32_silu_cases`: the fp32 sigmoid itself, which the bf16 layer rounds), in bf16 with
    random up and p (8 draws) and at a layer's size (dsv3_ep8's F, a ragged last row tile,
    `assert_forward_is_the_reference` with its control); with a live row count, the full call's
    bits on its rows. This is what lets "auto" take XLA's fusion over every row and the kernel
    with a live row count."""
    h, p = fp32_silu_cases()
    np.testing.assert_array_equal(np.asarray(forward(h, p, "pallas")), forward(h, p, "xla"))
    gate = every_finite_bf16(256)
    for seed in range(8):
        ku, kp = jax.random.split(jax.random.key(seed))
        up = jax.random.normal(ku, gate.shape, BF16) * 4
        h = jnp.concatenate([gate, up], axis=1)
        p = jax.random.uniform(kp, gate.shape[:1], F32)
        a, ref = forward(h, p, "pallas"), forward(h, p, "xla")
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(ref, F32))
    assert_forward_is_the_reference(4100, 2048, seed=6)
    h, p, _ = operands(4100, 2048, seed=6)
    live = 1500
    counted = forward(h, p, "pallas", live_rows=jnp.int32(live))
    full = forward(h, p, "pallas")
    np.testing.assert_array_equal(np.asarray(counted[:live], F32), np.asarray(full[:live], F32))


@pytest.mark.parametrize("shape", ["qwen3_30b", "mixtral", "dsv3_ep8"])
def test_lowering_at_real_shapes(shape):
    """Pallas -> Mosaic GPU lowering on CPU at the layer sizes (TMA boxes, SMEM, layouts), both
    kernels, with and without a live row count."""
    from jaxmoe.shapes import SHAPES

    config = SHAPES[shape].config
    m, f = SHAPES[shape].num_tokens * config.top_k, config.ffn_hidden_size
    s = jax.ShapeDtypeStruct
    fn = lambda h, p, g, live: weighted_activation_backward(  # noqa: E731
        h, p, g, "silu", True, live_rows=live, impl="pallas"
    )
    forward_fn = lambda h, p, live: forward(h, p, "pallas", live_rows=live)  # noqa: E731
    for live in (None, s((), jnp.int32)):
        jax.jit(fn).trace(s((m, 2 * f), BF16), s((m,), F32), s((m, f), BF16), live).lower(
            lowering_platforms=("cuda",)
        )
        for dtype in (BF16, F32):
            jax.jit(forward_fn).trace(s((m, 2 * f), dtype), s((m,), F32), live).lower(
                lowering_platforms=("cuda",)
            )
