"""The whole `jaxmoe.MoE` layer against the per-token loop reference (tests/support/loop_reference.py),
plus gradients (finite differences, bf16, jit, remat), bad inputs and NaN isolation.

Parameters are random (not the Megatron init) so that biases, expert bias and the shared gate
are non-trivial; they are written into a module built with `nnx.eval_shape` and read back from
the module for the reference (`moe.experts.fc1_kernel[...]`, ...).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe import MoEConfig

import loop_reference as ref  # noqa: E402
import mxfp8_numpy_reference as mx_ref  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
HIDDEN = 32
BATCH, SEQ = 4, 16  # T = 64 tokens


# ------------------------------------------------------------------------------------ helpers
def make_moe(
    config: MoEConfig, hidden: int, dtype, seed: int = 0, compute_dtype=None
) -> jaxmoe.MoE:
    """A MoE whose parameters (`dtype`) are random numpy draws (module structure from
    nnx.eval_shape); `compute_dtype` defaults to the parameter dtype.

    Scales: router kernel N(0, 1/H) (logits ~ N(0, |x|^2/H), well spread), fc1 N(0, 1/H),
    fc2 N(0, 1/F), biases N(0, 0.1^2), expert bias N(0, 0.05^2), shared gate N(0, 1/H)."""
    dtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(
        lambda: jaxmoe.MoE(config, hidden, param_dtype=dtype, dtype=compute_dtype, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        names = {getattr(p, "key", None) for p in path}
        if "expert_bias" in names:
            value = rng.standard_normal(leaf.shape) * 0.05
        elif names & {"bias", "fc1_bias", "fc2_bias"}:
            value = rng.standard_normal(leaf.shape) * 0.1
        else:  # every kernel: fan-in scaling on the second-to-last axis
            value = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2])
        return jnp.asarray(value.astype(leaf.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def reference_params(moe: jaxmoe.MoE) -> ref.LayerParams:
    """Numpy copies of every parameter, read from the module."""

    def value(v):
        return None if v is None else np.asarray(v[...])

    shared = moe.shared_experts
    return ref.LayerParams(
        router_kernel=value(moe.router.kernel),
        router_bias=value(moe.router.bias),
        expert_bias=value(moe.router.expert_bias),
        fc1=value(moe.experts.fc1_kernel),
        fc2=value(moe.experts.fc2_kernel),
        fc1_bias=value(moe.experts.fc1_bias),
        fc2_bias=value(moe.experts.fc2_bias),
        shared_fc1=None if shared is None else value(shared.fc1_kernel),
        shared_fc2=None if shared is None else value(shared.fc2_kernel),
        shared_gate=None if shared is None else value(shared.gate_kernel),
    )


@nnx.jit
def forward(moe, x):
    return moe(x)


@nnx.jit
def forward_masked(moe, x, mask):
    return moe(x, padding_mask=mask)


@functools.partial(nnx.jit, static_argnums=2)
def router_decision(moe, tokens, sequence_shape):
    return moe.router(tokens, sequence_shape=sequence_shape)[1]


def random_x(seed: int, dtype, shape=(BATCH, SEQ, HIDDEN)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """Spacing of bf16 numbers at |v| (normal range): 2^(floor(log2|v|) - 7)."""
    v = np.maximum(np.abs(v.astype(np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(v)) - 7)


def assert_close_to_reference(y, expected: ref.RefOutput, dtype, where="", flip_step=2.0**-7):
    """`expected.scale` = sum of |products| accumulated into the element through the fc2 GEMMs
    (all kept experts + shared expert). Errors are measured against it, not against |y|,
    because y (and each expert output) can cancel to ~0.

    fp32: |y - y_ref| <= 1e-5 * scale (observed <= 4e-7 * scale: fp32 accumulation order and
    XLA's fp32 exp/erf/logistic approximations).

    bf16: the reference rounds at exactly jaxmoe's rounding points; the only freedom left is
    the fp32 accumulation ORDER inside each GEMM / reduction before a bf16 rounding (and fp32
    transcendental approximations). Such a difference is ~1e-7 relative, so it flips a bf16
    rounding by at most 1 ulp, and only when the exact value is within ~1e-7 of a midpoint.
    Bound: a flip in an expert output o_j changes y by <= ulp(o_j) <= 2^-7 |o_j| <= 2^-7 x
    (o_j's share of scale) before the final rounding, which adds <= 1 ulp(y); flips upstream
    (h, a, logits, probs) move o_j by a fraction of its ulp and can at most flip its rounding.
    Hence
        |y - y_ref| <= ulp(y_ref) + 2^-7 * scale          for every element, and
        |y - y_ref| <= ulp(y_ref)                          for >= 99.9% of the elements,
    and, since such flips are rare, >= 99% of the elements bitwise equal (measured: >= 99.95%
    bitwise). Negative control: moving the probability multiply after a first bf16 rounding of
    act(g)*u (double rounding) drops these to ~53% bitwise / ~78% within 1 ulp.
    With MXFP8 operands (`flip_step` 2^-3) a flipped bf16 rounding of an activation element can
    also move its quantized value by one E4M3 step, 2^-3 of itself: the worst-case term becomes
    2^-3 * scale, the other criteria stay (such flips are as rare)."""
    y = np.asarray(y).reshape(expected.y.shape)
    assert y.dtype == np.dtype(dtype), (y.dtype, dtype)
    diff = np.abs(y.astype(np.float64) - expected.y.astype(np.float64))
    assert np.all(np.isfinite(y)), where
    if np.dtype(dtype) == F32:
        bound = 1e-5 * expected.scale + 1e-30
        assert np.all(diff <= bound), (where, np.max(diff / bound))
        return
    ulp = bf16_ulp(expected.y)
    bitwise = np.mean(diff == 0)
    assert bitwise >= 0.99, (where, bitwise)
    within_one = np.mean(diff <= ulp)
    assert within_one >= 0.999, (where, within_one)
    worst = np.max(diff / (ulp + flip_step * expected.scale))
    assert worst <= 1.0, (where, worst)
    # A plain max-ulp bound where y does not cancel much (|y_ref| >= scale / 16; typically
    # |y| ~ scale / sqrt(F) for random signs): measured <= 2 ulp(y_ref), bound 4.
    plain = np.abs(expected.y.astype(np.float64)) >= expected.scale / 16
    assert plain.mean() > 0.5, (where, plain.mean())
    assert np.max((diff / ulp)[plain]) <= 4, (where, np.max((diff / ulp)[plain]))


def check_layer_against_reference(config, dtype, seed=0, x_seed=1, hidden=HIDDEN, x=None):
    moe = make_moe(config, hidden, dtype, seed)
    if x is None:
        x = random_x(x_seed, dtype, (BATCH, SEQ, hidden))
    y, aux = forward(moe, jnp.asarray(x))
    tokens = x.reshape(-1, hidden)
    expected = ref.moe_forward(tokens, reference_params(moe), config, np.dtype(dtype), x.shape[:-1])
    decision = router_decision(moe, jnp.asarray(tokens), x.shape[:-1])
    # The routing decision must be identical (a flip would be a different expert, not an ulp).
    np.testing.assert_array_equal(np.asarray(decision.indices), expected.routing.indices)
    np.testing.assert_array_equal(np.asarray(decision.kept), expected.routing.kept)
    assert y.shape == x.shape
    assert_close_to_reference(y, expected, dtype, where=f"{np.dtype(dtype).name}")
    np.testing.assert_array_equal(
        np.asarray(aux.tokens_per_expert),
        ref.tokens_per_expert(expected.routing, config.num_experts),
    )
    lb = ref.load_balancing_loss(expected.logits, config, (BATCH, SEQ))
    np.testing.assert_allclose(float(aux.load_balancing_loss), lb, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(
        float(aux.z_loss), ref.z_loss(expected.logits, config.z_loss_coeff), rtol=1e-5
    )
    return moe, x, np.asarray(y), expected


# ------------------------------------------------------------------------------------ configs
CONFIGS = {
    # Mixtral-like: softmax after top-k, SwiGLU, router logits in the compute dtype.
    "mixtral": MoEConfig(
        num_experts=8, ffn_hidden_size=32, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3
    ),
    # DeepSeek-like: sigmoid + expert bias + group-limited + scaling, shared expert with gate,
    # fp32 router, sequence aux loss.
    "deepseek": MoEConfig(
        num_experts=16,
        ffn_hidden_size=16,
        top_k=4,
        score_function="sigmoid",
        enable_expert_bias=True,
        num_groups=4,
        group_topk=2,
        topk_scaling_factor=2.5,
        router_dtype="fp32",
        shared_expert_intermediate_size=24,
        shared_expert_gate=True,
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1e-3,
    ),
    # Nemotron-like: squared ReLU without GLU, softmax before top-k.
    "sqrelu": MoEConfig(
        num_experts=8,
        ffn_hidden_size=48,
        top_k=2,
        pre_softmax=True,
        activation="squared_relu",
        gated_linear_unit=False,
        load_balancing_type="none",
    ),
    # GeGLU with router / fc1 / fc2 biases.
    "gelu_glu_bias": MoEConfig(
        num_experts=4,
        ffn_hidden_size=32,
        top_k=2,
        activation="gelu",
        add_bias_linear=True,
        aux_loss_coeff=0.1,
    ),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_loop_reference(name, dtype):
    check_layer_against_reference(CONFIGS[name], dtype)


_CAPACITY = [("position", False), ("position", True), ("probs", False), ("probs", True)]


@pytest.mark.parametrize(
    "policy,pad", _CAPACITY, ids=[f"{p}-{'pad' if q else 'nopad'}" for p, q in _CAPACITY]
)
def test_layer_capacity_dropping_matches_reference(policy, pad):
    """Capacity 8 per expert (T=64, k=2, E=8, factor 0.5): tokens are really dropped, the
    reference agrees, and padding to capacity (zero rows) changes no output bit."""
    base = CONFIGS["mixtral"].replace(capacity_factor=0.5, token_drop_policy=policy)
    config = base.replace(pad_expert_input_to_capacity=pad)
    moe, x, y, expected = check_layer_against_reference(config, BF16, seed=3)
    assert (~expected.routing.kept).sum() >= 8
    # a token with every expert dropped gets exactly 0 (no shared expert here)
    dropped_all = ~expected.routing.kept.any(axis=1)
    assert dropped_all.any()
    assert np.all(y.reshape(-1, HIDDEN)[dropped_all] == 0)
    other = make_moe(base.replace(pad_expert_input_to_capacity=not pad), HIDDEN, BF16, seed=3)
    y_other, _ = forward(other, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y_other), y)


def test_layer_capacity_fp32_position_matches_reference():
    config = CONFIGS["gelu_glu_bias"].replace(capacity_factor=0.75, token_drop_policy="position")
    _, _, _, expected = check_layer_against_reference(config, F32, seed=4)
    assert (~expected.routing.kept).sum() > 0


def test_expert_row_alignment_is_bitwise_invisible():
    """expert_row_alignment 1, 4 and 32 pad every expert block with zero rows; outputs (and
    aux) are bitwise identical, and match the reference. Also with pad-to-capacity."""
    outputs = []
    for align in (1, 4, 32):
        config = CONFIGS["mixtral"].replace(expert_row_alignment=align)
        _, _, y, _ = check_layer_against_reference(config, BF16, seed=5)
        outputs.append(y)
    for y in outputs[1:]:
        np.testing.assert_array_equal(y, outputs[0])
    capped = CONFIGS["mixtral"].replace(capacity_factor=0.5, pad_expert_input_to_capacity=True)
    x = jnp.asarray(random_x(1, BF16))
    ys = [
        np.asarray(forward(make_moe(capped.replace(expert_row_alignment=a), HIDDEN, BF16, 5), x)[0])
        for a in (1, 32)
    ]
    np.testing.assert_array_equal(ys[0], ys[1])


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_identical_tokens_empty_experts_and_capacity_ties(policy):
    """40 copies of one token + 24 random ones: the copies share their top-2 experts, most
    experts are (nearly) empty, and under capacity the copies tie exactly (same probability),
    so the copies visited first in Megatron's token order (sequence-major) must be kept (both
    policies). Alignment 4."""
    config = CONFIGS["mixtral"].replace(
        capacity_factor=0.5, token_drop_policy=policy, expert_row_alignment=4
    )
    x = random_x(9, BF16).reshape(-1, HIDDEN)
    x[:40] = x[0]
    x = x.reshape(BATCH, SEQ, HIDDEN)
    _, _, y, expected = check_layer_against_reference(config, BF16, seed=8, x=x)
    first = expected.routing.indices[0]
    copies = [t for t in ref.megatron_order(BATCH * SEQ, (BATCH, SEQ)) if t < 40]
    kept_copies = expected.routing.kept[copies]
    cap = config.capacity(64)
    for j in range(2):
        # the first `cap` copies fit their expert's capacity (other tokens may also use it)
        assert kept_copies[:, j].sum() <= cap
        assert np.all(kept_copies[:, j][: kept_copies[:, j].sum()])
    assert np.all(expected.routing.indices[:40] == first)
    y = y.reshape(-1, HIDDEN)
    assert np.all(y[copies[-1]] == 0) and np.any(y[copies[0]] != 0)


@pytest.mark.parametrize("name", ["gelu_glu_bias", "deepseek"])
def test_fp32_params_bf16_compute_fp32_input(name):
    """Mixed precision: fp32 parameters and fp32 input, bf16 compute. x and the kernels are cast
    to bf16; biases enter the fp32 accumulations at their fp32 parameter precision."""
    config = CONFIGS[name]
    moe = make_moe(config, HIDDEN, F32, seed=13, compute_dtype=jnp.bfloat16)
    x = random_x(14, F32)
    y, _ = forward(moe, jnp.asarray(x))
    expected = ref.moe_forward(x.reshape(-1, HIDDEN), reference_params(moe), config, BF16)
    assert_close_to_reference(y, expected, BF16)


def test_single_token_and_odd_token_counts():
    """x as [H] (one token) and [7, H], with alignment 32: still the reference."""
    config = CONFIGS["gelu_glu_bias"].replace(expert_row_alignment=32)
    moe = make_moe(config, HIDDEN, F32, seed=10)
    params = reference_params(moe)
    for x in (random_x(11, F32, (HIDDEN,)), random_x(12, F32, (7, HIDDEN))):
        y, aux = forward(moe, jnp.asarray(x))
        assert y.shape == x.shape
        expected = ref.moe_forward(x.reshape(-1, HIDDEN), params, config, F32)
        assert_close_to_reference(y, expected, F32)
        np.testing.assert_array_equal(
            np.asarray(aux.tokens_per_expert), ref.tokens_per_expert(expected.routing, 4)
        )


def _combine_rows(indices, kept, row_values, dtype):
    """combine(rows) for one token whose row for expert e holds row_values[e]."""
    config = MoEConfig(num_experts=4, ffn_hidden_size=8, top_k=len(indices))
    decision = jaxmoe.Routing(
        probs=jnp.ones((1, len(indices)), jnp.float32),
        indices=jnp.asarray([indices], jnp.int32),
        kept=jnp.asarray([kept]),
    )
    plan = jax.jit(jaxmoe.make_plan, static_argnums=1)(decision, config)
    row_expert = np.asarray(plan.row_expert)
    real = np.asarray(plan.row_slot) < len(indices)
    rows = np.zeros((plan.num_rows, 1), np.float64)
    for r in range(plan.num_rows):
        if real[r]:
            rows[r, 0] = row_values[row_expert[r]]
    combined = jax.jit(jaxmoe.combine)(jnp.asarray(rows.astype(dtype)), plan)
    return float(np.asarray(combined)[0, 0])


def test_combine_ascending_expert_order_fp32_accumulation_one_rounding():
    """fp32 rows: experts 0, 1 hold 2^-24, expert 2 holds 1; top-k order [2, 0, 1].
    Ascending expert order: (2^-24 + 2^-24) + 1 = 1 + 2^-23; slot order would give 1.
    bf16 rows: 1 + 3 * 2^-9 summed in fp32 and rounded once is 1 + 2^-7; sequential bf16
    adds would give 1. A dropped slot contributes nothing."""
    tiny = 2.0**-24
    got = _combine_rows([2, 0, 1], [True] * 3, {0: tiny, 1: tiny, 2: 1.0}, np.float32)
    assert got == 1 + 2.0**-23, got
    got = _combine_rows([3, 0, 2, 1], [True] * 4, {0: 2**-9, 1: 2**-9, 2: 2**-9, 3: 1.0}, BF16)
    assert got == 1 + 2.0**-7, got
    got = _combine_rows([2, 0, 1], [True, False, True], {0: 5.0, 1: 0.25, 2: 1.0}, np.float32)
    assert got == 1.25, got


def test_padding_mask_affects_only_losses_and_counts():
    """Padding tokens (mask True) are routed and computed like any other token: y is bitwise
    the same; the counts and the losses leave them out (per the reference)."""
    config = CONFIGS["mixtral"]
    moe = make_moe(config, HIDDEN, BF16, seed=6)
    x = random_x(7, BF16)
    mask = np.zeros((BATCH, SEQ), bool)
    mask[0, 10:] = True
    mask[2, 3:] = True
    y_plain, aux_plain = forward(moe, jnp.asarray(x))
    y_masked, aux = forward_masked(moe, jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(y_masked), np.asarray(y_plain))
    tokens = x.reshape(-1, HIDDEN)
    flat = mask.reshape(-1)
    expected = ref.moe_forward(tokens, reference_params(moe), config, BF16)
    np.testing.assert_array_equal(
        np.asarray(aux.tokens_per_expert), ref.tokens_per_expert(expected.routing, 8, flat)
    )
    assert int(np.asarray(aux.tokens_per_expert).sum()) == 2 * (~flat).sum()
    np.testing.assert_allclose(
        float(aux.load_balancing_loss),
        ref.load_balancing_loss(expected.logits, config, (BATCH, SEQ), flat),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        float(aux.z_loss), ref.z_loss(expected.logits, 1e-3, flat), rtol=1e-5
    )
    assert float(aux.load_balancing_loss) != float(aux_plain.load_balancing_loss)


# ------------------------------------------------------------------------------------ gradients
GRAD_CONFIGS = {
    # biases everywhere (router, fc1, fc2), GeGLU, aux loss and z-loss in the objective
    "biases": MoEConfig(
        num_experts=4,
        ffn_hidden_size=8,
        top_k=2,
        activation="gelu",
        add_bias_linear=True,
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
    ),
    # shared expert with gate (Megatron forbids biases with a shared expert), seq aux loss
    "shared": MoEConfig(
        num_experts=4,
        ffn_hidden_size=8,
        top_k=2,
        shared_expert_intermediate_size=8,
        shared_expert_gate=True,
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=0.1,
    ),
}


def _objective(graphdef, rest, weights):
    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * weights) + aux.total_loss

    return loss


@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
def test_gradients_match_finite_differences(name):
    """jax.grad w.r.t. x and every parameter vs central differences along one random direction
    per leaf, all in fp32: eps = 1e-3 relative (direction scaled by the leaf's rms), relative
    error < 1e-2. The routing (indices and the aux top-k) is checked unchanged at +-eps, so the
    function is smooth on the segment."""
    config = GRAD_CONFIGS[name]
    hidden, tokens = 8, 16
    moe = make_moe(config, hidden, F32, seed=11)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((2, tokens // 2, hidden)).astype(np.float32))
    weights = jnp.asarray(rng.standard_normal((2, tokens // 2, hidden)).astype(np.float32))
    loss = _objective(graphdef, rest, weights)
    loss_jit = jax.jit(loss)
    grad_params, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    @jax.jit
    def routing_at(params, x):
        m = nnx.merge(graphdef, params, rest)
        return m.router(x.reshape(-1, hidden))[1].indices

    base_routing = np.asarray(routing_at(params, x))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    grad_leaves = jax.tree_util.tree_leaves(grad_params)
    eps = 1e-3
    checked = 0
    for i in range(len(leaves) + 1):  # every parameter leaf, then x
        if i < len(leaves):
            base = leaves[i]
            direction = rng.standard_normal(base.shape).astype(np.float32)
            direction *= float(np.sqrt(np.mean(np.square(np.asarray(base))))) or 0.1
            analytic = float(np.sum(np.asarray(grad_leaves[i]) * direction))

            def at(sign, i=i, direction=direction):
                moved = list(leaves)
                moved[i] = leaves[i] + sign * eps * jnp.asarray(direction)
                return jax.tree_util.tree_unflatten(treedef, moved), x
        else:
            direction = rng.standard_normal(x.shape).astype(np.float32)
            analytic = float(np.sum(np.asarray(grad_x) * direction))

            def at(sign, direction=direction):
                return params, x + sign * eps * jnp.asarray(direction)

        for sign in (1, -1):
            np.testing.assert_array_equal(
                np.asarray(routing_at(*at(sign))),
                base_routing,
                err_msg=f"routing flipped on leaf {i}",
            )
        numeric = (float(loss_jit(*at(1))) - float(loss_jit(*at(-1)))) / (2 * eps)
        assert abs(analytic) > 1e-4, (i, analytic)
        rel = abs(numeric - analytic) / max(abs(analytic), abs(numeric))
        assert rel < 1e-2, (name, i, analytic, numeric, rel)
        checked += 1
    expected_leaves = {"biases": 6, "shared": 6}[name]  # + x
    assert checked == expected_leaves + 1


def _grad_loss(moe, x, weights):
    y, aux = moe(x)
    return jnp.sum(y.astype(jnp.float32) * weights) + aux.total_loss


def _grad_loss_remat(moe, x, weights):
    y, aux = nnx.remat(lambda m, v: m(v))(moe, x)
    return jnp.sum(y.astype(jnp.float32) * weights) + aux.total_loss


@nnx.jit
def nnx_grads(moe, x, weights):
    return nnx.grad(_grad_loss, argnums=(0, 1))(moe, x, weights)


@nnx.jit
def nnx_grads_remat(moe, x, weights):
    return nnx.grad(_grad_loss_remat, argnums=(0, 1))(moe, x, weights)


def test_bf16_nnx_grad_is_finite_and_reaches_every_param():
    config = CONFIGS["deepseek"].replace(z_loss_coeff=1e-3)
    moe = make_moe(config, HIDDEN, BF16, seed=21)
    x = jnp.asarray(random_x(22, BF16))
    weights = jnp.asarray(random_x(23, np.float32))
    grads, grad_x = nnx_grads(moe, x, weights)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    names = {jax.tree_util.keystr(p) for p, _ in leaves}
    assert len(leaves) == 6, names  # router, fc1, fc2, shared fc1/fc2/gate; no expert bias
    assert not any("expert_bias" in n for n in names), names
    for path, g in leaves + [("x", grad_x)]:
        g = np.asarray(g)
        assert g.dtype == BF16, (path, g.dtype)
        assert np.all(np.isfinite(g.astype(np.float32))), path
        assert np.any(g != 0), path


@pytest.mark.parametrize("name", ["gelu_glu_bias"])
def test_jit_remat_and_functional_grads_are_bitwise_equal(name):
    """nnx.grad under nnx.jit, with and without nnx.remat around the layer call, and jax.grad
    of the functional (split / merge) form under jax.jit: all bitwise identical."""
    config = CONFIGS[name]
    moe = make_moe(config, HIDDEN, BF16, seed=31)
    x = jnp.asarray(random_x(32, BF16))
    weights = jnp.asarray(random_x(33, np.float32))
    plain, plain_x = nnx_grads(moe, x, weights)
    remat, remat_x = nnx_grads_remat(moe, x, weights)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    @jax.jit
    def functional(params, x):
        def loss(params, x):
            return _grad_loss(nnx.merge(graphdef, params, rest), x, weights)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    func, func_x = functional(params, x)
    flat = [jax.tree_util.tree_leaves(t) for t in (plain, remat, func)]
    assert len(flat[0]) == len(flat[1]) == len(flat[2]) > 0
    for a, b, c in zip(*flat):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(plain_x), np.asarray(remat_x))
    np.testing.assert_array_equal(np.asarray(plain_x), np.asarray(func_x))
    assert np.any(np.asarray(plain_x) != 0)


# ------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small_moe():
    return make_moe(CONFIGS["mixtral"], HIDDEN, BF16, seed=41)


@pytest.mark.parametrize(
    "x,error,message",
    [
        (np.float32(1.0), ValueError, "hidden_size"),  # rank 0
        (np.zeros((4, HIDDEN + 1), np.float32), ValueError, "hidden_size"),  # last dim
        (np.zeros((4, HIDDEN // 2), np.float32), ValueError, str(HIDDEN)),
        (np.zeros((4, HIDDEN), np.int32), TypeError, "floating"),  # int dtype
        (np.zeros((4, HIDDEN), bool), TypeError, "floating"),
        (np.zeros((0, HIDDEN), np.float32), ValueError, "no tokens"),  # empty
        (np.zeros((2, 0, HIDDEN), np.float32), ValueError, "no tokens"),
    ],
    ids=["rank0", "last_dim_plus1", "last_dim_half", "int32", "bool", "empty", "empty_3d"],
)
def test_bad_input_raises_clear_error(small_moe, x, error, message):
    with pytest.raises(error, match=message):
        small_moe(jnp.asarray(x))


@pytest.mark.parametrize(
    "mask",
    [
        np.zeros((4,), bool),  # wrong shape (x is [4, 8, H])
        np.zeros((8, 4), bool),  # transposed
        np.zeros((4, 8, 1), bool),
        np.zeros((4, 8), np.int32),  # wrong dtype
        np.zeros((4, 8), np.float32),
    ],
    ids=["rank1", "transposed", "extra_axis", "int32", "float32"],
)
def test_bad_padding_mask_raises_clear_error(small_moe, mask):
    x = jnp.zeros((4, 8, HIDDEN), jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match="padding_mask"):
        small_moe(x, padding_mask=jnp.asarray(mask))


def test_seq_aux_loss_needs_a_sequence_axis():
    moe = make_moe(CONFIGS["deepseek"], HIDDEN, BF16, seed=42)
    with pytest.raises(ValueError, match="seq_aux_loss"):
        moe(jnp.zeros((HIDDEN,), jnp.bfloat16))


@pytest.mark.parametrize("name", ["mixtral", "deepseek", "gelu_glu_bias"])
def test_nan_token_is_isolated(name):
    """A NaN in one token's input makes that token's output non-finite and leaves every other
    token's output bitwise unchanged (no dropping configured: nothing couples tokens)."""
    config = CONFIGS[name]
    moe = make_moe(config, HIDDEN, BF16, seed=51)
    x = random_x(52, BF16)
    y_clean, _ = forward(moe, jnp.asarray(x))
    poisoned = x.copy()
    poisoned[1, 5, 3] = np.nan
    y_nan, _ = forward(moe, jnp.asarray(poisoned))
    y_clean, y_nan = np.asarray(y_clean), np.asarray(y_nan)
    assert not np.all(np.isfinite(y_nan[1, 5].astype(np.float32)))
    others = np.ones((BATCH, SEQ), bool)
    others[1, 5] = False
    np.testing.assert_array_equal(y_nan[others], y_clean[others])


# ------------------------------------------------------------------------------------ MXFP8
def mxfp8_operands(config: MoEConfig):
    """The loop reference's GEMM operand hook for the MXFP8 options, quantized by the
    independent NumPy quantizer (tests/support/mxfp8_numpy_reference.py), blocks of 32 along each GEMM's
    contraction axis (docs/numerics.md, "MXFP8"): the tokens along H (MXFP8 dispatch or
    experts), and with MXFP8 experts the weights along K and the activation along F."""
    experts = config.expert_precision == "mxfp8"
    quantized = {
        "tokens": (experts or config.dispatch_dtype == "mxfp8") and -1,
        "fc1": experts and 0,
        "activation": experts and -1,
        "fc2": experts and 0,
    }

    def operand(name, value):
        axis = quantized[name]
        if axis is False:
            return value
        data, scale = mx_ref.quantize(np.asarray(value, np.float32), axis=axis)
        return mx_ref.dequantize(data, scale, axis=axis, dtype=value.dtype)

    return operand


MXFP8_OPTIONS = {
    "all": dict(expert_precision="mxfp8", dispatch_dtype="mxfp8", combine_bwd_dtype="mxfp8"),
    "experts": dict(expert_precision="mxfp8"),
    "dispatch": dict(dispatch_dtype="mxfp8"),
}


@pytest.mark.parametrize("options", list(MXFP8_OPTIONS))
def test_mxfp8_layer_against_the_loop_reference_with_independent_quantization(options):
    """The MXFP8 layer's forward against the loop reference fed operands quantized by the NumPy
    quantizer: nothing of jaxmoe's routing, plan, dispatch, combine or quantizer is shared.
    Control: the same check fails against the unquantized (bf16) reference."""
    config = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=32,
        expert_row_alignment=32,
        **MXFP8_OPTIONS[options],
    )
    moe = make_moe(config, HIDDEN, BF16)
    x = random_x(3, BF16)
    y, _ = forward(moe, jnp.asarray(x))
    tokens = x.reshape(-1, HIDDEN)
    params = reference_params(moe)
    expected = ref.moe_forward(
        tokens, params, config, BF16, x.shape[:-1], operand=mxfp8_operands(config)
    )
    decision = router_decision(moe, jnp.asarray(tokens), x.shape[:-1])
    np.testing.assert_array_equal(np.asarray(decision.indices), expected.routing.indices)
    assert_close_to_reference(y, expected, BF16, where=options, flip_step=2.0**-3)
    unquantized = ref.moe_forward(tokens, params, config, BF16, x.shape[:-1])
    with pytest.raises(AssertionError):
        assert_close_to_reference(y, unquantized, BF16, where=options, flip_step=2.0**-3)
