"""Dense matmul whose rows are tokens: `dense(x, w, bias)` = round(x @ w (+ bias)), fp32 accumulation.

The layer's token-row matmuls (router, shared expert) go through this op so that a token's
result never depends on how many other tokens share the call (batch invariance). XLA's dot on
the GPU does not promise that: cuBLAS picks its kernel and split by the number of rows.

Implementations (`impl=`):
  "xla"    `jnp.dot` with fp32 accumulation, differentiated by JAX (the reference). On XLA:CPU a
           row's result does not depend on the other rows once T >= 2 (tested).
  "pallas" the grouped-matmul kernel with one group (`ops/pallas/gmm_hopper.py`), or, for a
           product too small to fill the GPU with that kernel's tiles (the router and the
           shared expert at decode sizes: at most one 64 x 64 tile an SM), the narrow-tile
           kernel (`ops/pallas/dense_narrow_hopper.py`: many CTAs of 64 rows, the same bits).
           Both reduce in an order that depends only on K: batch-invariant. Rows, K and N are
           zero-padded to the kernels' multiples where needed (zero products leave every sum
           unchanged). Backward:
           d x on the same kernel (batch-invariant per token); d w on the weight-gradient
           kernel (`ops/pallas/tgmm_hopper.py`) over row chunks of the batch, summed in fp32 in
           a fixed order (`jaxmoe.ordered.sum_in_order`: the same bits in every compilation,
           which an autotuned library GEMM does not promise); d bias likewise. An fp32 output's
           gradient is split exactly into three bf16 pieces, so both products keep fp32
           precision.
  "auto"   "pallas" on a Hopper GPU for bf16/fp16 operands, else "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.ints import round_up
from jaxmoe.ops import registry
from jaxmoe.ops.array_gmm import KERNEL_DTYPES, KERNEL_MULTIPLE, gmm_product, pad_rows, tgmm_product
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.dense_narrow_hopper import ROWS as NARROW_ROWS
from jaxmoe.ops.pallas.dense_narrow_hopper import (
    default_narrow_config,
    dense_narrow_pallas,
    fits_one_wave,
)
from jaxmoe.ops.pallas.tgmm_hopper import default_tgmm_config
from jaxmoe.ordered import sum_in_order

F32 = jnp.float32


def dense(
    x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, out_dtype=None, impl: str = "auto"
) -> jax.Array:
    """round(x @ w + bias) -> [T, N] in `out_dtype` (default x.dtype), for x [T, K] and w [K, N]
    of one floating dtype and bias [N] (any float dtype, added in fp32) or None; the product is
    accumulated in fp32 and rounded once. Differentiable."""
    registry.check_impl("dense", impl)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"dense: x must be [T, K] and w [K, N]; got {x.shape}, {w.shape}")
    if x.dtype != w.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"dense: x and w must share one floating dtype, got {x.dtype}, {w.dtype}")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"dense: bias must be [{w.shape[1]}], got {bias.shape}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if registry.resolve("dense", impl, x) == "xla":
        acc = jnp.dot(x, w, preferred_element_type=F32)
        return (acc if bias is None else acc + bias.astype(F32)).astype(out_dtype)
    return _dense_pallas(x, w, bias, out_dtype)


def _kernel_problem(x) -> str | None:
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        return f"operands must be bf16 or fp16, got {x.dtype}"
    return None


registry.register("dense", "pallas", problem=_kernel_problem)


def _pad_to_kernel(a: jax.Array, axis: int) -> jax.Array:
    """a with zeros appended along `axis` up to a multiple of 64 (a no-op when it is one)."""
    extra = -a.shape[axis] % KERNEL_MULTIPLE
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _one_group_product(lhs, rhs, *, transpose_rhs: bool, out_dtype) -> jax.Array:
    """lhs [T, K] @ rhs[0] ([1, K, N], or [1, N, K] with transpose_rhs) -> [T, N] on the
    grouped-matmul kernel, its one group's size given on the host, so that the kernel's tile
    metadata is a constant of the executable."""
    one_group = np.array([lhs.shape[0]], np.int32)
    return gmm_product(lhs, rhs, one_group, transpose_rhs, out_dtype, "pallas")


def _product(x, w, out_dtype):
    """x @ w on a kernel, K and N padded to its multiples, result [T, N] in out_dtype: the
    narrow-tile kernel where the product fits one wave of its 64 x 64 tiles, else the
    grouped-matmul kernel."""
    num_rows = x.shape[0]
    x_padded, w_padded = _pad_to_kernel(x, 1), _pad_to_kernel(_pad_to_kernel(w, 0), 1)
    if fits_one_wave(num_rows, w_padded.shape[1], num_sms()):
        out = dense_narrow_pallas(
            pad_rows(x_padded, round_up(num_rows, NARROW_ROWS)),
            w_padded,
            out_dtype=out_dtype,
            config=default_narrow_config(w_padded.shape[0]),
        )
        return out[:num_rows, : w.shape[1]]
    out = _one_group_product(x_padded, w_padded[None], transpose_rhs=False, out_dtype=out_dtype)
    return out[:, : w.shape[1]]


def bf16_pieces(g: jax.Array, dtype) -> list[jax.Array]:
    """g as a list of `dtype` arrays that add up to g exactly: [g] when g already has that
    dtype, else three (hi, mid, lo) for an fp32 g, each the leading 8 significant bits of what
    the earlier ones leave (truncated, so that no piece overflows; Inf and NaN stay in hi). Exact
    for |g| >= 2^-110, where no piece is a denormal (flushed to zero on GPUs and XLA:CPU)."""
    if g.dtype == dtype:
        return [g]
    pieces, rest = [], g.astype(F32)
    for _ in range(3):
        bits = jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000)
        piece = jax.lax.bitcast_convert_type(bits, F32)
        pieces.append(piece.astype(dtype))
        rest = jnp.where(jnp.isfinite(rest), rest - piece, 0.0)
    return pieces


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense_pallas(x, w, bias, out_dtype):
    if bias is None:
        return _product(x, w, out_dtype)
    return (_product(x, w, F32) + bias.astype(F32)).astype(out_dtype)


def _dense_pallas_fwd(x, w, bias, out_dtype):
    return _dense_pallas(x, w, bias, out_dtype), (x, w, bias)


def _row_chunks(num_rows: int, k: int, n: int) -> np.ndarray:
    """Chunk sizes [C] (on the host) splitting the batch for the weight gradient: enough chunks
    that the kernel's (chunk, K tile, N tile) items fill the SMs, each a multiple of 512 rows
    but the last, at least one."""
    config = default_tgmm_config(num_rows, k, n)
    items = (k // config.cta_k) * (n // config.cta_n)
    chunks = max(1, min(-(-config.num_sms // items), num_rows // 512))
    size = -(-num_rows // chunks // 512) * 512
    chunks = -(-num_rows // size)
    return np.array([size] * (chunks - 1) + [num_rows - size * (chunks - 1)], np.int32)


def _dense_pallas_bwd(out_dtype, residuals, grad):
    x, w, bias = residuals
    x_padded = _pad_to_kernel(x, 1)
    w_padded = _pad_to_kernel(_pad_to_kernel(w, 0), 1)[None]
    chunks = _row_chunks(x.shape[0], x_padded.shape[1], w_padded.shape[2])
    d_x = d_w = None
    pieces = bf16_pieces(grad, x.dtype)
    # One piece: the kernel rounds its fp32 sums to x.dtype itself (what astype would do).
    d_x_dtype = x.dtype if len(pieces) == 1 else F32
    for piece in pieces:
        piece = _pad_to_kernel(piece, 1)
        part_x = _one_group_product(piece, w_padded, transpose_rhs=True, out_dtype=d_x_dtype)
        part_w = sum_in_order(tgmm_product(x_padded, piece, chunks, F32, "pallas"))
        d_x = part_x if d_x is None else d_x + part_x
        d_w = part_w if d_w is None else d_w + part_w
    d_x = d_x[:, : x.shape[1]].astype(x.dtype)
    d_w = d_w[: w.shape[0], : w.shape[1]].astype(w.dtype)
    d_bias = None if bias is None else sum_in_order(grad.astype(F32), dtype=bias.dtype)
    return d_x, d_w, d_bias


_dense_pallas.defvjp(_dense_pallas_fwd, _dense_pallas_bwd)
