"""The nnx module in use: transforms, dtypes, linen adapter, stateful options, the demo."""

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe import MoE, MoEConfig, demo

from bitwise import bits

H = 16
CONFIG = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, aux_loss_coeff=1e-2)


def x_of(shape=(2, 6, H), dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_param_and_compute_dtypes(param_dtype):
    model = MoE(CONFIG, H, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    assert model.experts.fc1_kernel[...].dtype == param_dtype
    y, aux = model(x_of())
    assert y.dtype == param_dtype and y.shape == (2, 6, H)
    assert aux.tokens_per_expert.dtype == jnp.int32 and int(aux.tokens_per_expert.sum()) == 24
    mixed = MoE(CONFIG, H, param_dtype=jnp.float32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert mixed(x_of())[0].dtype == jnp.bfloat16


def test_megatron_initialisation_scales():
    model = MoE(
        CONFIG.replace(ffn_hidden_size=256, num_experts=8),
        256,
        num_layers=8,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    np.testing.assert_allclose(np.std(model.experts.fc1_kernel[...]), 0.02, rtol=0.02)
    np.testing.assert_allclose(np.std(model.experts.fc2_kernel[...]), 0.02 / 4.0, rtol=0.02)
    np.testing.assert_allclose(np.std(model.router.kernel[...]), 0.02, rtol=0.05)


def plain_and_remat_grads(model, x):
    """Pairs of (plain, remat) jitted gradient leaves of sum(y^2) w.r.t. the model."""

    def plain(model, x):
        return jnp.sum(model(x)[0].astype(jnp.float32) ** 2)

    def remat(model, x):
        return jnp.sum(nnx.remat(lambda m, x: m(x)[0])(model, x).astype(jnp.float32) ** 2)

    g_plain = nnx.jit(nnx.grad(plain))(model, x)
    g_remat = nnx.jit(nnx.grad(remat))(model, x)
    return zip(jax.tree.leaves(nnx.state(g_plain)), jax.tree.leaves(nnx.state(g_remat)))


def test_remat_and_jit_give_identical_bits():
    model, x = MoE(CONFIG, H, rngs=nnx.Rngs(0)), x_of(dtype=jnp.bfloat16)

    for a, b in plain_and_remat_grads(model, x):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_linen_adapter_matches_nnx_module():
    config = CONFIG.replace(score_function="sigmoid", enable_expert_bias=True)
    module = jaxmoe.to_linen(config, H, param_dtype=jnp.float32)
    x = x_of()
    variables = module.init(jax.random.key(0), x)
    assert set(variables) >= {"params", "ExpertBias"}
    y, aux = module.apply(variables, x)
    boxed = variables["params"]["router"]["kernel"]  # linen boxes carry the axis names
    assert boxed.metadata["out_sharding"] == ("embed", "expert")
    params = flax.linen.unbox(variables)["params"]
    nnx_model = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(1))
    nnx_model.router.kernel[...] = params["router"]["kernel"]
    nnx_model.experts.fc1_kernel[...] = params["experts"]["fc1_kernel"]
    nnx_model.experts.fc2_kernel[...] = params["experts"]["fc2_kernel"]
    np.testing.assert_array_equal(bits(nnx_model(x)[0]), bits(y))


def test_expert_bias_is_not_a_trained_param_and_update_rule():
    config = CONFIG.replace(score_function="sigmoid", enable_expert_bias=True)
    model = MoE(config, H, rngs=nnx.Rngs(0))
    assert model.router.expert_bias[...].dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert "expert_bias" not in params["router"]
    counts = jnp.array([10, 2, 4, 4], jnp.int32)
    updated = jaxmoe.update_expert_bias(jnp.zeros(4), counts, 0.5)
    np.testing.assert_array_equal(updated, [-0.5, 0.5, 0.5, 0.5])


def test_expert_bias_changes_selection_only():
    config = CONFIG.replace(score_function="sigmoid", enable_expert_bias=True)
    model, x = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0)), x_of()
    tokens = x.reshape(-1, H)
    model.router.expert_bias[...] = jnp.array([0.0, 0.0, 0.0, 10.0])
    _, routing = model.router(tokens)
    assert np.all(np.asarray(routing.indices)[:, 0] == 3)
    logits = model.router.logits(tokens)
    scores = jax.nn.sigmoid(logits)
    picked = jnp.take_along_axis(scores, routing.indices, axis=1)
    np.testing.assert_allclose(routing.probs, picked / picked.sum(1, keepdims=True), rtol=1e-6)


def test_global_aux_loss_accumulates_and_resets():
    config = CONFIG.replace(load_balancing_type="global_aux_loss")
    model, x = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0)), x_of()
    first = model(x)[1].load_balancing_loss
    assert int(model.global_aux_steps[...]) == 1
    second = model(x)[1].load_balancing_loss
    assert int(model.global_aux_steps[...]) == 2
    np.testing.assert_allclose(first, second, rtol=1e-6)  # same batch twice: same average
    aux_loss = MoE(CONFIG, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0))(x)[1]
    np.testing.assert_allclose(first, aux_loss.load_balancing_loss, rtol=1e-6)
    model(x_of(seed=5))
    model.reset_global_aux_state()
    assert int(model.global_aux_steps[...]) == 0
    assert float(model.global_tokens_per_expert[...].sum()) == 0


def test_global_aux_loss_uses_the_window_average_of_the_counts():
    """Two batches routed to complementary experts: the second loss is
    E * coeff / (k * T^2) * sum_e (sum_t scores of the second batch) * (mean count over both
    batches), computed here in NumPy from the router logits. Negative control: with the second
    batch's counts alone the value differs."""
    config = CONFIG.replace(load_balancing_type="global_aux_loss")
    model = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    model.router.kernel[...] = model.router.kernel[...] * 100  # peaked, unequal scores
    # -x flips the (bias-free) logits: the second batch picks the experts the first did not.
    batches = [x_of(seed=1), -x_of(seed=1)]
    scores, counts = [], []
    for x in batches:
        logits = np.asarray(model.forward_with_stages(x)[2].router_logits, np.float64)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : config.top_k]
        scores.append(probs.sum(0))
        counts.append(np.bincount(top.reshape(-1), minlength=config.num_experts))
    model.reset_global_aux_state()
    model(batches[0])
    loss = float(model(batches[1])[1].load_balancing_loss)
    tokens = batches[1].size // H
    scale = config.num_experts * config.aux_loss_coeff / (config.top_k * tokens**2)
    expected = float(np.sum(scores[1] * (counts[0] + counts[1]) / 2) * scale)
    this_batch_only = float(np.sum(scores[1] * counts[1]) * scale)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert abs(this_batch_only - expected) > 1e-2 * abs(expected)


def test_input_jitter_is_seeded_and_changes_router_input():
    config = CONFIG.replace(input_jitter_eps=0.5)
    x = x_of()
    a = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0, jitter=7))
    b = MoE(config, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0, jitter=7))
    plain = MoE(CONFIG, H, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    tokens = x.reshape(-1, H)
    np.testing.assert_array_equal(a.router.logits(tokens), b.router.logits(tokens))
    assert not np.array_equal(a.router.logits(tokens), plain.router.logits(tokens))
    assert not np.array_equal(a.router.logits(tokens), a.router.logits(tokens))  # stream advances


def test_padding_mask_leaves_losses_and_counts_but_not_outputs():
    model, x = (
        MoE(CONFIG.replace(z_loss_coeff=1e-3), H, param_dtype=jnp.float32, rngs=nnx.Rngs(0)),
        x_of(),
    )
    mask = jnp.zeros((2, 6), bool).at[1, 3:].set(True)
    y_plain, aux_plain = model(x)
    y_mask, aux_mask = model(x, padding_mask=mask)
    np.testing.assert_array_equal(y_plain, y_mask)
    assert int(aux_mask.tokens_per_expert.sum()) == 2 * 9
    assert float(aux_mask.z_loss) != float(aux_plain.z_loss)
    unpadded = model(x.reshape(-1, H)[np.asarray(~mask.reshape(-1))])[1]
    np.testing.assert_allclose(
        aux_mask.load_balancing_loss, unpadded.load_balancing_loss, rtol=1e-6
    )
    np.testing.assert_allclose(aux_mask.z_loss, unpadded.z_loss, rtol=1e-6)


def test_mxfp8_layer_trains_under_jit_and_remat_and_refuses_bad_widths():
    config = CONFIG.replace(
        ffn_hidden_size=32,
        expert_precision="mxfp8",
        dispatch_dtype="mxfp8",
        combine_bwd_dtype="mxfp8",
        expert_row_alignment=32,
    )
    with pytest.raises(ValueError, match="hidden_size .16. must be a multiple of 32"):
        MoE(config, H, rngs=nnx.Rngs(0))
    model, x = MoE(config, 32, rngs=nnx.Rngs(0)), x_of((2, 6, 32), jnp.bfloat16)

    for a, b in plain_and_remat_grads(model, x):
        np.testing.assert_array_equal(bits(a), bits(b))
        assert np.all(np.isfinite(np.asarray(a, np.float32))) and np.any(np.asarray(a) != 0)


def test_demo_trains_and_reports():
    metrics = demo.train(
        "mixtral",
        steps=60,
        hidden=32,
        batch=4,
        seq_len=16,
        learning_rate=1e-2,
        log_every=20,
        quiet=True,
    )
    assert metrics["step"] == 60 and metrics["tokens_per_s"] > 0 and metrics["balance"] >= 1.0
    first = demo.train("mixtral", steps=1, hidden=32, batch=4, seq_len=16, log_every=1, quiet=True)
    # Progress as a share of the first step's loss (1.0: a student whose output is near 0):
    # 60 Adam steps must explain a twentieth of the target's variance. What is learnable in 60
    # steps is bounded by the teacher's random experts; bf16 and MXFP8 both reach about 8%.
    assert metrics["loss"] < 0.95 * first["loss"], (first["loss"], metrics["loss"])


def test_demo_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        demo.main(["--preset", "nope"])


def test_parameters_carry_logical_axis_names():
    biased = MoE(
        MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, add_bias_linear=True),
        H,
        rngs=nnx.Rngs(0),
    )
    model = MoE(
        MoEConfig(
            num_experts=4,
            top_k=2,
            ffn_hidden_size=16,
            enable_expert_bias=True,
            score_function="sigmoid",
            shared_expert_intermediate_size=16,
            shared_expert_gate=True,
        ),
        H,
        rngs=nnx.Rngs(0),
    )
    names = {}
    for module in (biased, model):
        specs = nnx.to_flat_state(nnx.get_partition_spec(nnx.state(module)))
        names.update({".".join(map(str, path)): tuple(v.get_value()) for path, v in specs})
    assert names["router.kernel"] == ("embed", "expert")
    assert names["router.expert_bias"] == ("expert",)
    assert names["experts.fc1_kernel"] == ("expert", "embed", "mlp")
    assert names["experts.fc2_kernel"] == ("expert", "mlp", "embed")
    assert names["experts.fc2_bias"] == ("expert", "embed")
    assert names["shared_experts.gate_kernel"] == ("embed", None)
    assert names["router.bias"] == ("expert",)
    for module in (biased, model):
        for path, value in nnx.to_flat_state(nnx.state(module)):
            assert len(names[".".join(map(str, path))]) == value.get_value().ndim


def test_injected_initializers_and_the_default_megatron_init():
    ones = jax.nn.initializers.constant(1.0)
    model = MoE(
        CONFIG, H, kernel_init=ones, output_kernel_init=jax.nn.initializers.zeros, rngs=nnx.Rngs(0)
    )
    assert np.all(np.asarray(model.experts.fc1_kernel[...]) == 1)
    assert np.all(np.asarray(model.experts.fc2_kernel[...]) == 0)
    # The default draws normal(0, std) in fp32 per parameter, in creation order.
    default = MoE(CONFIG, H, param_dtype=jnp.bfloat16, init_std=0.5, num_layers=2, rngs=nnx.Rngs(3))
    keys = nnx.Rngs(3)
    router = jaxmoe.moe.megatron_normal(0.5)(keys.params(), (H, 4), jnp.bfloat16)
    fc1 = jaxmoe.moe.megatron_normal(0.5)(keys.params(), (4, H, 32), jnp.bfloat16)
    fc2 = jaxmoe.moe.megatron_normal(0.25)(keys.params(), (4, 16, H), jnp.bfloat16)
    for got, want in (
        (default.router.kernel, router),
        (default.experts.fc1_kernel, fc1),
        (default.experts.fc2_kernel, fc2),
    ):
        assert np.array_equal(bits(np.asarray(got[...])), bits(np.asarray(want)))
    with pytest.raises(ValueError, match="initializer returned shape"):
        MoE(
            CONFIG,
            H,
            kernel_init=lambda key, shape, dtype: jnp.zeros((1,), dtype),
            rngs=nnx.Rngs(0),
        )
