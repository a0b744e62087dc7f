"""Quantization with a choice of implementation: MXFP8 `quantize` (any axis), FP8-blockwise
`quantize_1x128` (1 x 128 blocks along any axis), `dispatch_quantize` (gather the expert
buffer's rows and quantize them in one pass, either recipe; `dispatch_fake_quantize`: the
values of its MXFP8 copy alone), and the FP8-blockwise copies with
their K-major transposes made in one pass (`quantize_1x128_with_transpose`,
`quantize_1x128_transposed`, `quantize_128x128_with_transpose`; `requantize_1x128_transposed`
from a 1 x 128 copy's fp8 bytes instead of its dequantized values).

  impl "xla"     the TE-exact references `jaxmoe.mxfp8.quantize` and
                 `jaxmoe.fp8_blockwise.quantize_1x128` / `quantize_128x128` (the transposed
                 copies: the reference of the transposed input, or the data's axes swapped).
  impl "pallas"  the Hopper kernels (ops/pallas/quantize_hopper.py), bitwise equal to them:
                 blocks along the last axis (any leading shape, viewed as 2-D; FP8 blockwise:
                 its length a multiple of 128), blocks along the next-to-last axis with the
                 last a multiple of 16 (leading axes merged into it: [G, K, N] is [G * K, N];
                 FP8 blockwise: 2-D, any number of rows, a partial last block being zero-padded
                 as the reference counts it), and the dispatch gather with H a multiple of 64
                 (bf16) / 32 (fp32) (FP8 blockwise: 128); the transposing FP8-blockwise
                 kernels (ops/pallas/quantize_transpose_hopper.py) on [M, K] activations and
                 [G, K, N] weights whose last two axes are multiples of 128; bf16 or fp32
                 input, not empty (the requantize: a float8 [M, K] copy, M and K multiples
                 of 128). Other problems raise ValueError.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".

Gradients: a quantized tensor carries none (its data is fp8, its scales are integers or powers
of two). The functions take their input through `jax.lax.stop_gradient`, so they run inside
`jax.grad` on every impl (the kernels have no differentiation rule). Code that differentiates through a quantizer sends
the gradient to the high-precision tensor as if the quantizer were the identity
(straight-through, as Transformer Engine does): the layer does this for the dispatched tokens,
the combine gradient and every MXFP8 GEMM operand (`jaxmoe.ops.mxfp8_gmm`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmoe import fp8_blockwise, mxfp8
from jaxmoe.fp8_blockwise import BlockwiseTensor
from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor
from jaxmoe.ops import registry
from jaxmoe.ops.live_rows import check_live_rows, fill_dead_rows
from jaxmoe.ops.pallas.quantize_hopper import (
    FP8_BLOCKWISE,
    MXFP8,
    columnwise_1x128_problem,
    columnwise_problem,
    gather_fake_quantize_rowwise_pallas,
    gather_problem,
    gather_quantize_1x128_pallas,
    gather_quantize_rowwise_pallas,
    quantize_1x128_columnwise_pallas,
    quantize_1x128_pallas,
    quantize_columnwise_pallas,
    quantize_rowwise_pallas,
    rowwise_problem,
)
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    quantize_1x128_transposed_pallas,
    quantize_1x128_with_transpose_pallas,
    quantize_128x128_pallas,
    requantize_1x128_transposed_pallas,
    requantize_problem,
    transpose_problem,
    weights_problem,
)

RECIPES = ("mxfp8", "fp8_blockwise")
_SCALINGS = {"mxfp8": MXFP8, "fp8_blockwise": FP8_BLOCKWISE}

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _dtype_problem(x) -> str | None:
    if jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
        return f"input must be bf16 or fp32, got {x.dtype}"
    return None


def _kernel_problem(x, axis) -> str | None:
    """Why the kernels cannot quantize x along axis (None when they can)."""
    if _dtype_problem(x):
        return _dtype_problem(x)
    if axis == x.ndim - 1:
        if x.shape[-1] % BLOCK_SIZE:
            return None  # `quantize` raises the reference's error
        return rowwise_problem((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    if axis == x.ndim - 2:
        return columnwise_problem((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    return f"blocks along axis {axis} of shape {x.shape}: the kernels take the last two axes"


def _1x128_kernel_problem(x, axis) -> str | None:
    """Why the FP8-blockwise kernels cannot quantize x along axis (None when they can)."""
    if _dtype_problem(x):
        return _dtype_problem(x)
    if axis == x.ndim - 1:
        return rowwise_problem((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype, FP8_BLOCKWISE)
    if axis == 0 and x.ndim == 2:
        return columnwise_1x128_problem((_whole_blocks(x.shape[0]), x.shape[1]), x.dtype)
    return (
        f"1x128 blocks along axis {axis} of shape {x.shape}: the kernels take the last axis, "
        "or the first of a 2-D array"
    )


def _whole_blocks(rows: int) -> int:
    return -(-rows // fp8_blockwise.BLOCK) * fp8_blockwise.BLOCK


def _gather_kernel_problem(x, num_rows, recipe) -> str | None:
    """Why the gather-quantize kernel cannot make num_rows rows of x (None when it can)."""
    return _dtype_problem(x) or gather_problem(x.shape, x.dtype, num_rows, _SCALINGS[recipe])


def _transpose_kernel_problem(x) -> str | None:
    """Why the transposing 1 x 128 kernels cannot quantize x (None when they can)."""
    return _dtype_problem(x) or transpose_problem(x.shape, x.dtype)


def _requantize_kernel_problem(x: BlockwiseTensor, dtype) -> str | None:
    """Why the requantize kernel cannot make the transposed copy of x's values (None: it can)."""
    return requantize_problem(
        x.data.shape, x.data.dtype, x.scale_inv.shape, x.scale_inv.dtype, dtype
    )


def _weights_kernel_problem(w) -> str | None:
    """Why the transposing 128 x 128 kernel cannot quantize w (None when it can)."""
    return _dtype_problem(w) or weights_problem(w.shape, w.dtype)


registry.register("quantize", "pallas", problem=_kernel_problem)
registry.register("quantize_1x128", "pallas", problem=_1x128_kernel_problem)
registry.register("dispatch_quantize", "pallas", problem=_gather_kernel_problem)
registry.register("dispatch_fake_quantize", "pallas", problem=_gather_kernel_problem)
registry.register("quantize_1x128_with_transpose", "pallas", problem=_transpose_kernel_problem)
registry.register("quantize_1x128_transposed", "pallas", problem=_transpose_kernel_problem)
registry.register("quantize_128x128_with_transpose", "pallas", problem=_weights_kernel_problem)
registry.register("requantize_1x128_transposed", "pallas", problem=_requantize_kernel_problem)


def quantize(x: jax.Array, axis: int = -1, fmt: str = "e4m3", *, impl: str = "auto") -> MXTensor:
    """`jaxmoe.mxfp8.quantize(x, axis, fmt)` (same checks, same bits) on the chosen `impl`; no
    gradient flows through it (module docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize: axis {axis} is out of range for shape {x.shape}")
    axis %= x.ndim
    if registry.resolve("quantize", impl, x, axis) == "xla":
        return mxfp8.quantize(x, axis=axis, fmt=fmt)
    if x.shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"quantize: axis {axis} has length {x.shape[axis]}, not a multiple of {BLOCK_SIZE}"
        )
    if axis == x.ndim - 1:
        data, scale = quantize_rowwise_pallas(x.reshape(-1, x.shape[-1]), fmt)
        return MXTensor(
            data=data.reshape(x.shape),
            scale=scale.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE,)),
            axis=axis,
            fmt=fmt,
        )
    # Blocks along axis -2 never straddle two leading indices: its length is a multiple of 32.
    data, scale = quantize_columnwise_pallas(x.reshape(-1, x.shape[-1]), fmt)
    scale_shape = x.shape[:-2] + (x.shape[-2] // BLOCK_SIZE, x.shape[-1])
    return MXTensor(
        data=data.reshape(x.shape), scale=scale.reshape(scale_shape), axis=axis, fmt=fmt
    )


def quantize_1x128(
    x: jax.Array, axis: int = -1, fmt: str = "e4m3", *, impl: str = "auto"
) -> BlockwiseTensor:
    """`jaxmoe.fp8_blockwise.quantize_1x128(x, axis, fmt)` (same checks, same bits) on the
    chosen `impl`; no gradient flows through it (module docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize_1x128: axis {axis} is out of range for shape {x.shape}")
    axis %= x.ndim
    if registry.resolve("quantize_1x128", impl, x, axis) == "xla":
        return fp8_blockwise.quantize_1x128(x, axis, fmt)
    if axis == 0:  # 2-D, blocks along the rows: zero rows complete the last block
        rows = x.shape[0]
        padded = jnp.pad(x, ((0, _whole_blocks(rows) - rows), (0, 0)))
        data, scale_inv = quantize_1x128_columnwise_pallas(padded, fmt)
        return BlockwiseTensor(data[:rows], scale_inv, (0,), fmt)
    data, scale_inv = quantize_1x128_pallas(x.reshape(-1, x.shape[-1]), fmt)
    blocks = x.shape[-1] // fp8_blockwise.BLOCK
    return BlockwiseTensor(
        data.reshape(x.shape), scale_inv.reshape(x.shape[:-1] + (blocks,)), (axis,), fmt
    )


def dispatch_quantize(
    x: jax.Array,
    row_token: jax.Array,
    fmt: str = "e4m3",
    *,
    recipe: str = "mxfp8",
    per_token: int = 1,
    impl: str = "auto",
) -> MXTensor | BlockwiseTensor:
    """Rows x[row_token[r] // per_token] ([M, H], zeros where that is T, a padding row;
    per_token > 1: row_token holds the rows' slots, as `jaxmoe.ops.permute.dispatch_rows`)
    quantized with blocks along H (recipe "mxfp8": 32 wide, an MXTensor; "fp8_blockwise":
    1 x 128, a BlockwiseTensor), without a bf16 copy of the gathered rows on "pallas". Equals
    quantizing `jnp.concatenate([x, zeros])[row_token // per_token]` along axis 1 bitwise. No
    gradient flows through it (module docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if recipe not in RECIPES:
        raise ValueError(f"dispatch_quantize: recipe must be one of {RECIPES}, got {recipe!r}")
    _check_gather("dispatch_quantize", x, row_token)
    if registry.resolve("dispatch_quantize", impl, x, row_token.shape[0], recipe) == "xla":
        padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
        rows = jnp.take(padded, row_token // per_token, axis=0)
        if recipe == "fp8_blockwise":
            return fp8_blockwise.quantize_1x128(rows, 1, fmt)
        return mxfp8.quantize(rows, axis=1, fmt=fmt)
    if recipe == "fp8_blockwise":
        data, scale_inv = gather_quantize_1x128_pallas(x, row_token, fmt, per_token=per_token)
        return BlockwiseTensor(data, scale_inv, (1,), fmt)
    data, scale = gather_quantize_rowwise_pallas(x, row_token, fmt, per_token=per_token)
    return MXTensor(data=data, scale=scale, axis=1, fmt=fmt)


def dispatch_fake_quantize(
    x: jax.Array,
    row_token: jax.Array,
    fmt: str = "e4m3",
    *,
    per_token: int = 1,
    impl: str = "auto",
) -> jax.Array:
    """The values of `dispatch_quantize(x, row_token, fmt, per_token=per_token)`'s MXFP8 copy in
    x's dtype, made in one pass without the copy on "pallas": rows x[row_token[r] // per_token]
    ([M, H], zeros where that is T) quantized along H and dequantized, bitwise
    `jaxmoe.mxfp8.dequantize(dispatch_quantize(...), x.dtype)`. What the experts
    read when the copy itself need not move (the dispatch on one device). No gradient flows
    through it (module docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    _check_gather("dispatch_fake_quantize", x, row_token)
    if registry.resolve("dispatch_fake_quantize", impl, x, row_token.shape[0], "mxfp8") == "xla":
        copy = dispatch_quantize(x, row_token, fmt, per_token=per_token, impl="xla")
        return mxfp8.dequantize(copy, x.dtype)
    return gather_fake_quantize_rowwise_pallas(x, row_token, fmt, per_token=per_token)


def _check_gather(name, x, row_token):
    if x.ndim != 2 or row_token.ndim != 1:
        raise ValueError(
            f"{name}: x must be [T, H] and row_token [M], got {x.shape} and {row_token.shape}"
        )


def _check_ndim(name, x, ndim, shape):
    if x.ndim != ndim:
        raise ValueError(f"{name}: the input must be {shape}, got shape {x.shape}")


def quantize_1x128_with_transpose(
    x: jax.Array, fmt: str = "e4m3", *, live_rows: jax.Array | None = None, impl: str = "auto"
) -> tuple[BlockwiseTensor, BlockwiseTensor]:
    """(`quantize_1x128(x, 1, fmt)`, `quantize_1x128(x.T, 1, fmt)`) of x [M, K] (same bits):
    the copy in 1 x 128 blocks along K and the K-major copy of x^T [K, M] in 1 x 128 blocks
    along M (`quantize_1x128(x, 0)` transposed), from one read of x on "pallas". live_rows: an
    integer scalar, or None: x's rows at and past it are not quantized, and the copies' rows
    (the transposed copy's columns) there are unspecified (`jaxmoe.ops.live_rows`; a 1 x 128
    block along M that holds a live row is whole). No gradient flows through it (module
    docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    _check_ndim("quantize_1x128_with_transpose", x, 2, "[M, K]")
    check_live_rows("quantize_1x128_with_transpose", live_rows)
    if registry.resolve("quantize_1x128_with_transpose", impl, x) == "xla":
        rowwise = fp8_blockwise.quantize_1x128(x, 1, fmt)
        rowwise = jax.tree.map(lambda a: fill_dead_rows(a, live_rows), rowwise)
        return rowwise, _dead_columns(fp8_blockwise.quantize_1x128(x.T, 1, fmt), live_rows)
    (data, scale_inv), (data_t, scale_inv_t) = quantize_1x128_with_transpose_pallas(
        x, fmt, live_rows=live_rows
    )
    return (
        BlockwiseTensor(data, scale_inv, (1,), fmt),
        BlockwiseTensor(data_t, scale_inv_t, (1,), fmt),
    )


def _dead_columns(t: BlockwiseTensor, live_rows) -> BlockwiseTensor:
    """A transposed copy [K, M] in 1 x 128 blocks along M with its columns past `live_rows`
    (its scales' blocks past the last live one) set to DEAD_ROW_FILL."""
    if live_rows is None:
        return t
    live_blocks = (live_rows + fp8_blockwise.BLOCK - 1) // fp8_blockwise.BLOCK
    return BlockwiseTensor(
        fill_dead_rows(t.data, live_rows, axis=1),
        fill_dead_rows(t.scale_inv, live_blocks, axis=1),
        t.block_axes,
        t.fmt,
    )


def quantize_1x128_transposed(
    x: jax.Array, fmt: str = "e4m3", *, live_rows: jax.Array | None = None, impl: str = "auto"
) -> BlockwiseTensor:
    """`quantize_1x128(x.T, 1, fmt)` of x [M, K] (same bits): the K-major copy of x^T [K, M] in
    1 x 128 blocks along M, without a transposed copy of x on "pallas". live_rows as
    `quantize_1x128_with_transpose`'s. No gradient flows through it (module docstring)."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    _check_ndim("quantize_1x128_transposed", x, 2, "[M, K]")
    check_live_rows("quantize_1x128_transposed", live_rows)
    if registry.resolve("quantize_1x128_transposed", impl, x) == "xla":
        return _dead_columns(fp8_blockwise.quantize_1x128(x.T, 1, fmt), live_rows)
    data_t, scale_inv_t = quantize_1x128_transposed_pallas(x, fmt, live_rows=live_rows)
    return BlockwiseTensor(data_t, scale_inv_t, (1,), fmt)


def requantize_1x128_transposed(
    x: BlockwiseTensor,
    dtype,
    fmt: str = "e4m3",
    *,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> BlockwiseTensor:
    """`quantize_1x128(dequantize(x, dtype).T, 1, fmt)` of a copy x [M, K] in 1 x 128 blocks
    along K (same bits): the K-major copy of x's values transposed, in 1 x 128 blocks along M,
    as `quantize_1x128_transposed` makes it from those values in `dtype` (bf16 or fp32); on
    "pallas" read from x's fp8 bytes, without its values in `dtype` in memory. live_rows as
    `quantize_1x128_with_transpose`'s. No gradient flows through it (module docstring)."""
    if not isinstance(x, BlockwiseTensor) or x.ndim != 2 or x.block_axes != (1,):
        raise ValueError(
            "requantize_1x128_transposed: x must be a 2-D BlockwiseTensor in 1 x 128 blocks "
            f"along axis 1, got {x!r}"
        )
    x = jax.tree.map(jax.lax.stop_gradient, x)
    check_live_rows("requantize_1x128_transposed", live_rows)
    if registry.resolve("requantize_1x128_transposed", impl, x, dtype) == "xla":
        values = fp8_blockwise.dequantize(x, dtype).T
        return _dead_columns(fp8_blockwise.quantize_1x128(values, 1, fmt), live_rows)
    data_t, scale_inv_t = requantize_1x128_transposed_pallas(
        x.data, x.scale_inv, dtype, fmt, live_rows=live_rows
    )
    return BlockwiseTensor(data_t, scale_inv_t, (1,), fmt)


def quantize_128x128_with_transpose(
    w: jax.Array, fmt: str = "e4m3", *, impl: str = "auto"
) -> tuple[BlockwiseTensor, BlockwiseTensor]:
    """(`quantize_128x128(w, fmt)`, the same blocks transposed: data and scale_inv with their
    last two axes swapped) of the weights w [G, K, N] (same bits): the copy dgrad reads and the
    K-major [G, N, K] copy fprop reads, from one read of w on "pallas". No gradient flows
    through it (module docstring)."""
    w = jax.lax.stop_gradient(jnp.asarray(w))
    _check_ndim("quantize_128x128_with_transpose", w, 3, "[G, K, N]")
    if registry.resolve("quantize_128x128_with_transpose", impl, w) == "xla":
        weights = fp8_blockwise.quantize_128x128(w, fmt)
        data_t = jnp.swapaxes(weights.data, 1, 2)
    else:
        data, scale_inv, data_t = quantize_128x128_pallas(w, fmt)
        weights = BlockwiseTensor(data, scale_inv, (1, 2), fmt)
    scale_inv_t = jnp.swapaxes(weights.scale_inv, 1, 2)
    return weights, BlockwiseTensor(data_t, scale_inv_t, (1, 2), fmt)
