"""The experts' activation in fp32 (`activation`, `gated_activation`) and the two passes of its
probability-weighted form, each with a choice of implementation (`weighted_activation_forward`,
`weighted_activation_backward`).

Forward: a = round(act(h) * p), act(h) = `gated_activation` in fp32, rounded once.
  impl "xla"     XLA's elementwise fusion (the reference).
  impl "pallas"  SwiGLU (silu, gated) on Hopper (ops/pallas/activation_forward_hopper.py), the
                 same operations in the same order, bitwise XLA's on the GPU
                 (tests/kernels/test_activation_pallas.py); F a multiple of 256.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies and a live row count is
                 given (the rows past it are not read), else "xla" (faster over every row).
Backward, for a's incoming gradient g:
  d h = round(d/dh (act(h)) * g * p),   d p = each row's sum of g * act(h), in fp32
  impl "xla"     autodiff of `gated_activation` for d h, and `jaxmoe.ordered.row_sums_in_order`
                 for d p (the reference): two passes over h and g, the activation computed in
                 each.
  impl "pallas"  SwiGLU in one pass on Hopper (ops/pallas/activation_backward_hopper.py):
                 d p in the same tree (bitwise the reference's sums of the kernel's products),
                 its elementwise arithmetic (sigmoid) the kernel's own; F a multiple of 256.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".
Both passes take a live row count (`jaxmoe.ops.live_rows`).

FP8-blockwise copies of the forward, for fc2 (`weighted_activation_quantize_1x128_with_transpose`):
  impl "xla"     the forward, then `jaxmoe.ops.quantize_1x128_with_transpose` of a.
  impl "pallas"  SwiGLU in one Hopper kernel that computes a from each tile of h it loads and
                 quantizes it both ways (ops/pallas/swiglu_quantize_hopper.py): a is never in
                 memory; the same bits as the forward's kernel and the quantize's; bf16 h, F a
                 multiple of 256.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else the forward and the
                 quantize, each on "auto".
FP8-blockwise copies of the backward's d h, for fc1's backward
(`weighted_activation_backward_quantize_1x128_with_transpose`):
  impl "xla"     the backward, then `jaxmoe.ops.quantize_1x128_with_transpose` of d h.
  impl "pallas"  SwiGLU in one Hopper kernel that computes d h from each tile of h and g it
                 loads and quantizes it both ways, with d p's first tree levels
                 (ops/pallas/swiglu_backward_quantize_hopper.py): d h is never in memory; the
                 bits of the backward's kernel and the quantize's.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else the backward and the
                 quantize, each on "auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.fp8_blockwise import BlockwiseTensor
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops import registry
from jaxmoe.ops.live_rows import check_live_rows, fill_dead_rows
from jaxmoe.ops.pallas.activation_backward_hopper import (
    swiglu_backward_problem,
    weighted_swiglu_backward_pallas,
)
from jaxmoe.ops.pallas.activation_forward_hopper import (
    forward_problem,
    weighted_swiglu_forward_pallas,
)
from jaxmoe.ops.pallas.swiglu_backward_quantize_hopper import (
    swiglu_backward_quantize_problem,
    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.ops.pallas.swiglu_quantize_hopper import (
    swiglu_quantize_problem,
    weighted_swiglu_quantize_1x128_with_transpose_pallas,
)
from jaxmoe.ops.quantize import quantize_1x128_with_transpose
from jaxmoe.ordered import LEVELS_PER_PASS, row_sums_in_order, sum_in_order

F32 = jnp.float32


def not_swiglu(name: str, gated: bool) -> str | None:
    """Why the activation `name` (gated or not) is not the one the kernels compute, SwiGLU
    (None: it is)."""
    if name != "silu" or not gated:
        return f"the kernel is SwiGLU's (silu, gated), got {name!r} gated={gated}"
    return None


def _forward_problem(h_shape, h_dtype, name, gated) -> str | None:
    return not_swiglu(name, gated) or forward_problem(h_shape, h_dtype)


def _backward_problem(h_shape, h_dtype, g_shape, g_dtype, name, gated) -> str | None:
    return not_swiglu(name, gated) or swiglu_backward_problem(h_shape, h_dtype, g_shape, g_dtype)


def _quantized_problem(h_shape, h_dtype, probs_shape, name, gated) -> str | None:
    return not_swiglu(name, gated) or swiglu_quantize_problem(h_shape, h_dtype, probs_shape)


registry.register("weighted_activation_forward", "pallas", problem=_forward_problem)
registry.register("weighted_activation_backward", "pallas", problem=_backward_problem)


def _quantized_backward_problem(h_shape, h_dtype, probs_shape, g_shape, g_dtype, name, gated):
    return not_swiglu(name, gated) or swiglu_backward_quantize_problem(
        h_shape, h_dtype, probs_shape, g_shape, g_dtype
    )


registry.register(
    "weighted_activation_quantize_1x128_with_transpose", "pallas", problem=_quantized_problem
)
registry.register(
    "weighted_activation_backward_quantize_1x128_with_transpose",
    "pallas",
    problem=_quantized_backward_problem,
)


def activation(z: jax.Array, name: str) -> jax.Array:
    """The (non-gated) activation in fp32: silu, exact-erf gelu, or squared ReLU."""
    if name == "silu":
        return jax.nn.silu(z)
    if name == "gelu":
        return jax.nn.gelu(z, approximate=False)
    if name == "squared_relu":
        return jnp.square(jax.nn.relu(z))
    raise ValueError(f"unknown activation {name!r}")


def gated_activation(h: jax.Array, name: str, gated: bool) -> jax.Array:
    """act(gate) * up in fp32 for h [M, 2F] ([gate; up]) when gated, else act(h) [M, F]."""
    z = h.astype(F32)
    if gated:
        gate, up = jnp.split(z, 2, axis=-1)
        return activation(gate, name) * up
    return activation(z, name)


def weighted_activation_forward(
    h: jax.Array,
    probs: jax.Array,
    name: str,
    gated: bool,
    *,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> jax.Array:
    """a = round(act(h) * probs) [M, F] in h.dtype for h [M, 2F|F] (module docstring). probs:
    [M], used in fp32. live_rows: an integer scalar, or None; the rows at and past it
    are not computed and hold unspecified values (`jaxmoe.ops.live_rows`)."""
    if h.ndim != 2 or probs.shape != h.shape[:1]:
        raise ValueError(
            f"weighted_activation_forward: needs h [M, 2F|F] and probs [M], got {h.shape}, "
            f"{probs.shape}"
        )
    check_live_rows("weighted_activation_forward", live_rows)
    registry.check_impl("weighted_activation_forward", impl)
    if impl == "auto" and live_rows is None:
        # Over every row XLA's fusion is faster, with the kernel's bits on Hopper (docs/kernels/activation.md,
        # "Weighted SwiGLU forward").
        impl = registry.REFERENCE
    call = (h.shape, h.dtype, name, gated)
    if registry.resolve("weighted_activation_forward", impl, *call) == "pallas":
        return weighted_swiglu_forward_pallas(h, probs, live_rows=live_rows)
    out = gated_activation(h, name, gated) * probs.astype(F32)[:, None]
    return fill_dead_rows(out.astype(h.dtype), live_rows)


def weighted_activation_backward(
    h: jax.Array,
    probs: jax.Array,
    g: jax.Array,
    name: str,
    gated: bool,
    *,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """(d h [M, 2F|F] in h.dtype, d probs [M] fp32) of a = round(act(h) * probs) for its
    gradient g [M, F] (module docstring). probs: [M] fp32. live_rows: an integer scalar, or
    None; the rows at and past it are not computed and hold unspecified values
    (`jaxmoe.ops.live_rows`)."""
    if h.ndim != 2 or g.ndim != 2 or probs.shape != h.shape[:1]:
        raise ValueError(
            f"weighted_activation_backward: needs h [M, 2F|F], probs [M], g [M, F], got "
            f"{h.shape}, {probs.shape}, {g.shape}"
        )
    check_live_rows("weighted_activation_backward", live_rows)
    call = (h.shape, h.dtype, g.shape, g.dtype, name, gated)
    if registry.resolve("weighted_activation_backward", impl, *call) == "pallas":
        d_h, partials = weighted_swiglu_backward_pallas(h, probs, g, live_rows=live_rows)
        return d_h, _row_sums_of_partials(partials)
    out, pull = jax.vjp(lambda h: gated_activation(h, name, gated), h)
    g = g.astype(F32)
    (d_h,) = pull(g * probs.astype(F32)[:, None])
    d_probs = row_sums_in_order(g * out)
    return fill_dead_rows(d_h, live_rows), fill_dead_rows(d_probs, live_rows)


def weighted_activation_quantize_1x128_with_transpose(
    h: jax.Array,
    probs: jax.Array,
    name: str,
    gated: bool,
    fmt: str = "e4m3",
    *,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[BlockwiseTensor, BlockwiseTensor]:
    """`quantize_1x128_with_transpose(weighted_activation_forward(h, probs, name, gated), fmt)`,
    the same bits: the FP8-blockwise copies of a = round(act(h) * probs) [M, F] that fc2 reads,
    a in 1 x 128 blocks along F and a^T [F, M] in 1 x 128 blocks along M, on "pallas" made in
    one pass over h without a in memory (module docstring). live_rows as
    `quantize_1x128_with_transpose`'s. No gradient flows through it."""
    h, probs = (jax.lax.stop_gradient(jnp.asarray(v)) for v in (h, probs))
    if h.ndim != 2 or probs.shape != h.shape[:1]:
        raise ValueError(
            "weighted_activation_quantize_1x128_with_transpose: needs h [M, 2F|F] and probs "
            f"[M], got {h.shape}, {probs.shape}"
        )
    check_live_rows("weighted_activation_quantize_1x128_with_transpose", live_rows)
    call = (h.shape, h.dtype, probs.shape, name, gated)
    if registry.resolve("weighted_activation_quantize_1x128_with_transpose", impl, *call) == "xla":
        a = weighted_activation_forward(h, probs, name, gated, live_rows=live_rows, impl=impl)
        return quantize_1x128_with_transpose(a, fmt, live_rows=live_rows, impl=impl)
    copies = weighted_swiglu_quantize_1x128_with_transpose_pallas(
        h, probs, fmt, live_rows=live_rows
    )
    return _as_blockwise_tensors(copies, fmt)


def weighted_activation_backward_quantize_1x128_with_transpose(
    h: jax.Array,
    probs: jax.Array,
    g: jax.Array,
    name: str,
    gated: bool,
    fmt: str = "e4m3",
    *,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[BlockwiseTensor, BlockwiseTensor, jax.Array]:
    """(d h's two FP8-blockwise copies, d probs) for a = round(act(h) * probs) and its gradient
    g [M, F]: `quantize_1x128_with_transpose` of `weighted_activation_backward`'s d h (d h in
    1 x 128 blocks along 2F|F, the dgrad operand of fc1, and d h^T [2F|F, M] in 1 x 128 blocks
    along M, its wgrad operand) and that op's d probs [M] fp32, the same bits; on "pallas" made
    in one pass over h and g without d h in memory (module docstring). live_rows as
    `weighted_activation_backward`'s and `quantize_1x128_with_transpose`'s. No gradient flows
    through it."""
    h, probs, g = (jax.lax.stop_gradient(jnp.asarray(v)) for v in (h, probs, g))
    if h.ndim != 2 or g.ndim != 2 or probs.shape != h.shape[:1]:
        raise ValueError(
            "weighted_activation_backward_quantize_1x128_with_transpose: needs h [M, 2F|F], "
            f"probs [M] and g [M, F], got {h.shape}, {probs.shape}, {g.shape}"
        )
    op = "weighted_activation_backward_quantize_1x128_with_transpose"
    check_live_rows(op, live_rows)
    call = (h.shape, h.dtype, probs.shape, g.shape, g.dtype, name, gated)
    if registry.resolve(op, impl, *call) == "xla":
        d_h, d_probs = weighted_activation_backward(
            h, probs, g, name, gated, live_rows=live_rows, impl=impl
        )
        rowwise, transposed = quantize_1x128_with_transpose(
            d_h, fmt, live_rows=live_rows, impl=impl
        )
        return rowwise, transposed, d_probs
    copies, partials = weighted_swiglu_backward_quantize_1x128_with_transpose_pallas(
        h, probs, g, fmt, live_rows=live_rows
    )
    return (*_as_blockwise_tensors(copies, fmt), _row_sums_of_partials(partials))


def _as_blockwise_tensors(copies, fmt: str) -> tuple[BlockwiseTensor, BlockwiseTensor]:
    """A kernel's ((data, scale_inv), (data_t, scale_inv_t)) as the two 1 x 128 copies."""
    return tuple(BlockwiseTensor(data, scale_inv, (1,), fmt) for data, scale_inv in copies)


def _row_sums_of_partials(partials: jax.Array) -> jax.Array:
    """Each row's sum from a kernel's partial sums [M, C x 32] (its first tree levels over the
    row's 32-column chunks, 32 lanes a block of columns): the tree's later levels over the
    blocks, then over the lanes, as `row_sums_in_order` adds them."""
    blocks = partials.reshape(partials.shape[0], -1, BLOCK_SIZE)
    lanes = sum_in_order(blocks, axis=1, levels_per_pass=LEVELS_PER_PASS)
    return sum_in_order(lanes, axis=-1)
