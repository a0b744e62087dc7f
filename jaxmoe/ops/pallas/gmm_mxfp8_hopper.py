"""Block-scaled fp8 grouped matmul kernel for Hopper (Pallas Mosaic GPU): fp8 operands with one
fp32 scale per `scale_block` elements along K (MXFP8: 32, power-of-two scales; FP8 blockwise:
128, `jaxmoe.fp8_blockwise`), fp32 accumulation:
out[m, n] = sum over K blocks b, in order, of P_b[m, n] * (lhs_scale[b, m] * rhs_scale[g(m), b, n])
with P_b the block's fp8 product.

Same persistent, warp-specialised pipeline as the bf16 kernel (`gmm_common`); a K step runs one
fp8 wgmma per scale block into a fresh accumulator and folds it, scaled, into the running one.
docs/kernels/fp8_gemm.md describes the design."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.gmm_common import (
    GmmConfig,
    TileContext,
    aligned_epilogue_tile_n,
    gmm_kernel_call,
    zero_accumulator,
)

_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def default_mxfp8_config(
    num_rows: int, k: int, n: int, num_groups: int, out_dtype=jnp.bfloat16
) -> GmmConfig:
    """Heuristic for the MXFP8 kernel: the fp32 accumulator and one block product live in
    registers together, so each warpgroup owns 64 x 128 outputs (CTA 64 x 256, or 128 x 128
    along M for narrow N); 128-wide K steps (one 128-byte swizzled row of fp8)."""
    if k % 128 or n % 128:
        raise ValueError(f"gmm pallas mxfp8: K={k} and N={n} must be multiples of 128")
    split = "n" if n % 256 == 0 else "m"
    config = GmmConfig(
        tile_m=64,
        tile_n=128,
        tile_k=128,
        wg_split=split,
        max_concurrent_steps=min(6, k // 128),
        grid_tile_width=8 if num_groups >= 32 else 4,
        epilogue_tile_n=aligned_epilogue_tile_n(out_dtype),
        num_sms=num_sms(),
    )
    return config.with_fitting_stages(jnp.float8_e4m3fn, out_dtype)


def default_fp8_blockwise_config(
    num_rows: int, k: int, n: int, num_groups: int, out_dtype=jnp.bfloat16
) -> GmmConfig:
    """Heuristic for the FP8 blockwise kernel (128-wide scale blocks): `default_mxfp8_config`'s
    64 x 128 warpgroup tiles, but stacked along M (CTA 128 x 128, whose lhs and rhs tiles
    are the same size) and 256-wide K steps (two blocks a step) when K allows: faster fprops and
    dgrads than the MXFP8 tiles, either change alone giving about half the gain. Each K step's
    scales are loaded two steps ahead (`scale_lookahead`, faster than one; the kernel
    experiments in docs/notes/)."""
    config = default_mxfp8_config(num_rows, k, n, num_groups, out_dtype)
    tile_k = 256 if k % 256 == 0 else 128
    config = dataclasses.replace(
        config,
        wg_split="m",
        tile_k=tile_k,
        max_concurrent_steps=min(4, k // tile_k),
        scale_lookahead=2,
    )
    return config.with_fitting_stages(jnp.float8_e4m3fn, out_dtype)


def check_fp8_operands(
    lhs, lhs_scale, rhs, rhs_scale, what: str, scale_block: int = BLOCK_SIZE
) -> None:
    """Raise ValueError unless lhs [M, K] and rhs [G, N, K] are float8 and lhs_scale
    [K/B, M] and rhs_scale [G, K/B, N / C] fp32, B = scale_block and C its weight blocks'
    width in columns (`column_block`: 1 for MXFP8, 128 for FP8 blockwise's square blocks)
    (the operands of the kernels reading fp8)."""
    num_rows, k = lhs.shape
    num_groups, n, _ = rhs.shape
    if lhs.dtype not in _FP8_DTYPES or rhs.dtype not in _FP8_DTYPES:
        raise ValueError(f"{what}: operands must be float8, got {lhs.dtype}, {rhs.dtype}")
    columns = column_block(scale_block)
    if (
        lhs_scale.shape != (k // scale_block, num_rows)
        or rhs_scale.shape != (num_groups, k // scale_block, n // columns)
        or lhs_scale.dtype != jnp.float32
        or rhs_scale.dtype != jnp.float32
    ):
        n_blocks = "N" if columns == 1 else f"N/{columns}"
        raise ValueError(
            f"{what}: scales must be fp32 [K/{scale_block}, M] and [G, K/{scale_block}, "
            f"{n_blocks}], got {lhs_scale.shape} {lhs_scale.dtype} and {rhs_scale.shape} "
            f"{rhs_scale.dtype}"
        )


def column_block(scale_block: int) -> int:
    """Columns that share a weight scale: 1 for MXFP8 (1 x 32 blocks along K), the block
    width for FP8 blockwise (square 128 x 128 blocks)."""
    return 1 if scale_block == BLOCK_SIZE else scale_block


def gmm_mxfp8_pallas(
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
    """MXFP8 grouped matmul on Hopper: out[m] = sum_k deq(lhs)[m, k] deq(rhs)[g(m)][n, k], fp32
    accumulation. Hopper's fp8 wgmma needs both operands K-major, so rhs is [G, N, K].

    lhs [M, K] and rhs [G, N, K]: float8_e4m3fn / float8_e5m2 elements.
    lhs_scale [K/32, M] and rhs_scale [G, K/32, N]: the decoded fp32 block scales 2^(e-127),
      transposed so that a K block's scales for a row tile are contiguous.
    Rows past sum(group_sizes) are zeros. config: None for `default_mxfp8_config`. With
    groups_per_weight n, rhs (and rhs_scale) hold G / n matrices and group g uses entry g // n."""
    return gmm_block_scaled_fp8_pallas(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        group_sizes,
        scale_block=BLOCK_SIZE,
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
        groups_per_weight=groups_per_weight,
    )


def gmm_block_scaled_fp8_pallas(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    scale_block: int,
    out_dtype,
    config: GmmConfig | None = None,
    interpret=None,
    groups_per_weight: int = 1,
    write_rows_past_groups: bool = True,
) -> jax.Array:
    """Block-scaled fp8 grouped matmul on Hopper (module docstring): lhs [M, K] and rhs
    [G, N, K] float8 (both K-major, as Hopper's fp8 wgmma reads them); lhs_scale [K/B, M] and
    rhs_scale fp32 multipliers, B = scale_block (32 or 128), lhs's transposed so that a K
    block's scales for a row tile are contiguous; rhs_scale [G, K/32, N] for MXFP8 (a scale per
    column), [G, K/128, N/128] for FP8 blockwise (a scale per 128 x 128 block: a warpgroup's
    columns share one, so its fold is one multiply-add per element). Rows past sum(group_sizes)
    are zeros (unwritten with write_rows_past_groups=False, `jaxmoe.ops.live_rows`). config:
    None for the heuristic of the recipe (`default_mxfp8_config`,
    `default_fp8_blockwise_config`). groups_per_weight as in `gmm_mxfp8_pallas`."""
    if scale_block not in _TILE_MATMULS:
        raise ValueError(f"gmm pallas fp8: scale_block must be one of {sorted(_TILE_MATMULS)}")
    check_fp8_operands(lhs, lhs_scale, rhs, rhs_scale, "gmm pallas fp8", scale_block)
    num_rows, k = lhs.shape
    num_groups, n, _ = rhs.shape
    default = default_mxfp8_config if scale_block == BLOCK_SIZE else default_fp8_blockwise_config
    config = config or default(num_rows, k, n, num_groups, out_dtype)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype, transpose_rhs=True)
    if config.tile_k % scale_block:
        raise ValueError(f"gmm pallas fp8: tile_k={config.tile_k} must hold whole scale blocks")
    columns = column_block(scale_block)
    if columns > 1 and columns % config.tile_n:
        raise ValueError(
            f"gmm pallas fp8: a warpgroup's tile_n={config.tile_n} must divide the {columns} "
            "columns of a weight block (its columns share the block's scale)"
        )
    # The operand tiles are sliced into scale_block-wide K blocks, so they are swizzled at that width.
    return gmm_kernel_call(
        _TILE_MATMULS[scale_block],
        "gmm_mxfp8" if scale_block == BLOCK_SIZE else "gmm_fp8_blockwise",
        lhs,
        rhs,
        (lhs_scale, rhs_scale),
        group_sizes,
        n=n,
        out_dtype=out_dtype,
        transpose_rhs=True,
        swizzle_k=scale_block,
        release_delay=0,
        config=config,
        interpret=interpret,
        groups_per_weight=groups_per_weight,
        write_rows_past_groups=write_rows_past_groups,
    )


def _multiply_scaled_tile(tile: TileContext, scale_block: int):
    """Per K step and scale block: an fp8 wgmma into a fresh accumulator, then
    acc += block product * (row scale * column scale), one fp32 rounding per block, in
    ascending K order (with power-of-two scales the scaling itself is exact). The scales are
    read from GMEM (L2) straight into registers. MXFP8: issued before the block's wgmma so that
    their latency passes while it runs (the fold waits for both). FP8 blockwise: the
    warpgroup's columns share one weight scale, so the two scales' product is per row, and a
    step's scales (a few registers) are loaded `config.scale_lookahead` K steps ahead and
    carried: their latency passes over whole steps instead of stalling the fold."""
    lhs_scale_gmem, rhs_scale_gmem = tile.inputs
    row_scales = lhs_scale_gmem.at[:, tile.rows]
    columns = column_block(scale_block)
    blocks_per_step = tile.config.tile_k // scale_block

    def load_row_scale(kb):
        return plgpu.load(
            row_scales.at[kb, tile.wg_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False
        )

    def block_product(a, b, ks):
        def product(part_ref):
            plgpu.wgmma(part_ref, a.at[:, ks], b.at[ks, :])
            plgpu.wgmma_wait(0)
            return part_ref[...]

        return pl.run_scoped(product, plgpu.ACC(tile.acc_shape))

    if columns == 1:
        column_scales = rhs_scale_gmem.at[tile.group, :, tile.columns]

        def mma(step, lhs_smem, rhs_smem, acc):
            a, b = tile.operands(lhs_smem, rhs_smem)
            for block in range(blocks_per_step):
                ks = pl.ds(block * scale_block, scale_block)
                kb = step[0] * blocks_per_step + block
                row_scale = load_row_scale(kb)
                col_scale = plgpu.load(
                    column_scales.at[kb, tile.wg_columns],
                    layout=plgpu.Layout.WGMMA.reduce(0),
                    optimized=False,
                )
                part = block_product(a, b, ks)
                acc = acc + part * (row_scale[:, None] * col_scale[None, :])
            return acc

        tile.run_pipeline(
            mma, lambda eval_pipeline: tile.store(eval_pipeline(zero_accumulator(*tile.acc_shape)))
        )
        return

    # one weight block, so one scale, spans this warpgroup's columns
    weight_block = (tile.columns.start + tile.wg_columns.start) // columns
    weight_scales = rhs_scale_gmem.at[tile.group, :, weight_block]
    last_step = row_scales.shape[0] // blocks_per_step - 1
    lookahead = tile.config.scale_lookahead

    def step_scales(k_step):
        """K step k_step's (row scales, weight scale) per block, as loads in flight."""
        blocks = [k_step * blocks_per_step + block for block in range(blocks_per_step)]
        return tuple((load_row_scale(kb), weight_scales[kb]) for kb in blocks)

    def mma(step, lhs_smem, rhs_smem, carry):
        acc, scales, *later = carry  # this step's scales, then the next steps' in order
        upcoming = step_scales(jnp.minimum(step[0] + lookahead, last_step))
        a, b = tile.operands(lhs_smem, rhs_smem)
        for block, (row_scale, weight_scale) in enumerate(scales):
            part = block_product(a, b, pl.ds(block * scale_block, scale_block))
            acc = acc + part * (row_scale * weight_scale)[:, None]  # the same products, per row
        return (acc, *later, upcoming)

    def compute(eval_pipeline):
        first = [step_scales(min(k_step, last_step)) for k_step in range(lookahead)]
        acc, *_ = eval_pipeline((zero_accumulator(*tile.acc_shape), *first))
        tile.store(acc)

    tile.run_pipeline(mma, compute)


# Module-level tile functions (they key gmm_common's kernel cache), by scale block.
_TILE_MATMULS = {
    BLOCK_SIZE: functools.partial(_multiply_scaled_tile, scale_block=BLOCK_SIZE),
    128: functools.partial(_multiply_scaled_tile, scale_block=128),
}
