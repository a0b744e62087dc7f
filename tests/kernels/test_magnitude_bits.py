"""`quantize_hopper.magnitude_bits`, the magnitudes whose integer max is a block's amax: the
interpreter's integer form against a numpy model on every special class of fp32 (CPU, in a
kernel), and the GPU's PTX form bitwise equal to it in both register layouts the kernels use
(`gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ops.pallas.copies_pipeline import LAYOUT as COPIES_LAYOUT
from jaxmoe.ops.pallas.quantize_hopper import magnitude_bits
from jaxmoe.ops.pallas.quantize_transpose_hopper import _LAYOUT as TRANSPOSE_LAYOUT

SPECIAL = np.array(
    [
        0x00000000,  # +0
        0x80000000,  # -0
        0x00000001,  # smallest denormal
        0x807FFFFF,  # largest negative denormal
        0x00800000,  # smallest normal
        0x3FE00000,  # 1.75
        0xBFE00001,  # -(1.75 + ulp)
        0x7F7FFFFF,  # largest finite
        0xFF7FFFFF,
        0x7F800000,  # +Inf
        0xFF800000,  # -Inf
        0x7FC00000,  # quiet NaN
        0xFFC00000,  # negative quiet NaN
        0x7F800001,  # signalling NaN
        0xFFFFFFFF,  # NaN, all ones
    ],
    np.uint32,
)


def modelled(bits: np.ndarray) -> np.ndarray:
    """|x|'s bits, NaN as 0."""
    magnitudes = bits & np.uint32(0x7FFFFFFF)
    return np.where(magnitudes > 0x7F800000, np.uint32(0), magnitudes)


def tile_bits(shape, seed=0):
    """Every special value, then random bit patterns (a sixteenth of them NaN)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=shape, dtype=np.uint32).reshape(-1)
    bits[: SPECIAL.size] = SPECIAL
    return bits.reshape(shape)


@functools.cache
def magnitudes_kernel(shape, layout, compiled, interpret):
    """A kernel that loads a uint32 tile in `layout` and stores its `magnitude_bits` (the PTX
    form if `compiled`)."""

    def body(x_gmem, out_gmem, x_smem, out_smem, loaded):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, loaded)
        plgpu.barrier_wait(loaded)
        bits = plgpu.load(x_smem, layout=layout)
        out_smem[...] = magnitude_bits(bits, layout if compiled else None)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(shape, jnp.uint32),
        scratch_types=dict(
            x_smem=plgpu.SMEM(shape, jnp.uint32),
            out_smem=plgpu.SMEM(shape, jnp.uint32),
            loaded=plgpu.Barrier(num_arrivals=1),
        ),
        interpret=interpret,
    )


LAYOUTS = {"copies": ((16, 128), COPIES_LAYOUT), "transpose": ((32, 128), TRANSPOSE_LAYOUT)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_integer_form_in_the_interpreter_equals_the_model(layout, interpret):
    shape, register_layout = LAYOUTS[layout]
    bits = tile_bits(shape)
    got = np.asarray(magnitudes_kernel(shape, register_layout, False, interpret)(bits))
    np.testing.assert_array_equal(got, modelled(bits))
    # Control: the magnitudes differ from the bits wherever a sign or a NaN is.
    assert not np.array_equal(got, bits & np.uint32(0x7FFFFFFF))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ptx_form_equals_the_integer_form_on_the_gpu(layout):
    shape, register_layout = LAYOUTS[layout]
    bits = tile_bits(shape, seed=1)
    ptx = np.asarray(magnitudes_kernel(shape, register_layout, True, None)(bits))
    integer = np.asarray(magnitudes_kernel(shape, register_layout, False, None)(bits))
    np.testing.assert_array_equal(ptx, modelled(bits))
    np.testing.assert_array_equal(ptx, integer)
    # Control: the PTX form did replace the NaNs (a max.NaN would have kept them).
    nans = (bits & np.uint32(0x7FFFFFFF)) > 0x7F800000
    assert nans.any() and (ptx[nans] == 0).all()
