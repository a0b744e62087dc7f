"""The weighted SwiGLU forward that writes the activation as its two FP8-blockwise copies
(`swiglu_quantize_hopper.py`, op `jaxmoe.ops.weighted_activation_quantize_1x128_with_transpose`)
against XLA's forward then `jaxmoe.fp8_blockwise`'s reference quantizer, bit for bit: on CPU in
Mosaic GPU interpret mode with the race detector, on the GPU when marked `gpu`; lowering at the
real shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import fp8_blockwise
from jaxmoe.ops import (
    quantize_1x128_with_transpose,
    weighted_activation_forward,
    weighted_activation_quantize_1x128_with_transpose,
)
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.swiglu_quantize_hopper import (
    weighted_swiglu_quantize_1x128_with_transpose_pallas,
)

from bitwise import assert_bitwise, differs
from quantize_inputs import normal_range, tensor

BLOCK = fp8_blockwise.BLOCK
BF16 = jnp.bfloat16
fused = weighted_swiglu_quantize_1x128_with_transpose_pallas
op = weighted_activation_quantize_1x128_with_transpose


def operands(m, f, seed, special=True):
    """(h [M, 2F] bf16, p [M]): h over many binades with specials (`tensor`), or normal-range
    values; the last 128 rows are padding as the plan makes them (h = 0, p = 0)."""
    make = tensor if special else normal_range
    h = make((m, 2 * f), jnp.float32, seed=seed).at[-BLOCK:].set(0).astype(BF16)
    p = jax.random.uniform(jax.random.key(seed), (m,)).at[-BLOCK:].set(0)
    return h, p


def reference(h, p, fmt="e4m3", twice=False):
    """Both 1 x 128 copies (host CPU) of a = weighted_activation_forward(h, p) computed on the
    default device (XLA's fusion, whose bits the kernel's arithmetic shares there); `twice`:
    the control, a rounded to h's dtype before the product with p."""
    a = forward(h, p, "silu")
    if twice:
        gate, up = jnp.split(h.astype(jnp.float32), 2, axis=1)
        a = ((jax.nn.silu(gate) * up).astype(h.dtype).astype(jnp.float32) * p[:, None]).astype(
            h.dtype
        )
    host_a = np.asarray(a)
    with jax.default_device(jax.devices("cpu")[0]):
        rowwise, transposed = (fp8_blockwise.quantize_1x128(x, 1, fmt) for x in (host_a, host_a.T))
    return (rowwise.data, rowwise.scale_inv), (transposed.data, transposed.scale_inv)


def forward(h, p, name):
    return weighted_activation_forward(h, p, name, True, impl="xla")


def check(h, p, fmt="e4m3", arithmetic="exact", **kwargs):
    """The kernel's four outputs against `reference`, bit for bit."""
    got = fused(h, p, fmt, arithmetic=arithmetic, **kwargs)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(reference(h, p, fmt))):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))
    return got


@pytest.mark.parametrize("slots", [None, 1])
def test_copies_equal_the_reference_bitwise(interpret, slots):
    """Specials, zero/denormal blocks and padding rows, over more tiles than the interpreter's
    CTAs (every ring slot reused across tiles, each CTA's warpgroups meeting on several tiles),
    with the default ring and with one slot a warpgroup. Control: the copies of a rounded twice
    (before the product with p) differ."""
    tiles = num_sms() + 3
    h, p = operands(2 * BLOCK, -(-tiles // 2) * 2 * BLOCK, seed=31)
    (data, _), (data_t, _) = check(h, p, slots=slots)
    (control, _), (control_t, _) = reference(h, p, twice=True)
    assert differs(np.asarray(data), np.asarray(control))
    assert differs(np.asarray(data_t), np.asarray(control_t))


def test_e5m2_and_float_arithmetic(interpret):
    """e5m2 with the exact arithmetic, e4m3 with the float one on normal-range values."""
    check(*operands(2 * BLOCK, 2 * BLOCK, seed=33), "e5m2")
    check(*operands(BLOCK, 2 * BLOCK, seed=34, special=False), arithmetic="float")


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_copies_of_the_live_rows(interpret, monkeypatch, impl):
    """With a live row count (the layer's: whole 128-row blocks): the full call's bits on the
    live rows; the rows past them unwritten by the kernel (NaN in the interpreter) and filled by
    the reference (DEAD_ROW_FILL = NaN). Control: without the count no scale is NaN."""
    from jaxmoe.ops import live_rows as live_rows_module

    monkeypatch.setattr(live_rows_module, "DEAD_ROW_FILL", np.nan)
    h, p = operands(3 * BLOCK, 2 * BLOCK, seed=35, special=False)
    live = 2 * BLOCK
    run = functools.partial(op, impl=impl)
    counted = run(h, p, "silu", True, live_rows=jnp.int32(live))
    full = run(h, p, "silu", True)
    for copy in full:
        assert not np.any(np.isnan(np.asarray(copy.scale_inv)))
    assert_bitwise(np.asarray(counted[0].data[:live]), np.asarray(full[0].data[:live]))
    assert_bitwise(np.asarray(counted[1].data[:, :live]), np.asarray(full[1].data[:, :live]))
    assert_bitwise(np.asarray(counted[0].scale_inv[:live]), np.asarray(full[0].scale_inv[:live]))
    assert np.all(np.isnan(np.asarray(counted[0].scale_inv[live:])))
    assert np.all(np.isnan(np.asarray(counted[1].scale_inv[:, live // BLOCK :])))


def test_op_falls_back_and_refuses_clearly(interpret):
    """`jaxmoe.ops.weighted_activation_quantize_1x128_with_transpose`: "pallas" equals "xla",
    which is the forward then `quantize_1x128_with_transpose`; "auto" falls back for what the
    kernel cannot take (another activation, fp32 h, rows not a multiple of 128, F not one of
    256); "pallas" refuses it with the reason."""
    h, p = operands(2 * BLOCK, 2 * BLOCK, seed=36, special=False)
    want = quantize_1x128_with_transpose(forward(h, p, "silu"), impl="xla")
    for impl in ("pallas", "xla", "auto"):
        got = op(h, p, "silu", True, impl=impl)
        assert [t.block_axes for t in got] == [(1,), (1,)] and got[0].fmt == "e4m3"
        for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_bitwise(np.asarray(ours), np.asarray(theirs))
    gelu = op(h, p, "gelu", True)
    assert_bitwise(
        np.asarray(gelu[1].data),
        np.asarray(quantize_1x128_with_transpose(forward(h, p, "gelu"))[1].data),
    )
    fp32_h = h.astype(jnp.float32)
    assert_bitwise(
        np.asarray(op(fp32_h, p, "silu", True)[0].data),
        np.asarray(quantize_1x128_with_transpose(forward(fp32_h, p, "silu"))[0].data),
    )
    narrow_h = jnp.concatenate([h[:, :BLOCK], h[:, 2 * BLOCK : 3 * BLOCK]], axis=1)
    assert op(narrow_h, p, "silu", True)[1].shape == (BLOCK, 2 * BLOCK)
    ragged_h, ragged_p = h[:200], p[:200]
    assert op(ragged_h, ragged_p, "silu", True)[1].shape == (2 * BLOCK, 200)
    with pytest.raises(ValueError, match="SwiGLU"):
        op(h, p, "gelu", True, impl="pallas")
    for bad_h, bad_p in ((ragged_h, ragged_p), (narrow_h, p)):
        with pytest.raises(ValueError, match="M a multiple of 128 and F of 256"):
            op(bad_h, bad_p, "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="bfloat16"):
        op(fp32_h, p, "silu", True, impl="pallas")
    with pytest.raises(ValueError, match="probs"):
        op(h, p[:5], "silu", True)


@pytest.mark.gpu
@pytest.mark.parametrize("arithmetic", ["float", "exact"])
def test_gpu_copies_equal_the_reference_bitwise(arithmetic):
    """On the GPU, specials and padding rows, both formats, the default ring and one slot: the
    copies of XLA's a (which the forward kernel's bits equal there); with a live row count, the
    full call's bits on its rows."""
    h, p = operands(4096, 2048, seed=37)
    for fmt in ("e4m3", "e5m2"):
        check(h, p, fmt, arithmetic)
    check(h, p, "e4m3", arithmetic, slots=1)
    full = check(h, p, "e4m3", arithmetic)
    live = 1500
    (data, _), (data_t, _) = full
    (data_c, _), (data_t_c, _) = fused(h, p, arithmetic=arithmetic, live_rows=jnp.int32(live))
    assert_bitwise(np.asarray(data_c[:live]), np.asarray(data[:live]))
    assert_bitwise(np.asarray(data_t_c[:, :live]), np.asarray(data_t[:, :live]))
