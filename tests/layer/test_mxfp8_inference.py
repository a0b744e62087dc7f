"""MXFP8 inference (`jaxmoe.mxfp8_inference`): the routed experts stored only as their MXFP8
fprop copies (fp8 data and uint8 scales, no high-precision expert weights), and a token's
output bitwise the training forward's (D3) at any batch size (D2), with MXFP8 or bf16 tokens on
the dispatch. Controls: the bf16-expert layer, and copies of other weights, give other bits."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bridge import errors as megatron_errors
from bridge import megatron
from jaxmoe import MoE, MoEConfig, mxfp8, mxfp8_inference
from jaxmoe.mxfp8 import MXTensor
from jaxmoe.ops import Mxfp8Kernel, gmm, on_hopper
from jaxmoe.ops.mxfp8_gmm import mxfp8_gmm, quantize_mxfp8_weights
from jaxmoe.ops.pallas.gmm_decode_hopper import tile_weights
from jaxmoe.ordered import sum_in_order
from jaxmoe.plan import MIN_BUFFER_ROWS

from bitwise import assert_bitwise, differs

H = 64
MXFP8 = MoEConfig(
    num_experts=8,
    top_k=2,
    ffn_hidden_size=64,
    expert_precision="mxfp8",
    dispatch_dtype="mxfp8",
    combine_bwd_dtype="mxfp8",
    expert_row_alignment=32,
    shared_expert_intermediate_size=32,
)


def make(config, seed=0):
    model = MoE(config, H, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(1), (2, 24, H)).astype(jnp.bfloat16)
    return model, x


def training_output(model, x):
    """y of the training step (value and gradients computed together)."""

    def loss(model, x):
        y, aux = model(x)
        return sum_in_order(jnp.ravel(y.astype(jnp.float32))) + aux.total_loss, y

    (_, y), _ = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, x)
    return np.asarray(y)


def inference_output(model, x):
    return np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, x))


@pytest.mark.parametrize("dispatch_dtype", ["mxfp8", "bf16"])
def test_inference_forward_is_the_training_forward_at_any_batch(dispatch_dtype):
    model, x = make(MXFP8.replace(dispatch_dtype=dispatch_dtype))
    inference = mxfp8_inference(model)
    trained = training_output(model, x)
    assert_bitwise(inference_output(inference, x), trained)
    assert_bitwise(inference_output(inference, x[:1, :1]), trained[:1, :1])  # a token alone
    assert_bitwise(inference_output(inference, x[:, :12]), trained[:, :12])  # the first half
    # Controls: bf16 experts, or copies of other weights, give other bits.
    bf16 = MXFP8.replace(expert_precision="bf16", combine_bwd_dtype="bf16")
    assert differs(
        inference_output(make(bf16.replace(dispatch_dtype=dispatch_dtype))[0], x), trained
    )
    other, _ = make(MXFP8.replace(dispatch_dtype=dispatch_dtype), seed=0)
    other.experts.fc2_kernel[...] = other.experts.fc2_kernel[...] * 1.5
    assert differs(inference_output(mxfp8_inference(other), x), trained)


def test_the_inference_buffer_has_no_padding_rows():
    """The forward-only copy pads no expert block (MXFP8's 32-row blocks serve the backward):
    one token's 2 rows in a buffer of MIN_BUFFER_ROWS, not 8 experts x 31 padding rows."""
    model, x = make(MXFP8)
    inference = mxfp8_inference(model)
    assert (model.row_alignment, inference.row_alignment) == (32, 1)
    stages = nnx.jit(lambda m, x: m.forward_with_stages(x)[2])
    assert stages(inference, x[:1, :1]).dispatched_rows.shape[0] == MIN_BUFFER_ROWS
    assert stages(model, x[:1, :1]).dispatched_rows.shape[0] == 2 + 8 * 31 + 6  # rounded up to 32


def test_experts_are_stored_as_mxfp8_alone():
    model, _ = make(MXFP8)
    experts = nnx.state(mxfp8_inference(model).experts)
    dtypes = {str(a.dtype) for a in jax.tree.leaves(experts)}
    assert dtypes == {"float8_e4m3fn", "uint8"}
    stored = sum(a.nbytes for a in jax.tree.leaves(experts))
    weights = model.experts.fc1_kernel[...].size + model.experts.fc2_kernel[...].size
    assert stored == weights * 33 // 32  # one byte a weight, one scale byte per 32
    assert model.experts.fc1_kernel[...].dtype == jnp.bfloat16  # the model is left as it is


def test_small_scale_copies_are_marked_for_the_integer_dequantization():
    """Trained weights qualify for the decode kernel's integer dequantization (checked once,
    when the copies are made); an expert whose block amax exceeds 448 x 2^7 does not, and neither do
    copies made under a trace (they cannot be inspected)."""
    model, x = make(MXFP8)
    inference = mxfp8_inference(model)
    assert inference.experts.small_scales
    large, _ = make(MXFP8)
    large.experts.fc2_kernel[...] = large.experts.fc2_kernel[...].at[3, 0, 0].set(2.0**16)
    assert not mxfp8_inference(large).experts.small_scales
    assert_bitwise(inference_output(mxfp8_inference(large), x), training_output(large, x))

    @nnx.jit
    def traced(model):
        assert not mxfp8_inference(model).experts.small_scales
        return 0

    traced(model)


def test_refusals():
    bf16, _ = make(MXFP8.replace(expert_precision="bf16", combine_bwd_dtype="bf16"))
    with pytest.raises(ValueError, match="expert_precision='mxfp8'"):
        mxfp8_inference(bf16)
    model, x = make(MXFP8)
    with pytest.raises(TypeError, match="kernel must be an Mxfp8Kernel"):
        mxfp8_inference(model, kernel="decode")
    inference = mxfp8_inference(model)
    with pytest.raises(ValueError, match="holds its MXFP8 copies"):
        inference(x, expert_weights=model.quantize_expert_weights())
    rows = x.reshape(-1, H)[:32]
    with pytest.raises(ValueError, match="pass its copies as rhs_quantized"):
        mxfp8_gmm(rows, None, jnp.array([32], jnp.int32))


@pytest.mark.exhaustive
def test_gemm_kernels_run_the_stored_copies(interpret):
    """Every bit-preserving kernel on the stored copies (K and N multiples of 128), against
    DEQUANTIZE: bitwise on the H200; in the CPU interpreter, whose wgmma sums a call's K slice
    in another order, within the normwise bound of `test_moe_layer_mxfp8_pallas_matches_xla`
    (a last-bit difference may move a later MXFP8 rounding one e4m3 step). DEQUANTIZE on the
    kernels, with the inference copy's unpadded expert blocks, is bitwise the training forward
    on the same kernels with 32-row blocks."""
    config = MXFP8.replace(num_experts=4, ffn_hidden_size=128, shared_expert_intermediate_size=None)
    model = MoE(config, 128, param_dtype=jnp.bfloat16, gmm_impl="pallas", rngs=nnx.Rngs(2))
    x = jax.random.normal(jax.random.key(3), (1, 16, 128)).astype(jnp.bfloat16)
    kernels = (Mxfp8Kernel.DEQUANTIZE, Mxfp8Kernel.FUSED_DEQUANTIZE, Mxfp8Kernel.DECODE)
    y = {kernel: inference_output(mxfp8_inference(model, kernel=kernel), x) for kernel in kernels}
    assert_bitwise(y[Mxfp8Kernel.DEQUANTIZE], training_output(model, x))
    for kernel in kernels[1:]:
        if on_hopper():
            assert_bitwise(y[kernel], y[Mxfp8Kernel.DEQUANTIZE])
        else:
            a, b = y[kernel].astype(np.float32), y[Mxfp8Kernel.DEQUANTIZE].astype(np.float32)
            assert np.linalg.norm(a - b) <= 2**-6 * np.linalg.norm(b)


def relayouts(hlo: str, shapes, dtype: str = "u8") -> list:
    """The transposes and copies that the compiled module makes of `dtype` arrays of `shapes`."""
    found = re.findall(rf"= {dtype}\[([\d,]+)\]\{{[\d,]*\}} (transpose|copy)\(", hlo)
    return [(dims, op) for dims, op in found if tuple(map(int, dims.split(","))) in shapes]


def test_decode_forward_reads_the_stored_copies_in_place(interpret):
    """The stored copies are laid out as the decode kernel reads them, the scale bytes
    block-major and the data in 128 x 128 tiles: the compiled forward makes no transposed copy
    of any expert's scales or data (a per-call pass over every expert's would cost more than the
    kernel at a token or two). Controls: an MXTensor stored in its own layout gets both. fc1's K
    (the hidden size, 256) spans two tiles, so that tiling its data is a true transposition
    (with one K tile XLA:GPU makes it a bitcast)."""
    config = MXFP8.replace(num_experts=4, ffn_hidden_size=128, shared_expert_intermediate_size=None)
    model = MoE(config, 256, param_dtype=jnp.bfloat16, gmm_impl="pallas", rngs=nnx.Rngs(2))
    x = jax.ShapeDtypeStruct((1, 4, 256), jnp.bfloat16)
    decode = mxfp8_inference(model, kernel=Mxfp8Kernel.DECODE)
    experts = decode.experts
    fc1, fc2 = experts.fc1_scale[...], experts.fc2_scale[...]
    shapes = {a.shape for a in (fc1, fc2)} | {a.shape[:1] + a.shape[:0:-1] for a in (fc1, fc2)}
    tiles = {experts.fc1_data.shape, experts.fc2_data.shape}
    data = tiles | {copy.shape for copy in experts.fprop_copies()}
    assert tiles == {(4, 2, 2, 128, 128), (4, 2, 1, 128, 128)}
    graphdef, state = nnx.split(decode)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)[0])
    hlo = forward.lower(state, x).compile().as_text()
    assert relayouts(hlo, shapes) == [] and relayouts(hlo, data, "f8e4m3fn") == []

    fprop = quantize_mxfp8_weights(model.experts.fc1_kernel[...], dgrad=False).fprop
    rows = MXTensor(
        jnp.zeros((32, 256), jnp.float8_e4m3fn), jnp.zeros((32, 8), jnp.uint8), 1, "e4m3"
    )
    gemm = jax.jit(
        lambda w: gmm(
            rows,
            w,
            jnp.full((4,), 8),
            transpose_rhs=True,
            impl="pallas",
            kernel=Mxfp8Kernel.DECODE,
            rhs_tiled=tile_weights(w.data),
        )
    )
    hlo = gemm.lower(fprop).compile().as_text()
    assert relayouts(hlo, shapes) and relayouts(hlo, data, "f8e4m3fn")


def test_decode_forward_quantizes_the_fc2_input_with_xla(interpret):
    """With the decode kernel, fc2's input is quantized by the XLA quantizer (the same bits),
    which XLA fuses with the activation and the dequantization that the kernel reads; the
    DEQUANTIZE kernel runs the Pallas quantizer on it. Both quantize the dispatched
    tokens with the Pallas quantizer."""
    config = MXFP8.replace(num_experts=4, ffn_hidden_size=128, shared_expert_intermediate_size=None)
    model = MoE(config, 128, param_dtype=jnp.bfloat16, gmm_impl="pallas", rngs=nnx.Rngs(2))
    x = jax.ShapeDtypeStruct((1, 4, 128), jnp.bfloat16)
    kernels = {}
    for kernel in (Mxfp8Kernel.DECODE, Mxfp8Kernel.DEQUANTIZE):
        graphdef, state = nnx.split(mxfp8_inference(model, kernel=kernel))
        forward = lambda state, x: nnx.merge(graphdef, state)(x)[0]  # noqa: B023
        jaxpr = str(jax.make_jaxpr(forward)(state, x))
        kernels[kernel] = jaxpr.count("kernel_name='quantize_rowwise'")
    assert kernels == {Mxfp8Kernel.DECODE: 1, Mxfp8Kernel.DEQUANTIZE: 2}


def test_a_megatron_checkpoint_runs_as_mxfp8_inference():
    """A real Megatron-Core checkpoint (the deepseek_bf16 fixture: sigmoid routing, groups,
    expert bias, shared expert) built with an MXFP8 config and kept as MXFP8 copies alone: the
    training forward's bits, in the batch and for a token alone."""
    root = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron", "deepseek_bf16"
    )
    ckpt = megatron.load(os.path.join(root, "torch_dist"), os.path.join(root, "config.json"))
    model = megatron.build_moe(ckpt, 0, config=ckpt.config.with_precision("mxfp8"))
    # on JAX's default device, where the layer runs (not the host, where torch loaded them)
    assert {a.device for a in jax.tree.leaves(nnx.state(model))} == {jax.devices()[0]}
    x = jax.random.normal(jax.random.key(4), (2, 16, model.hidden_size)).astype(jnp.bfloat16)
    inference = mxfp8_inference(model)
    trained = training_output(model, x)
    assert_bitwise(inference_output(inference, x), trained)
    assert_bitwise(inference_output(inference, x[1:, 5:6]), trained[1:, 5:6])


def te_mxfp8_storage(weight: torch.Tensor) -> megatron.MXFP8Weight:
    """One expert weight [out, in] as Transformer Engine keeps it in MXFP8 (TE's recipe:
    rowwise data and the GEMM-swizzled, padded scale_inv), refitted as the bridge reads it."""
    rowwise = mxfp8.quantize(jnp.asarray(weight.float().numpy()).astype(jnp.bfloat16), axis=1)
    data = torch.from_numpy(np.asarray(rowwise.data).view(np.uint8).copy())
    scale_inv = torch.from_numpy(np.asarray(mxfp8.swizzled_scales(rowwise)).copy())
    return megatron.refit_mxfp8(data, scale_inv, swizzled=True, layout="megatron")


def test_te_mxfp8_expert_weights_run_as_they_are():
    """A Megatron layer whose experts come as Transformer Engine MXFP8 weights (rowwise data and
    swizzled scale_inv per expert), refitted (`megatron.refit_mxfp8`), stacked
    (`megatron.expert_fprop_copy`) and stored as they are by `mxfp8_inference(fprop_copies=)`:
    TE's bytes from the checkpoint's weights give the forward of the layer that quantizes those
    weights itself, bitwise. Control: a changed byte stays changed (nothing is re-quantized) and
    changes the output."""
    root = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron", "deepseek_bf16"
    )
    ckpt = megatron.load(os.path.join(root, "torch_dist"), os.path.join(root, "config.json"))
    model = megatron.build_moe(ckpt, 0, config=ckpt.config.with_precision("mxfp8"))
    weights = ckpt.layer(0)
    te = {
        name: [te_mxfp8_storage(w) for w in getattr(weights, name)]
        for name in ("fc1_weight", "fc2_weight")
    }
    copies = tuple(megatron.expert_fprop_copy(te[name]) for name in ("fc1_weight", "fc2_weight"))
    x = jax.random.normal(jax.random.key(5), (2, 16, model.hidden_size)).astype(jnp.bfloat16)
    refitted = mxfp8_inference(model, fprop_copies=copies)
    y = inference_output(refitted, x)
    assert_bitwise(y, inference_output(mxfp8_inference(model), x))
    stored = np.asarray(refitted.experts.fprop_copies()[0].data).view(np.uint8)
    np.testing.assert_array_equal(stored, np.asarray(copies[0].data).view(np.uint8))

    data = np.asarray(copies[0].data).view(np.uint8).copy()
    # The lowest mantissa bit of every expert's first two blocks, where that makes no NaN.
    first = data[:, :, :64]
    first ^= ((first & 0x7F) < 0x7E).astype(np.uint8)
    changed = MXTensor(jnp.asarray(data).view(jnp.float8_e4m3fn), copies[0].scale, 2, "e4m3")
    other = mxfp8_inference(model, fprop_copies=(changed, copies[1]))
    stored = np.asarray(other.experts.fprop_copies()[0].data).view(np.uint8)
    np.testing.assert_array_equal(stored, data)
    assert differs(inference_output(other, x), y)

    with pytest.raises(ValueError, match="fc1 copy must be e4m3"):
        mxfp8_inference(model, fprop_copies=copies[::-1])
    e5m2 = MXTensor(copies[0].data.astype(jnp.float8_e5m2), copies[0].scale, 2, "e5m2")
    with pytest.raises(ValueError, match="fc1 copy must be e4m3"):
        mxfp8_inference(model, fprop_copies=(e5m2, copies[1]))
    with pytest.raises(megatron_errors.MXFP8LayoutError, match="rowwise copy"):
        megatron.expert_fprop_copy([megatron.MXFP8Weight(rowwise=copies[0])])
