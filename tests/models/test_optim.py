"""The language model's loss and optimizer (jaxmoe/optim.py): values against float64 references,
bits independent of the batch layout, the mask, clipping and the weight-decay mask."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmoe
from jaxmoe.optim import (
    ClipState,
    clip_by_global_norm_in_order,
    decays,
    global_norm_in_order,
    last_gradient_norm,
    lm_loss,
    lr_schedule,
    make_optimizer,
)

from bitwise import assert_bitwise, differs

V = 259


def batch(shape, seed=0, dtype=jnp.float32, mask_fraction=0.2):
    """Logits of per-token scales from 1e-2 to 1e3 (losses of many magnitudes, whose sum's
    rounding depends on the order), random targets, a random mask."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-2, 3, shape + (1,))
    logits = jnp.asarray(rng.normal(0, 1, shape + (V,)) * scale, dtype)
    targets = jnp.asarray(rng.integers(0, V, shape), jnp.int32)
    mask = jnp.asarray(rng.random(shape) >= mask_fraction)
    return logits, targets, mask


def reference_nll(logits, targets, mask) -> float:
    """Masked mean next-token nll in float64 (numpy)."""
    x = np.asarray(jnp.asarray(logits, jnp.float32), np.float64).reshape(-1, V)
    t, m = np.asarray(targets).reshape(-1), np.asarray(mask).reshape(-1)
    top = x.max(axis=-1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=-1))
    nll = lse - x[np.arange(len(t)), t]
    return float(nll[m].sum() / max(m.sum(), 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_loss_equals_the_float64_reference(dtype):
    """fp32 arithmetic on the logits' values: within 2^-20 relative of float64 (a few ulps of
    exp/log per token and log2(n) ulps of the pairwise sums, far below it); count = mask sum;
    an empty mask gives 0 and count 0."""
    logits, targets, mask = batch((3, 37), dtype=dtype)
    loss, count = jax.jit(lm_loss)(logits, targets, mask)
    assert loss.dtype == jnp.float32 and int(count) == int(mask.sum())
    np.testing.assert_allclose(float(loss), reference_nll(logits, targets, mask), rtol=2**-20)
    loss, count = jax.jit(lm_loss)(logits, targets, jnp.zeros_like(mask))
    assert float(loss) == 0.0 and int(count) == 0


def test_loss_bits_do_not_depend_on_the_batch_layout():
    """The same tokens as [2, S], [1, 2S] and [4, S/2], each compiled separately: the same loss
    and gradient bits (the flattened positions, in row-major order, fix every sum's order).
    Control: the same tokens shuffled change the loss bits (another summation tree) for some of
    eight random orders (not every order does: a pairwise sum is often correctly rounded, and
    swapping the two rows never does, the tree's halves being those rows and a + b = b + a)."""
    logits, targets, mask = batch((2, 64), seed=3)

    def value_and_grad(shape):
        args = (logits.reshape(shape + (V,)), targets.reshape(shape), mask.reshape(shape))
        step = jax.jit(jax.value_and_grad(lambda x, t, m: lm_loss(x, t, m)[0]))
        loss, grad = step.lower(*args).compile()(*args)
        return loss, grad.reshape(logits.shape)

    loss, grad = value_and_grad((2, 64))
    for shape in ((1, 128), (4, 32)):
        other_loss, other_grad = value_and_grad(shape)
        assert_bitwise(loss, other_loss)
        assert_bitwise(grad, other_grad)
    loss_of = jax.jit(lambda x, t, m: lm_loss(x, t, m)[0])
    shuffled = []
    for seed in range(8):
        order = np.random.default_rng(seed).permutation(128)
        shuffle = lambda x: x.reshape((128,) + x.shape[2:])[order][None]
        shuffled.append(loss_of(shuffle(logits), shuffle(targets), shuffle(mask)))
    assert any(differs(loss, other) for other in shuffled)


def test_masked_positions_leave_the_loss_alone():
    """Logits and targets at masked positions change nothing (same bits); the loss over a
    mask is the loss over those positions alone; micro-batch losses with the whole batch's count
    as normalizer add up to the whole batch's mean. Control: changing an unmasked position's
    logits changes the loss."""
    logits, targets, mask = batch((2, 48), seed=2, mask_fraction=0.5)
    loss_fn = jax.jit(lm_loss)
    loss, _ = loss_fn(logits, targets, mask)
    noise = jnp.asarray(np.random.default_rng(3).normal(0, 5, logits.shape), jnp.float32)
    changed = jnp.where(mask[..., None], logits, noise)
    other_targets = jnp.where(mask, targets, (targets + 1) % V)
    assert_bitwise(loss, loss_fn(changed, other_targets, mask)[0])
    flat = np.asarray(mask).reshape(-1)
    alone, count = loss_fn(
        logits.reshape(-1, V)[flat][None],
        targets.reshape(-1)[flat][None],
        mask.reshape(-1)[flat][None],
    )
    assert int(count) == flat.sum()
    np.testing.assert_allclose(float(alone), float(loss), rtol=2**-21)
    total = jnp.sum(mask, dtype=jnp.int32)
    rows = [(logits[i : i + 1], targets[i : i + 1], mask[i : i + 1]) for i in range(2)]
    parts = [jax.jit(lm_loss)(*row, normalizer=total)[0] for row in rows]
    np.testing.assert_allclose(float(parts[0] + parts[1]), float(loss), rtol=2**-21)
    assert differs(loss, loss_fn(jnp.where(mask[..., None], noise, logits), targets, mask)[0])
    with pytest.raises(ValueError, match="same shape"):
        lm_loss(logits, targets[:, :5], mask)
    with pytest.raises(TypeError, match="loss_mask bool"):
        lm_loss(logits, targets, mask.astype(jnp.int32))


def tree(seed=4, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.normal(0, scale, (33, 5)), jnp.float32),
        "b": [jnp.asarray(rng.normal(0, scale, (7,)), jnp.bfloat16), jnp.zeros((0,), jnp.float32)],
        "c": jnp.asarray(rng.normal(0, scale, (2, 3, 4)), jnp.float32),
    }


def test_clipping_by_the_global_norm():
    """The norm equals float64's within 2^-20 and is recorded before clipping; above max_norm
    every leaf is scaled to norm max_norm (dtypes kept), below it the updates are the inputs'
    bits; None records without scaling; max_norm <= 0 is refused."""
    grads = tree(scale=3.0)
    ref = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(grads)))
    clip = clip_by_global_norm_in_order(1.0)
    state = clip.init(grads)
    assert isinstance(state, ClipState) and float(state.norm) == 0.0
    clipped, state = jax.jit(clip.update)(grads, state)
    np.testing.assert_allclose(float(state.norm), ref, rtol=2**-20)
    assert_bitwise(state.norm, global_norm_in_order(grads))
    assert jax.tree.map(lambda x: x.dtype, clipped) == jax.tree.map(lambda x: x.dtype, grads)
    np.testing.assert_allclose(float(global_norm_in_order(clipped)), 1.0, rtol=2**-7)
    unclipped, state = clip_by_global_norm_in_order(2 * ref).update(grads, state)
    for a, b in zip(jax.tree.leaves(unclipped), jax.tree.leaves(grads)):
        assert_bitwise(a, b)
    assert differs(jax.tree.leaves(clipped)[0], jax.tree.leaves(grads)[0])
    recorded, state = clip_by_global_norm_in_order(None).update(grads, state)
    assert recorded is grads and float(state.norm) == float(global_norm_in_order(grads))
    with pytest.raises(ValueError, match="clip norm must be > 0"):
        clip_by_global_norm_in_order(0.0)


def module():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(11, 32, rngs=rngs)
            self.input_norm = nnx.RMSNorm(32, rngs=rngs)
            self.proj = nnx.Linear(32, 32, rngs=rngs)
            config = jaxmoe.MoEConfig(
                num_experts=4,
                top_k=2,
                ffn_hidden_size=32,
                add_bias_linear=True,
                enable_expert_bias=True,
                score_function="sigmoid",
            )
            self.moe = jaxmoe.MoE(config, 32, param_dtype=jnp.float32, rngs=rngs)

    return Block(nnx.Rngs(0))


def test_weight_decay_reaches_the_matrices_only():
    """The mask selects kernels, embeddings and expert weights, not biases (the experts' [E, F]
    ones included), norm scales or the expert bias; an AdamW step with zero gradients moves the
    decayed parameters and leaves every other one's bits."""
    state = nnx.state(module())
    names = {
        ".".join(str(getattr(k, "key", k)) for k in path[:-1]): decays(path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    assert {n for n, d in names.items() if d} == {
        "embed.embedding",
        "proj.kernel",
        "moe.router.kernel",
        "moe.experts.fc1_kernel",
        "moe.experts.fc2_kernel",
    }
    assert {"moe.experts.fc1_bias", "moe.router.expert_bias", "input_norm.scale"} <= set(names)
    params = nnx.state(module(), nnx.Param)
    tx = make_optimizer(1e-2, 0, 10, weight_decay=0.5)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    moved = optax.apply_updates(params, updates)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, before), after in zip(flat, jax.tree.leaves(moved)):
        if decays(path, before):
            assert differs(before, after), path
        else:
            assert_bitwise(before, after)


def test_learning_rate_schedule_and_the_recorded_norm():
    """Warm-up from lr / warmup (the first update) to lr, cosine to lr * min_lr_ratio at
    total_steps and constant after; `last_gradient_norm` reads the optimizer's recorded norm;
    bad schedules are refused by name."""
    schedule = lr_schedule(2.0, 4, 12, 0.1)
    values = [float(schedule(i)) for i in range(14)]
    np.testing.assert_allclose(values[:5], [0.5, 1.0, 1.5, 2.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(values[8], 0.2 + 1.8 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(values[12:], [0.2, 0.2], rtol=1e-6)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))
    params = tree()
    tx = make_optimizer(1e-3, 2, 10)
    _, state = tx.update(tree(seed=5), tx.init(params), params)
    assert_bitwise(last_gradient_norm(state), global_norm_in_order(tree(seed=5)))
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_schedule(1.0, 11, 10, 0.1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_schedule(1.0, 1, 10, 1.5)
