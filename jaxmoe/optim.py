"""The language model's loss and optimizer, with every float sum in an order fixed by the shape.

`lm_loss` is next-token cross-entropy in fp32: the log-sum-exp over the vocabulary sums with
`jaxmoe.ordered.row_sums_in_order` and the tokens' losses with `sum_in_order`, so its bits depend
on the tokens and their row-major order alone, never on XLA's choice of reduce order (nor on how
the tokens are laid out in rows: a [2, S] batch and the same tokens as [1, 2S] give one value).

`make_optimizer` is AdamW (optax) with linear warm-up and cosine decay, weight decay on the
matrices only (`decays`), after global-norm clipping whose norm is a fixed-order sum
(`clip_by_global_norm_in_order`, which records the norm in its state: `last_gradient_norm`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.ordered import row_sums_in_order, sum_in_order

F32 = jnp.float32


def lm_loss(
    logits: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array,
    *,
    normalizer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(mean negative log-likelihood in fp32, count) of next-token targets.

    logits [..., V] (any float dtype; computed in fp32), targets [...] int, loss_mask [...] bool
    (False: the position is left out). count is the int32 number of positions in the mask; the
    mean is the masked positions' nll summed (`sum_in_order` over the flattened positions, in
    row-major order) divided by `normalizer` (None: count; an empty mask gives 0). Gradient
    accumulation passes the whole step's count as `normalizer`, so that the micro-batches'
    losses add up to the step's mean.

    Per position: logsumexp(logits) - logits[target], with the max subtracted before the
    exponentials (held out of the gradient, which does not depend on it) and the exponentials
    summed with `row_sums_in_order`."""
    if logits.ndim < 1 or targets.shape != logits.shape[:-1] or loss_mask.shape != targets.shape:
        raise ValueError(
            f"lm_loss: logits [..., V] and targets, loss_mask [...] of the same shape, got "
            f"logits {logits.shape}, targets {targets.shape}, loss_mask {loss_mask.shape}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer) or loss_mask.dtype != jnp.bool_:
        raise TypeError(
            f"lm_loss: targets must be integers and loss_mask bool, got {targets.dtype} and "
            f"{loss_mask.dtype}"
        )
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab).astype(F32)
    shift = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    lse = jnp.log(row_sums_in_order(jnp.exp(x - shift))) + shift[:, 0]
    picked = jnp.take_along_axis(x, targets.reshape(-1, 1).astype(jnp.int32), axis=-1)[:, 0]
    mask = loss_mask.reshape(-1)
    total = sum_in_order(jnp.where(mask, lse - picked, 0.0))
    count = jnp.sum(mask, dtype=jnp.int32)
    denominator = jnp.maximum(count, 1) if normalizer is None else normalizer
    return total / jnp.asarray(denominator, F32), count


def lr_schedule(
    lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> optax.Schedule:
    """Linear warm-up to `lr` over `warmup_steps` updates (the first update already at
    lr / warmup_steps, not 0), then cosine decay to lr * min_lr_ratio at `total_steps`, constant
    after. The schedule's argument is the number of updates done before this one."""
    if lr <= 0 or not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"lr must be > 0 and min_lr_ratio in [0, 1], got {lr}, {min_lr_ratio}")
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        raise ValueError(
            f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got warmup_steps="
            f"{warmup_steps}, total_steps={total_steps}"
        )
    floor = lr * min_lr_ratio

    def schedule(count):
        step = jnp.asarray(count, F32)
        warm = lr * (step + 1) / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
        cosine = floor + (lr - floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return schedule


_NO_DECAY_WORDS = ("bias", "norm")


def decays(path: tuple, leaf: Any) -> bool:
    """Whether weight decay applies to the parameter at `path` (a pytree key path): only to
    matrices (ndim >= 2: kernels, embeddings, expert weights), and to none whose path names a
    bias or a norm (a component containing "bias" or "norm": the experts' [E, F] biases, the
    router's expert bias, RMSNorm scales)."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return jnp.ndim(leaf) >= 2 and not any(w in n for n in names for w in _NO_DECAY_WORDS)


class ClipState(NamedTuple):
    """`clip_by_global_norm_in_order`'s state: the global norm of the last gradient (before
    clipping), fp32."""

    norm: jax.Array


def global_norm_in_order(tree: Any) -> jax.Array:
    """sqrt of the sum of squares of every leaf, in fp32: each leaf's squares summed with
    `sum_in_order` over its flattened elements, then the leaves' sums over the leaves in tree
    order (`jax.tree.leaves`). A leaf split over a mesh (explicit axes: the routed experts'
    gradients under `jaxmoe.models.parallel`) is gathered first, the same values and tree."""
    sums = [
        sum_in_order(jnp.square(_gathered(x).astype(F32)).reshape(-1))
        for x in jax.tree.leaves(tree)
    ]
    if not sums:
        return jnp.zeros((), F32)
    return jnp.sqrt(sum_in_order(jnp.stack(sums)))


def _gathered(x: jax.Array) -> jax.Array:
    """x replicated over its mesh: the tree's strided slices of a split array's flattened
    elements have no sharding rule."""
    sharding = jax.typeof(x).sharding
    if all(axis is None for axis in sharding.spec):
        return x
    return jax.reshard(x, NamedSharding(sharding.mesh, P()))


def clip_by_global_norm_in_order(max_norm: float | None) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with the norm of `global_norm_in_order`: every update scaled
    by max_norm / norm when norm > max_norm (None: never scaled, the norm still recorded). The
    norm before clipping is kept in the state (`ClipState`, read with `last_gradient_norm`)."""
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"clip norm must be > 0 or None, got {max_norm}")

    def init(params):
        del params
        return ClipState(jnp.zeros((), F32))

    def update(updates, state, params=None):
        del state, params
        norm = global_norm_in_order(updates)
        if max_norm is None:
            return updates, ClipState(norm)
        scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
        clipped = jax.tree.map(lambda g: (g.astype(F32) * scale).astype(g.dtype), updates)
        return clipped, ClipState(norm)

    return optax.GradientTransformation(init, update)


def last_gradient_norm(opt_state: Any) -> jax.Array:
    """The gradient norm recorded by the `ClipState` inside an optimizer state (that of
    `make_optimizer`): the last update's gradient before clipping."""
    found = [
        s.norm
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ClipState))
        if isinstance(s, ClipState)
    ]
    if len(found) != 1:
        raise ValueError(f"expected one ClipState in the optimizer state, found {len(found)}")
    return found[0]


def make_optimizer(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW on gradients clipped to global norm `clip_norm` (`clip_by_global_norm_in_order`):
    `optax.adamw` with the learning rate of `lr_schedule(lr, warmup_steps, total_steps,
    min_lr_ratio)` and decoupled weight decay (multiplied by the learning rate, as in PyTorch's
    AdamW) on the parameters `decays` selects. Every other operation is elementwise."""
    mask = lambda params: jax.tree_util.tree_map_with_path(decays, params)
    return optax.chain(
        clip_by_global_norm_in_order(clip_norm),
        optax.adamw(
            lr_schedule(lr, warmup_steps, total_steps, min_lr_ratio),
            b1=b1,
            b2=b2,
            eps=eps,
            weight_decay=weight_decay,
            mask=mask,
        ),
    )
