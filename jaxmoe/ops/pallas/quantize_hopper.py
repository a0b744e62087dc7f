"""Quantize kernels for Hopper (Pallas Mosaic GPU): MXFP8, bitwise equal to
`jaxmoe.mxfp8.quantize` (rowwise, columnwise, and the dispatch gather fused with a rowwise
quantize), and FP8 blockwise 1 x 128, bitwise equal to `jaxmoe.fp8_blockwise.quantize_1x128`
(along the rows, also fused with the gather: the same kernels with another `Scaling`; and along
the tokens, 128 rows a block).

The scale uses the reference's integer rule (`jaxmoe.mxfp8.e8m0_from_amax_bits`, an E8M0 byte;
`jaxmoe.fp8_blockwise.scale_exponent_from_amax_bits`, an fp32 power of two). The elements are
encoded with `arithmetic=`:
  "exact"  the reference's integer emulation (`jaxmoe.mxfp8.encode_elements`): no float op meets
           a denormal, so it is bit-exact under XLA:CPU's flush-to-zero too (the interpreter);
  "float"  TE's own arithmetic: RN_fp32(x * 2^(127-e)), clipped to +-max, then the hardware
           fp32 -> fp8 convert. Fewer instructions; exact on the GPU, which keeps denormals.
           Compiled for the GPU the clip is left to the convert, which saturates
           (`checked_arithmetic`).
  "float_clipped"  "float" with the clip kept on the GPU too (the interpreter's form of
           "float"): the same bits; it measures what the clip costs.
Bandwidth-bound: tiles stream through `row_pipeline`. Scales come out compact ([M, K/32] or
[M/32, K]; FP8 blockwise [M, K/128] or [M/128, K]); `jaxmoe.mxfp8.swizzle_scales` makes the
MXFP8 GEMM layout.
docs/kernels/quantize.md describes the design."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

from jaxmoe import fp8_blockwise
from jaxmoe.ints import cdiv, round_up
from jaxmoe.mxfp8 import (
    BLOCK_SIZE,
    FORMATS,
    FP32_ABS_MASK,
    FP32_INF_BITS,
    decode_elements,
    e8m0_from_amax_bits,
    encode_elements,
    float32_bits,
    reciprocal_scale_bits,
    scale_multipliers,
)
from jaxmoe.ops.device import compiled_for_gpu, on_gpu
from jaxmoe.ops.pallas.hopper import TMA_SMEM_ALIGN
from jaxmoe.ops.pallas.row_pipeline import (
    COMPILER_PARAMS,
    CTAS_PER_SM,
    STAGES,
    gather_fetch,
    gather_plan,
    num_ctas,
    pipeline,
    split_pipeline,
    tile_elems,
)

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

ARITHMETIC = ("exact", "float", "float_clipped")
COPY = ("data", "scale")  # a rowwise kernel's outputs: the quantized copy


def default_arithmetic() -> str:
    """ "float" on a GPU, "exact" elsewhere (the CPU interpreter flushes denormals)."""
    return "float" if on_gpu() else "exact"


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How a kernel scales its blocks: the block width, the scale's dtype and rule. A block is
    encoded as x / 2^(e - 127) for an exponent e (`exponent`, from the bits of the block's
    amax) and `stored(e)` is what the scale output holds."""

    name: str
    block: int
    scale_dtype: jnp.dtype

    def exponent(self, amax_bits, fmt):
        if self.name == "mxfp8":
            return e8m0_from_amax_bits(amax_bits, fmt)
        return 127 - fp8_blockwise.scale_exponent_from_amax_bits(amax_bits, fmt)

    def stored(self, e):
        if self.name == "mxfp8":
            return e.astype(jnp.uint8)  # the E8M0 byte
        return scale_multipliers(e)  # scale_inv = 2^(e - 127), an fp32 power of two


MXFP8 = Scaling("mxfp8", BLOCK_SIZE, jnp.dtype(jnp.uint8))
FP8_BLOCKWISE = Scaling("fp8_blockwise", fp8_blockwise.BLOCK, jnp.dtype(jnp.float32))


def rowwise_layout(dtype, block=BLOCK_SIZE):
    """Register layout of a [tile, block] tile whose rows are blocks: block/v consecutive lanes
    hold a row as 16-byte vectors of v elements each; a warp holds r = 32v/block rows, the
    warpgroup 4r (tiling (4r, block) / (r, block) / (v,): warps, lanes (row, vector),
    vector). MXFP8 bf16: 4 lanes a row, 8 rows a warp; 1 x 128 bf16: 16 lanes, 2 rows."""
    v = 16 // jnp.dtype(dtype).itemsize
    rows = 32 * v // block
    if rows == 1:  # a row a warp (1 x 128 fp32): Mosaic's canonical form drops the unit tile
        return plgpu.Layout.TILED(
            plgpu.Tiling(((4, block), (v,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
        )
    return plgpu.Layout.TILED(
        plgpu.Tiling(((4 * rows, block), (rows, block), (v,))),
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


def block_amax_bits(bits, axis):
    """max |x| over `axis` on the fp32 bits (monotone in |x|), NaNs counted as 0
    (`magnitude_bits`' integer form)."""
    return jnp.max(magnitude_bits(bits), axis=axis)


# |x| for fp32 bits x, NaN as +0: PTX max returns the operand that is not NaN.
_MAGNITUDE = """{
.reg .f32 t;
abs.f32 t, $1;
max.f32 $0, t, 0f00000000;
}"""


def magnitude_bits(bits, layout=None):
    """The fp32 bits of |x| for the fp32 bits `bits` (uint32), NaN as 0: ordered as |x| (a
    block's amax is their integer max). With `layout`, bits' register layout in a kernel
    compiled for the GPU: one PTX float max of |x| and 0 an element (`_MAGNITUDE`); without
    (the interpreter, which cannot run PTX): a mask, a compare and a select. The same bits."""
    if layout is None:
        magnitudes = bits & FP32_ABS_MASK
        return jnp.where(magnitudes > FP32_INF_BITS, jnp.uint32(0), magnitudes)

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(bits.shape, jnp.uint32, layout=layout),
    )
    def magnitudes(_, words: mgpu.FragmentedArray):
        i32 = ir.IntegerType.get_signless(32)
        out = np.empty_like(words.registers)
        magnitude = lambda word: llvm.inline_asm(i32, [word], _MAGNITUDE, "=r,r")  # noqa: E731
        for index, register in np.ndenumerate(words.registers):
            if not isinstance(register.type, ir.VectorType):
                out[index] = magnitude(register)
                continue
            result = llvm.mlir_undef(register.type)
            for lane in range(ir.VectorType(register.type).shape[0]):
                word = magnitude(vector.extract(register, [], [lane]))
                result = vector.insert(word, result, [], [lane])
            out[index] = result
        return mgpu.FragmentedArray(_registers=out, _layout=words.layout, _is_signed=False)

    return magnitudes(bits)


def spread_blocks(per_block, shape, axis, layout):
    """Per-block values (`shape` reduced along `axis`) broadcast over their blocks' elements."""
    return plgpu.layout_cast(lax.broadcast_in_dim(per_block, shape, (1 - axis,)), layout)


def encode_blocks(bits, e, axis, layout, fmt, arithmetic):
    """fp8 elements of the fp32 bits `bits` (in `layout`) with the scale bytes `e` (int32, one
    per block: `bits` reduced along `axis`). Per-block values are computed before they are
    spread over the block's elements."""

    spread = lambda per_block: spread_blocks(per_block, bits.shape, axis, layout)
    if arithmetic == "exact":
        return encode_elements(bits, spread(e), fmt)
    scale = reciprocal_scale_bits(e)  # per block, then spread
    y = lax.bitcast_convert_type(bits, jnp.float32) * spread(
        lax.bitcast_convert_type(scale, jnp.float32)
    )
    if arithmetic == "float_clipped":
        y = jnp.clip(y, -fmt.max_normal, fmt.max_normal)
    return y.astype(fmt.dtype)


def _quantize_tile(
    x_smem, data_smem, scale_smem, axis, layout, fmt, arithmetic, scaling=MXFP8, values_smem=None
):
    """Quantize the SMEM tile `x_smem` (blocks of scaling.block along `axis`) into `data_smem`
    (fp8, same shape; None: not stored) and `scale_smem` (one scale per block, in order; None:
    not stored). MXFP8 only: `values_smem` (x's dtype) receives the blocks' dequantized values,
    `jaxmoe.mxfp8.dequantize`'s bits (on the integer bits with the "exact" arithmetic, else by
    the float multiply, as XLA's dequantization on a GPU)."""
    bits = float32_bits(plgpu.load(x_smem, layout=layout))
    e = scaling.exponent(block_amax_bits(bits, axis), fmt)
    if scale_smem is not None:
        scale_smem[...] = scaling.stored(e)
    data = encode_blocks(bits, e, axis, layout, fmt, arithmetic)
    if data_smem is not None:
        data_smem[...] = data
    if values_smem is not None:
        if scaling is not MXFP8:
            raise ValueError("quantize kernel: dequantized values are made for MXFP8 only")
        spread = lambda per_block: spread_blocks(per_block, bits.shape, axis, layout)
        if arithmetic == "exact":
            values = decode_elements(data, spread(e), values_smem.dtype)
        else:
            values = data.astype(jnp.float32) * spread(scale_multipliers(e))
        values_smem[...] = values.astype(values_smem.dtype)


def kernel_problem(what, shape, dtype, needs, recipe="MXFP8") -> str | None:
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
                f"{recipe} {what} quantize kernel: needs {need}, got {tuple(shape)} "
                f"{jnp.dtype(dtype).name}"
            )
    return None


def rowwise_problem(shape, dtype, scaling=MXFP8) -> str | None:
    """Why `quantize_rowwise_pallas` (`quantize_1x128_pallas` for FP8_BLOCKWISE) cannot take an
    input of this shape/dtype (None: it can)."""
    b = scaling.block
    return kernel_problem(
        "rowwise", shape, dtype, [(f"K % {b} == 0", lambda m, k: k % b == 0)], _recipe(scaling)
    )


def _recipe(scaling):
    return "MXFP8" if scaling is MXFP8 else "FP8 blockwise"


def columnwise_problem(shape, dtype) -> str | None:
    """Why `quantize_columnwise_pallas` cannot take an input of this shape/dtype (None: it can).
    K % 16: the fp8 rows must be whole 16-byte chunks (TMA strides, clipped stores)."""
    return kernel_problem(
        "columnwise",
        shape,
        dtype,
        [
            (f"M % {BLOCK_SIZE} == 0", lambda m, k: m % BLOCK_SIZE == 0),
            ("K % 16 == 0", lambda m, k: k % 16 == 0),
        ],
    )


def columnwise_1x128_problem(shape, dtype) -> str | None:
    """Why `quantize_1x128_columnwise_pallas` cannot take an input of this shape/dtype (None:
    it can). K % 16: the fp8 rows must be whole 16-byte chunks (TMA strides, clipped stores)."""
    return kernel_problem(
        "columnwise",
        shape,
        dtype,
        [
            (f"M % {FP8_BLOCKWISE.block} == 0", lambda m, k: m % FP8_BLOCKWISE.block == 0),
            ("K % 16 == 0", lambda m, k: k % 16 == 0),
        ],
        "FP8 blockwise",
    )


def gather_problem(shape, dtype, num_rows, scaling=MXFP8) -> str | None:
    """Why `gather_quantize_rowwise_pallas` (`gather_quantize_1x128_pallas` for FP8_BLOCKWISE)
    cannot gather num_rows rows of x of this shape/dtype (None: it can): a row must be whole
    blocks and a whole number of 128 bytes (`row_pipeline.gather_plan`)."""
    multiple = max(scaling.block, TMA_SMEM_ALIGN // jnp.dtype(dtype).itemsize)
    return kernel_problem(
        "gather",
        shape,
        dtype,
        [
            (f"K % {multiple} == 0", lambda t, k: k % multiple == 0),
            ("at least one row to gather", lambda t, k: num_rows > 0),
        ],
        _recipe(scaling),
    )


def checked_arithmetic(problem, fmt, arithmetic, interpret) -> str:
    """The arithmetic a kernel is built with, for a call with `arithmetic` (None:
    `default_arithmetic()`) and `interpret`; raises ValueError for a bad arithmetic or format,
    or for the kernel's `problem`. "float" compiled for the GPU is built as "float_satfinite":
    the hardware's fp32 -> fp8 conversion (`cvt.rn.satfinite`) saturates out-of-range values
    and infinities to +-max by itself, so the clip before it goes; the interpreter's conversion
    does not saturate, so there "float" is built as "float_clipped"."""
    arithmetic = arithmetic or default_arithmetic()
    if arithmetic not in ARITHMETIC:
        raise ValueError(
            f"quantize kernel: arithmetic must be one of {ARITHMETIC}, got {arithmetic!r}"
        )
    if fmt not in FORMATS:
        raise ValueError(f"quantize kernel: unknown format {fmt!r}")
    if problem:
        raise ValueError(problem)
    if arithmetic == "float":
        return "float_satfinite" if compiled_for_gpu(interpret) else "float_clipped"
    return arithmetic


def quantize_rowwise_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None):
    """(data [M, K], scale [M, K/32] uint8) of x [M, K] (bf16/fp32) with blocks along K;
    K % 32 == 0, any M."""
    return _quantize_rowwise(x, fmt, arithmetic, interpret, MXFP8)


def quantize_1x128_pallas(x: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None):
    """(data [M, K], scale_inv [M, K/128] fp32) of x [M, K] (bf16/fp32) in FP8-blockwise 1 x 128
    blocks along K (`jaxmoe.fp8_blockwise.quantize_1x128(x, -1)`'s bits); K % 128 == 0, any M."""
    return _quantize_rowwise(x, fmt, arithmetic, interpret, FP8_BLOCKWISE)


def _quantize_rowwise(x, fmt, arithmetic, interpret, scaling):
    arithmetic = checked_arithmetic(
        rowwise_problem(x.shape, x.dtype, scaling), fmt, arithmetic, interpret
    )
    m, k = x.shape
    b = scaling.block
    num_blocks = m * k // b
    kernel = _rowwise_kernel(
        num_blocks, jnp.dtype(x.dtype), fmt, arithmetic, interpret, None, scaling
    )
    data, scale = kernel(x.reshape(num_blocks, b))
    return data.reshape(m, k), scale[:num_blocks].reshape(m, k // b)


def gather_quantize_rowwise_pallas(
    x: jax.Array,
    row_token: jax.Array,
    fmt: str = "e4m3",
    *,
    per_token: int = 1,
    arithmetic=None,
    interpret=None,
):
    """Dispatch and quantize in one pass: row r of the result is x[row_token[r]] quantized with
    blocks along K, or zeros (data 0, scale byte 0) where row_token[r] == T (a padding row).
    Returns (data [M, K], scale [M, K/32]), bitwise equal to quantizing the gathered rows.
    Any M; K % 64 == 0 for bf16, K % 32 == 0 for fp32. Tiles load whole token rows or row
    segments (`row_pipeline.gather_plan`). per_token > 1: row_token holds slots, row r is
    x[row_token[r] // per_token] (`jaxmoe.ops.permute.dispatch_rows`)."""
    return _gather_quantize_rowwise(x, row_token, fmt, arithmetic, interpret, MXFP8, per_token)


def gather_quantize_1x128_pallas(
    x: jax.Array,
    row_token: jax.Array,
    fmt: str = "e4m3",
    *,
    per_token: int = 1,
    arithmetic=None,
    interpret=None,
):
    """`gather_quantize_rowwise_pallas` in FP8-blockwise 1 x 128 blocks along K: (data [M, K],
    scale_inv [M, K/128] fp32), bitwise `quantize_1x128` of the gathered rows, a padding row
    being a zero row (data 0, scale_inv 1). K % 128 == 0, any M."""
    return _gather_quantize_rowwise(
        x, row_token, fmt, arithmetic, interpret, FP8_BLOCKWISE, per_token
    )


def gather_fake_quantize_rowwise_pallas(
    x: jax.Array,
    row_token: jax.Array,
    fmt: str = "e4m3",
    *,
    per_token: int = 1,
    arithmetic=None,
    interpret=None,
) -> jax.Array:
    """The values of `gather_quantize_rowwise_pallas`'s copy, without the copy: row r is
    x[row_token[r] // per_token] MXFP8-quantized along K and dequantized to x's dtype (zeros
    where that is T), bitwise `jaxmoe.mxfp8.dequantize` of the gathered rows' quantization.
    Same limits as `gather_quantize_rowwise_pallas`."""
    (values,) = _gather_quantize_rowwise(
        x, row_token, fmt, arithmetic, interpret, MXFP8, per_token, outputs=("values",)
    )
    return values


def _gather_quantize_rowwise(
    x, row_token, fmt, arithmetic, interpret, scaling, per_token=1, outputs=COPY
):
    arithmetic = checked_arithmetic(
        gather_problem(x.shape, x.dtype, row_token.shape[0], scaling), fmt, arithmetic, interpret
    )
    num_tokens, k = x.shape
    (m,) = row_token.shape
    b = scaling.block
    num_blocks = m * k // b
    kernel = _rowwise_kernel(
        num_blocks,
        jnp.dtype(x.dtype),
        fmt,
        arithmetic,
        interpret,
        (num_tokens, m, k // b, per_token),
        scaling,
        outputs,
    )
    out = kernel(row_token.astype(jnp.int32), x.reshape(num_tokens * k // b, b))
    names = [name for name in ("data", "scale", "values") if name in outputs]
    return tuple(
        a[:num_blocks].reshape(m, k // b) if name == "scale" else a.reshape(m, k)
        for name, a in zip(names, out, strict=True)
    )


def _contiguous_fetch(x_gmem, x_smem, tile):
    """Rowwise loads: tile t is blocks [t * tile, (t + 1) * tile) of x, one TMA."""

    def fetch(t):
        def issue(slot, barrier):
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(t * tile, tile)], x_smem.at[slot], barrier)

        return issue

    return fetch


@functools.cache
def _rowwise_kernel(
    num_blocks, dtype, fmt_name, arithmetic, interpret, gather, scaling=MXFP8, outputs=COPY
):
    """Kernel for rowwise blocks of B = scaling.block of x [num_blocks, B] or, with
    gather = (T, M, R, P), of (row_token [M], x [T * R, B]) (`row_pipeline.gather_fetch`). Its
    outputs, in this order, those named in `outputs`: "data" fp8 [num_blocks, B], "scale"
    [num_tiles * tile] (whole tiles, so that their 1-D stores never cross the end; the caller
    slices), "values" [num_blocks, B] in x's dtype (MXFP8 only: the dequantized values)."""
    fmt = FORMATS[fmt_name]
    b = scaling.block
    if gather is None:
        tile, segment = tile_elems(dtype, b), None
    else:
        tile, segment = gather_plan(gather[2] * b, dtype, b)
    num_tiles = cdiv(num_blocks, tile)
    ctas = num_ctas(num_tiles)
    layout = rowwise_layout(dtype, b)
    # A TMA reads each slot: 128-byte aligned.
    scale_slot = round_up(tile * scaling.scale_dtype.itemsize, TMA_SMEM_ALIGN)
    scale_slot //= scaling.scale_dtype.itemsize
    shapes = {
        "data": ((num_blocks, b), (tile, b), fmt.dtype),
        "scale": ((num_tiles * tile,), (scale_slot,), scaling.scale_dtype),
        "values": ((num_blocks, b), (tile, b), dtype),
    }
    names = [name for name in shapes if name in outputs]
    # Values as wide as x: two output slots keep the ring of STAGES loads within the shared
    # memory of CTAS_PER_SM CTAs an SM.
    out_slots = 2 if "values" in outputs else STAGES

    def quantize_rowwise(*refs):
        num_inputs, num_outputs = (1 if gather is None else 2), len(names)
        inputs, refs = refs[:num_inputs], refs[num_inputs:]
        out_gmem = dict(zip(names, refs[:num_outputs]))
        x_smem, *smem, loaded = refs[num_outputs:]
        out_smem = dict(zip(names, smem))
        if gather is None:
            fetch = _contiguous_fetch(*inputs, x_smem, tile)
        else:
            fetch = gather_fetch(*inputs, x_smem, tile, segment, gather)
        tiles = lambda name, slot: (
            out_smem[name].at[slot, pl.ds(0, tile)] if name == "scale" else out_smem[name].at[slot]
        )

        def compute(slot, out):
            stored = {name: tiles(name, out) for name in names}
            _quantize_tile(
                x_smem.at[slot],
                stored.get("data"),
                stored.get("scale"),
                1,
                layout,
                fmt,
                arithmetic,
                scaling,
                stored.get("values"),
            )

        def store(t, out):
            for name in names:
                plgpu.copy_smem_to_gmem(
                    tiles(name, out), out_gmem[name].at[pl.ds(t * tile, tile)], commit_group=False
                )

        split_pipeline(num_tiles, ctas, loaded, fetch, compute, store, STAGES, out_slots)

    kind = "quantize_rowwise" if gather is None else "dispatch_quantize"
    if outputs == ("values",):
        kind = "dispatch_fake_quantize"
    return plgpu.kernel(
        quantize_rowwise,
        kernel_name=kind + ("" if scaling is MXFP8 else "_1x128"),
        out_type=tuple(jax.ShapeDtypeStruct(shapes[n][0], shapes[n][2]) for n in names),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((STAGES, tile, b), dtype),
            *(plgpu.SMEM((out_slots, *shapes[n][1]), shapes[n][2]) for n in names),
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
    arithmetic = checked_arithmetic(
        columnwise_problem(x.shape, x.dtype), fmt, arithmetic, interpret
    )
    m, k = x.shape
    data, scale = _columnwise_kernel(m, k, jnp.dtype(x.dtype), fmt, arithmetic, interpret)(x)
    return data, scale[:, :k]


def quantize_1x128_columnwise_pallas(
    x: jax.Array, fmt: str = "e4m3", *, arithmetic=None, interpret=None
):
    """(data [M, K], scale_inv [M/128, K] fp32) of x [M, K] (bf16/fp32) in FP8-blockwise
    1 x 128 blocks along M (`jaxmoe.fp8_blockwise.quantize_1x128(x, 0)`'s bits: the weight
    gradient's copies along the tokens); M % 128 == 0 and K % 16 == 0."""
    arithmetic = checked_arithmetic(
        columnwise_1x128_problem(x.shape, x.dtype), fmt, arithmetic, interpret
    )
    m, k = x.shape
    kernel = _columnwise_kernel(m, k, jnp.dtype(x.dtype), fmt, arithmetic, interpret, FP8_BLOCKWISE)
    data, scale_inv = kernel(x)
    return data, scale_inv[:, :k]


# (ring slots, CTAs a SM) of the columnwise kernel: a 1 x 128 tile is four MXFP8 tiles.
_COLUMNWISE_RING = {"mxfp8": (STAGES, CTAS_PER_SM), "fp8_blockwise": (2, 1)}


@functools.cache
def _columnwise_kernel(m, k, dtype, fmt_name, arithmetic, interpret, scaling=MXFP8):
    """Kernel for blocks of B = scaling.block rows of x [m, k]: tile t is the [B, width] window
    at block row t // col_tiles, column tile t % col_tiles. The layout holds 32 rows, so a
    1 x 128 tile is taken as four 32-row parts: their amaxes first (each thread's own columns,
    no shuffle), then each part encoded with the block's scale. The scales
    [m / B, col_tiles * width] are whole tiles wide (the caller slices): a one-row uint8 TMA
    store clipped at the end of a row wrote its clipped bytes into the next row on the H200."""
    fmt = FORMATS[fmt_name]
    block = scaling.block
    width = tile_elems(dtype)
    col_tiles = cdiv(k, width)
    num_tiles = m // block * col_tiles
    stages, per_sm = _COLUMNWISE_RING[scaling.name]
    ctas = num_ctas(num_tiles, per_sm)
    layout = _columnwise_layout(dtype)

    def window(t):
        row, col = t // col_tiles, t % col_tiles
        return row, pl.ds(row * block, block), pl.ds(col * width, width)

    def quantize_columnwise(x_gmem, data_gmem, scale_gmem, x_smem, data_smem, scale_smem, loaded):
        def fetch(t):
            _, rows, cols = window(t)

            def issue(slot, barrier):
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem.at[slot], barrier)

            return issue

        def compute(slot):
            if block == BLOCK_SIZE:
                tile = (x_smem.at[slot], data_smem.at[slot], scale_smem.at[slot, 0])
                _quantize_tile(*tile, 0, layout, fmt, arithmetic, scaling)
                return
            parts = [pl.ds(p * BLOCK_SIZE, BLOCK_SIZE) for p in range(block // BLOCK_SIZE)]
            bits = lambda part: float32_bits(plgpu.load(x_smem.at[slot, part], layout=layout))
            amax = functools.reduce(jnp.maximum, [block_amax_bits(bits(p), 0) for p in parts])
            e = scaling.exponent(amax, fmt)
            scale_smem.at[slot, 0][...] = scaling.stored(e)
            for part in parts:
                data_smem.at[slot, part][...] = encode_blocks(
                    bits(part), e, 0, layout, fmt, arithmetic
                )

        def store(t, slot):
            row, rows, cols = window(t)
            plgpu.copy_smem_to_gmem(
                data_smem.at[slot], data_gmem.at[rows, cols], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                scale_smem.at[slot], scale_gmem.at[pl.ds(row, 1), cols], commit_group=False
            )

        pipeline(num_tiles, ctas, loaded, fetch, compute, store, stages)

    return plgpu.kernel(
        quantize_columnwise,
        kernel_name="quantize_columnwise" + ("" if scaling is MXFP8 else "_1x128"),
        out_type=(
            jax.ShapeDtypeStruct((m, k), fmt.dtype),
            jax.ShapeDtypeStruct((m // block, col_tiles * width), scaling.scale_dtype),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((stages, block, width), dtype),
            plgpu.SMEM((stages, block, width), fmt.dtype),
            plgpu.SMEM((stages, 1, width), scaling.scale_dtype),
            plgpu.Barrier(num_barriers=stages),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
