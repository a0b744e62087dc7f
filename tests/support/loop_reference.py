"""A per-token numpy reference of the jaxmoe MoE layer (Megatron-Core 0.19.2 semantics).

This module is written independently of `jaxmoe` (it imports nothing from it) and is meant to be
read: every function handles ONE token (or one expert) at a time with plain Python loops, so the
semantics are visible without any sort-based permutation, padding or grouped matmul.

Sources: Megatron-Core 0.19.2's semantics as docs/numerics.md states them (sections "Routing"
to "Shared experts") and the definitions that jaxmoe fixes where Megatron is ambiguous:
  * every top-k tie goes to the LOWER index (experts, groups, and tokens under capacity);
  * capacity policy "position" keeps the earliest routed tokens; "probs" the largest probabilities
    (ties: the earlier token); "earlier" in Megatron's token order, sequence-major ([S, B]);
  * padding to capacity adds zero rows (probability 0), which change no output;
  * combine: per token, the kept expert outputs in ascending expert id, fp32 sum, one rounding;
  * weighted activation computed in fp32 and rounded once; fc2 bias as round(f32(o) + f32(b2)*p);
  * shared expert: round(act(g)*u), fc2, times round(sigmoid(round(x @ gate))), then a bf16 add.

Arithmetic model. Exact math is done in float64. A value "computed in fp32
and rounded to dtype D" is modelled as `round_to(exact, D)`, i.e. exact -> fp32 -> D. The only
difference left against a real fp32 kernel is the accumulation ORDER of the fp32 sums inside a
matmul / softmax (and fp32 transcendental approximations), which the tests bound explicitly. Where
jaxmoe's definition is a specific sequence of fp32 element-wise operations (scaling factor, fc2
bias, combine sum), the reference does those operations in np.float32, which is correctly rounded.

Config objects: anything with the attributes of `jaxmoe.MoEConfig` (duck-typed; only attributes are
read, no methods).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------------- arithmetic
def exact(a) -> np.ndarray:
    """The exact value of a float array (bf16 / fp32 -> float64 is exact)."""
    return np.asarray(a).astype(np.float64)


def round_to(value, dtype) -> np.ndarray:
    """Round an exact value the way an fp32 computation with a `dtype` output does it:
    first to fp32, then to `dtype` (a no-op for fp32)."""
    return np.asarray(value, np.float64).astype(F32).astype(np.dtype(dtype))


def softmax(z: np.ndarray) -> np.ndarray:
    z = exact(z)
    w = np.exp(z - np.max(z))
    return w / np.sum(w)


def sigmoid(z):
    z = exact(z)
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), without overflow


def sqrt_softplus(z):
    return np.sqrt(np.logaddexp(0.0, exact(z)))


def activation(z: np.ndarray, name: str) -> np.ndarray:
    """silu, exact (erf) gelu, or squared ReLU, in float64."""
    z = exact(z)
    if name == "silu":
        return z * sigmoid(z)
    if name == "gelu":
        erf = np.vectorize(math.erf)
        return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))
    if name == "squared_relu":
        return np.maximum(z, 0.0) ** 2
    raise ValueError(name)


def top_k_lower_index(values, k: int, allowed=None) -> list[int]:
    """Indices of the k largest `values` in descending order; equal values: lower index first.
    `allowed` (a bool sequence) restricts the candidates."""
    candidates = [i for i in range(len(values)) if allowed is None or allowed[i]]
    return sorted(candidates, key=lambda i: (-float(values[i]), i))[:k]


# --------------------------------------------------------------------------------- routing
@dataclasses.dataclass
class RefRouting:
    """probs [T, k] in the logits dtype (0 where dropped), indices [T, k] int, kept [T, k] bool."""

    probs: np.ndarray
    indices: np.ndarray
    kept: np.ndarray


def _select_experts(selection: np.ndarray, selection_dtype, config) -> list[int]:
    """Top-k experts of one token on `selection` scores, group-limited when configured.

    Group-limited (Megatron `group_limited_topk`): experts form `num_groups` contiguous groups; a
    group's score is the fp32 sum of its top-(k // group_topk) selection scores, cast to the
    selection dtype; only the best `group_topk` groups (ties: lower group) are eligible."""
    k = config.top_k
    if config.num_groups is None:
        return top_k_lower_index(selection, k)
    per_group = config.num_experts // config.num_groups
    best_per_group = k // config.group_topk
    group_scores = []
    for g in range(config.num_groups):
        members = selection[g * per_group : (g + 1) * per_group]
        total = np.float32(0.0)
        for i in top_k_lower_index(members, best_per_group):
            total = np.float32(total + np.float32(members[i]))  # fp32 accumulation
        group_scores.append(exact(round_to(total, selection_dtype)))
    chosen = top_k_lower_index(group_scores, config.group_topk)
    allowed = [e // per_group in chosen for e in range(config.num_experts)]
    return top_k_lower_index(selection, k, allowed)


def route_token(logits_t: np.ndarray, config, expert_bias=None) -> tuple[np.ndarray, list[int]]:
    """Megatron `topk_routing_with_score_function` for ONE token.

    logits_t: [E] in the logits dtype. Returns (probs [k] in the logits dtype, indices [k])."""
    logits_dtype = np.asarray(logits_t).dtype
    z = exact(logits_t)
    if config.score_function == "softmax":
        if config.pre_softmax:
            scores = round_to(softmax(z), F32)  # fp32 softmax over all E
            indices = _select_experts(exact(scores), F32, config)
            probs = scores[indices]  # no renormalisation
        else:
            indices = _select_experts(z, logits_dtype, config)  # top-k on the raw logits
            probs = round_to(softmax(z[indices]), F32)  # softmax over the k values
    else:
        fn = sigmoid if config.score_function == "sigmoid" else sqrt_softplus
        scores = round_to(fn(z), F32)
        selection = scores
        if expert_bias is not None:  # bias: selection only
            selection = scores + np.asarray(expert_bias, F32)  # fp32 add
        indices = _select_experts(exact(selection), F32, config)
        probs = scores[indices]
        if config.top_k > 1:
            p = exact(probs)
            probs = round_to(p / (np.sum(p) + 1e-20), F32)
    probs = np.asarray(probs, F32)
    if config.topk_scaling_factor is not None:  # in fp32, before the final cast
        probs = probs * np.float32(config.topk_scaling_factor)
    return probs.astype(logits_dtype), indices


def capacity(num_tokens: int, config) -> int | None:
    """Per-expert capacity ceil(T * k / E * capacity_factor), or None without dropping."""
    if config.capacity_factor is None:
        return None
    return math.ceil(num_tokens * config.top_k / config.num_experts * config.capacity_factor)


def megatron_order(num_tokens: int, sequence_shape=None) -> list[int]:
    """Token ids in Megatron's order. Tokens are x[..., S, H] flattened batch-major (token
    b * S + s); Megatron's input is [S, B, H] flattened sequence-major, so it visits position 0
    of every sequence (batch 0, 1, ...), then position 1, ... With sequence_shape None or of one
    axis the order is the given one."""
    if sequence_shape is None or len(sequence_shape) < 2:
        return list(range(num_tokens))
    seq_len = sequence_shape[-1]
    num_sequences = num_tokens // seq_len
    return [b * seq_len + s for s in range(seq_len) for b in range(num_sequences)]


def capacity_kept(
    probs: np.ndarray, indices: np.ndarray, config, sequence_shape=None
) -> np.ndarray:
    """[T, k] bool: which routed (token, expert) pairs fit in their expert's capacity.

    One expert at a time, tokens visited in Megatron's order (`megatron_order`). Policy "probs":
    the expert keeps the `capacity` tokens with the largest probability for it (every token
    competes; a token not routed there has probability 0; ties: the token visited first).
    Policy "position": it keeps the first `capacity` routed tokens visited. With
    `pad_expert_input_to_capacity` the kept pairs are the same; the free slots are zero rows with
    probability 0 that contribute nothing, so the reference has nothing more to do."""
    num_tokens, k = indices.shape
    kept = np.ones((num_tokens, k), bool)
    cap = capacity(num_tokens, config)
    if cap is None or cap >= num_tokens:
        return kept
    order = megatron_order(num_tokens, sequence_shape)
    for e in range(config.num_experts):
        routed = [(t, j) for t in order for j in range(k) if indices[t, j] == e]
        if config.token_drop_policy == "probs":
            prob_for_e = np.zeros(num_tokens)
            for t, j in routed:
                prob_for_e[t] = float(probs[t, j])
            winners = {order[i] for i in top_k_lower_index(prob_for_e[order], cap)}
        else:
            winners = {t for t, _ in routed[:cap]}
        for t, j in routed:
            kept[t, j] = t in winners
    return kept


def route(logits: np.ndarray, config, expert_bias=None, sequence_shape=None) -> RefRouting:
    """Route every token (one at a time), then drop over capacity (tokens in Megatron's order
    for `sequence_shape`, see `capacity_kept`); dropped probs are 0 and the surviving ones are
    NOT renormalised."""
    logits = np.asarray(logits)
    probs, indices = [], []
    for t in range(logits.shape[0]):
        p, i = route_token(logits[t], config, expert_bias)
        probs.append(p)
        indices.append(i)
    probs = np.stack(probs)
    indices = np.asarray(indices, np.int64)
    kept = capacity_kept(probs, indices, config, sequence_shape)
    probs = np.where(kept, probs, np.zeros_like(probs))
    return RefRouting(probs=probs, indices=indices, kept=kept)


def tokens_per_expert(routing: RefRouting, num_experts: int, padding_mask=None) -> np.ndarray:
    """[E] number of kept (token, expert) pairs, padding tokens (mask True) left out."""
    counts = np.zeros(num_experts, np.int64)
    for t in range(routing.indices.shape[0]):
        if padding_mask is not None and padding_mask[t]:
            continue
        for j in range(routing.indices.shape[1]):
            if routing.kept[t, j]:
                counts[routing.indices[t, j]] += 1
    return counts


# --------------------------------------------------------------------------------- aux losses
def aux_scores_and_map(logits: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """Megatron `compute_routing_scores_for_aux_loss`, token by token: scores over all E (softmax,
    or sigmoid / sqrt-softplus normalised over E) and the plain top-k map (no expert bias, no
    groups, no dropping). The top-k is taken on the fp32 scores."""
    logits = np.asarray(logits)
    num_tokens, num_experts = logits.shape
    scores = np.zeros((num_tokens, num_experts))
    routing_map = np.zeros((num_tokens, num_experts), bool)
    for t in range(num_tokens):
        if config.score_function == "softmax":
            s = softmax(logits[t])
        else:
            fn = sigmoid if config.score_function == "sigmoid" else sqrt_softplus
            raw = fn(logits[t])
            s = raw / (np.sum(raw) + 1e-20)
        scores[t] = s
        routing_map[t, top_k_lower_index(exact(round_to(s, F32)), config.top_k)] = True
    return scores, routing_map


def _switch_loss(scores, routing_map, num_tokens, config) -> float:
    """sum_e (sum_t s[t, e]) * count_e * E * coeff / (k * T^2)."""
    total = 0.0
    for e in range(config.num_experts):
        total += scores[:, e].sum() * routing_map[:, e].sum()
    return (
        total
        * config.num_experts
        * config.aux_loss_coeff
        / (config.top_k * num_tokens * num_tokens)
    )


def load_balancing_loss(logits, config, sequence_shape, padding_mask=None) -> float:
    """The configured loss ("aux_loss" or "seq_aux_loss"), coefficient applied, in float64.

    Padding tokens (mask True) are removed from the scores, the counts and the token total.
    "seq_aux_loss": tokens are [..., S] sequences (last entry of `sequence_shape` = S); each
    sequence gets the switch loss with its own counts, and the result is the mean over the B
    sequences. The token total of every sequence is (all valid tokens) / B, as in Megatron's
    `_apply_seq_aux_loss`; without padding that is S, Megatron's [S, B*E] reshape divided by B."""
    logits = np.asarray(logits)
    if config.load_balancing_type == "none" or config.aux_loss_coeff == 0:
        return 0.0
    scores, routing_map = aux_scores_and_map(logits, config)
    valid = np.ones(logits.shape[0], bool) if padding_mask is None else ~np.asarray(padding_mask)
    scores = scores * valid[:, None]
    routing_map = routing_map & valid[:, None]
    if config.load_balancing_type == "seq_aux_loss":
        seq_len = sequence_shape[-1]
        num_sequences = logits.shape[0] // seq_len
        tokens_per_sequence = max(int(valid.sum()), 1) / num_sequences
        losses = []
        for start in range(0, logits.shape[0], seq_len):
            rows = slice(start, start + seq_len)
            losses.append(
                _switch_loss(scores[rows], routing_map[rows], tokens_per_sequence, config)
            )
        return float(np.mean(losses))
    if config.load_balancing_type == "aux_loss":
        return _switch_loss(scores, routing_map, max(int(valid.sum()), 1), config)
    raise NotImplementedError(config.load_balancing_type)


def z_loss(logits, coeff, padding_mask=None) -> float:
    """coeff * mean over valid tokens of logsumexp(logits_t)^2, where logsumexp is rounded to the
    logits dtype (Megatron computes it on the router-dtype logits)."""
    if coeff is None:
        return 0.0
    logits = np.asarray(logits)
    values = []
    for t in range(logits.shape[0]):
        if padding_mask is not None and padding_mask[t]:
            continue
        z = exact(logits[t])
        lse = np.max(z) + np.log(np.sum(np.exp(z - np.max(z))))
        lse = float(exact(round_to(lse, logits.dtype)))
        values.append(lse * lse)
    return coeff * (sum(values) / max(len(values), 1))


def update_expert_bias(expert_bias, token_counts, rate) -> np.ndarray:
    """bias + rate * sign(mean(c) - c), fp32; sign(0) = 0."""
    counts = np.asarray(token_counts, np.float64)
    step = np.sign(counts.mean() - counts)
    return (np.asarray(expert_bias, F32) + np.float32(rate) * step.astype(F32)).astype(F32)


# --------------------------------------------------------------------------------- the layer
@dataclasses.dataclass
class LayerParams:
    """Numpy copies of the layer's parameters, flax [in, out] layout.

    router_kernel [H, E], router_bias [E] | None, expert_bias [E] fp32 | None,
    fc1 [E, H, 2F | F] (GLU: [..., :F] gate, [..., F:] up), fc2 [E, F, H], fc1_bias [E, 2F | F],
    fc2_bias [E, H], shared_fc1 [H, 2Fs | Fs], shared_fc2 [Fs, H], shared_gate [H, 1]."""

    router_kernel: np.ndarray
    fc1: np.ndarray
    fc2: np.ndarray
    router_bias: np.ndarray | None = None
    expert_bias: np.ndarray | None = None
    fc1_bias: np.ndarray | None = None
    fc2_bias: np.ndarray | None = None
    shared_fc1: np.ndarray | None = None
    shared_fc2: np.ndarray | None = None
    shared_gate: np.ndarray | None = None


def router_logits(x: np.ndarray, params: LayerParams, config, dtype) -> np.ndarray:
    """[T, E] logits: x @ kernel (+ bias) accumulated exactly, rounded once to the router dtype
    (fp32 with router_dtype='fp32', else the compute dtype)."""
    router_dtype = F32 if config.router_dtype == "fp32" else np.dtype(dtype)
    acc = exact(x) @ exact(np.asarray(params.router_kernel).astype(dtype))
    if params.router_bias is not None:
        acc = acc + exact(np.asarray(params.router_bias).astype(F32))
    return round_to(acc, router_dtype)


def weighted_activation(h: np.ndarray, prob, config, dtype) -> np.ndarray:
    """round(act(gate) * up * p) (GLU, h = [gate; up]) or round(act(h) * p), computed exactly
    from the fp32 values and rounded once; `prob` None means no probability (shared expert)."""
    h = exact(h)
    if config.gated_linear_unit:
        half = h.shape[-1] // 2
        out = activation(h[..., :half], config.activation) * h[..., half:]
    else:
        out = activation(h, config.activation)
    if prob is not None:
        out = out * exact(np.float32(prob))
    return round_to(out, dtype)


def as_is(name: str, value: np.ndarray) -> np.ndarray:
    """The default GEMM operand hook: every operand as it is (bf16 / fp32 experts)."""
    return value


def expert_output(x_t: np.ndarray, e: int, prob, params: LayerParams, config, dtype, operand=as_is):
    """One routed expert on one token: p * (fc2(act(fc1 x + b1)) + b2) with jaxmoe's rounding:
      h = round(x @ W1[e] + b1)         (fp32 accumulation, bias inside, one rounding)
      a = round(act(gate) * up * p)     (fp32, one rounding)
      o = round(a @ W2[e])
      o = round(f32(o) + f32(b2) * f32(p))   with a bias.
    `operand(name, value)` gives each GEMM operand as the GEMM reads it ("tokens" [H], "fc1"
    [H, 2F|F], "activation" [F], "fc2" [F, H]): e.g. quantized and dequantized for MXFP8.
    Returns (o [H] in dtype, magnitude [H] = |a| @ |W2[e]| (+ |b2 p|), the sum of the absolute
    values of everything accumulated into o)."""
    w1 = operand("fc1", np.asarray(params.fc1[e]).astype(dtype))
    h = exact(operand("tokens", x_t)) @ exact(w1)
    if params.fc1_bias is not None:
        h = h + exact(np.asarray(params.fc1_bias[e]).astype(F32))
    h = round_to(h, dtype)
    a = exact(operand("activation", weighted_activation(h, prob, config, dtype)))
    w2 = exact(operand("fc2", np.asarray(params.fc2[e]).astype(dtype)))
    o = round_to(a @ w2, dtype)
    magnitude = np.abs(a) @ np.abs(w2)
    if params.fc2_bias is not None:
        scaled_bias = np.asarray(params.fc2_bias[e]).astype(F32) * np.float32(prob)
        o = (o.astype(F32) + scaled_bias).astype(dtype)
        magnitude = magnitude + np.abs(exact(scaled_bias))
    return o, magnitude


def shared_expert_output(x_t: np.ndarray, params: LayerParams, config, dtype):
    """The shared expert on one token: round(fc2(round(act(g) * u))), times
    round(sigmoid(round(x @ gate))) in the compute dtype when gated.
    Returns (out [H] in dtype, magnitude [H] as in `expert_output`)."""
    h = round_to(exact(x_t) @ exact(np.asarray(params.shared_fc1).astype(dtype)), dtype)
    a = weighted_activation(h, None, config, dtype)
    w2 = exact(np.asarray(params.shared_fc2).astype(dtype))
    out = round_to(exact(a) @ w2, dtype)
    magnitude = np.abs(exact(a)) @ np.abs(w2)
    if params.shared_gate is not None:
        logit = round_to(exact(x_t) @ exact(np.asarray(params.shared_gate).astype(dtype)), dtype)
        gate = round_to(sigmoid(logit), dtype)
        out = round_to(exact(out) * exact(gate), dtype)
        magnitude = magnitude * exact(gate)
    return out, magnitude


@dataclasses.dataclass
class RefOutput:
    """y [T, H] in the compute dtype; the routing; the logits [T, E] in the router dtype; and
    scale [T, H] = the sum of the absolute values of all products accumulated into each output
    element through the fc2 GEMMs (kept experts and shared expert, incl. the fc2 bias term):
    the natural yardstick for accumulation-order differences when y or o cancels."""

    y: np.ndarray
    routing: RefRouting
    logits: np.ndarray
    scale: np.ndarray


def moe_forward(
    x: np.ndarray, params: LayerParams, config, dtype, sequence_shape=None, operand=as_is
) -> RefOutput:
    """The whole layer, one token at a time.

    x: [T, H] (cast to the compute dtype `dtype` first, like the layer does); sequence_shape:
    the layer input's x.shape[:-1] when x was flattened from [..., S, H] (it orders the tokens
    for capacity dropping; None: the given order). Padding tokens need no special case: they
    are routed and computed like any other token (padding only changes the losses and the
    counts). `operand`: the routed experts' GEMM operand hook (`expert_output`)."""
    dtype = np.dtype(dtype)
    x = np.asarray(x).astype(dtype)
    logits = router_logits(x, params, config, dtype)
    routing = route(logits, config, params.expert_bias, sequence_shape)
    num_tokens, hidden = x.shape
    y = np.zeros((num_tokens, hidden), dtype)
    scale = np.zeros((num_tokens, hidden))
    for t in range(num_tokens):
        slots = sorted(
            (int(routing.indices[t, j]), j) for j in range(config.top_k) if routing.kept[t, j]
        )  # ascending expert id
        acc = np.zeros(hidden, F32)
        for e, j in slots:
            o, magnitude = expert_output(
                x[t], e, routing.probs[t, j], params, config, dtype, operand
            )
            acc = acc + o.astype(F32)  # fp32 accumulation
            scale[t] += magnitude
        y[t] = acc.astype(dtype)  # one rounding
        if params.shared_fc1 is not None:
            shared, magnitude = shared_expert_output(x[t], params, config, dtype)
            y[t] = round_to(exact(y[t]) + exact(shared), dtype)  # add in the compute dtype
            scale[t] += magnitude
    return RefOutput(y=y, routing=routing, logits=logits, scale=scale)
