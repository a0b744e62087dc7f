"""MXFP8 grouped matmul with Transformer Engine's recipe (docs/numerics.md, "MXFP8"), forward
and backward, as exact emulation on any backend.

Every operand of every GEMM is quantized from its high-precision tensor, with 32-element blocks
along that GEMM's contraction dim (lhs [M, K], rhs [G, K, N], grad [M, N]):

  GEMM                    lhs operand                      rhs operand
  fprop  out = lhs @ rhs  lhs rowwise (along K)            rhs along K (axis 1)
  dgrad  d_lhs            grad rowwise (along N)           rhs along N (axis 2)
  wgrad  d_rhs            lhs columnwise (along M)         grad columnwise (along M)

Each GEMM is sum_k deq(a) * deq(b) with fp32 accumulation. Gradients reach the high-precision
lhs and rhs as if the quantizer were the identity (straight-through), as in TE.

Columnwise blocks run along the rows of the expert buffer, so M and every group size must be
multiples of 32 (no block mixes two groups) and a group's rows that belong to no token must be
zero (the plan guarantees both when expert_row_alignment % 32 == 0); rows past the groups reach
no group's result (`jaxmoe.ops.live_rows`).

The rhs (the expert weights) is quantized in every call (along K for fprop and, when
differentiating, along N for dgrad) unless the caller passes both copies, made once per optimizer
step with `quantize_mxfp8_weights` (an `Mxfp8Weights`), as `rhs_quantized`: micro-batches of
one step then share them.

The GEMMs on MXTensor operands are `jaxmoe.ops.gmm` (fprop, dgrad) and `jaxmoe.ops.tgmm`
(wgrad), in `jaxmoe.ops.mxtensor_gmm` (which implementation runs them: see there).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor
from jaxmoe.ops import registry
from jaxmoe.ops.array_gmm import sum_group_partials
from jaxmoe.ops.checks import check_group_sizes
from jaxmoe.ops.mxtensor_gmm import (
    Mxfp8Kernel,
    _gmm_mxtensor,
    _tgmm_mxtensor,
    check_kernel,
    resolve_kernel,
)
from jaxmoe.ops.quantize import quantize


@struct.dataclass
class Mxfp8GmmResiduals:
    """What the backward pass keeps from the forward: the columnwise copies (fp8, smaller than
    the bf16 tensors they replace), the group sizes, and static settings."""

    lhs_columnwise: MXTensor  # lhs quantized along M, for wgrad
    rhs_columnwise: MXTensor  # rhs quantized along N, for dgrad
    group_sizes: jax.Array
    dtype: Any = struct.field(pytree_node=False)  # compute dtype of lhs, rhs and gradients
    impl: str = struct.field(pytree_node=False)
    groups_per_weight: int = struct.field(pytree_node=False, default=1)
    rhs_dtype: Any = struct.field(pytree_node=False, default=None)  # None: dtype


@struct.dataclass
class Mxfp8Weights:
    """Both MXFP8 copies of expert weights rhs [G, K, N] (`quantize_mxfp8_weights`; the bf16
    master copy stays the parameter and receives the gradient)."""

    fprop: MXTensor  # rhs^T [G, N, K], blocks along K
    dgrad: MXTensor | None  # rhs [G, K, N], blocks along N; None: forward only (inference)
    # The Pallas kernel of GEMMs on the fprop copy (all but FP8_WGMMA give the same bits;
    # DECODE suits few rows per group)
    fprop_kernel: Mxfp8Kernel = struct.field(pytree_node=False, default=Mxfp8Kernel.DEQUANTIZE)
    # The fprop copy meets `e4m3_registers.small_scale_dequantization_is_exact`, so that the
    # decode kernel may dequantize it in fewer instructions (the same bits)
    fprop_small_scales: bool = struct.field(pytree_node=False, default=False)
    # The fprop copy's data in the decode kernel's tiled layout (`gmm_decode_hopper.tile_weights`),
    # which that kernel reads faster; None: not stored so
    fprop_tiled: jax.Array | None = None


def quantize_mxfp8_weights(
    rhs: jax.Array, impl: registry.Impl = "auto", *, dgrad: bool = True
) -> Mxfp8Weights:
    """The fprop and dgrad copies of rhs [G, K, N], as `mxfp8_gmm(impl=impl)` would make them.
    Make them once per optimizer step (after the update) and pass them to every micro-batch.
    dgrad=False: the fprop copy alone (inference)."""
    if rhs.ndim != 3:
        raise ValueError(f"quantize_mxfp8_weights: rhs must be [G, K, N], got {rhs.shape}")
    return Mxfp8Weights(
        fprop=_quantize(jnp.swapaxes(rhs, 1, 2), 2, impl),
        dgrad=_quantize(rhs, 2, impl) if dgrad else None,
    )


def _check_operands(
    lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized=None, groups_per_weight=1, backward=True
):
    """backward=False: the forward alone, whose blocks run along K only, so M and the group
    sizes need not be multiples of 32."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"mxfp8_gmm: lhs must be [M, K] and rhs [G, K, N]; got {lhs.shape}, {rhs.shape}"
        )
    if not (
        jnp.issubdtype(lhs.dtype, jnp.floating)
        and jnp.issubdtype(rhs.dtype, jnp.floating)
        and jnp.finfo(rhs.dtype).bits >= jnp.finfo(lhs.dtype).bits
    ):
        raise TypeError(
            f"mxfp8_gmm: lhs and rhs must be floating, rhs no narrower, got {lhs.dtype} and "
            f"{rhs.dtype}"
        )
    (m, k), n = lhs.shape, rhs.shape[2]
    if k % BLOCK_SIZE or n % BLOCK_SIZE:
        raise ValueError(f"mxfp8_gmm: K={k} and N={n} must be multiples of {BLOCK_SIZE}")
    if backward and m % BLOCK_SIZE:
        raise ValueError(
            f"mxfp8_gmm: M={m} must be a multiple of {BLOCK_SIZE} (the backward's columnwise "
            "blocks run along M)"
        )
    check_group_sizes(
        group_sizes,
        rhs.shape[0] * groups_per_weight,
        m,
        "mxfp8_gmm",
        multiple=BLOCK_SIZE if backward else 1,
    )
    if lhs_rowwise is not None and (
        not isinstance(lhs_rowwise, MXTensor)
        or lhs_rowwise.shape != lhs.shape
        or lhs_rowwise.axis != 1
    ):
        raise ValueError(
            "mxfp8_gmm: lhs_rowwise must be an MXTensor of lhs's shape with blocks along K (axis 1)"
        )
    g = rhs.shape[0]
    dgrad = getattr(rhs_quantized, "dgrad", None)
    if rhs_quantized is not None and (
        not isinstance(rhs_quantized, Mxfp8Weights)
        or rhs_quantized.fprop.shape != (g, n, k)
        or rhs_quantized.fprop.axis != 2
        or (dgrad is not None and (dgrad.shape != (g, k, n) or dgrad.axis != 2))
    ):
        raise ValueError("mxfp8_gmm: rhs_quantized must be quantize_mxfp8_weights(rhs)")
    if rhs_quantized is not None:
        check_kernel(rhs_quantized.fprop_kernel, "mxfp8_gmm")


def mxfp8_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_rowwise: MXTensor | None = None,
    lhs_is_dequantized: bool = False,
    rhs_quantized: Mxfp8Weights | None = None,
    preferred_element_type=jnp.float32,
    impl: registry.Impl = "auto",
    groups_per_weight: int = 1,
) -> jax.Array:
    """MXFP8 grouped matmul out[m] = lhs[m] @ rhs[g(m) // groups_per_weight] (see the module
    docstring for which copy of which operand each GEMM uses); differentiable w.r.t. lhs and rhs.

    lhs [M, K] and rhs [G / n, K, N] (n = groups_per_weight, as in `jaxmoe.ops.gmm`: each
    group its own weight-gradient partial, a matrix's partials summed in a fixed order in fp32)
    are the high-precision tensors (e.g. bf16; rhs may be wider, it is rounded to lhs's dtype
    before it is quantized, and gets its gradient in its own dtype).
    lhs_rowwise: the fprop copy of lhs when it was quantized elsewhere (e.g. at token level,
      before the dispatch); it must equal `quantize(lhs, axis=1)` up to where it was made.
      None: quantize lhs here. It carries no gradient; lhs does.
    lhs_is_dequantized: lhs is bitwise lhs_rowwise's dequantized values (the layer's dispatched
      rows with an MXFP8 dispatch), so the forward's kernels that read the dequantized lhs
      take lhs as it is (bf16; see `jaxmoe.ops.gmm`'s lhs_values).
    rhs_quantized: `quantize_mxfp8_weights(rhs)` made earlier in the step (None: quantize here). It
      carries no gradient; rhs does. rhs None: the forward alone on rhs_quantized's fprop copy
      (MXFP8 inference with no high-precision weights; not differentiable).
    Result in `preferred_element_type`."""
    if rhs is None:  # inference on the stored fprop copy alone
        if not isinstance(rhs_quantized, Mxfp8Weights):
            raise ValueError("mxfp8_gmm: without rhs, pass its copies as rhs_quantized")
        g, n, k = rhs_quantized.fprop.shape
        like = jax.ShapeDtypeStruct((g, k, n), lhs.dtype)
        _check_operands(
            lhs, like, group_sizes, lhs_rowwise, rhs_quantized, groups_per_weight, backward=False
        )
        sizes = group_sizes.astype(jnp.int32)
        out_dtype = jnp.dtype(preferred_element_type)
        return _fprop(
            lhs,
            None,
            sizes,
            lhs_rowwise,
            rhs_quantized,
            out_dtype,
            impl,
            groups_per_weight,
            lhs_is_dequantized,
        )
    _check_operands(lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, groups_per_weight)
    return _mxfp8_gmm(
        lhs,
        rhs,
        group_sizes.astype(jnp.int32),
        lhs_rowwise,
        rhs_quantized,
        jnp.dtype(preferred_element_type),
        impl,
        groups_per_weight,
        lhs_is_dequantized,
    )


def _quantize(x, axis, impl):
    return quantize(x, axis=axis, impl=impl)


def _fprop(
    lhs,
    rhs,
    group_sizes,
    lhs_rowwise,
    rhs_quantized,
    out_dtype,
    impl,
    groups_per_weight,
    lhs_is_dequantized=False,
):
    rhs_q = (
        _quantize(rhs.astype(lhs.dtype), 1, impl) if rhs_quantized is None else rhs_quantized.fprop
    )
    kernel = Mxfp8Kernel.DEQUANTIZE if rhs_quantized is None else rhs_quantized.fprop_kernel
    if lhs_rowwise is None:
        # The decode kernel reads lhs dequantized (bf16), so its quantized copy has no other
        # reader: with the XLA quantizer (the same bits) XLA fuses the quantization, the
        # dequantization and lhs's producer into one kernel, where the Pallas quantizer is a
        # kernel of its own and the dequantization another.
        k, n = rhs_q.shape[rhs_q.axis], rhs_q.shape[3 - rhs_q.axis]
        groups = rhs_q.shape[0] * groups_per_weight
        resolved = resolve_kernel(kernel, lhs.shape[0], groups, k, n, rhs_q.axis == 2)
        lhs_rowwise = _quantize(lhs, 1, "xla" if resolved is Mxfp8Kernel.DECODE else impl)
    return _gmm_mxtensor(
        lhs_rowwise,
        rhs_q,
        group_sizes,
        impl=impl,
        preferred_element_type=out_dtype,
        groups_per_weight=groups_per_weight,
        kernel=kernel,
        small_scales=rhs_quantized is not None and rhs_quantized.fprop_small_scales,
        lhs_values=lhs if lhs_is_dequantized and lhs.dtype == jnp.bfloat16 else None,
        rhs_tiled=None if rhs_quantized is None else rhs_quantized.fprop_tiled,
    )


def mxfp8_gmm_forward(
    lhs,
    rhs,
    group_sizes,
    lhs_rowwise,
    out_dtype,
    impl,
    rhs_quantized=None,
    groups_per_weight=1,
    lhs_is_dequantized=False,
) -> tuple[jax.Array, Mxfp8GmmResiduals]:
    """`mxfp8_gmm`'s forward rule (no argument checks): the output and the residuals for
    `mxfp8_gmm_backward`. Public for ops that fuse the GEMM with their neighbours."""
    out = _fprop(
        lhs,
        rhs,
        group_sizes,
        lhs_rowwise,
        rhs_quantized,
        out_dtype,
        impl,
        groups_per_weight,
        lhs_is_dequantized,
    )
    rhs_columnwise = (
        _quantize(rhs.astype(lhs.dtype), 2, impl) if rhs_quantized is None else rhs_quantized.dgrad
    )
    residuals = Mxfp8GmmResiduals(
        lhs_columnwise=_quantize(lhs, 0, impl),
        rhs_columnwise=rhs_columnwise,
        group_sizes=group_sizes,
        dtype=lhs.dtype,
        impl=impl,
        groups_per_weight=groups_per_weight,
        rhs_dtype=rhs.dtype,
    )
    return out, residuals


def mxfp8_gmm_backward(
    residuals: Mxfp8GmmResiduals, grad: jax.Array, grad_rowwise: MXTensor | None = None
) -> tuple[jax.Array, jax.Array]:
    """`mxfp8_gmm`'s backward rule: (d_lhs, d_rhs) for the output gradient `grad` [M, N].

    grad is rounded to the compute dtype, then quantized columnwise for wgrad and, unless
    `grad_rowwise` (its dgrad copy, made elsewhere) is given, rowwise for dgrad."""
    dtype, sizes, impl = residuals.dtype, residuals.group_sizes, residuals.impl
    grad = grad.astype(dtype)
    grad_q = _quantize(grad, 1, impl) if grad_rowwise is None else grad_rowwise
    per_weight = residuals.groups_per_weight
    d_lhs = _gmm_mxtensor(
        grad_q,
        residuals.rhs_columnwise,
        sizes,
        impl=impl,
        kernel=Mxfp8Kernel.DEQUANTIZE,
        preferred_element_type=dtype,
        groups_per_weight=per_weight,
    )
    partials = _tgmm_mxtensor(
        residuals.lhs_columnwise,
        _quantize(grad, 0, impl),
        sizes,
        impl=impl,
        preferred_element_type=dtype,
    )
    rhs_dtype = dtype if residuals.rhs_dtype is None else residuals.rhs_dtype
    return d_lhs, sum_group_partials(partials, per_weight, rhs_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _mxfp8_gmm(
    lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl, per_weight, dequantized
):
    return _fprop(
        lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl, per_weight, dequantized
    )


def _mxfp8_gmm_fwd(
    lhs, rhs, group_sizes, lhs_rowwise, rhs_quantized, out_dtype, impl, per_weight, dequantized
):
    return mxfp8_gmm_forward(
        lhs, rhs, group_sizes, lhs_rowwise, out_dtype, impl, rhs_quantized, per_weight, dequantized
    )


def _mxfp8_gmm_bwd(out_dtype, impl, per_weight, dequantized, residuals, grad):
    d_lhs, d_rhs = mxfp8_gmm_backward(residuals, grad)
    return d_lhs, d_rhs, None, None, None


_mxfp8_gmm.defvjp(_mxfp8_gmm_fwd, _mxfp8_gmm_bwd)
