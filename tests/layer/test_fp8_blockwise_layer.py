"""The FP8 blockwise recipe in the layer (`MoEConfig(expert_precision="fp8_blockwise")`,
`jaxmoe.ops.fp8_blockwise_gmm`): each gradient is the GEMM of the operands the recipe names
(bitwise), the layer tracks bf16 within fp8's error, and the determinism properties hold: run
to run, a token alone equals the token in a batch (D2), training forward == inference forward
(D3), with negative controls."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe import MoE, MoEConfig, recipes
from jaxmoe import fp8_blockwise as fb
from jaxmoe.ops import fp8_blockwise_gmm, gmm, tgmm
from jaxmoe.ops.fp8_blockwise_gmm import fp8_blockwise_gmm_backward, fp8_blockwise_gmm_forward
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
    lhs and grad in 1x128 blocks along the rows, folded per 128-row block
    (`jaxmoe.ops.tgmm` on BlockwiseTensors); controls below."""
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
    assert_bitwise(out, gmm(fb.quantize_1x128(lhs), weights, sizes, preferred_element_type=BF16))
    assert_bitwise(
        d_lhs,
        gmm(fb.quantize_1x128(dy), weights, sizes, transpose_rhs=True, preferred_element_type=BF16),
    )
    lhs_t, dy_t = fb.quantize_1x128(lhs, 0), fb.quantize_1x128(dy, 0)
    assert_bitwise(d_rhs, tgmm(lhs_t, dy_t, sizes, preferred_element_type=BF16))
    # Controls: wgrad on the rowwise (fprop / dgrad) copies gives other bf16 bits; and at fp32
    # the per-block folds differ from one chain over the dequantized copies (rounded to bf16,
    # as the layer's gradient is, that difference vanishes at this size: 0 of 65,536 elements).
    rowwise = [fb.dequantize(fb.quantize_1x128(a), BF16) for a in (lhs, dy)]
    assert differs(d_rhs, tgmm(*rowwise, sizes, preferred_element_type=BF16))
    folds = tgmm(lhs_t, dy_t, sizes, preferred_element_type=jnp.float32)
    assert_bitwise(d_rhs, folds.astype(BF16))
    dequantized = [fb.dequantize(a, BF16) for a in (lhs_t, dy_t)]
    assert differs(folds, tgmm(*dequantized, sizes, preferred_element_type=jnp.float32))


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


def test_copies_routes_give_the_default_routes_bits():
    """`fp8_blockwise_gmm(lhs_is_dequantized=True)` on lhs = a 1x128 copy's dequantized rows,
    and `fp8_blockwise_gmm_backward` given the output gradient's copy (grad_quantized), have the
    bits of the default routes (which quantize those values again) in the output and both
    gradients, without reading lhs's or the gradient's values (zeros passed instead); controls:
    the default routes on those zeros differ."""
    rng = np.random.default_rng(4)
    spread = 2.0 ** rng.integers(-6, 6, (384, 256))
    copy = fb.quantize_1x128(jnp.asarray(rng.normal(size=(384, 256)) * spread, BF16), 1)
    lhs = fb.dequantize(copy, BF16)
    rhs = jnp.asarray(rng.normal(size=(2, 256, 128)), BF16)
    grad_copy = fb.quantize_1x128(jnp.asarray(rng.normal(size=(384, 128)) * 2.0**-3, BF16), 1)
    grad = fb.dequantize(grad_copy, BF16)
    sizes = jnp.array([256, 128])

    def step(a, **route):
        out, vjp = jax.vjp(
            lambda a, b: fp8_blockwise_gmm(a, b, sizes, preferred_element_type=BF16, **route),
            a,
            rhs,
        )
        return (out, *vjp(grad))

    default = step(lhs)
    for ours, want in zip(
        step(jnp.zeros_like(lhs), lhs_quantized=copy, lhs_is_dequantized=True), default, strict=True
    ):
        assert_bitwise(ours, want)
    assert differs(step(jnp.zeros_like(lhs), lhs_quantized=copy)[2], default[2])
    _, residuals = fp8_blockwise_gmm_forward(lhs, rhs, sizes, out_dtype=BF16, impl="xla")
    want = fp8_blockwise_gmm_backward(residuals, grad)
    ours = fp8_blockwise_gmm_backward(residuals, jnp.zeros_like(grad), grad_copy)
    for a, b in zip(ours, want, strict=True):
        assert_bitwise(a, b)
    assert differs(fp8_blockwise_gmm_backward(residuals, jnp.zeros_like(grad))[1], want[1])
    with pytest.raises(ValueError, match="lhs_is_dequantized needs lhs_quantized"):
        fp8_blockwise_gmm(lhs, rhs, sizes, lhs_is_dequantized=True)


def test_refusals():
    with pytest.raises(ValueError, match="multiple of 128"):
        CONFIG.replace(expert_row_alignment=32)
    with pytest.raises(ValueError, match="expert_precision"):
        CONFIG.replace(expert_precision="fp8")
    with pytest.raises(ValueError, match="dispatch_dtype"):
        CONFIG.replace(dispatch_dtype="fp8")
    with pytest.raises(ValueError, match="combine_bwd_dtype"):
        CONFIG.replace(combine_bwd_dtype="blockwise")
    with pytest.raises(ValueError, match="lhs_quantized"):
        fp8_blockwise_gmm(
            jnp.ones((128, 128)),
            jnp.ones((1, 128, 128)),
            jnp.array([128]),
            lhs_quantized=fb.quantize_1x128(jnp.ones((128, 128)), 0),
        )
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_blockwise_gmm(jnp.ones((128, 96)), jnp.ones((1, 96, 128)), jnp.array([128]))
    with pytest.raises(ValueError, match="multiples of 128"):
        # group sizes known on the host (numpy) on any platform
        fp8_blockwise_gmm(jnp.ones((256, 128)), jnp.ones((2, 128, 128)), np.array([100, 156]))
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


# ------------------------------------------------------------- FP8-blockwise tokens on the wire
def spread_tokens(n, seed=8):
    """Tokens whose 1x128 and 32-wide blocks see different maxima (columns scaled by powers of
    two), so that MXFP8 and 1x128 copies differ."""
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-6, 3, (1, H))
    return jnp.asarray(rng.normal(size=(n, H)) * scale, BF16)


def flat_gradients(grads):
    return {"/".join(map(str, path)): v[...] for path, v in nnx.to_flat_state(grads)}


def test_dispatched_blockwise_copy_is_the_quantized_rows():
    """dispatch_dtype "fp8_blockwise": what travels is each token's 1x128 copy along H, moved to
    its rows (data bitwise that of quantizing the dispatched rows; padding rows zero data and
    zero scales), and the experts' rows are its dequantized values."""
    model = make(CONFIG.replace(dispatch_dtype="fp8_blockwise"))
    x = spread_tokens(40)
    _, _, stages = nnx.jit(lambda m, x: m.forward_with_stages(x))(model, x[None])
    wire = stages.dispatched_quantized
    assert isinstance(wire, fb.BlockwiseTensor) and wire.block_axes == (1,)
    row_token = np.asarray(stages.plan.row_token())
    padded = jnp.concatenate([x, jnp.zeros((1, H), BF16)])[row_token]
    quantized = fb.quantize_1x128(padded, 1)
    real = row_token < x.shape[0]
    assert 0 < real.sum() < len(row_token)  # padding rows exist
    assert_bitwise(wire.data, quantized.data)
    assert_bitwise(np.asarray(wire.scale_inv)[real], np.asarray(quantized.scale_inv)[real])
    assert not np.asarray(wire.scale_inv)[~real].any()
    assert_bitwise(stages.dispatched_rows, fb.dequantize(quantized, BF16))
    assert differs(stages.dispatched_rows, padded)  # control: the rows are not the bf16 tokens


def layer_step(config, x):
    """y, d x and every parameter gradient of <y, c> + aux losses, by name, for a cotangent c
    whose elements are spread over powers of two (so its blocks along H and along the tokens
    see different maxima)."""
    model = make(config)
    rng = np.random.default_rng(9)
    c = jnp.asarray(rng.normal(size=x.shape) * 2.0 ** rng.integers(-8, 1, x.shape), jnp.float32)

    def loss(model, x):
        y, aux = model(x)
        return jnp.sum(y.astype(jnp.float32) * c) + aux.total_loss, y

    (_, y), (d_model, d_x) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        model, x
    )
    return dict(y=y, d_x=d_x, **flat_gradients(d_model))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("option", ["dispatch_dtype", "combine_bwd_dtype"])
def test_blockwise_experts_with_a_blockwise_wire(option, bias):
    """FP8-blockwise experts with an FP8-blockwise wire: the wire copy is what the recipe would
    quantize (fc1's fprop operand; in value, fc2's dgrad operand, which takes it as it is), so
    y, d x and every gradient but that GEMM's weight gradient have the bits of the bf16 wire;
    the weight gradient's copy along the tokens comes from the wire copy's values, as TE
    derives it, and differs (with biases, fc2's bias gradient, a sum of the wire rows, too).
    Control: for bf16 experts the same wire changes y (dispatch) or d x (combine)."""
    x = spread_tokens(48).reshape(2, 24, H)
    config = CONFIG.replace(add_bias_linear=bias)
    bf16_wire = layer_step(config, x)
    blockwise_wire = layer_step(config.replace(**{option: "fp8_blockwise"}), x)
    changed = {"experts/fc1_kernel"} if option == "dispatch_dtype" else {"experts/fc2_kernel"}
    if bias and option == "combine_bwd_dtype":
        changed.add("experts/fc2_bias")
    assert changed <= set(bf16_wire)
    for name, value in bf16_wire.items():
        if name in changed:
            assert differs(blockwise_wire[name], value), name
        else:
            assert_bitwise(blockwise_wire[name], value)
    control = "y" if option == "dispatch_dtype" else "d_x"
    bf16_experts = config.replace(expert_precision="bf16")
    assert differs(
        layer_step(bf16_experts.replace(**{option: "fp8_blockwise"}), x)[control],
        layer_step(bf16_experts, x)[control],
    )


def test_fc1_takes_the_dispatched_copy_as_it_is(monkeypatch):
    """With dispatch_dtype "fp8_blockwise" the forward quantizes fc1's operand along K no more:
    fc1 makes only the weight gradient's K-major copy, from the dispatched copy's fp8 bytes
    (`requantize_1x128_transposed`); with bf16 rows fc1 makes both (`quantize_1x128_with_transpose`).
    fc2's two copies come from the activation's quantize of h
    (`weighted_activation_quantize_1x128_with_transpose`), not from a quantize of a."""
    gmm_module = importlib.import_module("jaxmoe.ops.fp8_blockwise_gmm")  # not the function
    recipes_module = importlib.import_module("jaxmoe.recipes")
    calls = []
    spied = [
        (gmm_module, "quantize_1x128_with_transpose"),
        (gmm_module, "quantize_1x128_transposed"),
        (gmm_module, "requantize_1x128_transposed"),
        (recipes_module, "weighted_activation_quantize_1x128_with_transpose"),
    ]
    for module, name in spied:
        original = getattr(module, name)

        def spy(*args, impl="auto", _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, impl="xla", **kwargs)

        monkeypatch.setattr(module, name, spy)
    x = tokens(32)[None]
    counts = {}
    for wire in ("bf16", "fp8_blockwise"):
        calls.clear()
        nnx.eval_shape(lambda m, x: m(x), make(CONFIG.replace(dispatch_dtype=wire)), x)
        counts[wire] = sorted(calls)
    fc2 = "weighted_activation_quantize_1x128_with_transpose"
    assert counts == {
        "bf16": ["quantize_1x128_with_transpose", fc2],
        "fp8_blockwise": ["requantize_1x128_transposed", fc2],
    }


def test_bf16_experts_take_the_dequantized_wire_rows():
    """bf16 experts with both wire options "fp8_blockwise": the forward is the bf16 layer on the
    dequantized rows (the router still sees the tokens), and the output gradient reaching the
    experts is the dequantized copy of the token gradient; the layer runs run to run the same
    and a token alone equals the token in the batch (D2)."""
    config = CONFIG.replace(
        expert_precision="bf16", dispatch_dtype="fp8_blockwise", combine_bwd_dtype="fp8_blockwise"
    )
    model, x = make(config), spread_tokens(33)[None]
    y1, g1 = training(model, x)
    y2, g2 = training(model, x)
    assert_bitwise(y1, y2)
    for (_, a), (_, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g2)):
        assert_bitwise(a[...], b[...])
    _, _, stages = nnx.jit(lambda m, x: m.forward_with_stages(x))(model, x)
    row_token = np.asarray(stages.plan.row_token())
    rows = jnp.concatenate([x[0], jnp.zeros((1, H), BF16)])[row_token]
    assert_bitwise(stages.dispatched_rows, fb.dequantize(fb.quantize_1x128(rows, 1), BF16))
    bf16_wire = make(CONFIG.replace(expert_precision="bf16"))
    assert differs(inference(bf16_wire, x), y1)  # control
    alone = inference(model, x[:, 5:6])
    assert_bitwise(inference(model, x)[:, 5:6], alone)


@pytest.mark.parametrize("loss_of", ["y", "y_and_fc1_output", "fc1_output"])
def test_fc1_and_activation_in_one_vjp_give_the_unfused_bits(monkeypatch, loss_of):
    """SwiGLU experts run fc1 and the activation as one VJP (`Fp8BlockwiseRecipe.
    fc1_and_activation`), whose backward quantizes d h as the activation's backward makes it
    (`ops.weighted_activation_backward_quantize_1x128_with_transpose`) and hands both copies
    to fc1's backward: every gradient is bitwise that of fc1 then the activation, for a loss
    of y, of y and the fc1_output stage (d h is then the sum, quantized by fc1's backward),
    and of that stage alone. Control: the fused copies are made exactly when d h is the
    activation's alone."""
    calls = []
    fused_op = recipes.weighted_activation_backward_quantize_1x128_with_transpose
    monkeypatch.setattr(
        recipes,
        "weighted_activation_backward_quantize_1x128_with_transpose",
        lambda *args, **kwargs: calls.append(1) or fused_op(*args, **kwargs),
    )

    def gradients():
        def loss(model, x):
            y, aux, stages = model.forward_with_stages(x)
            total = aux.total_loss
            if loss_of.startswith("y"):
                total += jnp.sum(y.astype(jnp.float32) ** 2)
            if loss_of.endswith("fc1_output"):
                total += 1e-3 * jnp.sum(stages.fc1_output.astype(jnp.float32) ** 2)
            return total

        return nnx.jit(nnx.grad(loss))(make(), tokens(64).reshape(2, 32, H))

    fused = gradients()
    assert len(calls) == (loss_of == "y")
    monkeypatch.setattr(recipes.Fp8BlockwiseRecipe, "fc1_and_activation", lambda *a, **k: None)
    unfused = gradients()
    for ours, theirs in zip(jax.tree.leaves(fused), jax.tree.leaves(unfused), strict=True):
        assert_bitwise(ours, theirs)
