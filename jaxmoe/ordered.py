"""Float sums in an order fixed by the shape alone.

An XLA reduce leaves its summation order to the code XLA emits for it, and on the GPU XLA picks
that code per compilation by timing candidates (its fusion autotuner): two compilations of the
same program can add in different orders and differ in the last bit. `sum_in_order` adds with
elementwise adds in a balanced pairwise tree, an order no compiler choice changes; its gradient
is elementwise too (no reduce appears in the backward pass). `row_sums_in_order` is the same
idea laid out for the GPU's memory: the sums of wide rows, each as 32 interleaved lanes.
`broadcast_in_order` is the broadcast whose gradient is such a sum.

Every result is materialised behind an optimization barrier: without it XLA may fuse the tree
into a consumer that broadcasts the sum back over the summed axis, recomputing the whole tree
for each element (the likely cause of a 0.31 ms fusion in the qwen3_30b router's backward pass
on the H200)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def sum_in_order(
    x: jax.Array,
    axis: int = 0,
    *,
    keepdims: bool = False,
    levels_per_pass: int | None = None,
    dtype=None,
) -> jax.Array:
    """The sum of x along `axis` as a pairwise tree fixed by the axis length n: each level adds
    neighbours, element 2i to element 2i + 1, and an odd n carries its last element to the next
    level unchanged. n = 0 gives zeros. For n a power of two, summing consecutive blocks of a
    power-of-two length first and then the block sums gives the same tree (what lets a sum over
    ranks be split into a sum inside each rank and one across them).

    levels_per_pass: materialise the partial sums after every that many levels while at least
    as many remain (the same tree and bits; each GPU thread then adds at most 2^levels_per_pass
    elements instead of walking the whole axis).

    dtype: the result rounded once to it (None: x's dtype), inside the barrier, so that the
    rounding is fused with the last adds rather than a pass of its own over the sum.

    Bitwise the same in every compilation and on every backend that rounds each fp add
    (XLA does not reassociate float adds); its error bound is a pairwise sum's, log2(n) ulps."""
    x = jnp.asarray(x)
    axis = axis % x.ndim if x.ndim else 0
    dtype = jnp.dtype(dtype or x.dtype)
    if x.shape[axis] == 0:
        out = jnp.zeros(x.shape[:axis] + x.shape[axis + 1 :], dtype)
        return jnp.expand_dims(out, axis) if keepdims else out
    out = _tree_sum(x, axis, levels_per_pass, dtype)
    return out if keepdims else jnp.squeeze(out, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _tree_sum(x, axis, levels_per_pass, dtype):
    """The tree of `sum_in_order` along a non-empty axis, kept (size 1), in `dtype`."""
    n = x.shape[axis]
    level = 0
    while n > 1:
        half = n // 2
        even = lax.slice_in_dim(x, 0, 2 * half, stride=2, axis=axis)
        odd = lax.slice_in_dim(x, 1, 2 * half, stride=2, axis=axis)
        pairs = even + odd
        if n % 2:
            pairs = jnp.concatenate([pairs, lax.slice_in_dim(x, n - 1, n, axis=axis)], axis)
        x, n, level = pairs, half + n % 2, level + 1
        if levels_per_pass and level % levels_per_pass == 0 and n >= 2**levels_per_pass:
            x = lax.optimization_barrier(x)
    return lax.optimization_barrier(x.astype(dtype))


def _tree_sum_fwd(x, axis, levels_per_pass, dtype):
    return _tree_sum(x, axis, levels_per_pass, dtype), jnp.zeros((x.shape[axis], 0), x.dtype)


def _tree_sum_bwd(axis, levels_per_pass, dtype, length, g):
    """Every element's derivative is exactly 1: the gradient is g spread over the axis (not the
    transposed tree, pads and adds that XLA evaluates for every element), in x's dtype."""
    shape = g.shape[:axis] + (length.shape[0],) + g.shape[axis + 1 :]
    return (jnp.broadcast_to(g.astype(length.dtype), shape),)


_tree_sum.defvjp(_tree_sum_fwd, _tree_sum_bwd)


LANES = 32  # a warp's width: lane j of every row is read by neighbouring threads
# A lane adds at most 2^3 elements of a row per pass over memory: the experts' activation
# backward ran faster so than with 2^4 to 2^6 a pass, with the same bits.
LEVELS_PER_PASS = 3


def row_sums_in_order(x: jax.Array, *, keepdims: bool = False) -> jax.Array:
    """The sums over the last axis of x [..., n] in an order fixed by n, laid out so that the
    GPU reads each row's elements in contiguous runs: for n a multiple of `LANES` (and larger),
    lane j (0 <= j < 32) sums elements j, j + 32, j + 64, ... with `sum_in_order`'s tree, and the
    32 lane sums are added with that tree; other n use `sum_in_order` directly. (One tree over
    the whole row makes each thread walk one row alone: 0.2 ms on the H200 for the probability
    gradient of the qwen3_30b layer's activation, [65536, 768].)"""
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n <= LANES or n % LANES:
        return sum_in_order(x, axis=-1, keepdims=keepdims)
    lanes = sum_in_order(
        x.reshape(x.shape[:-1] + (n // LANES, LANES)), axis=-2, levels_per_pass=LEVELS_PER_PASS
    )
    return sum_in_order(lanes, axis=-1, keepdims=keepdims)


def broadcast_in_order(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`jnp.broadcast_to(x, shape)` whose gradient sums over the broadcast axes with
    `sum_in_order` (`row_sums_in_order` over the last axis; in fp32 for narrower floats, rounded
    once to x.dtype). Autodiff of a plain broadcast (`p[:, None] * a`) sums with an XLA reduce,
    whose order XLA picks per compilation."""
    x = jnp.asarray(x)
    return _broadcast(x, tuple(shape), x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _broadcast(x, shape, in_shape):
    return jnp.broadcast_to(x, shape)


def _broadcast_fwd(x, shape, in_shape):
    return jnp.broadcast_to(x, shape), jnp.zeros((0,), x.dtype)


def _broadcast_bwd(shape, in_shape, residual, g):
    dtype = residual.dtype
    total = g.astype(jnp.promote_types(dtype, jnp.float32))
    lead = len(shape) - len(in_shape)
    for _ in range(lead):
        total = sum_in_order(total, axis=0)
    last = len(in_shape) - 1
    for axis, (size, full) in enumerate(zip(in_shape, shape[lead:], strict=True)):
        if size == 1 and full != 1:
            if axis == last:
                total = row_sums_in_order(total, keepdims=True)
            else:
                total = sum_in_order(total, axis=axis, keepdims=True)
    return (total.astype(dtype),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)
