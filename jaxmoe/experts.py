"""Expert MLPs on the expert buffer and the combine back to token rows:
fc1 -> activation x probability (rounded once) -> fc2 -> combine.

Numerics (Megatron's fused weighted-activation kernels, shared spec `megatron_moe.md` §3.4):
  h = round(fc1 accumulation in fp32 [+ b1])                      [M, 2F] or [M, F]
  a = round(act(f32 gate) * f32 up * f32 p)   (GLU; [gate; up] = first and second half of h)
  a = round(act(f32 h) * f32 p)               (no GLU)
  o = round(fc2 accumulation in fp32); with a bias: round(f32 o + f32 b2 * p)
  y = combine(o)                                                  [T, H]
Padding rows are zero and carry p = 0, so their activation rows are exactly zero.

Precision (`MoEConfig.expert_precision`, `dispatch_dtype`, `combine_bwd_dtype`):
  * "mxfp8" experts run fc1 and fc2 through `jaxmoe.ops.mxfp8_gmm` (TE's recipe, forward and
    backward) on the compute-dtype copy of the weights; fc2 quantizes the activation after its
    single rounding above (mxfp8.md trap 11). Columnwise (wgrad) copies always come from the
    bf16 rows.
  * dispatch_dtype "mxfp8": the tokens were quantized rowwise before the dispatch
    (`rows_rowwise`). MXFP8 experts use that copy as fc1's fprop operand as it is; bf16 experts
    take its dequantized value as their input.
  * combine_bwd_dtype "mxfp8": the gradient of y is quantized rowwise at token level, before it
    is dispatched back to the rows. MXFP8 experts use the dispatched copy as fc2's dgrad operand
    as it is (so fc2 and the combine share one custom VJP); bf16 experts take its dequantized
    value as their output gradient.
  Quantizers are the identity for the gradient (straight-through), as in TE.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import combine, dispatch
from jaxmoe.mxfp8 import MXTensor, dequantize
from jaxmoe.ops import gmm
from jaxmoe.ops.dense import dense
from jaxmoe.ops.mxfp8_gmm import (Mxfp8GmmResiduals, QuantizedWeights, mxfp8_gmm,
                                  mxfp8_gmm_backward, mxfp8_gmm_forward, quantize_weights)
from jaxmoe.ops.quantize import quantize
from jaxmoe.plan import Plan

F32 = jnp.float32


def activation(z: jax.Array, name: str) -> jax.Array:
    """The (non-gated) activation in fp32: silu, exact-erf gelu, or squared ReLU."""
    if name == "silu":
        return jax.nn.silu(z)
    if name == "gelu":
        return jax.nn.gelu(z, approximate=False)
    if name == "squared_relu":
        return jnp.square(jax.nn.relu(z))
    raise ValueError(f"unknown activation {name!r}")


def weighted_activation(h: jax.Array, probs: jax.Array | None, config: MoEConfig) -> jax.Array:
    """act(h) (times the per-row probability when given) computed in fp32, rounded once to h.dtype.

    h: [M, 2F] ([gate; up]) with a GLU, else [M, F]; probs: [M] or None."""
    z = h.astype(F32)
    if config.gated_linear_unit:
        gate, up = jnp.split(z, 2, axis=-1)
        out = activation(gate, config.activation) * up
    else:
        out = activation(z, config.activation)
    if probs is not None:
        out = out * probs.astype(F32)[:, None]
    return out.astype(h.dtype)


def _per_row(bias: jax.Array, row_expert: jax.Array) -> jax.Array:
    """bias[row_expert] with zeros for rows past the last expert block (row_expert == E)."""
    padded = jnp.concatenate([bias, jnp.zeros((1,) + bias.shape[1:], bias.dtype)], axis=0)
    return jnp.take(padded, row_expert, axis=0)


class ExpertStages(NamedTuple):
    """Intermediate values of the grouped MLP on the expert buffer and its combine."""

    fc1_output: jax.Array     # h [M, 2F|F], rounded to the compute dtype (bias included)
    activation: jax.Array     # a = act(h) * p [M, F], rounded once
    output: jax.Array         # fc2 output [M, H] (probability-scaled bias included)
    combined: jax.Array       # combine(output) [T, H]


@struct.dataclass
class ExpertWeightsMx:
    """The MXFP8 copies of the experts' fc1 and fc2 weights (`quantize_expert_weights`)."""

    fc1: QuantizedWeights
    fc2: QuantizedWeights


def quantize_expert_weights(fc1_kernel: jax.Array, fc2_kernel: jax.Array, dtype,
                            gmm_impl: str = "auto") -> ExpertWeightsMx:
    """Both MXFP8 copies (fprop and dgrad) of fc1 [E, H, 2F|F] and fc2 [E, F, H], from their
    values in the compute dtype: once per optimizer step, shared by that step's micro-batches."""
    return ExpertWeightsMx(fc1=quantize_weights(fc1_kernel.astype(dtype), gmm_impl),
                           fc2=quantize_weights(fc2_kernel.astype(dtype), gmm_impl))


def grouped_mlp(rows: jax.Array, row_probs: jax.Array, plan: Plan, fc1_kernel: jax.Array,
                fc2_kernel: jax.Array, fc1_bias: jax.Array | None, fc2_bias: jax.Array | None,
                config: MoEConfig, *, rows_rowwise: MXTensor | None = None,
                expert_weights: ExpertWeightsMx | None = None,
                gmm_impl: str = "auto") -> ExpertStages:
    """Run every expert on its row block of the buffer and combine the rows back to tokens.

    rows [M, H] (dispatched tokens, compute dtype); row_probs [M]; plan: the buffer layout;
    fc1_kernel [E, H, 2F|F]; fc2_kernel [E, F, H]; biases [E, 2F|F], [E, H] or None;
    rows_rowwise: the dispatched rowwise MXFP8 copy of the tokens (dispatch_dtype "mxfp8"),
    else None. expert_weights: `quantize_expert_weights` of these kernels made earlier in the
    step (MXFP8 experts only; None: quantize here). Returns the stages; `.combined` [T, H] in
    rows.dtype is each token's probability-weighted sum of its expert outputs."""
    dtype, sizes = rows.dtype, plan.group_sizes
    mxfp8_experts = config.expert_precision == "mxfp8"
    if expert_weights is not None and not mxfp8_experts:
        raise ValueError("grouped_mlp: expert_weights are MXFP8 copies; the experts run in "
                         f"{config.expert_precision}")
    fc1_kernel, fc2_kernel = fc1_kernel.astype(dtype), fc2_kernel.astype(dtype)
    # The bias is added to the fp32 accumulator before the single rounding, as in TE's epilogue.
    fc1_out_dtype = F32 if fc1_bias is not None else dtype
    with jax.named_scope("fc1"):
        if mxfp8_experts:
            h = mxfp8_gmm(rows, fc1_kernel, sizes, lhs_rowwise=rows_rowwise, impl=gmm_impl,
                          rhs_quantized=None if expert_weights is None else expert_weights.fc1,
                          preferred_element_type=fc1_out_dtype)
        else:
            fc1_input = (rows if rows_rowwise is None
                         else _straight_through(rows, dequantize(rows_rowwise, dtype)))
            h = gmm(fc1_input, fc1_kernel, sizes, impl=gmm_impl,
                    preferred_element_type=fc1_out_dtype)
        if fc1_bias is not None:
            h = h + _per_row(fc1_bias, plan.row_expert).astype(F32)
        h = h.astype(dtype)
    with jax.named_scope("activation"):
        a = weighted_activation(h, row_probs, config)
    row_bias = (None if fc2_bias is None else
                _per_row(fc2_bias, plan.row_expert).astype(F32) * row_probs.astype(F32)[:, None])
    if mxfp8_experts:
        fc2_weights = None if expert_weights is None else expert_weights.fc2
        out, combined = _mxfp8_fc2_and_combine(a, fc2_kernel, row_bias, plan, fc2_weights,
                                               config.combine_bwd_dtype, gmm_impl)
    else:
        with jax.named_scope("fc2"):
            out = _add_row_bias(gmm(a, fc2_kernel, sizes, impl=gmm_impl,
                                    preferred_element_type=dtype), row_bias)
        with jax.named_scope("combine"):
            combined = combine(out, plan, gmm_impl)
            if config.combine_bwd_dtype == "mxfp8":
                combined = _gradient_through_mxfp8(combined, gmm_impl)
    return ExpertStages(fc1_output=h, activation=a, output=out, combined=combined)


def _add_row_bias(out: jax.Array, row_bias: jax.Array | None) -> jax.Array:
    """round(f32 out + row_bias), or out without a bias."""
    return out if row_bias is None else (out.astype(F32) + row_bias).astype(out.dtype)


@jax.custom_vjp
def _straight_through(x, value):
    """`value` (a quantized copy of x) in the forward; the gradient goes to x unchanged."""
    return value


_straight_through.defvjp(lambda x, value: (value, None), lambda _, grad: (grad, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_through_mxfp8(y, impl):
    """The identity, whose gradient is rounded through rowwise MXFP8 (quantize, dequantize)."""
    return y


_gradient_through_mxfp8.defvjp(
    lambda y, impl: (y, None),
    lambda impl, _, grad: (dequantize(quantize(grad, axis=1, impl=impl), grad.dtype),))


@struct.dataclass
class _Fc2CombineResiduals:
    gemm: Mxfp8GmmResiduals
    plan: Plan
    has_bias: bool = struct.field(pytree_node=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _mxfp8_fc2_and_combine(a, fc2_kernel, row_bias, plan, fc2_weights, combine_bwd_dtype,
                           gmm_impl):
    """(out, combine(out)) with out = MXFP8 fc2 of the activation a (+ the per-row bias).

    One custom VJP for both, so that the backward can quantize the token-level gradient before
    dispatching it and hand that MXTensor to fc2's dgrad (combine_bwd_dtype "mxfp8")."""
    with jax.named_scope("fc2"):
        out = _add_row_bias(mxfp8_gmm(a, fc2_kernel, plan.group_sizes, impl=gmm_impl,
                                      rhs_quantized=fc2_weights,
                                      preferred_element_type=a.dtype), row_bias)
    with jax.named_scope("combine"):
        return out, combine(out, plan, gmm_impl)


def _mxfp8_fc2_and_combine_fwd(a, fc2_kernel, row_bias, plan, fc2_weights, combine_bwd_dtype,
                               gmm_impl):
    a, fc2_kernel, row_bias, plan, fc2_weights = custom_vjp_primal_tree_values(
        (a, fc2_kernel, row_bias, plan, fc2_weights))
    with jax.named_scope("fc2"):
        out, gemm_residuals = mxfp8_gmm_forward(a, fc2_kernel, plan.group_sizes, None, a.dtype,
                                                gmm_impl, fc2_weights)
        out = _add_row_bias(out, row_bias)
    residuals = _Fc2CombineResiduals(gemm=gemm_residuals, plan=plan,
                                     has_bias=row_bias is not None)
    with jax.named_scope("combine"):
        combined = combine(out, plan, gmm_impl)
    return (out, combined), residuals


def _mxfp8_fc2_and_combine_bwd(combine_bwd_dtype, gmm_impl, residuals, cotangents):
    d_out, d_combined = cotangents
    plan = residuals.plan
    if isinstance(d_combined, SymbolicZero):          # only the fc2_output stage is used
        d_combined = jnp.zeros(d_combined.shape, d_combined.dtype)
    with jax.named_scope("combine"):
        # bf16 rows: fc2's wgrad copy, the bias gradient
        d_rows = dispatch(d_combined, plan, gmm_impl)
        grad_rowwise = None
        if not isinstance(d_out, SymbolicZero):
            # The fc2_output stage itself is differentiated: the dispatched token gradient is no
            # longer the whole row gradient, so the sum is quantized on the compute side.
            d_rows = d_rows + d_out
        elif combine_bwd_dtype == "mxfp8":
            grad_rowwise = dispatch(
                quantize(d_combined, axis=1, impl=residuals.gemm.impl), plan)
    with jax.named_scope("fc2"):
        d_a, d_kernel = mxfp8_gmm_backward(residuals.gemm, d_rows, grad_rowwise)
    d_row_bias = d_rows.astype(F32) if residuals.has_bias else None
    return d_a, d_kernel, d_row_bias, None, None


_mxfp8_fc2_and_combine.defvjp(_mxfp8_fc2_and_combine_fwd, _mxfp8_fc2_and_combine_bwd,
                              symbolic_zeros=True)


def shared_mlp(x: jax.Array, fc1_kernel: jax.Array, fc2_kernel: jax.Array,
               gate_kernel: jax.Array | None, config: MoEConfig, impl: str = "auto") -> jax.Array:
    """Shared expert on every token: fc2(act(fc1 x)) with the same rounding points as the routed
    experts (no probability), times sigmoid(x @ gate) rounded in the compute dtype when gated.
    Its matmuls run on `jaxmoe.ops.dense` (batch-invariant on the GPU kernels)."""
    dtype = x.dtype
    h = dense(x, fc1_kernel.astype(dtype), impl=impl)
    out = dense(weighted_activation(h, None, config), fc2_kernel.astype(dtype), impl=impl)
    if gate_kernel is not None:
        logit = dense(x, gate_kernel.astype(dtype), impl=impl)
        gate = jax.nn.sigmoid(logit.astype(F32)).astype(dtype)
        out = out * gate
    return out
