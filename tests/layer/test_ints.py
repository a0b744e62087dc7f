"""Integer helpers (`jaxmoe.ints`): the fusible forms equal the plain ones on arrays, negative
values included, for powers of two (shift and mask) and other divisors (division)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ints import cdiv, cdiv_fusible, is_power_of_two, round_down_fusible


@pytest.mark.parametrize("divisor", [1, 2, 8, 16, 128, 3, 24, 48])
def test_fusible_forms_equal_floor_and_ceiling_division(divisor):
    values = np.arange(-300, 301, dtype=np.int32)
    a = jnp.asarray(values)
    np.testing.assert_array_equal(np.asarray(cdiv_fusible(a, divisor)), -(-values // divisor))
    np.testing.assert_array_equal(
        np.asarray(round_down_fusible(a, divisor)), values // divisor * divisor
    )
    assert cdiv(7, divisor) == -(-7 // divisor)


def test_powers_of_two():
    assert [x for x in range(-2, 70) if is_power_of_two(x)] == [1, 2, 4, 8, 16, 32, 64]
