"""Refitting Transformer Engine MXFP8 weight storage into jaxmoe `MXTensor`s, bit for bit.

TE's `MXFP8TensorStorage` for a 2-D [M, K] tensor (the recipe: `docs/numerics.md`, "MXFP8") holds
  rowwise data [M, K] (blocks of 32 along K) and rowwise_scale_inv [roundup(M,128), roundup(K/32,4)],
  columnwise data [M, K] (blocks of 32 along M, not transposed) and columnwise_scale_inv
  [roundup(M/32,4), roundup(K,128)],
with E8M0 scale bytes either compact (row-major, padding bytes uninitialised) or in the swizzled
GEMM layout (`_with_gemm_swizzled_scales`). The refit only drops the padding and undoes the
swizzle: no value is re-quantized, so the resulting MXTensors hold TE's bytes exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import torch

from bridge.dlpack import mxtensor_from_torch, to_jax, to_torch
from bridge.errors import MXFP8LayoutError
from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor, unswizzle_scales


@dataclasses.dataclass(frozen=True)
class MXFP8Weight:
    """A refitted weight: rowwise (blocks along the input dim K) and optionally columnwise
    (blocks along the output dim M) MXTensors."""

    rowwise: MXTensor
    columnwise: MXTensor | None = None


def round_up(value, multiple):
    """`value` rounded up to a multiple of `multiple` (ints, or non-negative integer tensors)."""
    return (value + multiple - 1) // multiple * multiple


def _compact_scales(
    scale_inv: torch.Tensor, rows: int, cols: int, swizzled: bool, what: str
) -> torch.Tensor:
    """The [rows, cols] compact scale bytes inside TE's padded [roundup(rows,128),
    roundup(cols,4)] buffer (compact or swizzled)."""
    padded = (round_up(rows, 128), round_up(cols, 4))
    if scale_inv.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise MXFP8LayoutError(
            f"{what}: scale bytes must be uint8 or float8_e8m0fnu, got {scale_inv.dtype}"
        )
    scale_inv = scale_inv.view(torch.uint8)
    shape_ok = tuple(scale_inv.shape) == padded or (
        swizzled and tuple(scale_inv.shape) == (padded[0] * padded[1],)
    )
    if not shape_ok:
        raise MXFP8LayoutError(
            f"{what}: TE {'swizzled' if swizzled else 'compact'} scales for "
            f"{rows}x{cols} scale blocks must have shape {padded}"
            f"{' (or flat)' if swizzled else ''}, got {tuple(scale_inv.shape)}"
        )
    if not swizzled:
        return scale_inv[:rows, :cols].contiguous()
    flat = to_jax(scale_inv.reshape(-1), copy=True)
    return to_torch(unswizzle_scales(flat, (rows, cols)), copy=True)


def _check_data(data: torch.Tensor, what: str) -> tuple[int, int]:
    if data.ndim != 2:
        raise MXFP8LayoutError(
            f"{what}: TE MXFP8 data is viewed as 2-D [M, K], got shape {tuple(data.shape)}"
        )
    rows, cols = data.shape
    if rows % BLOCK_SIZE or cols % BLOCK_SIZE:
        raise MXFP8LayoutError(
            f"{what}: TE needs M and K divisible by {BLOCK_SIZE}, got {tuple(data.shape)}"
        )
    return rows, cols


def refit_mxfp8(
    rowwise_data: torch.Tensor,
    rowwise_scale_inv: torch.Tensor,
    *,
    fmt: str = "e4m3",
    swizzled: bool = False,
    columnwise_data: torch.Tensor | None = None,
    columnwise_scale_inv: torch.Tensor | None = None,
    layout: str = "jaxmoe",
) -> MXFP8Weight:
    """MXTensors holding a TE MXFP8 weight's bytes unchanged.

    rowwise_data / columnwise_data: [M, K] uint8 (or float8) bytes of a Megatron-layout weight
      [out, in]; the scale buffers are TE's padded ones, compact or (swizzled=True) GEMM-swizzled.
    layout: "jaxmoe" gives the [in, out] = [K, M] kernel layout used by jaxmoe.MoE params
      (rowwise -> blocks along axis 0, columnwise -> axis 1; the bytes are transposed, never
      re-quantized); "megatron" keeps [M, K] (rowwise axis 1, columnwise axis 0).
    Raises MXFP8LayoutError for shapes that do not follow TE's layout."""
    if layout not in ("jaxmoe", "megatron"):
        raise ValueError(f"refit_mxfp8: layout must be 'jaxmoe' or 'megatron', got {layout!r}")
    if (columnwise_data is None) != (columnwise_scale_inv is None):
        raise MXFP8LayoutError("columnwise data and columnwise_scale_inv must be given together")
    rows, cols = _check_data(rowwise_data, "rowwise data")
    scale = _compact_scales(
        rowwise_scale_inv, rows, cols // BLOCK_SIZE, swizzled, "rowwise_scale_inv"
    )
    rowwise = _as_mxtensor(rowwise_data, scale, 1, fmt, layout)
    columnwise = None
    if columnwise_data is not None:
        if tuple(columnwise_data.shape) != (rows, cols):
            raise MXFP8LayoutError(
                f"columnwise data {tuple(columnwise_data.shape)} must have the "
                f"rowwise shape {(rows, cols)} (TE does not transpose it)"
            )
        # TE pads [M/32, K] to [roundup(M/32,4), roundup(K,128)]; its swizzle is that of the
        # transpose [K, M/32] (the rowwise rule applied to [K_pad, (M/32)_pad]).
        padded = columnwise_scale_inv.view(torch.uint8)
        if swizzled:
            expected = round_up(rows // BLOCK_SIZE, 4) * round_up(cols, 128)
            if padded.numel() != expected or padded.ndim not in (1, 2):
                raise MXFP8LayoutError(
                    f"columnwise_scale_inv: swizzled buffer must hold {expected} "
                    f"bytes, got shape {tuple(padded.shape)}"
                )
            col_scale = _compact_scales(
                padded.reshape(-1), cols, rows // BLOCK_SIZE, True, "columnwise_scale_inv"
            ).T.contiguous()
        else:
            col_scale = _compact_scales(
                padded.T, cols, rows // BLOCK_SIZE, False, "columnwise_scale_inv (transposed)"
            ).T.contiguous()
        columnwise = _as_mxtensor(columnwise_data, col_scale, 0, fmt, layout)
    return MXFP8Weight(rowwise=rowwise, columnwise=columnwise)


def expert_fprop_copy(weights: Sequence[MXFP8Weight]) -> MXTensor:
    """The experts' stacked fprop copy for `jaxmoe.mxfp8_inference(fprop_copies=...)`: each
    expert's rowwise copy as `refit_mxfp8(..., layout="megatron")` gives it (Megatron's
    [out, in] layout, blocks along in), stacked to [E, out, in] on JAX's default device, the
    bytes unchanged. Raises MXFP8LayoutError when a copy is not such a rowwise copy or the
    experts' copies differ in shape or format."""
    if not weights:
        raise MXFP8LayoutError("expert_fprop_copy: no experts")
    copies = [w.rowwise for w in weights]
    first = copies[0]
    for e, copy in enumerate(copies):
        if copy.ndim != 2 or copy.axis != 1:
            raise MXFP8LayoutError(
                f"expert {e}: need the rowwise copy in Megatron's [out, in] layout "
                f"(refit_mxfp8(..., layout='megatron')), got axis {copy.axis} of {copy.shape}"
            )
        if copy.shape != first.shape or copy.fmt != first.fmt:
            raise MXFP8LayoutError(
                f"expert {e}: {copy.fmt} {copy.shape} differs from expert 0's "
                f"{first.fmt} {first.shape}"
            )
    device = jax.devices()[0]
    stack = lambda arrays: jax.device_put(jnp.stack(arrays), device)  # noqa: E731
    return MXTensor(
        data=stack([c.data for c in copies]),
        scale=stack([c.scale for c in copies]),
        axis=2,
        fmt=first.fmt,
    )


def _as_mxtensor(
    data: torch.Tensor, scale: torch.Tensor, axis: int, fmt: str, layout: str
) -> MXTensor:
    data = data.view(torch.uint8)
    if layout == "jaxmoe":
        data, scale, axis = data.T.contiguous(), scale.T.contiguous(), 1 - axis
    return mxtensor_from_torch(data, scale, axis=axis, fmt=fmt, copy=True)
