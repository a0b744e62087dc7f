"""`jaxmoe.ordered.sum_in_order`: a pairwise tree fixed by the shape, bitwise equal to a NumPy
loop of the same tree, with an elementwise gradient; the auxiliary losses use it for every sum
over tokens."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import MoEConfig, routing
from jaxmoe.ordered import LANES, row_sums_in_order, sum_in_order
from jaxmoe.shapes import SHAPES

from bitwise import assert_bitwise, differs

F32 = np.float32


def pairwise_numpy(x: np.ndarray) -> np.float32:
    """The documented tree on a 1-D array, one float32 add at a time."""
    values = [F32(v) for v in x]
    if not values:
        return F32(0)
    while len(values) > 1:
        half = len(values) // 2
        pairs = [F32(values[2 * i] + values[2 * i + 1]) for i in range(half)]
        values = pairs + values[2 * half :]
    return values[0]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 33, 1000])
def test_equals_the_tree_bit_for_bit(n):
    magnitudes = (10.0 ** (np.arange(n) % 7 - 3)).astype(F32)  # adds that round
    x = np.random.default_rng(n).standard_normal(n).astype(F32) * magnitudes
    assert_bitwise(np.asarray(sum_in_order(x)), np.asarray(pairwise_numpy(x)))
    assert_bitwise(np.asarray(jax.jit(sum_in_order)(x)), np.asarray(pairwise_numpy(x)))


def test_any_axis_and_keepdims():
    x = np.random.default_rng(1).standard_normal((5, 6, 7)).astype(F32)
    for axis in (0, 1, 2, -1):
        out = np.asarray(sum_in_order(x, axis=axis))
        moved = np.moveaxis(x, axis, -1)
        expect = np.array([pairwise_numpy(r) for r in moved.reshape(-1, moved.shape[-1])])
        assert_bitwise(out, expect.reshape(moved.shape[:-1]))
        assert (
            sum_in_order(x, axis=axis, keepdims=True).shape
            == np.sum(x, axis=axis, keepdims=True).shape
        )
    assert sum_in_order(np.zeros((0, 3), F32), axis=0).shape == (3,)


@pytest.mark.parametrize("n", [1000, 4 * LANES * 17, LANES * 448])
def test_passes_over_memory_keep_the_tree(n):
    """Materialising the partial sums every few levels (fewer elements per GPU thread) leaves
    the tree, so the bits, unchanged."""
    magnitudes = (10.0 ** (np.arange(n) % 7 - 3)).astype(F32)
    x = np.random.default_rng(n).standard_normal(n).astype(F32) * magnitudes
    want = np.asarray(pairwise_numpy(x))
    for levels in (None, 1, 2, 4):
        assert_bitwise(
            np.asarray(
                jax.jit(sum_in_order, static_argnames="levels_per_pass")(x, levels_per_pass=levels)
            ),
            want,
        )


@pytest.mark.parametrize("n", [24, LANES * 24, LANES * 448])
def test_row_sums_add_interleaved_lanes(n):
    """row_sums_in_order: lane j sums elements j, j + 32, ... by the tree, then the 32 lane sums
    by the tree (n a multiple of 32), else the tree over the row; negative control: the plain
    tree over the row gives other bits on these rows."""
    rows = 3
    magnitudes = (10.0 ** (np.arange(n) % 7 - 3)).astype(F32)
    x = np.random.default_rng(n).standard_normal((rows, n)).astype(F32) * magnitudes
    if n % LANES:
        want = np.array([pairwise_numpy(r) for r in x])
    else:
        lanes = [[pairwise_numpy(r[j::LANES]) for j in range(LANES)] for r in x]
        want = np.array([pairwise_numpy(np.array(lane, F32)) for lane in lanes])
        assert differs(want, np.array([pairwise_numpy(r) for r in x]))
    assert_bitwise(np.asarray(jax.jit(row_sums_in_order)(x)), want)
    assert row_sums_in_order(x, keepdims=True).shape == (rows, 1)


def test_order_is_the_tree_not_left_to_right():
    """Negative control: 1 followed by eight 2^-24 is 1 left to right (each tiny add rounds
    away) but 1 + 2^-21 in the tree (the tiny values meet each other first)."""
    x = np.array([1.0] + [2.0**-24] * 8, F32)
    left_to_right = F32(0)
    for v in x:
        left_to_right = F32(left_to_right + v)
    ours = np.asarray(sum_in_order(x))
    assert_bitwise(ours, np.asarray(pairwise_numpy(x)))
    assert differs(ours, np.asarray(left_to_right))


def test_gradient_is_elementwise():
    """The gradient of a fixed-order sum is ones, with no reduce in the backward pass."""
    x = jnp.arange(10.0)
    assert_bitwise(np.asarray(jax.grad(sum_in_order)(x)), np.ones(10, F32))
    primitives = {e.primitive.name for e in jax.make_jaxpr(jax.grad(sum_in_order))(x).eqns}
    assert not primitives & {"reduce_sum", "cumsum"}


def test_rounded_to_a_dtype_inside_the_barrier():
    """dtype=: the fp32 tree rounded once, the bits of rounding the sum after it, with the
    rounding before the barrier (fusable with the adds); the gradient keeps x's dtype; an
    empty axis gives zeros of that dtype."""
    x = jax.random.normal(jax.random.key(0), (5, 7, 3), F32) * 1e3
    rounded = sum_in_order(x, axis=1, dtype=jnp.bfloat16)
    assert rounded.dtype == jnp.bfloat16
    assert_bitwise(np.asarray(rounded), np.asarray(sum_in_order(x, axis=1).astype(jnp.bfloat16)))
    assert differs(np.asarray(rounded, F32), np.asarray(sum_in_order(x, axis=1)))  # rounded
    jaxpr = jax.make_jaxpr(lambda x: sum_in_order(x, axis=1, dtype=jnp.bfloat16))(x)
    names = [e.primitive.name for e in jaxpr.eqns[0].params["call_jaxpr"].eqns]
    assert names.index("convert_element_type") < names.index("optimization_barrier")
    grad = jax.grad(lambda x: jnp.sum(sum_in_order(x, axis=1, dtype=jnp.bfloat16), dtype=F32))(x)
    assert grad.dtype == F32 and np.all(np.asarray(grad) == 1)
    empty = sum_in_order(jnp.zeros((4, 0)), axis=1, dtype=jnp.bfloat16)
    assert empty.dtype == jnp.bfloat16 and empty.shape == (4,) and not np.asarray(empty).any()


def float_sums_over(fn, *args, axis_size: int) -> list[str]:
    """Float reduce_sum equations in fn's jaxpr (and its gradient's) that reduce an axis of
    length `axis_size` (the tokens, chosen to differ from every other dimension)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("reduce_sum", "cumsum"):
                aval = eqn.invars[0].aval
                axes = eqn.params.get("axes", (eqn.params.get("axis"),))
                if jnp.issubdtype(aval.dtype, jnp.floating) and any(
                    aval.shape[a] == axis_size for a in axes
                ):
                    found.append(f"{eqn.primitive.name} {aval} axes={axes}")
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    walk(jax.make_jaxpr(jax.grad(fn))(*args).jaxpr)
    return found


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_losses_sum_over_tokens_in_order(balancing, score_function):
    """The load-balancing and z losses have no XLA reduce over the tokens (T = 37, E = 8): the
    value a user logs is the same in every compilation. Control: a jnp.sum over the tokens is
    found."""
    config = MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=16,
        score_function=score_function,
        load_balancing_type=balancing,
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    )
    logits = jax.random.normal(jax.random.key(0), (37, 8))
    counts = jnp.arange(8.0)

    def losses(logits):
        balance = routing.load_balancing_loss(logits, config, (37,), token_counts=counts)
        return balance + routing.z_loss(logits, config.z_loss_coeff)

    assert not float_sums_over(losses, logits, axis_size=37)
    assert float_sums_over(lambda v: jnp.sum(v * v), logits, axis_size=37)


LAYER_CONFIGS = {
    "softmax_capacity": dict(
        aux_loss_coeff=1e-2, z_loss_coeff=1e-3, capacity_factor=1.0, token_drop_policy="probs"
    ),
    "pre_softmax_biases": dict(
        pre_softmax=True,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation="gelu",
        capacity_factor=1.5,
        token_drop_policy="position",
        pad_expert_input_to_capacity=True,
    ),
    "deepseek_v3_style": dict(  # its config (sigmoid, groups, expert bias, gated shared expert)
        dataclasses.asdict(SHAPES["deepseek_v3_style"].config),
        num_experts=8,
        top_k=2,
        num_groups=4,
        group_topk=2,
        shared_expert_intermediate_size=128,
    ),
    "sqrtsoftplus_mxfp8": dict(
        score_function="sqrtsoftplus",
        aux_loss_coeff=1e-2,
        expert_precision="mxfp8",
        dispatch_dtype="mxfp8",
        combine_bwd_dtype="mxfp8",
        expert_row_alignment=32,
        shared_expert_intermediate_size=128,
    ),
}


def compiler_ordered_sums(jaxpr, outer_scope: str = "") -> list[str]:
    """The equations whose float result depends on an order XLA picks: reduce_sum and cumsum
    over an axis longer than 1, scatter-add (but the top-k selections' gradients, one value per
    target), and XLA dots. `outer_scope`: the name scope of the equation holding this jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        scope = f"{outer_scope}/{eqn.source_info.name_stack}"
        name = eqn.primitive.name
        aval = eqn.invars[0].aval if eqn.invars else None
        floating = any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars)
        if name == "reduce_sum" and floating:
            suspect = any(aval.shape[a] > 1 for a in eqn.params["axes"])
        elif name == "cumsum" and floating:
            suspect = aval.shape[eqn.params["axis"]] > 1
        elif name == "scatter-add" and floating:
            suspect = routing.SELECTION not in scope
        else:
            suspect = name == "dot_general"
        if suspect:
            found.append(f"{name} {aval} at {scope}")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += compiler_ordered_sums(sub, scope)
    return found


@pytest.mark.parametrize("name", LAYER_CONFIGS)
def test_training_step_has_no_compiler_ordered_sum(name):
    """The layer's training step on the kernels (traced, not run), y and every gradient: every
    float sum is `jaxmoe.ordered`'s or a kernel's, so two compilations give the same bits (on
    the H200 an XLA reduce of the probability gradient came out differently in two compilations
    of one step). Control: an XLA reduce over the output is found."""
    from flax import nnx

    from jaxmoe import MoE

    config = MoEConfig(
        **{"num_experts": 8, "top_k": 2, **LAYER_CONFIGS[name], "ffn_hidden_size": 128}
    )
    model = MoE(config, 128, param_dtype=jnp.bfloat16, gmm_impl="pallas", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (2, 40, 128)).astype(jnp.bfloat16)

    def step(total):
        def loss(params, rest, x):
            y, aux, _ = nnx.merge(graphdef, params, rest).forward_with_stages(x)
            return total(y.astype(jnp.float32)) + aux.total_loss

        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(params, rest, x).jaxpr

    assert not compiler_ordered_sums(step(lambda y: sum_in_order(jnp.ravel(y))))
    assert compiler_ordered_sums(step(jnp.sum))
