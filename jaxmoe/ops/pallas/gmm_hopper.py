"""Grouped matmul forward / dgrad kernel for Hopper (Pallas Mosaic GPU), bf16/fp16 in, fp32 acc:
out[rows of group g] = lhs[rows of g] @ rhs[g] (rhs[g] is [K, N], or [N, K] with transpose_rhs).

Persistent and warp specialised (`gmm_common`); each K step is one wgmma into an fp32
accumulator in registers, in ascending K order, so an output's reduction order depends only on
K. docs/kernels/gmm.md describes the design."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.gmm_common import (
    GmmConfig,
    TileContext,
    aligned_epilogue_tile_n,
    gmm_kernel_call,
)


def default_config(
    num_rows: int, k: int, n: int, num_groups: int, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16
) -> GmmConfig:
    """Shape-based heuristic (the kernel experiments in docs/notes/ have the sweep behind it): a
    128 x 256 CTA tile of two 64 x 256 warpgroup tiles stacked along M with a double-buffered
    epilogue when N is a multiple of 256, else warpgroups along M with the widest column tile
    dividing N; as many pipeline stages (up to 4) as shared memory holds. A dense product
    (one group) with too few tiles to fill half the SMs takes 64-column tiles (more CTAs) and
    128-wide K steps (half the steps in each CTA's chain), faster for the routers at decode
    sizes. `dense` now runs such forwards on the
    narrow-tile kernel (`dense_narrow_hopper.py`); its d x at decode sizes still comes here."""
    if k % 64 or n % 64:
        raise ValueError(f"gmm pallas: K={k} and N={n} must be multiples of 64")
    if num_groups == 1 and cdiv(num_rows, 128) * (n // 64) <= num_sms() // 2:
        config = GmmConfig(tile_m=64, tile_n=64, tile_k=128 if k % 128 == 0 else 64, wg_split="m")
    elif n % 256 == 0:
        # Wider bands pay off when many groups share each column band (sweep: +3%).
        config = GmmConfig(
            tile_m=64,
            tile_n=256,
            wg_split="m",
            epilogue_slots=2,
            grid_tile_width=8 if num_groups >= 32 else 4,
        )
    else:
        tile_n = 128 if n % 128 == 0 else 64
        config = GmmConfig(tile_m=64 if num_rows < 256 else 128, tile_n=tile_n, wg_split="m")
    config = dataclasses.replace(
        config,
        num_sms=num_sms(),
        epilogue_tile_n=min(aligned_epilogue_tile_n(out_dtype), config.tile_n),
        max_concurrent_steps=min(config.max_concurrent_steps, k // config.tile_k),
    )
    return config.with_fitting_stages(in_dtype, out_dtype)


def gmm_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    out_dtype,
    config: GmmConfig | None = None,
    interpret=None,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
) -> jax.Array:
    """The kernel behind `jaxmoe.ops.gmm(impl="pallas")`: lhs [M, K] and rhs [G, K, N] (or
    [G, N, K] with transpose_rhs), both bf16 or both fp16, to out [M, N] in out_dtype; rows
    past sum(group_sizes) are zeros (unwritten with write_rows_past_groups=False). config: None
    for `default_config`. With groups_per_weight n, rhs holds G / n matrices and group g
    multiplies rhs[g // n]."""
    num_rows, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"gmm pallas: lhs and rhs must both be bf16 or fp16, got {lhs.dtype}, {rhs.dtype}"
        )
    config = config or default_config(num_rows, k, n, num_groups, lhs.dtype, out_dtype)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype, transpose_rhs)
    # overlap_wgmma: a step's SMEM slot is released once the next step's wgmma is issued.
    release_delay = 1 if config.overlap_wgmma and config.max_concurrent_steps > 1 else 0
    return gmm_kernel_call(
        _multiply_tile,
        "gmm",
        lhs,
        rhs,
        (),
        group_sizes,
        n=n,
        out_dtype=out_dtype,
        transpose_rhs=transpose_rhs,
        swizzle_k=config.tile_k,
        release_delay=release_delay,
        config=config,
        interpret=interpret,
        groups_per_weight=groups_per_weight,
        write_rows_past_groups=write_rows_past_groups,
    )


def _multiply_tile(tile: TileContext):
    """One wgmma per K step into an accumulator in registers, then the epilogue."""

    def mma(_step, lhs_smem, rhs_smem, acc_ref):
        # Both warpgroups multiply even where one has no valid rows (a group's last tile):
        # skipping that wgmma under a condition was slower.
        plgpu.wgmma(acc_ref, *tile.operands(lhs_smem, rhs_smem))
        if not tile.release_delay:
            plgpu.wgmma_wait(0)
        return acc_ref

    def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(tile.acc_shape))
        def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            tile.finish_pipeline()
            tile.store(acc_ref[...])

    tile.run_pipeline(mma, compute_context)
