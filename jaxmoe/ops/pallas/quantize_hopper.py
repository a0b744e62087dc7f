"""MXFP8 quantize kernels for Hopper (Pallas Mosaic GPU), bitwise equal to `jaxmoe.mxfp8.quantize`.

The scale byte is the reference's own integer rule (`jaxmoe/mxfp8.py`: `_e8m0_from_amax_bits` on
the amax bits). The elements are encoded with `arithmetic=`:
  "exact"  the reference's integer emulation (`_encode_elements`): no float op meets a denormal,
           so it is bit-exact under XLA:CPU's flush-to-zero too (the CPU interpreter);
  "float"  TE's own arithmetic: RN_fp32(x * 2^(127-e)), clipped to +-max (saturation), then the
           hardware fp32 -> fp8 convert (NaN -> 0x7F). About a third of the instructions; exact
           on the GPU, which keeps denormals. The default on a GPU, "exact" elsewhere.

Design. Quantizing is bound by HBM bandwidth (it reads 2 or 4 bytes per element and writes
1 + 1/32), so the kernels keep many TMA transfers in flight and little work per element:
  * Persistent grid (`row_pipeline`, shared with the dispatch and combine kernels):
    CTAS_PER_SM (2) CTAs of one warpgroup per SM; CTA c walks tiles c, c + G, c + 2G, ...
    (G CTAs) through a ring of STAGES (4) SMEM slots (`row_pipeline.pipeline`): while it
    quantizes tile i, the TMA loads of tiles i+1..i+3 are in flight and the TMA stores of the
    previous tiles drain. Two CTAs of 128 threads fit the register file whatever ptxas
    allocates (255 registers), so both are resident and the static tile split stays balanced;
    while one CTA waits or synchronises, the other computes.
  * A tile is TILE_BYTES = 16 KB of input in one TMA load (the gather: a few), a fp8 TMA store
    of 8 KB (bf16 input) / 4 KB (fp32) and a store of its 256 / 128 scale bytes. SMEM per CTA
    is STAGES x (16 KB + fp8 tile + scales) = 97 KB (bf16) / 80.5 KB (fp32): two CTAs fit an
    SM's 228 KB (SMEM_PER_CTA, checked by the lowering test). In flight per SM: up to 8 tile
    loads of 16 KB (6 while both CTAs compute), 96-128 KB, several times the ~30 KB per SM that
    4 TB/s at ~1 us of latency needs.
  * Register layouts keep each 32-element block in few threads, so no reduction crosses warps
    and every SMEM access is a conflict-free 16-byte (rowwise) or 4-byte (columnwise) vector:
      rowwise     x viewed as [M*K/32, 32] (free): a tile is [tile_elems, 32], one block per
                  row (tile_elems = 256 bf16 / 128 fp32). 32/v lanes hold a block as one
                  16-byte vector each (v = 8 bf16 / 4 fp32): amax is v-1 local maxes and 2 / 3
                  shuffles; per element ~10 instructions ("float").
      columnwise  x [M, K]: a tile is [32, tile_elems] (one block row, 32 rows of 512 bytes).
                  Each thread holds all 32 rows of w adjacent columns (w = 2 bf16 / 1 fp32;
                  a warp reads 128-byte row lines): amax is 31 local maxes, no shuffle.
      gather      (dispatch_quantize) the rowwise tile over the [M*K/32, 32] output, loaded
                  from x viewed as [T*K/32, 32] by TMAs of whole token rows or row segments
                  (`row_pipeline.gather_plan`; bf16 H = 4096: 2 x 8 KB per tile, 7168:
                  1 x 14 KB, 2048: 4 x 4 KB). A padding row (row_token == T) loads from past
                  the end of x: the TMA fills it with zeros, which quantize to data 0 and
                  scale byte 0.
  * Partial last tiles (any M for rowwise and gather, K % 16 == 0 for columnwise): TMA loads
    fill out-of-bounds rows/columns with zeros and the 32-row fp8 data stores drop them; every
    clipped edge falls on a whole 16-byte chunk (fp8 rows of 32 bytes; K % 16 == 0). Scale
    stores are never out of bounds: their buffers are padded to whole tiles and sliced. On the
    H200 (2026-11-29) clipped one-row uint8 stores did not stay in bounds: a 1-D store ending
    inside a 16-byte chunk stored 8 of 360 scale bytes wrong, and a [1, width] store clipped at
    the end of a scale row wrote its clipped (zero) bytes into the start of the next row.
Scales come out compact ([M, K/32] or [M/32, K]); `jaxmoe.mxfp8.swizzle_scales` makes the GEMM
layout from them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.mxfp8 import (_ABS, _FORMATS, _INF, BLOCK_SIZE, _e8m0_from_amax_bits,
                          _encode_elements, _float32_bits)
from jaxmoe.ops.pallas.row_pipeline import (ALIGN, COMPILER_PARAMS, STAGES, gather_fetch,
                                            gather_plan, num_ctas, pipeline, tile_elems)

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

ARITHMETIC = ("exact", "float")


def default_arithmetic() -> str:
    """"float" on a GPU, "exact" elsewhere (the CPU interpreter flushes denormals)."""
    return "float" if jax.devices()[0].platform == "gpu" else "exact"


def _rowwise_layout(dtype):
    """Register layout of a [tile_elems, 32] tile whose rows are blocks: 32/v consecutive lanes
    hold a row as one 16-byte vector of v elements each; a warp holds v rows, the warpgroup
    4v (tiling (4v, 32) / (v, 32) / (v,): warps, lanes (row, vector), vector)."""
    v = 16 // jnp.dtype(dtype).itemsize
    return plgpu.Layout.TILED(plgpu.Tiling(((4 * v, BLOCK_SIZE), (v, BLOCK_SIZE), (v,))),
                              warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)


def _columnwise_layout(dtype):
    """Register layout of a [32, tile_elems] tile whose columns are blocks: each thread holds
    all 32 rows of w adjacent columns (w elements = 4 bytes per row), the lanes of a warp 32w
    adjacent columns, the warps side by side (tiling (32, 128w) / (32, 32w) / (32, w))."""
    w = 4 // jnp.dtype(dtype).itemsize
    return plgpu.Layout.TILED(
        plgpu.Tiling(((BLOCK_SIZE, 128 * w), (BLOCK_SIZE, 32 * w), (BLOCK_SIZE, w))),
        warp_dims=(-5,), lane_dims=(-3,), vector_dim=-1)


def _block_amax_bits(bits, axis):
    """max |x| over `axis` on the fp32 bits (monotone in |x|), NaNs counted as 0."""
    mag = bits & _ABS
    return jnp.max(jnp.where(mag > _INF, jnp.uint32(0), mag), axis=axis)


def _encode(bits, e, axis, layout, fmt, arithmetic):
    """fp8 elements of the fp32 bits `bits` (in `layout`) with the scale bytes `e` (int32, one
    per block: `bits` reduced along `axis`). Per-block values are computed before they are
    spread over the block's elements."""
    def spread(per_block):
        return plgpu.layout_cast(
            lax.broadcast_in_dim(per_block, bits.shape, (1 - axis,)), layout)

    if arithmetic == "exact":
        return _encode_elements(bits, spread(e), fmt)
    # 2^(127 - e): exponent field 254 - e, or the subnormal 2^-127 for e = 254.
    scale = jnp.where(e == 254, jnp.int32(0x00400000), (254 - e) << 23)
    y = (lax.bitcast_convert_type(bits, jnp.float32)
         * spread(lax.bitcast_convert_type(scale, jnp.float32)))
    return jnp.clip(y, -fmt.max_normal, fmt.max_normal).astype(fmt.dtype)


def _quantize_tile(x_smem, data_smem, scale_smem, axis, layout, fmt, arithmetic):
    """Quantize the SMEM tile `x_smem` (blocks of 32 along `axis`) into `data_smem` (fp8, same
    shape) and `scale_smem` (one byte per block, in order)."""
    bits = _float32_bits(plgpu.load(x_smem, layout=layout))
    e = _e8m0_from_amax_bits(_block_amax_bits(bits, axis), fmt)
    scale_smem[...] = e.astype(jnp.uint8)
    data_smem[...] = _encode(bits, e, axis, layout, fmt, arithmetic)


def _problem(what, shape, dtype, needs) -> str | None:
    """The first unmet need of a kernel, as an error message, or None. `needs`: pairs
    (description, predicate on (M, K))."""
    needs = [("a non-empty 2-D float32/bfloat16 array",
              lambda m, k: m > 0 and k > 0 and jnp.dtype(dtype) in _INPUT_DTYPES), *needs]
    for need, ok in needs:
        if len(shape) != 2 or not ok(*shape):
            return (f"MXFP8 {what} quantize kernel: needs {need}, got {tuple(shape)} "
                    f"{jnp.dtype(dtype).name}")
    return None


def rowwise_problem(shape, dtype) -> str | None:
    """Why `quantize_rowwise_pallas` cannot take an input of this shape/dtype (None: it can)."""
    return _problem("rowwise", shape, dtype,
                    [(f"K % {BLOCK_SIZE} == 0", lambda m, k: k % BLOCK_SIZE == 0)])


def columnwise_problem(shape, dtype) -> str | None:
    """Why `quantize_columnwise_pallas` cannot take an input of this shape/dtype (None: it can).
    K % 16: the fp8 rows must be whole 16-byte chunks (TMA strides, clipped stores)."""
    return _problem("columnwise", shape, dtype,
                    [(f"M % {BLOCK_SIZE} == 0", lambda m, k: m % BLOCK_SIZE == 0),
                     ("K % 16 == 0", lambda m, k: k % 16 == 0)])


def gather_problem(shape, dtype, num_rows) -> str | None:
    """Why `gather_quantize_rowwise_pallas` cannot gather num_rows rows of x of this shape/dtype
    (None: it can): a row must be whole blocks and a whole number of 128 bytes
    (`row_pipeline.gather_plan`)."""
    multiple = max(BLOCK_SIZE, ALIGN // jnp.dtype(dtype).itemsize)
    return _problem("gather", shape, dtype,
                    [(f"K % {multiple} == 0", lambda t, k: k % multiple == 0),
                     ("at least one row to gather", lambda t, k: num_rows > 0)])


def _check(problem, fmt, arithmetic):
    """Raise ValueError for a bad arithmetic or format, or for the kernel's `problem`."""
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"MXFP8 quantize kernel: arithmetic must be one of {ARITHMETIC}, got "
                         f"{arithmetic!r}")
    if fmt not in _FORMATS:
        raise ValueError(f"MXFP8 quantize kernel: unknown format {fmt!r}")
    if problem:
        raise ValueError(problem)


def quantize_rowwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None,
                            interpret=None):
    """(data [M, K], scale [M, K/32] uint8) of x [M, K] (bf16/fp32) with blocks along K;
    K % 32 == 0, any M."""
    arithmetic = arithmetic or default_arithmetic()
    _check(rowwise_problem(x.shape, x.dtype), fmt, arithmetic)
    m, k = x.shape
    num_blocks = m * k // BLOCK_SIZE
    kernel = _rowwise_kernel(num_blocks, jnp.dtype(x.dtype), fmt, arithmetic, interpret, None)
    data, scale = kernel(x.reshape(num_blocks, BLOCK_SIZE))
    return data.reshape(m, k), scale[:num_blocks].reshape(m, k // BLOCK_SIZE)


def gather_quantize_rowwise_pallas(x: jax.Array, row_token: jax.Array, fmt: str = "e4m3", *,
                                   arithmetic=None, interpret=None):
    """Dispatch and quantize in one pass: row r of the result is x[row_token[r]] quantized with
    blocks along K, or zeros (data 0, scale byte 0) where row_token[r] == T (a padding row).
    Returns (data [M, K], scale [M, K/32]), bitwise equal to quantizing the gathered rows.
    Any M; K % 64 == 0 for bf16, K % 32 == 0 for fp32. Tiles load whole token rows or row
    segments (`row_pipeline.gather_plan`)."""
    arithmetic = arithmetic or default_arithmetic()
    _check(gather_problem(x.shape, x.dtype, row_token.shape[0]), fmt, arithmetic)
    num_tokens, k = x.shape
    (m,) = row_token.shape
    num_blocks = m * k // BLOCK_SIZE
    kernel = _rowwise_kernel(num_blocks, jnp.dtype(x.dtype), fmt, arithmetic, interpret,
                             (num_tokens, m, k // BLOCK_SIZE))
    data, scale = kernel(row_token.astype(jnp.int32),
                         x.reshape(num_tokens * k // BLOCK_SIZE, BLOCK_SIZE))
    return data.reshape(m, k), scale[:num_blocks].reshape(m, k // BLOCK_SIZE)


def _contiguous_fetch(x_gmem, x_smem, tile):
    """Rowwise loads: tile t is blocks [t * tile, (t + 1) * tile) of x, one TMA."""
    def fetch(t):
        def issue(slot, barrier):
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(t * tile, tile)], x_smem.at[slot], barrier)
        return issue
    return fetch


@functools.lru_cache(maxsize=None)
def _rowwise_kernel(num_blocks, dtype, fmt_name, arithmetic, interpret, gather):
    """Kernel for rowwise blocks: fp8 [num_blocks, 32] and scales [num_tiles * tile] (whole
    tiles, so that their 1-D stores never cross the end; the caller slices) of x [num_blocks, 32]
    or, with gather = (T, M, R), of (row_token [M], x [T * R, 32]) (`row_pipeline.gather_fetch`)."""
    fmt = _FORMATS[fmt_name]
    if gather is None:
        tile, segment = tile_elems(dtype), None
    else:
        tile, segment = gather_plan(gather[2] * BLOCK_SIZE, dtype)
    num_tiles = pl.cdiv(num_blocks, tile)
    ctas = num_ctas(num_tiles)
    layout = _rowwise_layout(dtype)
    scale_slot = pl.cdiv(tile, ALIGN) * ALIGN     # a TMA reads each slot: 128-byte aligned

    def body(*refs):
        *inputs, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, loaded = refs
        if gather is None:
            fetch = _contiguous_fetch(*inputs, x_smem, tile)
        else:
            fetch = gather_fetch(*inputs, x_smem, tile, segment, gather)

        def compute(slot):
            _quantize_tile(x_smem.at[slot], data_smem.at[slot],
                           scale_smem.at[slot, pl.ds(0, tile)], 1, layout, fmt, arithmetic)

        def store(t, slot):
            plgpu.copy_smem_to_gmem(data_smem.at[slot], data_gmem.at[pl.ds(t * tile, tile)],
                                    commit_group=False)
            plgpu.copy_smem_to_gmem(scale_smem.at[slot, pl.ds(0, tile)],
                                    scale_gmem.at[pl.ds(t * tile, tile)], commit_group=False)

        pipeline(num_tiles, ctas, loaded, fetch, compute, store)

    return plgpu.kernel(
        body,
        kernel_name="quantize_rowwise" if gather is None else "dispatch_quantize",
        out_type=(jax.ShapeDtypeStruct((num_blocks, BLOCK_SIZE), fmt.dtype),
                  jax.ShapeDtypeStruct((num_tiles * tile,), jnp.uint8)),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[plgpu.SMEM((STAGES, tile, BLOCK_SIZE), dtype),
                       plgpu.SMEM((STAGES, tile, BLOCK_SIZE), fmt.dtype),
                       plgpu.SMEM((STAGES, scale_slot), jnp.uint8),
                       plgpu.Barrier(num_arrivals=1 if gather is None else tile // segment,
                                     num_barriers=STAGES)],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )


def quantize_columnwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None,
                               interpret=None):
    """(data [M, K], scale [M/32, K] uint8) of x [M, K] (bf16/fp32) with blocks along M;
    M % 32 == 0 and K % 16 == 0."""
    arithmetic = arithmetic or default_arithmetic()
    _check(columnwise_problem(x.shape, x.dtype), fmt, arithmetic)
    m, k = x.shape
    data, scale = _columnwise_kernel(m, k, jnp.dtype(x.dtype), fmt, arithmetic, interpret)(x)
    return data, scale[:, :k]


@functools.lru_cache(maxsize=None)
def _columnwise_kernel(m, k, dtype, fmt_name, arithmetic, interpret):
    """Kernel for columnwise blocks of x [m, k]: tile t is the [32, width] window at block row
    t // col_tiles, column tile t % col_tiles. The scales [m / 32, col_tiles * width] are whole
    tiles wide (the caller slices): a one-row uint8 TMA store clipped at the end of a row wrote
    its clipped bytes into the next row on the H200 (2026-11-29)."""
    fmt = _FORMATS[fmt_name]
    width = tile_elems(dtype)
    col_tiles = pl.cdiv(k, width)
    num_tiles = m // BLOCK_SIZE * col_tiles
    ctas = num_ctas(num_tiles)
    layout = _columnwise_layout(dtype)

    def window(t):
        row, col = t // col_tiles, t % col_tiles
        return row, pl.ds(row * BLOCK_SIZE, BLOCK_SIZE), pl.ds(col * width, width)

    def body(x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, loaded):
        def fetch(t):
            _, rows, cols = window(t)

            def issue(slot, barrier):
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem.at[slot], barrier)
            return issue

        def compute(slot):
            _quantize_tile(x_smem.at[slot], data_smem.at[slot], scale_smem.at[slot, 0], 0,
                           layout, fmt, arithmetic)

        def store(t, slot):
            row, rows, cols = window(t)
            plgpu.copy_smem_to_gmem(data_smem.at[slot], data_gmem.at[rows, cols],
                                    commit_group=False)
            plgpu.copy_smem_to_gmem(scale_smem.at[slot], scale_gmem.at[pl.ds(row, 1), cols],
                                    commit_group=False)

        pipeline(num_tiles, ctas, loaded, fetch, compute, store)

    return plgpu.kernel(
        body,
        kernel_name="quantize_columnwise",
        out_type=(jax.ShapeDtypeStruct((m, k), fmt.dtype),
                  jax.ShapeDtypeStruct((m // BLOCK_SIZE, col_tiles * width), jnp.uint8)),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[plgpu.SMEM((STAGES, BLOCK_SIZE, width), dtype),
                       plgpu.SMEM((STAGES, BLOCK_SIZE, width), fmt.dtype),
                       plgpu.SMEM((STAGES, 1, width), jnp.uint8),
                       plgpu.Barrier(num_barriers=STAGES)],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
