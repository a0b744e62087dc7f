"""Grouped matmuls whose consecutive groups share one matrix (`groups_per_weight`, what expert
parallelism uses for the (expert, source) blocks of one expert): the forward and d lhs are the
bits of the same GEMM on the matrices repeated per group, and d rhs is the per-group partials
(rounded to the compute dtype) of that GEMM summed over each matrix's groups with
`sum_in_order` in fp32, in the rhs's own dtype. On the XLA reference and on the Pallas kernels
(CPU interpreter), bf16 and MXFP8; the forward on FP8-blockwise operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreter_tilings import GMM_SMALL

from jaxmoe import fp8_blockwise as fb
from jaxmoe.mxfp8 import quantize
from jaxmoe.ops import Mxfp8Kernel, gmm
from jaxmoe.ops.mxfp8_gmm import mxfp8_gmm
from jaxmoe.ordered import sum_in_order

from bitwise import assert_bitwise, differs

PER_WEIGHT, WEIGHTS, K, N = 3, 2, 128, 128
SIZES = [32, 0, 64, 32, 96, 32]  # multiples of 32 (MXFP8 columnwise blocks), an empty group


def operands(rhs_dtype):
    key_l, key_r, key_g = jax.random.split(jax.random.key(0), 3)
    m = sum(SIZES) + 32  # rows past the groups
    lhs = jax.random.normal(key_l, (m, K)).astype(jnp.bfloat16)
    rhs = jax.random.normal(key_r, (WEIGHTS, K, N)).astype(jnp.bfloat16).astype(rhs_dtype)
    cotangent = jax.random.normal(key_g, (m, N))
    return lhs, rhs, cotangent


def product(kind, impl):
    if kind == "bf16":
        config = GMM_SMALL if impl == "pallas" else None
        return lambda lhs, rhs, sizes, **kw: gmm(
            lhs, rhs, sizes, impl=impl, config=config, preferred_element_type=jnp.float32, **kw
        )
    return lambda lhs, rhs, sizes, **kw: mxfp8_gmm(
        lhs, rhs, sizes, impl=impl, preferred_element_type=jnp.bfloat16, **kw
    )


def _shared_matrix_cases():
    """Every impl x kind x rhs dtype; on the kernels the bf16 case is in `make test`, the others
    are exhaustive."""
    for impl in ("xla", "pallas"):
        for kind in ("bf16", "mxfp8"):
            for rhs_dtype, name in ((jnp.bfloat16, "bf16_rhs"), (jnp.float32, "fp32_rhs")):
                further = impl == "pallas" and (kind, name) != ("bf16", "bf16_rhs")
                marks = [pytest.mark.exhaustive] if further else []
                yield pytest.param(impl, kind, rhs_dtype, id=f"{impl}-{kind}-{name}", marks=marks)


@pytest.mark.parametrize("impl,kind,rhs_dtype", list(_shared_matrix_cases()))
def test_shared_matrices_equal_repeated_ones(interpret, impl, kind, rhs_dtype):
    lhs, rhs, cotangent = operands(rhs_dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    multiply = product(kind, impl)
    shared, shared_vjp = jax.vjp(
        lambda a, b: multiply(a, b, sizes, groups_per_weight=PER_WEIGHT), lhs, rhs
    )
    # The reference: the matrices repeated per group in the compute dtype, one partial each.
    repeated = jnp.repeat(rhs.astype(jnp.bfloat16), PER_WEIGHT, axis=0)
    plain, plain_vjp = jax.vjp(lambda a, b: multiply(a, b, sizes), lhs, repeated)
    d_lhs, d_rhs = shared_vjp(cotangent.astype(shared.dtype))
    want_d_lhs, partials = plain_vjp(cotangent.astype(plain.dtype))
    assert_bitwise(np.asarray(shared), np.asarray(plain))
    assert_bitwise(np.asarray(d_lhs), np.asarray(want_d_lhs))
    grouped = partials.astype(jnp.float32).reshape(WEIGHTS, PER_WEIGHT, K, N)
    want_d_rhs = sum_in_order(grouped, axis=1).astype(rhs_dtype)
    assert d_rhs.dtype == rhs_dtype
    assert_bitwise(np.asarray(d_rhs), np.asarray(want_d_rhs))
    # Control: the partials summed in bf16 (rounded after each add) give other bits.
    in_bf16 = partials[0::PER_WEIGHT] + partials[1::PER_WEIGHT] + partials[2::PER_WEIGHT]
    assert differs(np.asarray(in_bf16.astype(rhs_dtype)), np.asarray(d_rhs))


def test_group_count_must_be_a_multiple_of_the_matrices():
    lhs, rhs, _ = operands(jnp.bfloat16)
    with pytest.raises(ValueError, match="group_sizes must be"):
        gmm(lhs, rhs, jnp.asarray(SIZES[:5], jnp.int32), groups_per_weight=PER_WEIGHT, impl="xla")
    with pytest.raises(ValueError, match="narrower"):
        gmm(lhs.astype(jnp.float32), rhs, jnp.asarray(SIZES, jnp.int32), groups_per_weight=3)


def test_fp8_wgmma_kernel_reads_the_shared_matrix(interpret):
    """The MXFP8 kernel path (FP8_WGMMA: per-block scales of the shared matrix) too."""
    lhs, rhs, _ = operands(jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    lhs_q = quantize(lhs, axis=1)
    rhs_q = quantize(jnp.swapaxes(rhs, 1, 2), axis=2)
    repeated = quantize(jnp.swapaxes(jnp.repeat(rhs, PER_WEIGHT, axis=0), 1, 2), axis=2)
    run = lambda r, n: gmm(
        lhs_q,
        r,
        sizes,
        transpose_rhs=True,
        impl="pallas",
        kernel=Mxfp8Kernel.FP8_WGMMA,
        groups_per_weight=n,
    )
    assert_bitwise(np.asarray(run(rhs_q, PER_WEIGHT)), np.asarray(run(repeated, 1)))


def test_blockwise_forward_runs_a_matrix_groups_as_one():
    """FP8-blockwise operands: the n consecutive groups of a matrix are one group of their rows
    (the bits of the merged group sizes; with the XLA reference a row's bits depend on where
    its group starts, so not those of the matrices repeated per group); control: the matrices
    in another group order give other bits."""
    lhs, rhs, _ = operands(jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    merged = sizes.reshape(WEIGHTS, PER_WEIGHT).sum(axis=1)
    lhs_q = fb.quantize_1x128(lhs)
    run = lambda r, s, n: np.asarray(
        gmm(lhs_q, fb.quantize_128x128(r), s, impl="xla", groups_per_weight=n)
    )
    shared = run(rhs, sizes, PER_WEIGHT)
    assert_bitwise(shared, run(rhs, merged, 1))
    assert differs(shared, run(jnp.tile(rhs, (PER_WEIGHT, 1, 1)), sizes, 1))
