"""`jaxmoe.wire`: the quantized token copies that travel instead of bf16 rows. Each wire dtype
is its recipe's rowwise quantizer; a copy moves its data and scale rows together; bad inputs
are refused with the reason."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import fp8_blockwise, mxfp8
from jaxmoe.wire import (
    dequantize_rows,
    is_token_rows,
    move_rows,
    pack_rows,
    quantize_tokens,
    unpack_rows,
)

from bitwise import assert_bitwise

TOKENS = jax.random.normal(jax.random.key(0), (6, 256)).astype(jnp.bfloat16)
REFERENCES = {
    "mxfp8": lambda x: mxfp8.quantize(x, axis=1),
    "fp8_blockwise": lambda x: fp8_blockwise.quantize_1x128(x, 1),
}


@pytest.mark.parametrize("wire_dtype", sorted(REFERENCES))
def test_copies_are_the_recipes_rowwise_quantizers_and_move_whole_rows(wire_dtype):
    copy = quantize_tokens(TOKENS, wire_dtype, impl="xla")
    want = REFERENCES[wire_dtype](TOKENS)
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    order = jnp.array([5, 0, 6, 2])  # row 6: past the tokens, a padding row
    moved = move_rows(copy, lambda a: jnp.concatenate([a, jnp.zeros_like(a[:1])])[order])
    picked = np.asarray(dequantize_rows(moved, jnp.float32))
    assert_bitwise(picked[[0, 1, 3]], np.asarray(want.dequantize(jnp.float32))[[5, 0, 2]])
    assert not picked[2].any()
    assert is_token_rows(moved)
    packed = pack_rows(copy)  # one row of bytes a token: data, then scales
    # 256 data bytes, then 8 of scales: 256 / 32 e8m0 (MXFP8) or 256 / 128 fp32 (blockwise)
    assert packed.dtype == jnp.uint8 and packed.shape == (6, 256 + 8)
    unpacked = unpack_rows(jnp.concatenate([packed, jnp.zeros_like(packed[:1])])[order], copy)
    for a, b in zip(jax.tree.leaves(unpacked), jax.tree.leaves(moved), strict=True):
        assert a.dtype == b.dtype
        assert_bitwise(np.asarray(a), np.asarray(b))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="wire_dtype must be"):
        quantize_tokens(TOKENS, "bf16")
    with pytest.raises(ValueError, match=r"must be \[T, H\]"):
        quantize_tokens(TOKENS[None], "mxfp8")
    along_tokens = fp8_blockwise.quantize_1x128(TOKENS, 0)
    assert not is_token_rows(along_tokens)
    with pytest.raises(ValueError, match="blocks along H"):
        move_rows(along_tokens, lambda a: a)
    with pytest.raises(ValueError, match="blocks along H"):
        pack_rows(along_tokens)
    copy = quantize_tokens(TOKENS, "mxfp8", impl="xla")
    with pytest.raises(ValueError, match=r"uint8 \[rows, 264\] expected"):
        unpack_rows(pack_rows(copy)[:, :-1], copy)


@pytest.mark.parametrize("impl", ["auto", "pallas", "xla"])
def test_dispatch_moves_the_float8_data_on_the_kernel_and_the_scales_on_xla(monkeypatch, impl):
    """A copy's float8 data rows go to the dispatch kernel where one is asked for ("auto" keeps
    the fallback), its scale rows (a few bytes a row) to XLA's gather; the rows are the copy's."""
    dispatch_module = importlib.import_module("jaxmoe.dispatch")  # the package exports a function
    gather = dispatch_module.dispatch_rows
    calls = []

    def recording(x, row_token, *, per_token, impl):
        calls.append((jnp.dtype(x.dtype).itemsize, impl))
        return gather(x, row_token, per_token=per_token, impl="xla")  # kernel: test_permute.py

    monkeypatch.setattr(dispatch_module, "dispatch_rows", recording)

    class TwoRows:  # what the gather reads of the plan: its rows' slots, top_k a token
        row_slot = jnp.array([3 * 2 + 1, 6 * 2], jnp.int32)  # token 6: past them, a padding row
        top_k = 2

    copy = quantize_tokens(TOKENS, "fp8_blockwise", impl="xla")
    moved = dispatch_module.dispatch(copy, TwoRows(), impl)
    data_impl = "xla" if impl == "xla" else "auto"
    assert sorted(calls) == sorted([(1, data_impl), (4, "xla")])
    want = np.asarray(copy.dequantize(jnp.float32))[3]
    assert_bitwise(np.asarray(dequantize_rows(moved, jnp.float32))[0], want)
