"""MXFP8 inference: the layer with its routed experts stored only as the MXFP8 copies that the
forward GEMMs read (e4m3 data and E8M0 scales, 1.03 bytes a weight), no high-precision master.

    inference = jaxmoe.mxfp8_inference(model)   # model: MoEConfig(expert_precision="mxfp8")
    y, aux = inference(x)                       # the training forward's bits (D3), any batch

At a few tokens per expert (decode) the expert GEMMs run on the decode kernel, which reads each
active expert's fp8 weights once; at larger batches on the dequantizing kernels
(`Mxfp8Kernel.AUTO`; the same bits either way).

The copies are `quantize_expert_weights`'s fprop copies of the trained weights, so a token's
output is bitwise the training forward's at any batch size; the router and the shared expert
keep their weights. The result is for inference only: the experts' GEMMs have no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.experts import ExpertMatrices, grouped_mlp
from jaxmoe.moe import MoE
from jaxmoe.mxfp8 import BLOCK_SIZE, MXTensor
from jaxmoe.ops.mxfp8_gmm import Mxfp8Weights, quantize_mxfp8_weights
from jaxmoe.ops.mxtensor_gmm import Mxfp8Kernel, check_kernel
from jaxmoe.ops.pallas.e4m3_registers import small_scale_dequantization_is_exact
from jaxmoe.ops.pallas.gmm_decode_hopper import can_tile_weights, tile_weights, untile_weights
from jaxmoe.recipes import ExpertWeightsMx


class ExpertCopy(nnx.Variable):
    """The data or the scales of an MXFP8 weight copy (not trained)."""


class Mxfp8GroupedMLP(nnx.Module):
    """The E routed experts as their MXFP8 fprop copies: fc1 [E, 2F|F, H] and fc2 [E, H, F]
    (each expert's matrix transposed, blocks along the contraction dim, as the GEMMs read them),
    biases as they were; `kernel`: the `Mxfp8Kernel` of their GEMMs (`jaxmoe.ops.gmm`). Called
    like `jaxmoe.moe.GroupedMLP`.

    Stored as `stored_copy` makes them: the data in the decode kernel's tiled layout (when N
    and K are multiples of 128), the scale bytes block-major, [E, K/32, N] (the MXTensor's
    [E, N, K/32] transposed), the layout the fp8-reading kernels take: the forward transposes
    them back into the MXTensor and the kernel's wrapper transposes that again, and XLA removes
    the pair, so no call touches every expert's scales before the kernel (`loaded_copy`).
    `fprop_copies()` gives the copies as MXTensors. `small_scales`: whether both
    copies, checked once here, let the decode kernel dequantize with integer instructions (the
    same bits); the copies are not meant to be replaced afterwards. `fprop_copies`: as
    `mxfp8_inference`'s (None: the model's expert kernels quantized)."""

    def __init__(
        self,
        model: MoE,
        kernel: Mxfp8Kernel = Mxfp8Kernel.AUTO,
        fprop_copies: tuple[MXTensor, MXTensor] | None = None,
    ):
        config, experts = model.config, model.experts
        if config.expert_precision != "mxfp8":
            raise ValueError(
                "mxfp8_inference: the layer's experts must run in MXFP8 "
                f"(expert_precision='mxfp8'), got {config.expert_precision!r}"
            )
        check_kernel(kernel, "mxfp8_inference")
        self.config, self.kernel = config, kernel
        if fprop_copies is None:
            dtype, impl = model.dtype, model.gmm_impl
            fc1, fc2 = (
                quantize_mxfp8_weights(weights[...].astype(dtype), impl, dgrad=False).fprop
                for weights in (experts.fc1_kernel, experts.fc2_kernel)
            )
        else:
            fc1, fc2 = _checked_copies(fprop_copies, config, model.hidden_size)
        self.fc1_data, self.fc1_scale = map(ExpertCopy, stored_copy(fc1))
        self.fc2_data, self.fc2_scale = map(ExpertCopy, stored_copy(fc2))
        self.small_scales = _small_scales(fc1) and _small_scales(fc2)
        self.fc1_bias, self.fc2_bias = experts.fc1_bias, experts.fc2_bias

    def __call__(self, rows, row_probs, route, *, rows_quantized, expert_weights, gmm_impl: str):
        if expert_weights is not None:
            raise ValueError("mxfp8_inference: the layer holds its MXFP8 copies already")
        copy = lambda data, scale: loaded_copy(
            data[...], scale[...], self.kernel, self.small_scales
        )
        weights = ExpertWeightsMx(
            fc1=copy(self.fc1_data, self.fc1_scale), fc2=copy(self.fc2_data, self.fc2_scale)
        )
        value = lambda p: None if p is None else p[...]
        return grouped_mlp(
            rows,
            row_probs,
            route,
            ExpertMatrices(None, None, value(self.fc1_bias), value(self.fc2_bias)),
            self.config,
            rows_quantized=rows_quantized,
            expert_weights=weights,
            gmm_impl=gmm_impl,
        )

    def fprop_copies(self) -> tuple[MXTensor, MXTensor]:
        """The stored fc1 and fc2 copies as MXTensors ([E, N, K], blocks along K)."""
        return tuple(
            loaded_copy(data[...], scale[...]).fprop
            for data, scale in ((self.fc1_data, self.fc1_scale), (self.fc2_data, self.fc2_scale))
        )


def stored_copy(copy: MXTensor) -> tuple[jax.Array, jax.Array]:
    """An fprop copy [E, N, K] (blocks along K) as `Mxfp8GroupedMLP` stores it: (data, scale
    bytes), the data in the decode kernel's tiled layout (`tile_weights`, which that kernel reads
    faster) when N and K are multiples of 128, else as it is; the scale bytes block-major,
    [E, K/32, N]."""
    _, n, k = copy.shape
    data = tile_weights(copy.data) if can_tile_weights(n, k) else copy.data
    return data, jnp.swapaxes(copy.scale, 1, 2)


def loaded_copy(
    data: jax.Array,
    scale: jax.Array,
    kernel: Mxfp8Kernel = Mxfp8Kernel.AUTO,
    small_scales: bool = False,
) -> Mxfp8Weights:
    """The `Mxfp8Weights` (fprop only) of a copy stored by `stored_copy`, for GEMMs on the
    Pallas `kernel`: the fprop MXTensor, and the tiles as they are for the decode kernel (the
    MXTensor's untiled data, made by XLA, is then dropped where nothing else reads it)."""
    tiled = data.ndim == 5
    return Mxfp8Weights(
        fprop=MXTensor(
            data=untile_weights(data) if tiled else data,
            scale=jnp.swapaxes(scale, 1, 2),
            axis=2,
            fmt="e4m3",
        ),
        dgrad=None,
        fprop_kernel=kernel,
        fprop_small_scales=small_scales,
        fprop_tiled=data if tiled else None,
    )


def _checked_copies(copies, config, hidden_size: int) -> tuple[MXTensor, MXTensor]:
    """fprop_copies as `Mxfp8GroupedMLP` stores them, or ValueError: e4m3 MXTensors fc1
    [E, 2F|F, H] and fc2 [E, H, F] with blocks along the last axis and uint8 scales."""
    if not (isinstance(copies, tuple | list) and len(copies) == 2):
        raise ValueError("mxfp8_inference: fprop_copies must be a pair (fc1, fc2) of MXTensors")
    shapes = {
        "fc1": (config.num_experts, config.fc1_output_size, hidden_size),
        "fc2": (config.num_experts, hidden_size, config.ffn_hidden_size),
    }
    for (name, shape), copy in zip(shapes.items(), copies, strict=True):
        if not isinstance(copy, MXTensor):
            raise ValueError(f"mxfp8_inference: the {name} copy must be an MXTensor")
        scale_shape = shape[:2] + (shape[2] // BLOCK_SIZE,)
        if (
            copy.shape != shape
            or copy.axis != 2
            or copy.fmt != "e4m3"
            or copy.dtype != jnp.float8_e4m3fn
            or copy.scale.shape != scale_shape
            or copy.scale.dtype != jnp.uint8
        ):
            raise ValueError(
                f"mxfp8_inference: the {name} copy must be e4m3 {shape} (each expert's [out, "
                f"in] matrix) with blocks along the last axis and uint8 scales {scale_shape}; "
                f"got {copy.fmt} {copy.dtype}{copy.shape}, axis {copy.axis}, scales "
                f"{copy.scale.dtype}{copy.scale.shape}"
            )
    return tuple(copies)


def _small_scales(copy: MXTensor) -> bool:
    """Whether an fprop copy qualifies for the decode kernel's integer dequantization
    (`e4m3_registers.small_scale_dequantization_is_exact`: trained weights do, with blocks'
    amax at most 448 x 2^7 and no NaN); False when the copy is traced and cannot be inspected."""
    exact = small_scale_dequantization_is_exact(copy.data, copy.scale)
    return not isinstance(exact, jax.core.Tracer) and bool(exact)


def mxfp8_inference(
    model: MoE,
    *,
    kernel: Mxfp8Kernel = Mxfp8Kernel.AUTO,
    fprop_copies: tuple[MXTensor, MXTensor] | None = None,
) -> MoE:
    """A copy of `model` for inference whose routed experts hold only their MXFP8 fprop copies
    (`Mxfp8GroupedMLP`); `model` is left as it is (drop it to free its high-precision expert
    weights). Needs expert_precision "mxfp8". Its forward gives the training forward's bits.
    kernel: the `Mxfp8Kernel` the expert GEMMs run on (`jaxmoe.ops.gmm`): AUTO (default:
    DECODE at up to `DECODE_MAX_ROWS_PER_GROUP` rows per expert on average, else DEQUANTIZE),
    DEQUANTIZE (bf16 copies of the operands, then the bf16 kernel), FUSED_DEQUANTIZE and DECODE
    (the fp8 weights read once and dequantized in the kernel; DECODE for a few tokens per
    expert) give the same bits on the GPU; FP8_WGMMA does not.
    fprop_copies: the experts' MXFP8 weights as they are, stored without re-quantizing (the
    model's own expert kernels are then not read): e4m3 `MXTensor`s fc1 [E, 2F|F, H] and fc2
    [E, H, F], each expert's matrix in Megatron's [out, in] layout with blocks along the last
    (input) axis, which is how Transformer Engine stores an MXFP8 weight's rowwise copy
    (`bridge.megatron.expert_fprop_copy` stacks a Megatron layer's refitted expert weights).
    None: quantize the model's expert kernels (TE's recipe, so the same bytes for weights that
    TE quantized from the same values)."""
    inference = nnx.clone(model)
    inference.experts = Mxfp8GroupedMLP(model, kernel, fprop_copies)
    # No padding rows: MXFP8's 32-row blocks serve the backward's columnwise copies, and at
    # decode sizes the padding would be most of the buffer (e.g. 3976 of 4000 rows for one
    # qwen3_30b token). A row's bits do not depend on where its expert's block starts.
    inference.row_alignment = 1
    return inference
