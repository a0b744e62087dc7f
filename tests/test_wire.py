"""`jaxmoe.wire`: the quantized token copies that travel instead of bf16 rows. Each wire dtype
is its recipe's rowwise quantizer; a copy moves its data and scale rows together; bad inputs
are refused with the reason."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import fp8_blockwise, mxfp8
from jaxmoe.wire import dequantize_rows, is_token_rows, move_rows, quantize_tokens

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


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="wire_dtype must be"):
        quantize_tokens(TOKENS, "bf16")
    with pytest.raises(ValueError, match=r"must be \[T, H\]"):
        quantize_tokens(TOKENS[None], "mxfp8")
    along_tokens = fp8_blockwise.quantize_1x128(TOKENS, 0)
    assert not is_token_rows(along_tokens)
    with pytest.raises(ValueError, match="blocks along H"):
        move_rows(along_tokens, lambda a: a)
