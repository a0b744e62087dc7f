"""Expert MLPs on the expert buffer and the combine back to token rows:
fc1 -> activation x probability (rounded once) -> fc2 -> combine.

Numerics (Megatron's fused weighted-activation kernels; docs/numerics.md, "Experts and rounding
points"):
  h = round(fc1 accumulation in fp32 [+ b1])                      [M, 2F] or [M, F]
  a = round(act(f32 gate) * f32 up * f32 p)   (GLU; [gate; up] = first and second half of h)
  a = round(act(f32 h) * f32 p)               (no GLU)
  o = round(fc2 accumulation in fp32); with a bias: round(f32 o + f32 b2 * p)
  y = combine(o)                                                  [T, H]
Padding rows are zero and carry p = 0, so their activation rows are exactly zero.
Every sum that autodiff would leave to an XLA reduce (the probability's and the shared gate's
gradients, the biases' gradients) runs in a fixed order (`jaxmoe.ordered`, `bias_per_row`).

The GEMMs run by the recipe of `MoEConfig.expert_precision` (`jaxmoe.recipes`: bf16, MXFP8
or FP8 blockwise, and the token-level MXFP8 options of the dispatch and the combine gradient).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.ops.activation import (
    gated_activation,
    weighted_activation_backward,
    weighted_activation_forward,
)
from jaxmoe.ops.array_gmm import KERNEL_MULTIPLE
from jaxmoe.ops.dense import bf16_pieces, dense
from jaxmoe.ops.gmm import tgmm
from jaxmoe.ordered import broadcast_in_order
from jaxmoe.recipes import recipe_for
from jaxmoe.wire import QuantizedRows

F32 = jnp.float32


def weighted_activation(
    h: jax.Array,
    probs: jax.Array | None,
    config: MoEConfig,
    impl: str = "auto",
    live_rows: jax.Array | None = None,
) -> jax.Array:
    """act(h) (times the per-row probability when given) computed in fp32, rounded once to h.dtype.

    h: [M, 2F] ([gate; up]) with a GLU, else [M, F]; probs: [M] or None. With probs the two
    passes are `jaxmoe.ops.weighted_activation_forward` and `weighted_activation_backward`
    (`impl`): the probabilities' gradient is each row's sum of d out * act(h) in a fixed order,
    with act(h) recomputed from h rather than kept in fp32 between the passes. live_rows (with
    probs): both passes compute only the rows below it (`jaxmoe.ops.live_rows`)."""
    if probs is None:
        return gated_activation(h, config.activation, config.gated_linear_unit).astype(h.dtype)
    return _weighted(h, probs.astype(F32), live_rows, config, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _weighted(h, probs, live_rows, config, impl):
    return weighted_activation_forward(
        h,
        probs,
        config.activation,
        config.gated_linear_unit,
        live_rows=live_rows,
        impl=impl,
    )


def _weighted_fwd(h, probs, live_rows, config, impl):
    return _weighted(h, probs, live_rows, config, impl), (h, probs, live_rows)


def _weighted_bwd(config, impl, residuals, g):
    h, probs, live_rows = residuals
    d_h, d_probs = weighted_activation_backward(
        h,
        probs,
        g,
        config.activation,
        config.gated_linear_unit,
        live_rows=live_rows,
        impl=impl,
    )
    return d_h, d_probs, None


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def bias_per_row(bias: jax.Array, route: Any, impl: str = "auto") -> jax.Array:
    """fp32 bias[row_group] [M, N] for bias [G, N] (the route's `row_group` and
    `group_sizes`): each row gets its group's bias, rows past the last block zeros. Its gradient
    sums each group's rows on the weight-gradient GEMM (`jaxmoe.ops.tgmm`, ones^T @ rows, in fp32;
    an fp32 gradient as three exact bf16 pieces): a fixed order, where the gather's own
    gradient is a scatter-add whose order is the GPU's."""
    return _bias_per_row(bias, route.row_group, route.group_sizes, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bias_per_row(bias, row_group, group_sizes, impl):
    padded = jnp.concatenate([bias, jnp.zeros((1,) + bias.shape[1:], bias.dtype)], axis=0)
    return jnp.take(padded, row_group, axis=0).astype(F32)


def _bias_per_row_fwd(bias, row_group, group_sizes, impl):
    residuals = (row_group, group_sizes, jnp.zeros((0,), bias.dtype))
    return _bias_per_row(bias, row_group, group_sizes, impl), residuals


def _bias_per_row_bwd(impl, residuals, g):
    row_group, group_sizes, like = residuals
    g = jnp.where((row_group < group_sizes.shape[0])[:, None], g, 0.0)
    ones = jnp.ones((g.shape[0], KERNEL_MULTIPLE), jnp.bfloat16)
    total = None
    for piece in bf16_pieces(g, jnp.bfloat16):
        part = tgmm(ones, piece, group_sizes, impl=impl)[:, 0]
        total = part if total is None else total + part
    return total.astype(like.dtype), None, None


_bias_per_row.defvjp(_bias_per_row_fwd, _bias_per_row_bwd)


class ExpertStages(NamedTuple):
    """Intermediate values of the grouped MLP on the expert buffer and its combine."""

    fc1_output: jax.Array  # h [M, 2F|F], rounded to the compute dtype (bias included)
    activation: jax.Array  # a = act(h) * p [M, F], rounded once
    output: jax.Array  # fc2 output [M, H] (probability-scaled bias included)
    combined: jax.Array  # combine(output) [T, H]


class ExpertMatrices(NamedTuple):
    """The routed experts' parameters: fc1 [E, H, 2F|F], fc2 [E, F, H], biases [E, 2F|F] and
    [E, H] or None."""

    fc1_kernel: jax.Array
    fc2_kernel: jax.Array
    fc1_bias: jax.Array | None = None
    fc2_bias: jax.Array | None = None


def quantize_expert_weights(
    fc1_kernel: jax.Array, fc2_kernel: jax.Array, config: MoEConfig, dtype, gmm_impl: str = "auto"
) -> Any:
    """The recipe's copies of fc1 [E, H, 2F|F] and fc2 [E, F, H] (MXFP8: both fprop and dgrad
    copies), from their values in the compute dtype: once per optimizer step, shared by that
    step's micro-batches."""
    return recipe_for(config).quantize_weights(
        fc1_kernel.astype(dtype), fc2_kernel.astype(dtype), gmm_impl
    )


def grouped_mlp(
    rows: jax.Array,
    row_probs: jax.Array,
    route: Any,
    weights: ExpertMatrices,
    config: MoEConfig,
    *,
    rows_quantized: QuantizedRows | None = None,
    expert_weights: Any = None,
    gmm_impl: str = "auto",
) -> ExpertStages:
    """Run every expert on its row block of the buffer and combine the rows back to tokens.

    rows [M, H] (dispatched tokens, compute dtype); row_probs [M]; route: the buffer's layout and
    the way back to tokens (`jaxmoe.dispatch.LocalRoute`, or `jaxmoe.exchange.ExchangedRoute`
    across expert-parallel ranks);
    weights: the experts' parameters; rows_quantized: the dispatched quantized copy of the
    tokens (dispatch_dtype "mxfp8" or "fp8_blockwise", `jaxmoe.wire`; rows are then its
    dequantized values), else None.
    expert_weights: `quantize_expert_weights` of these kernels made earlier in the step (None:
    quantize here). Returns the stages;
    `.combined` [T, H] in rows.dtype is each token's probability-weighted sum of its expert
    outputs."""
    dtype, recipe = rows.dtype, recipe_for(config)
    # The GEMMs read each expert's matrix for all of its groups (route.groups_per_weight); a
    # kernel narrower than the compute dtype is widened, a wider one (fp32 copies under expert
    # parallelism) is rounded by the GEMM, its gradient kept in its dtype.
    at_least = lambda w: (
        w if w is None or jnp.finfo(w.dtype).bits >= jnp.finfo(dtype).bits else w.astype(dtype)
    )
    fc1_kernel, fc2_kernel = at_least(weights.fc1_kernel), at_least(weights.fc2_kernel)
    per_group = lambda w: None if w is None else route.per_group(w)
    fc1_bias, fc2_bias = per_group(weights.fc1_bias), per_group(weights.fc2_bias)
    # The bias is added to the fp32 accumulator before the single rounding, as in TE's epilogue.
    fc1_out_dtype = F32 if fc1_bias is not None else dtype
    # The activation's kernels take SwiGLU alone: the layer's "pallas" lets them run where they
    # can ("auto"), XLA elsewhere.
    activation_impl = "auto" if gmm_impl == "pallas" else gmm_impl
    fused = None
    if fc1_bias is None:
        fused = recipe.fc1_and_activation(
            rows,
            fc1_kernel,
            row_probs.astype(F32),
            route,
            rows_quantized=rows_quantized,
            weights=expert_weights,
            config=config,
            impl=gmm_impl,
            activation_impl=activation_impl,
        )
    if fused is not None:
        h, a = fused
    else:
        with jax.named_scope("fc1"):
            h = recipe.fc1(
                rows,
                fc1_kernel,
                route,
                rows_quantized=rows_quantized,
                weights=expert_weights,
                out_dtype=fc1_out_dtype,
                impl=gmm_impl,
            )
            if fc1_bias is not None:
                h = h + bias_per_row(fc1_bias, route, gmm_impl)
            h = h.astype(dtype)
        with jax.named_scope("activation"):
            a = weighted_activation(h, row_probs, config, activation_impl, route.live_rows)
    with jax.named_scope("activation"):
        a_quantized = recipe.activation_copies(h, row_probs, config, route.live_rows, gmm_impl)
    row_bias = None
    if fc2_bias is not None:
        row_bias = bias_per_row(fc2_bias, route, gmm_impl)
        row_bias = row_bias * broadcast_in_order(row_probs.astype(F32)[:, None], row_bias.shape)
    out, combined = recipe.fc2_and_combine(
        a,
        fc2_kernel,
        row_bias,
        route,
        weights=expert_weights,
        combine_bwd_dtype=config.combine_bwd_dtype,
        impl=gmm_impl,
        a_quantized=a_quantized,
    )
    return ExpertStages(fc1_output=h, activation=a, output=out, combined=combined)


def shared_mlp(
    x: jax.Array,
    fc1_kernel: jax.Array,
    fc2_kernel: jax.Array,
    gate_kernel: jax.Array | None,
    config: MoEConfig,
    impl: str = "auto",
) -> jax.Array:
    """Shared expert on every token: fc2(act(fc1 x)) with the same rounding points as the routed
    experts (no probability), times sigmoid(x @ gate) rounded in the compute dtype when gated.
    Its matmuls run on `jaxmoe.ops.dense` (batch-invariant on the GPU kernels)."""
    dtype = x.dtype
    h = dense(x, fc1_kernel.astype(dtype), impl=impl)
    out = dense(weighted_activation(h, None, config), fc2_kernel.astype(dtype), impl=impl)
    if gate_kernel is not None:
        logit = dense(x, gate_kernel.astype(dtype), impl=impl)
        gate = jax.nn.sigmoid(logit.astype(F32)).astype(dtype)
        out = out * broadcast_in_order(gate, out.shape)
    return out
