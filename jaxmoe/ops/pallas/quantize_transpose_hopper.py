"""FP8-blockwise quantize kernels for Hopper (Pallas Mosaic GPU) that also write the transposed
copies the fp8 GEMMs read (Hopper's fp8 wgmma takes both operands K-major), in one pass over
the input, bitwise equal to `jaxmoe.fp8_blockwise`:

  quantize_128x128_pallas                weights [G, K, N] in 128 x 128 blocks: data, scale_inv
                                         (`quantize_128x128`) and the data swapped to [G, N, K]
  quantize_1x128_with_transpose_pallas   activations x [M, K]: `quantize_1x128(x, 1)` and
                                         `quantize_1x128(x.T, 1)` (x^T in 1 x 128 blocks along M)
  quantize_1x128_transposed_pallas       the second alone
  requantize_1x128_transposed_pallas     the second of an fp8 copy's values (1 x 128 blocks
                                         along K, e.g. the dispatched tokens), read as fp8

A persistent CTA (one warpgroup) walks 128 x 128 input tiles through a TMA ring
(`row_pipeline.split_pipeline`): each tile is loaded once, quantized in registers with
`quantize_hopper`'s helpers (the reference's integer scale rule; "exact" or "float" element
arithmetic), and every output tile is stored once by TMA. The registers hold 32 rows at a time,
a row a warp (4 elements a lane, whatever the input dtype: the per-column amax then crosses the
warps in 128-bit pieces, as Mosaic's cross-warp reduction needs; a row's amax is one redux.sync).
Every kernel takes a `TransposeQuantizeConfig`: up to 4 CTAs an SM, fewer output slots than
input slots (`row_pipeline.split_pipeline`), C in the output slot, the tile kept in registers
for the column encode, and for the activations' two-copy kernel the rowwise copy encoded while
the wgmma transposes; the bits are the same under every one. Every kernel runs
`default_transpose_config` when given none, the fastest measured one that fits (docs/kernels/quantize.md).

The transpose. TMA cannot transpose, Mosaic's register transposes (`WGMMA_TRANSPOSED_LAYOUT`,
`FragmentedArray.to_layout`) are for 16- and 32-bit elements, and an SMEM access through a
transposed view must keep its vector dimension contiguous: an fp8 transpose through SMEM would
be one byte an access, with bank conflicts. The tensor core transposes instead: the tile's
bytes C, written row-major (int8) into 128-byte-swizzled SMEM, are the K-major B operand of an
8-bit integer wgmma whose A operand is the identity (in registers, built once per CTA):
D[m, n] = sum_k I[m, k] C[n, k] = C[n, m], exact in the s32 accumulator, whose low bytes are
C^T's bytes. An fp8 wgmma would not be exact: a NaN byte (0x7F) times 0 is NaN across a whole
row of D, and -0 plus the +0 products is +0. Eight m64n128k32 instructions a tile, in two
halves of 64 rows; each half's bytes are written to an int8 SMEM tile (2-byte stores,
conflict-free under the swizzle) that TMA stores to the transposed position (the wrappers
bitcast the bytes to fp8). C has one SMEM buffer (the wgmma has read it when the half is done)
and the output tiles are ring slots; or ("in_place") C is written into the output slot itself,
both halves' D are held in registers (16 a thread each, as bytes) until a warpgroup barrier
after both wgmmas, then written over C. (Aliasing C and its output tile through a
`plgpu.RefUnion` instead does not pass the interpreter's race detector, which checks a union's
views against each other as wholes, so a ring slot's writes race with another slot's TMA store
there; C and D of one dtype in one slot need no union.)

Scales: the kernels write the activation scales where they are contiguous per tile ([K/128, M]
for the rowwise copy, [M/128, K] for the transposed one: the layouts the fprop/dgrad and wgrad
kernels read) and return them transposed to the reference's layout (a caller that transposes
them back lets XLA cancel the two transposes); a weight tile's one scale is stored as a scalar.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.fp8_blockwise import BLOCK
from jaxmoe.mxfp8 import FORMATS, float32_bits
from jaxmoe.ops.device import compiled_for_gpu
from jaxmoe.ops.pallas.gmm_common import swizzled
from jaxmoe.ops.pallas.hopper import SMEM_PER_SM, SMEM_RESERVED_PER_CTA
from jaxmoe.ops.pallas.quantize_hopper import (
    FP8_BLOCKWISE,
    checked_arithmetic,
    encode_blocks,
    kernel_problem,
    magnitude_bits,
    rowwise_layout,
)
from jaxmoe.ops.pallas.row_pipeline import live_input, live_tiles, num_ctas, split_pipeline

_LAYOUT = rowwise_layout(jnp.float32, BLOCK)  # a row a warp, 4 consecutive elements a lane
_PART = 32  # tile rows in registers at a time
_PARTS = [pl.ds(p * _PART, _PART) for p in range(BLOCK // _PART)]
_WGMMA_M = 64  # rows of a Hopper wgmma instruction
_HALVES = [pl.ds(h * _WGMMA_M, _WGMMA_M) for h in range(BLOCK // _WGMMA_M)]
BYTE_TILE = swizzled(jnp.int8, BLOCK)  # SMEM transforms of a tile of 128-byte rows
# A cross-warp max of [128] uint32 (the column amax): 4 warps x 32 lanes x 16 bytes.
REDUCTION_SCRATCH = 4 * 32 * 16
COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Lane,
    unsafe_no_auto_barriers=True,
    reduction_scratch_bytes=REDUCTION_SCRATCH,
)
_MAX_STAGES = 4
_FP8_INPUTS = tuple(jnp.dtype(f.dtype) for f in FORMATS.values())
_DEQUANTIZED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SMEM_SLACK = 1024  # barriers and the alignment of the allocations
TRANSPOSES = ("separate", "in_place")
COLUMN_SOURCES = ("smem", "registers")
ROWWISE_ENCODES = ("first_pass", "under_wgmma")


@dataclasses.dataclass(frozen=True)
class TransposeQuantizeConfig:
    """How the activations' transposing kernels (`quantize_1x128_with_transpose_pallas`,
    `quantize_1x128_transposed_pallas`) run; their bits never depend on it. The field defaults
    are the kernel as first written (one CTA an SM, the byte tile C in its own buffer, the
    column encode re-reading the tile from SMEM), which fits every input dtype; the kernels'
    default is `default_transpose_config`. docs/kernels/quantize.md describes and measures each one.

    ctas_per_sm    1 to 4 persistent CTAs of one warpgroup an SM, sharing its shared memory
                   (227, 113, 75, 56 KB a CTA: checked here) and its registers (255, 255, 170,
                   128 a thread: not checked before ptxas allocates them; a CTA that does not
                   fit runs in a second wave, which a benchmark shows as a slow variant).
    slots          input ring slots (tiles loading while one computes); None: as many as fit
                   next to the output slots, at most 4.
    output_slots   buffers for the outputs of a tile (stored by TMA while the next tiles
                   compute); None: as many as `slots` (both None: equal, as many as fit).
    transpose      "separate": the encoded bytes C have a buffer of their own; "in_place": C
                   is written into the transposed output slot, both wgmma halves read it into
                   registers, then D overwrites it (16 KB less SMEM a CTA).
    column_source  "smem": the column encode loads the tile from SMEM again; "registers": the
                   tile's four 32-row parts stay in registers from the first pass.
    rowwise_encode (the two-copy kernel) "first_pass": the rowwise copy is encoded in the pass
                   that takes the column amax; "under_wgmma": the first pass takes the column
                   amax alone, and the rowwise copy is encoded while the transposing wgmma
                   runs, the top half's 64 rows under the first instruction group, the bottom
                   half's under the second.
    """

    ctas_per_sm: int = 1
    slots: int | None = None
    output_slots: int | None = None
    transpose: str = "separate"
    column_source: str = "smem"
    rowwise_encode: str = "first_pass"

    def __post_init__(self):
        choices = dict(
            ctas_per_sm=(1, 2, 3, 4),
            transpose=TRANSPOSES,
            column_source=COLUMN_SOURCES,
            rowwise_encode=ROWWISE_ENCODES,
        )
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"TransposeQuantizeConfig.{field} must be one of {allowed}, got "
                    f"{getattr(self, field)!r}"
                )
        for field in ("slots", "output_slots"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"TransposeQuantizeConfig.{field} must be a positive int or None, got {value!r}"
                )

    @property
    def smem_budget(self) -> int:
        """Bytes of shared memory one CTA may allocate."""
        return SMEM_PER_SM // self.ctas_per_sm - SMEM_RESERVED_PER_CTA

    def ring(self, input_bytes: int, output_bytes: int, fixed_bytes: int) -> tuple[int, int]:
        """(slots, output_slots) for slots of `input_bytes`, output slots of `output_bytes` and
        `fixed_bytes` more; ValueError where they do not fit `smem_budget`."""
        free = self.smem_budget - fixed_bytes
        slots, outputs = self.slots, self.output_slots
        if slots is None and outputs is None:
            slots = outputs = min(_MAX_STAGES, free // (input_bytes + output_bytes))
        elif slots is None:
            slots = min(_MAX_STAGES, (free - outputs * output_bytes) // input_bytes)
        elif outputs is None:
            outputs = slots
        need = fixed_bytes + max(slots, 1) * input_bytes + max(outputs, 1) * output_bytes
        if slots < 1 or outputs < 1 or need > self.smem_budget:
            raise ValueError(
                f"{self}: {max(slots, 1)} input slots of {input_bytes} bytes and "
                f"{max(outputs, 1)} output slots of {output_bytes} (+{fixed_bytes}) need "
                f"{need} bytes of shared memory, more than a CTA's {self.smem_budget} at "
                f"{self.ctas_per_sm} CTA(s) an SM"
            )
        return slots, outputs


def default_transpose_config(dtype) -> TransposeQuantizeConfig:
    """The config every kernel runs when given none. 2-byte inputs: two CTAs an SM,
    two input slots and one output slot, C in place, the column encode from registers (faster
    than the field defaults for both copies, the transposed copy alone and the weights; the
    kernel experiments in docs/notes/). fp32 tiles do not fit two CTAs' shared memory: one CTA,
    the field defaults."""
    if jnp.dtype(dtype).itemsize > 2:
        return TransposeQuantizeConfig()
    return TransposeQuantizeConfig(
        ctas_per_sm=2, slots=2, output_slots=1, transpose="in_place", column_source="registers"
    )


def weights_problem(shape, dtype) -> str | None:
    """Why `quantize_128x128_pallas` cannot take weights of this shape/dtype (None: it can)."""
    if len(shape) != 3 or not shape[0]:
        return (
            "FP8 blockwise 128x128 quantize kernel: needs a [G, K, N] array with G > 0, got "
            f"{tuple(shape)}"
        )
    return kernel_problem(
        "128x128",
        shape[1:],
        dtype,
        [(f"K and N multiples of {BLOCK}", lambda k, n: k % BLOCK == 0 and n % BLOCK == 0)],
        "FP8 blockwise",
    )


def transpose_problem(shape, dtype) -> str | None:
    """Why `quantize_1x128_with_transpose_pallas` and `quantize_1x128_transposed_pallas` cannot
    take x of this shape/dtype (None: they can)."""
    return kernel_problem(
        "1x128 transpose",
        shape,
        dtype,
        [(f"M and K multiples of {BLOCK}", lambda m, k: m % BLOCK == 0 and k % BLOCK == 0)],
        "FP8 blockwise",
    )


def requantize_problem(shape, dtype, scale_shape, scale_dtype, dequantized_dtype) -> str | None:
    """Why `requantize_1x128_transposed_pallas` cannot take a copy of this shape/dtype with
    these multipliers (None: it can)."""
    if (
        len(shape) != 2
        or jnp.dtype(dtype) not in _FP8_INPUTS
        or shape[0] <= 0
        or shape[0] % BLOCK
        or shape[1] <= 0
        or shape[1] % BLOCK
        or tuple(scale_shape) != (shape[0], shape[1] // BLOCK)
        or jnp.dtype(scale_dtype) != jnp.float32
        or jnp.dtype(dequantized_dtype) not in _DEQUANTIZED_DTYPES
    ):
        return (
            "FP8 blockwise 1x128 requantize kernel: needs a float8 [M, K] copy in 1 x 128 blocks "
            f"along K (M, K multiples of {BLOCK}) with fp32 multipliers [M, K/{BLOCK}], "
            f"dequantized to bfloat16 or float32; got {tuple(shape)} {jnp.dtype(dtype).name}, "
            f"multipliers {tuple(scale_shape)} {jnp.dtype(scale_dtype).name}, "
            f"{jnp.dtype(dequantized_dtype).name}"
        )
    return None


def requantize_1x128_transposed_pallas(
    data: jax.Array,
    scale_inv: jax.Array,
    dequantized_dtype,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    config: TransposeQuantizeConfig | None = None,
    live_rows=None,
    interpret=None,
):
    """(data_t [K, M], scale_inv_t [K, M/128]) of the copy x = (data [M, K] float8, scale_inv
    [M, K/128] fp32 multipliers) in 1 x 128 blocks along K: the bits of
    `quantize_1x128(dequantize(x, dequantized_dtype).T, 1)`, the copy of x^T in 1 x 128 blocks
    along M, from one read of the copy (1 byte an element, not the 2 or 4 of its dequantized
    values). `config` and `live_rows` as `quantize_1x128_transposed_pallas`'s."""
    problem = requantize_problem(
        data.shape, data.dtype, scale_inv.shape, scale_inv.dtype, dequantized_dtype
    )
    arithmetic = checked_arithmetic(problem, fmt, arithmetic, interpret)
    m, k = data.shape
    config = config or default_transpose_config(data.dtype)
    kernel = _activations_kernel(
        m,
        k,
        jnp.dtype(data.dtype),
        fmt,
        arithmetic,
        config,
        compiled_for_gpu(interpret),
        interpret,
        rowwise=False,
        dequantized_dtype=jnp.dtype(dequantized_dtype),
        counted=live_rows is not None,
    )
    data_t, scale_column = kernel(data, scale_inv.T, *live_input(live_rows))
    return as_format(data_t, fmt), scale_column.T


def quantize_128x128_pallas(
    w: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    config: TransposeQuantizeConfig | None = None,
    interpret=None,
):
    """(data [G, K, N], scale_inv [G, K/128, N/128] fp32, data_t [G, N, K]) of the weights
    w [G, K, N] (bf16/fp32; K, N multiples of 128): `jaxmoe.fp8_blockwise.quantize_128x128(w)`'s
    bits and its data with the last two axes swapped (the K-major copy the fprop GEMM reads),
    both from one read of w. config: how the kernel runs (`TransposeQuantizeConfig`, its
    rowwise_encode aside: a tile's one scale needs the whole tile's amax first; None:
    `default_transpose_config(w.dtype)`); the bits are the same under every one."""
    arithmetic = checked_arithmetic(weights_problem(w.shape, w.dtype), fmt, arithmetic, interpret)
    g, k, n = w.shape
    config = config or default_transpose_config(w.dtype)
    kernel = _weights_kernel(
        g, k, n, jnp.dtype(w.dtype), fmt, arithmetic, config, compiled_for_gpu(interpret), interpret
    )
    data, scale_inv, data_t = kernel(w.reshape(g * k, n))
    return (
        data.reshape(g, k, n),
        scale_inv.reshape(g, k // BLOCK, n // BLOCK),
        as_format(data_t, fmt).reshape(g, n, k),
    )


def quantize_1x128_with_transpose_pallas(
    x: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    config: TransposeQuantizeConfig | None = None,
    live_rows=None,
    interpret=None,
):
    """((data [M, K], scale_inv [M, K/128]), (data_t [K, M], scale_inv_t [K, M/128])) of
    x [M, K] (bf16/fp32; M, K multiples of 128), from one read of x: the bits of
    `jaxmoe.fp8_blockwise.quantize_1x128(x, 1)` (the GEMM copy, blocks along K) and of
    `quantize_1x128(x.T, 1)` (blocks along M: `quantize_1x128(x, 0)` transposed, the K-major
    copy the weight gradient reads). `config`: how the kernel runs (None:
    `default_transpose_config(x.dtype)`); the bits are the same under every one. live_rows: an
    int32 scalar, or None: only the 128-row bands holding rows below it are quantized, the
    rest of both copies (rows, or columns of the transposed one) left unwritten
    (`jaxmoe.ops.live_rows`)."""
    data, scale_row, data_t, scale_column = _quantize_1x128_transpose(
        x, fmt, arithmetic, config, interpret, rowwise=True, live_rows=live_rows
    )
    return (data, scale_row.T), (data_t, scale_column.T)


def quantize_1x128_transposed_pallas(
    x: jax.Array,
    fmt: str = "e4m3",
    *,
    arithmetic=None,
    config: TransposeQuantizeConfig | None = None,
    live_rows=None,
    interpret=None,
):
    """(data_t [K, M], scale_inv_t [K, M/128]) of x [M, K] (bf16/fp32; M, K multiples of 128):
    `jaxmoe.fp8_blockwise.quantize_1x128(x.T, 1)`'s bits, the transposed copy of
    `quantize_1x128_with_transpose_pallas` alone (`config` and `live_rows` as there)."""
    data_t, scale_column = _quantize_1x128_transpose(
        x, fmt, arithmetic, config, interpret, rowwise=False, live_rows=live_rows
    )
    return data_t, scale_column.T


def _quantize_1x128_transpose(x, fmt, arithmetic, config, interpret, rowwise, live_rows):
    arithmetic = checked_arithmetic(transpose_problem(x.shape, x.dtype), fmt, arithmetic, interpret)
    m, k = x.shape
    config = config or default_transpose_config(x.dtype)
    kernel = _activations_kernel(
        m,
        k,
        jnp.dtype(x.dtype),
        fmt,
        arithmetic,
        config,
        compiled_for_gpu(interpret),
        interpret,
        rowwise,
        counted=live_rows is not None,
    )
    *outputs, data_t, scale_column = kernel(x, *live_input(live_rows))
    return *outputs, as_format(data_t, fmt), scale_column


def as_format(data, fmt):
    """The kernels' int8 bytes as the format's fp8 (a bitcast)."""
    return lax.bitcast_convert_type(data, FORMATS[fmt].dtype)


def _ring(dtype, output_bytes, config, with_row_scales=False):
    """(slots, output slots, SMEM scratch) of a kernel whose input slots hold a tile (with
    `with_row_scales` also the rows' 128 fp32 scales) and whose output slots its transposed
    bytes and `output_bytes` more
    (`config.ring`), next to the reduction scratch and, unless the transpose is in place, the
    byte tile C."""
    tile = BLOCK * BLOCK
    separate = config.transpose == "separate"
    fixed = separate * tile + REDUCTION_SCRATCH + SMEM_SLACK
    input_bytes = tile * dtype.itemsize + with_row_scales * BLOCK * 4
    slots, outputs = config.ring(input_bytes, tile + output_bytes, fixed)
    scratch = dict(
        x_smem=plgpu.SMEM((slots, BLOCK, BLOCK), dtype),
        t_smem=plgpu.SMEM((outputs, BLOCK, BLOCK), jnp.int8, transforms=BYTE_TILE),
        loaded=plgpu.Barrier(num_arrivals=1 + with_row_scales, num_barriers=slots),
    )
    if with_row_scales:
        scratch["input_scale_smem"] = plgpu.SMEM((slots, 1, BLOCK), jnp.float32)
    if separate:
        scratch["c_smem"] = plgpu.SMEM((BLOCK, BLOCK), jnp.int8, transforms=BYTE_TILE)
    return slots, outputs, scratch


def identity_halves():
    """The int8 identity as two [64, 128] halves in registers: the A operands of the
    transposing wgmma."""
    rows, columns = (
        plgpu.broadcasted_iota(jnp.int32, (_WGMMA_M, BLOCK), d, layout=plgpu.Layout.WGMMA_8BIT)
        for d in (0, 1)
    )
    return [(rows + h * _WGMMA_M == columns).astype(jnp.int8) for h in range(len(_HALVES))]


def store_transposed(identity, c_smem, t_smem, in_place=False, under_halves=None):
    """t_smem = C^T for the byte tile C just written to c_smem (int8 both): D = I @ C^T on
    the tensor core (module docstring), 64 rows at a time. `in_place` (c_smem is t_smem): each
    half's D waits in registers until both halves have read C. under_halves: a function a half
    to run while its wgmma does (touching neither C nor t_smem)."""
    plgpu.commit_smem()  # C's stores, visible to the wgmma
    held = []
    for a, rows, work in zip(identity, _HALVES, under_halves or [lambda: None] * len(_HALVES)):

        def product(acc):
            plgpu.wgmma(acc, a, c_smem.T)
            work()
            plgpu.wgmma_wait(0)
            return acc[...]

        d = pl.run_scoped(product, plgpu.ACC((_WGMMA_M, BLOCK), jnp.int32)).astype(jnp.int8)
        if in_place:
            held.append((rows, d))
        else:
            t_smem.at[rows][...] = d
    if in_place:
        plgpu.commit_smem()  # every warp's wgmma has read C before D overwrites it
        for rows, d in held:
            t_smem.at[rows][...] = d


def _smem_parts(x_smem):
    """load(i): part i (`_PARTS`) of the SMEM tile x_smem in registers."""
    return lambda i: plgpu.load(x_smem.at[_PARTS[i]], layout=_LAYOUT)


def _tile_parts(load, config, as_bits=None, convert_once=False):
    """part_bits(i): the fp32 bits (as_bits(values, i); None: the values widened) of part i
    (`_PARTS`) of a tile whose values load(i) gives (from SMEM), loaded again at each call, or
    with `column_source="registers"` loaded once and held (converted once with
    `convert_once`)."""
    as_bits = as_bits or (lambda values, _: float32_bits(values))
    if config.column_source != "registers":
        return lambda i: as_bits(load(i), i)
    if convert_once:
        held = [as_bits(load(i), i) for i in range(len(_PARTS))]
        return lambda i: held[i]
    held = [load(i) for i in range(len(_PARTS))]  # as loaded: bf16 takes half the registers
    return lambda i: as_bits(held[i], i)


def _column_maxima(running, magnitudes):
    """`running` (None at the first part) updated with a part's `magnitude_bits`: the parts
    meet elementwise, so that the column amax crosses the warps once a tile."""
    return magnitudes if running is None else jnp.maximum(running, magnitudes)


def _as_bytes(encoded):
    return lax.bitcast_convert_type(encoded, jnp.int8)


def _tile_fetch(x_gmem, x_smem, input_window):
    """The pipeline's loads: tile t is x_gmem's window (rows, columns) = input_window(t), one
    TMA into x_smem[slot]."""

    def fetch(t):
        rows, columns = input_window(t)

        def issue(slot, barrier):
            plgpu.copy_gmem_to_smem(x_gmem.at[rows, columns], x_smem.at[slot], barrier)

        return issue

    return fetch


def _with_row_scales(fetch, scale_gmem, scale_smem, scale_window):
    """`fetch` that also loads the tile's rows' scales (scale_gmem's row r, columns rows, for
    (r, rows) = scale_window(t)) into the slot's row of scale_smem, on the same barrier."""

    def fetch_both(t):
        issue_tile = fetch(t)
        row, rows = scale_window(t)

        def issue(slot, barrier):
            issue_tile(slot, barrier)
            plgpu.copy_gmem_to_smem(
                scale_gmem.at[pl.ds(row, 1), rows], scale_smem.at[slot], barrier
            )

        return issue

    return fetch_both


def _row_values(scale_smem, i, like):
    """The 32 rows' values of part i in scale_smem [1, 128] fp32, broadcast along the columns of
    `like` (a part in `_LAYOUT`)."""
    scale = plgpu.load(scale_smem.at[0, _PARTS[i]], layout=_LAYOUT.reduce(1))
    return plgpu.layout_cast(lax.broadcast_in_dim(scale, like.shape, (0,)), _LAYOUT)


def _dequantized_bits(scale_smem, dtype, values, i):
    """fp32 bits of part i of a float8 tile times its rows' scales (scale_smem [1, 128]), in
    fp32 and rounded to dtype: `fp8_blockwise.dequantize`'s values."""
    scale = _row_values(scale_smem, i, values)
    return float32_bits((values.astype(jnp.float32) * scale).astype(dtype))


@functools.cache
def _weights_kernel(g, k, n, dtype, fmt_name, arithmetic, config, compiled, interpret):
    """Kernel of `quantize_128x128_pallas` on w viewed as [G * K, N] under `config`: tile t is
    block row t // (N/128) (expert e, block row kb of its K), block column nb = t % (N/128);
    outputs data [G * K, N], scale_inv [G * K/128 * N/128] (tile t's scale at t) and data_t
    [G * N, K] (tile t at block row e * N/128 + nb, block column kb). `compiled`: built for the
    GPU, where the magnitudes are PTX (`magnitude_bits`)."""
    fmt = FORMATS[fmt_name]
    layout = _LAYOUT if compiled else None
    column_tiles = n // BLOCK
    num_tiles = g * k // BLOCK * column_tiles
    ctas = num_ctas(num_tiles, config.ctas_per_sm)
    slots, output_slots, scratch = _ring(dtype, BLOCK * BLOCK + 4, config)
    in_place = config.transpose == "in_place"

    def window(t):
        row, nb = t // column_tiles, t % column_tiles
        expert, kb = row // (k // BLOCK), row % (k // BLOCK)
        block = lambda i: pl.ds(i * BLOCK, BLOCK)
        return block(row), block(nb), block(expert * column_tiles + nb), block(kb)

    def quantize_128x128(
        x_gmem, data_gmem, scale_gmem, data_t_gmem, *, x_smem, t_smem, loaded, **more_smem
    ):
        data_smem, scale_smem = more_smem["data_smem"], more_smem["scale_smem"]
        identity = identity_halves()

        fetch = _tile_fetch(x_gmem, x_smem, lambda t: window(t)[:2])

        def compute(slot, out):
            part_bits = _tile_parts(_smem_parts(x_smem.at[slot]), config)
            maxima = None
            for i in range(len(_PARTS)):
                maxima = _column_maxima(maxima, magnitude_bits(part_bits(i), layout))
            e = FP8_BLOCKWISE.exponent(jnp.max(jnp.max(maxima, axis=0)), fmt)
            scale_smem[out] = FP8_BLOCKWISE.stored(e)
            e_columns = lax.broadcast_in_dim(e, (BLOCK,), ())  # as if a block a column
            c_smem = t_smem.at[out] if in_place else more_smem["c_smem"]
            for i, part in enumerate(_PARTS):
                encoded = encode_blocks(part_bits(i), e_columns, 0, _LAYOUT, fmt, arithmetic)
                data_smem.at[out, part][...] = encoded
                c_smem.at[part][...] = _as_bytes(encoded)
            store_transposed(identity, c_smem, t_smem.at[out], in_place)

        def store(t, out):
            rows, columns, t_rows, t_columns = window(t)
            scale_gmem[t] = scale_smem[out]
            plgpu.copy_smem_to_gmem(
                data_smem.at[out], data_gmem.at[rows, columns], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                t_smem.at[out], data_t_gmem.at[t_rows, t_columns], commit_group=False
            )

        split_pipeline(num_tiles, ctas, loaded, fetch, compute, store, slots, output_slots)

    return plgpu.kernel(
        quantize_128x128,
        kernel_name="quantize_128x128_transpose",
        out_type=(
            jax.ShapeDtypeStruct((g * k, n), fmt.dtype),
            jax.ShapeDtypeStruct((num_tiles,), jnp.float32),
            jax.ShapeDtypeStruct((g * n, k), jnp.int8),
        ),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=dict(
            data_smem=plgpu.SMEM((output_slots, BLOCK, BLOCK), fmt.dtype),
            scale_smem=plgpu.SMEM((output_slots,), jnp.float32),
            **scratch,
        ),
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )


@functools.cache
def _activations_kernel(
    m,
    k,
    dtype,
    fmt_name,
    arithmetic,
    config,
    compiled,
    interpret,
    rowwise,
    dequantized_dtype=None,
    counted=False,
):
    """Kernel of the 1 x 128 transposing quantize of x [M, K] under `config`: tile t is block
    row rb = t // (K/128), block column kb = t % (K/128). Outputs: with `rowwise`, data [M, K]
    and its scales [K/128, M]; then data_t [K, M] (int8) and its scales [M/128, K].
    `dequantized_dtype` (transposed copy only): x is a float8 copy in 1 x 128 blocks along K,
    with a second input, its multipliers transposed [K/128, M]; the kernel quantizes its values
    dequantized in fp32 and rounded to `dequantized_dtype`, as `fp8_blockwise.dequantize`.
    `counted`: a last input, the live row count [1] int32: only the block rows holding rows
    below it run (`jaxmoe.ops.live_rows`). `compiled`: built for the GPU, where the magnitudes
    are PTX (`magnitude_bits`)."""
    fmt = FORMATS[fmt_name]
    layout = _LAYOUT if compiled else None
    column_tiles = k // BLOCK
    num_tiles = m // BLOCK * column_tiles
    ctas = num_ctas(num_tiles, config.ctas_per_sm)
    scale_row = BLOCK * 4  # a tile's 128 fp32 scales of one copy
    dequantizing = dequantized_dtype is not None
    slots, output_slots, scratch = _ring(
        dtype, (BLOCK * BLOCK + 2 * scale_row) if rowwise else scale_row, config, dequantizing
    )
    scale_slots = plgpu.SMEM((output_slots, 1, BLOCK), jnp.float32)
    scratch["column_scale_smem"] = scale_slots
    if rowwise:
        scratch["data_smem"] = plgpu.SMEM((output_slots, BLOCK, BLOCK), fmt.dtype)
        scratch["row_scale_smem"] = scale_slots
    in_place = config.transpose == "in_place"
    rows_under_wgmma = config.rowwise_encode == "under_wgmma"

    def window(t):
        rb, kb = t // column_tiles, t % column_tiles
        return rb, kb, pl.ds(rb * BLOCK, BLOCK), pl.ds(kb * BLOCK, BLOCK)

    def quantize_1x128_transpose(
        x_gmem, *inputs_and_outputs, x_smem, t_smem, loaded, column_scale_smem, **more_smem
    ):
        scale_gmem = inputs_and_outputs[0] if dequantizing else None
        live_gmem = inputs_and_outputs[dequantizing] if counted else None
        outputs = inputs_and_outputs[dequantizing + counted :]
        *rowwise_gmem, data_t_gmem, column_scale_gmem = outputs
        identity = identity_halves()

        fetch = _tile_fetch(x_gmem, x_smem, lambda t: window(t)[2:])
        if dequantizing:  # the multipliers' block row kb
            fetch = _with_row_scales(
                fetch, scale_gmem, more_smem["input_scale_smem"], lambda t: window(t)[1:3]
            )

        def compute(slot, out):
            as_bits, load = None, _smem_parts(x_smem.at[slot])
            if dequantizing:
                as_bits = functools.partial(
                    _dequantized_bits, more_smem["input_scale_smem"].at[slot], dequantized_dtype
                )
            part_bits = _tile_parts(load, config, as_bits, convert_once=dequantizing)

            def encode_rows(i, bits, magnitudes):
                """The rowwise copy of part i."""
                part = _PARTS[i]
                e = FP8_BLOCKWISE.exponent(jnp.max(magnitudes, axis=1), fmt)
                more_smem["row_scale_smem"].at[out, 0, part][...] = FP8_BLOCKWISE.stored(e)
                encoded = encode_blocks(bits, e, 1, _LAYOUT, fmt, arithmetic)
                more_smem["data_smem"].at[out, part][...] = encoded

            maxima = None
            for i in range(len(_PARTS)):
                bits = part_bits(i)
                magnitudes = magnitude_bits(bits, layout)
                maxima = _column_maxima(maxima, magnitudes)
                if rowwise and not rows_under_wgmma:
                    encode_rows(i, bits, magnitudes)
            e = FP8_BLOCKWISE.exponent(jnp.max(maxima, axis=0), fmt)
            column_scale_smem.at[out, 0][...] = FP8_BLOCKWISE.stored(e)
            c_smem = t_smem.at[out] if in_place else more_smem["c_smem"]
            for i, part in enumerate(_PARTS):
                encoded = encode_blocks(part_bits(i), e, 0, _LAYOUT, fmt, arithmetic)
                c_smem.at[part][...] = _as_bytes(encoded)
            under_halves = None
            if rowwise and rows_under_wgmma:
                per_half = len(_PARTS) // len(_HALVES)

                def rows_of_half(h):
                    def encode():
                        for i in range(h * per_half, (h + 1) * per_half):
                            bits = part_bits(i)
                            encode_rows(i, bits, magnitude_bits(bits, layout))

                    return encode

                under_halves = [rows_of_half(h) for h in range(len(_HALVES))]
            store_transposed(identity, c_smem, t_smem.at[out], in_place, under_halves)

        def store(t, out):
            rb, kb, rows, columns = window(t)
            if rowwise:
                data_gmem, row_scale_gmem = rowwise_gmem
                plgpu.copy_smem_to_gmem(
                    more_smem["data_smem"].at[out],
                    data_gmem.at[rows, columns],
                    commit_group=False,
                )
                plgpu.copy_smem_to_gmem(
                    more_smem["row_scale_smem"].at[out],
                    row_scale_gmem.at[pl.ds(kb, 1), rows],
                    commit_group=False,
                )
            plgpu.copy_smem_to_gmem(
                t_smem.at[out], data_t_gmem.at[columns, rows], commit_group=False
            )
            plgpu.copy_smem_to_gmem(
                column_scale_smem.at[out],
                column_scale_gmem.at[pl.ds(rb, 1), columns],
                commit_group=False,
            )

        # Counted: the block rows holding rows [0, live_rows).
        tiles = live_tiles(live_gmem, m, BLOCK, column_tiles) if counted else num_tiles
        split_pipeline(tiles, ctas, loaded, fetch, compute, store, slots, output_slots)

    out_type = (
        jax.ShapeDtypeStruct((k, m), jnp.int8),
        jax.ShapeDtypeStruct((m // BLOCK, k), jnp.float32),
    )
    if rowwise:
        out_type = (
            jax.ShapeDtypeStruct((m, k), fmt.dtype),
            jax.ShapeDtypeStruct((k // BLOCK, m), jnp.float32),
            *out_type,
        )
    return plgpu.kernel(
        quantize_1x128_transpose,
        kernel_name=(
            "quantize_1x128_transpose"
            if rowwise
            else "requantize_1x128_transposed"
            if dequantizing
            else "quantize_1x128_transposed"
        ),
        out_type=out_type,
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=scratch,
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
    )
