"""MXFP8 grouped matmul with Transformer Engine's recipe (specs/mxfp8.md §1.5), forward and
backward, as exact emulation on any backend.

Every operand of every GEMM is quantized from its high-precision tensor, with 32-element blocks
along that GEMM's contraction dim (lhs [M, K], rhs [G, K, N], grad [M, N]):

  GEMM                    lhs operand                      rhs operand
  fprop  out = lhs @ rhs  lhs rowwise (along K)            rhs along K (axis 1)
  dgrad  d_lhs            grad rowwise (along N)           rhs along N (axis 2)
  wgrad  d_rhs            lhs columnwise (along M)         grad columnwise (along M)

Each GEMM is sum_k deq(a) * deq(b) with fp32 accumulation: both operands are dequantized to the
compute dtype (exact in bf16 for magnitudes >= 2^-126, §6) and multiplied by `gmm` / `tgmm` with
the configured `impl`. Gradients reach the high-precision lhs and rhs as if the quantizer were the
identity (straight-through), as in TE.

Columnwise blocks run along the rows of the expert buffer, so M and every group size must be
multiples of 32 (no block mixes two groups) and rows that belong to no token must be zero (the
plan guarantees both when expert_row_alignment % 32 == 0).

The rhs (the expert weights) is quantized in every call: along K for fprop and, when
differentiating, along N for dgrad. A caller running several micro-batches per optimizer step
could quantize the weights once per step and reuse them; this module does not cache.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor, dequantize, quantize
from jaxmoe.ops.gmm import gmm, tgmm


@struct.dataclass
class Mxfp8GmmResiduals:
    """What the backward pass keeps from the forward: the columnwise copies (fp8, smaller than
    the bf16 tensors they replace), the group sizes, and static settings."""

    lhs_columnwise: MXTensor       # lhs quantized along M, for wgrad
    rhs_columnwise: MXTensor       # rhs quantized along N, for dgrad
    group_sizes: jax.Array
    dtype: Any = struct.field(pytree_node=False)       # compute dtype of lhs, rhs and gradients
    impl: str = struct.field(pytree_node=False)


def _known_on_host(a) -> bool:
    """Whether a's values can be read without tracing or stalling an accelerator stream."""
    if isinstance(a, jax.core.Tracer):
        return False
    return not isinstance(a, jax.Array) or all(d.platform == "cpu" for d in a.devices())


def _check_operands(lhs, rhs, group_sizes, lhs_rowwise):
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"mxfp8_gmm: lhs must be [M, K] and rhs [G, K, N]; got {lhs.shape}, "
                         f"{rhs.shape}")
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise TypeError(f"mxfp8_gmm: lhs and rhs must share one floating dtype, got {lhs.dtype} "
                        f"and {rhs.dtype}")
    (m, k), n = lhs.shape, rhs.shape[2]
    if m % BLOCK_SIZE or k % BLOCK_SIZE or n % BLOCK_SIZE:
        raise ValueError(f"mxfp8_gmm: M={m}, K={k} and N={n} must be multiples of {BLOCK_SIZE}")
    if _known_on_host(group_sizes) and (jax.device_get(group_sizes) % BLOCK_SIZE).any():
        raise ValueError(f"mxfp8_gmm: group sizes must be multiples of {BLOCK_SIZE} (columnwise "
                         f"blocks may not mix groups), got {jax.device_get(group_sizes).tolist()}")
    if lhs_rowwise is not None and (not isinstance(lhs_rowwise, MXTensor)
                                    or lhs_rowwise.shape != lhs.shape or lhs_rowwise.axis != 1):
        raise ValueError("mxfp8_gmm: lhs_rowwise must be an MXTensor of lhs's shape with blocks "
                         "along K (axis 1)")


def mxfp8_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
              lhs_rowwise: MXTensor | None = None, preferred_element_type=jnp.float32,
              impl: str = "auto") -> jax.Array:
    """MXFP8 grouped matmul out[m] = lhs[m] @ rhs[g(m)] (see the module docstring for which copy
    of which operand each GEMM uses); differentiable w.r.t. lhs and rhs.

    lhs [M, K] and rhs [G, K, N] are the high-precision tensors (one dtype, e.g. bf16).
    lhs_rowwise: the fprop copy of lhs when it was quantized elsewhere (e.g. at token level,
      before the dispatch); it must equal `quantize(lhs, axis=1)` up to where it was made.
      None: quantize lhs here. It carries no gradient; lhs does.
    Result in `preferred_element_type`."""
    _check_operands(lhs, rhs, group_sizes, lhs_rowwise)
    return _mxfp8_gmm(lhs, rhs, group_sizes.astype(jnp.int32), lhs_rowwise,
                      jnp.dtype(preferred_element_type), impl)


def _fprop(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl):
    lhs_q = quantize(lhs, axis=1) if lhs_rowwise is None else lhs_rowwise
    rhs_q = quantize(rhs, axis=1)
    return gmm(dequantize(lhs_q, lhs.dtype), dequantize(rhs_q, rhs.dtype), group_sizes,
               impl=impl, preferred_element_type=out_dtype)


def mxfp8_gmm_forward(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl
                      ) -> tuple[jax.Array, Mxfp8GmmResiduals]:
    """`mxfp8_gmm`'s forward rule (no argument checks): the output and the residuals for
    `mxfp8_gmm_backward`. Public for ops that fuse the GEMM with their neighbours."""
    out = _fprop(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl)
    residuals = Mxfp8GmmResiduals(lhs_columnwise=quantize(lhs, axis=0),
                                  rhs_columnwise=quantize(rhs, axis=2),
                                  group_sizes=group_sizes, dtype=lhs.dtype, impl=impl)
    return out, residuals


def mxfp8_gmm_backward(residuals: Mxfp8GmmResiduals, grad: jax.Array,
                       grad_rowwise: MXTensor | None = None) -> tuple[jax.Array, jax.Array]:
    """`mxfp8_gmm`'s backward rule: (d_lhs, d_rhs) for the output gradient `grad` [M, N].

    grad is rounded to the compute dtype, then quantized columnwise for wgrad and, unless
    `grad_rowwise` (its dgrad copy, made elsewhere) is given, rowwise for dgrad."""
    dtype, sizes, impl = residuals.dtype, residuals.group_sizes, residuals.impl
    grad = grad.astype(dtype)
    grad_q = quantize(grad, axis=1) if grad_rowwise is None else grad_rowwise
    d_lhs = gmm(dequantize(grad_q, dtype), dequantize(residuals.rhs_columnwise, dtype), sizes,
                transpose_rhs=True, impl=impl, preferred_element_type=dtype)
    d_rhs = tgmm(dequantize(residuals.lhs_columnwise, dtype),
                 dequantize(quantize(grad, axis=0), dtype), sizes, impl=impl,
                 preferred_element_type=dtype)
    return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _mxfp8_gmm(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl):
    return _fprop(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl)


def _mxfp8_gmm_bwd(out_dtype, impl, residuals, grad):
    d_lhs, d_rhs = mxfp8_gmm_backward(residuals, grad)
    return d_lhs, d_rhs, None, None


_mxfp8_gmm.defvjp(mxfp8_gmm_forward, _mxfp8_gmm_bwd)
