"""Grouped weight-gradient kernel for Hopper (Pallas Mosaic GPU): out[g] = lhs[rows_g]^T @ rhs[rows_g].

lhs [M, K], rhs [M, N] (bf16/fp16), out [G, K, N]; the contraction runs over each group's rows.

Structure (persistent, one warpgroup per CTA): work items are (group, K tile, N tile); each walks
its group's rows in blocks of `tile_rows` through a TMA pipeline and accumulates
lhs_block^T @ rhs_block with wgmma in fp32 registers. Row blocks sit on a grid anchored at the
group's first row rounded down to 8 (TMA into swizzled SMEM needs 8-row offsets); a block that
holds rows of another group (or rows past M, zero-filled by TMA) has those rows replaced by
zeros in BOTH operands with a select, so NaN/Inf in one group never reaches
another group's gradient. Empty groups store zeros. No atomics; every output tile is written by
one work item.

Reduction order: ascending rows, 16 rows per wgmma step, anchored as above. It does not depend
on the config; it depends on the group's own rows and on its start modulo 16 (groups that start
on multiples of 16, e.g. with expert_row_alignment 16/32/128, see only their own rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ops.pallas.gmm_hopper import (HOPPER_NUM_SMS, ROW_ALIGN, SMEM_BUDGET, _swizzled,
                                          default_num_sms)


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
    """Tiling of the weight-gradient kernel (tile_k x tile_n outputs per work item)."""

    tile_k: int = 128
    tile_n: int = 128
    tile_rows: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4
    num_sms: int = HOPPER_NUM_SMS

    def smem_bytes(self, in_dtype, out_dtype) -> int:
        """Shared memory used: the TMA ring of row blocks plus the output tile."""
        ring = self.tile_rows * (self.tile_k + self.tile_n) * jnp.dtype(in_dtype).itemsize
        return (self.max_concurrent_steps * ring
                + self.tile_k * self.tile_n * jnp.dtype(out_dtype).itemsize)

    def validate(self, num_rows: int, k: int, n: int, in_dtype=jnp.bfloat16,
                 out_dtype=jnp.float32) -> None:
        """Raise ValueError when this config cannot run on the given problem."""
        if self.smem_bytes(in_dtype, out_dtype) > SMEM_BUDGET:
            raise ValueError(f"tgmm pallas: {self} needs {self.smem_bytes(in_dtype, out_dtype)} "
                             f"bytes of shared memory (> {SMEM_BUDGET})")
        if k % self.tile_k or n % self.tile_n:
            raise ValueError(f"tgmm pallas: K={k}, N={n} must be multiples of tile_k="
                             f"{self.tile_k}, tile_n={self.tile_n}")
        if self.tile_rows % 16:
            raise ValueError(f"tgmm pallas: tile_rows={self.tile_rows} must be a multiple of 16")


def default_tgmm_config(num_rows: int, k: int, n: int) -> TgmmConfig:
    """Shape-based heuristic: 128-wide output tiles where they divide, else 64."""
    tile_k = 128 if k % 128 == 0 else 64
    tile_n = 128 if n % 128 == 0 else 64
    if k % tile_k or n % tile_n:
        raise ValueError(f"tgmm pallas: K={k} and N={n} must be multiples of 64")
    return TgmmConfig(tile_k=tile_k, tile_n=tile_n, num_sms=default_num_sms())


def tgmm_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype,
                config: TgmmConfig | None = None, interpret=None) -> jax.Array:
    """The kernel behind `jaxmoe.ops.tgmm(impl="pallas")`; see the module docstring."""
    num_rows, k = lhs.shape
    n = rhs.shape[1]
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"tgmm pallas: lhs and rhs must both be bf16 or fp16, got {lhs.dtype}, "
                         f"{rhs.dtype}")
    config = config or default_tgmm_config(num_rows, k, n)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype)
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    ends = starts + sizes
    anchors = starts - starts % ROW_ALIGN
    num_blocks = jnp.where(sizes > 0, -(-(ends - anchors) // config.tile_rows), 0)
    kernel = _build_kernel(num_rows, k, n, sizes.shape[0], lhs.dtype, jnp.dtype(out_dtype),
                           config, interpret)
    return kernel(starts, ends, anchors, num_blocks, lhs, rhs)


@functools.lru_cache(maxsize=None)
def _build_kernel(num_rows, k, n, num_groups, dtype, out_dtype, config: TgmmConfig, interpret):
    tile_k, tile_n, tile_rows = config.tile_k, config.tile_n, config.tile_rows
    grid_k, grid_n = k // tile_k, n // tile_n
    lhs_transforms = _swizzled(dtype, tile_k)
    rhs_transforms = _swizzled(dtype, tile_n)
    # Keep one wgmma in flight: a slot is refilled only after the step after it was issued.
    release_delay = 1 if config.max_concurrent_steps > 1 else 0

    def body(starts_gmem, ends_gmem, anchors_gmem, blocks_gmem, lhs_gmem, rhs_gmem, out_gmem):
        @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
        def _work_loop(loop_info: plgpu.NDLoopInfo):
            group = loop_info.index[0]
            ki, ni = plgpu.planar_snake(loop_info.index[1], (grid_k, grid_n), 1,
                                        config.grid_tile_width)
            start, end = starts_gmem[group], ends_gmem[group]
            anchor, blocks = anchors_gmem[group], blocks_gmem[group]

            def acc_scope(acc_ref):
                def block_matmul(step, lhs_smem, rhs_smem):
                    grid_row = anchor + step[0] * tile_rows
                    row_lo = jnp.maximum(start, grid_row)
                    row_hi = jnp.minimum(end, grid_row + tile_rows)

                    @pl.when((row_lo > grid_row) | (row_hi < grid_row + tile_rows))
                    def _zero_foreign_rows():
                        for ref in (lhs_smem, rhs_smem):
                            rows = grid_row + plgpu.layout_cast(
                                lax.broadcasted_iota(jnp.int32, ref.shape, 0),
                                plgpu.Layout.WGMMA)
                            keep = (rows >= row_lo) & (rows < row_hi)
                            ref[...] = jnp.where(keep, ref[...], jnp.zeros((), ref.dtype))
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)
                    if release_delay == 0:
                        plgpu.wgmma_wait(0)

                # Row windows start on the 8-aligned anchor; the last one may run past M, where
                # TMA fills zeros (and the select above discards those rows anyway).
                def window(block):
                    return pl.multiple_of(anchor + block * tile_rows, ROW_ALIGN)

                plgpu.emit_pipeline(
                    block_matmul,
                    grid=(blocks,),
                    in_specs=[
                        plgpu.BlockSpec((pl.Element(tile_rows), tile_k),
                                        lambda b: (window(b), ki),
                                        transforms=lhs_transforms,
                                        delay_release=release_delay),
                        plgpu.BlockSpec((pl.Element(tile_rows), tile_n),
                                        lambda b: (window(b), ni),
                                        transforms=rhs_transforms,
                                        delay_release=release_delay),
                    ],
                    max_concurrent_steps=config.max_concurrent_steps,
                )(lhs_gmem, rhs_gmem)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_k, tile_n)))   # starts at zero

            @functools.partial(pl.run_scoped,
                               out_smem=plgpu.SMEM((tile_k, tile_n), out_dtype,
                                                   transforms=_swizzled(out_dtype, tile_n)))
            def _store(out_smem):
                out_smem[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem, out_gmem.at[group, pl.ds(ki * tile_k, tile_k),
                                          pl.ds(ni * tile_n, tile_n)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid=(config.num_sms,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
