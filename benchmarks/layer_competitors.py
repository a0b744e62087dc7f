"""The layer benchmark's competitors: the same MoE written plainly in PyTorch (on
`torch._grouped_mm`) and in JAX (on `jax.lax.ragged_dot`), reading jaxmoe's weights.

Both follow one data path, for T tokens, E experts, top-k and M = T * k rows:
  router   logits = x @ router.kernel (fp32 accumulation, rounded to the router dtype)
  scores   softmax over the top-k logits, or sigmoid scores picked by (scores + expert bias)
           within the best groups, normalised, times the scaling factor
  permute  a stable argsort of the [M] expert ids; rows = x[order // k] (a gather)
  experts  grouped matmul fc1 -> silu(gate) * up * probability (fp32, rounded once) -> fc2
  combine  each token gathers its k rows (through the inverse permutation) and sums them in fp32
  shared   the shared expert on every token (x sigmoid gate), added to the output
  aux      the load-balancing loss (aux_loss over the batch, seq_aux_loss per sequence)
Weights are named as in jaxmoe's parameter state ("router.kernel", "experts.fc1_kernel",
"shared_experts.gate_kernel", ..., and "router.expert_bias", which takes no gradient).
`torch._grouped_mm(x [M, K], w [E, K, N], offs=int32 cumulative row ends)` multiplies each row
block by its expert's matrix; bf16 only, row strides of 16 bytes (K, N multiples of 8).
`torch_dense_gemms` is not an MoE: the expert GEMMs' FLOPs alone as dense cuBLAS matmuls, the
ceiling of any layer whose GEMMs run at cuBLAS's dense speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jaxmoe.config import MoEConfig

F32 = jnp.float32


def check_supported(config: MoEConfig) -> None:
    """Raise NotImplementedError for the config options the competitors leave out."""
    unsupported = dict(
        capacity_factor=config.capacity_factor is not None,
        add_bias_linear=config.add_bias_linear,
        pre_softmax=config.pre_softmax,
        z_loss_coeff=config.z_loss_coeff is not None,
        input_jitter_eps=config.input_jitter_eps is not None,
        activation=config.activation != "silu" or not config.gated_linear_unit,
        score_function=config.score_function not in ("softmax", "sigmoid"),
        load_balancing_type=config.load_balancing_type == "global_aux_loss",
        precision=config.expert_precision != "bf16" or config.dispatch_dtype != "bf16",
    )
    missing = [name for name, flag in unsupported.items() if flag]
    if missing:
        raise NotImplementedError(f"the competitor MoEs do not implement {missing}")


def _switch_loss(scores, routed, config: MoEConfig, seq_len: int):
    """The load-balancing loss from the fp32 scores [T, E] over all experts and the 0/1 top-k
    map [T, E] (torch tensors or JAX arrays alike): sum_e (sum_t s) (sum_t map) E coeff /
    (k tokens^2) per sequence of seq_len tokens (seq_aux_loss, then averaged) or over the
    batch."""
    tokens = seq_len if config.load_balancing_type == "seq_aux_loss" else scores.shape[0]
    scores = scores.reshape(-1, tokens, config.num_experts)
    routed = routed.reshape(-1, tokens, config.num_experts)
    per_group = (scores.sum(1) * routed.sum(1)).sum(-1)
    return per_group.mean() * (
        config.num_experts * config.aux_loss_coeff / (config.top_k * tokens * tokens)
    )


# ----------------------------------------------------------------------------------- PyTorch
def torch_moe(w: dict, x: torch.Tensor, config: MoEConfig, seq_len: int):
    """(y [T, H], aux loss fp32 scalar, expert ids [T, k]) for tokens x [T, H] (bf16)."""
    k, num_experts = config.top_k, config.num_experts
    router_kernel = w["router.kernel"]
    logits = (
        x.float() @ router_kernel.float() if config.router_dtype == "fp32" else x @ router_kernel
    )
    probs, indices = _torch_route(logits, config, w.get("router.expert_bias"))
    flat = indices.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(
        sorted_ids, torch.arange(num_experts, device=x.device), right=True
    ).to(torch.int32)
    rows = x.index_select(0, order // k)
    h = torch._grouped_mm(rows, w["experts.fc1_kernel"], offs=offs)
    gate, up = h.float().chunk(2, dim=-1)
    row_probs = probs.reshape(-1).index_select(0, order).float()
    a = (F.silu(gate) * up * row_probs[:, None]).to(x.dtype)
    out = torch._grouped_mm(a, w["experts.fc2_kernel"], offs=offs)
    inverse = torch.argsort(order)
    y = out.index_select(0, inverse).reshape(-1, k, out.shape[-1]).float().sum(1).to(x.dtype)
    if "shared_experts.fc1_kernel" in w:
        y = y + _torch_shared_expert(w, x)
    return y, _torch_aux_loss(logits, config, seq_len), indices


def _torch_route(logits, config: MoEConfig, expert_bias):
    k = config.top_k
    if config.score_function == "softmax":
        values, indices = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(values.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        selection = scores if expert_bias is None else scores + expert_bias
        if config.num_groups is not None:
            tokens, groups = selection.shape[0], config.num_groups
            grouped = selection.reshape(tokens, groups, -1)
            group_scores = grouped.topk(k // config.group_topk, dim=-1).values.sum(-1)
            chosen = group_scores.topk(config.group_topk, dim=-1).indices
            allowed = (chosen[:, :, None] == torch.arange(groups, device=logits.device)).any(1)
            selection = selection.masked_fill(
                ~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf")
            )
        indices = torch.topk(selection, k, dim=-1).indices
        probs = scores.gather(1, indices)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if config.topk_scaling_factor is not None:
        probs = probs * config.topk_scaling_factor
    return probs.to(logits.dtype), indices


def _torch_shared_expert(w, x):
    gate, up = (x @ w["shared_experts.fc1_kernel"]).float().chunk(2, dim=-1)
    out = (F.silu(gate) * up).to(x.dtype) @ w["shared_experts.fc2_kernel"]
    if "shared_experts.gate_kernel" in w:
        out = out * torch.sigmoid((x @ w["shared_experts.gate_kernel"]).float()).to(x.dtype)
    return out


def _torch_aux_loss(logits, config: MoEConfig, seq_len: int):
    if config.load_balancing_type == "none" or config.aux_loss_coeff == 0:
        return torch.zeros((), device=logits.device)
    z = logits.float()
    if config.score_function == "softmax":
        scores = torch.softmax(z, dim=-1)
    else:
        scores = torch.sigmoid(z)
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    top = scores.topk(config.top_k, dim=-1).indices
    routed = (top[..., None] == torch.arange(config.num_experts, device=z.device)).any(1)
    return _switch_loss(scores, routed.float(), config, seq_len)


# ---------------------------------------------------------------------------------------- JAX
def jax_moe(w: dict, x: jax.Array, config: MoEConfig, seq_len: int, ragged_dot=jax.lax.ragged_dot):
    """(y [T, H], aux loss fp32 scalar, expert ids [T, k]) for tokens x [T, H] (bf16), its
    grouped matmuls on `ragged_dot(rows, weights, group_sizes)` (e.g. tokamax's)."""
    k, num_experts = config.top_k, config.num_experts
    router_dtype = F32 if config.router_dtype == "fp32" else x.dtype
    logits = jnp.dot(x, w["router.kernel"], preferred_element_type=F32).astype(router_dtype)
    probs, indices = _jax_route(logits, config, w.get("router.expert_bias"))
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    bounds = jnp.searchsorted(flat[order], jnp.arange(num_experts + 1), side="left")
    group_sizes = jnp.diff(bounds).astype(jnp.int32)
    rows = x[order // k]
    h = ragged_dot(rows, w["experts.fc1_kernel"], group_sizes)
    gate, up = jnp.split(h.astype(F32), 2, axis=-1)
    row_probs = probs.reshape(-1)[order].astype(F32)
    a = (jax.nn.silu(gate) * up * row_probs[:, None]).astype(x.dtype)
    out = ragged_dot(a, w["experts.fc2_kernel"], group_sizes)
    inverse = jnp.argsort(order)
    y = out[inverse].reshape(-1, k, out.shape[-1]).astype(F32).sum(1).astype(x.dtype)
    if "shared_experts.fc1_kernel" in w:
        y = y + _jax_shared_expert(w, x)
    return y, _jax_aux_loss(logits, config, seq_len), indices


def _jax_route(logits, config: MoEConfig, expert_bias):
    k = config.top_k
    if config.score_function == "softmax":
        values, indices = jax.lax.top_k(logits, k)
        probs = jax.nn.softmax(values.astype(F32), axis=-1)
    else:
        scores = jax.nn.sigmoid(logits.astype(F32))
        selection = scores if expert_bias is None else scores + expert_bias
        if config.num_groups is not None:
            tokens, groups = selection.shape[0], config.num_groups
            grouped = selection.reshape(tokens, groups, -1)
            group_scores = jax.lax.top_k(grouped, k // config.group_topk)[0].sum(-1)
            chosen = jax.lax.top_k(group_scores, config.group_topk)[1]
            allowed = jnp.any(chosen[:, :, None] == jnp.arange(groups), axis=1)
            selection = jnp.where(
                jnp.repeat(allowed, grouped.shape[-1], axis=1), selection, -jnp.inf
            )
        indices = jax.lax.top_k(selection, k)[1]
        probs = jnp.take_along_axis(scores, indices, axis=1)
        probs = probs / (probs.sum(-1, keepdims=True) + 1e-20)
    if config.topk_scaling_factor is not None:
        probs = probs * config.topk_scaling_factor
    return probs.astype(logits.dtype), indices


def _jax_shared_expert(w, x):
    h = jnp.dot(x, w["shared_experts.fc1_kernel"], preferred_element_type=F32).astype(x.dtype)
    gate, up = jnp.split(h.astype(F32), 2, axis=-1)
    out = jnp.dot(
        (jax.nn.silu(gate) * up).astype(x.dtype),
        w["shared_experts.fc2_kernel"],
        preferred_element_type=F32,
    ).astype(x.dtype)
    if "shared_experts.gate_kernel" in w:
        logit = jnp.dot(x, w["shared_experts.gate_kernel"], preferred_element_type=F32)
        out = out * jax.nn.sigmoid(logit.astype(x.dtype).astype(F32)).astype(x.dtype)
    return out


def _jax_aux_loss(logits, config: MoEConfig, seq_len: int):
    if config.load_balancing_type == "none" or config.aux_loss_coeff == 0:
        return jnp.zeros((), F32)
    z = logits.astype(F32)
    if config.score_function == "softmax":
        scores = jax.nn.softmax(z, axis=-1)
    else:
        scores = jax.nn.sigmoid(z)
        scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    top = jax.lax.top_k(scores, config.top_k)[1]
    routed = jnp.any(top[..., None] == jnp.arange(config.num_experts), axis=1)
    return _switch_loss(scores, routed.astype(F32), config, seq_len)


def torch_dense_gemms(config: MoEConfig, num_tokens: int, hidden: int, device):
    """(train, inference) callables of the layer's expert GEMMs alone, as dense bf16 matmuls of
    all M = T * k rows against one matrix (no routing, dispatch, activation or combine):
    inference fc1 [M, H] x [H, F1] and fc2 [M, F] x [F, H]; train adds both dgrads and wgrads
    (the FLOPs of `benchmarks.layer.expert_gemm_flops`). Inputs are random, made once."""
    rows, f1, f = num_tokens * config.top_k, config.fc1_output_size, config.ffn_hidden_size
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    x, act, dy, dh = rand(rows, hidden), rand(rows, f), rand(rows, hidden), rand(rows, f1)
    w1, w2 = rand(hidden, f1) * hidden**-0.5, rand(f, hidden) * f**-0.5

    def inference():
        return x @ w1, act @ w2

    def train():
        return (*inference(), dy @ w2.T, act.T @ dy, dh @ w1.T, x.T @ dh)

    return train, inference
