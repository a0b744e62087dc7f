"""The quantized token rows that travel instead of bf16 ones: the dispatched tokens
(`MoEConfig.dispatch_dtype`) and the output gradient sent back through the combine
(`MoEConfig.combine_bwd_dtype`), to halve the bytes of the expert-parallel all-to-all.

  "bf16"           the rows themselves (nothing quantized)
  "mxfp8"          rowwise MXFP8 (`jaxmoe.mxfp8.MXTensor`: 32-wide blocks along H, E8M0
                   scales), Transformer Engine's MXFP8 recipe
  "fp8_blockwise"  1x128 blocks along H (`jaxmoe.fp8_blockwise.BlockwiseTensor`: e4m3, one
                   power-of-two fp32 scale per block), TE's `Float8BlockScaling` activations

A token is quantized once, at token level, before it moves (`quantize_tokens`); the dispatch and
the expert-parallel exchange move the copy's data and scale rows with the same index
(`move_rows`), padding rows getting zero data and zero scales (they dequantize to 0). Across
devices a row's data and scales travel as one row of bytes (`pack_rows`: MXFP8's [H | H/32]),
so one collective carries the copy. Whatever
reads the high-precision rows reads the copy's dequantized values, so only the copy needs to
travel (on one device `jaxmoe.dispatch.dequantized_rows` makes those values from the tokens in
one pass, and the copy is computed only where it is read); experts of the copy's own format use
it as their GEMM operand as it is. A copy carries
no gradient: its users send the gradient to the high-precision rows as if the quantizer were
the identity (straight-through, as TE does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmoe.fp8_blockwise import BlockwiseTensor
from jaxmoe.mxfp8 import MXTensor
from jaxmoe.ops.quantize import quantize, quantize_1x128

WIRE_DTYPES = ("bf16", "mxfp8", "fp8_blockwise")
QuantizedRows = MXTensor | BlockwiseTensor


def quantize_tokens(x: jax.Array, wire_dtype: str, impl: str = "auto") -> QuantizedRows:
    """x [T, H] quantized in blocks along H in `wire_dtype` ("mxfp8" or "fp8_blockwise"); no
    gradient flows through it. impl: the quantize's (`jaxmoe.ops.quantize`, `quantize_1x128`)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_tokens: x must be [T, H], got {x.shape}")
    x = jax.lax.stop_gradient(x)
    if wire_dtype == "mxfp8":
        return quantize(x, axis=1, impl=impl)
    if wire_dtype == "fp8_blockwise":
        return quantize_1x128(x, axis=1, impl=impl)
    raise ValueError(
        f"quantize_tokens: wire_dtype must be 'mxfp8' or 'fp8_blockwise', got {wire_dtype!r}"
    )


def is_token_rows(t) -> bool:
    """Whether t is a quantized [T, H] array blocked along H (what `move_rows` takes)."""
    if isinstance(t, MXTensor):
        return t.ndim == 2 and t.axis == 1
    if isinstance(t, BlockwiseTensor):
        return t.ndim == 2 and t.block_axes == (1,)
    return False


def move_rows(t: QuantizedRows, move: Callable[[jax.Array], jax.Array]) -> QuantizedRows:
    """t with `move` (a row permutation with zero fill, e.g. the dispatch's gather) applied to its
    data rows and its scale rows alike."""
    if not is_token_rows(t):
        raise ValueError(
            f"move_rows: a quantized copy must be [T, H] with blocks along H (axis 1), got {t!r}"
        )
    return jax.tree.map(move, t)


def dequantize_rows(t: QuantizedRows, dtype) -> jax.Array:
    """The copy's values in `dtype` (exact: each is an fp8 value times a power of two)."""
    return t.dequantize(dtype)


def pack_rows(t: QuantizedRows) -> jax.Array:
    """t's data and scale rows side by side as bytes, [T, row bytes] uint8 (MXFP8: [H | H/32]),
    so that one move carries the whole copy; `unpack_rows` takes them apart."""
    if not is_token_rows(t):
        raise ValueError(
            f"pack_rows: a quantized copy must be [T, H] with blocks along H (axis 1), got {t!r}"
        )
    return jnp.concatenate([_as_row_bytes(a) for a in jax.tree.leaves(t)], axis=1)


def unpack_rows(packed: jax.Array, like: QuantizedRows) -> QuantizedRows:
    """Rows packed by `pack_rows` (any number of them, e.g. after a move) back into a copy of
    `like`'s kind (format, row width); the bits are the packed ones."""
    leaves, treedef = jax.tree.flatten(like)
    widths = [_row_byte_count(a) for a in leaves]
    if packed.dtype != jnp.uint8 or packed.ndim != 2 or packed.shape[1] != sum(widths):
        raise ValueError(
            f"unpack_rows: uint8 [rows, {sum(widths)}] expected for {like!r}, "
            f"got {packed.dtype} {packed.shape}"
        )
    parts, start = [], 0
    for a, width in zip(leaves, widths, strict=True):
        parts.append(_from_row_bytes(packed[:, start : start + width], a))
        start += width
    return jax.tree.unflatten(treedef, parts)


def _row_byte_count(a) -> int:
    return math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize


def _as_row_bytes(a: jax.Array) -> jax.Array:
    """[T, ...] -> [T, bytes a row] uint8, the same bits."""
    rows = a.reshape(a.shape[0], -1)
    if rows.dtype != jnp.uint8:
        rows = jax.lax.bitcast_convert_type(rows, jnp.uint8)  # itemsize > 1: [T, n, itemsize]
    return rows.reshape(a.shape[0], -1)


def _from_row_bytes(rows: jax.Array, like) -> jax.Array:
    """[N, bytes a row] uint8 -> [N, *like.shape[1:]] in like's dtype, the same bits."""
    itemsize = jnp.dtype(like.dtype).itemsize
    if itemsize > 1:
        rows = rows.reshape(rows.shape[0], -1, itemsize)
    if like.dtype != jnp.uint8:
        rows = jax.lax.bitcast_convert_type(rows, like.dtype)
    return rows.reshape((rows.shape[0],) + tuple(like.shape[1:]))
