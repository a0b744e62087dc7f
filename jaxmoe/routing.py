"""Router: logits -> top-k experts, probabilities, capacity dropping and auxiliary losses.

Megatron-Core 0.19.2 semantics (docs/numerics.md, "Routing"): score math in fp32, final
probabilities cast back to the logits dtype, expert bias affects selection only, no
renormalisation after dropping.

Ties: every top-k in this module (experts per token, groups per token, tokens per expert under
capacity) is resolved toward the LOWER index, i.e. the earlier expert / group / token wins, tokens
counted in Megatron's sequence-major order (`megatron_token_order`). Megatron uses `torch.topk`,
whose tie order is an implementation detail; this rule is jaxmoe's definition.

Every float sum here, forward and backward, is `jaxmoe.ordered`'s (a fixed pairwise order): an
XLA reduce's order is chosen per compilation on the GPU, and two compilations of one step would
differ in the last bit. The top-k gathers' gradients scatter one value per target (exact in any
order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxmoe.config import MoEConfig
from jaxmoe.ops.dense import dense
from jaxmoe.ops.device import on_gpu
from jaxmoe.ordered import broadcast_in_order, sum_in_order

F32 = jnp.float32
# The name scope of the top-k selections: their gradients scatter one value per target.
SELECTION = "top_k_selection"


@struct.dataclass
class Routing:
    """The routing decision for T tokens.

    probs:   [T, k] routing probabilities in the logits dtype; 0 for dropped slots.
    indices: [T, k] int32 expert ids, in Megatron's top-k order (descending selection score).
    kept:    [T, k] bool, False where capacity dropping removed the (token, expert) pair.
    """

    probs: jax.Array
    indices: jax.Array
    kept: jax.Array


def router_logits(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None, router_dtype, impl: str = "auto"
) -> jax.Array:
    """Router logits [T, E]: x[T, H] @ kernel[H, E] (+ bias) accumulated in fp32, rounded once to
    `router_dtype` (the compute dtype by default, fp32 with `router_dtype='fp32'`), on
    `jaxmoe.ops.dense` (batch-invariant on the GPU kernels)."""
    return dense(x, kernel.astype(x.dtype), bias, out_dtype=router_dtype, impl=impl)


def _divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """A true IEEE division. XLA:CPU rewrites x / broadcast(d) into x * (1 / d), which rounds
    twice (0.5 / 1.0 style ties come out one ulp low); there a barrier keeps the division.
    XLA:GPU keeps the division as written (seen in the compiled Hopper program), where the
    barrier would only cost a kernel that writes the broadcast out."""
    spread = broadcast_in_order(denominator, numerator.shape)
    if not on_gpu():
        spread = jax.lax.optimization_barrier(spread)
    return numerator / spread


def _shifted_exp(logits: jax.Array) -> jax.Array:
    """exp(z - max z) over the last axis in fp32; the shift is a constant to autodiff (the
    result's uses do not depend on it)."""
    z = logits.astype(F32)
    return jnp.exp(z - jnp.max(jax.lax.stop_gradient(z), axis=-1, keepdims=True))


def _softmax(logits: jax.Array) -> jax.Array:
    """fp32 softmax over the last axis with a true division (as torch computes it)."""
    e = _shifted_exp(logits)
    return _divide(e, sum_in_order(e, axis=-1, keepdims=True))


def _logsumexp(logits: jax.Array) -> jax.Array:
    """log(sum(exp(z))) over the last axis in fp32, shifted by the row's max."""
    z = logits.astype(F32)
    shift = jnp.max(jax.lax.stop_gradient(z), axis=-1)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    return jnp.log(sum_in_order(jnp.exp(z - shift[..., None]), axis=-1)) + shift


def _scores(logits: jax.Array, score_function: str) -> jax.Array:
    """Elementwise sigmoid / sqrt(softplus) scores in fp32."""
    z = logits.astype(F32)
    if score_function == "sigmoid":
        return jax.nn.sigmoid(z)
    if score_function == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(z))
    raise ValueError(score_function)


@jax.named_scope(SELECTION)
def _top_k(scores: jax.Array, k: int, num_groups: int | None, group_topk: int | None):
    """Top-k over the last axis, optionally group-limited (Megatron `group_limited_topk`).

    Returns (values, indices) in descending order, ties toward the lower index. -0.0 and +0.0
    tie too (`lax.top_k` alone ranks +0.0 higher)."""
    scores = jnp.where(scores == 0, jnp.zeros((), scores.dtype), scores)
    if num_groups is None:
        return jax.lax.top_k(scores, k)
    num_tokens, num_experts = scores.shape
    grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
    best_in_group = jax.lax.top_k(grouped, k // group_topk)[0]
    group_scores = sum_in_order(best_in_group.astype(F32), axis=-1, dtype=scores.dtype)
    chosen_groups = jax.lax.top_k(group_scores, group_topk)[1]
    group_allowed = jnp.any(chosen_groups[:, :, None] == jnp.arange(num_groups), axis=1)
    allowed = jnp.repeat(group_allowed, num_experts // num_groups, axis=1)
    masked = jnp.where(allowed, scores, jnp.asarray(-jnp.inf, scores.dtype))
    return jax.lax.top_k(masked, k)


def topk_routing(
    logits: jax.Array, config: MoEConfig, expert_bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Megatron's `topk_routing_with_score_function`: (probs [T, k] in logits dtype, indices)."""
    k, groups = config.top_k, (config.num_groups, config.group_topk)
    if config.score_function == "softmax":
        if config.pre_softmax:
            probs, indices = _top_k(_softmax(logits), k, *groups)
        else:
            values, indices = _top_k(logits, k, *groups)
            probs = _softmax(values)
    else:
        scores = _scores(logits, config.score_function)
        if expert_bias is not None:
            indices = _top_k(scores + expert_bias.astype(F32), k, *groups)[1]
            with jax.named_scope(SELECTION):
                probs = jnp.take_along_axis(scores, indices, axis=-1)
        else:
            probs, indices = _top_k(scores, k, *groups)
        if k > 1:
            probs = _divide(probs, sum_in_order(probs, axis=-1, keepdims=True) + 1e-20)
    if config.topk_scaling_factor is not None:
        probs = probs * jnp.asarray(config.topk_scaling_factor, F32)
    return probs.astype(logits.dtype), indices.astype(jnp.int32)


def dense_probs(probs: jax.Array, indices: jax.Array, num_experts: int) -> jax.Array:
    """[T, k] probabilities -> dense [T, E] (zeros off the top-k), without a scatter."""
    one_hot = indices[..., None] == jnp.arange(num_experts, dtype=indices.dtype)
    return sum_in_order(jnp.where(one_hot, probs[..., None], 0), axis=-2).astype(probs.dtype)


def megatron_token_order(num_tokens: int, sequence_shape: tuple[int, ...] | None) -> np.ndarray:
    """[T] token ids in Megatron's token order, the order in which capacity dropping ranks them.

    jaxmoe's tokens are x[..., S, H] flattened batch-major (token b * S + s). Megatron feeds
    [S, B, H] and flattens sequence-major, so its order is: earlier sequence position first, and
    at the same position the lower (flattened leading) batch index first. `sequence_shape` is
    x.shape[:-1]; with None or a single axis ([T, H]: one sequence, or tokens already in the
    caller's order) the order is the given one."""
    if sequence_shape is None or len(sequence_shape) < 2:
        return np.arange(num_tokens)
    if math.prod(sequence_shape) != num_tokens:
        raise ValueError(
            f"sequence_shape {tuple(sequence_shape)} does not hold {num_tokens} tokens"
        )
    return np.arange(num_tokens).reshape(-1, sequence_shape[-1]).T.reshape(-1)


def capacity_keep_mask(
    probs: jax.Array,
    indices: jax.Array,
    config: MoEConfig,
    sequence_shape: tuple[int, ...] | None = None,
) -> jax.Array:
    """[T, k] bool: which routed pairs survive the per-expert capacity (all when no capacity).

    Policy "probs" keeps, per expert, the `capacity` tokens with the largest probability (ties:
    the earlier token); policy "position" keeps the earliest `capacity` routed tokens. "Earlier"
    is Megatron's token order, sequence-major (see `megatron_token_order`; `sequence_shape` is
    x.shape[:-1]), so that a layer fed Megatron's batch transposed to [B, S, H] keeps the
    tokens Megatron keeps."""
    num_tokens = probs.shape[0]
    capacity = config.capacity(num_tokens)
    if capacity is None or capacity >= num_tokens:
        return jnp.ones(indices.shape, bool)
    order = megatron_token_order(num_tokens, sequence_shape)
    probs, indices = probs[order], indices[order]
    num_experts = config.num_experts
    routed = jnp.any(indices[..., None] == jnp.arange(num_experts), axis=1)  # [T, E]
    if config.token_drop_policy == "probs":
        order_by_prob = jnp.argsort(
            -dense_probs(probs, indices, num_experts).T.astype(F32), axis=1, stable=True
        )  # [E, T]
        rank = jnp.argsort(order_by_prob, axis=1).T  # [T, E]
        keep_dense = rank < capacity
    else:
        earlier_routed = jnp.cumsum(routed, axis=0) - routed  # [T, E]
        keep_dense = earlier_routed < capacity
    return jnp.take_along_axis(keep_dense, indices, axis=1)[np.argsort(order)]


def route(
    logits: jax.Array,
    config: MoEConfig,
    expert_bias: jax.Array | None = None,
    sequence_shape: tuple[int, ...] | None = None,
) -> Routing:
    """Top-k routing plus capacity dropping (dropped pairs get probability 0, no renormalisation).

    sequence_shape: x.shape[:-1] of the layer input the T tokens come from; it fixes the token
    order of capacity dropping (see `capacity_keep_mask`). None: the given order."""
    if logits.ndim != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(f"route: logits must be [T, {config.num_experts}], got {logits.shape}")
    if (expert_bias is not None) != config.enable_expert_bias:
        raise ValueError("route: expert_bias must be given exactly when enable_expert_bias is set")
    probs, indices = topk_routing(logits, config, expert_bias)
    kept = capacity_keep_mask(probs, indices, config, sequence_shape)
    return Routing(probs=jnp.where(kept, probs, jnp.zeros_like(probs)), indices=indices, kept=kept)


def tokens_per_expert(
    routing: Routing, num_experts: int, padding_mask: jax.Array | None = None
) -> jax.Array:
    """[E] int32 count of kept (token, expert) pairs, excluding padding tokens (True = padding)."""
    kept = routing.kept if padding_mask is None else routing.kept & ~padding_mask[:, None]
    hits = (routing.indices[..., None] == jnp.arange(num_experts)) & kept[..., None]
    return jnp.sum(hits, axis=(0, 1), dtype=jnp.int32)


# ---------------------------------------------------------------------------- auxiliary losses
def aux_loss_scores(logits: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Megatron's `compute_routing_scores_for_aux_loss`: fp32 scores over all E (softmax, or
    sigmoid/sqrtsoftplus normalised over E) and the plain top-k map [T, E] (no bias, no groups,
    no dropping)."""
    if config.score_function == "softmax":
        scores = _softmax(logits)
    else:
        scores = _scores(logits, config.score_function)
        scores = _divide(scores, sum_in_order(scores, axis=-1, keepdims=True) + 1e-20)
    top = _top_k(scores, config.top_k, None, None)[1]
    routing_map = jnp.any(top[..., None] == jnp.arange(config.num_experts), axis=1)
    return scores, routing_map


def _switch_loss(scores, routing_map, num_tokens, config: MoEConfig):
    """Switch-Transformer loss: sum_e (sum_t s[t,e]) count_e * E * coeff / (k * T^2)."""
    per_expert = sum_in_order(scores, axis=-2) * jnp.sum(routing_map, axis=-2).astype(F32)
    scale = config.num_experts * config.aux_loss_coeff / (config.top_k * num_tokens * num_tokens)
    return sum_in_order(per_expert, axis=-1) * scale


def load_balancing_loss(
    logits: jax.Array,
    config: MoEConfig,
    sequence_shape: tuple[int, ...],
    padding_mask: jax.Array | None = None,
    token_counts: jax.Array | None = None,
) -> jax.Array:
    """The configured load-balancing loss (coefficient applied), an fp32 scalar.

    logits: [T, E] with T = prod(sequence_shape); for "seq_aux_loss" the last entry of
    `sequence_shape` is the sequence length S and the leading entries are sequences.
    padding_mask: [T] bool, True = padding; padding tokens are left out of the scores, the counts
    and the token totals (with "seq_aux_loss", every sequence uses the total of valid tokens
    divided by the number of sequences, as Megatron's `_apply_seq_aux_loss`).
    token_counts: for "global_aux_loss", the per-expert counts averaged over the accumulation
    window (replaces this batch's counts, as Megatron's `global_tokens_per_expert`)."""
    if config.load_balancing_type == "none" or config.aux_loss_coeff == 0:
        return jnp.zeros((), F32)
    scores, routing_map = aux_loss_scores(logits, config)
    valid = jnp.ones(logits.shape[0], bool) if padding_mask is None else ~padding_mask
    scores = jnp.where(valid[:, None], scores, 0.0)
    routing_map = routing_map & valid[:, None]
    if config.load_balancing_type == "seq_aux_loss":
        seq_len = sequence_shape[-1]
        scores = scores.reshape(-1, seq_len, config.num_experts)
        routing_map = routing_map.reshape(-1, seq_len, config.num_experts)
        num_sequences = scores.shape[0]
        tokens_per_sequence = jnp.maximum(jnp.sum(valid), 1).astype(F32) / num_sequences
        losses = _switch_loss(scores, routing_map, tokens_per_sequence, config)
        return sum_in_order(losses) / num_sequences
    num_valid = jnp.maximum(jnp.sum(valid), 1).astype(F32)
    if config.load_balancing_type == "global_aux_loss" and token_counts is not None:
        per_expert = sum_in_order(scores, axis=0) * token_counts.astype(F32)
        scale = config.num_experts * config.aux_loss_coeff / (config.top_k * num_valid * num_valid)
        return sum_in_order(per_expert) * scale
    return _switch_loss(scores, routing_map, num_valid, config)


def z_loss(
    logits: jax.Array, coeff: float | None, padding_mask: jax.Array | None = None
) -> jax.Array:
    """coeff * mean_t(logsumexp(logits_t)^2), with logsumexp rounded to the logits dtype as in
    Megatron (bf16 by default); padding tokens excluded. An fp32 scalar (0 when coeff is None)."""
    if coeff is None:
        return jnp.zeros((), F32)
    lse = _logsumexp(logits).astype(logits.dtype).astype(F32)
    valid = jnp.ones(lse.shape, bool) if padding_mask is None else ~padding_mask
    total = sum_in_order(jnp.where(valid, lse * lse, 0.0))
    return total / jnp.maximum(jnp.sum(valid), 1).astype(F32) * coeff


def update_expert_bias(
    expert_bias: jax.Array, token_counts: jax.Array, update_rate: float
) -> jax.Array:
    """Megatron's aux-loss-free update, once per optimizer step:
    bias + rate * sign(mean(c) - c) in fp32, with c the token counts accumulated over the global
    batch (after dropping, padding excluded). Underloaded experts go up; sign(0) = 0."""
    counts = token_counts.astype(F32)
    return expert_bias.astype(F32) + jnp.asarray(update_rate, F32) * jnp.sign(
        jnp.mean(counts) - counts
    )
