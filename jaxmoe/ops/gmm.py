"""Grouped matmuls, one API for every operand type: `gmm` (rows of each group times that group's
matrix: fprop and dgrad) and `tgmm` (its weight-gradient form), each taking float arrays,
`MXTensor`s or `BlockwiseTensor`s and picking the recipe by the operands' types:

  lhs, rhs                           gmm / tgmm
  float arrays (bf16, fp16, fp32)    `jaxmoe.ops.array_gmm`: differentiable (custom VJP)
  MXTensor, MXTensor                 `jaxmoe.ops.mxtensor_gmm`: MXFP8, `kernel=` picks the kernel
  BlockwiseTensor, BlockwiseTensor   `jaxmoe.ops.fp8_blockwise_gmm`: TE's FP8 blockwise blocks

Any other pair (an array and an MXTensor, say) is a TypeError. The quantized products are not
differentiable; the recipes that quantize inside, from high-precision operands, are
`jaxmoe.ops.mxfp8_gmm` and `jaxmoe.ops.fp8_blockwise_gmm`.

Groups are consecutive row blocks of `lhs`: group g owns rows [offset_g, offset_g + group_sizes[g]),
offset_g = sum(group_sizes[:g]). Rows at or past sum(group_sizes) produce zeros (gmm; unspecified
with `write_rows_past_groups=False`, `jaxmoe.ops.live_rows`) and are left out (tgmm). Sizes must
be >= 0 and add up to at most M (checked when they are concrete). Several consecutive groups may
share one matrix (`groups_per_weight` n: group g multiplies rhs[g // n]), as the blocks of one
expert's rows from n sources do under expert parallelism.

`impl` (`Impl`): "xla" (the reference every kernel is tested against, runs anywhere), "pallas"
(the Hopper Mosaic GPU kernels; a problem they cannot run raises ValueError; off the GPU it runs
only inside the Mosaic GPU interpreter) or "auto" ("pallas" on a Hopper GPU when the problem
qualifies, else "xla"). Each operand type's module says which kernels run and what they need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.fp8_blockwise import BlockwiseTensor
from jaxmoe.mxfp8 import MXTensor
from jaxmoe.ops import registry
from jaxmoe.ops.array_gmm import _gmm_arrays, _tgmm_arrays
from jaxmoe.ops.fp8_blockwise_gmm import _gmm_blockwise, _tgmm_blockwise
from jaxmoe.ops.mxtensor_gmm import Mxfp8Kernel, _gmm_mxtensor, _tgmm_mxtensor, check_kernel
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_decode_hopper import DecodeConfig
from jaxmoe.ops.pallas.tgmm_fp8_blockwise_hopper import BlockwiseTgmmConfig
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig


def _operand_kind(x) -> type | None:
    """The operand type that picks the recipe: MXTensor, BlockwiseTensor, jax.Array (for any
    array), or None for anything else."""
    for kind in (MXTensor, BlockwiseTensor):
        if isinstance(x, kind):
            return kind
    return jax.Array if isinstance(x, jax.Array | np.ndarray) else None


def _describe(x) -> str:
    """An operand's type for an error message."""
    if isinstance(x, jax.Array | np.ndarray):
        return f"array ({x.dtype})"
    return type(x).__name__


def _operands_kind(op: str, lhs, rhs) -> type:
    """The kind both operands share, or TypeError naming both types."""
    kind = _operand_kind(lhs)
    if kind is None or _operand_kind(rhs) is not kind:
        raise TypeError(
            f"{op}: lhs and rhs must both be float arrays, both MXTensors or both "
            f"BlockwiseTensors; got {_describe(lhs)} and {_describe(rhs)}"
        )
    return kind


def _reject(op: str, kind: type, **options) -> None:
    """ValueError for the first option given (truthy) that `kind` operands do not take."""
    for name, given in options.items():
        if given:
            raise ValueError(f"{op}: {name}= does not apply to {kind.__name__} operands")


def _check_config(op: str, kind: type, config, allowed: tuple[type, ...]) -> None:
    """TypeError unless config is None or one of the `allowed` types for `kind` operands."""
    if config is not None and not isinstance(config, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise TypeError(
            f"{op}: {kind.__name__} operands take a {names} config, got {type(config).__name__}"
        )


def gmm(
    lhs: jax.Array | MXTensor | BlockwiseTensor,
    rhs: jax.Array | MXTensor | BlockwiseTensor,
    group_sizes: jax.Array,
    *,
    impl: registry.Impl = "auto",
    transpose_rhs: bool = False,
    preferred_element_type=jnp.float32,
    config: GmmConfig | DecodeConfig | None = None,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
    kernel: Mxfp8Kernel = Mxfp8Kernel.AUTO,
    small_scales: bool = False,
    lhs_values: jax.Array | None = None,
    rhs_tiled: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul out[m] = lhs[m] @ rhs[g(m) // groups_per_weight] (or, transpose_rhs,
    lhs[m] @ rhs[g(m) // groups_per_weight]^T) with fp32 accumulation, the result in
    `preferred_element_type`; the recipe follows the operands' types (module docstring).

    lhs [M, K] and rhs [G / n, K, N] (transpose_rhs: [G / n, N, K]; n = groups_per_weight),
    group_sizes [G] integers:
      float arrays: rhs may be a wider float than lhs (rounded to lhs's dtype for the
        product, its gradient in its own dtype). Differentiable: dgrad is a gmm, wgrad a
        `tgmm` per group (a matrix's groups' partials summed in a fixed order in fp32), on
        the same implementation as the forward.
      MXTensors: lhs with blocks along K (axis 1), rhs with blocks along its contraction axis
        (axis 2 with transpose_rhs, the K-major layout every fp8 kernel reads; axis 1 only for
        Mxfp8Kernel.DEQUANTIZE). `kernel` picks the Pallas kernel (AUTO: the shape heuristic,
        `mxtensor_gmm.resolve_kernel`). small_scales, lhs_values and rhs_tiled are promises
        and copies for the kernels that read them (`mxtensor_gmm._gmm_mxtensor`). All rows
        are computed whatever write_rows_past_groups says.
      BlockwiseTensors: lhs [M, C] in 1 x 128 blocks along C, rhs the weights [G / n, K, N] in
        128 x 128 blocks, contracted over K (C = K) or, transpose_rhs, over N (C = N) with the
        same blocks.
    config tiles the Pallas kernel: a `GmmConfig`, or a `DecodeConfig` for DECODE (an MXTensor
    gmm's config needs a named kernel); None: the kernel's shape heuristic. No config changes
    the result bits. write_rows_past_groups=False: the rows at and past sum(group_sizes) of
    out (and of d lhs) may be left uncomputed, with unspecified values, for a buffer whose
    rows past its groups nothing reads (`jaxmoe.ops.live_rows`)."""
    registry.check_impl("gmm", impl)
    kind = _operands_kind("gmm", lhs, rhs)
    _check_config(
        "gmm", kind, config, (GmmConfig, DecodeConfig) if kind is MXTensor else (GmmConfig,)
    )
    if kind is MXTensor:
        check_kernel(kernel, "gmm")
        if rhs.ndim == 3 and rhs.axis != (2 if transpose_rhs else 1):
            raise ValueError(
                f"gmm: an MXTensor rhs {rhs.shape} with blocks along axis {rhs.axis} is "
                f"contracted over that axis: pass transpose_rhs={rhs.axis == 2}"
            )
        return _gmm_mxtensor(
            lhs,
            rhs,
            group_sizes,
            impl=impl,
            preferred_element_type=preferred_element_type,
            config=config,
            kernel=kernel,
            groups_per_weight=groups_per_weight,
            small_scales=small_scales,
            lhs_values=lhs_values,
            rhs_tiled=rhs_tiled,
        )
    _reject(
        "gmm",
        kind,
        kernel=kernel is not Mxfp8Kernel.AUTO,
        small_scales=small_scales,
        lhs_values=lhs_values is not None,
        rhs_tiled=rhs_tiled is not None,
    )
    product = _gmm_blockwise if kind is BlockwiseTensor else _gmm_arrays
    return product(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=transpose_rhs,
        impl=impl,
        preferred_element_type=preferred_element_type,
        config=config,
        groups_per_weight=groups_per_weight,
        write_rows_past_groups=write_rows_past_groups,
    )


def tgmm(
    lhs: jax.Array | MXTensor | BlockwiseTensor,
    rhs: jax.Array | MXTensor | BlockwiseTensor,
    group_sizes: jax.Array,
    *,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: TgmmConfig | BlockwiseTgmmConfig | None = None,
    tokens_last: bool = False,
) -> jax.Array:
    """Weight-gradient form out[g] = lhs[rows of g]^T @ rhs[rows of g] -> [G, K, N] for lhs
    [M, K] and rhs [M, N], fp32 accumulation, the result in `preferred_element_type`; groups
    with no rows give zeros, rows past the groups are not read. The recipe follows the
    operands' types (module docstring):
      float arrays: the bf16/fp16 kernel's or XLA's ragged dot (not differentiable).
      MXTensors with blocks along M (axis 0), group sizes multiples of 32: dequantized to bf16
        (exact), then the array product.
      BlockwiseTensors in 1 x 128 blocks along M, group sizes multiples of 128: each 128-row
        block's fp32 partial times its two scales, folded in row order. tokens_last: lhs and
        rhs are instead the K-major copies lhs^T [K, M] and rhs^T [N, M] (blocks along axis 1),
        as `quantize_1x128_transposed` makes them and the Pallas kernel reads them.
    config tiles the Pallas kernel: a `TgmmConfig` (arrays, MXTensors) or a
    `BlockwiseTgmmConfig` (BlockwiseTensors); None: the kernel's shape heuristic. No config
    changes the result bits."""
    registry.check_impl("tgmm", impl)
    kind = _operands_kind("tgmm", lhs, rhs)
    blockwise = kind is BlockwiseTensor
    _check_config("tgmm", kind, config, (BlockwiseTgmmConfig,) if blockwise else (TgmmConfig,))
    if blockwise:
        return _tgmm_blockwise(
            lhs,
            rhs,
            group_sizes,
            tokens_last=tokens_last,
            impl=impl,
            preferred_element_type=preferred_element_type,
            config=config,
        )
    _reject("tgmm", kind, tokens_last=tokens_last)
    product = _tgmm_mxtensor if kind is MXTensor else _tgmm_arrays
    return product(
        lhs,
        rhs,
        group_sizes,
        impl=impl,
        preferred_element_type=preferred_element_type,
        config=config,
    )
