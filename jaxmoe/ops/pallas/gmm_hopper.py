"""Grouped matmul forward / dgrad kernel for Hopper (Pallas Mosaic GPU), bf16/fp16 in, fp32 acc.

out[rows of group g] = lhs[rows of g] @ rhs[g]  (rhs[g] is [K, N], or [N, K] with transpose_rhs).

Structure (warp specialised, persistent):
  * a grid of one CTA per SM walks a list of (row tile, column tile) work items built outside
    the kernel (`tiles.work_list`: tiles with rows first, in a banded order for L2 reuse);
    row tiles come from `tiles.row_tiles` (each tile inside one group, so every output row is
    written once and a row's result never depends on the other groups);
  * optionally (`cluster_n=2`) the CTAs run in clusters of two that take the same row tile and
    adjacent column tiles: each CTA loads half of the lhs tile and TMA-multicasts it to both,
    so the lhs is read from L2 once per cluster;
  * the CTA's consecutive tiles share one software pipeline, so the memory warpgroup already
    loads the next tile while the compute warpgroups finish the current one;
  * per CTA: one memory warpgroup issues TMA loads of lhs / rhs tiles into a ring of
    `max_concurrent_steps` SMEM slots; two compute warpgroups each own half of the CTA tile
    (by default two 64 x 256 tiles stacked along M) and run wgmma into fp32 registers; they
    release each SMEM slot themselves (manual consumed barriers), optionally one step late so
    that a wgmma stays in flight (`overlap_wgmma`);
  * the K loop is a plain ascending loop and each wgmma adds its 16-wide K slice into the
    accumulator in order, so the reduction order of an output element depends only on K: not on
    the config, the group sizes, M or the row's position (batch invariance);
  * epilogue (per column chunk, through one or two SMEM slots per warpgroup): cast, SMEM, then
    TMA stores of exactly the tile's valid rows (a ladder of power-of-two row counts, since TMA
    boxes are static) that drain during the next chunk or tile. Tiles of the zero region store
    zeros.
No atomics; every output element is written by exactly one tile.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ops.pallas.tiles import row_tiles, work_list

HOPPER_NUM_SMS = 132      # H100/H200 SXM
INTERPRET_NUM_SMS = 4     # persistent-grid size when not on a GPU (CPU interpret mode)
NUM_COMPUTE_WGS = 2
ROW_ALIGN = 8   # TMA loads into swizzled SMEM tiles need row offsets that are multiples of 8
SMEM_BUDGET = 227 * 1024   # bytes of shared memory per CTA on sm_90, minus barrier headroom
TMA_SMEM_ALIGN = 128       # bytes: alignment of an SMEM address used by a TMA copy
SCALE_BLOCK = 32           # MXFP8: elements along K sharing one scale


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Tiling of the forward/dgrad kernel. Each compute warpgroup owns tile_m x tile_n outputs;
    the two warpgroups of a CTA sit side by side along N (wg_split="n": CTA tile
    tile_m x 2*tile_n) or along M (wg_split="m": 2*tile_m x tile_n). overlap_wgmma keeps a K
    step's wgmma running while the next one is issued (its SMEM slot is released one step
    late; bf16 kernel, max_concurrent_steps >= 2 only). epilogue_slots=2 double-buffers the
    epilogue's SMEM tile, so a column chunk is written while the previous one is stored. None of
    these change the K-reduction order. cluster_n=2 pairs the CTAs along N (see the module
    docstring); the work items then cover column-tile pairs. (Pairing them along M instead, to
    multicast the larger rhs tile as CUTLASS does, with a group's odd last tile split between
    the two CTAs, gave the same bits but ran 2-10% slower on the H200: its L2 hit rate fell
    from 66% to 38% and DRAM traffic rose from 38% to 61% of peak at dsv3_ep8, so the kernel
    became memory-bound (benchmarks/results/gmm_2026-11-30_cluster_m_experiment.json,
    profiles/ncu_dsv3_ep8_fwd_pallas_rhs_multicast_*.txt).)"""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4
    epilogue_tile_n: int = 64
    wg_split: str = "n"
    overlap_wgmma: bool = False
    epilogue_slots: int = 1
    cluster_n: int = 1
    num_sms: int = HOPPER_NUM_SMS

    @property
    def cta_m(self) -> int:
        return self.tile_m * (NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)

    def smem_bytes(self, in_dtype, out_dtype) -> int:
        """Shared memory used: the TMA ring of lhs/rhs tiles plus the epilogue tiles of both
        compute warpgroups."""
        ring = (self.cta_m + self.cta_n) * self.tile_k * jnp.dtype(in_dtype).itemsize
        epilogue = NUM_COMPUTE_WGS * self.epilogue_slots * self.tile_m * self.epilogue_tile_n
        return self.max_concurrent_steps * ring + epilogue * jnp.dtype(out_dtype).itemsize

    def validate(self, num_rows: int, k: int, n: int, in_dtype=jnp.bfloat16,
                 out_dtype=jnp.bfloat16, transpose_rhs: bool = False) -> None:
        """Raise ValueError when this config cannot run on the given problem."""
        if self.smem_bytes(in_dtype, out_dtype) > SMEM_BUDGET:
            raise ValueError(f"gmm pallas: {self} needs {self.smem_bytes(in_dtype, out_dtype)} "
                             f"bytes of shared memory (> {SMEM_BUDGET}); use fewer "
                             "max_concurrent_steps or smaller tiles")
        if self.wg_split not in ("n", "m"):
            raise ValueError(f"gmm pallas: wg_split must be 'n' or 'm', got {self.wg_split!r}")
        if self.tile_k % 64:
            raise ValueError(f"gmm pallas: tile_k={self.tile_k} must be a multiple of 64")
        if self.tile_m not in (64, 128) or self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"gmm pallas: unsupported tiles {self}")
        if self.wg_split == "n" and not transpose_rhs and self.tile_n % 64:
            # Each warpgroup slices its columns out of a 128-byte-swizzled rhs tile.
            raise ValueError(f"gmm pallas: wg_split='n' needs tile_n % 64 == 0, got {self.tile_n}")
        if k % self.tile_k:
            raise ValueError(f"gmm pallas: K={k} must be a multiple of tile_k={self.tile_k}")
        if self.max_concurrent_steps > k // self.tile_k:
            raise ValueError(f"gmm pallas: max_concurrent_steps={self.max_concurrent_steps} "
                             f"exceeds the {k // self.tile_k} K steps")
        if self.cluster_n not in (1, 2) or self.num_sms % self.cluster_n:
            raise ValueError(f"gmm pallas: cluster_n={self.cluster_n} must be 1 or 2 and divide "
                             f"num_sms={self.num_sms}")
        if n % (self.cta_n * self.cluster_n):
            raise ValueError(f"gmm pallas: N={n} must be a multiple of the CTA tile {self.cta_n}"
                             f" times cluster_n={self.cluster_n}")
        if self.tile_n % self.epilogue_tile_n:
            raise ValueError(f"gmm pallas: tile_n={self.tile_n} must be a multiple of "
                             f"epilogue_tile_n={self.epilogue_tile_n}")
        if self.epilogue_slots not in (1, 2) or (self.epilogue_slots == 2 and (
                self.tile_n // self.epilogue_tile_n) % 2):
            # The slots alternate chunk by chunk across tiles, so that the newest store always
            # reads the other slot: a tile must have an even number of chunks.
            raise ValueError(f"gmm pallas: epilogue_slots={self.epilogue_slots} needs 1, or 2 "
                             f"with an even number of epilogue chunks per tile")
        if self.epilogue_tile_n * jnp.dtype(out_dtype).itemsize % TMA_SMEM_ALIGN:
            # The epilogue stores start at any row of the SMEM tile: rows must be 128-byte
            # multiples for TMA (the CPU interpreter does not check this; the GPU faults).
            raise ValueError(f"gmm pallas: epilogue_tile_n={self.epilogue_tile_n} x "
                             f"{jnp.dtype(out_dtype).name} is not a multiple of "
                             f"{TMA_SMEM_ALIGN} bytes")
        if num_rows < self.cta_m or num_rows % ROW_ALIGN:
            raise ValueError(f"gmm pallas: M={num_rows} must be >= {self.cta_m} and a "
                             f"multiple of {ROW_ALIGN}")


def default_num_sms() -> int:
    """SM count of the GPU (the persistent grid size), or a small grid in CPU interpret mode.
    Never reads core_count from a CPU device."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else INTERPRET_NUM_SMS


def default_config(num_rows: int, k: int, n: int, num_groups: int, in_dtype=jnp.bfloat16,
                   out_dtype=jnp.bfloat16) -> GmmConfig:
    """Shape-based heuristic (benchmarks/results/gmm_*_sweep.json has the sweep behind it): a
    128 x 256 CTA tile of two 64 x 256 warpgroup tiles stacked along M with a double-buffered
    epilogue when N is a multiple of 256, else warpgroups along M with the widest column tile
    dividing N; as many pipeline stages (up to 4) as shared memory holds."""
    if k % 64 or n % 64:
        raise ValueError(f"gmm pallas: K={k} and N={n} must be multiples of 64")
    epilogue_tile_n = TMA_SMEM_ALIGN // jnp.dtype(out_dtype).itemsize
    if n % 256 == 0:
        # Wider snake bands pay off when many groups share each column band (sweep: +3%).
        config = GmmConfig(tile_m=64, tile_n=256, wg_split="m", epilogue_slots=2,
                           grid_tile_width=8 if num_groups >= 32 else 4)
    else:
        tile_n = 128 if n % 128 == 0 else 64
        config = GmmConfig(tile_m=64 if num_rows < 256 else 128, tile_n=tile_n, wg_split="m")
    config = dataclasses.replace(config, num_sms=default_num_sms(),
                                 epilogue_tile_n=min(epilogue_tile_n, config.tile_n),
                                 max_concurrent_steps=min(config.max_concurrent_steps,
                                                          k // config.tile_k))
    while config.smem_bytes(in_dtype, out_dtype) > SMEM_BUDGET:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def default_mxfp8_config(num_rows: int, k: int, n: int, num_groups: int,
                         out_dtype=jnp.bfloat16) -> GmmConfig:
    """Heuristic for the MXFP8 kernel: the fp32 accumulator and one block product live in
    registers together, so each warpgroup owns 64 x 128 outputs (CTA 64 x 256, or 128 x 128
    along M for narrow N); 128-wide K steps (one 128-byte swizzled row of fp8)."""
    if k % 128 or n % 128:
        raise ValueError(f"gmm pallas mxfp8: K={k} and N={n} must be multiples of 128")
    split = "n" if n % 256 == 0 else "m"
    config = GmmConfig(tile_m=64, tile_n=128, tile_k=128, wg_split=split,
                       max_concurrent_steps=min(6, k // 128),
                       grid_tile_width=8 if num_groups >= 32 else 4,
                       epilogue_tile_n=TMA_SMEM_ALIGN // jnp.dtype(out_dtype).itemsize,
                       num_sms=default_num_sms())
    while config.smem_bytes(jnp.float8_e4m3fn, out_dtype) > SMEM_BUDGET:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


def gmm_mxfp8_pallas(lhs: jax.Array, lhs_scale: jax.Array, rhs: jax.Array, rhs_scale: jax.Array,
                     group_sizes: jax.Array, *, out_dtype, config: GmmConfig | None = None,
                     interpret=None) -> jax.Array:
    """MXFP8 grouped matmul on Hopper: out[m] = sum_k deq(lhs)[m, k] deq(rhs)[g(m)][n, k], fp32
    accumulation. Hopper's fp8 wgmma needs both operands K-major, so rhs is [G, N, K].

    lhs [M, K] and rhs [G, N, K]: float8_e4m3fn / float8_e5m2 elements.
    lhs_scale [K/32, M] and rhs_scale [G, K/32, N]: the decoded fp32 block scales 2^(e-127),
      transposed so that a K block's scales for a row tile are contiguous.
    Same tiling, schedule, zero rows and batch-invariance properties as `gmm_pallas`."""
    num_rows, k = lhs.shape
    num_groups, n, _ = rhs.shape
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    if lhs.dtype not in fp8 or rhs.dtype not in fp8:
        raise ValueError(f"gmm pallas mxfp8: operands must be float8, got {lhs.dtype}, {rhs.dtype}")
    if (lhs_scale.shape != (k // SCALE_BLOCK, num_rows)
            or rhs_scale.shape != (num_groups, k // SCALE_BLOCK, n)
            or lhs_scale.dtype != jnp.float32 or rhs_scale.dtype != jnp.float32):
        raise ValueError(f"gmm pallas mxfp8: scales must be fp32 [K/32, M] and [G, K/32, N], got "
                         f"{lhs_scale.shape} {lhs_scale.dtype} and {rhs_scale.shape} "
                         f"{rhs_scale.dtype}")
    config = config or default_mxfp8_config(num_rows, k, n, num_groups, out_dtype)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype, transpose_rhs=True)
    tiles = row_tiles(group_sizes, num_rows, config.cta_m, ROW_ALIGN)
    work = work_list(tiles, n // (config.cta_n * config.cluster_n), config.grid_tile_width)
    kernel = _build_kernel(num_rows, k, n, num_groups, work.num_items, lhs.dtype,
                           jnp.dtype(out_dtype), True, config, interpret, scaled=True)
    return kernel(work.counts, work.tile, work.column, tiles.group, tiles.row, tiles.rows,
                  lhs, rhs, lhs_scale, rhs_scale)


def _swizzled(dtype, minor_elems: int):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def gmm_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool,
               out_dtype, config: GmmConfig | None = None, interpret=None) -> jax.Array:
    """The kernel behind `jaxmoe.ops.gmm(impl="pallas")`; see the module docstring."""
    num_rows, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"gmm pallas: lhs and rhs must both be bf16 or fp16, got {lhs.dtype}, "
                         f"{rhs.dtype}")
    config = config or default_config(num_rows, k, n, num_groups, lhs.dtype, out_dtype)
    config.validate(num_rows, k, n, lhs.dtype, out_dtype, transpose_rhs)
    tiles = row_tiles(group_sizes, num_rows, config.cta_m, ROW_ALIGN)
    work = work_list(tiles, n // (config.cta_n * config.cluster_n), config.grid_tile_width)
    kernel = _build_kernel(num_rows, k, n, num_groups, work.num_items, lhs.dtype,
                           jnp.dtype(out_dtype), transpose_rhs, config, interpret)
    return kernel(work.counts, work.tile, work.column, tiles.group, tiles.row, tiles.rows,
                  lhs, rhs)


@functools.lru_cache(maxsize=None)
def _build_kernel(num_rows, k, n, num_groups, num_items, dtype, out_dtype, transpose_rhs,
                  config: GmmConfig, interpret, scaled=False):
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n, epi_n = config.cta_m, config.cta_n, config.epilogue_tile_n
    split_m = config.wg_split == "m"
    num_clusters = config.num_sms // config.cluster_n
    k_steps = k // tile_k
    # MXFP8 tiles are sliced into 32-wide K blocks (32 bytes of fp8), so they are tiled and
    # swizzled at that width.
    in_transforms = _swizzled(dtype, SCALE_BLOCK if scaled else tile_k)
    # Consecutive tiles of one CTA can share one pipeline (the memory warpgroup prefetches the
    # next tile while the compute warpgroups run the epilogue) when the K steps divide evenly.
    chained = k_steps % config.max_concurrent_steps == 0
    # SMEM slots are released by the compute warpgroups themselves (manual consumed barriers):
    # with overlap_wgmma a step's slot is released once the next step's wgmma is issued and
    # this one has retired, which the pipeline's own delay_release cannot do across chained
    # pipelines.
    num_slots = config.max_concurrent_steps
    release_delay = 1 if config.overlap_wgmma and not scaled and num_slots > 1 else 0

    def body(counts_gmem, work_tile_gmem, work_column_gmem, tile_group_gmem, tile_row_gmem,
             tile_rows_gmem, lhs_gmem, rhs_gmem, *scale_and_out_gmem):
        # Scaled (MXFP8): lhs_scale [K/32, M] and rhs_scale [G, K/32, N] stay in GMEM (L2);
        # the compute warpgroups read their rows' and columns' scales straight into registers.
        # (Measured on the H200: 2x faster than passing them through the TMA ring, whose SMEM
        # reads in the row/column layouts plus the proxy fence they need cost more.)
        *scale_gmem, out_gmem = scale_and_out_gmem

        def pipeline(mma_body, compute_context, state=None):
            rhs_block = (cta_n, tile_k) if transpose_rhs else (tile_k, cta_n)
            return plgpu.emit_pipeline_warp_specialized(
                mma_body,
                grid=(k_steps,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((cta_m, tile_k), lambda ki: (0, ki),
                                    transforms=in_transforms, memory_space=plgpu.SMEM,
                                    collective_axes=("cluster",) if config.cluster_n > 1
                                    else ()),
                    plgpu.BlockSpec(rhs_block,
                                    (lambda ki: (0, ki)) if transpose_rhs
                                    else (lambda ki: (ki, 0)),
                                    transforms=in_transforms, memory_space=plgpu.SMEM),
                ],
                wg_axis="wg",
                num_compute_wgs=NUM_COMPUTE_WGS,
                max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context,
                pipeline_state=state,
                manual_consumed_barriers=True,
            )

        ignore = lambda *_, **__: None
        lhs_view = lhs_gmem.at[pl.ds(0, cta_m), :]
        rhs_view = (rhs_gmem.at[0, pl.ds(0, cta_n), :] if transpose_rhs
                    else rhs_gmem.at[0, :, pl.ds(0, cta_n)])

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(lhs_view, rhs_view),
            out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, config.epilogue_slots, tile_m, epi_n),
                                out_dtype),
            collective_axes="wg",
        )
        def _scope(allocations, out_smem):
            wg = lax.axis_index("wg")
            cluster = lax.axis_index("sm")        # one cluster of cluster_n CTAs per work lane
            cta_in_cluster = lax.axis_index("cluster")

            def release(step):
                """Tell the memory warpgroup that K step `step`'s SMEM slot may be refilled."""
                for barrier in allocations["flat_consumed_barrier_refs"]:
                    plgpu.barrier_arrive(barrier.at[lax.rem(step, num_slots)])

            def pipeline_step(mma):
                """The pipeline body: `mma` on this step's tiles, then the slot releases."""
                def step_body(step, lhs_smem, rhs_smem, _lhs_consumed, _rhs_consumed, carry,
                              *scales):
                    carry = mma(step, lhs_smem, rhs_smem, carry, *scales)
                    if release_delay:
                        plgpu.wgmma_wait(1)      # the previous step's wgmma has retired

                        @pl.when(step[0] > 0)
                        def _():
                            release(step[0] - 1)
                    else:
                        release(step[0])
                    return carry
                return step_body

            def finish_pipeline():
                """After a tile's last K step: its wgmma retired, its slot released."""
                if release_delay:
                    plgpu.wgmma_wait(0)
                    release(k_steps - 1)

            def tile_geometry(item):
                """Metadata of work item `item`, and this warpgroup's share of its rows."""
                tile = work_tile_gmem[item]
                first_row = tile_row_gmem[tile]
                valid_rows = tile_rows_gmem[tile]
                # Load cta_m rows from the 8-aligned row at or below the tile's first row; near
                # the end of lhs, shift the window back so it stays in bounds. The valid rows
                # are rows [offset, offset + valid_rows) of the window.
                load_row = pl.multiple_of(
                    jnp.minimum(first_row - first_row % ROW_ALIGN, num_rows - cta_m), ROW_ALIGN)
                offset = first_row - load_row
                wg_row = wg * tile_m if split_m else 0
                lo = jnp.maximum(offset, wg_row)
                count = jnp.clip(jnp.minimum(offset + valid_rows, wg_row + tile_m) - lo, 0,
                                 tile_m)
                column = (work_column_gmem[item] * config.cluster_n + cta_in_cluster) * cta_n
                return dict(tile=tile, load_row=load_row, gmem_row=first_row + lo - offset,
                            smem_row=lo - wg_row, count=count, column=column,
                            wg_column=column + (0 if split_m else wg * tile_n))

            def store(acc, geo):
                # A slot is refilled once the TMA stores that read it are done. Slots alternate
                # chunk by chunk (an even number per tile) and a warpgroup with no rows in the
                # tile skips it, so the newest store group always reads the other slot and
                # waiting for all but `slots - 1` groups suffices, however many stores the row
                # ladder issued. The last chunks' stores drain while the next tile's main loop
                # runs.
                slots = config.epilogue_slots

                @pl.when(geo["count"] > 0)
                def _():
                    for chunk in range(tile_n // epi_n):
                        slot = out_smem.at[wg, chunk % slots]
                        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                        slot[...] = acc[:, chunk * epi_n:(chunk + 1) * epi_n].astype(out_dtype)
                        plgpu.commit_smem()
                        _store_rows(slot, out_gmem, geo["gmem_row"], geo["smem_row"],
                                    geo["count"], geo["wg_column"] + chunk * epi_n, tile_m,
                                    epi_n)

            wg_rows = pl.ds(wg * tile_m, tile_m) if split_m else pl.ds(0, tile_m)
            wg_cols = pl.ds(0, tile_n) if split_m else pl.ds(wg * tile_n, tile_n)

            def operands(lhs_smem, rhs_smem):
                """This warpgroup's lhs [tile_m, tile_k] and rhs [tile_k, tile_n] SMEM views."""
                b = (rhs_smem.at[wg_cols, :].transpose((1, 0)) if transpose_rhs
                     else rhs_smem.at[:, wg_cols])
                return lhs_smem.at[wg_rows, :], b

            def mma_body(_, lhs_smem, rhs_smem, acc_ref):
                # Both warpgroups multiply even where one has no valid rows (the second half of
                # a group's last tile): skipping that wgmma under a condition made the dsv3
                # forward 10% slower on the H200
                # (benchmarks/results/gmm_2026-11-29_wg_skip_experiment.json).
                a, b = operands(lhs_smem, rhs_smem)
                plgpu.wgmma(acc_ref, a, b)
                if not release_delay:
                    plgpu.wgmma_wait(0)
                return acc_ref

            def scaled_mma_body(step, lhs_smem, rhs_smem, acc, lhs_scale_gmem, rhs_scale_gmem):
                # MXFP8: one fp8 wgmma per 32-wide K block into a fresh accumulator, then
                # acc += partial * (lhs scale of the row * rhs scale of the column). The scales
                # are powers of two, so the product and the scaling are exact and acc sees one
                # fp32 rounding per block, in ascending K order.
                a, b = operands(lhs_smem, rhs_smem)
                for block in range(tile_k // SCALE_BLOCK):
                    ks = pl.ds(block * SCALE_BLOCK, SCALE_BLOCK)

                    def block_product(part_ref):
                        plgpu.wgmma(part_ref, a.at[:, ks], b.at[ks, :])
                        plgpu.wgmma_wait(0)
                        return part_ref[...]

                    part = pl.run_scoped(block_product, plgpu.ACC((tile_m, tile_n)))
                    kb = step[0] * (tile_k // SCALE_BLOCK) + block
                    row_scale = plgpu.load(lhs_scale_gmem.at[kb, wg_rows],
                                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                    col_scale = plgpu.load(rhs_scale_gmem.at[kb, wg_cols],
                                           layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                    acc = acc + part * (row_scale[:, None] * col_scale[None, :])
                return acc

            def zero_acc():
                return plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32),
                                         plgpu.Layout.WGMMA)

            def matmul_item(item, state):
                geo = tile_geometry(item)
                group = tile_group_gmem[geo["tile"]]

                def compute_context(eval_pipeline):
                    if scaled:
                        store(eval_pipeline(zero_acc()), geo)
                        return

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n)))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        finish_pipeline()
                        store(acc_ref[...], geo)

                rhs_group = rhs_gmem.at[group]
                m_slice = pl.ds(geo["load_row"], cta_m)
                n_slice = pl.ds(geo["column"], cta_n)
                rhs_tile = rhs_group.at[n_slice, :] if transpose_rhs else rhs_group.at[:, n_slice]
                scale_tiles = ([scale_gmem[0].at[:, m_slice], scale_gmem[1].at[group, :, n_slice]]
                               if scaled else [])
                body_fn = (functools.partial(_with_scales, pipeline_step(scaled_mma_body),
                                             *scale_tiles) if scaled
                           else pipeline_step(mma_body))
                pipeline(body_fn, compute_context, state)(
                    lhs_gmem.at[m_slice, :], rhs_tile, allocations=allocations)

            # Work items are [matmul items | zero-region items]; this CTA's cluster takes every
            # num_clusters-th item of each list.
            num_matmul, num_zero = counts_gmem[0], counts_gmem[1]
            mine = jnp.maximum(num_matmul - cluster + num_clusters - 1, 0) // num_clusters
            item_of = lambda j: cluster + j * num_clusters
            states = plgpu.PipelinePipeline

            if chained:
                @pl.when(mine == 1)
                def _single():
                    matmul_item(item_of(0), None)

                @pl.when(mine > 1)
                def _chain():
                    matmul_item(item_of(0), states.START)

                    @pl.loop(1, mine - 1)
                    def _steady(j):
                        matmul_item(item_of(j), states.STEADY)

                    matmul_item(item_of(mine - 1), states.STOP)
            else:
                @pl.loop(0, mine)
                def _each(j):
                    matmul_item(item_of(j), None)

            mine_zero = jnp.maximum(num_zero - cluster + num_clusters - 1, 0) // num_clusters

            @pl.when(wg < NUM_COMPUTE_WGS)
            def _zero_region():
                @pl.loop(0, mine_zero)
                def _each_zero(j):
                    store(zero_acc(), tile_geometry(num_matmul + item_of(j)))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        kernel_name="gmm_mxfp8" if scaled else "gmm",
        out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        grid=(num_clusters,),
        grid_names=("sm",),
        cluster=(config.cluster_n,),
        cluster_names=("cluster",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    return kernel


def _with_scales(body, lhs_scale, rhs_scale, *args):
    """`body` with the GMEM scale views of the current tile appended to the pipeline's args."""
    return body(*args, lhs_scale, rhs_scale)


def _store_rows(tile_smem, out_gmem, gmem_row, smem_row, count, col, tile_m, tile_n):
    """TMA-store `count` rows of the SMEM tile, from smem_row, to out rows from gmem_row. TMA
    boxes have static shapes, so the count is written as a sum of powers of two, one
    conditional store per bit (each to a distinct row range)."""
    done = jnp.int32(0)
    for bit in reversed(range(int(math.log2(tile_m)) + 1)):
        size = 1 << bit
        take = (count & size) != 0

        @pl.when(take)
        def _():
            plgpu.copy_smem_to_gmem(
                tile_smem.at[pl.ds(smem_row + done, size)],
                out_gmem.at[pl.ds(gmem_row + done, size), pl.ds(col, tile_n)])

        done = done + jnp.where(take, size, 0)
