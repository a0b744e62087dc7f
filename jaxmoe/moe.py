"""`jaxmoe.MoE`: the Megatron-style MoE layer as a `flax.nnx` module (+ a linen adapter).

    x[..., H] -> router -> plan -> dispatch -> grouped expert MLP -> combine (+ shared expert)

Parameters use the flax [in, out] convention (Megatron stores [out, in]; bridge/ transposes):
  router.kernel [H, E], router.bias [E], router.expert_bias [E] (fp32, not trained by gradients),
  experts.fc1_kernel [E, H, 2F] (GLU: [..., :F] gate, [..., F:] up) or [E, H, F],
  experts.fc1_bias [E, 2F|F], experts.fc2_kernel [E, F, H], experts.fc2_bias [E, H],
  shared_experts.fc1_kernel [H, 2Fs|Fs], shared_experts.fc2_kernel [Fs, H],
  shared_experts.gate_kernel [H, 1].
Initialisation follows Megatron: N(0, init_std) for the router, fc1 and the shared gate,
N(0, init_std / sqrt(2 * num_layers)) for fc2, zero biases and expert bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxmoe import routing as routing_lib
from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import LocalRoute, dequantized_rows
from jaxmoe.experts import ExpertMatrices, grouped_mlp, quantize_expert_weights, shared_mlp
from jaxmoe.fp8_blockwise import BLOCK as FP8_BLOCK
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.plan import Plan, make_plan
from jaxmoe.recipes import ExpertWeights
from jaxmoe.wire import QuantizedRows, quantize_tokens

F32 = jnp.float32


class ExpertBias(nnx.Variable):
    """The fp32 aux-loss-free routing bias. Not an `nnx.Param`: optimizers leave it alone; update
    it with `jaxmoe.update_expert_bias` once per step."""


class AuxLossState(nnx.Variable):
    """Running per-expert token counts and call count for `global_aux_loss` (Megatron's
    `global_tokens_per_expert` / `ga_steps`); reset with `MoE.reset_global_aux_state`."""


@struct.dataclass
class MoEAux:
    """What the layer returns besides its output.

    load_balancing_loss: fp32 scalar, coefficient applied (0 when disabled).
    z_loss: fp32 scalar, coefficient applied (0 when disabled).
    tokens_per_expert: [E] int32 kept (token, expert) pairs, padding tokens excluded; accumulate
      these over a step for `update_expert_bias`.
    The caller adds the losses to its objective: jaxmoe never adds them silently."""

    load_balancing_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array

    @property
    def total_loss(self) -> jax.Array:
        """load_balancing_loss + z_loss."""
        return self.load_balancing_loss + self.z_loss


@struct.dataclass
class MoEStages:
    """The layer's intermediate values, for stage-by-stage comparisons (`forward_with_stages`).
    T is the number of tokens (leading axes of x flattened), M the expert buffer's rows."""

    router_logits: jax.Array  # [T, E] in the router dtype
    probs: jax.Array  # [T, k] routing probabilities, Megatron's top-k order
    indices: jax.Array  # [T, k] expert of each slot
    kept: jax.Array  # [T, k] bool: the slot survived capacity
    plan: Plan  # the expert buffer's layout
    dispatched_rows: jax.Array  # [M, H] tokens in expert order (the dequantized copy's values
    # when dispatch_dtype is not "bf16")
    dispatched_quantized: QuantizedRows | None  # the copy that was dispatched (`jaxmoe.wire`)
    row_probs: jax.Array  # [M] probability of each row
    fc1_output: jax.Array  # [M, 2F] (gated) or [M, F]
    activation: jax.Array  # [M, F], probabilities applied
    fc2_output: jax.Array  # [M, H]
    combined: jax.Array  # [T, H] before the shared expert
    shared_output: jax.Array | None  # [T, H], or None without a shared expert


# Logical axis names of the parameters (`nnx.get_partition_spec(nnx.state(moe))` lists them);
# map them to a device mesh with sharding rules of your own, e.g. EXPERT -> the expert axis.
EMBED, EXPERT, MLP = "embed", "expert", "mlp"

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def megatron_normal(std: float) -> Initializer:
    """Megatron's weight init: normal(0, std) drawn in fp32, then cast to the parameter dtype."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = F32) -> jax.Array:
        return (jax.random.normal(key, shape, F32) * std).astype(dtype)

    return init


def _weight(init: Initializer, rngs: nnx.Rngs, shape, dtype, axes) -> nnx.Param:
    value = init(rngs.params(), shape, dtype)
    if value.shape != tuple(shape):
        raise ValueError(f"MoE: an initializer returned shape {value.shape}, expected {shape}")
    return _annotated(nnx.Param, value.astype(dtype), axes)


def _zeros(shape, dtype, axes, kind=nnx.Param) -> nnx.Variable:
    return _annotated(kind, jnp.zeros(shape, dtype), axes)


def _annotated(kind, value, axes) -> nnx.Variable:
    """A variable carrying logical axis names, sharded by the caller (never eagerly here: the
    layer does not assume a mesh)."""
    return kind(value, out_sharding=axes, eager_sharding=False)


class TopKRouter(nnx.Module):
    """Router: logits = x @ kernel (+ bias), then Megatron top-k routing with capacity."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        *,
        param_dtype: Any,
        kernel_init: Initializer,
        rngs: nnx.Rngs,
    ):
        self.config = config
        num_experts = config.num_experts
        self.kernel = _weight(
            kernel_init, rngs, (hidden_size, num_experts), param_dtype, (EMBED, EXPERT)
        )
        self.bias = (
            _zeros((num_experts,), param_dtype, (EXPERT,)) if config.add_bias_linear else None
        )
        self.expert_bias = (
            _zeros((num_experts,), F32, (EXPERT,), ExpertBias)
            if config.enable_expert_bias
            else None
        )
        self.jitter_rngs = (
            rngs["jitter"].fork() if config.input_jitter_eps is not None else nnx.data(None)
        )

    def logits(self, x: jax.Array, impl: str = "auto") -> jax.Array:
        """[T, E] logits in the router dtype (input jitter applied when configured); `impl` is
        `jaxmoe.ops.dense`'s."""
        eps = self.config.input_jitter_eps
        if eps is not None:
            noise = jax.random.uniform(self.jitter_rngs(), x.shape, F32, 1.0 - eps, 1.0 + eps)
            x = (x.astype(F32) * noise).astype(x.dtype)
        router_dtype = F32 if self.config.router_dtype == "fp32" else x.dtype
        bias = None if self.bias is None else self.bias[...]
        return routing_lib.router_logits(x, self.kernel[...], bias, router_dtype, impl)

    def __call__(
        self, x: jax.Array, impl: str = "auto", sequence_shape: tuple[int, ...] | None = None
    ) -> tuple[jax.Array, routing_lib.Routing]:
        """(logits, routing) for tokens x [T, H]; `sequence_shape` is the layer input's
        x.shape[:-1] (it fixes the token order of capacity dropping, see
        `routing.capacity_keep_mask`; None: the given order)."""
        logits = self.logits(x, impl)
        expert_bias = (
            None if self.expert_bias is None else jax.lax.stop_gradient(self.expert_bias[...])
        )
        return logits, routing_lib.route(logits, self.config, expert_bias, sequence_shape)


class GroupedMLP(nnx.Module):
    """The E routed experts' weights, applied to the expert buffer with grouped matmuls."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        *,
        param_dtype: Any,
        kernel_init: Initializer,
        output_kernel_init: Initializer,
        rngs: nnx.Rngs,
    ):
        self.config = config
        e, f1, f = config.num_experts, config.fc1_output_size, config.ffn_hidden_size
        self.fc1_kernel = _weight(
            kernel_init, rngs, (e, hidden_size, f1), param_dtype, (EXPERT, EMBED, MLP)
        )
        self.fc2_kernel = _weight(
            output_kernel_init, rngs, (e, f, hidden_size), param_dtype, (EXPERT, MLP, EMBED)
        )
        bias = config.add_bias_linear
        self.fc1_bias = _zeros((e, f1), param_dtype, (EXPERT, MLP)) if bias else None
        self.fc2_bias = _zeros((e, hidden_size), param_dtype, (EXPERT, EMBED)) if bias else None

    def __call__(self, rows, row_probs, route, *, rows_quantized, expert_weights, gmm_impl: str):
        value = lambda p: None if p is None else p[...]
        weights = ExpertMatrices(
            self.fc1_kernel[...], self.fc2_kernel[...], value(self.fc1_bias), value(self.fc2_bias)
        )
        return grouped_mlp(
            rows,
            row_probs,
            route,
            weights,
            self.config,
            rows_quantized=rows_quantized,
            expert_weights=expert_weights,
            gmm_impl=gmm_impl,
        )


class SharedExpertMLP(nnx.Module):
    """The shared expert (every token), optionally gated by sigmoid(x @ gate_kernel)."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        *,
        param_dtype: Any,
        kernel_init: Initializer,
        output_kernel_init: Initializer,
        rngs: nnx.Rngs,
    ):
        self.config = config
        fs = config.shared_expert_intermediate_size
        fs1 = 2 * fs if config.gated_linear_unit else fs
        self.fc1_kernel = _weight(kernel_init, rngs, (hidden_size, fs1), param_dtype, (EMBED, MLP))
        self.fc2_kernel = _weight(
            output_kernel_init, rngs, (fs, hidden_size), param_dtype, (MLP, EMBED)
        )
        self.gate_kernel = (
            _weight(kernel_init, rngs, (hidden_size, 1), param_dtype, (EMBED, None))
            if config.shared_expert_gate
            else None
        )

    def __call__(self, x: jax.Array, impl: str = "auto") -> jax.Array:
        gate = None if self.gate_kernel is None else self.gate_kernel[...]
        return shared_mlp(x, self.fc1_kernel[...], self.fc2_kernel[...], gate, self.config, impl)


class MoE(nnx.Module):
    """Megatron-Core MoE layer (routing, dropless or capacity dispatch, grouped experts,
    deterministic combine, shared expert), with bf16 or MXFP8 routed experts, dispatch and
    combine gradient (`MoEConfig.expert_precision`, `dispatch_dtype`, `combine_bwd_dtype`; see
    `jaxmoe.experts`). The router and the shared expert always run in the compute dtype.

    Args:
      config: the `MoEConfig`.
      hidden_size: H, the model width.
      param_dtype: parameter dtype (bf16 or fp32); the expert bias is always fp32.
      dtype: compute dtype (default: param_dtype); inputs and weights are cast to it.
      init_std, num_layers: Megatron's init_method_std and the model depth: weights are drawn
        from normal(0, init_std), the output matrices (fc2) from normal(0, init_std /
        sqrt(2 num_layers)) (`megatron_normal`), unless
      kernel_init, output_kernel_init: initializers `(key, shape, dtype) -> array` (e.g.
        `jax.nn.initializers.*`) for the input-side matrices (router, fc1, shared fc1 and gate)
        and the output matrices (fc2, shared fc2); biases start at zero.
      Parameters carry logical axis names (EMBED, EXPERT, MLP) for sharding.
      gmm_impl: implementation of every matmul, row permutation and quantize in the layer
        ("auto", "pallas" or "xla"): the grouped expert matmuls (`jaxmoe.ops.gmm`), the
        token-row matmuls of the router and the shared expert (`jaxmoe.ops.dense`), the dispatch
        and combine (`jaxmoe.ops.permute`) and the MXFP8 quantizers. "auto" runs the Pallas
        kernels on a Hopper GPU (batch-invariant) and XLA elsewhere; every impl gives the
        dispatch and combine the same bits.
      dense_impl: implementation of the token-row matmuls alone (router, shared expert); None:
        `gmm_impl`. "xla" there trades batch invariance on the GPU for cuBLAS (benchmarks).
      rngs: `nnx.Rngs`; "params" initialises weights, "jitter" drives the input jitter.

    Attribute `row_alignment`: the expert buffer's row alignment, config.expert_row_alignment;
    `jaxmoe.mxfp8_inference` sets 1 on its forward-only copy (MXFP8's 32-row blocks serve the
    backward). A row's outputs do not depend on it.
    """

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        *,
        param_dtype: Any = jnp.bfloat16,
        dtype: Any = None,
        init_std: float = 0.02,
        num_layers: int = 1,
        kernel_init: Initializer | None = None,
        output_kernel_init: Initializer | None = None,
        gmm_impl: str = "auto",
        dense_impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE: config must be a MoEConfig, got {type(config).__name__}")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"MoE: hidden_size must be a positive int, got {hidden_size!r}")
        _check_block_shapes(config, hidden_size)
        for name, dt in (("param_dtype", param_dtype), ("dtype", dtype)):
            if dt is not None and not jnp.issubdtype(jnp.dtype(dt), jnp.floating):
                raise TypeError(f"MoE: {name} must be a floating dtype, got {dt}")
        self.config = config
        self.hidden_size = hidden_size
        self.dtype = jnp.dtype(dtype if dtype is not None else param_dtype)
        self.gmm_impl = gmm_impl
        self.dense_impl = gmm_impl if dense_impl is None else dense_impl
        self.row_alignment = config.expert_row_alignment
        kernel_init = kernel_init or megatron_normal(init_std)
        output_kernel_init = output_kernel_init or megatron_normal(
            init_std / math.sqrt(2.0 * num_layers)
        )
        kw = dict(param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.router = TopKRouter(config, hidden_size, **kw)
        self.experts = GroupedMLP(config, hidden_size, output_kernel_init=output_kernel_init, **kw)
        self.shared_experts = (
            SharedExpertMLP(config, hidden_size, output_kernel_init=output_kernel_init, **kw)
            if config.shared_expert_intermediate_size
            else None
        )
        use_global = config.load_balancing_type == "global_aux_loss"
        self.global_tokens_per_expert = (
            AuxLossState(jnp.zeros((config.num_experts,), F32)) if use_global else None
        )
        self.global_aux_steps = AuxLossState(jnp.zeros((), jnp.int32)) if use_global else None

    def _check_input(self, x, padding_mask):
        if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"MoE: x must be a floating-point array, got {getattr(x, 'dtype', type(x))}"
            )
        if x.ndim < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE: x must be [..., {self.hidden_size}] (hidden_size), got {x.shape}"
            )
        if x.size == 0:
            raise ValueError(f"MoE: x has no tokens (shape {x.shape})")
        if self.config.load_balancing_type == "seq_aux_loss" and x.ndim < 2:
            raise ValueError("MoE: seq_aux_loss needs x as [..., S, H] (a sequence axis)")
        if padding_mask is not None:
            if padding_mask.shape != x.shape[:-1] or padding_mask.dtype != jnp.bool_:
                raise ValueError(
                    f"MoE: padding_mask must be bool {x.shape[:-1]}, got "
                    f"{padding_mask.dtype} {padding_mask.shape}"
                )

    def reset_global_aux_state(self) -> None:
        """Start a new accumulation window for `global_aux_loss` (call once per optimizer step)."""
        if self.global_aux_steps is not None:
            self.global_tokens_per_expert[...] = jnp.zeros_like(self.global_tokens_per_expert[...])
            self.global_aux_steps[...] = jnp.zeros_like(self.global_aux_steps[...])

    def quantize_expert_weights(self) -> ExpertWeights:
        """The quantized copies of the routed experts' weights (MXFP8: fprop and dgrad copies;
        FP8 blockwise: the 128x128 copies and their transposes; a ValueError for bf16 experts,
        which have none). Make them once per optimizer step
        (after the update) and pass them as `expert_weights=` to each micro-batch's forward:
        the bits are those of quantizing in every call, and the gradient still reaches the
        master weights."""
        return quantize_expert_weights(
            self.experts.fc1_kernel[...],
            self.experts.fc2_kernel[...],
            self.config,
            self.dtype,
            self.gmm_impl,
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        padding_mask: jax.Array | None = None,
        expert_weights: ExpertWeights | None = None,
    ) -> tuple[jax.Array, MoEAux]:
        """y, aux = moe(x): x [..., H] -> y [..., H] in the compute dtype.

        padding_mask: optional bool [...] (True = padding token). Padding tokens are still routed
        and computed, as in Megatron; they only leave the losses and the token counts.
        expert_weights: `quantize_expert_weights()` from earlier in this optimizer step (MXFP8
        experts; None: the weights are quantized in this call).
        A token whose input holds NaN/Inf gets a non-finite output; other tokens are unaffected."""
        y, aux, _ = self.forward_with_stages(
            x, padding_mask=padding_mask, expert_weights=expert_weights
        )
        return y, aux

    def forward_with_stages(
        self,
        x: jax.Array,
        *,
        padding_mask: jax.Array | None = None,
        expert_weights: ExpertWeights | None = None,
        route_for: Callable[[Plan, str], Any] = LocalRoute,
    ) -> tuple[jax.Array, MoEAux, MoEStages]:
        """Like `__call__`, plus the intermediate values (`MoEStages`, for stage-by-stage
        comparisons). Unused entries cost nothing under jit.

        route_for(plan, gmm_impl): how the plan's rows reach the experts and come back; the
        default keeps them on this device (`jaxmoe.expert_parallel` passes the exchange between
        expert-parallel ranks, and the experts' parameters are then this rank's)."""
        self._check_input(x, padding_mask)
        config = self.config
        tokens = x.reshape(-1, self.hidden_size).astype(self.dtype)
        flat_mask = None if padding_mask is None else padding_mask.reshape(-1)

        with jax.named_scope("router"):
            logits, routing = self.router(tokens, self.dense_impl, x.shape[:-1])
        with jax.named_scope("plan"):
            plan = make_plan(routing, config, self.row_alignment)
        with jax.named_scope("dispatch"):
            route = route_for(plan, self.gmm_impl)
            if config.dispatch_dtype != "bf16":
                # Each token quantized once (blocks along H); only the quantized copy is
                # dispatched, and the experts' bf16 rows are its dequantized values (on one
                # device made from the tokens in one pass, the copy left to whoever reads it).
                copy = quantize_tokens(tokens, config.dispatch_dtype, self.gmm_impl)
                rows_quantized, rows = dequantized_rows(tokens, copy, route)
            else:
                rows, rows_quantized = route.to_experts(tokens), None
            row_probs = route.slot_values(routing.probs)
        expert = self.experts(
            rows,
            row_probs,
            route,
            rows_quantized=rows_quantized,
            expert_weights=expert_weights,
            gmm_impl=self.gmm_impl,
        )
        combined = expert.combined
        with jax.named_scope("shared_expert"):
            shared = (
                None
                if self.shared_experts is None
                else self.shared_experts(tokens, self.dense_impl)
            )
            y = combined if shared is None else combined + shared

        with jax.named_scope("aux_losses"):
            aux = MoEAux(
                load_balancing_loss=self._load_balancing_loss(logits, x.shape[:-1], flat_mask),
                z_loss=routing_lib.z_loss(logits, config.z_loss_coeff, flat_mask),
                # Without padding the plan has counted the kept pairs already (no second pass).
                tokens_per_expert=plan.tokens_per_group
                if flat_mask is None
                else routing_lib.tokens_per_expert(routing, config.num_experts, flat_mask),
            )
        stages = MoEStages(
            router_logits=logits,
            probs=routing.probs,
            indices=routing.indices,
            kept=routing.kept,
            plan=plan,
            dispatched_rows=rows,
            dispatched_quantized=rows_quantized,
            row_probs=row_probs,
            fc1_output=expert.fc1_output,
            activation=expert.activation,
            fc2_output=expert.output,
            combined=combined,
            shared_output=shared,
        )
        return y.reshape(x.shape[:-1] + (self.hidden_size,)), aux, stages

    def _load_balancing_loss(self, logits, sequence_shape, padding_mask):
        config = self.config
        if self.global_aux_steps is None:
            return routing_lib.load_balancing_loss(logits, config, sequence_shape, padding_mask)
        _, routing_map = routing_lib.aux_loss_scores(logits, config)
        if padding_mask is not None:
            routing_map = routing_map & ~padding_mask[:, None]
        counts = self.global_tokens_per_expert[...] + jnp.sum(routing_map, axis=0).astype(F32)
        steps = self.global_aux_steps[...] + 1
        self.global_tokens_per_expert[...] = counts
        self.global_aux_steps[...] = steps
        return routing_lib.load_balancing_loss(
            logits, config, sequence_shape, padding_mask, token_counts=counts / steps.astype(F32)
        )


def _check_block_shapes(config: MoEConfig, hidden_size: int) -> None:
    """MXFP8 blocks are 32 wide: H must be a multiple of 32 for any MXFP8 option, and F too for
    MXFP8 experts (fc2 contracts over F); FP8 blockwise experts need both multiples of 128."""
    if config.uses_mxfp8 and hidden_size % BLOCK_SIZE:
        raise ValueError(
            f"MoE: hidden_size ({hidden_size}) must be a multiple of {BLOCK_SIZE} "
            "for the MXFP8 options (blocks of 32 along H)"
        )
    if config.expert_precision == "mxfp8" and config.ffn_hidden_size % BLOCK_SIZE:
        raise ValueError(
            f"MoE: ffn_hidden_size ({config.ffn_hidden_size}) must be a multiple "
            f"of {BLOCK_SIZE} for expert_precision='mxfp8' (blocks of 32 along F)"
        )
    if config.expert_precision == "fp8_blockwise" and (
        hidden_size % FP8_BLOCK or config.ffn_hidden_size % FP8_BLOCK
    ):
        raise ValueError(
            f"MoE: hidden_size ({hidden_size}) and ffn_hidden_size ({config.ffn_hidden_size}) "
            f"must be multiples of {FP8_BLOCK} for expert_precision='fp8_blockwise' (its "
            "1x128 and 128x128 blocks)"
        )


def to_linen(config: MoEConfig, hidden_size: int, **kwargs):
    """A `flax.linen` module wrapping `MoE` (via `flax.nnx.bridge.to_linen`) for linen users.

    `module.init(rngs, x)` / `module.apply(variables, x)` return (y, MoEAux) like `MoE`. The
    variables come boxed with their logical axis names (`flax.linen.unbox(variables)` gives
    the arrays)."""
    return nnx.bridge.to_linen(MoE, config, hidden_size, **kwargs)
