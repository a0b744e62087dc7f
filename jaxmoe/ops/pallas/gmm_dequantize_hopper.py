"""MXFP8 grouped matmul for Hopper that dequantizes in the kernel (Pallas Mosaic GPU): the fp8
operand tiles and their block scales are read once, turned into bf16 in the kernel, and
multiplied by bf16 wgmma: out[m, n] = sum_k deq(lhs)[m, k] deq(rhs)[g(m)][n, k], fp32
accumulation. No bf16 copy of either operand is written to HBM.

Bitwise the same as dequantizing both operands to bf16 (`jaxmoe.mxfp8.dequantize`, exact) and
running the bf16 kernel (`gmm_hopper`): deq(x) = x * 2^e is exact in fp32 and in bf16, and both
kernels accumulate the same k16 wgmma instructions into one fp32 accumulator in ascending K
order (the bf16 kernel's K step is a sequence of them; here each 32-wide scale block is two).

Per K step and 32-wide block, each compute warpgroup loads its lhs rows and rhs columns (fp8)
into registers, scales them, and writes them as bf16 into SMEM tiles of its own, which one
bf16 wgmma reads. (An A operand in registers would skip one SMEM round trip, but the Mosaic GPU
interpreter, which the CPU tests run the kernel in, takes wgmma operands from SMEM only.)
docs/kernels/fp8_gemm.md describes the design."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.gmm_common import (
    NUM_COMPUTE_WGS,
    GmmConfig,
    TileContext,
    gmm_kernel_call,
    swizzled,
)
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import check_fp8_operands, default_mxfp8_config

_MULTIPLY_DTYPE = jnp.bfloat16


def _scratch(config: GmmConfig) -> tuple:
    """One warpgroup's bf16 blocks of one 32-wide K block, K-major: its tile_m lhs rows and
    its tile_n rhs columns."""
    return tuple(
        plgpu.SMEM(
            (rows, BLOCK_SIZE), _MULTIPLY_DTYPE, transforms=swizzled(_MULTIPLY_DTYPE, BLOCK_SIZE)
        )
        for rows in (config.tile_m, config.tile_n)
    )


def _scratch_bytes(config: GmmConfig) -> int:
    per_wg = (config.tile_m + config.tile_n) * BLOCK_SIZE * jnp.dtype(_MULTIPLY_DTYPE).itemsize
    return NUM_COMPUTE_WGS * per_wg


def default_dequantize_config(
    num_rows: int, k: int, n: int, num_groups: int, out_dtype=jnp.bfloat16
) -> GmmConfig:
    """The fp8 kernel's heuristic (`default_mxfp8_config`: 64 x 128 warpgroup tiles, side by
    side along N when N allows, so each warpgroup dequantizes only its own rhs columns), its
    stages refitted around the bf16 blocks."""
    config = dataclasses.replace(
        default_mxfp8_config(num_rows, k, n, num_groups, out_dtype),
        max_concurrent_steps=min(6, k // 128),
    )
    return config.with_fitting_stages(jnp.float8_e4m3fn, out_dtype, _scratch_bytes(config))


def gmm_dequantize_pallas(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype,
    config: GmmConfig | None = None,
    interpret=None,
    groups_per_weight: int = 1,
) -> jax.Array:
    """MXFP8 grouped matmul on Hopper, dequantizing in the kernel: operands as for
    `gmm_mxfp8_pallas` (lhs [M, K] and rhs [G, N, K] float8; lhs_scale [K/32, M] and
    rhs_scale [G, K/32, N] the decoded fp32 block scales). Rows past sum(group_sizes) are
    zeros. config: None for `default_dequantize_config`; its tile_k must be a multiple of 64.
    With groups_per_weight n, rhs (and rhs_scale) hold G / n matrices and group g uses
    entry g // n."""
    check_fp8_operands(lhs, lhs_scale, rhs, rhs_scale, "gmm pallas dequantize")
    num_rows, k = lhs.shape
    num_groups, n, _ = rhs.shape
    config = config or default_dequantize_config(num_rows, k, n, num_groups, out_dtype)
    config.validate(
        num_rows,
        k,
        n,
        lhs.dtype,
        out_dtype,
        transpose_rhs=True,
        scratch_bytes=_scratch_bytes(config),
    )
    return gmm_kernel_call(
        _multiply_dequantized_tile,
        "gmm_dequantize",
        lhs,
        rhs,
        (lhs_scale, rhs_scale),
        group_sizes,
        n=n,
        out_dtype=out_dtype,
        transpose_rhs=True,
        swizzle_k=BLOCK_SIZE,  # the tiles are sliced into 32-wide K blocks
        release_delay=0,
        config=config,
        interpret=interpret,
        groups_per_weight=groups_per_weight,
        scratch=_scratch(config),
    )


def _multiply_dequantized_tile(tile: TileContext):
    """Per K step and 32-wide block: the lhs and rhs blocks scaled into this warpgroup's bf16
    SMEM tiles, then one bf16 wgmma into the accumulator. The scales are read from GMEM (L2)
    straight into registers."""
    lhs_scale_gmem, rhs_scale_gmem = tile.inputs
    row_scales = lhs_scale_gmem.at[:, tile.rows]
    column_scales = rhs_scale_gmem.at[tile.group, :, tile.columns]
    lhs_block, rhs_block = tile.scratch
    blocks_per_step = tile.config.tile_k // BLOCK_SIZE
    scale_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout tile

    def mma(step, lhs_smem, rhs_smem, acc_ref):
        for block in range(blocks_per_step):
            ks = pl.ds(block * BLOCK_SIZE, BLOCK_SIZE)
            kb = step[0] * blocks_per_step + block
            row_scale = plgpu.load(
                row_scales.at[kb, tile.wg_rows], layout=scale_layout, optimized=False
            )
            column_scale = plgpu.load(
                column_scales.at[kb, tile.wg_columns], layout=scale_layout, optimized=False
            )
            lhs = lhs_smem.at[tile.wg_rows, ks][...].astype(jnp.float32)
            lhs_block[...] = (lhs * row_scale[:, None]).astype(_MULTIPLY_DTYPE)
            rhs = rhs_smem.at[tile.wg_columns, ks][...].astype(jnp.float32)
            rhs_block[...] = (rhs * column_scale[:, None]).astype(_MULTIPLY_DTYPE)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, lhs_block, rhs_block.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the next block overwrites both tiles
        return acc_ref

    def compute_context(eval_pipeline):
        def scoped(acc_ref):
            eval_pipeline(acc_ref)
            tile.store(acc_ref[...])

        pl.run_scoped(scoped, plgpu.ACC(tile.acc_shape))

    tile.run_pipeline(mma, compute_context)
