"""The jaxmoe reference layer re-implemented in plain PyTorch, stage for stage.

Same semantics and rounding points as `jaxmoe` (see its module docstrings):
  * routing in fp32 with every top-k tie going to the LOWER index, implemented explicitly with a
    stable descending sort (never relying on torch.topk's tie order); group-limited routing,
    expert bias (selection only), scaling factor, capacity dropping ("probs"/"position", tokens
    ranked in Megatron's sequence-major order), aux / seq / global aux loss and z-loss;
  * the permutation plan: expert-major, tokens ascending, each expert block padded with zero rows
    to `expert_row_alignment` (or to capacity), the same static row count as jaxmoe;
  * dispatch and combine as mutually transposed gathers (custom autograd functions, so the
    backward pass has no scatter-add either); the combine sums a token's rows in fp32 in
    ascending expert order and rounds once;
  * expert MLP: fc1 (fp32 accumulation, one rounding) -> act(gate)*up*p in fp32 rounded once ->
    fc2; shared expert with optional sigmoid gate.
Parameters use Megatron's [out, in] layout (`bridge.megatron.MoELayerWeights` field names).
Expert GEMMs: per-expert fp32 matmuls (CPU, and GPU for non-bf16), or `torch._grouped_mm` for
bf16 on CUDA (`grouped_mm=None` picks it when available).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

import jaxmoe
from bridge import megatron
from bridge.errors import ConfigError
from bridge.te_mxfp8 import round_up
from jaxmoe.plan import buffer_rows

F32 = torch.float32


# ----------------------------------------------------------------------------------- routing
class Routing(NamedTuple):
    """probs [T, k] (logits dtype, 0 where dropped), indices [T, k] int64 in top-k order, kept
    [T, k] bool."""

    probs: torch.Tensor
    indices: torch.Tensor
    kept: torch.Tensor


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: torch.dtype
) -> torch.Tensor:
    """[T, E] = x[T, H] @ weight[E, H]^T (+ bias), fp32 accumulation, one rounding."""
    acc = x.to(F32) @ weight.to(x.dtype).to(F32).T
    if bias is not None:
        acc = acc + bias.to(F32)
    return acc.to(router_dtype)


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis, descending; equal scores are ordered by ascending index (a
    stable sort keeps the original, ascending, index order among equal keys)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _group_limited_top_k(scores, k, num_groups, group_topk):
    if num_groups is None:
        return top_k(scores, k)
    num_tokens, num_experts = scores.shape
    grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
    best_in_group = top_k(grouped, k // group_topk)[0]
    group_scores = best_in_group.to(F32).sum(dim=-1).to(scores.dtype)
    chosen = top_k(group_scores, group_topk)[1]
    group_allowed = (chosen[:, :, None] == torch.arange(num_groups, device=scores.device)).any(1)
    allowed = group_allowed.repeat_interleave(num_experts // num_groups, dim=1)
    masked = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
    return top_k(masked, k)


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    z = logits.to(F32)
    if score_function == "sigmoid":
        return torch.sigmoid(z)
    if score_function == "sqrtsoftplus":
        return torch.sqrt(torch.logaddexp(z, torch.zeros_like(z)))
    raise ValueError(score_function)


def topk_routing(
    logits: torch.Tensor, config: jaxmoe.MoEConfig, expert_bias: torch.Tensor | None = None
):
    """(probs [T, k] in the logits dtype, indices [T, k]): Megatron's
    topk_routing_with_score_function with jaxmoe's tie rule."""
    k, groups = config.top_k, (config.num_groups, config.group_topk)
    if config.score_function == "softmax":
        if config.pre_softmax:
            probs, indices = _group_limited_top_k(torch.softmax(logits.to(F32), -1), k, *groups)
        else:
            values, indices = _group_limited_top_k(logits, k, *groups)
            probs = torch.softmax(values.to(F32), dim=-1)
    else:
        scores = _scores(logits, config.score_function)
        if expert_bias is not None:
            indices = _group_limited_top_k(scores + expert_bias.to(F32), k, *groups)[1]
            probs = scores.gather(-1, indices)
        else:
            probs, indices = _group_limited_top_k(scores, k, *groups)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.topk_scaling_factor is not None:
        probs = probs * torch.tensor(config.topk_scaling_factor, dtype=F32)
    return probs.to(logits.dtype), indices


def _one_hot(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    return indices[..., None] == torch.arange(num_experts, device=indices.device)


def megatron_token_order(num_tokens: int, sequence_shape, device=None) -> torch.Tensor:
    """[T] token ids in Megatron's (sequence-major) order: for tokens of x [..., S, H] flattened
    batch-major, position s before s + 1 and, at one position, batch b before b + 1; for
    sequence_shape None or of one axis, the given order (jaxmoe's `megatron_token_order`)."""
    ids = torch.arange(num_tokens, device=device)
    if sequence_shape is None or len(sequence_shape) < 2:
        return ids
    return ids.reshape(-1, sequence_shape[-1]).T.reshape(-1)


def capacity_keep_mask(
    probs, indices, config: jaxmoe.MoEConfig, sequence_shape=None
) -> torch.Tensor:
    """[T, k] bool: pairs kept under the per-expert capacity (policy "probs": largest
    probability, ties to the earlier token; "position": earliest tokens), tokens in Megatron's
    order (`megatron_token_order` of sequence_shape = x.shape[:-1])."""
    num_tokens = probs.shape[0]
    capacity = config.capacity(num_tokens)
    if capacity is None or capacity >= num_tokens:
        return torch.ones_like(indices, dtype=torch.bool)
    order = megatron_token_order(num_tokens, sequence_shape, indices.device)
    probs, indices = probs[order], indices[order]
    one_hot = _one_hot(indices, config.num_experts)
    if config.token_drop_policy == "probs":
        dense = torch.where(one_hot, probs[..., None], torch.zeros((), dtype=probs.dtype)).sum(1)
        by_prob = torch.sort(-dense.T.to(F32), dim=1, stable=True)[1]  # [E, T]
        rank = torch.sort(by_prob, dim=1, stable=True)[1].T  # [T, E]
        keep_dense = rank < capacity
    else:
        routed = one_hot.any(1).to(torch.int64)
        keep_dense = (torch.cumsum(routed, 0) - routed) < capacity
    return keep_dense.gather(1, indices)[torch.argsort(order)]


def route(
    logits: torch.Tensor,
    config: jaxmoe.MoEConfig,
    expert_bias: torch.Tensor | None = None,
    sequence_shape=None,
) -> Routing:
    """Top-k routing plus capacity dropping (dropped pairs get probability 0); sequence_shape
    (x.shape[:-1]) fixes the token order of the dropping."""
    probs, indices = topk_routing(logits, config, expert_bias)
    kept = capacity_keep_mask(probs, indices, config, sequence_shape)
    return Routing(torch.where(kept, probs, torch.zeros_like(probs)), indices, kept)


def tokens_per_expert(routing: Routing, num_experts: int, padding_mask=None) -> torch.Tensor:
    """[E] int32 count of kept pairs, padding tokens (True) excluded."""
    kept = routing.kept if padding_mask is None else routing.kept & ~padding_mask[:, None]
    return (_one_hot(routing.indices, num_experts) & kept[..., None]).sum((0, 1)).to(torch.int32)


def aux_loss_scores(logits, config: jaxmoe.MoEConfig):
    """fp32 scores over all E and the plain top-k map [T, E] for the load-balancing loss."""
    if config.score_function == "softmax":
        scores = torch.softmax(logits.to(F32), dim=-1)
    else:
        scores = _scores(logits, config.score_function)
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    routing_map = _one_hot(top_k(scores, config.top_k)[1], config.num_experts).any(1)
    return scores, routing_map


def _switch_loss(scores, routing_map, num_tokens, config):
    per_expert = scores.sum(-2) * routing_map.sum(-2).to(F32)
    scale = config.num_experts * config.aux_loss_coeff / (config.top_k * num_tokens * num_tokens)
    return per_expert.sum(-1) * scale


def load_balancing_loss(
    logits, config: jaxmoe.MoEConfig, sequence_shape, padding_mask=None, token_counts=None
) -> torch.Tensor:
    """The configured load-balancing loss (fp32 scalar, coefficient applied)."""
    if config.load_balancing_type == "none" or config.aux_loss_coeff == 0:
        return torch.zeros((), dtype=F32, device=logits.device)
    scores, routing_map = aux_loss_scores(logits, config)
    valid = (
        torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        if padding_mask is None
        else ~padding_mask
    )
    scores = torch.where(valid[:, None], scores, torch.zeros((), dtype=F32))
    routing_map = routing_map & valid[:, None]
    if config.load_balancing_type == "seq_aux_loss":
        seq_len = sequence_shape[-1]
        scores = scores.reshape(-1, seq_len, config.num_experts)
        routing_map = routing_map.reshape(-1, seq_len, config.num_experts)
        per_seq = valid.reshape(-1, seq_len).sum(1).clamp(min=1).to(F32)
        return _switch_loss(scores, routing_map, per_seq, config).mean()
    num_valid = valid.sum().clamp(min=1).to(F32)
    if config.load_balancing_type == "global_aux_loss" and token_counts is not None:
        scale = config.num_experts * config.aux_loss_coeff / (config.top_k * num_valid * num_valid)
        return (scores.sum(0) * token_counts.to(F32)).sum() * scale
    return _switch_loss(scores, routing_map, num_valid, config)


def z_loss(logits, coeff, padding_mask=None) -> torch.Tensor:
    """coeff * mean(logsumexp(logits)^2), the logsumexp rounded to the logits dtype."""
    if coeff is None:
        return torch.zeros((), dtype=F32, device=logits.device)
    lse = torch.logsumexp(logits.to(F32), dim=-1).to(logits.dtype).to(F32)
    valid = torch.ones_like(lse, dtype=torch.bool) if padding_mask is None else ~padding_mask
    total = torch.where(valid, lse * lse, torch.zeros((), dtype=F32)).sum()
    return total / valid.sum().clamp(min=1).to(F32) * coeff


# -------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class Plan:
    """jaxmoe's permutation plan (same fields and meaning as `jaxmoe.Plan`), int64 tensors."""

    row_slot: torch.Tensor
    row_expert: torch.Tensor
    slot_row: torch.Tensor
    combine_slot: torch.Tensor
    group_sizes: torch.Tensor
    tokens_per_group: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_slot.shape[0]

    @property
    def top_k(self) -> int:
        return self.slot_row.shape[1]

    def row_token(self) -> torch.Tensor:
        """[M] token of each row; T for padding rows."""
        return self.row_slot // self.top_k


def make_plan(routing: Routing, config: jaxmoe.MoEConfig) -> Plan:
    """Expert-major stable permutation with zero padding rows (see `jaxmoe.plan`)."""
    num_tokens, k = routing.indices.shape
    num_experts, align = config.num_experts, config.expert_row_alignment
    num_slots, num_rows = num_tokens * k, buffer_rows(num_tokens, config)
    device = routing.indices.device
    slot_expert = torch.where(routing.kept, routing.indices, num_experts).reshape(-1)
    sorted_expert, order = torch.sort(slot_expert, stable=True)
    bounds = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=device))
    sorted_start, tokens_per_group = bounds[:-1], torch.diff(bounds)
    if config.pad_expert_input_to_capacity:
        padded = torch.full(
            (num_experts,), round_up(config.capacity(num_tokens), align), device=device
        )
    else:
        padded = round_up(tokens_per_group, align)
    block_start = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), padded.cumsum(0)])
    clipped_sorted = sorted_expert.clamp(max=num_experts - 1)
    sorted_row = torch.where(
        sorted_expert < num_experts,
        block_start[clipped_sorted]
        + torch.arange(num_slots, device=device)
        - sorted_start[clipped_sorted],
        num_rows,
    )
    slot_row = torch.empty_like(sorted_row)
    slot_row[order] = sorted_row
    rows = torch.arange(num_rows, device=device)
    row_expert = torch.searchsorted(block_start[1:], rows, right=True)
    clipped = row_expert.clamp(max=num_experts - 1)
    rank = rows - block_start[clipped]
    is_real = (row_expert < num_experts) & (rank < tokens_per_group[clipped])
    row_slot = torch.where(
        is_real, order[(sorted_start[clipped] + rank).clamp(max=num_slots - 1)], num_slots
    )
    combine_key = torch.where(routing.kept, routing.indices, num_experts)
    combine_slot = torch.sort(combine_key, dim=1, stable=True)[1]
    return Plan(
        row_slot=row_slot,
        row_expert=row_expert,
        slot_row=slot_row.reshape(num_tokens, k),
        combine_slot=combine_slot,
        group_sizes=padded,
        tokens_per_group=tokens_per_group,
    )


# -------------------------------------------------------------------------- dispatch / combine
def _with_zero_row(a: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, a.new_zeros((1,) + a.shape[1:])])


def _gather_rows(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    return _with_zero_row(x)[plan.row_token()]


def _sum_rows(rows: torch.Tensor, plan: Plan, out_dtype: torch.dtype) -> torch.Tensor:
    padded = _with_zero_row(rows)
    ordered_rows = plan.slot_row.gather(1, plan.combine_slot)
    total = padded[ordered_rows[:, 0]].to(F32)
    for j in range(1, plan.top_k):
        total = total + padded[ordered_rows[:, j]].to(F32)  # a dropped slot adds +0.0
    return total.to(out_dtype)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan, ctx.dtype = plan, x.dtype
        return _gather_rows(x, plan)

    @staticmethod
    def backward(ctx, grad):
        return _sum_rows(grad, ctx.plan, ctx.dtype), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, plan):
        ctx.plan, ctx.dtype = plan, rows.dtype
        return _sum_rows(rows, plan, rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.plan).to(ctx.dtype), None


class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, plan):
        ctx.plan = plan
        return _with_zero_row(values.reshape(-1))[plan.row_slot]

    @staticmethod
    def backward(ctx, grad):
        return _with_zero_row(grad)[ctx.plan.slot_row], None


def dispatch(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """x[T, H] -> expert buffer [M, H] (zero padding rows); backward = combine."""
    return _Dispatch.apply(x, plan)


def combine(rows: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Expert buffer [M, H] -> [T, H]: fp32 sum in ascending expert order from the first row
    (a dropped slot adds +0.0), one rounding; backward = dispatch."""
    return _Combine.apply(rows, plan)


def gather_slots(values: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Per-slot values [T, k] -> per-row values [M] (0 for padding rows)."""
    return _GatherSlots.apply(values, plan)


# ------------------------------------------------------------------------------------ experts
def grouped_mm_available(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can run this GEMM: bf16 on a CUDA device of compute
    capability >= 9.0."""
    return (
        rows.is_cuda
        and rows.dtype == torch.bfloat16
        and weights.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(rows.device)[0] >= 9
    )


def grouped_linear(
    rows: torch.Tensor,
    weights: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    use_grouped_mm: bool = False,
) -> torch.Tensor:
    """out[m] = rows[m] @ weights[g(m)]^T for rows [M, K] and Megatron-layout weights [G, N, K]
    with fp32 accumulation; group g owns the next group_sizes[g] rows, rows past the last group
    give 0. The per-expert path returns fp32; `torch._grouped_mm` returns the accumulation
    rounded once to rows.dtype (its only output dtype), so use it only where that rounding comes
    next anyway (no bias)."""
    num_rows = rows.shape[0]
    if use_grouped_mm:
        # The last group also takes the trailing rows: they are zero rows, so their outputs are
        # exactly zero and they add nothing to any gradient of the weights.
        offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
        offsets[-1] = num_rows
        return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=offsets)
    chunks, start = [], 0
    for expert, size in enumerate(group_sizes.tolist()):
        block = rows[start : start + size]
        chunks.append(block.to(F32) @ weights[expert].to(F32).T)
        start += size
    chunks.append(rows.new_zeros((num_rows - start, weights.shape[1]), dtype=F32))
    return torch.cat(chunks)


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    """The non-gated activation in fp32."""
    if name == "silu":
        return F.silu(z)
    if name == "gelu":
        return F.gelu(z, approximate="none")
    if name == "squared_relu":
        return torch.square(F.relu(z))
    raise ValueError(f"unknown activation {name!r}")


def weighted_activation(h, probs, config: jaxmoe.MoEConfig) -> torch.Tensor:
    """act(gate) * up (* p) computed in fp32, rounded once to h.dtype."""
    z = h.to(F32)
    if config.gated_linear_unit:
        gate, up = z.chunk(2, dim=-1)
        out = activation(gate, config.activation) * up
    else:
        out = activation(z, config.activation)
    if probs is not None:
        out = out * probs.to(F32)[:, None]
    return out.to(h.dtype)


def _per_row(bias: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    return _with_zero_row(bias)[row_expert]


class ExpertStages(NamedTuple):
    """fc1 output h, activation a, and fc2 output of the grouped MLP (all [M, ...])."""

    fc1_output: torch.Tensor
    activation: torch.Tensor
    output: torch.Tensor


def grouped_mlp(
    rows,
    row_probs,
    plan: Plan,
    fc1_weight,
    fc2_weight,
    fc1_bias,
    fc2_bias,
    config: jaxmoe.MoEConfig,
    *,
    use_grouped_mm: bool = False,
) -> ExpertStages:
    """Every expert on its row block: h = round(fc1 + b1), a = round(act(h) * p),
    out = round(fc2) then round(out + b2 * p) with a bias."""
    dtype = rows.dtype
    h = grouped_linear(rows, fc1_weight.to(dtype), plan.group_sizes, use_grouped_mm=use_grouped_mm)
    if fc1_bias is not None:
        h = h + _per_row(fc1_bias, plan.row_expert).to(F32)
    h = h.to(dtype)
    a = weighted_activation(h, row_probs, config)
    out = grouped_linear(
        a, fc2_weight.to(dtype), plan.group_sizes, use_grouped_mm=use_grouped_mm
    ).to(dtype)
    if fc2_bias is not None:
        scaled = _per_row(fc2_bias, plan.row_expert).to(F32) * row_probs.to(F32)[:, None]
        out = (out.to(F32) + scaled).to(dtype)
    return ExpertStages(h, a, out)


def _linear(x, weight):
    return (x.to(F32) @ weight.to(x.dtype).to(F32).T).to(x.dtype)


def shared_mlp(x, fc1_weight, fc2_weight, gate_weight, config: jaxmoe.MoEConfig) -> torch.Tensor:
    """Shared expert fc2(act(fc1 x)) (same rounding points), times round(sigmoid(x @ gate))."""
    out = _linear(weighted_activation(_linear(x, fc1_weight), None, config), fc2_weight)
    if gate_weight is not None:
        out = out * torch.sigmoid(_linear(x, gate_weight).to(F32)).to(x.dtype)
    return out


# ------------------------------------------------------------------------------------- module
@dataclasses.dataclass
class MoEAux:
    """load_balancing_loss, z_loss (fp32 scalars, coefficients applied), tokens_per_expert [E]."""

    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor

    @property
    def total_loss(self) -> torch.Tensor:
        """load_balancing_loss + z_loss."""
        return self.load_balancing_loss + self.z_loss


@dataclasses.dataclass
class MoEStages:
    """The twin's intermediate values, named and shaped as jaxmoe's `MoEStages` (without the
    quantized dispatch copy)."""

    router_logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor
    kept: torch.Tensor
    plan: Plan
    dispatched_rows: torch.Tensor
    row_probs: torch.Tensor
    fc1_output: torch.Tensor
    activation: torch.Tensor
    fc2_output: torch.Tensor
    combined: torch.Tensor
    shared_output: torch.Tensor | None


_PARAM_FIELDS = (
    "router_weight",
    "router_bias",
    "fc1_weight",
    "fc1_bias",
    "fc2_weight",
    "fc2_bias",
    "shared_fc1_weight",
    "shared_fc2_weight",
    "shared_gate_weight",
)


class MoE(torch.nn.Module):
    """jaxmoe's MoE layer in PyTorch. Parameters (Megatron layout, `None` when unused):
    router_weight [E, H], router_bias [E], fc1_weight [E, 2F|F, H], fc1_bias, fc2_weight
    [E, H, F], fc2_bias, shared_fc1_weight [2Fs|Fs, H], shared_fc2_weight [H, Fs],
    shared_gate_weight [1, H]; buffer expert_bias [E] fp32.

    dtype: parameter and compute dtype. grouped_mm: use torch._grouped_mm for the expert GEMMs
    (None: when available, i.e. bf16 on a Hopper-or-newer GPU, and the experts have no biases,
    which must be added before the single rounding)."""

    def __init__(
        self,
        config: jaxmoe.MoEConfig,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        grouped_mm: bool | None = None,
    ):
        super().__init__()
        c, h = config, hidden_size
        self.config, self.hidden_size, self.dtype, self.grouped_mm = c, h, dtype, grouped_mm
        e, f1, f = c.num_experts, c.fc1_output_size, c.ffn_hidden_size
        bias = c.add_bias_linear

        def param(*shape):
            return torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))

        self.router_weight = param(e, h)
        self.router_bias = param(e) if bias else None
        self.fc1_weight, self.fc2_weight = param(e, f1, h), param(e, h, f)
        self.fc1_bias = param(e, f1) if bias else None
        self.fc2_bias = param(e, h) if bias else None
        fs = c.shared_expert_intermediate_size
        fs1 = None if fs is None else (2 * fs if c.gated_linear_unit else fs)
        self.shared_fc1_weight = param(fs1, h) if fs else None
        self.shared_fc2_weight = param(h, fs) if fs else None
        self.shared_gate_weight = param(1, h) if c.shared_expert_gate else None
        self.register_buffer(
            "expert_bias",
            torch.zeros(e, dtype=F32, device=device) if c.enable_expert_bias else None,
        )
        use_global = c.load_balancing_type == "global_aux_loss"
        self.register_buffer(
            "global_tokens_per_expert",
            torch.zeros(e, dtype=F32, device=device) if use_global else None,
        )
        self.register_buffer(
            "global_aux_steps",
            torch.zeros((), dtype=torch.int32, device=device) if use_global else None,
        )
        self.jitter_generator = (
            torch.Generator(device=device or "cpu").manual_seed(0)
            if c.input_jitter_eps is not None
            else None
        )

    # ------------------------------------------------------------------ construction helpers
    def load_weights(self, weights) -> MoE:
        """Copy every tensor of a `bridge.megatron.MoELayerWeights` into this module."""
        with torch.no_grad():
            for field in _PARAM_FIELDS + ("expert_bias",):
                target, source = getattr(self, field), getattr(weights, field)
                if (target is None) != (source is None):
                    raise ValueError(
                        f"torch_reference.MoE: {field} is "
                        f"{'missing' if source is None else 'unexpected'} for this "
                        "config"
                    )
                if target is not None:
                    if tuple(source.shape) != tuple(target.shape):
                        raise ValueError(
                            f"torch_reference.MoE: {field} has shape "
                            f"{tuple(source.shape)}, expected {tuple(target.shape)}"
                        )
                    target.copy_(source.to(target.dtype))
        return self

    @classmethod
    def from_megatron(
        cls, ckpt, layer: int, *, config=None, dtype=None, device=None, grouped_mm=None
    ) -> MoE:
        """The layer `layer` of a `bridge.megatron.MegatronCheckpoint` (config: override)."""
        weights = ckpt.layer(layer)
        config = megatron.resolve_config(None, config) if config is not None else ckpt.config
        if config is None:
            raise ConfigError("no config: the checkpoint has none saved; pass config=")
        megatron.check_layer(config, layer, weights)
        dtype = dtype or weights.fc1_weight.dtype
        return cls(
            config, weights.hidden_size, dtype=dtype, device=device, grouped_mm=grouped_mm
        ).load_weights(weights)

    @classmethod
    def from_jaxmoe(cls, moe: jaxmoe.MoE, *, device=None, grouped_mm=None) -> MoE:
        """A copy of a jaxmoe.MoE's parameters (same config, param dtype as compute dtype)."""
        weights = megatron.weights_from_moe(moe)
        dtype = weights.fc1_weight.dtype
        return cls(
            moe.config, moe.hidden_size, dtype=dtype, device=device, grouped_mm=grouped_mm
        ).load_weights(weights)

    # ----------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """(y, aux) for x [..., H]; y in the compute dtype."""
        y, aux, _ = self.forward_with_stages(x, padding_mask)
        return y, aux

    def forward_with_stages(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoEAux, MoEStages]:
        """Like forward, plus the intermediate values (`MoEStages`)."""
        c = self.config
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: x must be [..., {self.hidden_size}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size).to(self.dtype)
        flat_mask = None if padding_mask is None else padding_mask.reshape(-1)
        router_input = tokens
        if c.input_jitter_eps is not None:
            noise = torch.empty(tokens.shape, dtype=F32, device=tokens.device).uniform_(
                1 - c.input_jitter_eps, 1 + c.input_jitter_eps, generator=self.jitter_generator
            )
            router_input = (tokens.to(F32) * noise).to(tokens.dtype)
        router_dtype = F32 if c.router_dtype == "fp32" else tokens.dtype
        logits = router_logits(router_input, self.router_weight, self.router_bias, router_dtype)
        routing = route(
            logits,
            c,
            None if self.expert_bias is None else self.expert_bias.detach(),
            tuple(x.shape[:-1]),
        )
        plan = make_plan(routing, c)
        rows = dispatch(tokens, plan)
        row_probs = gather_slots(routing.probs, plan)
        if self.grouped_mm is None:
            use_grouped_mm = grouped_mm_available(rows, self.fc1_weight) and not c.add_bias_linear
        else:
            use_grouped_mm = self.grouped_mm
        expert = grouped_mlp(
            rows,
            row_probs,
            plan,
            self.fc1_weight,
            self.fc2_weight,
            self.fc1_bias,
            self.fc2_bias,
            c,
            use_grouped_mm=use_grouped_mm,
        )
        combined = combine(expert.output, plan)
        shared = (
            None
            if self.shared_fc1_weight is None
            else shared_mlp(
                tokens, self.shared_fc1_weight, self.shared_fc2_weight, self.shared_gate_weight, c
            )
        )
        y = combined if shared is None else combined + shared
        aux = MoEAux(
            self._load_balancing_loss(logits, tuple(x.shape[:-1]), flat_mask),
            z_loss(logits, c.z_loss_coeff, flat_mask),
            tokens_per_expert(routing, c.num_experts, flat_mask),
        )
        stages = MoEStages(
            router_logits=logits,
            probs=routing.probs,
            indices=routing.indices,
            kept=routing.kept,
            plan=plan,
            dispatched_rows=rows,
            row_probs=row_probs,
            fc1_output=expert.fc1_output,
            activation=expert.activation,
            fc2_output=expert.output,
            combined=combined,
            shared_output=shared,
        )
        return y.reshape(tuple(x.shape[:-1]) + (self.hidden_size,)), aux, stages

    def _load_balancing_loss(self, logits, sequence_shape, padding_mask):
        c = self.config
        if self.global_aux_steps is None:
            return load_balancing_loss(logits, c, sequence_shape, padding_mask)
        routing_map = aux_loss_scores(logits, c)[1]
        if padding_mask is not None:
            routing_map = routing_map & ~padding_mask[:, None]
        with torch.no_grad():
            self.global_tokens_per_expert += routing_map.sum(0).to(F32)
            self.global_aux_steps += 1
        counts = self.global_tokens_per_expert / self.global_aux_steps.to(F32)
        return load_balancing_loss(logits, c, sequence_shape, padding_mask, token_counts=counts)

    def reset_global_aux_state(self) -> None:
        """Start a new global_aux_loss accumulation window."""
        if self.global_aux_steps is not None:
            self.global_tokens_per_expert.zero_()
            self.global_aux_steps.zero_()
