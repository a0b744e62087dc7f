"""bridge.dlpack: zero-copy torch <-> JAX exchange, checked by data pointers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from bridge.dlpack import jax_data_pointer
from bridge.errors import DLPackTransferError
from jaxmoe import mxfp8

EXCHANGED = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
]


@pytest.mark.parametrize("dtype", EXCHANGED, ids=str)
def test_round_trip_shares_memory(dtype):
    t = (torch.arange(96, dtype=torch.float32).reshape(8, 12) - 40).to(dtype)
    a = bridge.to_jax(t)
    assert jax_data_pointer(a) == t.data_ptr()
    assert a.shape == (8, 12) and a.dtype == bridge.dlpack.jax_dtype(dtype)
    back = bridge.to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_memory_is_shared_not_copied():
    t = torch.zeros(4, 4)
    a = bridge.to_jax(t)
    t[1, 2] = 7.0
    assert float(a[1, 2]) == 7.0


def test_fp8_bytes_reinterpreted_through_uint8_views():
    data = mxfp8.quantize(jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32), axis=1).data
    as_bytes = bridge.to_torch(data, dtype=torch.uint8)
    assert as_bytes.dtype == torch.uint8 and as_bytes.data_ptr() == jax_data_pointer(data)
    again = bridge.to_jax(as_bytes, dtype=jnp.float8_e4m3fn)
    assert again.dtype == jnp.float8_e4m3fn and jax_data_pointer(again) == as_bytes.data_ptr()
    np.testing.assert_array_equal(np.asarray(again).view(np.uint8), np.asarray(data).view(np.uint8))


def test_non_contiguous_is_refused_unless_copy():
    t = torch.arange(20, dtype=torch.float32).reshape(4, 5).T
    with pytest.raises(DLPackTransferError, match="not contiguous"):
        bridge.to_jax(t)
    a = bridge.to_jax(t, copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_misaligned_view_would_be_copied_by_jax_so_it_is_refused():
    t = torch.arange(65, dtype=torch.float32)[1:]  # 4-byte offset: XLA copies on import
    with pytest.raises(DLPackTransferError, match="copied"):
        bridge.to_jax(t)
    a = bridge.to_jax(t, copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_unsupported_inputs_raise_clear_errors():
    with pytest.raises(DLPackTransferError, match="jax_enable_x64"):
        bridge.to_jax(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(DLPackTransferError, match="cannot be exchanged"):
        bridge.to_jax(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(DLPackTransferError, match="torch.Tensor"):
        bridge.to_jax(np.zeros(3))
    with pytest.raises(DLPackTransferError, match="element sizes differ"):
        bridge.to_jax(torch.zeros(3, dtype=torch.float32), dtype=jnp.bfloat16)


def test_mxtensor_round_trip_is_zero_copy_and_bitwise():
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32)
    mx = mxfp8.quantize(x, axis=0, fmt="e5m2")
    data, scale = bridge.mxtensor_to_torch(mx)
    assert data.dtype == torch.float8_e5m2 and scale.dtype == torch.uint8
    assert data.data_ptr() == jax_data_pointer(mx.data)
    back = bridge.mxtensor_from_torch(data.view(torch.uint8), scale, axis=0, fmt="e5m2")
    assert jax_data_pointer(back.data) == data.data_ptr()
    np.testing.assert_array_equal(
        np.asarray(mxfp8.dequantize(back)), np.asarray(mxfp8.dequantize(mx))
    )
    with pytest.raises(DLPackTransferError, match="compact MXFP8 scales"):
        bridge.mxtensor_from_torch(data, scale[:1], axis=0, fmt="e5m2")
