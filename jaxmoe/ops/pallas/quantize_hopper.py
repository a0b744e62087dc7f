"""MXFP8 quantize kernels for Hopper (Pallas Mosaic GPU), bitwise equal to `jaxmoe.mxfp8.quantize`.

The scale byte is the reference's own integer rule (`jaxmoe/mxfp8.py`: `_e8m0_from_amax_bits` on
the amax bits). The elements are encoded with `arithmetic=`:
  "exact"  the reference's integer emulation (`_encode_elements`): no float op meets a denormal,
           so it is bit-exact under XLA:CPU's flush-to-zero too (the CPU interpreter);
  "float"  TE's own arithmetic: RN_fp32(x * 2^(127-e)), clipped to +-max (saturation), then the
           hardware fp32 -> fp8 convert (NaN -> 0x7F). About a third of the instructions; exact
           on the GPU, which keeps denormals. The default on a GPU, "exact" elsewhere.

Each CTA moves one tile: TMA load into SMEM, registers (WGMMA layout), TMA store of the fp8 data
and the scale bytes. The tensor must be a whole number of tiles: with a partial last tile the
H200 stored 8 of 360 scale bytes wrong (measured 2026-11-29, not yet understood), so such shapes
are refused.

  rowwise     blocks of 32 along the last axis. The tensor is viewed as [M*K/32, 32] (free), so
              a block is one row of the tile and its amax one row reduction.
  columnwise  blocks of 32 along the first axis of [M, K]: a [64, 128] tile holds two row
              blocks; each takes a masked column reduction.
  gather      (dispatch_quantize) rowwise on a [64, 128] tile whose rows are TMA-loaded one by
              one from their tokens; four masked row reductions give the four blocks' scales.
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

ROW_TILE = 128        # rowwise: blocks (rows of the [M*K/32, 32] view) per CTA
COLUMN_TILE = 128     # columnwise: columns per CTA (the tile is 2 blocks = 64 rows high)
_LAYOUT = plgpu.Layout.WGMMA
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _tiled(dtype, cols):
    """SMEM tiling + swizzle for a tile `cols` elements wide (WGMMA-layout register transfers)."""
    width = min(cols * jnp.dtype(dtype).itemsize, 128)
    return (plgpu.TilingTransform((8, width // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(width))


ARITHMETIC = ("exact", "float")


def default_arithmetic() -> str:
    """"float" on a GPU, "exact" elsewhere (the CPU interpreter flushes denormals)."""
    return "float" if jax.devices()[0].platform == "gpu" else "exact"


def _encode(bits, e, fmt, arithmetic):
    """fp8 elements of the fp32 bits `bits` with scale bytes `e` (int32, broadcast to bits)."""
    if arithmetic == "exact":
        return _encode_elements(bits, e, fmt)
    # 2^(127 - e): exponent field 254 - e, or the subnormal 2^-127 for e = 254.
    scale = jnp.where(e == 254, jnp.int32(0x00400000), (254 - e) << 23)
    y = (lax.bitcast_convert_type(bits, jnp.float32)
         * lax.bitcast_convert_type(scale, jnp.float32))
    return jnp.clip(y, -fmt.max_normal, fmt.max_normal).astype(fmt.dtype)


def _block_amax_bits(bits, axis):
    """max |x| over `axis` on the fp32 bits (monotone in |x|), NaNs counted as 0."""
    mag = bits & _ABS
    return jnp.max(jnp.where(mag > _INF, jnp.uint32(0), mag), axis=axis)


def _check(x, fmt, arithmetic):
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"MXFP8 quantize kernel: arithmetic must be one of {ARITHMETIC}, got "
                         f"{arithmetic!r}")
    if fmt not in _FORMATS:
        raise ValueError(f"MXFP8 quantize kernel: unknown format {fmt!r}")
    if x.ndim != 2 or jnp.dtype(x.dtype) not in _INPUT_DTYPES:
        raise ValueError(f"MXFP8 quantize kernel: needs a 2-D float32/bfloat16 array, got "
                         f"{x.shape} {x.dtype}")


def quantize_rowwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None,
                            interpret=None):
    """(data [M, K], scale [M, K/32] uint8) of x [M, K] with blocks along K; K % 32 == 0 and
    M * K / 32 a multiple of ROW_TILE."""
    arithmetic = arithmetic or default_arithmetic()
    _check(x, fmt, arithmetic)
    m, k = x.shape
    if k % BLOCK_SIZE or (m * k // BLOCK_SIZE) % ROW_TILE:
        raise ValueError(f"MXFP8 quantize kernel: needs K % {BLOCK_SIZE} == 0 and M * K / "
                         f"{BLOCK_SIZE} % {ROW_TILE} == 0, got {x.shape}")
    blocks = x.reshape(m * k // BLOCK_SIZE, BLOCK_SIZE)
    data, scale = _rowwise_kernel(blocks.shape[0], jnp.dtype(x.dtype), fmt, arithmetic,
                                  interpret)(blocks)
    return data.reshape(m, k), scale.reshape(m, k // BLOCK_SIZE)


@functools.lru_cache(maxsize=None)
def _rowwise_kernel(num_blocks, dtype, fmt_name, arithmetic, interpret):
    fmt = _FORMATS[fmt_name]

    def body(x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, barrier):
        rows = pl.ds(lax.axis_index("tile") * ROW_TILE, ROW_TILE)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, barrier)
        plgpu.barrier_wait(barrier)
        bits = _float32_bits(plgpu.load(x_smem, layout=_LAYOUT))
        e = _e8m0_from_amax_bits(_block_amax_bits(bits, axis=1), fmt)
        e_rows = plgpu.layout_cast(lax.broadcast_in_dim(e, (ROW_TILE, BLOCK_SIZE), (0,)),
                                   _LAYOUT)
        data_smem[...] = _encode(bits, e_rows, fmt, arithmetic)
        scale_smem[...] = e.astype(jnp.uint8)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(data_smem, data_gmem.at[rows])
        plgpu.copy_smem_to_gmem(scale_smem, scale_gmem.at[rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((num_blocks, BLOCK_SIZE), fmt.dtype),
                  jax.ShapeDtypeStruct((num_blocks,), jnp.uint8)),
        grid=(num_blocks // ROW_TILE,),
        grid_names=("tile",),
        scratch_types=[plgpu.SMEM((ROW_TILE, BLOCK_SIZE), dtype,
                                  transforms=_tiled(dtype, BLOCK_SIZE)),
                       plgpu.SMEM((ROW_TILE, BLOCK_SIZE), fmt.dtype,
                                  transforms=_tiled(fmt.dtype, BLOCK_SIZE)),
                       plgpu.SMEM((ROW_TILE,), jnp.uint8),
                       plgpu.Barrier()],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )


def quantize_columnwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None,
                               interpret=None):
    """(data [M, K], scale [M/32, K] uint8) of x [M, K] with blocks along M; M % 64 == 0 and
    K % 128 == 0."""
    arithmetic = arithmetic or default_arithmetic()
    _check(x, fmt, arithmetic)
    m, k = x.shape
    if m % (2 * BLOCK_SIZE) or k % COLUMN_TILE:
        raise ValueError(f"MXFP8 columnwise quantize kernel: needs M % 64 == 0 and K % "
                         f"{COLUMN_TILE} == 0, got {x.shape}")
    return _columnwise_kernel(m, k, jnp.dtype(x.dtype), fmt, arithmetic, interpret)(x)


@functools.lru_cache(maxsize=None)
def _columnwise_kernel(m, k, dtype, fmt_name, arithmetic, interpret):
    fmt = _FORMATS[fmt_name]
    height = 2 * BLOCK_SIZE

    def body(x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, barrier):
        rows = pl.ds(lax.axis_index("row") * height, height)
        cols = pl.ds(lax.axis_index("col") * COLUMN_TILE, COLUMN_TILE)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, barrier)
        plgpu.barrier_wait(barrier)
        bits = _float32_bits(plgpu.load(x_smem, layout=_LAYOUT))
        upper = plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, (height, COLUMN_TILE), 0), _LAYOUT) < BLOCK_SIZE
        zero = jnp.uint32(0)
        e_upper = _e8m0_from_amax_bits(_block_amax_bits(jnp.where(upper, bits, zero), 0), fmt)
        e_lower = _e8m0_from_amax_bits(_block_amax_bits(jnp.where(upper, zero, bits), 0), fmt)

        def spread(e):
            return plgpu.layout_cast(lax.broadcast_in_dim(e, (height, COLUMN_TILE), (1,)),
                                     _LAYOUT)

        data_smem[...] = _encode(bits, jnp.where(upper, spread(e_upper), spread(e_lower)), fmt,
                                 arithmetic)
        scale_smem[0] = e_upper.astype(jnp.uint8)
        scale_smem[1] = e_lower.astype(jnp.uint8)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(data_smem, data_gmem.at[rows, cols])
        plgpu.copy_smem_to_gmem(scale_smem,
                                scale_gmem.at[pl.ds(lax.axis_index("row") * 2, 2), cols])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((m, k), fmt.dtype),
                  jax.ShapeDtypeStruct((m // BLOCK_SIZE, k), jnp.uint8)),
        grid=(m // height, k // COLUMN_TILE),
        grid_names=("row", "col"),
        scratch_types=[plgpu.SMEM((height, COLUMN_TILE), dtype,
                                  transforms=_tiled(dtype, COLUMN_TILE)),
                       plgpu.SMEM((height, COLUMN_TILE), fmt.dtype,
                                  transforms=_tiled(fmt.dtype, COLUMN_TILE)),
                       plgpu.SMEM((2, COLUMN_TILE), jnp.uint8),
                       plgpu.Barrier()],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )


def gather_quantize_rowwise_pallas(x: jax.Array, row_token: jax.Array, fmt: str = "e4m3", *,
                                   arithmetic=None, interpret=None):
    """Dispatch and quantize in one pass: row r of the result is x[row_token[r]] quantized with
    blocks along K, or zeros (data 0, scale byte 0) where row_token[r] == T (a padding row).
    Returns (data [M, K], scale [M, K/32]), bitwise equal to quantizing the gathered rows.
    M % 64 == 0 and K % 128 == 0. Each row of a tile is one TMA load of its token's columns."""
    arithmetic = arithmetic or default_arithmetic()
    _check(x, fmt, arithmetic)
    num_tokens, k = x.shape
    (m,) = row_token.shape
    if m % (2 * BLOCK_SIZE) or k % COLUMN_TILE:
        raise ValueError(f"MXFP8 gather-quantize kernel: needs M % 64 == 0 and K % "
                         f"{COLUMN_TILE} == 0, got M={m}, K={k}")
    kernel = _gather_rowwise_kernel(num_tokens, m, k, jnp.dtype(x.dtype), fmt, arithmetic,
                                    interpret)
    return kernel(row_token.astype(jnp.int32), x)


@functools.lru_cache(maxsize=None)
def _gather_rowwise_kernel(num_tokens, m, k, dtype, fmt_name, arithmetic, interpret):
    fmt = _FORMATS[fmt_name]
    height, blocks = 2 * BLOCK_SIZE, COLUMN_TILE // BLOCK_SIZE

    def body(token_gmem, x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem,
             barrier):
        row0 = lax.axis_index("row") * height
        cols = pl.ds(lax.axis_index("col") * COLUMN_TILE, COLUMN_TILE)
        for r in range(height):
            source = jnp.minimum(token_gmem[row0 + r], num_tokens - 1)
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(source, 1), cols],
                                    x_smem.at[pl.ds(r, 1)], barrier)
        plgpu.barrier_wait(barrier)
        tokens = plgpu.load(token_gmem.at[pl.ds(row0, height)],
                            layout=_LAYOUT.reduce(1), optimized=False)
        real = plgpu.layout_cast(
            lax.broadcast_in_dim(tokens < num_tokens, (height, COLUMN_TILE), (0,)), _LAYOUT)
        bits = jnp.where(real, _float32_bits(plgpu.load(x_smem, layout=_LAYOUT,
                                                        optimized=False)), jnp.uint32(0))
        column = plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, (height, COLUMN_TILE), 1), _LAYOUT) // BLOCK_SIZE
        e_rows = jnp.zeros((height, COLUMN_TILE), jnp.int32)
        for b in range(blocks):
            e = _e8m0_from_amax_bits(
                _block_amax_bits(jnp.where(column == b, bits, jnp.uint32(0)), 1), fmt)
            scale_smem[b] = e.astype(jnp.uint8)
            e_rows = jnp.where(column == b, plgpu.layout_cast(
                lax.broadcast_in_dim(e, (height, COLUMN_TILE), (0,)), _LAYOUT), e_rows)
        data_smem[...] = _encode(bits, e_rows, fmt, arithmetic)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(data_smem, data_gmem.at[pl.ds(row0, height), cols])
        plgpu.copy_smem_to_gmem(
            scale_smem, scale_gmem.at[pl.ds(lax.axis_index("col") * blocks, blocks),
                                      pl.ds(row0, height)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((m, k), fmt.dtype),
                  jax.ShapeDtypeStruct((k // BLOCK_SIZE, m), jnp.uint8)),
        grid=(m // height, k // COLUMN_TILE),
        grid_names=("row", "col"),
        scratch_types=[plgpu.SMEM((height, COLUMN_TILE), dtype),
                       plgpu.SMEM((height, COLUMN_TILE), fmt.dtype,
                                  transforms=_tiled(fmt.dtype, COLUMN_TILE)),
                       plgpu.SMEM((blocks, height), jnp.uint8),
                       plgpu.Barrier(num_arrivals=height)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )
