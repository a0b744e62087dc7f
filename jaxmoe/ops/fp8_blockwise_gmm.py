"""Grouped matmul on FP8-blockwise operands (`jaxmoe.fp8_blockwise.BlockwiseTensor`): fprop and
dgrad of Transformer Engine's `Float8BlockScaling` recipe for the experts.

  impl "xla"     `fp8_blockwise.gmm_reference`: each 128-wide contraction block's fp32 partial,
                 times the product of its two scales, summed in K order.
  impl "pallas"  the Hopper block-scaled fp8 kernel (`ops/pallas/gmm_mxfp8_hopper.py` with
                 128-wide scale blocks): one fp8 wgmma per 128-wide K block into a fresh
                 accumulator, folded into the running one with its scales (K and N multiples
                 of 128). Its partials come from the tensor core, so it equals the reference
                 where the partials are exact and is within the fp32 bound elsewhere.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.fp8_blockwise import BLOCK, BlockwiseTensor, gmm_reference
from jaxmoe.ops import registry
from jaxmoe.ops.checks import check_group_sizes
from jaxmoe.ops.gmm import kernel_rows, pad_rows
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import gmm_block_scaled_fp8_pallas


def _problem(k: int, n: int) -> str | None:
    if k % BLOCK or n % BLOCK:
        return f"K={k} and N={n} must be multiples of {BLOCK} for the fp8 blockwise kernel"
    return None


registry.register("gmm_fp8_blockwise", "pallas", problem=_problem)


def gmm_fp8_blockwise(
    lhs: BlockwiseTensor,
    rhs: BlockwiseTensor,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    impl: str = "auto",
    preferred_element_type=jnp.float32,
    config: GmmConfig | None = None,
) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] (fprop) or lhs[m] @ rhs[g(m)]^T (transpose_rhs: dgrad, the
    weights' 128 x 128 blocks serving the transposed product), fp32 accumulation.

    lhs: [M, C] in 1 x 128 blocks along C (the contraction); rhs: the weights [G, K, N] in
    128 x 128 blocks, contracted over K (C = K, out [M, N]) or, with transpose_rhs, over N
    (C = N, out [M, K]). Rows past sum(group_sizes) give zeros. config: the Pallas kernel's
    tiling (None: its heuristic). Not differentiable."""
    if not (
        isinstance(lhs, BlockwiseTensor)
        and isinstance(rhs, BlockwiseTensor)
        and lhs.ndim == 2
        and rhs.ndim == 3
        and lhs.block_axes == (1,)
        and rhs.block_axes == (1, 2)
    ):
        raise ValueError(
            "gmm_fp8_blockwise: lhs must be a BlockwiseTensor [M, C] in 1x128 blocks along C "
            "and rhs one [G, K, N] in 128x128 blocks"
        )
    num_weights, k, n = rhs.shape
    contraction, out_n = (n, k) if transpose_rhs else (k, n)
    if lhs.shape[1] != contraction:
        raise ValueError(
            f"gmm_fp8_blockwise: lhs has {lhs.shape[1]} columns, the weights contract {contraction}"
        )
    check_group_sizes(group_sizes, num_weights, lhs.shape[0], "gmm_fp8_blockwise")
    out_dtype = jnp.dtype(preferred_element_type)
    if registry.resolve("gmm_fp8_blockwise", impl, contraction, out_n) == "xla":
        out = gmm_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
        return out.astype(out_dtype)
    # The kernel reads both operands K-major: rhs [G, out_n, contraction], and its scales per
    # output column (a 128 x 128 block's scale repeated over the block's columns).
    data, scale = rhs.data, rhs.scale_inv
    if not transpose_rhs:
        data, scale = jnp.swapaxes(data, 1, 2), jnp.swapaxes(scale, 1, 2)
    column_scale = jnp.swapaxes(jnp.repeat(scale, BLOCK, axis=1), 1, 2)  # [G, C/128, out_n]
    num_rows = lhs.shape[0]
    rows = kernel_rows(num_rows)
    out = gmm_block_scaled_fp8_pallas(
        pad_rows(lhs.data, rows),
        jnp.swapaxes(pad_rows(lhs.scale_inv, rows), 0, 1),
        data,
        column_scale,
        group_sizes.astype(jnp.int32),
        scale_block=BLOCK,
        out_dtype=out_dtype,
        config=config,
    )
    return out[:num_rows]
