"""MXFP8 grouped matmul for decode sizes on Hopper (Pallas Mosaic GPU): few rows per group, each
expert's fp8 weights read once and dequantized in the kernel.

out[m, n] = sum_k lhs[m, k] deq(rhs)[g(m)][n, k] with fp32 accumulation, for bf16 lhs rows (the
dequantized MXFP8 rows: a few KB at decode sizes) and MXFP8 rhs [G, N, K] (the experts' fprop
copies). A wgmma multiplies a 64-row A operand by an N-wide B operand, N as small as 8, so here
the weights are A: each compute warpgroup dequantizes its wg_n weight rows of a 32-wide K block
in registers (fp8 from SMEM, times the block scale, to bf16; with `small_scales`, in integer
PTX, `e4m3_registers.py`) and hands them to the wgmma as A from registers, with the group's
tile_rows lhs rows (SMEM) as B, accumulating out^T [wg_n, tile_rows]. A group with up to
tile_rows rows reads its weights once.

Bits: every output is the same chain of k16 wgmma instructions in ascending K as in the bf16
kernel on the dequantized operands (`Mxfp8Kernel.DEQUANTIZE`), with the operands'
roles swapped; each product is exact, so the hardware's sum of a k16 step should not depend on
which operand is A, and it does not on the H200
(`test_gpu_in_kernel_dequantization_equals_dequantizing_first_bitwise`).

The weights' fp8 tiles and their E8M0 scale bytes come through the same TMA ring, so no
warpgroup waits on a global load. The weights may come as [G, N, K] or in 128 x 128 tiles
(`tile_weights`, as `jaxmoe.mxfp8_inference` stores them: a K step's load is one or two
contiguous pieces, read faster). The work items go to as few CTAs as their count needs
(`DecodeConfig.balance_ctas`), so that no part of the GPU idles while the rest runs the last ones.

The epilogue transposes each warpgroup's out^T tile in SMEM and TMA-stores only the tile's
own rows of out [M, N] (the rows of a group, never another's); the compute warpgroups write
zeros to the rows past the groups.

docs/kernels/decode.md describes the design."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.mxfp8 import BLOCK_SIZE, scale_multipliers
from jaxmoe.ops.device import compiled_for_gpu, num_sms
from jaxmoe.ops.pallas import e4m3_registers, regions
from jaxmoe.ops.pallas.gmm_common import (
    COMPUTE_REGISTERS,
    MEMORY_REGISTERS,
    NUM_COMPUTE_WGS,
    ROW_ALIGN,
    store_rows,
    swizzled,
    zero_accumulator,
)
from jaxmoe.ops.pallas.hopper import MAX_SMEM_PER_CTA, NUM_SMS
from jaxmoe.ops.pallas.tiles import COUNT, GROUP, START, metadata_scope, row_tiles

_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_BF16 = jnp.bfloat16
WEIGHT_TILE = 128  # rows and columns of a weight tile in the tiled layout
LOADS_PER_STEP = 3  # a K step's TMA loads into its ring slot: lhs rows, weights, scale bytes


def can_tile_weights(n: int, k: int) -> bool:
    """Whether [G, N, K] weights have a tiled layout (`tile_weights`)."""
    return n % WEIGHT_TILE == 0 and k % WEIGHT_TILE == 0


def tile_weights(rhs: jax.Array) -> jax.Array:
    """The decode kernel's tiled layout of weights [G, N, K]: [G, N/128, K/128, 128, 128],
    each 128 x 128 tile contiguous (16 KB), so that a K step's TMA load reads whole DRAM pages
    rather than 128-byte pieces of rows K bytes apart. `untile_weights` inverts it."""
    g, n, k = rhs.shape
    if not can_tile_weights(n, k):
        raise ValueError(f"tile_weights: N={n} and K={k} must be multiples of {WEIGHT_TILE}")
    t = WEIGHT_TILE
    return rhs.reshape(g, n // t, t, k // t, t).transpose(0, 1, 3, 2, 4)


def untile_weights(tiled: jax.Array) -> jax.Array:
    """[G, N/128, K/128, 128, 128] -> [G, N, K]: the inverse of `tile_weights`."""
    g, n_tiles, k_tiles, t, _ = tiled.shape
    return tiled.transpose(0, 1, 3, 2, 4).reshape(g, n_tiles * t, k_tiles * t)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel: row tiles of tile_rows lhs rows (the wgmma N, 8 to 256);
    each of the two compute warpgroups owns wg_n weight rows (64 or 128) of a CTA's
    2 * wg_n output columns; K steps of tile_k (a multiple of 64); num_sms as in `GmmConfig`.
    balance_ctas: spread the work items over as few CTAs as the most items a CTA must take
    allows (e.g. 1000 items: 125 CTAs of 8, not 76 of 8 and 56 of 7), so that the last items
    do not run on part of the GPU while the rest idles. None of these change the bits. An op
    given config=None runs `default_decode_config`, the shape heuristic, whose row tiles, wg_n,
    tile_k and ring depth follow the shape; these field defaults are one of its choices, not the
    one for every shape."""

    tile_rows: int = 32
    wg_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    num_sms: int = NUM_SMS
    balance_ctas: bool = True

    @property
    def cta_n(self) -> int:
        return NUM_COMPUTE_WGS * self.wg_n

    def smem_bytes(self, out_dtype) -> int:
        """The TMA ring (bf16 lhs, fp8 rhs, its E8M0 scale bytes) and the epilogue tiles."""
        ring = self.tile_rows * self.tile_k * 2 + self.cta_n * self.tile_k
        ring += self.tile_k // BLOCK_SIZE * self.cta_n
        epilogue = NUM_COMPUTE_WGS * self.wg_n * self.tile_rows * jnp.dtype(out_dtype).itemsize
        return self.max_concurrent_steps * ring + epilogue

    def validate(self, num_rows: int, k: int, n: int, out_dtype, tiled: bool = False) -> None:
        """Raise ValueError when this config cannot run on the given problem (tiled: the
        weights in `tile_weights`' layout)."""
        if tiled and self.tile_k != WEIGHT_TILE:
            raise ValueError(f"gmm decode: tiled weights need tile_k={WEIGHT_TILE}")
        if self.tile_rows % 8 or not 8 <= self.tile_rows <= 256:
            raise ValueError(
                f"gmm decode: tile_rows={self.tile_rows} must be 8..256, a multiple of 8"
            )
        if self.tile_rows * jnp.dtype(out_dtype).itemsize % 16:
            raise ValueError("gmm decode: an output tile row must be a multiple of 16 bytes")
        if self.wg_n not in (64, 128):
            raise ValueError(f"gmm decode: wg_n={self.wg_n} must be 64 or 128")
        if self.tile_k % 64 or k % self.tile_k:
            raise ValueError(f"gmm decode: K={k} must be a multiple of tile_k={self.tile_k} (64k)")
        if n % self.cta_n:
            raise ValueError(f"gmm decode: N={n} must be a multiple of 2 * wg_n = {self.cta_n}")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"gmm decode: max_concurrent_steps={self.max_concurrent_steps}")
        if self.smem_bytes(out_dtype) > MAX_SMEM_PER_CTA:
            raise ValueError(f"gmm decode: {self} needs too much shared memory")
        if num_rows < self.tile_rows or num_rows % ROW_ALIGN:
            raise ValueError(
                f"gmm decode: M={num_rows} must be >= tile_rows and a multiple of {ROW_ALIGN}"
            )


def default_tile_rows(num_rows: int, num_groups: int) -> int:
    """Row tiles in which most groups fit whole, so that they read their weights once: a group
    of the usual size (the mean rows per group plus two standard deviations of a Poisson count)
    starting anywhere in its first 8-row cell (tiles are anchored at the group's start rounded
    down to 8 rows: up to 7 rows more); a power of two, 8 to 128. 8 when groups average at most
    one row (most are empty or single rows)."""
    mean = num_rows / max(num_groups, 1)
    if mean <= 1:
        return 8
    usual = math.ceil(mean + 2 * math.sqrt(mean)) + ROW_ALIGN - 1
    return min(128, max(8, 1 << (usual - 1).bit_length()))


def default_decode_config(
    num_rows: int,
    k: int,
    n: int,
    num_groups: int,
    out_dtype=_BF16,
    tile_rows: int | None = None,
) -> DecodeConfig:
    """Heuristic: row tiles (None: `default_tile_rows`); 128 weight rows
    per warpgroup when N allows and the groups that the rows can reach give at least half the
    SMs a 256-column work item (else 64, twice the items; on the H200 64 won at qwen3_30b T=1,
    128 at mixtral T=64 with 128 items); four ring slots, or as many as shared memory holds
    (the ring runs through all of a CTA's items, so the slots need not divide the K steps)."""
    if tile_rows is None:
        tile_rows = default_tile_rows(num_rows, num_groups)
    sms = num_sms()
    wide_items = min(num_rows, num_groups) * (n // (2 * 128))
    wg_n = 128 if n % 256 == 0 and 2 * wide_items >= sms else 64
    config = DecodeConfig(
        tile_rows=tile_rows,
        wg_n=wg_n,
        tile_k=128 if k % 128 == 0 else 64,
        num_sms=sms,
    )
    steps = config.max_concurrent_steps
    while (
        steps > 1
        and dataclasses.replace(config, max_concurrent_steps=steps).smem_bytes(out_dtype)
        > MAX_SMEM_PER_CTA
    ):
        steps -= 1
    return dataclasses.replace(config, max_concurrent_steps=steps)


def gmm_decode_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype,
    config: DecodeConfig | None = None,
    interpret=None,
    groups_per_weight: int = 1,
    trace: regions.KernelTrace | None = None,
    small_scales: bool = False,
) -> jax.Array:
    """out[m] = lhs[m] @ deq(rhs)[g(m)]^T for bf16 lhs [M, K], float8 rhs [G, N, K] (or the
    same in `tile_weights`' layout, [G, N/128, K/128, 128, 128]: faster to read) and its
    E8M0 block scale bytes rhs_scale [G, K/32, N] (uint8, decoded in the kernel by
    `jaxmoe.mxfp8.scale_multipliers`); rows past sum(group_sizes) are zeros.
    config: None for `default_decode_config`. With groups_per_weight n, rhs holds G / n
    matrices and group g multiplies rhs[g // n]. trace: record the kernel's regions per warpgroup
    with Mosaic's profiler (compute warpgroups: `item`, `step`, within it `wait_data` for the
    ring slot's TMA, `epilogue`; the memory warpgroup: `wait_free` for a slot's release; GPU only;
    benchmarks/decode_trace.py reads them). small_scales: the caller promises e4m3 weights for
    which `e4m3_registers.small_scale_dequantization_is_exact`; on the GPU the kernel then
    dequantizes with `e4m3_registers.dequantize_small_scales` (same bits, fewer instructions)."""
    num_rows, k = lhs.shape
    tiled = rhs.ndim == 5
    if tiled and rhs.shape[2:] != (k // WEIGHT_TILE, WEIGHT_TILE, WEIGHT_TILE):
        raise ValueError(
            f"gmm decode: tiled rhs must be [G, N/128, K/128, 128, 128] with K={k}, got {rhs.shape}"
        )
    if not tiled and (rhs.ndim != 3 or rhs.shape[2] != k):
        raise ValueError(f"gmm decode: rhs must be [G, N, K={k}] or tiled, got {rhs.shape}")
    num_weights, n = rhs.shape[0], rhs.shape[1] * (WEIGHT_TILE if tiled else 1)
    if lhs.dtype != _BF16 or rhs.dtype not in _FP8_DTYPES:
        raise ValueError(
            f"gmm decode: lhs must be bf16 and rhs float8, got {lhs.dtype}, {rhs.dtype}"
        )
    if rhs_scale.shape != (num_weights, k // BLOCK_SIZE, n) or rhs_scale.dtype != jnp.uint8:
        raise ValueError(
            f"gmm decode: rhs_scale must be uint8 [G, K/32, N], got {rhs_scale.shape} "
            f"{rhs_scale.dtype}"
        )
    num_groups = group_sizes.shape[0]
    config = config or default_decode_config(num_rows, k, n, num_groups, out_dtype)
    rows = max(config.tile_rows, cdiv(num_rows, ROW_ALIGN) * ROW_ALIGN)
    padded = jnp.pad(lhs, ((0, rows - num_rows), (0, 0)))
    config.validate(rows, k, n, out_dtype, tiled)
    if small_scales and rhs.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"gmm decode: small_scales needs e4m3 weights, got {rhs.dtype}")
    with metadata_scope(group_sizes):
        tiles = row_tiles(group_sizes, rows, config.tile_rows, ROW_ALIGN, interpret=interpret)
    kernel = _build_kernel(
        rows,
        k,
        n,
        jnp.dtype(out_dtype),
        config,
        interpret,
        trace,
        small_scales and compiled_for_gpu(interpret),
        num_weights,
        groups_per_weight,
        num_groups,
        tiled,
    )
    out = kernel(tiles.bounds, tiles.fields, padded, rhs, rhs_scale)
    return out[:num_rows]


@functools.cache
def _build_kernel(
    num_rows,
    k,
    n,
    out_dtype,
    config: DecodeConfig,
    interpret,
    trace,
    register_route,
    num_weights,
    groups_per_weight,
    num_groups,
    tiled,
):
    tile_rows, wg_n, tile_k, cta_n = config.tile_rows, config.wg_n, config.tile_k, config.cta_n
    num_columns = n // cta_n
    k_steps = k // tile_k
    blocks_per_step = tile_k // BLOCK_SIZE
    scale_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per weight row of a block

    num_slots = config.max_concurrent_steps
    weights_block = (cta_n // WEIGHT_TILE, WEIGHT_TILE, tile_k) if tiled else (cta_n, tile_k)

    def step_weights(rhs_gmem, weight, column, step):
        """The CTA's cta_n weight rows of rhs_gmem, K step `step`."""
        if tiled:
            return rhs_gmem.at[weight, pl.ds(column // WEIGHT_TILE, cta_n // WEIGHT_TILE), step]
        return rhs_gmem.at[weight, pl.ds(column, cta_n), pl.ds(step * tile_k, tile_k)]

    def decode_matmul(
        tile_bounds_gmem,
        tile_fields_gmem,
        lhs_gmem,
        rhs_gmem,
        rhs_scale_gmem,
        out_gmem,
    ):
        # One ring of num_slots K steps through all of a CTA's items (the memory warpgroup
        # loads the next item's first steps while this item's last ones run), for any number
        # of K steps an item.
        @functools.partial(
            pl.run_scoped,
            lhs_ring=plgpu.SMEM(
                (num_slots, tile_rows, tile_k), _BF16, transforms=swizzled(_BF16, BLOCK_SIZE)
            ),
            weights_ring=plgpu.SMEM(
                (num_slots, *weights_block),
                jnp.float8_e4m3fn,
                transforms=swizzled(jnp.float8_e4m3fn, tile_k),
            ),
            scale_ring=plgpu.SMEM((num_slots, blocks_per_step, cta_n), jnp.uint8),
            out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, tile_rows, wg_n), out_dtype),
            # TMA landed (one arrival per operand); slot free (both compute warpgroups).
            produced=plgpu.Barrier(num_arrivals=LOADS_PER_STEP, num_barriers=num_slots),
            consumed=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=num_slots),
            collective_axes="wg",
        )
        def _scope(lhs_ring, weights_ring, scale_ring, out_smem, produced, consumed):
            wg = lax.axis_index("wg")
            sm = lax.axis_index("sm")
            wg_cols = pl.ds(wg * wg_n, wg_n)
            # Work items in row-tile-major order: item i is column tile i % num_columns of row
            # tile i // num_columns, so each item's fields are independent loads.
            matmul_tiles = tile_bounds_gmem[num_groups]
            num_items = matmul_tiles * num_columns
            ctas = config.num_sms
            if config.balance_ctas:
                per_cta = jnp.maximum(cdiv(num_items, config.num_sms), 1)
                ctas = jnp.maximum(cdiv(num_items, per_cta), 1)
            mine = jnp.where(sm < ctas, jnp.maximum(num_items - sm + ctas - 1, 0) // ctas, 0)

            def load_row(first_row):
                """The 8-aligned first row of the lhs window that holds the rows from
                first_row, shifted back near the end of lhs so that it stays in bounds."""
                row = jnp.minimum(first_row - first_row % ROW_ALIGN, num_rows - tile_rows)
                return pl.multiple_of(row, ROW_ALIGN)

            def item_fields(item):
                """(first row, row count, first column) of a work item, read at its start so
                that the epilogue does not wait for global loads."""
                tile = item // num_columns
                first_column = pl.multiple_of(item % num_columns * cta_n, cta_n)
                return tile_fields_gmem[START, tile], tile_fields_gmem[COUNT, tile], first_column

            def memory_warpgroup():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                @pl.loop(0, mine)
                def _item(j):
                    item = sm + j * ctas
                    group = tile_fields_gmem[GROUP, item // num_columns]
                    weight = jnp.minimum(group // groups_per_weight, num_weights - 1)
                    first_row, _, first_column = item_fields(item)
                    rows = pl.ds(load_row(first_row), tile_rows)

                    @pl.loop(0, k_steps)
                    def _step(s):
                        t = j * k_steps + s
                        slot = lax.rem(t, num_slots)

                        @pl.when(t >= num_slots)
                        @regions.named("wait_free")
                        def _wait_free():  # both compute warpgroups are done with t - slots
                            plgpu.barrier_wait(consumed.at[slot])

                        for source, ring in (
                            (lhs_gmem.at[rows, pl.ds(s * tile_k, tile_k)], lhs_ring),
                            (step_weights(rhs_gmem, weight, first_column, s), weights_ring),
                            (
                                rhs_scale_gmem.at[
                                    weight,
                                    pl.ds(s * blocks_per_step, blocks_per_step),
                                    pl.ds(first_column, cta_n),
                                ],
                                scale_ring,
                            ),
                        ):
                            plgpu.copy_gmem_to_smem(source, ring.at[slot], produced.at[slot])

                # Observe the releases of the last slots too (the barriers' phases then match
                # in every warpgroup when they are deallocated).
                total = mine * k_steps

                @pl.loop(jnp.maximum(total - num_slots, 0), total)
                def _quiesce(t):
                    plgpu.barrier_wait(consumed.at[lax.rem(t, num_slots)])

            @regions.named("step")
            def mma(acc_ref, slot):
                # A block's dequantized weights go to its wgmma from registers; the step's
                # wgmmas retire before its TMA slot (their B rows) is released.
                regions.named("wait_data")(plgpu.barrier_wait)(produced.at[slot])
                lhs_smem, rhs_smem = lhs_ring.at[slot], weights_ring.at[slot]
                # The whole step's tile in one load: a 32-wide block cannot be sliced out of
                # the tile's 128-byte swizzle in SMEM, and a narrower swizzle splits the TMA
                # load into boxes of 32-byte rows (18% slower on the H200).
                if not tiled:
                    weights = rhs_smem.at[wg_cols][...]
                elif wg_n == WEIGHT_TILE:
                    weights = rhs_smem.at[wg][...]
                else:
                    weights = rhs_smem.at[0, wg_cols][...]
                for block in range(blocks_per_step):
                    ks = pl.ds(block * BLOCK_SIZE, BLOCK_SIZE)
                    scale_bytes = plgpu.load(
                        scale_ring.at[slot, block, wg_cols], layout=scale_layout, optimized=False
                    )
                    w = weights[:, block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
                    if register_route:
                        words = e4m3_registers.multipliers(scale_bytes)[:, None]
                        w = e4m3_registers.dequantize_small_scales(
                            w, jnp.broadcast_to(words, w.shape)
                        )
                    else:
                        scale = scale_multipliers(scale_bytes)[:, None]
                        w = (w.astype(jnp.float32) * scale).astype(_BF16)
                    plgpu.wgmma(acc_ref, w, lhs_smem.at[:, ks].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])

            @regions.named("epilogue")
            def store(out_t, fields):
                """Write out^T [wg_n, tile_rows] of this warpgroup's columns to the item's rows
                of out: transposed into SMEM, then TMA stores of the item's rows only, so no
                store reaches another group's rows."""
                first_row, count, first_column = fields
                tile_out = out_smem.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                tile_out.transpose((1, 0))[...] = plgpu.layout_cast(
                    out_t.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED
                )
                plgpu.commit_smem()
                store_rows(
                    tile_out,
                    out_gmem,
                    first_row,
                    first_row - load_row(first_row),
                    count,
                    first_column + wg * wg_n,
                    tile_rows,
                    wg_n,
                )

            @regions.named("item")
            def decode_item(j):
                fields = item_fields(sm + j * ctas)

                def scoped(acc_ref):
                    @pl.loop(0, k_steps)
                    def _step(s):
                        mma(acc_ref, lax.rem(j * k_steps + s, num_slots))

                    store(acc_ref[...], fields)

                pl.run_scoped(scoped, plgpu.ACC((wg_n, tile_rows)))

            def compute_warpgroup():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
                pl.loop(0, mine)(decode_item)

                # The rows past the groups: zeros.
                num_zero = (tile_bounds_gmem[num_groups + 1] - matmul_tiles) * num_columns
                mine_zero = jnp.maximum(num_zero - sm + config.num_sms - 1, 0) // config.num_sms

                @pl.loop(0, mine_zero)
                def _each_zero(j):
                    item = num_items + sm + j * config.num_sms
                    store(zero_accumulator(wg_n, tile_rows), item_fields(item))

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            lax.cond(wg == NUM_COMPUTE_WGS, memory_warpgroup, compute_warpgroup)

    return plgpu.kernel(
        decode_matmul,
        kernel_name="gmm_decode",
        out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
        grid=(config.num_sms,),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            **(trace.compiler_params() if trace else {}),
        ),
        interpret=interpret,
    )
