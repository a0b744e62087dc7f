"""The MoE layer with MXFP8 experts, dispatch and combine gradient (XLA reference path).

* gradients equal a "dequantize-then-bf16" reference written here from TE's recipe (bitwise);
  every GEMM of `mxfp8_gmm` stays within its elementwise MXFP8 error bound; the layer stays
  within a first-order error estimate of the bf16 layer;
* D3 (training forward == inference forward) and D2 (batch invariance) in MXFP8, each with a
  negative control that must find a difference;
* the three options alone and combined, bad input, per-layer precision, the demo.
Bits are compared through integer views (`assert_bitwise`).
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe import MoE, MoEConfig, demo, mxfp8
from jaxmoe.dispatch import LocalRoute, combine
from jaxmoe.experts import bias_per_row, weighted_activation
from jaxmoe.ops import gmm, mxfp8_gmm, quantize_mxfp8_weights, tgmm
from jaxmoe.ordered import broadcast_in_order

from bitwise import assert_bitwise, differs

H = F = 32
BF16, F32 = jnp.bfloat16, jnp.float32
MXFP8_ALL = dict(expert_precision="mxfp8", dispatch_dtype="mxfp8", combine_bwd_dtype="mxfp8")
BASE = MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=F, expert_row_alignment=32)
ALL = BASE.replace(**MXFP8_ALL)
E4M3_HALF_ULP = 2.0**-4  # relative rounding error bound of E4M3 (3 mantissa bits), normals
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # absolute, in units of the block scale


def make(config, seed=0, *, spread=True):
    """Same parameters for every precision option (they do not change the parameter shapes).

    spread: expert weight rows (K) and columns (N) are scaled by 2^r_k * 2^c_n, r, c random in
    -5..5: blocks along K then see rows of very different magnitude and blocks along N columns,
    so a weight quantized along the wrong axis changes the small rows' or columns' products
    (see `tokens`)."""
    model = MoE(config, H, param_dtype=BF16, init_std=0.2, rngs=nnx.Rngs(seed))
    if not spread:
        return model
    rng = np.random.default_rng(seed)
    for kernel in (model.experts.fc1_kernel, model.experts.fc2_kernel):
        _, k, n = kernel.shape
        scale = 2.0 ** (rng.integers(-5, 6, (k, 1)) + rng.integers(-5, 6, (1, n)))
        kernel[...] = (kernel[...].astype(F32) * scale).astype(BF16)
    return model


COLUMN_SCALE = 2.0 ** np.random.default_rng(0).integers(-4, 5, H)


def tokens(n, seed=1, *, spread=True):
    """N(0, 1) (drawn in fp32) in bf16; with `spread`, times 2^r_t per row (r cycling through
    -6..6) and a fixed 2^c_h per column (c in -4..4).

    With power-of-two block scales, deq(q(x)) is x rounded to 4 significant bits whatever the
    block, except for elements far below their block's amax (E4M3 subnormals). Spread row and
    column magnitudes make rowwise and token-axis blocks round differently, so that a wrong
    blocking axis, or a copy made from the wrong tensor, shows up in the bits."""
    x = jax.random.normal(jax.random.key(seed), (n, H), F32)
    if spread:
        x = x * 2.0 ** (np.arange(n) % 13 - 6)[:, None] * COLUMN_SCALE
    return x.astype(BF16)


def cotangent_of(n, seed=2, *, spread=True):
    """An output gradient (fp32 values of bf16 numbers), drawn like `tokens`."""
    return tokens(n, seed, spread=spread).astype(F32)


def qdq(x, axis):
    """x as an MXFP8 GEMM operand: quantized with blocks along `axis`, dequantized (exactly)."""
    return mxfp8.dequantize(mxfp8.quantize(x, axis=axis), x.dtype)


@nnx.jit
def inference(model, x):
    return model(x)[0]


@nnx.jit
def stages_of(model, x):
    return model.forward_with_stages(x)[2]


def _linear_loss(forward, model, x, cotangent):
    y = forward(model, x)
    return jnp.sum(y.astype(F32) * cotangent), y


@nnx.jit
def training(model, x, cotangent):
    """(y, (model grads, x grad)) of sum(y * cotangent): the training forward and its VJP."""
    (_, y), grads = nnx.value_and_grad(
        functools.partial(_linear_loss, lambda m, x: m(x)[0]), argnums=(0, 1), has_aux=True
    )(model, x, cotangent)
    return y, grads


def grad_leaves(grads):
    model_grads, x_grad = grads
    return jax.tree.leaves(nnx.state(model_grads)) + [x_grad]


def grads_by_name(grads) -> dict[str, np.ndarray]:
    """{parameter path: gradient} and "x": the input's."""
    model_grads, x_grad = grads
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model_grads))[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat} | {"x": np.asarray(x_grad)}


# ------------------------------------------------------------------------ reference gradients
@jax.custom_vjp
def reference_gmm(lhs, rhs, group_sizes):
    """A grouped GEMM of MXFP8 operands (TE's recipe, docs/numerics.md, "MXFP8"), written out:
    each operand is quantized from its bf16 tensor along the GEMM's contraction dim and
    dequantized; bf16 GEMMs accumulate in fp32. Output fp32."""
    return gmm(qdq(lhs, 1), qdq(rhs, 1), group_sizes, impl="xla", preferred_element_type=F32)


def _reference_gmm_bwd(residuals, grad):
    lhs, rhs, sizes = residuals
    grad = grad.astype(lhs.dtype)
    d_lhs = gmm(
        qdq(grad, 1),
        qdq(rhs, 2),
        sizes,
        transpose_rhs=True,
        impl="xla",  # dgrad
        preferred_element_type=lhs.dtype,
    )
    d_rhs = tgmm(
        qdq(lhs, 0),
        qdq(grad, 0),
        sizes,
        impl="xla",  # wgrad
        preferred_element_type=rhs.dtype,
    )
    return d_lhs, d_rhs, None


reference_gmm.defvjp(
    lambda lhs, rhs, sizes: (reference_gmm(lhs, rhs, sizes), (lhs, rhs, sizes)), _reference_gmm_bwd
)


@jax.custom_vjp
def wire_copy(rows):
    """The dispatched rows through rowwise MXFP8 (what only the MXFP8 copy on the wire gives the
    experts); the gradient straight through."""
    return qdq(rows, 1)


wire_copy.defvjp(lambda rows: (qdq(rows, 1), None), lambda _, grad: (grad,))


@jax.custom_vjp
def gradient_wire_copy(rows):
    """The identity, whose gradient goes through rowwise MXFP8 (what only the MXFP8 copy of the
    output gradient on the wire gives the experts)."""
    return rows


gradient_wire_copy.defvjp(lambda rows: (rows, None), lambda _, grad: (qdq(grad, 1),))


def reference_forward(model, x):
    """The layer's routed experts (no shared expert) with `reference_gmm` and plain autodiff:
    the bf16 layer with MXFP8 GEMMs swapped in, the dequantized wire copies of the rows
    (dispatch_dtype "mxfp8") and of their output gradient (combine_bwd_dtype "mxfp8") in place of
    the bf16 ones (the weight gradients quantize those columnwise). It shares the layer's
    routing, plan, dispatch, combine and fixed-order bias and probability sums on purpose, to
    isolate the MXFP8 GEMM wiring of the gradients; the forward is checked with nothing shared
    in tests/layer/test_layer_reference.py
    (`test_mxfp8_layer_against_the_loop_reference_with_independent_quantization`)."""
    config, experts = model.config, model.experts
    _, routing = model.router(x)
    plan = jaxmoe.make_plan(routing, config)
    rows, row_probs = jaxmoe.dispatch(x, plan), jaxmoe.gather_slots(routing.probs, plan)
    if config.dispatch_dtype == "mxfp8":
        rows = wire_copy(rows)
    h = reference_gmm(rows, experts.fc1_kernel[...], plan.group_sizes)
    if config.add_bias_linear:
        h = h + bias_per_row(experts.fc1_bias[...], LocalRoute(plan), model.gmm_impl)
    a = weighted_activation(h.astype(BF16), row_probs, config)
    out = reference_gmm(a, experts.fc2_kernel[...], plan.group_sizes).astype(BF16)
    if config.add_bias_linear:
        bias = bias_per_row(experts.fc2_bias[...], LocalRoute(plan), model.gmm_impl)
        bias = bias * broadcast_in_order(row_probs.astype(F32)[:, None], bias.shape)
        out = (out.astype(F32) + bias).astype(BF16)
    if config.combine_bwd_dtype == "mxfp8":
        out = gradient_wire_copy(out)
    return combine(out, plan)


@nnx.jit
def reference_training(model, x, cotangent):
    (_, y), grads = nnx.value_and_grad(
        functools.partial(_linear_loss, reference_forward), argnums=(0, 1), has_aux=True
    )(model, x, cotangent)
    return y, grads


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_equal_the_dequantize_then_bf16_reference_bitwise(bias):
    """The layer's output and every gradient (router, fc1, fc2, biases, input) equal the
    reference's, bitwise. The layer quantizes tokens and the output gradient before their
    dispatch and fuses fc2 with the combine; the reference quantizes every operand where the
    GEMM reads it. Both run the same gmm/tgmm on the same operand bits, so a wrong blocking axis,
    a copy made from the wrong tensor (e.g. wgrad's from the bf16 tokens rather than the wire
    copy), or a misplaced rounding shows up as a bit difference."""
    model, x, ct = make(ALL.replace(add_bias_linear=bias)), tokens(48), cotangent_of(48)
    if bias:
        rng = np.random.default_rng(1)
        for b in (model.router.bias, model.experts.fc1_bias, model.experts.fc2_bias):
            b[...] = jnp.asarray(rng.standard_normal(b.shape) * 0.1, BF16)
    y, grads = training(model, x, ct)
    y_ref, grads_ref = reference_training(model, x, ct)
    assert_bitwise(y, y_ref)
    for got, want in zip(grad_leaves(grads), grad_leaves(grads_ref)):
        assert_bitwise(got, want)
    # Negative control: the bf16 layer's gradients are not these bits.
    _, grads_bf16 = training(make(BASE), x, ct)
    assert differs(grads_bf16[0].experts.fc1_kernel[...], grads[0].experts.fc1_kernel[...])


def test_differentiating_the_fc2_output_stage_adds_to_the_row_gradient():
    """With a cotangent on the fc2_output stage itself, fc2's wgrad sees dispatch(dy) + that
    cotangent (quantized on the compute side, since the wire copy no longer covers it)."""
    model, x, ct = make(ALL), tokens(40), cotangent_of(40)

    def loss(model, x):
        y, _, stages = model.forward_with_stages(x)
        out = stages.fc2_output
        return (
            jnp.sum(y.astype(F32) * ct) + jnp.sum(out.astype(F32)),
            (stages.activation, stages.plan),
        )

    grads, (a, plan) = nnx.jit(nnx.grad(loss, has_aux=True))(model, x)
    d_rows = jaxmoe.dispatch(ct.astype(BF16), plan) + jnp.ones((plan.num_rows, H), BF16)
    want = tgmm(
        qdq(a, 0), qdq(d_rows, 0), plan.group_sizes, impl="xla", preferred_element_type=BF16
    )
    assert_bitwise(grads.experts.fc2_kernel[...], want)


# ------------------------------------------------------------------------ error bounds
def _operand_error_bound(x, axis):
    """Elementwise bound on |deq(q(x)) - x|: half an E4M3 ulp relative, plus half the subnormal
    step of the block (scale < amax / 224, since amax / scale lies in (224, 448])."""
    x = np.abs(np.asarray(x, np.float64))
    block_amax = np.maximum.reduceat(x, np.arange(0, x.shape[axis], 32), axis=axis)
    block_amax = np.repeat(block_amax, 32, axis=axis)
    return E4M3_HALF_ULP * x + E4M3_SUBNORMAL_HALF_STEP * block_amax / 224


def _grouped(lhs, rhs, sizes, wgrad=False):
    """Exact float64 grouped products: lhs_g @ rhs_g (or lhs_g^T @ rhs_g for wgrad)."""
    out, start = [], 0
    for g, size in enumerate(sizes):
        block = slice(start, start + size)
        out.append(lhs[block].T @ rhs[block] if wgrad else lhs[block] @ rhs[g])
        start += size
    return np.stack(out) if wgrad else np.concatenate(out)


def _assert_within_bound(got, a, b, a_axis, b_axis, sizes, wgrad, rounded_output):
    """|got - exact| <= (2u + u^2)|a||b| + (1+u)(T_a|b| + |a|T_b) + T_a T_b (operands), plus
    fp32 accumulation (K * 2^-24 * |deq a||deq b|) and the output rounding to bf16."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ta, tb = _operand_error_bound(a, a_axis), _operand_error_bound(b, b_axis)
    u = E4M3_HALF_ULP
    exact = _grouped(a64, b64, sizes, wgrad)
    magnitude = _grouped(np.abs(a64), np.abs(b64), sizes, wgrad)
    bound = (
        (2 * u + u * u) * magnitude
        + (1 + u)
        * (_grouped(ta, np.abs(b64), sizes, wgrad) + _grouped(np.abs(a64), tb, sizes, wgrad))
        + _grouped(ta, tb, sizes, wgrad)
    )
    contraction = a64.shape[0] if wgrad else a64.shape[1]
    bound += contraction * 2.0**-24 * (1 + u) ** 2 * magnitude + 1e-30
    got = np.asarray(got, np.float64)
    if rounded_output:
        bound += 2.0**-8 * np.abs(got)
    error = np.abs(got - exact)
    assert np.all(error <= bound), f"worst error / bound {np.max(error / bound):.3f}"
    assert np.max(error / bound) > 0.05  # quantization did happen; the bound is not loose


def test_every_mxfp8_gmm_is_within_its_elementwise_error_bound():
    """fprop, dgrad and wgrad of `mxfp8_gmm` against exact float64 products of the bf16
    operands, with the bound derived from E4M3 rounding (3 mantissa bits, round to nearest)."""
    sizes = [64, 0, 32, 96]
    keys = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(keys[0], (192, 64), F32).astype(BF16)
    rhs = jax.random.normal(keys[1], (4, 64, 96), F32).astype(BF16)
    grad = jax.random.normal(keys[2], (192, 96), F32).astype(BF16)
    group_sizes = jnp.array(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda a, b: mxfp8_gmm(a, b, group_sizes, impl="xla"), lhs, rhs)
    d_lhs, d_rhs = vjp(grad.astype(F32))
    _assert_within_bound(out, lhs, rhs, 1, 1, sizes, wgrad=False, rounded_output=False)
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    _assert_within_bound(d_lhs, grad, rhs_t, 1, 1, sizes, wgrad=False, rounded_output=True)
    _assert_within_bound(d_rhs, lhs, grad, 0, 0, sizes, wgrad=True, rounded_output=True)


def relative_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


# First-order estimate with independent rounding errors: an E4M3 operand element carries a
# relative error of RMS <= u / sqrt(3) (uniform within half an ulp), a GEMM of two such
# operands sqrt(2) times that (0.051), and the errors of the n quantized GEMMs on a value's
# path add in quadrature. The bound is twice that estimate (activation slopes, finite sample).
# It holds for well-conditioned data (Gaussian tokens and weights, measured 0.06-0.09); with
# magnitudes spread over 2^12, single large tokens dominate and the error is that of a few
# products.
GEMM_RMS = np.sqrt(2.0) * E4M3_HALF_ULP / np.sqrt(3.0)


@pytest.mark.parametrize(
    "name,gemms_on_path", [("y", 2), ("fc2_kernel", 2), ("fc1_kernel", 3), ("x", 3), ("router", 3)]
)
def test_layer_stays_within_the_mxfp8_error_estimate_of_bf16(name, gemms_on_path):
    x, ct = tokens(48, spread=False), cotangent_of(48, spread=False)
    y_mx, grads_mx = training(make(ALL, spread=False), x, ct)
    y_bf, grads_bf = training(make(BASE, spread=False), x, ct)
    pick = {
        "y": lambda y, g: y,
        "x": lambda y, g: g[1],
        "fc1_kernel": lambda y, g: g[0].experts.fc1_kernel[...],
        "fc2_kernel": lambda y, g: g[0].experts.fc2_kernel[...],
        "router": lambda y, g: g[0].router.kernel[...],
    }[name]
    error = relative_rms(pick(y_mx, grads_mx), pick(y_bf, grads_bf))
    assert GEMM_RMS / 10 < error <= 2 * GEMM_RMS * np.sqrt(gemms_on_path), error


# ------------------------------------------------------------------------ D3 train == inference
def _manual_expert_output(model, stages, variant):
    """The combined expert output rebuilt from the fc1 stage: "training" order (prob at the
    activation, one bf16 rounding, then quantize), or an inference kernel's shortcut."""
    h, plan, config = stages.fc1_output, stages.plan, model.config
    row_probs = stages.row_probs.astype(F32)[:, None]
    w2 = qdq(model.experts.fc2_kernel[...], 1)
    if variant == "fp32_activation_quantized":  # skips the bf16 rounding before the quantize
        gate, up = jnp.split(h.astype(F32), 2, axis=-1) if config.gated_linear_unit else (h, 1)
        act = jaxmoe.ops.activation.activation(gate.astype(F32), config.activation) * up * row_probs
        a = mxfp8.dequantize(mxfp8.quantize(act, axis=1), BF16)
    else:
        a = qdq(
            weighted_activation(
                h, None if variant == "prob_after_fc2" else stages.row_probs, config
            ),
            1,
        )
    out = gmm(a, w2, plan.group_sizes, impl="xla", preferred_element_type=BF16)
    if variant == "prob_after_fc2":
        out = (out.astype(F32) * row_probs).astype(BF16)
    return combine(out, plan)


@pytest.mark.parametrize("activation,glu", [("silu", True), ("squared_relu", False)])
def test_training_forward_equals_inference_forward(activation, glu):
    """Padded experts, MXFP8 dispatch and combine gradient; three batches of 12 tokens over 16
    experts, each with other expert sizes and some experts empty."""
    config = ALL.replace(num_experts=16, activation=activation, gated_linear_unit=glu)
    model, sizes = make(config), set()
    for seed in (3, 4, 5):
        x = tokens(12, seed)
        y_train, _ = training(model, x, cotangent_of(12))
        assert_bitwise(y_train, inference(model, x))
        counts = np.bincount(np.asarray(model.router(x)[1].indices).ravel(), minlength=16)
        assert np.any(counts == 0)
        sizes.add(tuple(counts))
    assert len(sizes) == 3
    # Negative controls: the same check catches an inference path with another prob/rounding
    # order; rebuilt in the training order, the expert output matches bitwise.
    stages = stages_of(model, x)
    assert_bitwise(_manual_expert_output(model, stages, "training"), stages.combined)
    for shortcut in ("prob_after_fc2", "fp32_activation_quantized"):
        assert differs(_manual_expert_output(model, stages, shortcut), y_train)


# ------------------------------------------------------------------------ D2 batch invariance
def _alone_and_in_batch(forward, model, position):
    others, needle = tokens(64, seed=2), tokens(1, seed=3)
    batch = jnp.concatenate([others[:position], needle, others[position:]])
    return forward(model, needle), forward(model, batch)[position : position + 1]


@pytest.mark.parametrize("alignment", [32, 128])
def test_token_alone_equals_token_in_batch(alignment):
    """A small token alone (its expert blocks otherwise zero) and among 64 larger ones."""
    model = make(ALL.replace(expert_row_alignment=alignment))
    for position in (0, 17, 64):
        alone, in_batch = _alone_and_in_batch(inference, model, position)
        assert_bitwise(in_batch, alone)


def _quantize_lhs_along_tokens(monkeypatch):
    """Break the recipe: round 2-D GEMM inputs with blocks along the rows (tokens) instead of K
    (then encode that along the requested axis, the layout the GEMMs take)."""
    quantize = mxfp8.quantize

    def along_tokens(x, axis, impl="xla"):
        if x.ndim == 2:
            x = mxfp8.dequantize(quantize(x, axis=0), x.dtype)
        return quantize(x, axis=axis)

    monkeypatch.setattr(importlib.import_module("jaxmoe.ops.mxfp8_gmm"), "quantize", along_tokens)


def test_negative_controls_for_batch_invariance(monkeypatch):
    """Alignments that let a 32-row block straddle two experts are refused; fprop operands
    blocked along the token axis make a token's output depend on its neighbours, which the
    check above detects."""
    for alignment in (1, 16, 64):
        with pytest.raises(ValueError, match="expert_row_alignment"):
            ALL.replace(expert_row_alignment=alignment)
    _quantize_lhs_along_tokens(monkeypatch)
    model = make(ALL.replace(dispatch_dtype="bf16"))
    alone, in_batch = _alone_and_in_batch(nnx.jit(lambda m, x: m(x)[0]), model, 17)
    assert differs(in_batch, alone)


def test_zero_padding_rows_keep_wgrad_columnwise_blocks_clean():
    """Garbage in padding rows (their gradient rows are zero) changes MXFP8 wgrad through the
    shared columnwise scales, and leaves bf16 wgrad alone: why padding is zero before any
    quantization."""
    sizes = jnp.array([32, 64], jnp.int32)
    real = np.ones(96, bool)
    real[[20, 21, 90]] = False
    keys = jax.random.split(jax.random.key(6), 3)
    lhs = jnp.where(real[:, None], jax.random.normal(keys[0], (96, 32), F32), 0).astype(BF16)
    rhs = jax.random.normal(keys[1], (2, 32, 32), F32).astype(BF16)
    grad = jnp.where(real[:, None], jax.random.normal(keys[2], (96, 32), F32), 0).astype(BF16)
    garbage = jnp.where(real[:, None], lhs, 1e4).astype(BF16)

    def wgrad(op, lhs):
        return jax.vjp(lambda r: op(lhs, r, sizes, impl="xla"), rhs)[1](grad.astype(F32))[0]

    assert differs(wgrad(mxfp8_gmm, garbage), wgrad(mxfp8_gmm, lhs))
    assert_bitwise(wgrad(gmm, garbage), wgrad(gmm, lhs))


# ------------------------------------------------------------------------ dispatch dtype
def test_dispatched_mxtensor_equals_quantizing_the_dispatched_rows():
    """Rowwise blocks are per row, so quantize-then-dispatch == dispatch-then-quantize bitwise
    (padding rows: zero data, scale byte 0). Negative controls: columnwise blocks, or padding
    rows filled with a real token (clipped gather), do not give these bits."""
    model, x = make(ALL), tokens(40)
    _, routing = model.router(x)
    plan = jaxmoe.make_plan(routing, ALL)
    wire = jaxmoe.dispatch(mxfp8.quantize(x, axis=1), plan)
    rows = jaxmoe.dispatch(x, plan)
    compute_side = mxfp8.quantize(rows, axis=1)
    assert_bitwise(wire.data, compute_side.data)
    assert_bitwise(wire.scale, compute_side.scale)
    padding = np.asarray(plan.row_token()) == 40
    assert padding.any() and not np.asarray(wire.scale)[padding].any()
    wrong_axis = mxfp8.quantize(rows, axis=0)
    assert differs(mxfp8.dequantize(wrong_axis, BF16), mxfp8.dequantize(wire, BF16))
    clipped = mxfp8.quantize(jnp.take(x, jnp.minimum(plan.row_token(), 39), axis=0), axis=1)
    assert differs(clipped.scale, wire.scale)
    with pytest.raises(ValueError, match="axis 1"):
        jaxmoe.dispatch(mxfp8.quantize(x[:32], axis=0), plan)


def test_mxfp8_dispatch_forward_equals_compute_side_quantization(monkeypatch):
    """The layer with tokens quantized before the dispatch equals the layer that quantizes the
    dispatched rows, bitwise; with the compute-side copy blocked along the wrong axis, it
    does not."""
    x = tokens(40)
    wire = inference(make(ALL), x)
    assert_bitwise(wire, inference(make(ALL.replace(dispatch_dtype="bf16")), x))
    _quantize_lhs_along_tokens(monkeypatch)
    wrong = nnx.jit(lambda m, x: m(x)[0])(make(ALL.replace(dispatch_dtype="bf16")), x)
    assert differs(wrong, wire)


# ------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "dispatch_dtype,combine_bwd_dtype", [("bf16", "bf16"), ("mxfp8", "bf16"), ("bf16", "mxfp8")]
)
def test_mxfp8_experts_do_not_depend_on_where_the_rowwise_copies_are_made(
    dispatch_dtype, combine_bwd_dtype
):
    """MXFP8 experts consume the same rowwise copies whether tokens / gradients were quantized
    before the dispatch (wire) or after it (compute side): outputs and gradients are bitwise
    those of the all-MXFP8 layer, except a weight gradient whose columnwise copy then comes
    from bf16 rows rather than the dequantized wire rows (which the MXFP8 wire alone carries,
    as Transformer Engine's MXFP8 all-to-all): fc1's with bf16 dispatch, fc2's with a bf16
    combine gradient. Those differ."""
    x, ct = tokens(48), cotangent_of(48)
    config = ALL.replace(dispatch_dtype=dispatch_dtype, combine_bwd_dtype=combine_bwd_dtype)
    y, grads = training(make(config), x, ct)
    y_all, grads_all = training(make(ALL), x, ct)
    assert_bitwise(y, y_all)
    got, want = grads_by_name(grads), grads_by_name(grads_all)
    assert got.keys() == want.keys()
    from_bf16_rows = {
        "fc1_kernel": dispatch_dtype == "bf16",
        "fc2_kernel": combine_bwd_dtype == "bf16",
    }
    for name in got:
        if any(weight in name and other for weight, other in from_bf16_rows.items()):
            assert differs(got[name], want[name])
        else:
            assert_bitwise(got[name], want[name])


@pytest.mark.parametrize("combine_bwd_dtype", ["bf16", "mxfp8"])
def test_bf16_experts_with_mxfp8_dispatch_take_the_dequantized_tokens(combine_bwd_dtype):
    """fc1's input is the dequantized wire copy, in training and inference alike."""
    config = BASE.replace(dispatch_dtype="mxfp8", combine_bwd_dtype=combine_bwd_dtype)
    model, x = make(config), tokens(40)
    stages = stages_of(model, x)
    assert_bitwise(training(model, x, cotangent_of(40))[0], stages.combined)
    w1 = model.experts.fc1_kernel[...]
    fc1_input = mxfp8.dequantize(stages.dispatched_quantized, BF16)
    assert_bitwise(fc1_input, qdq(stages.dispatched_rows, 1))
    want = gmm(fc1_input, w1, stages.plan.group_sizes, impl="xla", preferred_element_type=BF16)
    assert_bitwise(stages.fc1_output, want)
    assert differs(stages.fc1_output, stages_of(make(BASE), x).fc1_output)


@pytest.mark.parametrize("dispatch_dtype", ["bf16", "mxfp8"])
def test_bf16_experts_with_mxfp8_combine_gradient_see_the_dequantized_gradient(dispatch_dtype):
    """Forward unchanged; every gradient equals the layer without the option, given the
    rowwise-MXFP8-rounded output gradient (the router and input gradients too: y is the
    combined expert output, there is no shared expert here)."""
    config = BASE.replace(dispatch_dtype=dispatch_dtype)
    x, ct = tokens(48), cotangent_of(48)
    rounded_ct = qdq(ct.astype(BF16), 1).astype(F32)
    y, grads = training(make(config.replace(combine_bwd_dtype="mxfp8")), x, ct)
    y_ref, grads_ref = training(make(config), x, rounded_ct)
    assert_bitwise(y, y_ref)
    for got, want in zip(grad_leaves(grads), grad_leaves(grads_ref)):
        assert_bitwise(got, want)
    assert differs(
        grads[0].experts.fc2_kernel[...],
        training(make(config), x, ct)[1][0].experts.fc2_kernel[...],
    )


def test_bad_mxfp8_shapes_and_alignment_are_refused_clearly():
    """Alignments other than 32/128/256 by the config; H (any MXFP8 option) or F (MXFP8
    experts) not a multiple of 32 by the layer; bad buffers by the op (M and the group sizes
    only where a backward needs their columnwise blocks)."""
    with pytest.raises(ValueError, match="expert_row_alignment"):
        BASE.replace(expert_row_alignment=8, combine_bwd_dtype="mxfp8")
    with pytest.raises(ValueError, match=r"hidden_size \(48\) must be a multiple of 32"):
        MoE(BASE.replace(dispatch_dtype="mxfp8"), 48, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ffn_hidden_size \(48\) must be a multiple of 32"):
        MoE(ALL.replace(ffn_hidden_size=48), H, rngs=nnx.Rngs(0))
    MoE(BASE.replace(ffn_hidden_size=48, dispatch_dtype="mxfp8"), H, rngs=nnx.Rngs(0))
    weights = jnp.ones((2, H, H), BF16)
    with pytest.raises(ValueError, match="M=48 must be a multiple of 32"):
        mxfp8_gmm(tokens(48), weights, jnp.array([32, 16]))
    with pytest.raises(ValueError, match="group sizes must be multiples of 32"):
        mxfp8_gmm(tokens(64), weights, jnp.array([32, 16]))
    with pytest.raises(ValueError, match="K=48 and N=32 must be multiples of 32"):
        mxfp8_gmm(jnp.ones((64, 48), BF16), jnp.ones((2, 48, H), BF16), jnp.array([32, 32]))
    # The forward alone (no high-precision rhs: inference) has no columnwise blocks.
    stored = quantize_mxfp8_weights(weights, dgrad=False)
    assert mxfp8_gmm(tokens(48), None, jnp.array([32, 15]), rhs_quantized=stored).shape == (48, H)


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_buffers_keep_32_row_blocks_inside_experts(pad):
    """With token dropping (and padding to capacity), the buffer and every expert block are
    still multiples of 32 rows, so MXFP8 runs."""
    config = ALL.replace(capacity_factor=0.5, pad_expert_input_to_capacity=pad)
    model, x = make(config), tokens(40)
    stages = stages_of(model, x)
    assert stages.plan.num_rows % 32 == 0
    assert not np.any(np.asarray(stages.plan.group_sizes) % 32)
    assert not np.asarray(stages.kept).all()
    assert np.all(np.isfinite(np.asarray(stages.combined, np.float32)))


# ------------------------------------------------------------------------ per-layer precision
def test_selective_precision_keeps_chosen_layers_in_bf16():
    """First 2, last 1 and layers 0 and 4 of 8 in bf16; nothing else changes; bad choices
    raise."""
    layers = jaxmoe.selective_precision(ALL, 8, first_bf16=2, last_bf16=1, bf16_layers=(4, 0))
    assert [c.expert_precision for c in layers] == ["bf16"] * 2 + ["mxfp8"] * 2 + ["bf16"] + [
        "mxfp8"
    ] * 2 + ["bf16"]
    for config in layers:
        assert config.replace(**MXFP8_ALL) == ALL
        assert {config.expert_precision, config.dispatch_dtype, config.combine_bwd_dtype} in (
            {"bf16"},
            {"mxfp8"},
        )
    assert jaxmoe.selective_precision(ALL, 3) == (ALL,) * 3
    for kwargs in (
        dict(first_bf16=2, last_bf16=2),
        dict(bf16_layers=(3,)),
        dict(bf16_layers=(-1,)),
        dict(first_bf16=-1),
    ):
        with pytest.raises(ValueError, match="selective_precision"):
            jaxmoe.selective_precision(ALL, 3, **kwargs)
    with pytest.raises(ValueError, match="no MXFP8 option"):
        jaxmoe.selective_precision(BASE, 3)


# ------------------------------------------------------------------------ demo
def test_demo_mxfp8_loss_tracks_bf16():
    """Same seed, same teacher, 60 steps: MXFP8 training keeps at least half of the progress
    bf16 makes from the first step's loss, and at most bf16's progress plus that half again (a
    quantized run must neither stall nor look better than its bf16 twin by more than the
    precision can explain). The relative loss of an untrained student, whose output is near 0,
    is 1.0."""
    kwargs = dict(hidden=32, batch=4, seq_len=16, learning_rate=1e-2, quiet=True)
    start = demo.train("mixtral", precision="bf16", steps=1, log_every=1, **kwargs)["loss"]
    bf16 = demo.train("mixtral", precision="bf16", steps=60, log_every=60, **kwargs)["loss"]
    mx = demo.train("mixtral", precision="mxfp8", steps=60, log_every=60, **kwargs)["loss"]
    progress = start - bf16
    assert progress > 0, (start, bf16)
    assert abs((start - mx) - progress) <= progress / 2, (start, bf16, mx)


def test_weights_quantized_once_per_step_give_the_same_bits():
    """quantize_mxfp8_weights(rhs) made once and passed to several micro-batches: outputs and
    gradients (to lhs and to the bf16 master rhs) are the bits of quantizing in every call;
    copies made from other weights are used as given (negative control)."""
    keys = jax.random.split(jax.random.key(11), 4)
    rhs = jax.random.normal(keys[0], (3, 64, 96), F32).astype(BF16)
    sizes = jnp.array([32, 0, 64], jnp.int32)
    cached = quantize_mxfp8_weights(rhs, impl="xla")
    stale = quantize_mxfp8_weights((rhs * 1.5).astype(BF16), impl="xla")

    def run(lhs, weights):
        def loss(lhs, rhs):
            out = mxfp8_gmm(lhs, rhs, sizes, rhs_quantized=weights, impl="xla")
            return jnp.sum(out * jnp.arange(96.0)), out

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)

    for key in keys[1:3]:  # two micro-batches, one set of weights
        lhs = jax.random.normal(key, (96, 64), F32).astype(BF16)
        (d_lhs, d_rhs), out = run(lhs, cached)
        (ref_lhs, ref_rhs), ref = run(lhs, None)
        for a, b in ((out, ref), (d_lhs, ref_lhs), (d_rhs, ref_rhs)):
            assert_bitwise(np.asarray(a), np.asarray(b))
    assert differs(np.asarray(run(lhs, stale)[1]), np.asarray(ref))
    with pytest.raises(ValueError, match="rhs_quantized"):
        mxfp8_gmm(lhs, rhs, sizes, rhs_quantized=cached.fprop)


def test_layer_with_weights_quantized_once_per_step():
    """MoE.quantize_expert_weights() once, then two micro-batches with expert_weights=: the
    outputs and gradients (incl. the bf16 master weights') equal quantizing in every call."""
    model = make(ALL)
    weights = model.quantize_expert_weights()
    dy = jax.random.normal(jax.random.key(12), (24, H), F32)

    def grads(x, expert_weights):
        def loss(model, x):
            y, aux = model(x, expert_weights=expert_weights)
            return jnp.sum(y.astype(F32) * dy) + aux.total_loss, y

        (_, y), g = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
        return [y, *jax.tree.leaves(g)]

    for seed in (13, 14):
        x = jax.random.normal(jax.random.key(seed), (24, H), F32).astype(BF16)
        for a, b in zip(grads(x, weights), grads(x, None)):
            assert_bitwise(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="run in bf16, which has no quantized weight copies"):
        make(ALL.replace(expert_precision="bf16")).quantize_expert_weights()
