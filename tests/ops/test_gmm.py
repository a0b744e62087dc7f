"""jaxmoe.ops.gmm / tgmm (impl="xla") against a per-group numpy loop, gradients included.

Every test runs on the host CPU, also on a GPU machine: there XLA would run the fp32 matmuls in
TF32 (JAX's default matmul precision) and the group sizes would live on the GPU, where the
host-side size checks do not read them back. The Pallas kernels' tests are in
test_gmm_pallas.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops import gmm, tgmm

from bitwise import assert_bitwise, differs


@pytest.fixture(autouse=True)
def on_host_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def loop_gmm(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, size in enumerate(sizes):
        out[start : start + size] = lhs[start : start + size] @ rhs[g]
        start += size
    return out


def loop_tgmm(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((len(sizes), lhs.shape[1], rhs.shape[1])), 0
    for g, size in enumerate(sizes):
        out[g] = lhs[start : start + size].T @ rhs[start : start + size]
        start += size
    return out


SIZES = [[5, 0, 9, 3], [0, 0, 17, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_loop_and_zeroes_tail_rows(sizes, transpose_rhs):
    rng = np.random.default_rng(0)
    m, k, n = 20, 16, 24
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, k, n)), jnp.float32)
    operand = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = gmm(lhs, operand, jnp.asarray(sizes, jnp.int32), transpose_rhs=transpose_rhs, impl="xla")
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    np.testing.assert_allclose(out, loop_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)


def test_gmm_bf16_inputs_accumulate_in_fp32():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((32, 256)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((2, 256, 8)), jnp.bfloat16)
    out = gmm(lhs, rhs, jnp.array([16, 16], jnp.int32), impl="xla")
    np.testing.assert_allclose(out, loop_gmm(lhs, rhs, [16, 16]), rtol=1e-5, atol=1e-4)


def test_tgmm_matches_loop():
    rng = np.random.default_rng(2)
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)
    sizes = [5, 0, 9, 3]
    out = tgmm(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(out, loop_tgmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[1] == 0)


def test_tgmm_group_bits_depend_on_its_start_modulo_32_only():
    """XLA:CPU's ragged dot sums a group's rows in an order fixed by the group's start modulo 32
    (what `jaxmoe.expert_parallel.GROUP_START_ALIGNMENT` relies on): the same rows give the
    same bits at starts 0, 32, 96, 2080, and other bits at a start of 1, 8 or 16 (the control:
    which of them depends on the CPU; 8 and 16 on earlier machines, only odd starts on an AMD
    EPYC of 2026-12-04, whose order depends on the start modulo 2)."""
    rng = np.random.default_rng(3)
    rows, total = 517, 4096
    lhs = jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    run = jax.jit(lambda a, b, sizes: tgmm(a, b, sizes, impl="xla")[1])

    def at(start):
        place = lambda x: jnp.zeros((total, x.shape[1]), x.dtype).at[start : start + rows].set(x)
        sizes = jnp.array([start, rows, total - start - rows], jnp.int32)
        return np.asarray(run(place(lhs), place(rhs), sizes))

    first = at(0)
    for start in (32, 96, 2080):
        assert_bitwise(at(start), first)
    assert any(differs(at(start), first) for start in (1, 8, 16))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_gradients_match_loop_gradients(transpose_rhs):
    rng = np.random.default_rng(3)
    sizes = [5, 0, 9, 3]
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)
    operand = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    d_lhs, d_rhs = jax.grad(
        lambda a, b: jnp.sum(gmm(a, b, jnp.asarray(sizes), transpose_rhs=transpose_rhs) * cot),
        argnums=(0, 1),
    )(lhs, operand)
    expected_lhs = np.zeros((20, 8))
    start = 0
    for g, size in enumerate(sizes):
        expected_lhs[start : start + size] = (
            np.asarray(cot[start : start + size]) @ np.asarray(rhs[g]).T
        )
        start += size
    expected_rhs = loop_tgmm(lhs, cot, sizes)
    if transpose_rhs:
        expected_rhs = np.swapaxes(expected_rhs, 1, 2)
    np.testing.assert_allclose(d_lhs, expected_lhs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_rhs, expected_rhs, rtol=1e-5, atol=1e-5)


def test_nan_in_one_group_stays_in_that_group():
    rng = np.random.default_rng(4)
    lhs = np.asarray(rng.standard_normal((12, 8)), np.float32)
    lhs[2, 3] = np.nan
    rhs = jnp.asarray(rng.standard_normal((3, 8, 4)), jnp.float32)
    sizes = jnp.array([4, 4, 4], jnp.int32)
    out = np.asarray(gmm(jnp.asarray(lhs), rhs, sizes))
    assert np.all(np.isnan(out[2])) and np.all(np.isfinite(np.delete(out, 2, axis=0)))
    d_rhs = np.asarray(jax.grad(lambda b: jnp.sum(gmm(jnp.asarray(lhs), b, sizes)))(rhs))
    assert np.any(np.isnan(d_rhs[0])) and np.all(np.isfinite(d_rhs[1:]))


def test_bad_arguments_raise():
    lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match="contraction"):
        gmm(lhs, jnp.ones((2, 5, 3)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, jnp.array([4, 2, 2]))
    with pytest.raises(TypeError, match="integers"):
        gmm(lhs, rhs, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="impl"):
        gmm(lhs, rhs, jnp.array([4, 4]), impl="cuda")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gmm(jnp.ones((8,)), rhs, jnp.array([4, 4]))
    # Values are checked when known on the host (numpy), on any platform.
    with pytest.raises(ValueError, match="add up"):
        gmm(lhs, rhs, np.array([6, 4]))
    with pytest.raises(ValueError, match="add up"):
        tgmm(lhs, jnp.ones((8, 3)), np.array([-1, 4]))
    with pytest.raises(ValueError, match="share M"):
        tgmm(lhs, jnp.ones((7, 3)), jnp.array([4, 4]))
