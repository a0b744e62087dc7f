"""MXFP8 quantize kernels for Hopper (Pallas Mosaic GPU), bitwise equal to `jaxmoe.mxfp8.quantize`:
rowwise, columnwise, and the dispatch gather fused with a rowwise quantize.

The scale byte uses the reference's integer rule (`jaxmoe.mxfp8.e8m0_from_amax_bits`). The
elements are encoded with `arithmetic=`:
  "exact"  the reference's integer emulation (`jaxmoe.mxfp8.encode_elements`): no float op meets
           a denormal, so it is bit-exact under XLA:CPU's flush-to-zero too (the interpreter);
  "float"  TE's own arithmetic: RN_fp32(x * 2^(127-e)), clipped to +-max, then the hardware
           fp32 -> fp8 convert. Fewer instructions; exact on the GPU, which keeps denormals.
Bandwidth-bound: tiles stream through `row_pipeline`. Scales come out compact ([M, K/32] or
[M/32, K]); `jaxmoe.mxfp8.swizzle_scales` makes the GEMM layout. docs/kernels.md describes the
design."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv, round_up
from jaxmoe.mxfp8 import (
    BLOCK_SIZE,
    FORMATS,
    FP32_ABS_MASK,
    FP32_INF_BITS,
    e8m0_from_amax_bits,
    encode_elements,
    float32_bits,
)
from jaxmoe.ops.device import on_gpu
from jaxmoe.ops.pallas.hopper import TMA_SMEM_ALIGN
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    STAGES,
    gather_fetch,
    gather_plan,
    num_ctas,
    pipeline,
    tile_elems,
)

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

ARITHMETIC = ("exact", "float")


def default_arithmetic() -> str:
    """ "float" on a GPU, "exact" elsewhere (the CPU interpreter flushes denormals)."""
    return "float" if on_gpu() else "exact"


def _rowwise_layout(dtype):
    """Register layout of a [tile_elems, 32] tile whose rows are blocks: 32/v consecutive lanes
    hold a row as one 16-byte vector of v elements each; a warp holds v rows, the warpgroup
    4v (tiling (4v, 32) / (v, 32) / (v,): warps, lanes (row, vector), vector)."""
    v = 16 // jnp.dtype(dtype).itemsize
    return plgpu.Layout.TILED(
        plgpu.Tiling(((4 * v, BLOCK_SIZE), (v, BLOCK_SIZE), (v,))),
        warp_dims=(-5,),
        lane_dims=(-3, -2),
        vector_dim=-1,
    )


def _columnwise_layout(dtype):
    """Register layout of a [32, tile_elems] tile whose columns are blocks: each thread holds
    all 32 rows of w adjacent columns (w elements = 4 bytes per row), the lanes of a warp 32w
    adjacent columns, the warps side by side (tiling (32, 128w) / (32, 32w) / (32, w))."""
    w = 4 // jnp.dtype(dtype).itemsize
    return plgpu.Layout.TILED(
        plgpu.Tiling(((BLOCK_SIZE, 128 * w), (BLOCK_SIZE, 32 * w), (BLOCK_SIZE, w))),
        warp_dims=(-5,),
        lane_dims=(-3,),
        vector_dim=-1,
    )


def _block_amax_bits(bits, axis):
    """max |x| over `axis` on the fp32 bits (monotone in |x|), NaNs counted as 0."""
    mag = bits & FP32_ABS_MASK
    return jnp.max(jnp.where(mag > FP32_INF_BITS, jnp.uint32(0), mag), axis=axis)


def _encode(bits, e, axis, layout, fmt, arithmetic):
    """fp8 elements of the fp32 bits `bits` (in `layout`) with the scale bytes `e` (int32, one
    per block: `bits` reduced along `axis`). Per-block values are computed before they are
    spread over the block's elements."""

    def spread(per_block):
        return plgpu.layout_cast(lax.broadcast_in_dim(per_block, bits.shape, (1 - axis,)), layout)

    if arithmetic == "exact":
        return encode_elements(bits, spread(e), fmt)
    # 2^(127 - e): exponent field 254 - e, or the subnormal 2^-127 for e = 254.
    scale = jnp.where(e == 254, jnp.int32(0x00400000), (254 - e) << 23)
    y = lax.bitcast_convert_type(bits, jnp.float32) * spread(
        lax.bitcast_convert_type(scale, jnp.float32)
    )
    return jnp.clip(y, -fmt.max_normal, fmt.max_normal).astype(fmt.dtype)


def _quantize_tile(x_smem, data_smem, scale_smem, axis, layout, fmt, arithmetic):
    """Quantize the SMEM tile `x_smem` (blocks of 32 along `axis`) into `data_smem` (fp8, same
    shape) and `scale_smem` (one byte per block, in order)."""
    bits = float32_bits(plgpu.load(x_smem, layout=layout))
    e = e8m0_from_amax_bits(_block_amax_bits(bits, axis), fmt)
    scale_smem[...] = e.astype(jnp.uint8)
    data_smem[...] = _encode(bits, e, axis, layout, fmt, arithmetic)


def _problem(what, shape, dtype, needs) -> str | None:
    """The first unmet need of a kernel, as an error message, or None. `needs`: pairs
    (description, predicate on (M, K))."""
    needs = [
        (
            "a non-empty 2-D float32/bfloat16 array",
            lambda m, k: m > 0 and k > 0 and jnp.dtype(dtype) in _INPUT_DTYPES,
        ),
        *needs,
    ]
    for need, ok in needs:
        if len(shape) != 2 or not ok(*shape):
            return (
                f"MXFP8 {what} quantize kernel: needs {need}, got {tuple(shape)} "
                f"{jnp.dtype(dtype).name}"
            )
    return None


def rowwise_problem(shape, dtype) -> str | None:
    """Why `quantize_rowwise_pallas` cannot take an input of this shape/dtype (None: it can)."""
    return _problem(
        "rowwise", shape, dtype, [(f"K % {BLOCK_SIZE} == 0", lambda m, k: k % BLOCK_SIZE == 0)]
    )


def columnwise_problem(shape, dtype) -> str | None:
    """Why `quantize_columnwise_pallas` cannot take an input of this shape/dtype (None: it can).
    K % 16: the fp8 rows must be whole 16-byte chunks (TMA strides, clipped stores)."""
    return _problem(
        "columnwise",
        shape,
        dtype,
        [
            (f"M % {BLOCK_SIZE} == 0", lambda m, k: m % BLOCK_SIZE == 0),
            ("K % 16 == 0", lambda m, k: k % 16 == 0),
        ],
    )


def gather_problem(shape, dtype, num_rows) -> str | None:
    """Why `gather_quantize_rowwise_pallas` cannot gather num_rows rows of x of this shape/dtype
    (None: it can): a row must be whole blocks and a whole number of 128 bytes
    (`row_pipeline.gather_plan`)."""
    multiple = max(BLOCK_SIZE, TMA_SMEM_ALIGN // jnp.dtype(dtype).itemsize)
    return _problem(
        "gather",
        shape,
        dtype,
        [
            (f"K % {multiple} == 0", lambda t, k: k % multiple == 0),
            ("at least one row to gather", lambda t, k: num_rows > 0),
        ],
    )


def _check(problem, fmt, arithmetic):
    """Raise ValueError for a bad arithmetic or format, or for the kernel's `problem`."""
    if arithmetic not in ARITHMETIC:
        raise ValueError(
            f"MXFP8 quantize kernel: arithmetic must be one of {ARITHMETIC}, got {arithmetic!r}"
        )
    if fmt not in FORMATS:
        raise ValueError(f"MXFP8 quantize kernel: unknown format {fmt!r}")
    if problem:
        raise ValueError(problem)


def quantize_rowwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None):
    """(data [M, K], scale [M, K/32] uint8) of x [M, K] (bf16/fp32) with blocks along K;
    K % 32 == 0, any M."""
    arithmetic = arithmetic or default_arithmetic()
    _check(rowwise_problem(x.shape, x.dtype), fmt, arithmetic)
    m, k = x.shape
    num_blocks = m * k // BLOCK_SIZE
    kernel = _rowwise_kernel(num_blocks, jnp.dtype(x.dtype), fmt, arithmetic, interpret, None)
    data, scale = kernel(x.reshape(num_blocks, BLOCK_SIZE))
    return data.reshape(m, k), scale[:num_blocks].reshape(m, k // BLOCK_SIZE)


def gather_quantize_rowwise_pallas(
    x: jax.Array, row_token: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None
):
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
    kernel = _rowwise_kernel(
        num_blocks, jnp.dtype(x.dtype), fmt, arithmetic, interpret, (num_tokens, m, k // BLOCK_SIZE)
    )
    data, scale = kernel(
        row_token.astype(jnp.int32), x.reshape(num_tokens * k // BLOCK_SIZE, BLOCK_SIZE)
    )
    return data.reshape(m, k), scale[:num_blocks].reshape(m, k // BLOCK_SIZE)


def _contiguous_fetch(x_gmem, x_smem, tile):
    """Rowwise loads: tile t is blocks [t * tile, (t + 1) * tile) of x, one TMA."""

    def fetch(t):
        def issue(slot, barrier):
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(t * tile, tile)], x_smem.at[slot], barrier)

        return issue

    return fetch


@functools.cache
def _rowwise_kernel(num_blocks, dtype, fmt_name, arithmetic, interpret, gather):
    """Kernel for rowwise blocks: fp8 [num_blocks, 32] and scales [num_tiles * tile] (whole
    tiles, so that their 1-D stores never cross the end; the caller slices) of x [num_blocks, 32]
    or, with gather = (T, M, R), of (row_token [M], x [T * R, 32]) (`row_pipeline.gather_fetch`)."""
    fmt = FORMATS[fmt_name]
    if gather is None:
        tile, segment = tile_elems(dtype), None
    else:
        tile, segment = gather_plan(gather[2] * BLOCK_SIZE, dtype)
    num_tiles = cdiv(num_blocks, tile)
    ctas = num_ctas(num_tiles)
    layout = _rowwise_layout(dtype)
    scale_slot = round_up(tile, TMA_SMEM_ALIGN)  # a TMA reads each slot: 128-byte aligned

    def quantize_rowwise(*refs):
        *inputs, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, loaded = refs
        if gather is None:
            fetch = _contiguous_fetch(*inputs, x_smem, tile)
        else:
            fetch = gather_fetch(*inputs, x_smem, tile, segment, gather)

        def compute(slot):
            _quantize_tile(
                x_smem.at[slot],
                data_smem.at[slot],
                scale_smem.at[slot, pl.ds(0, tile)],
                1,
                layout,
                fmt,
                arithmetic,
            )

        def store(t, slot):
            plgpu.copy_smem_to_gmem(
                data_smem.at[slot], data_gmem.at[pl.ds(t * tile, tile)], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                scale_smem.at[slot, pl.ds(0, tile)],
                scale_gmem.at[pl.ds(t * tile, tile)],
                commit_group=False,
            )

        pipeline(num_tiles, ctas, loaded, fetch, compute, store)

    return plgpu.kernel(
        quantize_rowwise,
        kernel_name="quantize_rowwise" if gather is None else "dispatch_quantize",
        out_type=(
            jax.ShapeDtypeStruct((num_blocks, BLOCK_SIZE), fmt.dtype),
            jax.ShapeDtypeStruct((num_tiles * tile,), jnp.uint8),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, tile, BLOCK_SIZE), dtype),
            plgpu.SMEM((STAGES, tile, BLOCK_SIZE), fmt.dtype),
            plgpu.SMEM((STAGES, scale_slot), jnp.uint8),
            plgpu.Barrier(
                num_arrivals=1 if gather is None else tile // segment, num_barriers=STAGES
            ),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )


def quantize_columnwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None):
    """(data [M, K], scale [M/32, K] uint8) of x [M, K] (bf16/fp32) with blocks along M;
    M % 32 == 0 and K % 16 == 0."""
    arithmetic = arithmetic or default_arithmetic()
    _check(columnwise_problem(x.shape, x.dtype), fmt, arithmetic)
    m, k = x.shape
    data, scale = _columnwise_kernel(m, k, jnp.dtype(x.dtype), fmt, arithmetic, interpret)(x)
    return data, scale[:, :k]


@functools.cache
def _columnwise_kernel(m, k, dtype, fmt_name, arithmetic, interpret):
    """Kernel for columnwise blocks of x [m, k]: tile t is the [32, width] window at block row
    t // col_tiles, column tile t % col_tiles. The scales [m / 32, col_tiles * width] are whole
    tiles wide (the caller slices): a one-row uint8 TMA store clipped at the end of a row wrote
    its clipped bytes into the next row on the H200 (2026-11-29)."""
    fmt = FORMATS[fmt_name]
    width = tile_elems(dtype)
    col_tiles = cdiv(k, width)
    num_tiles = m // BLOCK_SIZE * col_tiles
    ctas = num_ctas(num_tiles)
    layout = _columnwise_layout(dtype)

    def window(t):
        row, col = t // col_tiles, t % col_tiles
        return row, pl.ds(row * BLOCK_SIZE, BLOCK_SIZE), pl.ds(col * width, width)

    def quantize_columnwise(x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, loaded):
        def fetch(t):
            _, rows, cols = window(t)

            def issue(slot, barrier):
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem.at[slot], barrier)

            return issue

        def compute(slot):
            _quantize_tile(
                x_smem.at[slot],
                data_smem.at[slot],
                scale_smem.at[slot, 0],
                0,
                layout,
                fmt,
                arithmetic,
            )

        def store(t, slot):
            row, rows, cols = window(t)
            plgpu.copy_smem_to_gmem(
                data_smem.at[slot], data_gmem.at[rows, cols], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                scale_smem.at[slot], scale_gmem.at[pl.ds(row, 1), cols], commit_group=False
            )

        pipeline(num_tiles, ctas, loaded, fetch, compute, store)

    return plgpu.kernel(
        quantize_columnwise,
        kernel_name="quantize_columnwise",
        out_type=(
            jax.ShapeDtypeStruct((m, k), fmt.dtype),
            jax.ShapeDtypeStruct((m // BLOCK_SIZE, col_tiles * width), jnp.uint8),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, BLOCK_SIZE, width), dtype),
            plgpu.SMEM((STAGES, BLOCK_SIZE, width), fmt.dtype),
            plgpu.SMEM((STAGES, 1, width), jnp.uint8),
            plgpu.Barrier(num_barriers=STAGES),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
