"""Router tests: hand-checked cases, randomized comparison with the per-token loop reference
(tests/support/loop_reference.py), capacity dropping, auxiliary losses, expert-bias update, config
validation and `MoEConfig.from_megatron` on the shared Megatron fixtures.

Semantics: docs/numerics.md, "Routing", "Capacity and token dropping" and "Auxiliary losses"
(Megatron-Core 0.19.2, with jaxmoe's tie rule: the lower index wins).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe import MoEConfig, routing

import loop_reference as ref  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

# Hand values: sigma(d) = 1 / (1 + e^-d) is the softmax of two logits that differ by d.
SIG1, SIG1C = 0.7310585786300049, 0.2689414213699951  # sigma(1), 1 - sigma(1)
SIG2, SIG2C = 0.8807970779778823, 0.11920292202211769  # sigma(2), 1 - sigma(2)


# ------------------------------------------------------------------------------------ helpers
@functools.partial(jax.jit, static_argnums=(1, 3))
def _route(logits, config, expert_bias=None, sequence_shape=None):
    return routing.route(logits, config, expert_bias, sequence_shape)


def route(logits, config, expert_bias=None, sequence_shape=None):
    """jaxmoe routing as numpy (probs, indices, kept); sequence_shape: the layer input's
    x.shape[:-1] (token order of capacity dropping)."""
    bias = None if expert_bias is None else jnp.asarray(expert_bias, jnp.float32)
    out = _route(jnp.asarray(logits), config, bias, sequence_shape)
    return np.asarray(out.probs), np.asarray(out.indices), np.asarray(out.kept)


@functools.partial(jax.jit, static_argnums=1)
def _topk_routing(logits, config, expert_bias=None):
    return routing.topk_routing(logits, config, expert_bias)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _load_balancing_loss(logits, config, sequence_shape, padding_mask=None):
    return routing.load_balancing_loss(logits, config, sequence_shape, padding_mask)


@functools.partial(jax.jit, static_argnums=1)
def _z_loss(logits, coeff, padding_mask=None):
    return routing.z_loss(logits, coeff, padding_mask)


def cfg(num_experts=4, top_k=2, **kw) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, ffn_hidden_size=8, top_k=top_k, **kw)


def ulp_distance(a, b) -> np.ndarray:
    """Number of representable values between a and b (same float dtype; -0 == +0)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    bits = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
    magnitude = np.int64(2 ** (8 * a.dtype.itemsize - 1) - 1)

    def key(v):
        i = v.view(bits).astype(np.int64)
        return np.where(i < 0, -(i & magnitude), i)

    return np.abs(key(a) - key(b))


def random_logits(rng, num_tokens, num_experts, dtype, scale=1.0):
    """Half Gaussian logits, half on a coarse grid (many exact ties, also after a bf16 cast).
    `+ 0.0` turns -0.0 into +0.0 (signed zeros have their own test)."""
    half = num_tokens // 2
    gauss = rng.standard_normal((half, num_experts)) * scale
    grid = np.round(rng.standard_normal((num_tokens - half, num_experts)) * 2) / 2
    return (np.concatenate([gauss, grid]) + 0.0).astype(dtype)


# ------------------------------------------------------------------------------------ hand cases
def test_softmax_post_topk_hand():
    """Top-k on the raw logits, softmax over the k selected values (sums to 1)."""
    logits = np.array(
        [
            [1, 3, 2, 0],
            [math.log(3), 0, -1, -5],
            [-1, 5, 5, 4],  # tie 5 = 5: lower index first
            [0, 0, 0, 0],
        ],
        np.float32,
    )
    probs, idx, kept = route(logits, cfg())
    np.testing.assert_array_equal(idx, [[1, 2], [0, 1], [1, 2], [0, 1]])
    np.testing.assert_allclose(
        probs, [[SIG1, SIG1C], [0.75, 0.25], [0.5, 0.5], [0.5, 0.5]], rtol=1e-6
    )
    assert kept.all()
    assert probs.dtype == np.float32


def test_topk_routing_function_hand():
    """`routing.topk_routing` (no capacity) returns [T, k] probs in the logits dtype."""
    logits = np.array([[1, 3, 2, 0]], BF16)
    probs, idx = _topk_routing(jnp.asarray(logits), cfg())
    assert probs.dtype == jnp.bfloat16 and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2]])
    np.testing.assert_array_equal(np.asarray(probs), np.array([[SIG1, SIG1C]]).astype(BF16))


def test_pre_softmax_hand_no_renormalisation():
    """Softmax over all E first, then top-k; the k probs are NOT renormalised."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.4, 0.1]])).astype(np.float32)
    probs, idx, _ = route(logits, cfg(pre_softmax=True))
    np.testing.assert_array_equal(idx, [[3, 2], [0, 2]])
    np.testing.assert_allclose(probs, [[0.4, 0.3], [0.4, 0.4]], rtol=1e-6)
    assert np.all(probs.sum(-1) < 0.81)


def test_pre_softmax_top1_hand():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])).astype(np.float32)
    probs, idx, _ = route(logits, cfg(top_k=1, pre_softmax=True))
    np.testing.assert_array_equal(idx, [[3], [0]])
    np.testing.assert_allclose(probs, [[0.4], [0.25]], rtol=1e-6)


def test_sigmoid_hand_normalised():
    """sigmoid scores; k > 1: p / (sum + 1e-20); k = 1: the raw score."""
    logits = np.array([[0, math.log(3), -math.log(3), -math.log(9)]], np.float32)
    # scores = [0.5, 0.75, 0.25, 0.1]
    probs, idx, _ = route(logits, cfg(score_function="sigmoid"))
    np.testing.assert_array_equal(idx, [[1, 0]])
    np.testing.assert_allclose(probs, [[0.6, 0.4]], rtol=1e-6)
    probs, idx, _ = route(logits, cfg(top_k=1, score_function="sigmoid"))
    np.testing.assert_array_equal(idx, [[1]])
    np.testing.assert_allclose(probs, [[0.75]], rtol=1e-6)


def test_sigmoid_epsilon_1e20_is_applied():
    """The +1e-20 in the normaliser is visible when the scores are ~1e-22."""
    logits = np.array([[-50, -50, -60, -60]], np.float32)
    s = math.exp(-50) / (1 + math.exp(-50))  # 1.9287e-22, a normal fp32 value
    probs, idx, _ = route(logits, cfg(score_function="sigmoid"))
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(probs, [[s / (2 * s + 1e-20)] * 2], rtol=1e-5)  # 0.018571
    assert probs[0, 0] < 0.02  # not 0.5


def test_sigmoid_equal_scores_normalise_to_exactly_one_half():
    """probs = scores / (scores.sum(-1) + 1e-20) in fp32 (docs/numerics.md, "Routing"). Two
    equal selected scores s give s / fl(2s + 1e-20) = s / 2s = 0.5 EXACTLY in IEEE fp32 (torch),
    for every s.
    XLA rewrites `x / broadcast(sum)` into `x * broadcast(1 / sum)`, which rounds twice and gives
    0.49999997 for s = sigmoid(0.5). Besides breaking bitwise fp32 parity with Megatron, this
    turns exact ties between tokens (both 0.5) into a strict order under capacity policy
    "probs", so the wrong token is kept."""
    logits = np.array([[0.5, 0.5, -5, -5], [1, 1, -5, -5], [2, -5, 2, -5]], np.float32)
    probs, idx, _ = route(logits, cfg(score_function="sigmoid"))
    np.testing.assert_array_equal(idx, [[0, 1], [0, 1], [0, 2]])
    np.testing.assert_array_equal(
        probs,
        np.full((3, 2), 0.5, np.float32),
        err_msg="BUG: sigmoid normalisation s / (s + s + 1e-20) is not the IEEE fp32 quotient "
        "(XLA's reciprocal-multiply rewrite); expected exactly 0.5",
    )


def test_sqrtsoftplus_hand():
    # softplus(ln(e^a - 1)) = a, so the scores are sqrt(a) = [0.5, 2, 1, ~0.07]
    logits = np.array(
        [[math.log(math.e**0.25 - 1), math.log(math.e**4 - 1), math.log(math.e - 1), -10]],
        np.float32,
    )
    probs, idx, _ = route(logits, cfg(score_function="sqrtsoftplus"))
    np.testing.assert_array_equal(idx, [[1, 2]])
    np.testing.assert_allclose(probs, [[2 / 3, 1 / 3]], rtol=1e-6)


def test_topk_scaling_factor_hand():
    logits = np.array([[math.log(3), 0, -1, -5]], np.float32)
    probs, idx, _ = route(logits, cfg(topk_scaling_factor=2.5))
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(probs, [[1.875, 0.625]], rtol=1e-6)
    logits = np.array([[0, math.log(3), -math.log(3), -math.log(9)]], np.float32)
    probs, _, _ = route(logits, cfg(score_function="sigmoid", topk_scaling_factor=2.5))
    np.testing.assert_allclose(probs, [[1.5, 1.0]], rtol=1e-6)


def test_expert_bias_changes_selection_only_hand():
    """scores [0.5, 0.75, 0.25, 0.1] + bias [0, -1, 0.3, 0] -> selects [2, 0]; the probs come
    from the UNBIASED scores: [0.25, 0.5] / 0.75."""
    logits = np.array([[0, math.log(3), -math.log(3), -math.log(9)]], np.float32)
    config = cfg(score_function="sigmoid", enable_expert_bias=True)
    probs, idx, _ = route(logits, config, np.array([0, -1, 0.3, 0], np.float32))
    np.testing.assert_array_equal(idx, [[2, 0]])
    np.testing.assert_allclose(probs, [[1 / 3, 2 / 3]], rtol=1e-6)
    # zero bias: plain sigmoid routing
    probs, idx, _ = route(logits, config, np.zeros(4, np.float32))
    np.testing.assert_array_equal(idx, [[1, 0]])
    np.testing.assert_allclose(probs, [[0.6, 0.4]], rtol=1e-6)


def test_group_limited_best_expert_in_losing_group_hand():
    """E=8 in 2 groups of 4, group_topk=1, k=2: group score = sum of its top-2 logits.
    Expert 0 has the best logit (10) but group 0 scores 10 + 0 < group 1's 7 + 6."""
    logits = np.array(
        [[10, 0, 0, 0, 6, 7, 0, 0], [10, 9, 0, 0, 6, 7, 0, 0]], np.float32
    )  # token 1: group 0 wins (19)
    config = cfg(num_experts=8, num_groups=2, group_topk=1)
    probs, idx, _ = route(logits, config)
    np.testing.assert_array_equal(idx, [[5, 4], [0, 1]])
    np.testing.assert_allclose(probs, [[SIG1, SIG1C], [SIG1, SIG1C]], rtol=1e-6)
    # Without groups the best expert is selected.
    _, idx, _ = route(logits, cfg(num_experts=8))
    np.testing.assert_array_equal(idx, [[0, 5], [0, 1]])


def test_group_limited_sigmoid_with_bias_hand():
    """The grouping uses scores + bias; E=4 in 2 groups of 2, group_topk=1, k=2."""
    # scores [0.5, 0.5, 0.75, 0.25]; bias lifts group 0: (0.5+0.2) + (0.5+0.2) > 0.75 + 0.25
    logits = np.array([[0, 0, math.log(3), -math.log(3)]], np.float32)
    config = cfg(score_function="sigmoid", enable_expert_bias=True, num_groups=2, group_topk=1)
    probs, idx, _ = route(logits, config, np.array([0.2, 0.2, 0, 0], np.float32))
    np.testing.assert_array_equal(idx, [[0, 1]])
    np.testing.assert_allclose(probs, [[0.5, 0.5]], rtol=1e-6)
    # Equal scores everywhere: the bias alone picks group 1; with zero bias the groups tie
    # (1.0 = 1.0) and the lower group wins.
    flat = np.zeros((1, 4), np.float32)
    probs, idx, _ = route(flat, config, np.array([0, 0, 0.1, 0.1], np.float32))
    np.testing.assert_array_equal(idx, [[2, 3]])
    np.testing.assert_allclose(probs, [[0.5, 0.5]], rtol=1e-6)
    _, idx, _ = route(flat, config, np.zeros(4, np.float32))
    np.testing.assert_array_equal(idx, [[0, 1]])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_ties_go_to_lower_index(dtype):
    """Exactly equal values: the lower expert index wins, in every score function and in the
    group choice (jaxmoe's definition; torch.topk leaves it unspecified)."""
    logits = np.array([[2, 2, 2, 2], [1, 3, 3, 3], [0, 1, 1, 0], [-1, -1, -2, -1]], dtype)
    _, idx, _ = route(logits, cfg())
    np.testing.assert_array_equal(idx, [[0, 1], [1, 2], [1, 2], [0, 1]])
    for extra in (
        dict(pre_softmax=True),
        dict(score_function="sigmoid"),
        dict(score_function="sqrtsoftplus"),
    ):
        _, idx, _ = route(logits, cfg(**extra))
        np.testing.assert_array_equal(idx, [[0, 1], [1, 2], [1, 2], [0, 1]], err_msg=str(extra))
    _, idx, _ = route(logits, cfg(top_k=1, pre_softmax=True))
    np.testing.assert_array_equal(idx, [[0], [1], [1], [0]])
    # groups {0,1} and {2,3} with equal group scores: group 0 wins.
    _, idx, _ = route(np.array([[1, 0, 0, 1]], dtype), cfg(num_groups=2, group_topk=1))
    np.testing.assert_array_equal(idx, [[0, 1]])
    # sigmoid + bias: equal biased scores tie as well.
    _, idx, _ = route(
        np.array([[0, 0, 0, 0]], dtype),
        cfg(score_function="sigmoid", enable_expert_bias=True),
        np.array([0, 0.5, 0.5, 0.5], np.float32),
    )
    np.testing.assert_array_equal(idx, [[1, 2]])


def test_signed_zero_logits_tie_to_lower_index():
    """-0.0 and +0.0 are equal logits (IEEE, torch.topk), so by jaxmoe's tie rule the lower index
    must win: logits [-0, +0, +0, -1] with k=2 select experts [0, 1]."""
    logits = np.array([[-0.0, 0.0, 0.0, -1.0]], np.float32)
    _, idx, _ = route(logits, cfg())
    np.testing.assert_array_equal(
        idx,
        [[0, 1]],
        err_msg="BUG: jax.lax.top_k orders +0.0 above -0.0, so the tie between equal logits "
        "-0.0 (expert 0) and +0.0 (expert 1, 2) is not resolved toward the lower index",
    )


# ------------------------------------------------------------------------------------ vs reference
def _option_config(option: str, num_experts: int, top_k: int) -> MoEConfig:
    groups = {4: 2, 8: 4, 16: 4}[num_experts]
    group_topk = 1 if top_k == 1 else 2 if num_experts > 4 else 1
    options = {
        "softmax": dict(),
        "pre_softmax": dict(pre_softmax=True),
        "sigmoid": dict(score_function="sigmoid"),
        "sqrtsoftplus": dict(score_function="sqrtsoftplus"),
        "sigmoid_bias": dict(score_function="sigmoid", enable_expert_bias=True),
        "sqrtsoftplus_bias_scale": dict(
            score_function="sqrtsoftplus", enable_expert_bias=True, topk_scaling_factor=2.5
        ),
        "softmax_groups_scale": dict(
            num_groups=groups, group_topk=group_topk, topk_scaling_factor=1.5
        ),
        "pre_softmax_groups": dict(pre_softmax=True, num_groups=groups, group_topk=group_topk),
        "sigmoid_bias_groups_scale": dict(
            score_function="sigmoid",
            enable_expert_bias=True,
            num_groups=groups,
            group_topk=group_topk,
            topk_scaling_factor=2.5,
        ),
    }
    return cfg(num_experts, top_k, **options[option])


_EK = [(4, 1), (8, 2), (8, 4), (16, 4)]  # covers E in {4, 8, 16} and k in {1, 2, 4}
_OPTIONS = [
    "softmax",
    "pre_softmax",
    "sigmoid",
    "sqrtsoftplus",
    "sigmoid_bias",
    "sqrtsoftplus_bias_scale",
    "softmax_groups_scale",
    "pre_softmax_groups",
    "sigmoid_bias_groups_scale",
]
_CASES = [(o, e, k) for o in _OPTIONS for e, k in _EK if not (o.startswith("softmax") and k == 1)]


@pytest.mark.parametrize(
    "option,num_experts,top_k", _CASES, ids=[f"{o}-E{e}-k{k}" for o, e, k in _CASES]
)
def test_route_matches_loop_reference(option, num_experts, top_k):
    """Random logits (fp32 and bf16, three seeds, Gaussian + tie-heavy grid) vs the reference.

    indices: exactly equal (including the order of the k entries).
    probs:
      bf16 logits -> bf16 probs: the score math is fp32 in both; its error (a few fp32 ulp,
        ~2^-21 relative) is far below half a bf16 ulp (2^-9), so the probs are bitwise equal
        unless the exact value lies within that error of a bf16 rounding midpoint: we require
        >= 99% bitwise and every element within 1 bf16 ulp.
      fp32 logits -> fp32 probs: the reference rounds the exact value once; XLA chains rounded
        fp32 ops (z - max, exp / logistic, sum, reciprocal-multiply, scale). The rounding of
        z - max alone costs |z - max| * 2^-24 relative after exp (up to ~8 ulp for the
        |z - max| <= 16 of these logits), so the bound is 16 fp32 ulp (1.9e-6 relative).
    """
    config = _option_config(option, num_experts, top_k)
    for dtype in (F32, BF16):
        for seed in range(3):
            rng = np.random.default_rng(1000 * seed + 10 * num_experts + top_k)
            logits = random_logits(rng, 48, num_experts, dtype, scale=2.0)
            bias = (
                (rng.standard_normal(num_experts) * 0.1).astype(np.float32)
                if config.enable_expert_bias
                else None
            )
            probs, idx, kept = route(logits, config, bias)
            expected = ref.route(logits, config, bias)
            where = f"{dtype.name} seed={seed}"
            np.testing.assert_array_equal(idx, expected.indices, err_msg=where)
            assert kept.all()
            assert probs.dtype == dtype
            ulps = ulp_distance(probs, expected.probs)
            if dtype == BF16:
                assert ulps.max() <= 1, (where, ulps.max())
                assert np.mean(ulps == 0) >= 0.99, (where, np.mean(ulps == 0))
            else:
                assert ulps.max() <= 16, (where, ulps.max())


# ------------------------------------------------------------------------------------ capacity
# T=6, E=4, k=2, capacity_factor=0.5 -> capacity = ceil(6 * 2 / 4 * 0.5) = 2.
# Top-2 of each token (softmax over the two selected logits, which differ by 1 or 2):
#   t0 [0, 1, -5, -5] -> e1 .7311, e0 .2689      t3 [2, -5, 0, -5] -> e0 .8808, e2 .1192
#   t1 [1, -5, 0, -5] -> e0 .7311, e2 .2689      t4 [-5, 2, -5, 0] -> e1 .8808, e3 .1192
#   t2 [1, -5, -5, 0] -> e0 .7311, e3 .2689      t5 [-5, 0, 1, -5] -> e2 .7311, e1 .2689
# expert 0 gets t0 .2689, t1 .7311, t2 .7311 (tie with t1), t3 .8808
#   position keeps t0, t1;  probs keeps t3, t1 (t1 beats t2 on the tie: lower token)
# expert 1 gets t0 .7311, t4 .8808, t5 .2689: position keeps t0, t4; probs keeps t4, t0
# expert 2 gets t1 .2689, t3 .1192, t5 .7311: position keeps t1, t3; probs keeps t5, t1
# expert 3 gets t2, t4: both kept.
_CAP_LOGITS = np.array(
    [
        [0, 1, -5, -5],
        [1, -5, 0, -5],
        [1, -5, -5, 0],
        [2, -5, 0, -5],
        [-5, 2, -5, 0],
        [-5, 0, 1, -5],
    ],
    np.float32,
)
_CAP_IDX = [[1, 0], [0, 2], [0, 3], [0, 2], [1, 3], [2, 1]]
_CAP_PROBS = np.array(
    [[SIG1, SIG1C], [SIG1, SIG1C], [SIG1, SIG1C], [SIG2, SIG2C], [SIG2, SIG2C], [SIG1, SIG1C]]
)
_CAP_KEPT = {
    "position": [[1, 1], [1, 1], [0, 1], [0, 1], [1, 1], [0, 0]],
    "probs": [[1, 0], [1, 1], [0, 1], [1, 0], [1, 1], [1, 0]],
}
_CAP_COUNTS_T1_PADDING = {"position": [1, 2, 1, 2], "probs": [1, 2, 1, 2]}


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_hand(policy, pad):
    config = cfg(capacity_factor=0.5, token_drop_policy=policy, pad_expert_input_to_capacity=pad)
    assert config.capacity(6) == 2
    probs, idx, kept = route(_CAP_LOGITS, config)
    np.testing.assert_array_equal(idx, _CAP_IDX)
    np.testing.assert_array_equal(kept, np.array(_CAP_KEPT[policy], bool))
    # dropped pairs get 0, kept pairs keep their value: no renormalisation
    np.testing.assert_allclose(probs, np.where(kept, _CAP_PROBS, 0.0), rtol=1e-6)
    assert np.all(probs[~kept] == 0)
    result = jaxmoe.Routing(
        probs=jnp.asarray(probs), indices=jnp.asarray(idx), kept=jnp.asarray(kept)
    )
    counts = np.asarray(routing.tokens_per_expert(result, 4))
    np.testing.assert_array_equal(counts, [2, 2, 2, 2])
    # padding tokens are left out of the counts (t1 is padding)
    mask = jnp.array([False, True, False, False, False, False])
    counts = np.asarray(routing.tokens_per_expert(result, 4, mask))
    np.testing.assert_array_equal(counts, _CAP_COUNTS_T1_PADDING[policy])
    # the reference agrees with the hand values
    expected = ref.route(_CAP_LOGITS, config)
    np.testing.assert_array_equal(expected.kept, kept)


def test_capacity_not_binding():
    """capacity >= T: nothing is dropped (T=6, k=2, E=4, factor 2 -> capacity 6)."""
    config = cfg(capacity_factor=2.0, token_drop_policy="position")
    assert config.capacity(6) == 6
    probs, idx, kept = route(_CAP_LOGITS, config)
    assert kept.all()
    np.testing.assert_allclose(probs, _CAP_PROBS, rtol=1e-6)


_CAPACITY_CASES = [
    ("position", False, "softmax"),
    ("position", True, "softmax"),
    ("probs", False, "softmax"),
    ("probs", True, "softmax"),
    ("probs", False, "sigmoid"),
    ("position", True, "pre_softmax"),
]


@pytest.mark.parametrize(
    "policy,pad,score",
    _CAPACITY_CASES,
    ids=[f"{p}-{'pad' if q else 'nopad'}-{s}" for p, q, s in _CAPACITY_CASES],
)
def test_capacity_matches_loop_reference(policy, pad, score):
    """Random tie-heavy logits, T=64, E=8, k=2 (capacity 8 with factor 0.5), as 64 tokens in the
    given order and as 4 sequences of 16 (Megatron's sequence-major token order): kept masks
    equal the reference exactly, dropped probs are 0, kept probs equal the uncapped probs
    bitwise, and the counts match (never above capacity)."""
    extra = {
        "softmax": {},
        "sigmoid": dict(score_function="sigmoid"),
        "pre_softmax": dict(pre_softmax=True),
    }[score]
    config = cfg(
        8,
        2,
        capacity_factor=0.5,
        token_drop_policy=policy,
        pad_expert_input_to_capacity=pad,
        **extra,
    )
    uncapped = cfg(8, 2, **extra)
    cap = config.capacity(64)
    assert cap == 8
    for dtype, sequence_shape in ((F32, None), (BF16, None), (F32, (4, 16)), (BF16, (4, 16))):
        for seed in range(2):
            rng = np.random.default_rng(seed)
            logits = random_logits(rng, 64, 8, dtype)
            if score == "sigmoid" and dtype == F32:
                # Exact fp32 ties of *normalised* sigmoid probs (e.g. s/(s+s) = 0.5 for
                # different s) are not reproducible by jaxmoe, see
                # test_sigmoid_equal_scores_normalise_to_exactly_one_half; no grid rows here.
                logits = (rng.standard_normal((64, 8)) * 2).astype(F32)
            logits[:16, 0] = 6  # make expert 0 oversubscribed with equal probabilities
            probs, idx, kept = route(logits, config, sequence_shape=sequence_shape)
            expected = ref.route(logits, config, sequence_shape=sequence_shape)
            free_probs, free_idx, _ = route(logits, uncapped)
            where = f"{dtype.name} seed={seed} sequence_shape={sequence_shape}"
            np.testing.assert_array_equal(idx, expected.indices, err_msg=where)
            np.testing.assert_array_equal(kept, expected.kept, err_msg=where)
            np.testing.assert_array_equal(idx, free_idx, err_msg=where)
            assert (~kept).sum() > 0, where
            assert np.all(probs[~kept] == 0), where
            np.testing.assert_array_equal(probs[kept], free_probs[kept], err_msg=where)
            result = jaxmoe.Routing(
                probs=jnp.asarray(probs), indices=jnp.asarray(idx), kept=jnp.asarray(kept)
            )
            mask = rng.random(64) < 0.25
            for m in (None, mask):
                counts = np.asarray(
                    routing.tokens_per_expert(result, 8, None if m is None else jnp.asarray(m))
                )
                np.testing.assert_array_equal(counts, ref.tokens_per_expert(expected, 8, m))
                assert counts.max() <= cap


# Token order of capacity dropping. B=2 sequences of S=3 tokens, every token routed to experts
# 0 (p .7311) and 1 (p .2689): capacity ceil(6 * 2 / 4 * 1.0) = 3 per expert. Megatron's order
# is sequence-major, (s0 b0), (s0 b1), (s1 b0), ...: tokens 0, 3, 1, 4, 2, 5 of the batch-major
# layout, so both experts keep tokens 0, 3 and 1 (both policies: the equal probabilities of
# "probs" tie and go to the earlier token). The batch-major order would keep 0, 1, 2.
_ORDER_LOGITS = np.tile(np.array([2, 1, -5, -5], np.float32), (6, 1))
_ORDER_KEPT_SEQUENCE_MAJOR = [1, 1, 0, 1, 0, 0]
_ORDER_KEPT_GIVEN_ORDER = [1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_ranks_tokens_sequence_major(policy):
    config = cfg(capacity_factor=1.0, token_drop_policy=policy)
    assert config.capacity(6) == 3
    assert routing.megatron_token_order(6, (2, 3)).tolist() == [0, 3, 1, 4, 2, 5]
    for shape, expected in (
        ((2, 3), _ORDER_KEPT_SEQUENCE_MAJOR),
        ((1, 2, 3), _ORDER_KEPT_SEQUENCE_MAJOR),
        (None, _ORDER_KEPT_GIVEN_ORDER),
        ((6,), _ORDER_KEPT_GIVEN_ORDER),
    ):
        _, idx, kept = route(_ORDER_LOGITS, config, sequence_shape=shape)
        np.testing.assert_array_equal(idx, [[0, 1]] * 6)
        np.testing.assert_array_equal(
            kept, np.repeat(np.array(expected, bool)[:, None], 2, 1), err_msg=str(shape)
        )
        np.testing.assert_array_equal(
            ref.route(_ORDER_LOGITS, config, sequence_shape=shape).kept, kept, err_msg=str(shape)
        )
    with pytest.raises(ValueError, match="does not hold 6 tokens"):
        routing.route(jnp.asarray(_ORDER_LOGITS), config, sequence_shape=(2, 4))


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_layer_keeps_the_tokens_megatron_keeps(policy):
    """A Megatron batch x_sbh [S, B, H] fed to the layer as x_sbh.transpose(1, 0, 2) ([B, S, H])
    keeps the tokens of its [S*B, H] flattening taken in the given order, i.e. Megatron's: the
    outputs agree token by token. Flattening [B, S, H] batch-major instead changes the kept
    tokens under "position"; under "probs" without ties the order does not matter."""
    config = MoEConfig(
        num_experts=8, ffn_hidden_size=16, top_k=2, capacity_factor=0.5, token_drop_policy=policy
    )
    moe = jaxmoe.MoE(config, 32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x_sbh = jax.random.normal(jax.random.key(1), (16, 4, 32), jnp.float32)
    layer = nnx.jit(lambda moe, x: moe(x)[0])
    y_sbh = np.asarray(layer(moe, x_sbh.transpose(1, 0, 2))).transpose(1, 0, 2)
    y_megatron_order = np.asarray(layer(moe, x_sbh.reshape(64, 32))).reshape(16, 4, 32)
    np.testing.assert_array_equal(y_sbh, y_megatron_order)
    x_batch_major = x_sbh.transpose(1, 0, 2).reshape(64, 32)
    y_batch_major = np.asarray(layer(moe, x_batch_major)).reshape(4, 16, 32).transpose(1, 0, 2)
    assert np.array_equal(y_batch_major, y_sbh) == (policy == "probs")


# ------------------------------------------------------------------------------------ losses
_LOSS_CASES = [
    ("aux_loss", "softmax"),
    ("aux_loss", "sigmoid"),
    ("aux_loss", "sqrtsoftplus"),
    ("seq_aux_loss", "softmax"),
    ("seq_aux_loss", "sigmoid"),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("balancing,score", _LOSS_CASES, ids=[f"{b}-{s}" for b, s in _LOSS_CASES])
def test_load_balancing_and_z_loss_match_reference(balancing, score, dtype):
    """Losses vs the reference (rtol 1e-5), with and without a padding mask; padding tokens
    are removed from scores, counts and token totals. Batch of 4 sequences of 16 tokens."""
    config = cfg(
        8,
        2,
        score_function=score,
        load_balancing_type=balancing,
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
    )
    rng = np.random.default_rng(7)
    logits = random_logits(rng, 64, 8, dtype)
    mask_equal = np.zeros((4, 16), bool)
    mask_equal[:, 12:] = True  # every sequence has 12 valid tokens
    mask_ragged = rng.random((4, 16)) < 0.3  # sequences have different valid counts
    for mask in (None, mask_equal.reshape(-1), mask_ragged.reshape(-1)):
        jmask = None if mask is None else jnp.asarray(mask)
        loss = float(_load_balancing_loss(jnp.asarray(logits), config, (4, 16), jmask))
        expected = ref.load_balancing_loss(logits, config, (4, 16), mask)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        z = float(_z_loss(jnp.asarray(logits), 1e-3, jmask))
        np.testing.assert_allclose(z, ref.z_loss(logits, 1e-3, mask), rtol=1e-5)


def test_padding_tokens_do_not_count_in_losses():
    """aux_loss and z-loss with a padding mask equal the losses of the valid tokens alone."""
    config = cfg(8, 2, aux_loss_coeff=0.01)
    rng = np.random.default_rng(8)
    logits = random_logits(rng, 64, 8, F32)
    mask = rng.random(64) < 0.3
    with_mask = float(_load_balancing_loss(jnp.asarray(logits), config, (64,), jnp.asarray(mask)))
    valid = jnp.asarray(logits[~mask])
    alone = float(_load_balancing_loss(valid, config, (valid.shape[0],)))
    np.testing.assert_allclose(with_mask, alone, rtol=1e-6)
    assert with_mask != float(_load_balancing_loss(jnp.asarray(logits), config, (64,)))
    np.testing.assert_allclose(
        float(_z_loss(jnp.asarray(logits), 1e-3, jnp.asarray(mask))),
        float(_z_loss(valid, 1e-3)),
        rtol=1e-6,
    )


def test_losses_hand_values():
    """Balanced routing: 16 tokens, E=8, k=2; token t prefers experts 2t, 2t+1 (mod 8) by
    delta = 1e-3, so every expert is in 4 top-2 sets (= T k / E). Its score is
    a = e^d / (6 + 2 e^d) on those 4 tokens and b = 1 / (6 + 2 e^d) on the other 12:
        loss = sum_e (4a + 12b) * 4 * E * coeff / (k T^2)   (= coeff for d -> 0).
    z-loss of zero logits: coeff * (ln E)^2, with ln 8 rounded to bf16 (2.078125) for bf16."""
    delta = 1e-3
    bumps = np.zeros((16, 8), np.float32)
    for t in range(16):
        bumps[t, (2 * t) % 8] = bumps[t, (2 * t + 1) % 8] = delta
    config = cfg(8, 2, aux_loss_coeff=0.01)
    a = math.exp(delta) / (6 + 2 * math.exp(delta))
    b = 1 / (6 + 2 * math.exp(delta))
    expected = 8 * (4 * a + 12 * b) * 4 * 8 * 0.01 / (2 * 16**2)
    loss = float(_load_balancing_loss(jnp.asarray(bumps), config, (16,)))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.01, rtol=1e-3)
    zeros = jnp.zeros((16, 8), jnp.float32)
    np.testing.assert_allclose(float(_z_loss(zeros, 1e-3)), 1e-3 * 4.324077125263812, rtol=1e-6)
    z_bf16 = float(_z_loss(zeros.astype(jnp.bfloat16), 1e-3))
    np.testing.assert_allclose(z_bf16, 1e-3 * 2.078125**2, rtol=1e-6)
    # disabled losses are exactly 0
    assert float(_load_balancing_loss(zeros, cfg(8, 2, aux_loss_coeff=0.0), (16,))) == 0.0
    assert (
        float(
            _load_balancing_loss(
                zeros, cfg(8, 2, aux_loss_coeff=1.0, load_balancing_type="none"), (16,)
            )
        )
        == 0.0
    )
    assert float(routing.z_loss(zeros, None)) == 0.0


def test_update_expert_bias_hand():
    """bias + rate * sign(mean(c) - c); sign(0) = 0; underloaded experts go up."""
    bias = jnp.array([0.0, 0.5, -0.25, 1.0], jnp.float32)
    counts = jnp.array([4, 2, 2, 0], jnp.int32)  # mean 2
    new = np.asarray(routing.update_expert_bias(bias, counts, 0.1))
    assert new.dtype == np.float32
    f = np.float32
    np.testing.assert_array_equal(new, [f(0) - f(0.1), f(0.5), f(-0.25), f(1) + f(0.1)])
    np.testing.assert_array_equal(new, ref.update_expert_bias(bias, counts, 0.1))
    # all equal counts: no change at all
    same = np.asarray(routing.update_expert_bias(bias, jnp.array([3, 3, 3, 3]), 0.1))
    np.testing.assert_array_equal(same, np.asarray(bias))
    # the public re-export is the same function
    assert jaxmoe.update_expert_bias is routing.update_expert_bias


# ------------------------------------------------------------------------------------ config
_INVALID = [
    ("pre_softmax", dict(top_k=1, score_function="softmax")),
    ("group_topk", dict(num_experts=8, num_groups=2, group_topk=3)),
    ("num_groups", dict(num_experts=8, num_groups=3, group_topk=1, top_k=1, pre_softmax=True)),
    ("num_groups", dict(num_experts=8, num_groups=4)),  # group_topk missing
    ("enable_expert_bias", dict(enable_expert_bias=True)),
    ("pre_softmax", dict(pre_softmax=True, score_function="sigmoid")),
    ("expert_row_alignment", dict(expert_precision="mxfp8", expert_row_alignment=1)),
    ("expert_row_alignment", dict(dispatch_dtype="mxfp8", expert_row_alignment=16)),
    ("shared_expert_gate", dict(shared_expert_gate=True)),
    ("add_bias_linear", dict(add_bias_linear=True, shared_expert_intermediate_size=8)),
    ("pad_expert_input_to_capacity", dict(pad_expert_input_to_capacity=True)),
    ("score_function", dict(score_function="softplus")),
    ("token_drop_policy", dict(token_drop_policy="random")),
    ("activation", dict(activation="relu")),
    ("load_balancing_type", dict(load_balancing_type="sinkhorn")),
    ("router_dtype", dict(router_dtype="fp64")),
    ("expert_precision", dict(expert_precision="fp8")),
    ("top_k", dict(num_experts=4, top_k=5)),
    ("num_experts", dict(num_experts=0)),
    ("capacity_factor", dict(capacity_factor=0.0)),
]


@pytest.mark.parametrize(
    "field,kwargs", _INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(_INVALID)]
)
def test_config_validation_names_the_field(field, kwargs):
    args = dict(num_experts=4, ffn_hidden_size=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        MoEConfig(**args)


def test_config_valid_combinations_and_capacity():
    config = MoEConfig(
        num_experts=16,
        ffn_hidden_size=8,
        top_k=4,
        score_function="sigmoid",
        enable_expert_bias=True,
        num_groups=4,
        group_topk=2,
        shared_expert_intermediate_size=8,
        shared_expert_gate=True,
        expert_precision="mxfp8",
        expert_row_alignment=32,
    )
    assert config.fc1_output_size == 16
    assert cfg(gated_linear_unit=False).fc1_output_size == 8
    assert cfg(8, 2).capacity(64) is None
    assert cfg(8, 2, capacity_factor=1.3).capacity(60) == math.ceil(60 * 2 / 8 * 1.3) == 20
    assert cfg(top_k=1, pre_softmax=True).top_k == 1
    with pytest.raises(ValueError, match="group_topk"):
        config.replace(group_topk=5)


# ------------------------------------------------------------------------------------ Megatron
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"


def _megatron_args(name: str) -> dict:
    path = FIXTURES / name / "config.json"
    assert path.is_file(), f"missing Megatron fixture {path}"
    return json.loads(path.read_text())


def test_from_megatron_mixtral_fp32():
    config = MoEConfig.from_megatron(_megatron_args("mixtral_fp32"))
    assert (config.num_experts, config.ffn_hidden_size, config.top_k) == (8, 256, 2)
    assert config.score_function == "softmax" and not config.pre_softmax
    assert config.router_dtype == "param"  # moe_router_dtype null
    assert config.load_balancing_type == "aux_loss" and config.aux_loss_coeff == 0.01
    assert config.z_loss_coeff is None and config.capacity_factor is None
    assert config.activation == "silu" and config.gated_linear_unit
    assert not config.add_bias_linear
    assert config.shared_expert_intermediate_size is None and not config.shared_expert_gate
    assert config.num_groups is None and config.topk_scaling_factor is None
    assert not config.enable_expert_bias
    assert config.expert_row_alignment == 1 and config.expert_precision == "bf16"


def test_from_megatron_deepseek_bf16():
    config = MoEConfig.from_megatron(_megatron_args("deepseek_bf16"))
    assert (config.num_experts, config.ffn_hidden_size, config.top_k) == (16, 128, 4)
    assert config.score_function == "sigmoid"
    assert (config.num_groups, config.group_topk) == (4, 2)
    assert config.topk_scaling_factor == 2.5
    assert config.enable_expert_bias and config.bias_update_rate == 0.001
    assert config.router_dtype == "fp32"
    assert config.load_balancing_type == "seq_aux_loss" and config.aux_loss_coeff == 0.001
    assert config.shared_expert_intermediate_size == 192 and not config.shared_expert_gate
    assert config.activation == "silu" and config.gated_linear_unit
    assert not config.add_bias_linear and config.token_drop_policy == "probs"


def test_from_megatron_nemotron_sqrelu_bf16():
    config = MoEConfig.from_megatron(_megatron_args("nemotron_sqrelu_bf16"))
    assert (config.num_experts, config.ffn_hidden_size, config.top_k) == (8, 384, 2)
    assert config.score_function == "softmax" and config.pre_softmax
    assert config.activation == "squared_relu" and not config.gated_linear_unit
    assert config.fc1_output_size == 384
    assert config.load_balancing_type == "none" and config.aux_loss_coeff == 0.0
    assert config.router_dtype == "param"


def test_from_megatron_overrides_and_activation_repr():
    args = _megatron_args("mixtral_fp32")
    args.pop("activation")  # falls back to the repr of activation_func
    config = MoEConfig.from_megatron(args, capacity_factor=1.5, token_drop_policy="position")
    assert config.activation == "silu"
    assert config.capacity_factor == 1.5 and config.token_drop_policy == "position"


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
        ("moe_latent_size", 64, "moe_latent_size"),
        ("moe_mlp_glu_interleave_size", 32, "moe_mlp_glu_interleave_size"),
        ("moe_router_dtype", "fp64", "moe_router_dtype"),
        ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
        ("activation_func_clamp_value", 7.0, "activation_func_clamp_value"),
        ("num_moe_experts", None, "num_moe_experts"),
    ],
)
def test_from_megatron_rejects_unsupported(key, value, message):
    """Options jaxmoe does not implement raise (nothing is silently ignored)."""
    args = _megatron_args("mixtral_fp32")
    args[key] = value
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_megatron(args)


def test_from_megatron_maps_mxfp8_and_blockwise_and_rejects_other_fp8():
    args = _megatron_args("deepseek_bf16")
    args.update(fp8="hybrid", fp8_recipe="delayed")
    with pytest.raises(ValueError, match="fp8"):
        MoEConfig.from_megatron(args)
    args.update(fp8_recipe="mxfp8")
    config = MoEConfig.from_megatron(args)
    assert config.expert_precision == "mxfp8" and config.expert_row_alignment == 32
    args.update(fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="blockwise with e4m3"):
        MoEConfig.from_megatron(args)  # hybrid: e5m2 gradients, not modelled
    args.update(fp8="e4m3")
    config = MoEConfig.from_megatron(args)
    assert config.expert_precision == "fp8_blockwise" and config.expert_row_alignment == 128
