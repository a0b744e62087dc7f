"""Zero-copy tensor exchange between PyTorch and JAX over DLPack.

`to_jax(t)` / `to_torch(a)` share memory (CPU or GPU) and verify it: the result's data pointer must
equal the source's, otherwise `DLPackTransferError` is raised (JAX silently copies misaligned
buffers and narrows 64-bit types without `jax_enable_x64`; this module never lets that pass as
"zero-copy"). Non-contiguous tensors are refused; `copy=True` makes one contiguous copy first.

Float8 data travels as float8 (e4m3fn, e5m2, e8m0fnu are DLPack types in both libraries). Bytes
held as uint8 (Transformer Engine stores MXFP8 data and scales that way) are reinterpreted without
a copy with `dtype=`: `to_jax(te_bytes, dtype=jnp.float8_e4m3fn)`, `to_torch(a, dtype=torch.uint8)`.

Memory is shared, not transferred: JAX assumes its arrays are immutable, so do not modify a torch
tensor in place while a JAX array views it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge.errors import DLPackTransferError
from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float64: jnp.float64,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e8m0fnu: jnp.float8_e8m0fnu,
}
_JAX_TO_TORCH = {np.dtype(j): t for t, j in _TORCH_TO_JAX.items()}
_MX_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def torch_dtype(dtype) -> torch.dtype:
    """The exchangeable torch dtype for a torch, numpy or JAX dtype (or its name)."""
    try:
        candidate = dtype if isinstance(dtype, torch.dtype) else _JAX_TO_TORCH.get(np.dtype(dtype))
    except TypeError:
        candidate = None
    if candidate not in _TORCH_TO_JAX:
        raise DLPackTransferError(
            f"dtype {dtype!r} cannot be exchanged over DLPack here "
            f"(supported: {sorted(str(d) for d in _TORCH_TO_JAX)})"
        )
    return candidate


def jax_dtype(dtype) -> np.dtype:
    """The JAX (numpy) dtype for an exchangeable torch, numpy or JAX dtype (or its name)."""
    return np.dtype(_TORCH_TO_JAX[torch_dtype(dtype)])


def _check_width(dtype: np.dtype) -> None:
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise DLPackTransferError(f"{dtype} needs jax_enable_x64 (JAX would narrow it with a copy)")


def _reinterpret(t: torch.Tensor, dtype) -> torch.Tensor:
    """A same-itemsize view of t's bytes as `dtype` (no copy)."""
    target = torch_dtype(dtype)
    if target.itemsize != t.dtype.itemsize:
        raise DLPackTransferError(f"cannot reinterpret {t.dtype} as {target}: element sizes differ")
    return t.view(target)


def jax_data_pointer(a: jax.Array) -> int:
    """Address of a single-device JAX array's buffer."""
    if len(a.devices()) != 1:
        raise DLPackTransferError(
            f"a JAX array on {len(a.devices())} devices cannot be shared; "
            "gather it to one device first"
        )
    return a.unsafe_buffer_pointer()


def to_jax(t: torch.Tensor, *, dtype=None, copy: bool = False) -> jax.Array:
    """A JAX array sharing `t`'s memory (CPU or CUDA), optionally reinterpreting its bytes as
    `dtype` (same element size, e.g. uint8 -> float8_e4m3fn).

    Raises DLPackTransferError for non-contiguous tensors (unless copy=True: one contiguous copy is
    made and shared), unsupported dtypes, 64-bit types without jax_enable_x64, or whenever JAX would
    copy (the data pointers are compared)."""
    if not isinstance(t, torch.Tensor):
        raise DLPackTransferError(f"to_jax needs a torch.Tensor, got {type(t).__name__}")
    if t.requires_grad:
        t = t.detach()
    if dtype is not None:
        t = _reinterpret(t, dtype)
    _check_width(jax_dtype(t.dtype))
    if not t.is_contiguous():
        if not copy:
            raise DLPackTransferError(
                f"tensor of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; "
                "pass copy=True to share a contiguous copy"
            )
        t = t.contiguous()
    try:
        a = jax.dlpack.from_dlpack(t)
    except (RuntimeError, TypeError, ValueError, BufferError) as exc:
        raise DLPackTransferError(
            f"JAX cannot import a {t.dtype} tensor on {t.device}: {exc}"
        ) from exc
    if t.numel() and jax_data_pointer(a) != t.data_ptr():
        if copy:
            return to_jax(t.clone(), copy=False)
        raise DLPackTransferError(
            f"JAX copied the {t.dtype} tensor on import (data pointer {t.data_ptr():#x} is probably "
            "not aligned for XLA); pass copy=True to share an aligned copy"
        )
    return a


def to_torch(a: jax.Array, *, dtype=None, copy: bool = False) -> torch.Tensor:
    """A torch tensor sharing the single-device JAX array `a`'s memory, optionally reinterpreting
    its bytes as `dtype` (same element size). With copy=True the result owns a copy."""
    if not isinstance(a, jax.Array):
        raise DLPackTransferError(f"to_torch needs a jax.Array, got {type(a).__name__}")
    torch_dtype(a.dtype)
    pointer = jax_data_pointer(a) if a.size else None
    try:
        t = torch.from_dlpack(a)
    except (RuntimeError, TypeError, ValueError, BufferError) as exc:
        raise DLPackTransferError(
            f"torch cannot import a {a.dtype} array on {a.devices()}: {exc}"
        ) from exc
    if pointer is not None and t.data_ptr() != pointer:
        raise DLPackTransferError(f"torch copied the {a.dtype} array on import")
    if dtype is not None:
        t = _reinterpret(t, dtype)
    return t.clone() if copy else t


def mxtensor_to_torch(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) torch views of an MXTensor: data in the float8 dtype of `mx.fmt` (view it as
    torch.uint8 for Transformer Engine's byte buffers), scale uint8 in the compact layout."""
    return to_torch(mx.data), to_torch(mx.scale)


def mxtensor_from_torch(
    data: torch.Tensor, scale: torch.Tensor, *, axis: int, fmt: str = "e4m3", copy: bool = False
) -> MXTensor:
    """An MXTensor viewing torch `data` (float8 of `fmt`, or its uint8 bytes) and compact `scale`
    (uint8 or float8_e8m0fnu E8M0 bytes, `data.shape` with dim `axis` divided by 32). copy: as
    for `to_jax`."""
    if fmt not in _MX_FORMATS:
        raise DLPackTransferError(
            f"unknown MXFP8 format {fmt!r}; expected one of {sorted(_MX_FORMATS)}"
        )
    if data.dtype not in (torch.uint8, _MX_FORMATS[fmt]):
        raise DLPackTransferError(
            f"MXFP8 {fmt} data must be {_MX_FORMATS[fmt]} or uint8, got {data.dtype}"
        )
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise DLPackTransferError(
            f"MXFP8 scales must be uint8 or float8_e8m0fnu, got {scale.dtype}"
        )
    axis %= data.ndim
    expected = list(data.shape)
    if expected[axis] % BLOCK_SIZE:
        raise DLPackTransferError(
            f"MXFP8 data dim {axis} ({expected[axis]}) is not a multiple of {BLOCK_SIZE}"
        )
    expected[axis] //= BLOCK_SIZE
    if list(scale.shape) != expected:
        raise DLPackTransferError(
            f"compact MXFP8 scales for data {tuple(data.shape)} along axis "
            f"{axis} must be {tuple(expected)}, got {tuple(scale.shape)}"
        )
    return MXTensor(
        data=to_jax(data, dtype=_MX_FORMATS[fmt], copy=copy),
        scale=to_jax(scale, dtype=torch.uint8, copy=copy),
        axis=axis,
        fmt=fmt,
    )
