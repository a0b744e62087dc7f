"""Dispatch (token rows -> expert buffer) and combine (expert buffer -> token rows).

Both are gathers and each is the other's transpose, so neither the forward nor the backward pass
has a scatter-add:
  * dispatch(x)[r] = x[token(r)] (zero for padding rows); its VJP is combine.
  * combine(rows)[t] = sum of the token's kept rows in ascending expert order, accumulated in
    fp32 from the first row and rounded once (a dropped slot adds +0.0); its VJP is dispatch.
  * gather_slots(p)[r] = p[slot(r)] moves per-slot values (the routing probabilities) into the
    buffer; each slot owns at most one row, so its VJP is the gather back along `slot_row`.
A token's combined value depends only on its own rows, in a fixed order: batch invariant.
The bf16 / fp32 row moves run on `jaxmoe.ops.permute` (`impl`: Hopper kernels or XLA, same bits).

`dispatch` also moves quantized token copies (`jaxmoe.wire`: MXFP8 or FP8-blockwise data and
scale rows gathered by the same index), so that tokens can be quantized once, before the
dispatch, and travel quantized alone. A quantized copy carries no gradient: `dequantized_rows`
gives the experts its values and sends their gradient back to the tokens through the route's
transpose, treating the quantizer as the identity (straight-through).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.mxfp8 import MXTensor
from jaxmoe.ops.permute import combine_rows, dispatch_rows
from jaxmoe.ops.quantize import dispatch_fake_quantize
from jaxmoe.plan import Plan
from jaxmoe.wire import QuantizedRows, dequantize_rows, move_rows


def token_rows(plan: Plan) -> jax.Array:
    """[T, k] each token's buffer rows in ascending expert order (M for dropped slots, last): the
    rows `combine` adds, in its order."""
    return jnp.take_along_axis(plan.slot_row, plan.combine_slot, axis=1)


def _dispatch(x, plan, impl):
    return dispatch_rows(x, plan.row_slot, per_token=plan.top_k, impl=impl)


def _combine(rows, plan, out_dtype, impl):
    return combine_rows(rows, token_rows(plan), out_dtype, impl=impl)


def dispatch(x: jax.Array | QuantizedRows, plan: Plan, impl: str = "auto"):
    """Gather token rows x[T, H] into the expert buffer [M, H] laid out by `plan`; padding rows
    are zero. `impl`: `jaxmoe.ops.permute`'s ("auto": the Hopper kernel on a Hopper GPU).

    x may be a quantized copy blocked along H (`jaxmoe.wire`): its data and scale rows move
    together, padding rows get zero data and zero scales. For MXFP8 the result equals
    quantizing the dispatched rows bitwise (a zero block's scale byte is 0); an FP8-blockwise
    zero row would have scale 1, so only its data and its value (0) agree.
    Differentiable for arrays only (the VJP is `combine`)."""
    if isinstance(x, MXTensor):
        # Every reader of a dispatched MXFP8 copy dequantizes it with XLA, which fuses this
        # gather into the dequantization: faster than the dispatch kernel's copy followed by the
        # dequantization at every size tried.
        return move_rows(x, lambda a: _dispatch(a, plan, "xla"))
    if isinstance(x, QuantizedRows):
        return move_rows(x, lambda a: _dispatch_bits(a, plan, impl))
    return _dispatch_array(x, plan, impl)


def _dispatch_bits(a: jax.Array, plan: Plan, impl: str) -> jax.Array:
    """An FP8-blockwise copy's data or scale rows gathered bit for bit: the float8 data rows,
    which the fp8 GEMM kernels read as they are, on the dispatch kernel where it takes them
    (impl "pallas" or "auto"); the scale rows of a few bytes, and everything with impl "xla",
    on XLA."""
    on_kernel = impl != "xla" and jnp.dtype(a.dtype).itemsize == 1
    return _dispatch(a, plan, "auto" if on_kernel else "xla")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch_array(x, plan, impl):
    return _dispatch(x, plan, impl)


def _dispatch_fwd(x, plan, impl):
    return _dispatch(x, plan, impl), (plan, jnp.zeros((0,), x.dtype))


def _dispatch_bwd(impl, residuals, grad):
    plan, dtype_carrier = residuals
    return _combine(grad, plan, dtype_carrier.dtype, impl), None


_dispatch_array.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(rows: jax.Array, plan: Plan, impl: str = "auto") -> jax.Array:
    """y[t] = sum of token t's kept rows in ascending expert order (fp32 accumulation from the
    first row, one rounding to rows.dtype; `jaxmoe.ops.permute.combine_rows`) -> [T, H].
    `impl`: `jaxmoe.ops.permute`'s."""
    return _combine_array(rows, plan, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine_array(rows, plan, impl):
    return _combine(rows, plan, rows.dtype, impl)


def _combine_fwd(rows, plan, impl):
    return _combine(rows, plan, rows.dtype, impl), (plan, jnp.zeros((0,), rows.dtype))


def _combine_bwd(impl, residuals, grad):
    plan, dtype_carrier = residuals
    return _dispatch(grad, plan, impl).astype(dtype_carrier.dtype), None


_combine_array.defvjp(_combine_fwd, _combine_bwd)


@jax.custom_vjp
def gather_slots(values: jax.Array, plan: Plan) -> jax.Array:
    """Per-slot values [T, k] -> per-row values [M] (zero for padding rows)."""
    return dispatch_rows(values.reshape(-1, 1), plan.row_slot, impl="xla")[:, 0]


def _gather_slots_fwd(values, plan):
    return gather_slots(values, plan), plan


def _gather_slots_bwd(plan, grad):
    slots = dispatch_rows(grad[:, None], plan.slot_row.reshape(-1), impl="xla")
    return slots.reshape(plan.slot_row.shape), None


gather_slots.defvjp(_gather_slots_fwd, _gather_slots_bwd)


@struct.dataclass
class LocalRoute:
    """How tokens reach the experts on this device and come back: the plan's expert buffer.

    The experts' code sees a route only through these members, so that an expert-parallel
    route (`jaxmoe.exchange.ExchangedRoute`, rows moved to the experts' owners) runs the same
    GEMMs, activation and gradient rules:
      group_sizes [G]  rows per group of the buffer the GEMMs read (padding included)
      groups_per_weight  n: groups g of one expert are n consecutive ones (expert g // n)
      row_group [M]    group of each buffer row (G past the last block)
      per_group(w)     an expert tensor [E, ...] -> one entry per group [G, ...]
      to_experts(x)    token rows [T, H] (array or quantized copy) -> buffer rows
      to_experts_with_values(copy, dtype)  a quantized copy of token rows -> (its buffer rows,
                       their dequantized values in dtype); no gradient
      to_tokens(rows)  buffer rows -> each token's rows combined [T, H]; VJP: to_experts
      slot_values(v)   per-slot values [T, k] -> per-row values [M]
      live_rows        None, or an int32 scalar: the buffer's rows at and past it hold no
                       block and the passes that take it skip them (`jaxmoe.ops.live_rows`)"""

    plan: Plan
    impl: str = struct.field(pytree_node=False, default="auto")

    @property
    def group_sizes(self) -> jax.Array:
        return self.plan.group_sizes

    @property
    def groups_per_weight(self) -> int:
        return 1

    @property
    def row_group(self) -> jax.Array:
        return self.plan.row_expert

    @property
    def live_rows(self) -> None:
        return None  # rows past the blocks: the padding slack of one buffer, zeros

    def per_group(self, weights: jax.Array) -> jax.Array:
        return weights  # one group per expert

    def to_experts(self, x: jax.Array | QuantizedRows) -> jax.Array | QuantizedRows:
        return dispatch(x, self.plan, self.impl)

    def to_experts_with_values(self, copy: QuantizedRows, dtype) -> tuple[QuantizedRows, jax.Array]:
        rows_quantized = self.to_experts(copy)
        return rows_quantized, dequantize_rows(rows_quantized, dtype)

    def to_tokens(self, rows: jax.Array) -> jax.Array:
        return combine(rows, self.plan, self.impl)

    def slot_values(self, values: jax.Array) -> jax.Array:
        return gather_slots(values, self.plan)


def dequantized_rows(
    tokens: jax.Array, copy: QuantizedRows, route
) -> tuple[QuantizedRows, jax.Array]:
    """(the dispatched copy, its rows in tokens.dtype) for copy = `quantize_tokens(tokens, ...)`:
    what the experts see when the quantized copy alone is dispatched
    (`route.to_experts_with_values`). The rows' gradient goes to the tokens as the dispatch's
    would (`route.to_tokens`, its transpose), the quantizer taken as the identity
    (straight-through, as Transformer Engine does).

    On this device (a `LocalRoute`) an MXFP8 copy's values come from the tokens in one pass
    (`jaxmoe.ops.dispatch_fake_quantize`: gathered, quantized and dequantized, the same bits),
    so the dispatched copy itself is computed only where something reads it."""
    if isinstance(route, LocalRoute) and isinstance(copy, MXTensor):
        return route.to_experts(copy), _fake_quantized_rows(tokens, route, copy.fmt)
    rows_quantized, values = route.to_experts_with_values(copy, tokens.dtype)
    return rows_quantized, _straight_through(tokens, values, route)


def _to_tokens_bwd(residuals, grad):
    route, dtype_carrier = residuals
    return route.to_tokens(grad).astype(dtype_carrier.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fake_quantized_rows(tokens, route, fmt):
    plan = route.plan
    return dispatch_fake_quantize(tokens, plan.row_slot, fmt, per_token=plan.top_k, impl=route.impl)


def _fake_quantized_rows_fwd(tokens, route, fmt):
    return _fake_quantized_rows(tokens, route, fmt), (route, jnp.zeros((0,), tokens.dtype))


_fake_quantized_rows.defvjp(
    _fake_quantized_rows_fwd, lambda fmt, residuals, grad: (_to_tokens_bwd(residuals, grad), None)
)


@jax.custom_vjp
def _straight_through(tokens, values, route):
    """values (the dispatched copy's, computed without a gradient), whose gradient goes to the
    tokens through the route."""
    return values


def _straight_through_fwd(tokens, values, route):
    return values, (route, jnp.zeros((0,), tokens.dtype))


_straight_through.defvjp(
    _straight_through_fwd, lambda residuals, grad: (_to_tokens_bwd(residuals, grad), None, None)
)
