"""The FP8 blockwise recipe in the layer (`MoEConfig(expert_precision="fp8_blockwise")`,
`jaxmoe.ops.fp8_blockwise_gmm`): each gradient is the GEMM of the operands the recipe names
(bitwise), the layer tracks bf16 within fp8's error, and the determinism properties hold: run
to run, a token alone equals the token in a batch (D2), training forward == inference forward
(D3), with negative controls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import MoE, MoEConfig
from jaxmoe import fp8_blockwise as fb
from jaxmoe.ops import fp8_blockwise_gmm, gmm_fp8_blockwise, tgmm
from jaxmoe.shapes import SHAPES

from bitwise import assert_bitwise, differs

H = 128
CONFIG = MoEConfig(
    num_experts=4,
    top_k=2,
    ffn_hidden_size=128,
    expert_precision="fp8_blockwise",
    expert_row_alignment=128,
)
BF16 = jnp.bfloat16


def make(config=CONFIG, seed=0):
    return MoE(config, H, param_dtype=BF16, rngs=nnx.Rngs(seed))


def tokens(n, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, H)).astype(BF16)


def training(model, x):
    """(y, gradients) of sum(y^2) + aux losses, one compiled step."""

    def loss(model, x):
        y, aux = model(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux.total_loss, y

    (_, y), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, x)
    return y, grads


def inference(model, x):
    return nnx.jit(lambda m, x: m(x)[0])(model, x)


def test_gradients_are_the_recipes_gemms_bitwise():
    """dgrad: grad in 1x128 blocks along N times the weights' 128x128 blocks transposed; wgrad:
    lhs and grad in 1x128 blocks along the rows, dequantized, through tgmm; control: the
    forward's lhs copy (blocks along K) in wgrad differs."""
    rng = np.random.default_rng(0)
    spread = 2.0 ** rng.integers(0, 6, (384, 1)) * 2.0 ** rng.integers(0, 6, (1, 256))
    lhs = jnp.asarray(rng.normal(size=(384, 256)) * spread, BF16)  # the two block directions differ
    rhs = jnp.asarray(rng.normal(size=(2, 256, 128)), BF16)
    dy = jnp.asarray(rng.normal(size=(384, 128)), BF16)
    sizes = jnp.array([256, 128])
    out, vjp = jax.vjp(
        lambda a, b: fp8_blockwise_gmm(a, b, sizes, preferred_element_type=BF16), lhs, rhs
    )
    d_lhs, d_rhs = vjp(dy)
    weights = fb.quantize_128x128(rhs)
    assert_bitwise(
        out, gmm_fp8_blockwise(fb.quantize_1x128(lhs), weights, sizes, preferred_element_type=BF16)
    )
    assert_bitwise(
        d_lhs,
        gmm_fp8_blockwise(
            fb.quantize_1x128(dy), weights, sizes, transpose_rhs=True, preferred_element_type=BF16
        ),
    )
    wgrad = lambda a: tgmm(
        a, fb.dequantize(fb.quantize_1x128(dy, 0), BF16), sizes, preferred_element_type=BF16
    )
    assert_bitwise(d_rhs, wgrad(fb.dequantize(fb.quantize_1x128(lhs, 0), BF16)))
    assert differs(d_rhs, wgrad(fb.dequantize(fb.quantize_1x128(lhs, 1), BF16)))


def test_layer_tracks_bf16_within_fp8_error():
    x = tokens(64).reshape(2, 32, H)
    y8, g8 = training(make(), x)
    yb, gb = training(make(CONFIG.replace(expert_precision="bf16")), x)
    rel = lambda a, b: float(
        jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32))
    )
    assert 0 < rel(y8, yb) < 0.15
    for (path, a), (_, b) in zip(nnx.to_flat_state(g8), nnx.to_flat_state(gb)):
        assert np.all(np.isfinite(np.asarray(a[...], np.float32))), path
        assert 0 < rel(a[...], b[...]) < 0.2, path


def test_run_to_run_and_training_forward_equals_inference_forward():
    model, x = make(), tokens(48).reshape(1, 48, H)
    y1, g1 = training(model, x)
    y2, g2 = training(model, x)
    assert_bitwise(y1, y2)
    for (_, a), (_, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g2)):
        assert_bitwise(a[...], b[...])
    assert_bitwise(inference(model, x), y1)
    assert differs(inference(make(CONFIG.replace(expert_precision="bf16")), x), y1)


@pytest.mark.parametrize("position", [0, 17, 64])
def test_token_alone_equals_token_in_batch(position):
    model = make()
    others, needle = tokens(64, seed=2), tokens(1, seed=3)
    batch = jnp.concatenate([others[:position], needle, others[position:]])
    alone = inference(model, needle[None])[0]
    assert_bitwise(inference(model, batch[None])[0, position : position + 1], alone)


def test_negative_control_blocks_along_tokens_are_batch_variant():
    """Quantizing the fprop rows in 1x128 blocks along the tokens (the wgrad copy's direction)
    would tie a token's output to its neighbours: the D2 check above would see it."""
    rng = np.random.default_rng(4)
    rows = jnp.asarray(rng.normal(size=(128, 128)) * 2.0 ** rng.integers(0, 6, (128, 1)), BF16)
    rows = rows.at[0].multiply(2.0**-8)  # its neighbours set its columns' scales
    along_tokens = fb.dequantize(fb.quantize_1x128(rows, 0), BF16)
    alone = fb.dequantize(fb.quantize_1x128(rows[:1], 0), BF16)
    assert differs(along_tokens[:1], alone)
    along_k = fb.dequantize(fb.quantize_1x128(rows, 1), BF16)
    assert_bitwise(along_k[:1], fb.dequantize(fb.quantize_1x128(rows[:1], 1), BF16))


def test_refusals():
    with pytest.raises(ValueError, match="multiple of 128"):
        CONFIG.replace(expert_row_alignment=32)
    with pytest.raises(ValueError, match="expert_precision"):
        CONFIG.replace(expert_precision="fp8")
    with pytest.raises(ValueError, match="dispatch_dtype"):
        CONFIG.replace(dispatch_dtype="fp8_blockwise")
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_blockwise_gmm(jnp.ones((128, 96)), jnp.ones((1, 96, 128)), jnp.array([128]))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_blockwise_gmm(jnp.ones((256, 128)), jnp.ones((2, 128, 128)), jnp.array([100, 156]))
    with pytest.raises(ValueError, match="multiples of 128"):
        MoE(CONFIG.replace(ffn_hidden_size=96), H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no quantized weight copies"):
        make(CONFIG.replace(expert_precision="bf16")).quantize_expert_weights()


def test_weights_quantized_once_per_step_give_the_same_bits():
    """MoE.quantize_expert_weights() once, two micro-batches with expert_weights=: outputs and
    gradients (the bf16 master weights' included) equal quantizing in every call; copies of
    other weights are used as given (control)."""
    model = make()
    weights = model.quantize_expert_weights()
    stale = make(seed=5).quantize_expert_weights()

    def step(x, expert_weights):
        def loss(model, x):
            y, aux = model(x, expert_weights=expert_weights)
            return jnp.sum(y.astype(jnp.float32) ** 2) + aux.total_loss, y

        (_, y), g = nnx.value_and_grad(loss, has_aux=True)(model, x)
        return [y, *jax.tree.leaves(g)]

    for seed in (6, 7):
        x = tokens(40, seed)[None]
        for a, b in zip(step(x, weights), step(x, None)):
            assert_bitwise(a, b)
    assert differs(step(x, stale)[0], step(x, None)[0])
    with pytest.raises(ValueError, match="fp8_blockwise copies"):
        model(
            x,
            expert_weights=make(
                CONFIG.replace(expert_precision="mxfp8", expert_row_alignment=32)
            ).quantize_expert_weights(),
        )


def test_every_benchmark_shape_runs_in_fp8_blockwise():
    """`LayerShape.with_precision("fp8_blockwise")` (the layer benchmark's jaxmoe_fp8_blockwise)
    gives a layer the recipe accepts at every real shape (H and F multiples of 128); unknown
    precisions are refused."""
    for shape in SHAPES.values():
        blockwise = shape.with_precision("fp8_blockwise")
        assert blockwise.config.expert_precision == "fp8_blockwise"
        nnx.eval_shape(lambda s=blockwise: MoE(s.config, s.hidden_size, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="precision must be one of"):
        SHAPES["mixtral"].with_precision("fp4")
