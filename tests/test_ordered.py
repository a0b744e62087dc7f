"""`jaxmoe.ordered.sum_in_order`: a pairwise tree fixed by the shape, bitwise equal to a NumPy
loop of the same tree, with an elementwise gradient; the auxiliary losses use it for every sum
over tokens."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import MoEConfig, routing
from jaxmoe.ordered import sum_in_order

from bitwise import assert_bitwise, differs

F32 = np.float32


def pairwise_numpy(x: np.ndarray) -> np.float32:
    """The documented tree on a 1-D array, one float32 add at a time."""
    values = [F32(v) for v in x]
    if not values:
        return F32(0)
    while len(values) > 1:
        half = len(values) // 2
        pairs = [F32(values[i] + values[half + i]) for i in range(half)]
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
