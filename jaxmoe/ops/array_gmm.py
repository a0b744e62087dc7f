"""Grouped matmul on float arrays (bf16, fp16, fp32): `jaxmoe.ops.gmm` and `jaxmoe.ops.tgmm`
for array operands (`_gmm_arrays`, `_tgmm_arrays`), with a custom VJP so that the backward pass
also runs through these two products, and the helpers the quantized grouped matmuls share.

Several consecutive groups may share one matrix (`groups_per_weight` n: group g multiplies
rhs[g // n]), as the blocks of one expert's rows from n sources do under expert parallelism.
Each group then still has its own weight-gradient partial (rounded to the compute dtype, as
the GEMM writes it), and the partials of one matrix are summed in a fixed order in fp32
(`jaxmoe.ordered.sum_in_order`); an rhs wider than lhs (fp32 weights, bf16 rows) is rounded to
lhs's dtype for the products and gets its gradient in its own dtype, unrounded.

Implementations (`impl=`):
  "xla"    the readable reference (`jax.lax.ragged_dot`, fp32 accumulation) every kernel is tested
           against. On XLA:CPU a row's result does not depend on the other rows once M >= 2
           (tested); cuBLAS on GPU may pick M-dependent algorithms.
  "pallas" the Hopper Mosaic GPU kernels (ops/pallas/gmm_hopper.py, tgmm_hopper.py): bf16/fp16
           operands, K and N multiples of 64; batch-invariant by construction. Any other
           problem raises ValueError. On a machine without a Hopper GPU it runs only inside
           `plgpu.force_gpu_interpret_mode` (the CPU interpreter used by the tests).
  "auto"   "pallas" on a Hopper GPU when the problem qualifies, else "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.ints import round_up
from jaxmoe.ops import registry
from jaxmoe.ops.checks import check_floating, check_group_sizes
from jaxmoe.ops.live_rows import fill_dead_rows
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_hopper import gmm_pallas
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig, tgmm_pallas
from jaxmoe.ordered import sum_in_order

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KERNEL_ROW_MULTIPLE = 8
_KERNEL_MIN_ROWS = 128
KERNEL_MULTIPLE = 64  # K and N of the Pallas kernels


def kernel_problem(lhs_dtype, rhs_dtype, k: int, n: int) -> str | None:
    """Why the Pallas gmm / tgmm kernels cannot run this problem (None when they can)."""
    if lhs_dtype != rhs_dtype or jnp.dtype(lhs_dtype) not in KERNEL_DTYPES:
        return f"operands must both be bf16 or fp16, got {lhs_dtype} and {rhs_dtype}"
    if k % KERNEL_MULTIPLE or n % KERNEL_MULTIPLE:
        return f"K={k} and N={n} must be multiples of {KERNEL_MULTIPLE}"
    return None


registry.register("gmm", "pallas", problem=kernel_problem)
registry.register("tgmm", "pallas", problem=kernel_problem)


def pad_rows(x, num_rows):
    """x with zero rows appended up to num_rows (a no-op when it already has them)."""
    extra = num_rows - x.shape[0]
    return x if extra <= 0 else jnp.pad(x, ((0, extra), (0, 0)))


def kernel_rows(num_rows):
    """Row count the Pallas kernels run on: a multiple of 8, at least one full tile."""
    return max(round_up(num_rows, _KERNEL_ROW_MULTIPLE), _KERNEL_MIN_ROWS)


def _gmm_arrays(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: GmmConfig | None = None,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
) -> jax.Array:
    """`jaxmoe.ops.gmm` on arrays: out[m] = lhs[m] @ rhs[g(m) // groups_per_weight] for lhs
    [M, K], rhs [G / n, K, N] (or [G / n, N, K] with `transpose_rhs`; n = groups_per_weight),
    group_sizes [G] int; fp32 accumulation, result in `preferred_element_type`. rhs may be a
    wider float than lhs (it is rounded to lhs's dtype). Differentiable: dgrad is a gmm, wgrad
    a `_tgmm_arrays` per group (summed over each matrix's groups in a fixed order), on the same
    implementation as the forward. `config` tiles the Pallas forward (None: the shape heuristic
    `gmm_hopper.default_config`; the backward kernels use their heuristics); no config changes
    the result bits. write_rows_past_groups=False: the rows at and past sum(group_sizes) of out
    (and of d lhs) are not computed and hold unspecified values, for a buffer whose rows past
    its groups nothing reads (`jaxmoe.ops.live_rows`)."""
    registry.check_impl("gmm", impl)
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm: lhs must be [M, K] and rhs [G, K, N]; got {lhs.shape}, {rhs.shape}")
    check_floating("gmm", lhs=lhs, rhs=rhs)
    if jnp.finfo(rhs.dtype).bits < jnp.finfo(lhs.dtype).bits:
        raise ValueError(f"gmm: rhs ({rhs.dtype}) may not be narrower than lhs ({lhs.dtype})")
    if groups_per_weight < 1:
        raise ValueError(f"gmm: groups_per_weight must be >= 1, got {groups_per_weight}")
    check_group_sizes(group_sizes, rhs.shape[0] * groups_per_weight, lhs.shape[0], "gmm")
    k_rhs, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if lhs.shape[1] != k_rhs:
        raise ValueError(f"gmm: contraction sizes differ: lhs K={lhs.shape[1]}, rhs K={k_rhs}")
    resolved = registry.resolve("gmm", impl, lhs.dtype, lhs.dtype, k_rhs, n)
    return _gmm_differentiable(
        lhs,
        rhs,
        group_sizes.astype(jnp.int32),
        transpose_rhs,
        jnp.dtype(preferred_element_type),
        resolved,
        config,
        groups_per_weight,
        write_rows_past_groups,
    )


def sum_group_partials(partials: jax.Array, groups_per_weight: int, dtype) -> jax.Array:
    """Per-group weight gradients [G, ...] -> per matrix [G / n, ...] in `dtype`: each matrix's
    n consecutive partials summed with `sum_in_order` in fp32 (n = 1: only the dtype)."""
    if groups_per_weight == 1:
        return partials.astype(dtype)
    grouped = partials.reshape((-1, groups_per_weight) + partials.shape[1:])
    return sum_in_order(grouped.astype(jnp.float32), axis=1, dtype=dtype)


def _tgmm_arrays(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: registry.Impl = "auto",
    preferred_element_type=jnp.float32,
    config: TgmmConfig | None = None,
) -> jax.Array:
    """`jaxmoe.ops.tgmm` on arrays: out[g] = lhs[rows_g]^T @ rhs[rows_g] -> [G, K, N] for lhs
    [M, K] and rhs [M, N]; fp32 accumulation. Groups with no rows give zeros. `config` tiles
    the Pallas kernel (None: the heuristic `tgmm_hopper.default_tgmm_config`)."""
    registry.check_impl("tgmm", impl)
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"tgmm: lhs [M, K] and rhs [M, N] must share M; got {lhs.shape}, {rhs.shape}"
        )
    check_floating("tgmm", lhs=lhs, rhs=rhs)
    check_group_sizes(group_sizes, None, lhs.shape[0], "tgmm")
    resolved = registry.resolve("tgmm", impl, lhs.dtype, rhs.dtype, lhs.shape[1], rhs.shape[1])
    return tgmm_product(
        lhs, rhs, group_sizes.astype(jnp.int32), jnp.dtype(preferred_element_type), resolved, config
    )


def gmm_product(
    lhs,
    rhs,
    group_sizes,
    transpose_rhs,
    out_dtype,
    impl,
    config=None,
    groups_per_weight=1,
    write_rows_past_groups=True,
):
    """`_gmm_arrays`' product on the resolved implementation `impl` ("pallas" or "xla"): no argument
    checks, not differentiable. Group sizes known on the host (numpy) give the kernel's tile
    metadata at trace time (`jaxmoe.ops.pallas.tiles.metadata_scope`)."""
    rhs = rhs.astype(lhs.dtype)
    if impl == "pallas":
        num_rows = lhs.shape[0]
        out = gmm_pallas(
            pad_rows(lhs, kernel_rows(num_rows)),
            rhs,
            group_sizes,
            transpose_rhs=transpose_rhs,
            out_dtype=out_dtype,
            config=config,
            groups_per_weight=groups_per_weight,
            write_rows_past_groups=write_rows_past_groups,
        )
        return out[:num_rows]
    rhs = jnp.repeat(rhs, groups_per_weight, axis=0) if groups_per_weight > 1 else rhs
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    out = out.astype(out_dtype)
    return out if write_rows_past_groups else fill_dead_rows(out, jnp.sum(group_sizes))


def tgmm_product(lhs, rhs, group_sizes, out_dtype, impl, config=None):
    """`_tgmm_arrays`' product on the resolved implementation `impl`, as `gmm_product` is
    `_gmm_arrays`'."""
    if impl == "pallas":
        # TMA loads the row windows of both operands: zero rows up to the kernels' multiple of
        # 8 (rows past the groups add nothing).
        rows = kernel_rows(lhs.shape[0])
        return tgmm_pallas(
            pad_rows(lhs, rows),
            pad_rows(rhs, rows),
            group_sizes,
            out_dtype=out_dtype,
            config=config,
        )
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        lhs.T, rhs, group_sizes, dims, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _gmm_differentiable(
    lhs, rhs, group_sizes, transpose_rhs, out_dtype, impl, config, groups_per_weight, written
):
    return gmm_product(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, impl, config, groups_per_weight, written
    )


def _gmm_fwd(
    lhs, rhs, group_sizes, transpose_rhs, out_dtype, impl, config, groups_per_weight, written
):
    out = gmm_product(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, impl, config, groups_per_weight, written
    )
    return out, (lhs, rhs, group_sizes)


def _gmm_bwd(transpose_rhs, out_dtype, impl, config, groups_per_weight, written, residuals, grad):
    lhs, rhs, group_sizes = residuals
    grad = grad.astype(lhs.dtype)
    # dgrad: d lhs = grad @ rhs[g]^T, i.e. a gmm against the other orientation of rhs.
    d_lhs = gmm_product(
        grad, rhs, group_sizes, not transpose_rhs, lhs.dtype, impl, None, groups_per_weight, written
    )
    if transpose_rhs:
        partials = tgmm_product(grad, lhs, group_sizes, lhs.dtype, impl)
    else:
        partials = tgmm_product(lhs, grad, group_sizes, lhs.dtype, impl)
    return d_lhs, sum_group_partials(partials, groups_per_weight, rhs.dtype), None


_gmm_differentiable.defvjp(_gmm_fwd, _gmm_bwd)
