"""FP8-blockwise weight-gradient kernel for Hopper (Pallas Mosaic GPU): the wgrad of Transformer
Engine's `Float8BlockScaling` recipe,
out[g] = sum over g's 128-row blocks b, in order, of P_b * (lhs_scale[b, k] * rhs_scale[b, n]),
P_b = lhs_t[:, b]  @ rhs_t[:, b]^T the block's fp8 product (one wgmma into a fresh accumulator),
fp32 accumulation; `jaxmoe.fp8_blockwise.tgmm_reference`'s arithmetic.

Hopper's fp8 wgmma reads both operands K-major, and here K is the tokens: the operands are the
transposed copies lhs_t [K, M] and rhs_t [N, M] (1 x 128 blocks along M). Every group starts on
a 128-row block (the plan pads each expert's rows), so a block belongs to one group and is read
whole.

Persistent and warp specialised: a memory warpgroup walks the CTA's work items (group, K tile,
N tile) and TMA-loads each item's blocks, with their rows of scales, into a ring that runs
across items (a slot holds `blocks_per_step` blocks); two compute warpgroups (stacked along K,
or side by side along N) multiply, fold and store. An empty group's tiles are zeros.
docs/kernels/fp8_gemm.md describes the design and what was measured."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.ops.device import num_sms
from jaxmoe.ops.pallas.gmm_common import (
    COMPUTE_REGISTERS,
    MEMORY_REGISTERS,
    NUM_COMPUTE_WGS,
    swizzled,
)
from jaxmoe.ops.pallas.hopper import L2_BYTES, MAX_SMEM_PER_CTA
from jaxmoe.ops.pallas.tiles import banded_item

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class BlockwiseTgmmConfig:
    """Tiling: each compute warpgroup owns tile_k x tile_n outputs, the two side by side along
    N (wg_split "n": CTA tile tile_k x 2 * tile_n) or along K ("k": 2 * tile_k x tile_n);
    `slots` ring slots of `blocks_per_step` (1 or 2) 128-row blocks of both operands and
    their scales; the epilogue stores epilogue_n columns at a time. cluster_n=2 pairs the CTAs
    along N: the two CTAs of a cluster take the same group and K tile and adjacent N tiles, and
    multicast the lhs tile (half its L2 reads). grid_tile_width (0: all of N) orders each
    group's items in bands of that many N tiles (of a cluster's width), K tiles ascending within
    a band (`tiles.banded_item`): CTAs running side by side then share a band's few rhs tiles
    and sweep the group's lhs tiles, rather than sweeping all of N's rhs tiles for each K tile.
    scales="ring" loads each block's rows of scales into the ring slot with its operands (TMA;
    the compute warpgroups read them from SMEM); "l2" leaves them out of the ring: each compute
    warpgroup loads its rows and columns of a block's scales from GMEM (L2) into registers one
    block ahead, the next item's first block during an item's last (the items of empty groups
    then go last). None of these change the bits."""

    tile_k: int = 64
    tile_n: int = 128
    slots: int = 4
    epilogue_n: int = 64
    num_sms: int = 132
    wg_split: str = "k"
    blocks_per_step: int = 2
    cluster_n: int = 1
    grid_tile_width: int = 0
    scales: str = "ring"

    @property
    def cta_k(self) -> int:
        return self.tile_k * (NUM_COMPUTE_WGS if self.wg_split == "k" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)

    def smem_bytes(self, out_dtype) -> int:
        # fp8 operands (a byte an element) and, in the ring, their fp32 scale rows
        row_bytes = BLOCK + (4 if self.scales == "ring" else 0)
        ring = self.slots * self.blocks_per_step * (self.cta_k + self.cta_n) * row_bytes
        epilogue = NUM_COMPUTE_WGS * self.tile_k * self.epilogue_n * jnp.dtype(out_dtype).itemsize
        return ring + epilogue

    def with_fitting_slots(self, out_dtype) -> BlockwiseTgmmConfig:
        """This tiling with as many of its ring slots as fit a CTA's shared memory."""
        config = self
        while config.slots > 2 and config.smem_bytes(out_dtype) > MAX_SMEM_PER_CTA:
            config = dataclasses.replace(config, slots=config.slots - 1)
        return config

    def validate(self, k: int, n: int, out_dtype) -> None:
        if self.tile_k not in (64, 128) or self.tile_n % 64 or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tgmm fp8 blockwise: unsupported tiles {self}")
        if self.blocks_per_step not in (1, 2):
            raise ValueError(
                f"tgmm fp8 blockwise: blocks_per_step must be 1 or 2, got {self.blocks_per_step}"
            )
        if self.wg_split not in ("n", "k"):
            raise ValueError(
                f"tgmm fp8 blockwise: wg_split must be 'n' or 'k', got {self.wg_split!r}"
            )
        if self.scales not in ("ring", "l2"):
            raise ValueError(
                f"tgmm fp8 blockwise: scales must be 'ring' or 'l2', got {self.scales!r}"
            )
        if self.grid_tile_width < 0:
            raise ValueError(
                f"tgmm fp8 blockwise: grid_tile_width={self.grid_tile_width} must be >= 0"
            )
        if self.cluster_n not in (1, 2) or self.num_sms % self.cluster_n:
            raise ValueError(
                f"tgmm fp8 blockwise: cluster_n={self.cluster_n} must be 1 or 2 and divide "
                f"num_sms={self.num_sms}"
            )
        if k % self.cta_k or n % (self.cta_n * self.cluster_n):
            raise ValueError(
                f"tgmm fp8 blockwise: K={k} must be a multiple of the CTA tile's {self.cta_k} "
                f"rows and N={n} of its {self.cta_n} columns times cluster_n={self.cluster_n}"
            )
        if self.tile_n % self.epilogue_n or self.epilogue_n * jnp.dtype(out_dtype).itemsize % 128:
            raise ValueError(
                f"tgmm fp8 blockwise: epilogue_n={self.epilogue_n} must divide tile_n and "
                "make 128-byte rows"
            )
        if self.slots < 2 or self.smem_bytes(out_dtype) > MAX_SMEM_PER_CTA:
            raise ValueError(f"tgmm fp8 blockwise: {self} does not fit a CTA's shared memory")


def default_config(
    k: int, n: int, out_dtype=jnp.float32, rows_per_group: int = 0
) -> BlockwiseTgmmConfig:
    """64 x 128 outputs per warpgroup (its fp32 accumulator and one block product fit in
    registers together, as in the forward kernel), the two warpgroups stacked along K when K
    allows (CTA 128 x 128: both operand tiles the same size, as the forward's heuristic), else
    side by side along N (CTA 64 x 256, or 64 x 128 for narrow N); two blocks a ring slot, as
    many slots as fit; the scales' rows in the SMEM ring (not read from L2), stacking along K
    and two blocks a slot each made it faster (the kernel experiments in docs/notes/).
    Items in bands of 4 N tiles when a group's rhs copy (N x rows_per_group fp8 bytes, the mean
    group) is more than half the L2: each K tile would otherwise sweep all of it from HBM again;
    shapes whose groups fit gain nothing from bands. CTA pairs where the SM count and N allow:
    faster than the unpaired kernel at every shape tried."""
    out_dtype = jnp.dtype(out_dtype)
    if k % 128 == 0:
        config = BlockwiseTgmmConfig(tile_n=128, wg_split="k")
    else:
        config = BlockwiseTgmmConfig(tile_n=128 if n % 256 == 0 else 64, wg_split="n")
    banded = n * rows_per_group > L2_BYTES // 2
    sms = num_sms()
    paired = sms % 2 == 0 and n % (2 * config.cta_n) == 0
    config = dataclasses.replace(
        config,
        epilogue_n=128 // out_dtype.itemsize,
        num_sms=sms,
        cluster_n=2 if paired else 1,
        grid_tile_width=4 if banded else 0,
    )
    return config.with_fitting_slots(out_dtype)


def problem(k: int, n: int) -> str | None:
    """Why the kernel cannot take K x N outputs (None: it can)."""
    if k % 64 or n % 128:
        return f"K={k} must be a multiple of 64 and N={n} of 128 for the fp8 blockwise wgrad kernel"
    return None


def tgmm_fp8_blockwise_pallas(
    lhs_t: jax.Array,
    lhs_scale: jax.Array,
    rhs_t: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.float32,
    config: BlockwiseTgmmConfig | None = None,
    interpret=None,
) -> jax.Array:
    """out [G, K, N] (module docstring) of lhs_t [K, M] and rhs_t [N, M] float8 (the transposed
    1 x 128-along-M copies) with lhs_scale [M/128, K] and rhs_scale [M/128, N] fp32
    multipliers; group_sizes [G] multiples of 128 (not checked here: traced), their sum <= M;
    M a multiple of 128."""
    (k, m), (n, m_rhs) = lhs_t.shape, rhs_t.shape
    if (
        jnp.dtype(lhs_t.dtype) not in _FP8_DTYPES
        or jnp.dtype(rhs_t.dtype) not in _FP8_DTYPES
        or m != m_rhs
        or m % BLOCK
        or lhs_scale.shape != (m // BLOCK, k)
        or rhs_scale.shape != (m // BLOCK, n)
        or lhs_scale.dtype != jnp.float32
        or rhs_scale.dtype != jnp.float32
    ):
        raise ValueError(
            "tgmm fp8 blockwise: lhs_t [K, M] and rhs_t [N, M] float8 with M a multiple of "
            f"{BLOCK}, scales fp32 [M/{BLOCK}, K] and [M/{BLOCK}, N]; got {lhs_t.shape} "
            f"{lhs_t.dtype}, {rhs_t.shape} {rhs_t.dtype}, {lhs_scale.shape} {lhs_scale.dtype}, "
            f"{rhs_scale.shape} {rhs_scale.dtype}"
        )
    if problem(k, n):
        raise ValueError(problem(k, n))
    out_dtype = jnp.dtype(out_dtype)
    num_groups = group_sizes.shape[0]
    config = config or default_config(k, n, out_dtype, rows_per_group=m // max(num_groups, 1))
    config.validate(k, n, out_dtype)
    sizes = group_sizes.astype(jnp.int32)
    first_block = (jnp.cumsum(sizes) - sizes) // BLOCK
    # The groups in the order of their items: with scales="l2" the empty ones last, so that an
    # item's successor in a CTA's walk has blocks unless every later item is empty.
    order = (
        jnp.argsort(sizes == 0, stable=True) if config.scales == "l2" else jnp.arange(num_groups)
    )
    walk = jnp.stack([first_block[order], sizes[order] // BLOCK, order]).astype(jnp.int32)
    kernel = _build_kernel(
        m, k, n, num_groups, lhs_t.dtype, rhs_t.dtype, out_dtype, config, interpret
    )
    return kernel(walk, lhs_t, rhs_t, lhs_scale, rhs_scale)


@functools.cache
def _build_kernel(m, k, n, num_groups, lhs_dtype, rhs_dtype, out_dtype, config, interpret):
    tile_k, tile_n, slots = config.tile_k, config.tile_n, config.slots
    cta_k, cta_n, step = config.cta_k, config.cta_n, config.blocks_per_step
    epi_n, pair = config.epilogue_n, config.cluster_n
    clusters = config.num_sms // pair
    grid_k, grid_n = k // cta_k, n // (cta_n * pair)  # grid_n: N tiles of a cluster's width
    per_group = grid_k * grid_n
    num_items = num_groups * per_group
    band_width = config.grid_tile_width or grid_n
    multicast = ("cluster",) if pair > 1 else None
    scales_in_ring = config.scales == "ring"
    last_block_row = m // BLOCK - 1

    def weight_gradient(walk_gmem, lhs_gmem, rhs_gmem, lhs_scale_gmem, rhs_scale_gmem, out_gmem):
        lane = lax.axis_index("sm")  # the CTA's cluster
        cta = lax.axis_index("cluster")
        num_mine = jnp.maximum(num_items - lane + clusters - 1, 0) // clusters

        def item(j):
            """(group, first block, blocks, ki, ni) of the CTA's j-th work item (j < num_mine):
            the cluster's item, the CTA's N tile of it."""
            idx = jnp.minimum(lane + j * clusters, num_items - 1)
            position, tile = lax.div(idx, per_group), lax.rem(idx, per_group)
            ki, column = banded_item(tile, grid_k, grid_n, band_width)
            first, blocks = walk_gmem[0, position], walk_gmem[1, position]
            return walk_gmem[2, position], first, blocks, ki, column * pair + cta

        def item_steps(blocks):
            return (blocks + step - 1) // step

        @functools.partial(
            pl.run_scoped,
            lhs_ring=plgpu.SMEM(
                (slots, cta_k, step * BLOCK), lhs_dtype, transforms=swizzled(lhs_dtype, BLOCK)
            ),
            rhs_ring=plgpu.SMEM(
                (slots, cta_n, step * BLOCK), rhs_dtype, transforms=swizzled(rhs_dtype, BLOCK)
            ),
            # (without scales in the ring: one unused slot of each)
            lhs_scale_ring=plgpu.SMEM((slots if scales_in_ring else 1, step, cta_k), jnp.float32),
            rhs_scale_ring=plgpu.SMEM((slots if scales_in_ring else 1, step, cta_n), jnp.float32),
            out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, tile_k, epi_n), out_dtype),
            # operands (and scales)
            produced=plgpu.Barrier(num_arrivals=4 if scales_in_ring else 2, num_barriers=slots),
            # A multicast slot is refilled once both CTAs of the cluster are done with it.
            consumed=(
                plgpu.ClusterBarrier(
                    collective_axes=multicast, num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots
                )
                if multicast
                else plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots)
            ),
            collective_axes="wg",
        )
        def _scope(
            lhs_ring,
            rhs_ring,
            lhs_scale_ring,
            rhs_scale_ring,
            out_smem,
            produced,
            consumed,
        ):
            wg = lax.axis_index("wg")

            def memory_warpgroup():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def load_item(j, done):
                    _, first, blocks, ki, ni = item(j)

                    @pl.loop(0, item_steps(blocks))
                    def _step(s):
                        t = done + s
                        slot = lax.rem(t, slots)

                        @pl.when(t >= slots)
                        def _wait_free():  # both compute warpgroups are done with t - slots
                            plgpu.barrier_wait(consumed.at[slot])
                            if scales_in_ring:
                                # Their scale reads (generic proxy) before this TMA's writes.
                                plgpu.commit_smem()

                        # A step's blocks past the group (an odd count's last step) are loaded
                        # but not used; past M they are zeros.
                        block_rows = pl.ds(first + s * step, step)
                        tokens = pl.ds((first + s * step) * BLOCK, step * BLOCK)
                        k_rows, n_rows = pl.ds(ki * cta_k, cta_k), pl.ds(ni * cta_n, cta_n)
                        plgpu.copy_gmem_to_smem(
                            lhs_gmem.at[k_rows, tokens],
                            lhs_ring.at[slot],
                            produced.at[slot],
                            collective_axes=multicast,
                        )
                        loads = [(rhs_gmem.at[n_rows, tokens], rhs_ring)]
                        if scales_in_ring:
                            loads += [
                                (lhs_scale_gmem.at[block_rows, k_rows], lhs_scale_ring),
                                (rhs_scale_gmem.at[block_rows, n_rows], rhs_scale_ring),
                            ]
                        for src, dst in loads:
                            plgpu.copy_gmem_to_smem(src, dst.at[slot], produced.at[slot])

                    return done + item_steps(blocks)

                num_steps = lax.fori_loop(0, num_mine, load_item, jnp.int32(0))

                # Observe the last slots' releases too, so that every warpgroup leaves the
                # barriers in the same phase.
                @pl.loop(jnp.maximum(num_steps - slots, 0), num_steps)
                def _quiesce(t):
                    plgpu.barrier_wait(consumed.at[lax.rem(t, slots)])

            def compute_warpgroup():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
                # This warpgroup's rows and columns of the CTA tile (the ring slot's rows).
                by_k, by_n = config.wg_split == "k", config.wg_split == "n"
                wg_rows = pl.ds(wg * tile_k if by_k else 0, tile_k)
                wg_columns = pl.ds(wg * tile_n if by_n else 0, tile_n)

                def load_scales(row_scales, col_scales):
                    """A block's row and column scales (refs of this warpgroup's rows and
                    columns), in the wgmma layout."""
                    row_scale = plgpu.load(
                        row_scales, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False
                    )
                    col_scale = plgpu.load(
                        col_scales, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False
                    )
                    return row_scale, col_scale

                def ring_scales(slot, b):
                    """Block b of the slot's scales (scales="ring")."""
                    return load_scales(
                        lhs_scale_ring.at[slot, b, wg_rows], rhs_scale_ring.at[slot, b, wg_columns]
                    )

                def gmem_scales(block_row, ki, ni):
                    """Block row block_row's scales of item tile (ki, ni) from GMEM (scales="l2";
                    a row past the last, a prefetch never used, reads the last)."""
                    block_row = jnp.minimum(block_row, last_block_row)
                    return load_scales(
                        lhs_scale_gmem.at[block_row, pl.ds(ki * cta_k + wg_rows.start, tile_k)],
                        rhs_scale_gmem.at[block_row, pl.ds(ni * cta_n + wg_columns.start, tile_n)],
                    )

                def issue(part_ref, slot, b):
                    plgpu.wgmma(
                        part_ref,
                        lhs_ring.at[slot].at[wg_rows, pl.ds(b * BLOCK, BLOCK)],
                        rhs_ring.at[slot].at[wg_columns, pl.ds(b * BLOCK, BLOCK)].transpose((1, 0)),
                    )

                def folded(acc, part, scales):
                    row_scale, col_scale = scales
                    return acc + part * (row_scale[:, None] * col_scale[None, :])

                def matmul_item(j, carry):
                    done, scales = carry
                    group, first, blocks, ki, ni = item(j)
                    _, next_first, _, next_ki, next_ni = item(jnp.minimum(j + 1, num_mine - 1))

                    def next_block_scales(t):
                        """scales="l2": the loads of the scales of the block after the item's
                        block t (its block t + 1 or the next item's first)."""
                        inside = t + 1 < blocks
                        return gmem_scales(
                            jnp.where(inside, first + t + 1, next_first),
                            jnp.where(inside, ki, next_ki),
                            jnp.where(inside, ni, next_ni),
                        )

                    def fold_step(s, acc_scales, count):
                        """Fold the `count` blocks of the item's step s into acc, in order."""
                        acc, scales = acc_scales
                        slot = lax.rem(done + s, slots)
                        plgpu.barrier_wait(produced.at[slot])
                        for b in range(count):

                            def block_product(part_ref):
                                """The block's product and the scales loaded while its wgmma
                                runs: its own from the ring, or the next block's from L2."""
                                if not scales_in_ring:
                                    loaded = next_block_scales(s * step + b)  # noqa: B023
                                issue(part_ref, slot, b)  # noqa: B023
                                if scales_in_ring:
                                    loaded = ring_scales(slot, b)  # noqa: B023
                                plgpu.wgmma_wait(0)
                                return part_ref[...], loaded

                            part, loaded = pl.run_scoped(block_product, plgpu.ACC((tile_k, tile_n)))
                            if b == count - 1:
                                plgpu.barrier_arrive(consumed.at[slot])
                            if scales_in_ring:
                                acc = folded(acc, part, loaded)
                            else:  # this block's scales came with the previous block
                                acc, scales = folded(acc, part, scales), loaded
                        return acc, scales

                    whole = blocks // step
                    acc = plgpu.layout_cast(
                        jnp.zeros((tile_k, tile_n), jnp.float32), plgpu.Layout.WGMMA
                    )
                    acc, scales = lax.fori_loop(
                        0, whole, lambda s, a: fold_step(s, a, step), (acc, scales)
                    )
                    if step > 1:  # the last step's blocks of an odd count
                        acc, scales = lax.fori_loop(
                            0, blocks % step, lambda _, a: fold_step(whole, a, 1), (acc, scales)
                        )
                    rows = pl.ds(ki * cta_k + wg_rows.start, tile_k)
                    columns = pl.ds(ni * cta_n + wg_columns.start, tile_n)
                    for c in range(tile_n // epi_n):
                        slot = out_smem.at[wg]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        slot[...] = acc[:, c * epi_n : (c + 1) * epi_n].astype(out_dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            slot,
                            out_gmem.at[group, rows, pl.ds(columns.start + c * epi_n, epi_n)],
                        )
                    return done + item_steps(blocks), scales

                if scales_in_ring:
                    first_scales = ()
                else:  # the first item's first block
                    _, first, _, ki, ni = item(0)
                    first_scales = gmem_scales(first, ki, ni)
                lax.fori_loop(0, num_mine, matmul_item, (jnp.int32(0), first_scales))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            lax.cond(wg == NUM_COMPUTE_WGS, memory_warpgroup, compute_warpgroup)

    return plgpu.kernel(
        weight_gradient,
        kernel_name="tgmm_fp8_blockwise",
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid=(clusters,),
        grid_names=("sm",),
        cluster=(pair,),
        cluster_names=("cluster",),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
