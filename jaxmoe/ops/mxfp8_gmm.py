"""MXFP8 grouped matmul with Transformer Engine's recipe (specs/mxfp8.md §1.5), forward and
backward, as exact emulation on any backend.

Every operand of every GEMM is quantized from its high-precision tensor, with 32-element blocks
along that GEMM's contraction dim (lhs [M, K], rhs [G, K, N], grad [M, N]):

  GEMM                    lhs operand                      rhs operand
  fprop  out = lhs @ rhs  lhs rowwise (along K)            rhs along K (axis 1)
  dgrad  d_lhs            grad rowwise (along N)           rhs along N (axis 2)
  wgrad  d_rhs            lhs columnwise (along M)         grad columnwise (along M)

Each GEMM is sum_k deq(a) * deq(b) with fp32 accumulation (see `gmm_mxfp8` and `tgmm_mxfp8`
below for how each implementation computes it). Gradients reach the high-precision lhs and rhs as if the quantizer were the
identity (straight-through), as in TE.

Columnwise blocks run along the rows of the expert buffer, so M and every group size must be
multiples of 32 (no block mixes two groups) and rows that belong to no token must be zero (the
plan guarantees both when expert_row_alignment % 32 == 0).

The rhs (the expert weights) is quantized in every call (along K for fprop and, when
differentiating, along N for dgrad) unless the caller passes both copies, made once per optimizer
step with `quantize_weights`, as `rhs_quantized`: micro-batches of one step then share them.

The GEMMs on MXTensor operands are `gmm_mxfp8` (fprop, dgrad) and `tgmm_mxfp8` (wgrad):
  impl "xla"     dequantize to bf16 (exact for magnitudes >= 2^-133), then
                 `jax.lax.ragged_dot` with fp32 accumulation (the reference).
  impl "pallas"  fprop / dgrad, `strategy=`:
                   "dequantize" (default) dequantize both operands to bf16 (exact), then the
                                bf16 gmm kernel;
                   "fp8_wgmma"  the Hopper fp8 kernel (`gmm_mxfp8_pallas`: one fp8 wgmma per
                                32-wide K block, scales folded into the fp32 accumulator).
                 H200 measurements (benchmarks/results/gmm_mxfp8_*.json) put "dequantize" at
                 1.3-2.6x the speed of "fp8_wgmma", and both below bf16. Why neither can beat
                 bf16 on Hopper, which has no block-scaled MMA: an fp8 wgmma over one 32-wide K
                 block costs 32 / 4096 = 1/128 SM clock per output element (4096 fp8 MAC per
                 clock), while folding it into the accumulator with its own scale (the product
                 of a row's and a column's scale, then an FMA) costs 2 / 128 clock per element
                 on the CUDA cores (128 fp32 lanes). Even perfectly overlapped with the tensor
                 cores such a kernel runs at most at half the fp8 rate, which is the bf16 rate;
                 "dequantize" runs the bf16 kernel plus the dequantize passes.
                 wgrad: dequantize to bf16, then the bf16 tgmm kernel.
  impl "auto"    "pallas" on a Hopper GPU when K and N are multiples of 128, else "xla".
Both operands of an fp8 wgmma must be K-major, so the rhs of `gmm_mxfp8` is [G, N, K] with
blocks along K: fprop quantizes rhs^T along K, dgrad uses rhs [G, K, N] quantized along N as is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor, dequantize, scale_multipliers
from jaxmoe.ops.gmm import (_check_group_sizes, _check_impl, _pad_rows, _pallas_rows, gmm,
                            on_hopper, tgmm)
from jaxmoe.ops.pallas.gmm_hopper import GmmConfig, gmm_mxfp8_pallas
from jaxmoe.ops.quantize import quantize


@struct.dataclass
class Mxfp8GmmResiduals:
    """What the backward pass keeps from the forward: the columnwise copies (fp8, smaller than
    the bf16 tensors they replace), the group sizes, and static settings."""

    lhs_columnwise: MXTensor       # lhs quantized along M, for wgrad
    rhs_columnwise: MXTensor       # rhs quantized along N, for dgrad
    group_sizes: jax.Array
    dtype: Any = struct.field(pytree_node=False)       # compute dtype of lhs, rhs and gradients
    impl: str = struct.field(pytree_node=False)


@struct.dataclass
class QuantizedWeights:
    """Both MXFP8 copies of expert weights rhs [G, K, N] (the bf16 master copy stays the
    parameter and receives the gradient)."""

    fprop: MXTensor     # rhs^T [G, N, K], blocks along K
    dgrad: MXTensor     # rhs [G, K, N], blocks along N


def quantize_weights(rhs: jax.Array, impl: str = "auto") -> QuantizedWeights:
    """The fprop and dgrad copies of rhs [G, K, N], as `mxfp8_gmm(impl=impl)` would make them.
    Make them once per optimizer step (after the update) and pass them to every micro-batch."""
    if rhs.ndim != 3:
        raise ValueError(f"quantize_weights: rhs must be [G, K, N], got {rhs.shape}")
    return QuantizedWeights(fprop=_quantize(jnp.swapaxes(rhs, 1, 2), 2, impl),
                            dgrad=_quantize(rhs, 2, impl))


def _known_on_host(a) -> bool:
    """Whether a's values can be read without tracing or stalling an accelerator stream."""
    if isinstance(a, jax.core.Tracer):
        return False
    return not isinstance(a, jax.Array) or all(d.platform == "cpu" for d in a.devices())


def _check_operands(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized=None):
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
    g = rhs.shape[0]
    if rhs_quantized is not None and (
            not isinstance(rhs_quantized, QuantizedWeights)
            or rhs_quantized.fprop.shape != (g, n, k) or rhs_quantized.fprop.axis != 2
            or rhs_quantized.dgrad.shape != (g, k, n) or rhs_quantized.dgrad.axis != 2):
        raise ValueError("mxfp8_gmm: rhs_quantized must be quantize_weights(rhs)")


def mxfp8_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
              lhs_rowwise: MXTensor | None = None, rhs_quantized: QuantizedWeights | None = None,
              preferred_element_type=jnp.float32, impl: str = "auto") -> jax.Array:
    """MXFP8 grouped matmul out[m] = lhs[m] @ rhs[g(m)] (see the module docstring for which copy
    of which operand each GEMM uses); differentiable w.r.t. lhs and rhs.

    lhs [M, K] and rhs [G, K, N] are the high-precision tensors (one dtype, e.g. bf16).
    lhs_rowwise: the fprop copy of lhs when it was quantized elsewhere (e.g. at token level,
      before the dispatch); it must equal `quantize(lhs, axis=1)` up to where it was made.
      None: quantize lhs here. It carries no gradient; lhs does.
    rhs_quantized: `quantize_weights(rhs)` made earlier in the step (None: quantize here). It
      carries no gradient; rhs does.
    Result in `preferred_element_type`."""
    _check_operands(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized)
    return _mxfp8_gmm(lhs, rhs, group_sizes.astype(jnp.int32), lhs_rowwise, rhs_quantized,
                      jnp.dtype(preferred_element_type), impl)


def _decoded_scales(t: MXTensor) -> jax.Array:
    """fp32 block multipliers of t, block axis before the row axis: [..., R, C/32] ->
    [..., C/32, R] (a K block's scales for a row tile are contiguous)."""
    return jnp.swapaxes(scale_multipliers(t.scale), -1, -2)


def _resolve_mx(impl, k, n) -> str:
    _check_impl(impl, "gmm_mxfp8")
    if impl == "auto":
        return "pallas" if on_hopper() and k % 128 == 0 and n % 128 == 0 else "xla"
    return impl


STRATEGIES = ("dequantize", "fp8_wgmma")


def gmm_mxfp8(lhs: MXTensor, rhs: MXTensor, group_sizes: jax.Array, *, impl: str = "auto",
              preferred_element_type=jnp.float32, config: GmmConfig | None = None,
              strategy: str = "dequantize") -> jax.Array:
    """out[m, n] = sum_k deq(lhs)[m, k] * deq(rhs)[g(m), n, k], fp32 accumulation.

    lhs: MXTensor [M, K] with blocks along K (axis 1); rhs: MXTensor [G, N, K] with blocks along
    K (axis 2), i.e. the expert matrices transposed (K-major, what Hopper's fp8 wgmma reads).
    Rows past sum(group_sizes) give zeros. `strategy` picks the Pallas path (module docstring);
    `config` tiles its kernel (None: heuristic). Not differentiable (see `mxfp8_gmm`)."""
    if not (isinstance(lhs, MXTensor) and isinstance(rhs, MXTensor) and lhs.ndim == 2
            and rhs.ndim == 3 and lhs.axis == 1 and rhs.axis == 2
            and lhs.shape[1] == rhs.shape[2]):
        raise ValueError("gmm_mxfp8: lhs must be an MXTensor [M, K] with blocks along K and rhs "
                         "an MXTensor [G, N, K] with blocks along K")
    if strategy not in STRATEGIES:
        raise ValueError(f"gmm_mxfp8: strategy must be one of {STRATEGIES}, got {strategy!r}")
    num_groups, n, k = rhs.shape
    _check_group_sizes(group_sizes, num_groups, lhs.shape[0], "gmm_mxfp8")
    group_sizes = group_sizes.astype(jnp.int32)
    out_dtype = jnp.dtype(preferred_element_type)
    if _resolve_mx(impl, k, n) == "xla":
        out = jax.lax.ragged_dot(dequantize(lhs, jnp.bfloat16),
                                 jnp.swapaxes(dequantize(rhs, jnp.bfloat16), 1, 2),
                                 group_sizes, preferred_element_type=jnp.float32)
        return out.astype(out_dtype)
    if strategy == "dequantize":
        return gmm(dequantize(lhs, jnp.bfloat16), dequantize(rhs, jnp.bfloat16), group_sizes,
                   transpose_rhs=True, impl="pallas", preferred_element_type=out_dtype,
                   config=config)
    num_rows = lhs.shape[0]
    rows = _pallas_rows(num_rows)
    # Padding rows (zero data) belong to no group; their outputs are cut off below.
    lhs_scale = jnp.swapaxes(scale_multipliers(_pad_rows(lhs.scale, rows)), 0, 1)
    out = gmm_mxfp8_pallas(_pad_rows(lhs.data, rows), lhs_scale, rhs.data,
                           _decoded_scales(rhs), group_sizes, out_dtype=out_dtype, config=config)
    return out[:num_rows]


def tgmm_mxfp8(lhs: MXTensor, rhs: MXTensor, group_sizes: jax.Array, *, impl: str = "auto",
               preferred_element_type=jnp.float32) -> jax.Array:
    """Weight-gradient form out[g] = sum over g's rows m of deq(lhs)[m, :]^T deq(rhs)[m, :] ->
    [G, K, N], fp32 accumulation. lhs [M, K] and rhs [M, N] are MXTensors with blocks along M
    (axis 0); group sizes must be multiples of 32 so that no block mixes two groups. Both are
    dequantized to bf16 (exact for magnitudes >= 2^-133) and multiplied by `tgmm`."""
    if not (isinstance(lhs, MXTensor) and isinstance(rhs, MXTensor) and lhs.ndim == 2
            and rhs.ndim == 2 and lhs.axis == 0 and rhs.axis == 0
            and lhs.shape[0] == rhs.shape[0]):
        raise ValueError("tgmm_mxfp8: lhs [M, K] and rhs [M, N] must be MXTensors with blocks "
                         "along M (axis 0)")
    _check_group_sizes(group_sizes, None, lhs.shape[0], "tgmm_mxfp8")
    resolved = _resolve_mx(impl, lhs.shape[1], rhs.shape[1])
    return tgmm(dequantize(lhs, jnp.bfloat16), dequantize(rhs, jnp.bfloat16), group_sizes,
                impl=resolved,
                preferred_element_type=preferred_element_type)


def _quantize(x, axis, impl):
    return quantize(x, axis=axis, impl=impl)


def _fprop(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl):
    lhs_q = _quantize(lhs, 1, impl) if lhs_rowwise is None else lhs_rowwise
    rhs_q = (_quantize(jnp.swapaxes(rhs, 1, 2), 2, impl) if rhs_quantized is None
             else rhs_quantized.fprop)
    return gmm_mxfp8(lhs_q, rhs_q, group_sizes, impl=impl, preferred_element_type=out_dtype)


def mxfp8_gmm_forward(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl, rhs_quantized=None
                      ) -> tuple[jax.Array, Mxfp8GmmResiduals]:
    """`mxfp8_gmm`'s forward rule (no argument checks): the output and the residuals for
    `mxfp8_gmm_backward`. Public for ops that fuse the GEMM with their neighbours."""
    out = _fprop(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl)
    residuals = Mxfp8GmmResiduals(lhs_columnwise=_quantize(lhs, 0, impl),
                                  rhs_columnwise=(_quantize(rhs, 2, impl) if rhs_quantized is None
                                                  else rhs_quantized.dgrad),
                                  group_sizes=group_sizes, dtype=lhs.dtype, impl=impl)
    return out, residuals


def mxfp8_gmm_backward(residuals: Mxfp8GmmResiduals, grad: jax.Array,
                       grad_rowwise: MXTensor | None = None) -> tuple[jax.Array, jax.Array]:
    """`mxfp8_gmm`'s backward rule: (d_lhs, d_rhs) for the output gradient `grad` [M, N].

    grad is rounded to the compute dtype, then quantized columnwise for wgrad and, unless
    `grad_rowwise` (its dgrad copy, made elsewhere) is given, rowwise for dgrad."""
    dtype, sizes, impl = residuals.dtype, residuals.group_sizes, residuals.impl
    grad = grad.astype(dtype)
    grad_q = _quantize(grad, 1, impl) if grad_rowwise is None else grad_rowwise
    d_lhs = gmm_mxfp8(grad_q, residuals.rhs_columnwise, sizes, impl=impl,
                      preferred_element_type=dtype)
    d_rhs = tgmm_mxfp8(residuals.lhs_columnwise, _quantize(grad, 0, impl), sizes, impl=impl,
                       preferred_element_type=dtype)
    return d_lhs, d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _mxfp8_gmm(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl):
    return _fprop(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl)


def _mxfp8_gmm_fwd(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl):
    return mxfp8_gmm_forward(lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl, rhs_quantized)


def _mxfp8_gmm_bwd(out_dtype, impl, residuals, grad):
    d_lhs, d_rhs = mxfp8_gmm_backward(residuals, grad)
    return d_lhs, d_rhs, None, None, None


_mxfp8_gmm.defvjp(_mxfp8_gmm_fwd, _mxfp8_gmm_bwd)
