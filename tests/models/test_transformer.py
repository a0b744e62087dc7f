"""The MoE language model on CPU at tiny sizes: shapes, causality and packed segments (bitwise),
positions, the KV cache against the full forward, variants, remat, gradients, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe.dispatch import LocalRoute
from jaxmoe.models import CONFIGS, MoETransformer, attention_impl_used
from jaxmoe.models.attention import apply_rope, rope_tables
from jaxmoe.ordered import sum_in_order

from bitwise import assert_bitwise, differs

V, S = 64, 16

# "tiny" shrunk: a dense first layer, then MoE layers with a shared expert; fp32 compute.
MICRO = CONFIGS["tiny"].with_overrides(
    {
        "vocab_size": V,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "max_position": 64,
        "dense_ffn_hidden_size": 64,
        "dtype": "float32",
        "moe.num_experts": 4,
        "moe.ffn_hidden_size": 32,
        "moe.shared_expert_intermediate_size": 16,
    }
)


def model_of(config=MICRO, seed=0):
    return MoETransformer(config, rngs=nnx.Rngs(seed))


def tokens_of(shape=(2, S), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, V, jnp.int32)


@nnx.jit
def forward(model, tokens, segment_ids=None, positions=None):
    return model(tokens, segment_ids=segment_ids, positions=positions)


def logits_of(model, tokens, segment_ids=None, positions=None):
    return np.asarray(forward(model, tokens, segment_ids, positions)[0])


def test_shapes_dtypes_and_parameter_names():
    config = MICRO.replace(dtype="bfloat16")
    model = model_of(config)
    tokens = tokens_of()

    @nnx.jit
    def run(model, tokens):
        h, _ = model.hidden(tokens)
        return model(tokens), h, model.head(h)

    (logits, aux), h, head = run(model, tokens)
    assert logits.shape == (2, S, V) and logits.dtype == jnp.bfloat16
    assert aux.load_balancing_loss.shape == aux.z_loss.shape == (1,)  # layer 1 is MoE
    assert aux.tokens_per_expert.shape == (1, 4) and aux.tokens_per_expert.dtype == jnp.int32
    assert np.all(np.asarray(aux.tokens_per_expert).sum(axis=1) == 2 * S * config.moe.top_k)
    assert aux.total_loss.shape == () and aux.total_loss.dtype == jnp.float32
    assert float(aux.total_loss) > 0
    assert h.shape == (2, S, 32) and h.dtype == jnp.bfloat16
    assert_bitwise(np.asarray(head), np.asarray(logits))

    params = nnx.state(model, nnx.Param)
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(params)}
    assert {
        "embed.embedding",
        "layers.0.input_norm.scale",
        "layers.0.attention.q_proj.kernel",
        "layers.0.attention.o_proj.kernel",
        "layers.0.ffn.gate_up.kernel",
        "layers.0.ffn.down.kernel",
        "layers.1.post_attention_norm.scale",
        "layers.1.ffn.router.kernel",
        "layers.1.ffn.experts.fc1_kernel",
        "final_norm.scale",
    } <= names
    assert "lm_head.kernel" not in names  # tied
    assert model.embed.embedding.out_sharding == ("vocab", "embed")
    assert model.layers[0].attention.k_proj.kernel.out_sharding == ("embed", "kv_heads")
    assert model.embed.embedding[...].dtype == jnp.float32
    assert [type(m) for m in model.moe_layers()] == [jaxmoe.MoE]


def test_a_later_token_never_changes_earlier_logits():
    model, tokens = model_of(), tokens_of()
    base = logits_of(model, tokens)
    changed = logits_of(model, tokens.at[:, 9].set((tokens[:, 9] + 1) % V))
    assert_bitwise(changed[:, :9], base[:, :9])
    assert differs(changed[:, 9:], base[:, 9:])  # control: the later ones do change
    earlier = logits_of(model, tokens.at[:, 2].set((tokens[:, 2] + 1) % V))
    assert differs(earlier[:, 3:9], base[:, 3:9])


def test_packed_documents_do_not_see_each_other():
    model, tokens = model_of(), tokens_of()
    # Row 0: document A in [0, 6), document B in [6, 13), padding after; row 1: one document.
    segments = jnp.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * S], jnp.int32)
    positions = jnp.array([list(range(6)) + list(range(7)) + [0] * 3, list(range(S))], jnp.int32)
    base = logits_of(model, tokens, segments, positions)
    other_a = tokens.at[0, :6].set((tokens[0, :6] + 7) % V)
    assert_bitwise(logits_of(model, other_a, segments, positions)[0, 6:13], base[0, 6:13])
    other_b = tokens.at[0, 6:13].set((tokens[0, 6:13] + 7) % V)
    assert_bitwise(logits_of(model, other_b, segments, positions)[0, :6], base[0, :6])
    # Controls: a change inside B changes B's later logits; one segment a row lets A reach B.
    inside_b = logits_of(model, tokens.at[0, 6].set((tokens[0, 6] + 1) % V), segments, positions)
    assert differs(inside_b[0, 7:13], base[0, 7:13])
    unsegmented = lambda t: logits_of(model, t, None, positions)[0, 6:13]
    assert differs(unsegmented(other_a), unsegmented(tokens))
    # The padding (segment 0) leaves the MoE token counts: 13 real tokens in row 0.
    aux = forward(model, tokens, segments, positions)[1]
    top_k = MICRO.moe.top_k
    assert np.all(np.asarray(aux.tokens_per_expert).sum(axis=1) == (13 + S) * top_k)


def test_rope_of_a_token_depends_on_its_own_position_only():
    x = jax.random.normal(jax.random.key(1), (2, 8, 2, 16), jnp.float32)
    positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 0, 1, 2, 3, 4]], jnp.int32)
    rotated = apply_rope(x, *rope_tables(positions, 16, 1e4))
    # Each token alone at its own position (a batch of one-token rows).
    alone = apply_rope(
        x.reshape(16, 1, 2, 16), *rope_tables(positions.reshape(16, 1), 16, 1e4)
    ).reshape(x.shape)
    assert_bitwise(np.asarray(rotated), np.asarray(alone))
    assert differs(np.asarray(rotated[:, 3:]), np.asarray(x[:, 3:]))  # positions > 0 rotate
    assert_bitwise(np.asarray(rotated[:, 3]), np.asarray(x[:, 3]))  # position 0 does not
    # HF's rotate-half: the pair (j, j + D/2) turned by position * theta^(-2j/D).
    angle = 2 * 1e4 ** (-2 * 3 / 16)
    a, b = x[0, 2, 0, 3], x[0, 2, 0, 3 + 8]
    expected = (a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle))
    np.testing.assert_allclose(rotated[0, 2, 0, [3, 11]], expected, rtol=1e-5)


def test_positions_restart_per_segment():
    model, tokens = model_of(), tokens_of()
    doc = tokens[0, :7]
    # Document B packed after a 6-token document, its positions restarting at 0 ...
    packed = tokens.at[0, 6:13].set(doc)
    segments = jnp.array([[1] * 6 + [2] * 7 + [3] * 3, [1] * S], jnp.int32)
    restart = jnp.array([list(range(6)) + list(range(7)) + list(range(3)), list(range(S))])
    in_pack = logits_of(model, packed, segments, restart)[0, 6:13]
    # ... gives its logits at the start of a row (to rounding: the attention adds its masked
    # zeros at other places of the row).
    first = jnp.array([[1] * 7 + [2] * 9, [1] * S], jnp.int32)
    first_positions = jnp.array([list(range(7)) + list(range(9)), list(range(S))])
    at_start = logits_of(model, tokens, first, first_positions)[0, :7]
    np.testing.assert_allclose(in_pack, at_start, rtol=1e-5, atol=1e-5)
    # positions=None is 0, 1, ... in every row, and the positions given are the ones used.
    arange = jnp.broadcast_to(jnp.arange(S), (2, S))
    assert_bitwise(
        logits_of(model, packed, segments, None), logits_of(model, packed, segments, arange)
    )
    assert differs(logits_of(model, packed, segments, arange)[0, 6:13], in_pack)


def test_decode_with_the_cache_equals_the_full_forward():
    """Prefill two prompts of lengths 3 and 5 in one batch, then three one-token steps: every
    logit within 1e-5 of the full forward's (fp32; the attention sums over the cache's entries,
    masked ones included, in another order than over the sequence) and the same greedy token."""
    model = model_of(MICRO.replace(max_position=32))
    sequences = tokens_of((2, 8), seed=3)
    prompt_lengths = jnp.array([3, 5], jnp.int32)
    prompts = jnp.where(jnp.arange(5) < prompt_lengths[:, None], sequences[:, :5], 0)
    decode = nnx.jit(lambda m, t, c, n=None: m.decode(t, c, new_lengths=n))
    cache = model.init_cache(2, 12, jnp.float32)
    logits, cache = decode(model, prompts, cache, prompt_lengths)
    got = [[logits[0, i] for i in range(3)], [logits[1, i] for i in range(5)]]
    for _ in range(3):
        step = sequences[jnp.arange(2), cache.lengths][:, None]  # teacher-forced next tokens
        logits, cache = decode(model, step, cache)
        for row in range(2):
            got[row].append(logits[row, 0])
    np.testing.assert_array_equal(cache.lengths, [6, 8])
    full = logits_of(model, sequences)  # row 0's logits past its 6 tokens are not compared
    for row, n in ((0, 6), (1, 8)):
        row_logits = np.stack([np.asarray(g) for g in got[row]])
        np.testing.assert_allclose(row_logits, full[row, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(row_logits.argmax(-1), full[row, :n].argmax(-1))


@pytest.mark.parametrize(
    "changes, kinds",
    [
        (dict(num_layers=4, first_k_dense=0, moe_layer_freq=2), ("moe", "dense", "moe", "dense")),
        (dict(num_layers=3, first_k_dense=1, moe_layer_freq=2), ("dense", "moe", "dense")),
        (dict(tie_embeddings=False, qk_norm=True, attention_impl="xla"), ("dense", "moe")),
    ],
    ids=["moe_layer_freq", "first_k_dense_and_freq", "untied_qk_norm_xla"],
)
def test_variants_build_and_run(changes, kinds):
    config = MICRO.replace(**changes)
    assert config.layer_kinds() == kinds
    model = model_of(config)
    assert [b.kind for b in model.layers] == list(kinds)
    assert (model.lm_head is None) == config.tie_embeddings
    assert (model.layers[0].attention.q_norm is None) == (not config.qk_norm)
    logits, aux = forward(model, tokens_of())
    assert logits.shape == (2, S, V) and np.all(np.isfinite(np.asarray(logits)))
    assert aux.load_balancing_loss.shape == (kinds.count("moe"),)


def weighted_loss(model, tokens):
    """sum(w logits^2) + the aux losses: a cotangent that depends on the forward (with a
    constant one XLA:CPU may compile the tied head's forward otherwise in the gradient program
    than in the forward alone)."""
    logits, aux = model(tokens)
    weights = jax.random.normal(jax.random.key(7), logits.shape, jnp.float32)
    weighted = weights * jnp.square(logits.astype(jnp.float32))
    return sum_in_order(weighted.reshape(-1)) + aux.total_loss


loss_and_grads = nnx.jit(nnx.value_and_grad(weighted_loss))


def gradient_leaves(grads):
    return [np.asarray(g) for g in jax.tree.leaves(nnx.state(grads, nnx.Param))]


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_recomputes_the_forward_bits(remat):
    """The loss bits are those without remat; the gradients agree to rounding only: XLA:CPU
    contracts a * b + c into an FMA inside a fusion, and rematerialisation changes the
    backward's fusions (every parameter's gradient moves by a few ulps)."""
    tokens = tokens_of()
    plain_loss, plain = loss_and_grads(model_of(), tokens)
    remat_loss, rematted = loss_and_grads(model_of(MICRO.replace(remat=remat)), tokens)
    assert_bitwise(np.asarray(remat_loss), np.asarray(plain_loss))
    other_loss, other = loss_and_grads(model_of(seed=1), tokens)
    assert differs(np.asarray(other_loss), np.asarray(plain_loss))  # control: other weights

    def close(a, b):
        return np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a))

    pairs = zip(gradient_leaves(plain), gradient_leaves(rematted), strict=True)
    assert all(close(a, b) for a, b in pairs)
    assert not any(close(a, b) for a, b in zip(gradient_leaves(plain), gradient_leaves(other)))


def test_gradients_reach_every_parameter():
    model = model_of(MICRO.replace(qk_norm=True, tie_embeddings=False))
    _, grads = loss_and_grads(model, tokens_of())
    flat = list(nnx.to_flat_state(nnx.state(grads, nnx.Param)))
    assert len(flat) == 26  # 3 + 8 a layer (qk_norm) + 2 dense + 5 MoE (router, 2 routed, 2 shared)
    zero = [".".join(map(str, path)) for path, g in flat if not np.any(np.asarray(g[...]))]
    assert not zero, f"all-zero gradients: {zero}"


MXFP8 = MICRO.replace(first_k_dense=0, moe=MICRO.moe.with_precision("mxfp8"))  # two MoE layers


def test_route_for_and_quantized_expert_weights_reach_every_moe_layer():
    model, tokens = model_of(MXFP8), tokens_of()
    calls = []

    def route_for(plan, impl):
        calls.append(impl)
        return LocalRoute(plan, impl)

    run = nnx.jit(lambda m, t, w: m(t, route_for=route_for, expert_weights=w))
    weights = model.quantize_expert_weights()
    assert len(weights) == 2
    routed = np.asarray(run(model, tokens, weights)[0])
    assert len(calls) == 2  # traced once per MoE layer
    assert_bitwise(routed, logits_of(model, tokens))
    with pytest.raises(ValueError, match="no quantized weight copies"):
        model_of().quantize_expert_weights()


def test_moe_layers_swapped_for_their_inference_copies():
    model, tokens = model_of(MXFP8), tokens_of()
    inference = model.with_moe_layers(jaxmoe.mxfp8_inference)
    assert [type(m.experts).__name__ for m in model.moe_layers()] == ["GroupedMLP"] * 2
    assert [type(m.experts).__name__ for m in inference.moe_layers()] == ["Mxfp8GroupedMLP"] * 2
    # The inference copies give the training forward's bits (`jaxmoe.mxfp8_inference`).
    assert_bitwise(logits_of(inference, tokens), logits_of(model, tokens))
    assert differs(logits_of(inference, tokens_of(seed=1)), logits_of(model, tokens))


def test_attention_impl_used():
    # JAX's default runs XLA's attention on the CPU; explicit choices are what runs.
    assert attention_impl_used(MICRO, backend="cpu") == "xla"
    assert attention_impl_used(MICRO) in ("xla", "cudnn")
    assert attention_impl_used(MICRO.replace(attention_impl="xla")) == "xla"
    assert attention_impl_used(MICRO.replace(attention_impl="cudnn")) == "cudnn"


def test_bad_inputs_are_refused_before_tracing():
    model, tokens = model_of(), tokens_of()
    with pytest.raises(TypeError, match="tokens must be an integer array"):
        model(tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 64\), got 64"):
        model(tokens.at[1, 3].set(V))
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 64\), got -1"):
        model(np.asarray(tokens.at[0, 0].set(-1)))
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_position"):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\]"):
        model(tokens[0])
    with pytest.raises(ValueError, match="segment_ids must have the tokens' shape"):
        model(tokens, segment_ids=jnp.ones((2, S - 1), jnp.int32))
    with pytest.raises(ValueError, match="positions must have the tokens' shape"):
        model(tokens, positions=jnp.zeros((1, S), jnp.int32))
    with pytest.raises(ValueError, match=r"positions must be in \[0, 64\), got 64"):
        model(tokens, positions=jnp.full((2, S), 64, jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be >= 0, got -1"):
        model(tokens, segment_ids=jnp.full((2, S), -1, jnp.int32))
    with pytest.raises(ValueError, match="expert_weights must be a list of 1 entries"):
        model(tokens, expert_weights=[None, None])
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"cache.lengths \+ new_lengths must be in \[0, 9\)"):
        model.decode(tokens[:, :8], cache.replace(lengths=jnp.array([1, 0], jnp.int32)))
    with pytest.raises(ValueError, match="do not fit a cache"):
        model.decode(tokens[:1, :4], cache)
    with pytest.raises(ValueError, match="max_len .* exceeds max_position"):
        model.init_cache(2, 65)
    with pytest.raises(TypeError, match="config must be an LMConfig"):
        MoETransformer(MICRO.moe, rngs=nnx.Rngs(0))
