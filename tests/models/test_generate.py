"""Generation (jaxmoe/generate.py) with a two-layer byte-level model on CPU: the token-row
matmuls on the batch-invariant dense op, prefill = the training forward (bitwise), a prompt's
tokens and logits alone = inside a batch of other prompts (bitwise, greedy and sampled), greedy
decode = the full forward's argmax, nucleus sampling, EOS, the MXFP8 MoE layers, checkpoint
loading and the command line, with errors before anything is compiled.

Every test runs at max_len = max_position = 32 and at 2 or 4 rows, so that the compiled
programs are shared within the module."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmoe.generate as generate_lib
from jaxmoe.checkpoint import TMP_SUFFIX, Checkpointer
from jaxmoe.data import BOS, EOS, decode, encode
from jaxmoe.generate import (
    checkpoint_config,
    generate,
    inference_model,
    load_model,
    main,
)
from jaxmoe.inference import Mxfp8GroupedMLP
from jaxmoe.models import CONFIGS, KVCache, MoETransformer

from bitwise import assert_bitwise, differs
from jaxprs import equations

W = 32  # max_position, hence every call's max_len

# "tiny" shrunk (byte vocabulary, a dense layer then a MoE layer with a shared expert, tied
# head); fp32 compute, so that decode's logits are close enough to the forward's for its argmax;
# weights large enough that attention and FFNs outweigh the embedding (at init_std 0.02 a tied
# head's argmax is the input token).
CONFIG = CONFIGS["tiny"].with_overrides(
    {
        "init_std": 0.5,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "max_position": W,
        "dense_ffn_hidden_size": 64,
        "dtype": "float32",
        "moe.num_experts": 4,
        "moe.ffn_hidden_size": 32,
        "moe.shared_expert_intermediate_size": 32,
    }
)
MXFP8 = CONFIG.replace(moe=CONFIG.moe.with_precision("mxfp8"))  # widths multiples of 32
SAMPLED = dict(temperature=0.9, top_p=0.8, seed=5)


def prompt(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length).astype(np.int32)


P, Q, R = prompt(5, 1), prompt(3, 2), prompt(9, 3)


@pytest.fixture(scope="module")
def model():
    return MoETransformer(CONFIG, rngs=nnx.Rngs(0))


def run(model, prompts, max_new_tokens=8, **options):
    return generate(model, prompts, max_new_tokens=max_new_tokens, return_logits=True, **options)


def padded(prompts, rows=4):
    """The prompts as left-aligned rows of W tokens (the rest rows of one token), their segment
    ids (1 real, 0 padding) and lengths."""
    tokens, lengths = np.zeros((rows, W), np.int32), np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : p.size], lengths[i] = p, p.size
    segment_ids = (np.arange(W) < lengths[:, None]).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(segment_ids), jnp.asarray(lengths)


@nnx.jit
def forward_logits(model, tokens, segment_ids):
    return model(tokens, segment_ids=segment_ids)[0]


@nnx.jit
def prefill_logits(model, tokens, lengths):
    h, cache = model.prefill(tokens, lengths=lengths)
    return model.head(h), cache


# ------------------------------------------------------------------ batch-invariant matmuls
@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied_head", "lm_head"])
def test_every_token_row_matmul_runs_on_the_batch_invariant_dense_kernels(tie_embeddings):
    """Traced with gmm_impl="pallas" (bf16), the generation programs (prefill + head + sampling,
    decode step + sampling) keep no token-row matmul for XLA: the dot_generals left all have
    batch dimensions (the attention's, per row and head). Control: with "xla" the same walk
    finds the 14 token-row matmuls (q/k/v/o x 2 layers, the dense FFN's 2, the router, the
    shared expert's 2, the head)."""
    config = CONFIG.with_overrides(  # widths of 64: the kernels' multiple
        {
            "hidden_size": 64,
            "moe.ffn_hidden_size": 64,
            "dtype": "bfloat16",
            "tie_embeddings": tie_embeddings,
        }
    )
    rows, cache_shape = 2, (2, 2, W, 1, 16)
    tokens, lengths = jnp.zeros((rows, W), jnp.int32), jnp.ones((rows,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), rows)
    options = (jnp.float32(1), jnp.float32(1))
    cache = KVCache(
        k=jnp.zeros(cache_shape, jnp.bfloat16),
        v=jnp.zeros(cache_shape, jnp.bfloat16),
        lengths=lengths,
    )

    def token_row_matmuls(gmm_impl):
        model = MoETransformer(config, rngs=nnx.Rngs(0), gmm_impl=gmm_impl)
        graphdef, state = nnx.split(model)
        prefill = jax.make_jaxpr(generate_lib._prefill, static_argnums=0)(
            graphdef, state, tokens, lengths, keys, *options
        )
        decode = jax.make_jaxpr(generate_lib._decode, static_argnums=0)(
            graphdef, state, jnp.zeros((rows,), jnp.int32), cache, keys, jnp.int32(1), *options
        )
        return [
            sum(
                1
                for e in equations(jaxpr.jaxpr)
                if e.primitive.name == "dot_general" and not e.params["dimension_numbers"][1][0]
            )
            for jaxpr in (prefill, decode)
        ]

    assert token_row_matmuls("pallas") == [0, 0]
    assert token_row_matmuls("xla") == [14, 14]


# ------------------------------------------------------------------ D3: prefill = training forward
def test_prefill_is_the_training_forward(model):
    """Prompts of lengths 5, 3, 9 and a padding row, prefilled: the head of prefill's hidden
    states is the forward's logits bitwise (same tokens, segment ids 1 on the prompts and 0 on
    the padding), every position; the cache holds the prompts' lengths; generate's first logits
    are the forward's at each prompt's last token. Control: one token of row 1 changed changes
    that row's logits and leaves the other rows' bits alone (rows are independent)."""
    tokens, segment_ids, lengths = padded([P, Q, R])
    forward = np.asarray(forward_logits(model, tokens, segment_ids))
    logits, cache = prefill_logits(model, tokens, lengths)
    assert_bitwise(np.asarray(logits), forward)
    np.testing.assert_array_equal(cache.lengths, lengths)
    assert cache.k.shape == (2, 4, W, 1, 16)
    for i, (_, first) in enumerate(run(model, [P, Q, R], max_new_tokens=1)):
        assert_bitwise(first[0], forward[i, lengths[i] - 1])

    changed, _ = prefill_logits(model, tokens.at[1, 1].add(1), lengths)
    changed = np.asarray(changed)
    assert differs(changed[1, 1:3], forward[1, 1:3])
    assert_bitwise(changed[[0, 2, 3]], forward[[0, 2, 3]])


# ------------------------------------------------------------------ D2: batch invariance
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_a_prompt_generates_the_same_alone_and_in_a_batch(model, sampling):
    """P alone (2 rows, one of padding) and with prompts of other lengths (4 rows): the same
    tokens and, at every step, the same logits bits; likewise P at index 1 after other
    neighbours. Controls: another seed samples other tokens; one token of P changed changes
    its logits."""
    alone = run(model, [P], **sampling)[0]
    in_batch = run(model, [P, Q, R], **sampling)[0]
    assert alone[0].size == 8
    np.testing.assert_array_equal(in_batch[0], alone[0])
    assert_bitwise(in_batch[1], alone[1])
    second = run(model, [Q, P], **sampling)[1]
    second_among_others = run(model, [R, P, Q], **sampling)[1]
    np.testing.assert_array_equal(second_among_others[0], second[0])
    assert_bitwise(second_among_others[1], second[1])

    if sampling:
        other_seed = run(model, [P], **dict(sampling, seed=6))[0]
        assert not np.array_equal(other_seed[0], alone[0])
    one_changed = P.copy()
    one_changed[2] = (one_changed[2] + 1) % 256
    changed = run(model, [one_changed], **sampling)[0]
    assert differs(changed[1][0], alone[1][0])


def test_greedy_decode_is_the_argmax_of_the_full_forward(model):
    """Each greedy token is the argmax of the full forward's logits (prompt + the tokens so
    far, no cache) at the position before it. Control: another model's argmax differs."""
    outputs = generate(model, [P, Q], max_new_tokens=8)
    sequences = [np.concatenate([p, t[:-1]]) for p, t in zip([P, Q], outputs)]
    tokens, segment_ids, _ = padded(sequences, rows=2)

    def argmaxes(model):
        logits = np.asarray(forward_logits(model, tokens, segment_ids))
        return [
            logits[i, p.size - 1 : s.size].argmax(-1)
            for i, (p, s) in enumerate(zip([P, Q], sequences))
        ]

    for expected, got in zip(argmaxes(model), outputs):
        np.testing.assert_array_equal(got, expected)
    other = argmaxes(MoETransformer(CONFIG, rngs=nnx.Rngs(1)))
    assert not all(np.array_equal(a, b) for a, b in zip(other, outputs))


# ------------------------------------------------------------------ sampling, EOS
def test_sampling_keeps_to_the_nucleus_with_each_rows_key():
    """4096 rows of the probabilities (0.5, 0.3, 0.15, 0.05), each with its own key: top_p
    0.7 draws only the two likeliest tokens, in proportion 5:3; top_p 1 all four as given;
    temperature 0 the argmax; a row drawn alone gets the token it gets in the batch."""
    n = 4096
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05])), (n, 4))
    keys = jax.random.split(jax.random.key(0), n)
    sample = jax.jit(generate_lib._sample)

    def frequencies(temperature, top_p):
        drawn = np.asarray(sample(logits, keys, 3, jnp.float32(temperature), jnp.float32(top_p)))
        return np.bincount(drawn, minlength=4) / n

    np.testing.assert_allclose(frequencies(1, 0.7), [0.625, 0.375, 0, 0], atol=0.03)
    np.testing.assert_allclose(frequencies(1, 1), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    np.testing.assert_array_equal(frequencies(0, 0.7), [1, 0, 0, 0])
    batch = np.asarray(sample(logits, keys, 3, jnp.float32(1), jnp.float32(1)))
    alone = [int(sample(logits[i : i + 1], keys[i : i + 1], 3, 1.0, 1.0)[0]) for i in range(4)]
    np.testing.assert_array_equal(alone, batch[:4])


def test_rows_stop_at_eos(model):
    """With eos_id set to a token that one row samples at its fourth step, each row's output
    ends at its first EOS (included) and the rows without one run to max_new_tokens."""
    free = [t for t, _ in run(model, [P, Q], **SAMPLED)]
    eos = int(free[1][3])
    stopped = generate(model, [P, Q], max_new_tokens=8, eos_id=eos, **SAMPLED)
    for got, tokens in zip(stopped, free):
        hits = np.flatnonzero(tokens == eos)
        np.testing.assert_array_equal(got, tokens[: hits[0] + 1] if hits.size else tokens)
    assert stopped[1].size <= 4 and stopped[1][-1] == eos


# ------------------------------------------------------------------ MXFP8 MoE layers
def test_mxfp8_moe_layers_generate_with_the_training_forwards_bits(model):
    """A model trained with MXFP8 experts generates the same tokens and logits bits with its
    MoE layers as trained (moe="bf16") and as their MXFP8 inference copies (moe="mxfp8",
    `jaxmoe.mxfp8_inference`); a bf16 model of the same weights run with moe="mxfp8" is rebuilt
    with MXFP8 experts and gives those bits too. Control: the bf16 experts' logits differ."""
    mx = MoETransformer(MXFP8, rngs=nnx.Rngs(0))
    copies = inference_model(mx, "mxfp8")
    assert [type(m.experts) for m in copies.moe_layers()] == [Mxfp8GroupedMLP]
    assert inference_model(copies, "mxfp8") is copies and inference_model(mx, "bf16") is mx
    as_trained = run(mx, [P, Q], max_new_tokens=4)
    for moe_copies, from_bf16, trained in zip(
        run(mx, [P, Q], max_new_tokens=4, moe="mxfp8"),
        run(model, [P, Q], max_new_tokens=4, moe="mxfp8"),
        as_trained,
    ):
        for got in (moe_copies, from_bf16):
            np.testing.assert_array_equal(got[0], trained[0])
            assert_bitwise(got[1], trained[1])
    bf16 = run(model, [P, Q], max_new_tokens=4)
    assert differs(bf16[0][1][0], as_trained[0][1][0])


# ------------------------------------------------------------------ bad inputs
def test_bad_options_and_prompts_are_refused_before_compiling(model, monkeypatch):
    def compiled(*args):
        raise AssertionError("compiled before the inputs were checked")

    monkeypatch.setattr(generate_lib, "_prefill", compiled)
    monkeypatch.setattr(generate_lib, "_decode", compiled)
    cases = [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(prompts=[P, [300]]), r"prompt 1: token id 300 is outside \[0, 259\)"),
        (dict(max_new_tokens=28), r"prompt 0: its 5 tokens \+ max_new_tokens 28 exceed max_pos"),
        (dict(prompts=[R], max_len=16), r"its 9 tokens \+ max_new_tokens 8 exceed max_len \(16\)"),
        (dict(max_len=33), r"max_len must be in \[1, max_position=32\], got 33"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int, got 0"),
        (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
        (dict(eos_id=259), r"eos_id must be None or a token id in \[0, 259\), got 259"),
        (dict(moe="fp8"), r"moe must be one of \('bf16', 'mxfp8'\), got 'fp8'"),
    ]
    for changes, message in cases:
        arguments = dict(dict(prompts=[P], max_new_tokens=8), **changes)
        with pytest.raises(ValueError, match=message):
            generate(model, arguments.pop("prompts"), **arguments)


# ------------------------------------------------------------------ checkpoints and the CLI
@pytest.fixture(scope="module")
def run_dir(model, tmp_path_factory):
    """A run directory holding step 3's checkpoint of `model` as `jaxmoe.train` saves it:
    params and rest (pure dicts), an optimizer state, the model config."""
    out = tmp_path_factory.mktemp("run")
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    checkpointer = Checkpointer(out / "checkpoints", async_save=False)
    state = dict(params=params, rest=rest, opt_state=optax.adamw(1e-3).init(params))
    checkpointer.save(
        3, state, data_state={"epoch": 0}, model_config=CONFIG.to_dict(), train_config={}
    )
    checkpointer.close()
    return out


def test_load_model_restores_the_checkpointed_model(model, run_dir, tmp_path):
    """The loaded model has the stored config and the saved parameters' bits, and generates
    what the saved model does. A missing step, a missing directory and a directory with an
    unfinished save (left as it is) are refused by name."""
    assert checkpoint_config(run_dir) == (CONFIG, 3)
    loaded = load_model(run_dir / "checkpoints", step=3)
    saved = jax.tree.leaves(nnx.state(model, nnx.Param))
    for got, want in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)), saved, strict=True):
        assert_bitwise(np.asarray(got), np.asarray(want))
    for got, want in zip(run(loaded, [P, Q]), run(model, [P, Q])):
        np.testing.assert_array_equal(got[0], want[0])
        assert_bitwise(got[1], want[1])

    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint of step 4 .*\[3\]"):
        load_model(run_dir, step=4)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_model(tmp_path / "absent")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    unfinished = copy / "checkpoints" / f"4{TMP_SUFFIX}"
    unfinished.mkdir()
    with pytest.raises(ValueError, match="holds unfinished saves"):
        load_model(copy)
    assert unfinished.is_dir()


def test_the_command_line_prints_each_prompt_and_its_continuation(model, run_dir, capsys):
    """Each prompt is BOS + its bytes and ends at EOS: the printed continuation is generate's
    on the checkpoint's model, decoded; --moe mxfp8 runs too."""
    texts = ["def ", "import os"]
    main(
        ["--checkpoint", str(run_dir), "--prompt", texts[0], "--prompt", texts[1]]
        + ["--max-new-tokens", "6", "--temperature", "0.9", "--top-p", "0.8", "--seed", "5"]
    )
    printed = capsys.readouterr().out
    prompts = [np.concatenate([[BOS], encode(t)]) for t in texts]
    expected = generate(model, prompts, max_new_tokens=6, eos_id=EOS, **SAMPLED)
    assert "step 3, moe bf16" in printed
    for i, (text, tokens) in enumerate(zip(texts, expected)):
        assert f"=== prompt {i} " in printed and f": {text!r}\n{text + decode(tokens)}\n" in printed
    main(["--checkpoint", str(run_dir), "--prompt", "x", "--max-new-tokens", "2", "--moe", "mxfp8"])
    assert "moe mxfp8" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--prompt", ""], "--prompt 0 is empty"),
        (["--prompt", "x" * 28, "--max-new-tokens", "4"], "its 29 tokens .* exceed max_position"),
        (["--prompt", "a", "--temperature", "-1"], "temperature must be"),
        (["--prompt", "a", "--top-p", "0"], "top_p must be"),
        (["--prompt", "a", "--moe", "fp8"], "moe must be one of"),
        (["--prompt", "a", "--step", "7"], "no complete checkpoint of step 7"),
    ],
    ids=["empty_prompt", "too_long", "temperature", "top_p", "moe", "step"],
)
def test_command_line_errors_come_before_the_model_is_read(
    run_dir, arguments, message, capsys, monkeypatch
):
    def read(*args, **kwargs):
        raise AssertionError("the model was read before the arguments were checked")

    monkeypatch.setattr(generate_lib, "load_model", read)
    with pytest.raises(SystemExit) as exit:
        main(["--checkpoint", str(run_dir), *arguments])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and re.search(message, error)
