"""The weighted SwiGLU backward that writes d h as its two FP8-blockwise copies
(`swiglu_backward_quantize_hopper.py`, op `jaxmoe.ops.weighted_activation_backward_quantize_1x128_with_transpose`)
against the two kernels it fuses run in turn (the activation backward's d h, then the two-copy
quantize of it) and the backward's probability gradient, bit for bit: on CPU in Mosaic GPU
interpret mode with the race detector, on the GPU when marked `gpu`; lowering at the real
shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import fp8_blockwise
from jaxmoe.ops import (
    quantize_1x128_with_transpose,
    weighted_activation_backward,
    weighted_activation_backward_quantize_1x128_with_transpose,
)
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.activation_backward_hopper import weighted_swiglu_backward_pallas
from jaxmoe.ops.pallas.quantize_transpose_hopper import quantize_1x128_with_transpose_pallas
from jaxmoe.ops.pallas.swiglu_backward_quantize_hopper import (
    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas,
)

from bitwise import assert_bitwise, differs
from quantize_inputs import normal_range, tensor

BLOCK = fp8_blockwise.BLOCK
BF16 = jnp.bfloat16
fused = weighted_swiglu_backward_quantize_1x128_with_transpose_pallas
op = weighted_activation_backward_quantize_1x128_with_transpose


def operands(m, f, seed, special=True):
    """(h [M, 2F], p [M], g [M, F]) bf16 h and g over many binades with specials (`tensor`),
    or normal-range values; the last 128 rows are padding as the plan makes them (h = 0,
    p = 0, g = 0)."""
    make = tensor if special else normal_range
    h = make((m, 2 * f), jnp.float32, seed=seed).at[-BLOCK:].set(0).astype(BF16)
    g = make((m, f), jnp.float32, seed=seed + 1).at[-BLOCK:].set(0).astype(BF16)
    p = jax.random.uniform(jax.random.key(seed), (m,)).at[-BLOCK:].set(0)
    return h, p, g


def two_kernels(h, p, g, fmt="e4m3", arithmetic="exact"):
    """What the fused kernel replaces: the backward kernel's (d h, partial sums), then the
    two-copy quantize kernel of d h."""
    d_h, partials = weighted_swiglu_backward_pallas(h, p, g)
    return quantize_1x128_with_transpose_pallas(d_h, fmt, arithmetic=arithmetic), partials


def check(h, p, g, fmt="e4m3", arithmetic="exact", **kwargs):
    """The fused kernel's copies bitwise the two kernels', and its partial sums (two tree
    levels over a 128-column block's chunks) added pairwise bitwise the backward kernel's
    (three levels over 256 columns)."""
    copies, partials = fused(h, p, g, fmt, arithmetic=arithmetic, **kwargs)
    want_copies, want_partials = two_kernels(h, p, g, fmt, arithmetic)
    for ours, theirs in zip(jax.tree.leaves(copies), jax.tree.leaves(want_copies), strict=True):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))
    pairs = np.asarray(partials).reshape(h.shape[0], -1, 2, 32)
    assert_bitwise(
        (pairs[:, :, 0] + pairs[:, :, 1]).reshape(h.shape[0], -1), np.asarray(want_partials)
    )
    return copies, partials


@pytest.mark.parametrize("slots", [None, 1])
def test_copies_and_partial_sums_equal_the_two_kernels_bitwise(interpret, slots):
    """Specials, zero and padding rows in h and g, over more tiles than the interpreter's CTAs
    (every ring slot reused across tiles, each CTA's warpgroups meeting on several tiles), with
    the default ring and with one slot a warpgroup. Control: the copies of d h left in fp32 (not
    rounded to bf16 before the quantize) differ."""
    tiles = num_sms() + 3
    h, p, g = operands(2 * BLOCK, -(-tiles // 4) * 2 * BLOCK, seed=41)
    (rowwise, transposed), _ = check(h, p, g, slots=slots)
    d_h_fp32 = jax.vjp(
        lambda h: jax.nn.silu(h[:, : g.shape[1]]) * h[:, g.shape[1] :],
        h.astype(jnp.float32),
    )[1](g.astype(jnp.float32) * p[:, None])[0]
    control = quantize_1x128_with_transpose(d_h_fp32, impl="xla")
    assert differs(np.asarray(rowwise[0]), np.asarray(control[0].data))
    assert differs(np.asarray(transposed[0]), np.asarray(control[1].data))


def test_e5m2_and_float_arithmetic(interpret):
    """e5m2 copies, and "float" arithmetic on normal-range values."""
    check(*operands(2 * BLOCK, 2 * BLOCK, seed=42), "e5m2")
    check(*operands(2 * BLOCK, 2 * BLOCK, seed=43, special=False), arithmetic="float")


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_op_on_the_live_rows(interpret, monkeypatch, impl):
    """With a live row count (whole 128-row blocks, as the layer's): the full call's bits on
    the live rows; the rows past them unwritten by the kernel (NaN in the interpreter) and
    filled by the reference (DEAD_ROW_FILL = NaN). Control: without the count no scale is NaN."""
    from jaxmoe.ops import live_rows as live_rows_module

    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    h, p, g = operands(3 * BLOCK, 2 * BLOCK, seed=44, special=False)
    live = 2 * BLOCK
    run = functools.partial(op, impl=impl)
    counted = run(h, p, g, "silu", True, live_rows=jnp.int32(live))
    full = run(h, p, g, "silu", True)
    for copy in full[:2]:
        assert not np.any(np.isnan(np.asarray(copy.scale_inv)))
    assert_bitwise(np.asarray(counted[0].data[:live]), np.asarray(full[0].data[:live]))
    assert_bitwise(np.asarray(counted[1].data[:, :live]), np.asarray(full[1].data[:, :live]))
    assert_bitwise(np.asarray(counted[0].scale_inv[:live]), np.asarray(full[0].scale_inv[:live]))
    assert_bitwise(np.asarray(counted[2][:live]), np.asarray(full[2][:live]))
    assert np.all(np.isnan(np.asarray(counted[0].scale_inv[live:])))
    assert np.all(np.isnan(np.asarray(counted[1].scale_inv[:, live // BLOCK :])))


def test_op_falls_back_and_refuses_clearly(interpret):
    """`jaxmoe.ops.weighted_activation_backward_quantize_1x128_with_transpose`: "pallas" equals
    the backward's kernel then the quantize (and its probability gradient the backward's,
    bitwise); "xla" is the backward then `quantize_1x128_with_transpose`; "auto" falls back
    for what the kernel cannot take (another activation, rows or F not multiples of 128, fp16);
    "pallas" refuses it with the reason."""
    h, p, g = operands(2 * BLOCK, 2 * BLOCK, seed=45, special=False)
    rowwise, transposed, d_p = op(h, p, g, "silu", True, impl="pallas")
    assert [t.block_axes for t in (rowwise, transposed)] == [(1,), (1,)] and rowwise.fmt == "e4m3"
    (want_rowwise, want_transposed), _ = two_kernels(h, p, g, arithmetic=None)
    for ours, theirs in ((rowwise, want_rowwise), (transposed, want_transposed)):
        assert_bitwise(np.asarray(ours.data), np.asarray(theirs[0]))
        assert_bitwise(np.asarray(ours.scale_inv), np.asarray(theirs[1]))
    _, want_d_p = weighted_activation_backward(h, p, g, "silu", True, impl="pallas")
    assert_bitwise(np.asarray(d_p), np.asarray(want_d_p))
    d_h, d_p_xla = weighted_activation_backward(h, p, g, "silu", True, impl="xla")
    want = quantize_1x128_with_transpose(d_h, impl="xla")
    got = op(h, p, g, "silu", True, impl="xla")
    for ours, theirs in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))
    assert_bitwise(np.asarray(got[2]), np.asarray(d_p_xla))
    gelu_h = op(h, p, g, "gelu", True)[0]
    want_gelu = weighted_activation_backward(h, p, g, "gelu", True)[0]
    assert_bitwise(
        np.asarray(gelu_h.data), np.asarray(quantize_1x128_with_transpose(want_gelu)[0].data)
    )
    assert op(h[:200], p[:200], g[:200], "silu", True)[1].shape == (4 * BLOCK, 200)
    assert op(h[:, 128:384], p, g[:, :128], "silu", True)[1].shape == (2 * BLOCK, 2 * BLOCK)
    with pytest.raises(ValueError, match="SwiGLU"):
        op(h, p, g, "gelu", True, impl="pallas")
    with pytest.raises(ValueError, match="M a multiple of 128 and F of 256"):
        op(h[:200], p[:200], g[:200], "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="M a multiple of 128 and F of 256"):
        op(h[:, 128:384], p, g[:, :128], "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="bfloat16"):
        op(h.astype(jnp.float16), p, g.astype(jnp.float16), "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="g"):
        op(h, p, g[:, :64], "silu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_copies_and_partial_sums_equal_the_two_kernels_bitwise(arithmetic):
    """On the GPU: specials and padding rows, both formats, one and three ring slots; with a
    live row count, the full call's bits on its rows."""
    h, p, g = operands(4096, 2048, seed=46)
    for fmt in ("e4m3", "e5m2"):
        check(h, p, g, fmt, arithmetic)
    check(h, p, g, "e4m3", arithmetic, slots=1)
    full = check(h, p, g, "e4m3", arithmetic)
    live = 1536
    counted = fused(h, p, g, arithmetic=arithmetic, live_rows=jnp.int32(live))
    (data, _), (data_t, _) = full[0]
    (data_c, _), (data_t_c, _) = counted[0]
    assert_bitwise(np.asarray(data_c[:live]), np.asarray(data[:live]))
    assert_bitwise(np.asarray(data_t_c[:, :live]), np.asarray(data_t[:, :live]))
    assert_bitwise(np.asarray(counted[1][:live]), np.asarray(full[1][:live]))
