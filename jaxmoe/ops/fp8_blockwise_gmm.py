"""Grouped matmul on FP8-blockwise operands (`jaxmoe.fp8_blockwise.BlockwiseTensor`): what
`jaxmoe.ops.gmm` (fprop and dgrad of Transformer Engine's `Float8BlockScaling` recipe for the
experts; `_gmm_blockwise`) and `jaxmoe.ops.tgmm` (its weight gradient; `_tgmm_blockwise`) run
on them.

  impl "xla"     `fp8_blockwise.gmm_reference`: each 128-wide contraction block's fp32 partial,
                 times the product of its two scales, summed in K order.
  impl "pallas"  the Hopper block-scaled fp8 kernel (`ops/pallas/gmm_mxfp8_hopper.py` with
                 128-wide scale blocks): one fp8 wgmma per 128-wide K block into a fresh
                 accumulator, folded into the running one with its scales (K and N multiples
                 of 128). Its partials come from the tensor core, so it equals the reference
                 where the partials are exact and is within the fp32 bound elsewhere.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".
The weight gradient (tgmm) takes operands 1 x 128 along the tokens (XLA:
`fp8_blockwise.tgmm_reference`, Pallas: `ops/pallas/tgmm_fp8_blockwise_hopper.py`, the same
per-block folds). `fp8_blockwise_gmm` is the differentiable GEMM of the recipe on
high-precision operands, with `BlockwiseWeights` (`quantize_blockwise_weights`) its weights'
copies.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.fp8_blockwise import BLOCK, BlockwiseTensor, gmm_reference, tgmm_reference
from jaxmoe.ops import registry
from jaxmoe.ops.array_gmm import kernel_rows, pad_rows, sum_group_partials
from jaxmoe.ops.checks import check_group_sizes
from jaxmoe.ops.live_rows import fill_dead_rows
from jaxmoe.ops.pallas import tgmm_fp8_blockwise_hopper
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import gmm_block_scaled_fp8_pallas
from jaxmoe.ops.quantize import (
    quantize_1x128_transposed,
    quantize_1x128_with_transpose,
    quantize_128x128_with_transpose,
    requantize_1x128_transposed,
)


def _problem(k: int, n: int) -> str | None:
    if k % BLOCK or n % BLOCK:
        return f"K={k} and N={n} must be multiples of {BLOCK} for the fp8 blockwise kernel"
    return None


registry.register("gmm[BlockwiseTensor]", "pallas", problem=_problem)
registry.register(
    "tgmm[BlockwiseTensor]",
    "pallas",
    problem=lambda k, n: tgmm_fp8_blockwise_hopper.problem(k, n),
)


def _gmm_blockwise(
    lhs: BlockwiseTensor,
    rhs: BlockwiseTensor,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: GmmConfig | None = None,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
) -> jax.Array:
    """`jaxmoe.ops.gmm` on BlockwiseTensors: out[m] = lhs[m] @ rhs[g(m) // groups_per_weight]
    (fprop) or lhs[m] @ rhs[g(m) // groups_per_weight]^T (transpose_rhs: dgrad, the weights'
    128 x 128 blocks serving the transposed product), fp32 accumulation.

    lhs: [M, C] in 1 x 128 blocks along C (the contraction); rhs: the weights [G / n, K, N] in
    128 x 128 blocks (n = groups_per_weight: the n consecutive groups of a matrix run as one),
    contracted over K (C = K, out [M, N]) or, with transpose_rhs, over N (C = N, out [M, K]).
    Rows past sum(group_sizes) give zeros (unspecified with write_rows_past_groups=False,
    `jaxmoe.ops.live_rows`). config: the Pallas kernel's tiling (None: its heuristic
    `gmm_mxfp8_hopper.default_fp8_blockwise_config`). Not differentiable."""
    if not (
        isinstance(lhs, BlockwiseTensor)
        and isinstance(rhs, BlockwiseTensor)
        and lhs.ndim == 2
        and rhs.ndim == 3
        and lhs.block_axes == (1,)
        and rhs.block_axes == (1, 2)
    ):
        raise ValueError(
            "gmm (BlockwiseTensor): lhs must be a BlockwiseTensor [M, C] in 1x128 blocks along "
            "C and rhs one [G, K, N] in 128x128 blocks"
        )
    num_weights, k, n = rhs.shape
    contraction, out_n = (n, k) if transpose_rhs else (k, n)
    if lhs.shape[1] != contraction:
        raise ValueError(
            f"gmm (BlockwiseTensor): lhs has {lhs.shape[1]} columns, the weights contract "
            f"{contraction}"
        )
    if groups_per_weight < 1:
        raise ValueError(
            f"gmm (BlockwiseTensor): groups_per_weight must be >= 1, got {groups_per_weight}"
        )
    check_group_sizes(
        group_sizes, num_weights * groups_per_weight, lhs.shape[0], "gmm (BlockwiseTensor)"
    )
    group_sizes = _sizes_per_weight(group_sizes, groups_per_weight)
    out_dtype = jnp.dtype(preferred_element_type)
    if registry.resolve("gmm[BlockwiseTensor]", impl, contraction, out_n) == "xla":
        out = gmm_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs).astype(out_dtype)
        return out if write_rows_past_groups else fill_dead_rows(out, jnp.sum(group_sizes))
    # The kernel reads both operands K-major: rhs [G, out_n, contraction], and the weight
    # scales as [G, C/128, out_n/128] (scale_inv is [G, K/128, N/128]).
    data, block_scale = rhs.data, rhs.scale_inv
    if transpose_rhs:
        block_scale = jnp.swapaxes(block_scale, 1, 2)
    else:
        data = jnp.swapaxes(data, 1, 2)
    num_rows = lhs.shape[0]
    rows = kernel_rows(num_rows)
    out = gmm_block_scaled_fp8_pallas(
        pad_rows(lhs.data, rows),
        jnp.swapaxes(pad_rows(lhs.scale_inv, rows), 0, 1),
        data,
        block_scale,
        group_sizes.astype(jnp.int32),
        scale_block=BLOCK,
        out_dtype=out_dtype,
        config=config,
        write_rows_past_groups=write_rows_past_groups,
    )
    return out[:num_rows]


def _tgmm_blockwise(
    lhs: BlockwiseTensor,
    rhs: BlockwiseTensor,
    group_sizes: jax.Array,
    *,
    tokens_last: bool = False,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: tgmm_fp8_blockwise_hopper.BlockwiseTgmmConfig | None = None,
) -> jax.Array:
    """`jaxmoe.ops.tgmm` on BlockwiseTensors, the recipe's weight gradient out[g] =
    lhs[rows of g]^T @ rhs[rows of g] for lhs [M, K] and rhs [M, N] in 1 x 128 blocks along M
    (the tokens): each 128-row block's fp32 partial of the fp8 values times the product of its
    two scales, folded in row order
    (`fp8_blockwise.tgmm_reference`). tokens_last: lhs and rhs are instead the K-major copies
    lhs^T [K, M] and rhs^T [N, M] in 1 x 128 blocks along M (axis 1), as
    `ops.quantize_1x128_transposed` makes them and the Pallas kernel reads them (the other
    form costs a transpose of the fp8 data). group_sizes [G]: multiples of 128 adding up to at
    most M (checked when known on the host); rows past them are not read. Groups with no rows
    get zeros. [G, K, N] in preferred_element_type. config: the Pallas kernel's tiling
    (`BlockwiseTgmmConfig`; None: its heuristic `tgmm_fp8_blockwise_hopper.default_config`).
    Not differentiable."""
    token_axis = 1 if tokens_last else 0
    if not (
        isinstance(lhs, BlockwiseTensor)
        and isinstance(rhs, BlockwiseTensor)
        and lhs.ndim == rhs.ndim == 2
        and lhs.block_axes == rhs.block_axes == (token_axis,)
        and lhs.shape[token_axis] == rhs.shape[token_axis]
    ):
        layout = "lhs^T [K, M] and rhs^T [N, M]" if tokens_last else "lhs [M, K] and rhs [M, N]"
        raise ValueError(
            f"tgmm (BlockwiseTensor): {layout} must be BlockwiseTensors in 1x128 blocks along M"
        )
    m, k, n = lhs.shape[token_axis], lhs.shape[1 - token_axis], rhs.shape[1 - token_axis]
    check_group_sizes(group_sizes, None, m, "tgmm (BlockwiseTensor)", multiple=BLOCK)
    out_dtype = jnp.dtype(preferred_element_type)
    if m % BLOCK:  # whole blocks; the tokens added lie past the groups
        pad = [(0, 0), (0, 0)]
        pad[token_axis] = (0, -(-m // BLOCK) * BLOCK - m)
        lhs, rhs = (
            BlockwiseTensor(jnp.pad(t.data, pad), t.scale_inv, t.block_axes, t.fmt)
            for t in (lhs, rhs)
        )
    if registry.resolve("tgmm[BlockwiseTensor]", impl, k, n) == "xla":
        if tokens_last:  # the reference takes the tokens first
            lhs, rhs = (BlockwiseTensor(t.data.T, t.scale_inv.T, (0,), t.fmt) for t in (lhs, rhs))
        return tgmm_reference(lhs, rhs, group_sizes).astype(out_dtype)
    # The kernel reads the data K-major (tokens last) and the scales tokens first.
    if tokens_last:
        operands = [(t.data, t.scale_inv.T) for t in (lhs, rhs)]
    else:
        operands = [(t.data.T, t.scale_inv) for t in (lhs, rhs)]
    (lhs_data, lhs_scale), (rhs_data, rhs_scale) = operands
    return tgmm_fp8_blockwise_hopper.tgmm_fp8_blockwise_pallas(
        lhs_data,
        lhs_scale,
        rhs_data,
        rhs_scale,
        group_sizes,
        out_dtype=out_dtype,
        config=config,
    )


@struct.dataclass
class BlockwiseWeights:
    """The FP8-blockwise copies of expert weights W [G, K, N] (`quantize_blockwise_weights`):
    `weights` (128x128 blocks, what dgrad reads) and `transposed` (W^T [G, N, K], the same
    blocks transposed: K-major, what the fprop kernel reads)."""

    weights: BlockwiseTensor
    transposed: BlockwiseTensor


def quantize_blockwise_weights(rhs: jax.Array, *, impl: registry.Impl = "auto") -> BlockwiseWeights:
    """Both copies of rhs [G, K, N] as `fp8_blockwise_gmm` makes them, from one read of rhs on
    the Pallas kernel (`ops.quantize_128x128_with_transpose`; impl as there). Make them once
    per optimizer step (after the update) and pass them to every micro-batch
    (`rhs_quantized`)."""
    if rhs.ndim != 3:
        raise ValueError(f"quantize_blockwise_weights: rhs must be [G, K, N], got {rhs.shape}")
    return BlockwiseWeights(*quantize_128x128_with_transpose(rhs, impl=impl))


def fp8_blockwise_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_quantized: BlockwiseTensor | None = None,
    lhs_is_dequantized: bool = False,
    rhs_quantized: BlockwiseWeights | None = None,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
) -> jax.Array:
    """Grouped matmul out[m] = lhs[m] @ rhs[g(m) // groups_per_weight] with Transformer Engine's
    FP8 blockwise recipe, differentiable w.r.t. lhs and rhs (straight-through quantizers, as in
    TE):
      fprop  lhs in 1x128 blocks along K  x  rhs in 128x128 blocks  (`jaxmoe.ops.gmm`)
      dgrad  grad in 1x128 blocks along N  x  the same rhs blocks, transposed
      wgrad  lhs and grad each in 1x128 blocks along the rows (`jaxmoe.ops.tgmm`: each
             128-row block's partial times its scales, folded in row order); groups sharing a
             matrix add their partials with `jaxmoe.ordered.sum_in_order` in fp32, as
             `jaxmoe.ops.gmm` does
    lhs [M, K] and rhs [G / n, K, N] high precision (n = groups_per_weight: consecutive groups
    sharing a matrix, the expert-parallel (expert, source) blocks; rhs rounded to lhs's dtype
    before it is quantized; its gradient in its own dtype); K, N and every group size multiples
    of 128 (no 1x128 block along the rows mixes two groups); a group's padding rows must be
    zeros, as the plan makes them (they share the group's blocks along the rows); rows past the
    groups reach no group's result (`jaxmoe.ops.live_rows`). lhs_quantized: the fprop copy of
    lhs quantized elsewhere (the dispatched 1x128 copy of the tokens, dispatch_dtype
    "fp8_blockwise"); it must equal
    `quantize_1x128(lhs, 1)` in value; None: quantize here. lhs_is_dequantized: lhs holds
    `dequantize(lhs_quantized, lhs.dtype)` (the layer's dispatched rows): the wgrad's copy is
    then made from lhs_quantized's fp8 bytes (`requantize_1x128_transposed`, the same bits) and
    lhs's values are never read, so XLA need not compute them. rhs_quantized:
    `quantize_blockwise_weights(rhs)` made earlier in the step (None: quantize here). Neither
    carries a gradient; lhs and rhs do. Result in `preferred_element_type`.
    write_rows_past_groups=False: the rows past the groups of out and d lhs are not computed
    (unspecified, `jaxmoe.ops.live_rows`), nor quantized."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"fp8_blockwise_gmm: lhs must be [M, K] and rhs [G, K, N]; got {lhs.shape}, {rhs.shape}"
        )
    _, k, n = rhs.shape
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"fp8_blockwise_gmm: K={k} and N={n} must be multiples of {BLOCK}")
    if groups_per_weight < 1:
        raise ValueError(
            f"fp8_blockwise_gmm: groups_per_weight must be >= 1, got {groups_per_weight}"
        )
    check_group_sizes(
        group_sizes,
        rhs.shape[0] * groups_per_weight,
        lhs.shape[0],
        "fp8_blockwise_gmm",
        multiple=BLOCK,
    )
    if lhs_quantized is not None and (
        not isinstance(lhs_quantized, BlockwiseTensor)
        or lhs_quantized.shape != lhs.shape
        or lhs_quantized.block_axes != (1,)
    ):
        raise ValueError(
            "fp8_blockwise_gmm: lhs_quantized must be a BlockwiseTensor of lhs's shape "
            f"{lhs.shape} in 1x128 blocks along K (axis 1)"
        )
    if lhs_is_dequantized and lhs_quantized is None:
        raise ValueError("fp8_blockwise_gmm: lhs_is_dequantized needs lhs_quantized")
    if rhs_quantized is not None and (
        not isinstance(rhs_quantized, BlockwiseWeights) or rhs_quantized.weights.shape != rhs.shape
    ):
        raise ValueError(
            "fp8_blockwise_gmm: rhs_quantized must be quantize_blockwise_weights(rhs) of rhs's "
            f"shape {rhs.shape}"
        )
    return _fp8_blockwise_gmm(
        lhs,
        rhs,
        group_sizes.astype(jnp.int32),
        lhs_quantized,
        rhs_quantized,
        jnp.dtype(preferred_element_type),
        impl,
        groups_per_weight,
        bool(lhs_is_dequantized),
        bool(write_rows_past_groups),
    )


def _live_rows(group_sizes, write_rows_past_groups: bool):
    """The rows the quantizes must cover: all (None), or those of the groups."""
    return None if write_rows_past_groups else jnp.sum(group_sizes)


def _sizes_per_weight(group_sizes, groups_per_weight):
    """Rows per matrix: the n consecutive groups of a matrix are contiguous rows."""
    if groups_per_weight == 1:
        return group_sizes
    return group_sizes.reshape(-1, groups_per_weight).sum(axis=1)


@struct.dataclass
class Fp8BlockwiseGmmResiduals:
    """What `fp8_blockwise_gmm`'s backward keeps from its forward: lhs's copy for the weight
    gradient (lhs^T in 1 x 128 blocks along the rows), the weights' 128 x 128 copy for dgrad,
    the group sizes and static settings."""

    lhs_t: BlockwiseTensor
    weights: BlockwiseTensor
    group_sizes: jax.Array
    dtype: Any = struct.field(pytree_node=False)  # compute dtype of lhs and the gradients
    rhs_dtype: Any = struct.field(pytree_node=False)
    impl: str = struct.field(pytree_node=False)
    groups_per_weight: int = struct.field(pytree_node=False)
    write_rows_past_groups: bool = struct.field(pytree_node=False, default=True)


def fp8_blockwise_gmm_forward(
    lhs,
    rhs,
    group_sizes,
    *,
    lhs_quantized=None,
    lhs_is_dequantized=False,
    lhs_t_quantized=None,
    rhs_quantized=None,
    out_dtype,
    impl,
    groups_per_weight=1,
    write_rows_past_groups=True,
) -> tuple[jax.Array, Fp8BlockwiseGmmResiduals]:
    """`fp8_blockwise_gmm`'s forward rule (no argument checks): the output and the residuals
    for `fp8_blockwise_gmm_backward`. Public for ops that fuse the GEMM with their neighbours.
    lhs_t_quantized (with lhs_quantized): the weight gradient's copy of lhs made elsewhere,
    `quantize_1x128_transposed(lhs)` in value (the experts' activation quantized as it is
    computed, `jaxmoe.ops.weighted_activation_quantize_1x128_with_transpose`): lhs's values
    are then never read."""
    dtype = jnp.dtype(lhs.dtype)
    copies = rhs_quantized
    if copies is None:
        copies = quantize_blockwise_weights(rhs.astype(dtype), impl=impl)
    live = _live_rows(group_sizes, write_rows_past_groups)
    if lhs_t_quantized is not None:
        if lhs_quantized is None:
            raise ValueError("fp8_blockwise_gmm_forward: lhs_t_quantized needs lhs_quantized")
        lhs_rowwise, lhs_t = lhs_quantized, lhs_t_quantized
    elif lhs_quantized is None:
        lhs_rowwise, lhs_t = quantize_1x128_with_transpose(lhs, live_rows=live, impl=impl)
    elif lhs_is_dequantized:
        lhs_rowwise = lhs_quantized
        lhs_t = requantize_1x128_transposed(lhs_quantized, dtype, live_rows=live, impl=impl)
    else:
        lhs_rowwise = lhs_quantized
        lhs_t = quantize_1x128_transposed(lhs, live_rows=live, impl=impl)
    out = _gmm_blockwise(
        lhs_rowwise,
        copies.transposed,
        group_sizes,
        groups_per_weight=groups_per_weight,
        transpose_rhs=True,
        impl=impl,
        preferred_element_type=out_dtype,
        write_rows_past_groups=write_rows_past_groups,
    )
    residuals = Fp8BlockwiseGmmResiduals(
        lhs_t=lhs_t,
        weights=copies.weights,
        group_sizes=group_sizes,
        dtype=dtype,
        rhs_dtype=jnp.dtype(rhs.dtype),
        impl=impl,
        groups_per_weight=groups_per_weight,
        write_rows_past_groups=write_rows_past_groups,
    )
    return out, residuals


def fp8_blockwise_gmm_backward(
    residuals: Fp8BlockwiseGmmResiduals,
    grad: jax.Array | None,
    grad_quantized: BlockwiseTensor | None = None,
    grad_t_quantized: BlockwiseTensor | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`fp8_blockwise_gmm`'s backward rule: (d_lhs, d_rhs) for the output gradient grad
    [M, N], rounded to the compute dtype and quantized in 1 x 128 blocks along N (dgrad) and
    along the rows (wgrad). grad_quantized: a 1 x 128 copy along N whose dequantized values in
    the compute dtype are grad (the combine gradient's wire copy): dgrad takes it as it is (the
    same values as grad's copy, so the same products) and wgrad's copy is requantized from its
    fp8 bytes; grad's values are then never read. grad_t_quantized (with grad_quantized): the
    wgrad copy made elsewhere, `quantize_1x128_transposed` of the rounded grad in value (the
    experts' activation gradient quantized as it is computed,
    `jaxmoe.ops.weighted_activation_backward_quantize_1x128_with_transpose`); grad may then be
    None."""
    dtype, impl, n = residuals.dtype, residuals.impl, residuals.groups_per_weight
    live = _live_rows(residuals.group_sizes, residuals.write_rows_past_groups)
    if grad_t_quantized is not None:
        if grad_quantized is None:
            raise ValueError("fp8_blockwise_gmm_backward: grad_t_quantized needs grad_quantized")
        grad_rowwise, grad_t = grad_quantized, grad_t_quantized
    elif grad_quantized is None:
        grad_rowwise, grad_t = quantize_1x128_with_transpose(
            grad.astype(dtype), live_rows=live, impl=impl
        )
    else:
        grad_rowwise = grad_quantized
        grad_t = requantize_1x128_transposed(grad_quantized, dtype, live_rows=live, impl=impl)
    d_lhs = _gmm_blockwise(
        grad_rowwise,
        residuals.weights,
        residuals.group_sizes,
        groups_per_weight=n,
        transpose_rhs=True,
        impl=impl,
        preferred_element_type=dtype,
        write_rows_past_groups=residuals.write_rows_past_groups,
    )
    partials = _tgmm_blockwise(
        residuals.lhs_t,
        grad_t,
        residuals.group_sizes,
        tokens_last=True,
        impl=impl,
        preferred_element_type=dtype,
    )  # each group's partial rounded to the compute dtype, as `jaxmoe.ops.gmm`'s
    return d_lhs, sum_group_partials(partials, n, residuals.rhs_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _fp8_blockwise_gmm(lhs, rhs, group_sizes, lhs_quantized, rhs_quantized, *static):
    return _fp8_blockwise_gmm_fwd(lhs, rhs, group_sizes, lhs_quantized, rhs_quantized, *static)[0]


def _fp8_blockwise_gmm_fwd(lhs, rhs, group_sizes, lhs_quantized, rhs_quantized, *static):
    out_dtype, impl, n, lhs_is_dequantized, written = static
    return fp8_blockwise_gmm_forward(
        lhs,
        rhs,
        group_sizes,
        lhs_quantized=lhs_quantized,
        lhs_is_dequantized=lhs_is_dequantized,
        rhs_quantized=rhs_quantized,
        out_dtype=out_dtype,
        impl=impl,
        groups_per_weight=n,
        write_rows_past_groups=written,
    )


def _fp8_blockwise_gmm_bwd(out_dtype, impl, n, lhs_is_dequantized, written, residuals, grad):
    d_lhs, d_rhs = fp8_blockwise_gmm_backward(residuals, grad)
    return d_lhs, d_rhs, None, None, None


_fp8_blockwise_gmm.defvjp(_fp8_blockwise_gmm_fwd, _fp8_blockwise_gmm_bwd)
