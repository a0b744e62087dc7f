"""The test harness's race checking (tests/interpreter.py): a race in any kernel call of a test
fails it, not only a race in the last call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from interpreter import race_checked_interpreter


def _copy_plus_one(x, ctas):
    """o = x + 1 written whole by each of `ctas` CTAs: with 2, both write every element of the
    output (a race between CTAs); with 1, none."""

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(ctas,), grid_names=("cta",)
    )(x)


def test_a_race_before_the_last_kernel_call_fails_the_check():
    x = jnp.arange(128, dtype=jnp.float32)
    with pytest.raises(AssertionError, match="race detected in 1 of 2 interpreted kernel calls"):
        with race_checked_interpreter():
            _copy_plus_one(x, ctas=2).block_until_ready()
            np.testing.assert_array_equal(_copy_plus_one(x, ctas=1), x + 1)


def test_race_free_calls_pass():
    x = jnp.arange(128, dtype=jnp.float32)
    with race_checked_interpreter() as states:
        for _ in range(2):
            np.testing.assert_array_equal(_copy_plus_one(x, ctas=1), x + 1)
    assert len(states) == 2
