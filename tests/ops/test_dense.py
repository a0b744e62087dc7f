"""`jaxmoe.ops.dense`, the token-row matmul: the kernel path (CPU interpreter, race detector on)
against the XLA reference, batch invariance of outputs and input gradients with a negative
control, and the exact fp32 gradient split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops import dense, gmm, tgmm
from jaxmoe.ops.dense import _row_chunks, bf16_pieces
from jaxmoe.ordered import sum_in_order

from bitwise import assert_bitwise, differs
from jaxprs import equations

F32, BF16 = jnp.float32, jnp.bfloat16


def operands(t, k, n, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (t, k), F32).astype(BF16)
    w = (jax.random.normal(keys[1], (k, n), F32) / np.sqrt(k)).astype(BF16)
    bias = jax.random.normal(keys[2], (n,), F32)
    dy = jax.random.normal(keys[3], (t, n), F32)
    return x, w, bias, dy


def value_and_grads(x, w, bias, dy, out_dtype, impl):
    def loss(x, w, bias):
        y = dense(x, w, bias, out_dtype=out_dtype, impl=impl)
        return jnp.sum(y.astype(F32) * dy), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, bias)
    return y, grads


def float64_grads(x, w, dy):
    """(d x, d w) of sum((x @ w) * dy) in float64."""
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    return dy64 @ w64.T, x64.T @ dy64


@pytest.mark.parametrize(
    "t,k,n,out_dtype", [(37, 128, 16, F32), (200, 96, 64, BF16), (1, 64, 130, BF16)]
)
def test_kernel_matches_xla(interpret, t, k, n, out_dtype):
    """Same function on both paths: fp32 accumulation of exact bf16 products, so outputs differ
    only by accumulation order (a few fp32 ulps; at most one ulp after a bf16 rounding), and
    gradients are within fp32 accumulation error of float64 (fp32 outputs: the gradient is
    split exactly into bf16 pieces) or of the bf16-rounded gradient (bf16 outputs)."""
    x, w, bias, dy = operands(t, k, n)
    dy_cast = dy.astype(out_dtype)
    y_p, (dx_p, dw_p, db_p) = value_and_grads(x, w, bias, dy_cast, out_dtype, "pallas")
    y_x, (dx_x, dw_x, db_x) = value_and_grads(x, w, bias, dy_cast, out_dtype, "xla")
    ulp = 2.0**-23 if out_dtype == F32 else 2.0**-8
    np.testing.assert_allclose(
        np.asarray(y_p, F32), np.asarray(y_x, F32), rtol=2 * ulp, atol=k * 2.0**-24
    )
    dx_ref, dw_ref = float64_grads(x, w, dy_cast)
    for got, ref in ((dx_p, dx_ref), (dw_p, dw_ref)):
        scale = np.max(np.abs(ref))
        # One bf16 rounding of the result (2^-9 relative) plus fp32 accumulation.
        assert np.max(np.abs(np.asarray(got, np.float64) - ref)) <= 2.0**-8 * scale
    np.testing.assert_allclose(db_p, db_x, rtol=1e-6, atol=1e-6)


def test_fp32_output_gradient_keeps_fp32_precision(interpret):
    """An fp32 output's gradient (the fp32 router's) reaches d x and d w at fp32 precision: they
    are the correctly rounded bf16 of the float64 result except where fp32 accumulation error
    straddles a rounding boundary (rare). Negative control: rounding the gradient to bf16 first
    (what a bf16-only backward would do) misses the correct rounding in many elements."""
    x, w, _, dy = operands(64, 128, 64, seed=3)
    dx_ref, dw_ref = float64_grads(x, w, dy)
    _, (dx, dw, _) = value_and_grads(x, w, None, dy, F32, "pallas")
    dx_rounded_grad, dw_rounded_grad = float64_grads(x, w, dy.astype(BF16))

    def miss_fraction(got, ref):
        return np.mean(
            np.asarray(got).view(np.uint16)
            != np.asarray(ref.astype(np.float32)).astype(BF16).view(np.uint16)
        )

    assert miss_fraction(dx, dx_ref) <= 0.01 and miss_fraction(dw, dw_ref) <= 0.01
    assert miss_fraction(dx_rounded_grad.astype(BF16), dx_ref) >= 0.1
    assert miss_fraction(dw_rounded_grad.astype(BF16), dw_ref) >= 0.1


def testbf16_pieces_add_up_exactly():
    g = np.concatenate(
        [np.random.default_rng(0).standard_normal(1000) * 10.0**e for e in range(-20, 21, 5)]
    ).astype(np.float32)
    g = np.concatenate([g, np.float32([0.0, -0.0, 1.0, 3.4e38, -3.4028235e38, -1.2e-30])])
    pieces = bf16_pieces(jnp.asarray(g), BF16)
    assert len(pieces) == 3 and all(p.dtype == BF16 for p in pieces)
    total = sum(np.asarray(p, np.float64) for p in pieces)
    np.testing.assert_array_equal(total, g.astype(np.float64))
    special = bf16_pieces(jnp.float32([np.inf, -np.inf, np.nan]), BF16)
    np.testing.assert_array_equal(np.asarray(special[0], np.float32), [np.inf, -np.inf, np.nan])
    assert not np.any(np.asarray(special[1], np.float32)) and not np.any(
        np.asarray(special[2], np.float32)
    )
    assert bf16_pieces(jnp.asarray(g, BF16), BF16)[0].dtype == BF16  # already bf16: as is


def test_rows_do_not_depend_on_the_batch(interpret):
    """D2 at the op: a token's output and input gradient are the same bits alone and in a
    batch, its output the same at another position; the weight gradient is the same bits run
    to run. (fp32 outputs run the same kernel on each bf16 piece of the gradient.)"""
    x, w, bias, dy = operands(150, 128, 64, seed=5)
    dy = dy.astype(BF16)
    y_all, (dx_all, dw_1, _) = value_and_grads(x, w, bias, dy, BF16, "pallas")
    y_one, (dx_one, _, _) = value_and_grads(x[77:78], w, bias, dy[77:78], BF16, "pallas")
    assert_bitwise(np.asarray(y_one), np.asarray(y_all)[77:78])
    assert_bitwise(np.asarray(dx_one), np.asarray(dx_all)[77:78])
    reversed_y = dense(x[::-1], w, bias, impl="pallas")
    assert_bitwise(np.asarray(reversed_y), np.asarray(y_all)[::-1])
    dw_2 = value_and_grads(x, w, bias, dy, BF16, "pallas")[1][1]
    assert_bitwise(np.asarray(dw_1), np.asarray(dw_2))


@pytest.mark.parametrize("t", [37, 150, 4096])
def test_training_step_lowers_for_hopper_at_any_row_count(t, monkeypatch):
    """Forward and gradients through Mosaic's lowering for the GPU (its TMA checks included),
    on CPU, at a decode-size and a training-size router and at row counts that are no multiple
    of 8 (the weight gradient's row windows once failed to lower there on the H200)."""
    monkeypatch.setattr("jaxmoe.ops.pallas.gmm_hopper.num_sms", lambda: 132)
    s = jax.ShapeDtypeStruct

    def loss(x, w, bias, dy):
        return jnp.sum(dense(x, w, bias, out_dtype=F32, impl="pallas") * dy)

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        s((t, 2048), BF16), s((2048, 128), BF16), s((128,), F32), s((t, 128), F32)
    ).lower(lowering_platforms=("cuda",))


def test_negative_control_reduction_order_shows_in_bits():
    """The bitwise checks above can fail: the same row summed in another K order (what a
    library GEMM may choose by row count) gives other bits."""
    x, w, _, _ = operands(64, 512, 64, seed=6)
    forward = dense(x, w, out_dtype=F32, impl="xla")
    halves = dense(x[:, :256], w[:256], out_dtype=F32, impl="xla") + dense(
        x[:, 256:], w[256:], out_dtype=F32, impl="xla"
    )
    assert differs(np.asarray(forward), np.asarray(halves))


def test_weight_gradient_chunks_cover_the_batch():
    for rows, k, n in ((8192, 2048, 128), (1, 64, 64), (600, 128, 64), (5000, 7168, 64)):
        sizes = np.asarray(_row_chunks(rows, k, n))
        assert sizes.sum() == rows and (sizes > 0).all() and (sizes[:-1] % 512 == 0).all()


def test_refuses_bad_operands():
    x, w, bias, _ = operands(8, 64, 64)
    with pytest.raises(ValueError, match="x must be"):
        dense(x, w[:32])
    with pytest.raises(TypeError, match="one floating dtype"):
        dense(x, w.astype(F32))
    with pytest.raises(ValueError, match="bias must be"):
        dense(x, w, bias[:3])
    with pytest.raises(ValueError, match="impl"):
        dense(x, w, impl="cuda")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        dense(x.astype(F32), w.astype(F32), impl="pallas")


# Integer ops that XLA runs as kernels of their own (it does not fold them on constants).
METADATA_KERNEL_OPS = {"reduce_sum", "reduce_max", "reduce_min", "cumsum", "sort", "concatenate"}


def metadata_kernel_ops(fn, *args) -> list[str]:
    """The integer-valued `METADATA_KERNEL_OPS` of fn's jaxpr and the jaxprs inside it: on the
    kernel path, tile metadata that would be computed at run time."""
    return [
        e.primitive.name
        for e in equations(jax.make_jaxpr(fn)(*args).jaxpr)
        if e.primitive.name in METADATA_KERNEL_OPS
        and all(jnp.issubdtype(v.aval.dtype, jnp.integer) for v in e.outvars)
    ]


def test_kernel_tile_metadata_is_computed_at_trace_time():
    """The one group's size and the weight gradient's row chunks are known on the host, so the
    kernels' tile metadata are constants of the executable, with no reduction left to run on
    the device (on the H200 at 64 tokens XLA ran four small kernels and a copy for them).
    Control: the same kernel with the group size traced computes them at run time."""
    x, w, bias, dy = operands(64, 128, 64)

    def step(x, w, bias):
        return jax.grad(
            lambda *a: jnp.sum(dense(*a, out_dtype=F32, impl="pallas") * dy), argnums=(0, 1, 2)
        )(x, w, bias)

    assert metadata_kernel_ops(step, x, w, bias) == []
    traced = metadata_kernel_ops(
        lambda x, w, sizes: gmm(x, w[None], sizes, impl="pallas"), x, w, np.array([64], np.int32)
    )
    assert "reduce_sum" in traced


@pytest.mark.parametrize("t", [37, 64])
def test_host_group_sizes_give_the_bits_of_traced_ones(interpret, t):
    """The kernels with their tile metadata computed at trace time (dense) give the bits of
    the same kernels with the group sizes traced (metadata computed on the device): forward,
    d x and the chunked d w, at a row count that is no multiple of 8 and a decode size."""
    x, w, _, dy = operands(t, 256, 128, seed=t)
    dy = dy.astype(BF16)
    y, vjp = jax.vjp(lambda x, w: dense(x, w, impl="pallas"), x, w)
    d_x, d_w = vjp(dy)
    chunks = _row_chunks(t, 256, 128)

    @jax.jit
    def traced(x, w, dy, one_group, chunks):
        y, vjp = jax.vjp(
            lambda x: gmm(x, w[None], one_group, impl="pallas", preferred_element_type=BF16), x
        )
        d_w = sum_in_order(tgmm(x, dy, chunks, impl="pallas", preferred_element_type=F32))
        return y, vjp(dy)[0], d_w.astype(BF16)

    for got, want in zip((y, d_x, d_w), traced(x, w, dy, np.array([t], np.int32), chunks)):
        assert_bitwise(np.asarray(got), np.asarray(want))
