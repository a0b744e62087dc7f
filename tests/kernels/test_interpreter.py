"""The test harness's race checking (tests/support/interpreter.py): a race in any kernel call of a test
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


def _store_rows(out_shape, leading, start):
    """A kernel storing an [8, 32] tile of ones by TMA to out.at[leading..., rows] with rows
    start .. start + 7 (a dynamic start, as a kernel's tile index makes it)."""
    from jax import lax
    from jax.experimental import pallas as pl

    def body(o_ref, tile):
        tile[...] = jnp.ones(tile.shape, jnp.float32)
        plgpu.commit_smem()
        rows = pl.ds(start + lax.axis_index("cta"), 8)
        plgpu.copy_smem_to_gmem(tile, o_ref.at[(*leading, rows)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(1,),
        grid_names=("cta",),
        scratch_types=[plgpu.SMEM((8, 32), jnp.float32)],
    )()


def test_a_tma_window_past_an_axis_after_an_integer_index_fails():
    """Rows 4..11 of a [2, 12, 32] array at index 0 stay inside; rows 8..15 run past axis 1
    after the index, which the GPU does not clip (the next index's rows are written). Past the
    end of a [12, 32] array's rows, with no index, the GPU clips, so that passes."""
    with race_checked_interpreter():
        _store_rows((2, 12, 32), (0,), 4).block_until_ready()
        out = _store_rows((12, 32), (), 8)
        assert float(out[8:].sum()) == 4 * 32
    with pytest.raises(Exception, match="runs past the end of axis 1"):
        with race_checked_interpreter():
            _store_rows((2, 12, 32), (0,), 8).block_until_ready()
