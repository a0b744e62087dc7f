"""Grouped matmuls on MXFP8 operands (`MXTensor`s): what `jaxmoe.ops.gmm` (fprop and dgrad) and
`jaxmoe.ops.tgmm` (wgrad) run on them (`_gmm_mxtensor`, `_tgmm_mxtensor`). Not differentiable:
`jaxmoe.ops.mxfp8_gmm` builds the differentiable MXFP8 GEMM (Transformer Engine's recipe) from
them.

Each computes sum_k deq(a) * deq(b) with fp32 accumulation:
  impl "xla"     dequantize to bf16 (exact for magnitudes >= 2^-133), then
                 `jax.lax.ragged_dot` with fp32 accumulation (the reference).
  impl "pallas"  gmm, `kernel=` (an `Mxfp8Kernel`):
                   DEQUANTIZE   dequantize both operands to bf16 (exact), then the bf16 gmm
                                kernel (K and N multiples of 64);
                   FUSED_DEQUANTIZE the same bits from one kernel that reads the fp8
                                operands and dequantizes them in SMEM
                                (`ops/pallas/gmm_dequantize_hopper.py`; K and N multiples of
                                128): no bf16 copy in HBM;
                   DECODE       for few rows per group: lhs dequantized to bf16 (a few KB at
                                decode sizes), the weights read once as fp8 and dequantized
                                in SMEM, the wgmma's roles swapped so that a group's few rows
                                are its narrow side (`ops/pallas/gmm_decode_hopper.py`; K and N
                                multiples of 128; rhs's data also as `tile_weights` tiles,
                                which it reads faster); the dequantize-first bits;
                   AUTO         (default) DECODE when the rows average at most
                                `DECODE_MAX_ROWS_PER_GROUP` per group and its kernel can
                                run the problem, else DEQUANTIZE (the same bits);
                   FP8_WGMMA    the Hopper fp8 kernel (`ops/pallas/gmm_mxfp8_hopper.py`: one
                                fp8 wgmma per 32-wide K block, scales folded into the fp32
                                accumulator; K and N multiples of 128).
                 Hopper has no block-scaled MMA, so none beats bf16 there (docs/kernels/fp8_gemm.md has
                 the arithmetic and the measurements).
                 tgmm: dequantize to bf16, then the bf16 tgmm kernel.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".
Both operands of an fp8 wgmma must be K-major, so the rhs of a gmm is [G, N, K] with blocks
along K (`transpose_rhs=True`); DEQUANTIZE (and "xla") also take it as [G, K, N] with blocks
along K, which needs no transpose of the high-precision weights (the quantize kernels make it
from [G, K, N]).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxmoe.mxfp8 import MXTensor, dequantize, scale_multipliers
from jaxmoe.ops import registry
from jaxmoe.ops.array_gmm import _gmm_arrays, _tgmm_arrays, kernel_problem, kernel_rows, pad_rows
from jaxmoe.ops.checks import check_group_sizes
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_decode_hopper import DecodeConfig, gmm_decode_pallas, tile_weights
from jaxmoe.ops.pallas.gmm_dequantize_hopper import gmm_dequantize_pallas
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import gmm_mxfp8_pallas
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig


class Mxfp8Kernel(enum.Enum):
    """Which Pallas kernel runs a gmm on MXTensor operands (`jaxmoe.ops.gmm`'s `kernel=`;
    module docstring): all but FP8_WGMMA give the same bits; AUTO lets the shape decide."""

    AUTO = "auto"  # DECODE for few rows per group where it can run, else DEQUANTIZE
    DEQUANTIZE = "dequantize"  # bf16 copies of both operands, then the bf16 kernel
    FUSED_DEQUANTIZE = "fused_dequantize"  # one kernel dequantizing the fp8 tiles in SMEM
    DECODE = "decode"  # the fp8 weights read once, a group's few rows the wgmma's narrow side
    FP8_WGMMA = "fp8_wgmma"  # one fp8 wgmma per 32-wide K block, scales on the CUDA cores


# AUTO takes the decode kernel up to this mean number of rows per group: it reads each active
# expert's fp8 weights once (1.03 bytes a weight) where DEQUANTIZE writes and reads a bf16 copy
# of every expert's (5 bytes). The layer with it beat bf16 at 16 rows per expert; 64 rows per
# expert is the bytes argument.
DECODE_MAX_ROWS_PER_GROUP = 64
FP8_KERNEL_MULTIPLE = 128  # K and N of the kernels reading fp8: one 128-byte swizzled row
_BF16 = jnp.dtype(jnp.bfloat16)  # what both Pallas paths multiply in


def check_kernel(kernel, what: str) -> None:
    """TypeError unless `kernel` is an `Mxfp8Kernel` (`what` names the caller)."""
    if not isinstance(kernel, Mxfp8Kernel):
        raise TypeError(
            f"{what}: kernel must be an Mxfp8Kernel ({', '.join(k.name for k in Mxfp8Kernel)}), "
            f"got {kernel!r}"
        )


def resolve_kernel(
    kernel: Mxfp8Kernel, num_rows: int, num_groups: int, k: int, n: int, k_major: bool = True
) -> Mxfp8Kernel:
    """The kernel that AUTO stands for on M rows times G matrices [N, K] (k_major) or [K, N];
    any other kernel stands for itself."""
    if kernel is not Mxfp8Kernel.AUTO:
        return kernel
    fits = k_major and not (k % FP8_KERNEL_MULTIPLE or n % FP8_KERNEL_MULTIPLE)
    few_rows = num_rows <= DECODE_MAX_ROWS_PER_GROUP * num_groups
    return Mxfp8Kernel.DECODE if fits and few_rows else Mxfp8Kernel.DEQUANTIZE


def _gmm_problem(k: int, n: int, kernel: Mxfp8Kernel) -> str | None:
    """Why the Pallas path of `kernel` cannot run a [.., K] x [G, N, K] problem."""
    if kernel is not Mxfp8Kernel.DEQUANTIZE and (
        k % FP8_KERNEL_MULTIPLE or n % FP8_KERNEL_MULTIPLE
    ):
        return (
            f"K={k} and N={n} must be multiples of {FP8_KERNEL_MULTIPLE} for the "
            f"{kernel.name} kernel"
        )
    return kernel_problem(_BF16, _BF16, k, n)


registry.register("gmm[MXTensor]", "pallas", problem=_gmm_problem)
registry.register(
    "tgmm[MXTensor]", "pallas", problem=lambda k, n: kernel_problem(_BF16, _BF16, k, n)
)


def _decoded_scales(t: MXTensor) -> jax.Array:
    """fp32 block multipliers of t, block axis before the row axis: [..., R, C/32] ->
    [..., C/32, R] (a K block's scales for a row tile are contiguous)."""
    return jnp.swapaxes(scale_multipliers(t.scale), -1, -2)


def _gmm_mxtensor(
    lhs: MXTensor,
    rhs: MXTensor,
    group_sizes: jax.Array,
    *,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: GmmConfig | DecodeConfig | None = None,
    kernel: Mxfp8Kernel = Mxfp8Kernel.AUTO,
    groups_per_weight: int = 1,
    small_scales: bool = False,
    lhs_values: jax.Array | None = None,
    rhs_tiled: jax.Array | None = None,
) -> jax.Array:
    """`jaxmoe.ops.gmm` on MXTensors: out[m, n] = sum_k deq(lhs)[m, k] *
    deq(rhs)[g(m) // groups_per_weight, n, k], fp32 accumulation (groups_per_weight: see
    `jaxmoe.ops.gmm`).

    lhs: MXTensor [M, K] with blocks along K (axis 1); rhs: MXTensor [G, N, K] with blocks along
    K (axis 2), i.e. the expert matrices transposed (K-major, what Hopper's fp8 wgmma reads),
    or, for DEQUANTIZE, [G, K, N] with blocks along K (axis 1). Rows past sum(group_sizes)
    give zeros. `kernel` picks the Pallas path (module docstring); `config` tiles its kernel
    (None: that kernel's heuristic; a `DecodeConfig` for DECODE, so a config needs a named
    kernel). Not differentiable (see `mxfp8_gmm`). small_scales: the caller promises that
    rhs's e4m3 data and scales meet `e4m3_registers.small_scale_dequantization_is_exact`,
    which lets the decode kernel dequantize in fewer instructions (the same bits).
    lhs_values: deq(lhs) in bf16 when the caller has it (the dispatch makes the rows' values in
    one pass): XLA and the kernels that read the dequantized lhs (DEQUANTIZE, DECODE) take it
    instead of dequantizing lhs, whose copy then has no reader; the caller promises it is
    bitwise `dequantize(lhs, bfloat16)`. rhs_tiled: rhs.data in the decode kernel's tiled
    layout (`gmm_decode_hopper.tile_weights`) when the caller stores it so
    (`jaxmoe.mxfp8_inference`): DECODE reads it instead of rhs.data, which then has no reader
    there."""
    if not (
        isinstance(lhs, MXTensor)
        and isinstance(rhs, MXTensor)
        and lhs.ndim == 2
        and rhs.ndim == 3
        and lhs.axis == 1
        and rhs.axis in (1, 2)
        and lhs.shape[1] == rhs.shape[rhs.axis]
    ):
        raise ValueError(
            "gmm (MXTensor): lhs must be an MXTensor [M, K] with blocks along K and "
            "rhs an MXTensor [G, N, K] or [G, K, N] with blocks along K"
        )
    check_kernel(kernel, "gmm (MXTensor)")
    if lhs_values is not None and (
        lhs_values.shape != lhs.shape or lhs_values.dtype != jnp.bfloat16
    ):
        raise ValueError(
            f"gmm (MXTensor): lhs_values must be bf16 {lhs.shape}, got {lhs_values.dtype} "
            f"{lhs_values.shape}"
        )
    lhs_bf16 = lambda: dequantize(lhs, jnp.bfloat16) if lhs_values is None else lhs_values
    if kernel is Mxfp8Kernel.AUTO and config is not None:
        raise ValueError("gmm (MXTensor): a config tiles one kernel; name the kernel (kernel=)")
    k_major = rhs.axis == 2
    num_weights, n, k = rhs.shape if k_major else (rhs.shape[0], rhs.shape[2], rhs.shape[1])
    check_group_sizes(group_sizes, num_weights * groups_per_weight, lhs.shape[0], "gmm (MXTensor)")
    num_groups = num_weights * groups_per_weight
    kernel = resolve_kernel(kernel, lhs.shape[0], num_groups, k, n, k_major)
    if not k_major and kernel is not Mxfp8Kernel.DEQUANTIZE:
        raise ValueError(
            f"gmm (MXTensor): the {kernel.name} kernel reads rhs as [G, N, K] (blocks along the "
            "last axis); got [G, K, N]"
        )
    if rhs_tiled is not None and (
        not k_major
        or rhs_tiled.dtype != rhs.dtype
        or rhs_tiled.shape != jax.eval_shape(tile_weights, rhs.data).shape
    ):
        raise ValueError(
            f"gmm (MXTensor): rhs_tiled must be rhs.data {rhs.dtype}{rhs.shape} in "
            f"tile_weights' layout, got {rhs_tiled.dtype}{rhs_tiled.shape}"
        )
    group_sizes = group_sizes.astype(jnp.int32)
    out_dtype = jnp.dtype(preferred_element_type)
    if registry.resolve("gmm[MXTensor]", impl, k, n, kernel) == "xla":
        out = jax.lax.ragged_dot(
            lhs_bf16(),
            jnp.repeat(
                jnp.swapaxes(dequantize(rhs, jnp.bfloat16), 1, 2)
                if k_major
                else dequantize(rhs, jnp.bfloat16),
                groups_per_weight,
                0,
            ),
            group_sizes,
            preferred_element_type=jnp.float32,
        )
        return out.astype(out_dtype)
    if kernel is Mxfp8Kernel.DEQUANTIZE:
        return _gmm_arrays(
            lhs_bf16(),
            dequantize(rhs, jnp.bfloat16),
            group_sizes,
            transpose_rhs=k_major,
            impl="pallas",
            preferred_element_type=out_dtype,
            config=config,
            groups_per_weight=groups_per_weight,
        )
    if kernel is Mxfp8Kernel.DECODE:
        return gmm_decode_pallas(
            lhs_bf16(),
            rhs.data if rhs_tiled is None else rhs_tiled,
            jnp.swapaxes(rhs.scale, 1, 2),  # E8M0 bytes, decoded in the kernel
            group_sizes,
            out_dtype=out_dtype,
            config=config,
            groups_per_weight=groups_per_weight,
            small_scales=small_scales,
        )
    num_rows = lhs.shape[0]
    rows = kernel_rows(num_rows)
    # Padding rows (zero data) belong to no group; their outputs are cut off below.
    lhs_scale = jnp.swapaxes(scale_multipliers(pad_rows(lhs.scale, rows)), 0, 1)
    fp8_kernel = gmm_mxfp8_pallas if kernel is Mxfp8Kernel.FP8_WGMMA else gmm_dequantize_pallas
    out = fp8_kernel(
        pad_rows(lhs.data, rows),
        lhs_scale,
        rhs.data,
        _decoded_scales(rhs),
        group_sizes,
        out_dtype=out_dtype,
        config=config,
        groups_per_weight=groups_per_weight,
    )
    return out[:num_rows]


def _tgmm_mxtensor(
    lhs: MXTensor,
    rhs: MXTensor,
    group_sizes: jax.Array,
    *,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: TgmmConfig | None = None,
) -> jax.Array:
    """`jaxmoe.ops.tgmm` on MXTensors: out[g] = sum over g's rows m of deq(lhs)[m, :]^T
    deq(rhs)[m, :] -> [G, K, N], fp32 accumulation. lhs [M, K] and rhs [M, N] are MXTensors
    with blocks along M (axis 0); group sizes must be multiples of 32 so that no block mixes
    two groups. Both are dequantized to bf16 (exact for magnitudes >= 2^-133) and multiplied
    as arrays (`config`: the bf16 kernel's tiling; None: its heuristic)."""
    if not (
        isinstance(lhs, MXTensor)
        and isinstance(rhs, MXTensor)
        and lhs.ndim == 2
        and rhs.ndim == 2
        and lhs.axis == 0
        and rhs.axis == 0
        and lhs.shape[0] == rhs.shape[0]
    ):
        raise ValueError(
            "tgmm (MXTensor): lhs [M, K] and rhs [M, N] must be MXTensors with "
            "blocks along M (axis 0)"
        )
    check_group_sizes(group_sizes, None, lhs.shape[0], "tgmm (MXTensor)")
    resolved = registry.resolve("tgmm[MXTensor]", impl, lhs.shape[1], rhs.shape[1])
    return _tgmm_arrays(
        dequantize(lhs, jnp.bfloat16),
        dequantize(rhs, jnp.bfloat16),
        group_sizes,
        impl=resolved,
        preferred_element_type=preferred_element_type,
        config=config,
    )
