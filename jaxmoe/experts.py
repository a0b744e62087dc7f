"""Expert MLPs on the expert buffer: fc1 -> activation x probability (rounded once) -> fc2.

Numerics (Megatron's fused weighted-activation kernels, shared spec `megatron_moe.md` §3.4):
  h = round(fc1 accumulation in fp32 [+ b1])                      [M, 2F] or [M, F]
  a = round(act(f32 gate) * f32 up * f32 p)   (GLU; [gate; up] = first and second half of h)
  a = round(act(f32 h) * f32 p)               (no GLU)
  o = round(fc2 accumulation in fp32); with a bias: round(f32 o + f32 b2 * p)
Padding rows are zero and carry p = 0, so their activation rows are exactly zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.ops import gmm

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
    """Intermediate values of the grouped MLP on the expert buffer (all [M, ...])."""

    fc1_output: jax.Array     # h, rounded to the compute dtype (bias included)
    activation: jax.Array     # a = act(h) * p, rounded once
    output: jax.Array         # fc2 output (probability-scaled bias included)


def grouped_mlp(rows: jax.Array, row_probs: jax.Array, group_sizes: jax.Array,
                row_expert: jax.Array, fc1_kernel: jax.Array, fc2_kernel: jax.Array,
                fc1_bias: jax.Array | None, fc2_bias: jax.Array | None, config: MoEConfig,
                *, gmm_impl: str = "auto") -> ExpertStages:
    """Run every expert on its row block of the buffer.

    rows [M, H]; row_probs [M]; group_sizes [E] (padded rows per expert); row_expert [M];
    fc1_kernel [E, H, 2F|F]; fc2_kernel [E, F, H]; biases [E, 2F|F], [E, H] or None.
    Returns the stages; `.output` is [M, H] in rows.dtype, each row already scaled by its
    probability."""
    dtype = rows.dtype
    # The bias is added to the fp32 accumulator before the single rounding, as in TE's epilogue.
    fc1_out_dtype = F32 if fc1_bias is not None else dtype
    h = gmm(rows, fc1_kernel.astype(dtype), group_sizes, impl=gmm_impl,
            preferred_element_type=fc1_out_dtype)
    if fc1_bias is not None:
        h = h + _per_row(fc1_bias, row_expert).astype(F32)
    h = h.astype(dtype)
    a = weighted_activation(h, row_probs, config)
    out = gmm(a, fc2_kernel.astype(dtype), group_sizes, impl=gmm_impl,
              preferred_element_type=dtype)
    if fc2_bias is not None:
        scaled_bias = _per_row(fc2_bias, row_expert).astype(F32) * row_probs.astype(F32)[:, None]
        out = (out.astype(F32) + scaled_bias).astype(dtype)
    return ExpertStages(fc1_output=h, activation=a, output=out)


def shared_mlp(x: jax.Array, fc1_kernel: jax.Array, fc2_kernel: jax.Array,
               gate_kernel: jax.Array | None, config: MoEConfig) -> jax.Array:
    """Shared expert on every token: fc2(act(fc1 x)) with the same rounding points as the routed
    experts (no probability), times sigmoid(x @ gate) rounded in the compute dtype when gated."""
    dtype = x.dtype
    h = jnp.dot(x, fc1_kernel.astype(dtype), preferred_element_type=F32).astype(dtype)
    out = jnp.dot(weighted_activation(h, None, config), fc2_kernel.astype(dtype),
                  preferred_element_type=F32).astype(dtype)
    if gate_kernel is not None:
        logit = jnp.dot(x, gate_kernel.astype(dtype), preferred_element_type=F32).astype(dtype)
        gate = jax.nn.sigmoid(logit.astype(F32)).astype(dtype)
        out = out * gate
    return out
