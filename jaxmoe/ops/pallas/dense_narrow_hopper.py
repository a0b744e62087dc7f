"""Dense matmul for few rows on Hopper (Pallas Mosaic GPU): out = x @ w for x [M, K] and w [K, N],
bf16/fp16 in, fp32 accumulation, in many CTAs of narrow column tiles.

At a few rows (the router and the shared expert at decode sizes) the product is bound by how
fast each SM can read its operands, and a K step cannot be split across CTAs without changing
the bits. The grouped-matmul kernel's CTA tile (128 rows by 64 or more columns) puts the whole
product on a handful of SMs, with rows padded to 128; here a CTA is one warpgroup owning 64
rows by `tile_n` (16 to 64) columns, one CTA per tile (N / tile_n per 64 rows), its K steps
through a TMA ring (`plgpu.emit_pipeline`). The routers at decode sizes take about half the
grouped-matmul kernel's time.

Bits: each output is the chain of k16 wgmma steps in ascending K into an fp32 accumulator, as
in the grouped-matmul kernel (`gmm_hopper.py`), which a tile's width does not change: the same
bits as `jaxmoe.ops.dense` on that kernel, at any row count (batch-invariant).

docs/kernels/dense.md describes the design."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv

ROWS = 64  # rows of a CTA tile: the wgmma's M
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class NarrowConfig:
    """A CTA's columns (`tile_n`, the wgmma's N: 16, 32 or 64), its K steps (`tile_k`, 64 or
    128) and the TMA ring's depth. None of these change the bits."""

    tile_n: int = 64
    tile_k: int = 128
    max_concurrent_steps: int = 4

    def validate(self, num_rows: int, k: int, n: int) -> None:
        """Raise ValueError when this config cannot run on the given problem."""
        if self.tile_n not in (16, 32, 64):
            # 8 columns: Mosaic finds no SMEM tiling for an [tile_k, 8] bf16 tile.
            raise ValueError(f"dense narrow: tile_n={self.tile_n} must be 16, 32 or 64")
        if self.tile_k not in (64, 128) or k % self.tile_k:
            raise ValueError(f"dense narrow: K={k} must be a multiple of tile_k={self.tile_k}")
        if n % self.tile_n:
            raise ValueError(f"dense narrow: N={n} must be a multiple of tile_n={self.tile_n}")
        if num_rows % ROWS or not num_rows:
            raise ValueError(f"dense narrow: M={num_rows} must be a positive multiple of {ROWS}")
        k_steps = k // self.tile_k
        if not min(2, k_steps) <= self.max_concurrent_steps <= k_steps:
            raise ValueError(
                f"dense narrow: max_concurrent_steps={self.max_concurrent_steps} must be 2 (1 "
                f"for one K step) to the {k_steps} K steps"
            )


def fits_one_wave(num_rows: int, n: int, sms: int) -> bool:
    """Whether the product of num_rows rows and N columns (a multiple of 64) takes at most one
    CTA an SM in 64 x 64 tiles: where this kernel is meant to run."""
    return cdiv(num_rows, ROWS) * (n // 64) <= sms


def default_narrow_config(k: int) -> NarrowConfig:
    """64 columns a CTA (on the H200 at the qwen3_30b, mixtral and dsv3_ep8 routers at 64 and
    256 tokens the fastest or within 5% of it; 16 columns, whose tiles' 32-byte rows the TMA
    reads slowly, 1.5-1.7x slower), 128-wide K steps where K allows, four ring slots (fewer
    when K has fewer steps)."""
    tile_k = 128 if k % 128 == 0 else 64
    return NarrowConfig(tile_n=64, tile_k=tile_k, max_concurrent_steps=min(4, k // tile_k))


def dense_narrow_pallas(
    x: jax.Array, w: jax.Array, *, out_dtype, config: NarrowConfig, interpret=None
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype, fp32 accumulation, for x and w both bf16 or
    both fp16, M a multiple of 64, K of config.tile_k and N of config.tile_n."""
    (num_rows, k), n = x.shape, w.shape[1]
    if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"dense narrow: x must be [M, K] and w [K, N], got {x.shape}, {w.shape}")
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(
            f"dense narrow: x and w must both be bf16 or fp16, got {x.dtype}, {w.dtype}"
        )
    config.validate(num_rows, k, n)
    return _build_kernel(num_rows, k, n, jnp.dtype(out_dtype), config, interpret)(x, w)


@functools.cache
def _build_kernel(num_rows, k, n, out_dtype, config: NarrowConfig, interpret):
    tile_n, tile_k = config.tile_n, config.tile_k
    k_steps = k // tile_k
    # A step's slot is released one step late, so that its wgmma runs while the next one is
    # issued; with a single step, once its wgmma has retired.
    delay = 1 if k_steps > 1 else 0

    def narrow_matmul(x_gmem, w_gmem, out_gmem):
        rows = pl.ds(lax.axis_index("row") * ROWS, ROWS)
        columns = pl.ds(lax.axis_index("column") * tile_n, tile_n)

        def accumulate(acc_ref):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem)
                if not delay:
                    plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((ROWS, tile_k), lambda ki: (0, ki), delay_release=delay),
                    plgpu.BlockSpec((tile_k, tile_n), lambda ki: (ki, 0), delay_release=delay),
                ],
                max_concurrent_steps=config.max_concurrent_steps,
            )(x_gmem.at[rows, :], w_gmem.at[:, columns])
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, tile_n)))

        def store(out_smem):
            out_smem[...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, columns])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(store, plgpu.SMEM((ROWS, tile_n), out_dtype))

    return plgpu.kernel(
        narrow_matmul,
        kernel_name="dense_narrow",
        out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        grid=(num_rows // ROWS, n // tile_n),
        grid_names=("row", "column"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
