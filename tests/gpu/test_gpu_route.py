"""The route "auto" takes on an H200, checked on the CPU: `jaxmoe.ops.device` answers for a
simulated H200 (`compiling_for`) while the training step and the MXFP8 inference forward are
traced at real shapes (abstract weights, so nothing is allocated or run). Their Pallas kernels, by name
and count, are the ones docs/kernels/ describes; no matmul is left to XLA (on the GPU:
cuBLAS, whose kernel choice depends on the batch); the dispatch kernel moves only whole token
rows (a wire copy's scale rows stay on XLA's gather); under expert parallelism the passes over
the receiver's buffer take its live row count. The GPU suite runs these routes; this catches a
changed route before it reaches the GPU."""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmoe.ops.device
from jaxmoe.expert_parallel import expert_parallel_forward
from jaxmoe.inference import mxfp8_inference
from jaxmoe.moe import MoE
from jaxmoe.shapes import SHAPES

from jaxprs import KERNEL_PRIMITIVE, equations, live

Kernels = collections.Counter  # kernel name -> calls


class SimulatedH200:
    platform = "gpu"
    compute_capability = "9.0"
    core_count = 132


@pytest.fixture
def simulated_h200():
    with jaxmoe.ops.device.compiling_for(SimulatedH200()):
        assert jaxmoe.ops.device.on_hopper() and jaxmoe.ops.device.num_sms() == 132
        yield
    assert not jaxmoe.ops.device.on_gpu()


TRAINING_TOKENS = 512


def model(shape_name, precision, inference=False):
    """(graphdef, params, rest) of an abstract layer of this shape (`mxfp8_inference`'s copy
    with `inference`)."""
    shape = SHAPES[shape_name].with_precision(precision)

    def build():
        layer = MoE(shape.config, shape.hidden_size, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return mxfp8_inference(layer) if inference else layer

    return nnx.split(nnx.eval_shape(build), nnx.Param, ...)


def tokens(shape_name, count):
    return jax.ShapeDtypeStruct((1, count, SHAPES[shape_name].hidden_size), jnp.bfloat16)


def training_step(shape_name, precision):
    """The equations of sum(y) + aux losses and its gradient w.r.t. (params, x) for
    TRAINING_TOKENS tokens (the loss is live, as in a training step that reports it)."""
    graphdef, params, rest = model(shape_name, precision)

    def loss(params, x, rest):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32)) + aux.total_loss

    x = tokens(shape_name, TRAINING_TOKENS)
    return list(
        equations(live(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(params, x, rest)))
    )


def inference_forward(shape_name, count):
    """The equations of the MXFP8 inference forward (`mxfp8_inference`) of `count` tokens."""
    graphdef, params, rest = model(shape_name, "mxfp8", inference=True)
    forward = lambda params, x, rest: nnx.merge(graphdef, params, rest)(x)[0]  # noqa: E731
    return list(equations(live(jax.make_jaxpr(forward)(params, tokens(shape_name, count), rest))))


def check_route(eqns, kernels, shape_name, count):
    """eqns take exactly `kernels`, no XLA matmul, and dispatch whole rows of `count` tokens."""
    taken = Kernels(e.params["name"] for e in eqns if e.primitive.name == KERNEL_PRIMITIVE)
    assert taken == kernels
    assert not [e for e in eqns if e.primitive.name in ("dot_general", "ragged_dot_general")]
    token_rows = (count * SHAPES[shape_name].hidden_size // 32, 32)  # as 32-element blocks
    for e in eqns:
        if e.primitive.name == KERNEL_PRIMITIVE and e.params["name"] == "dispatch":
            assert e.invars[1].aval.shape == token_rows


# The router's matmul: forward (at these token counts on the narrow-tile kernel) and d x,
# d weight; with fp32 logits (router_dtype "fp32") d x and d weight take the output gradient
# as three exact bf16 pieces, a product each.
ROUTER = {
    "bf16": Kernels(dense_narrow=1, gmm=1, tgmm=1),
    "fp32": Kernels(dense_narrow=1, gmm=3, tgmm=3),
}
# fc1, fc2 and the gate: forward (the gate's single column on the narrow-tile kernel), d x;
# d weight.
SHARED_GATED = Kernels(gmm=5, dense_narrow=1, tgmm=3)
PERMUTES = Kernels(dispatch=2, combine=2)  # each the other's transpose
# With MXFP8 wire copies (the mixtral MXFP8 step sends the tokens and the combine's gradient
# so) the tokens' rows are made in one pass (gathered, quantized, dequantized: their copy
# itself has no reader on one device), the gradient's copy is gathered on XLA, fused into its
# dequantization.
PERMUTES_MXFP8_WIRE = Kernels(combine=2, dispatch_fake_quantize=1)
EXPERTS = {
    "bf16": Kernels(gmm=4, tgmm=2, weighted_swiglu_backward=1),  # fc1, fc2: fwd, dgrad; wgrad
    # The bf16 GEMM kernels on dequantized copies. Rowwise copies: fc2's output gradient's
    # wire copy, the weights' fprop copies, fc2's input, fc1's output gradient; columnwise: the
    # weights' dgrad copies, the wgrad copies of both GEMMs' inputs and output gradients.
    "mxfp8": Kernels(
        gmm=4, tgmm=2, weighted_swiglu_backward=1, quantize_rowwise=5, quantize_columnwise=6
    ),
    "fp8_blockwise": Kernels(
        gmm_fp8_blockwise=4,  # fc1 and fc2: fprop and dgrad
        tgmm_fp8_blockwise=2,
        quantize_128x128_transpose=2,  # each weight's two copies
        quantize_rowwise_1x128=2,  # the wire copies: the tokens, fc2's output gradient
        requantize_1x128_transposed=2,  # their wgrad copies, from their bytes
        # fc2's input, quantized as the activation computes it: a itself is never computed
        weighted_swiglu_quantize_1x128_transpose=1,
        # fc1's output gradient, quantized as the activation's backward computes it
        weighted_swiglu_backward_quantize_1x128_transpose=1,
    ),
}
# With few experts and row tiles (mixtral's 8 at these token counts) each call of a grouped
# kernel (not the weight gradient's) gets its row tiles from the row-tiles kernel; with more,
# from XLA.
ROW_TILES = {"step": Kernels(row_tiles=4), "forward": Kernels(row_tiles=2)}
STEPS = {  # (shape, precision): the kernels of its training step
    ("mixtral", "bf16"): ROUTER["bf16"] + PERMUTES + EXPERTS["bf16"] + ROW_TILES["step"],
    ("mixtral", "mxfp8"): ROUTER["bf16"]
    + PERMUTES_MXFP8_WIRE
    + EXPERTS["mxfp8"]
    + ROW_TILES["step"],
    ("mixtral", "fp8_blockwise"): ROUTER["bf16"]
    + PERMUTES
    + EXPERTS["fp8_blockwise"]
    + ROW_TILES["step"],
    ("dsv3_ep8", "fp8_blockwise"): ROUTER["bf16"] + PERMUTES + EXPERTS["fp8_blockwise"],
    ("deepseek_v3_style", "bf16"): ROUTER["fp32"] + SHARED_GATED + PERMUTES + EXPERTS["bf16"],
    ("deepseek_v3_style", "fp8_blockwise"): ROUTER["fp32"]
    + SHARED_GATED
    + PERMUTES
    + EXPERTS["fp8_blockwise"],
}
# MXFP8 inference: the router (the narrow-tile kernel), the tokens' rows as their MXFP8 copy's
# values made in one pass, the combine, and the experts' GEMMs: at up to 64 rows an expert on
# the decode kernel (fc2's input quantized by XLA, which fuses it with the activation), above
# on the bf16 kernel with dequantized weight copies (fc2's input on the quantize kernel).
FORWARD = Kernels(dense_narrow=1, dispatch_fake_quantize=1, combine=1)
DECODE = FORWARD + Kernels(gmm_decode=2)
DEQUANTIZE = FORWARD + Kernels(gmm=2, quantize_rowwise=1)
SHARED_GATED_FORWARD = Kernels(dense_narrow=3)  # at 64 tokens
FORWARDS = {  # (shape, tokens): the kernels of the MXFP8 inference forward
    ("qwen3_30b", 1): DECODE,
    ("mixtral", 64): DECODE + ROW_TILES["forward"],
    ("deepseek_v3_style", 64): DECODE + SHARED_GATED_FORWARD,
    ("mixtral", 512): DEQUANTIZE + ROW_TILES["forward"],  # 128 rows an expert
}


@pytest.mark.parametrize("shape_name, precision", list(STEPS))
def test_training_step_on_an_h200_takes_these_kernels(simulated_h200, shape_name, precision):
    eqns = training_step(shape_name, precision)
    check_route(eqns, STEPS[shape_name, precision], shape_name, TRAINING_TOKENS)


@pytest.mark.parametrize("shape_name, count", list(FORWARDS))
def test_mxfp8_inference_on_an_h200_takes_these_kernels(simulated_h200, shape_name, count):
    check_route(
        inference_forward(shape_name, count), FORWARDS[shape_name, count], shape_name, count
    )


def expert_parallel_step(shape_name, precision, ep=2):
    """`training_step` under `expert_parallel_forward` over a (1, ep) mesh of host devices,
    TRAINING_TOKENS a rank."""
    graphdef, params, rest = model(shape_name, precision)
    mesh = jax.make_mesh((1, ep), ("data", "ep"), devices=jax.devices()[:ep])

    def loss(params, x, rest):
        y, aux = expert_parallel_forward(nnx.merge(graphdef, params, rest), x, mesh)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(aux.total_loss)

    x = jax.ShapeDtypeStruct((ep, TRAINING_TOKENS, SHAPES[shape_name].hidden_size), jnp.bfloat16)
    grad = jax.value_and_grad(loss, argnums=(0, 1))
    return list(equations(live(jax.make_jaxpr(grad)(params, x, rest))))


# Under expert parallelism the receiver's token rows (the tokens and the output gradient; with
# fp8-blockwise wire copies their fp8 data rows) are copied on the dispatch kernel, and the bf16
# activation's forward runs on its kernel (over the live rows; XLA's fusion over every row on one
# device; FP8-blockwise experts never compute a, above).
EXPERT_PARALLEL_STEPS = {
    "bf16": ROUTER["bf16"] + PERMUTES + EXPERTS["bf16"] + Kernels(weighted_swiglu_forward=1),
    "fp8_blockwise": ROUTER["bf16"] + PERMUTES + EXPERTS["fp8_blockwise"],
}
# The kernels over the receiver's rows that take its live row count (`jaxmoe.ops.live_rows`).
COUNTED = ("dispatch", "weighted_swiglu_forward", "weighted_swiglu_backward")
COUNTED += ("quantize_1x128_transpose", "requantize_1x128_transposed")
COUNTED += ("weighted_swiglu_quantize_1x128_transpose",)
COUNTED += ("weighted_swiglu_backward_quantize_1x128_transpose",)
# The activation's passes over the live rows, by precision: (forward, backward).
ACTIVATION_PASSES = {
    "bf16": ("weighted_swiglu_forward", "weighted_swiglu_backward"),
    "fp8_blockwise": COUNTED[-2:],
}


@pytest.mark.parametrize("precision", list(EXPERT_PARALLEL_STEPS))
def test_expert_parallel_step_takes_these_kernels_on_its_live_rows(simulated_h200, precision):
    """qwen3_30b at ep = 2: the kernels of the step, and every pass over the receiver's buffer
    (R x M rows) on a kernel that takes the live row count (one int32 operand more). Control:
    the combine (token rows) takes none."""
    eqns = expert_parallel_step("qwen3_30b", precision)
    taken = Kernels(e.params["name"] for e in eqns if e.primitive.name == KERNEL_PRIMITIVE)
    assert taken == EXPERT_PARALLEL_STEPS[precision]
    counted = [e for e in eqns if e.params.get("name") in COUNTED]
    assert {e.params["name"] for e in counted} >= {"dispatch", *ACTIVATION_PASSES[precision]}
    for e in counted:
        assert e.invars[-1].aval.shape == (1,) and e.invars[-1].aval.dtype == jnp.int32
    combines = [e for e in eqns if e.params.get("name") == "combine"]
    assert combines and all(e.invars[-1].aval.shape != (1,) for e in combines)


def test_without_the_simulated_h200_the_step_takes_no_kernel():
    """Control: on this CPU "auto" takes XLA everywhere (and the matmuls are XLA's)."""
    eqns = training_step("mixtral", "fp8_blockwise")
    assert not [e for e in eqns if e.primitive.name == KERNEL_PRIMITIVE]
    assert [e for e in eqns if e.primitive.name == "dot_general"]
