"""The MoE language model on the GPU, as a user trains it (`gmm_impl="auto"`: the Pallas kernels,
cuDNN's attention): a training step's loss and every gradient the same bits twice (D1), a
sequence's logits the same bits alone and inside a batch (D2). Negative control: a changed token
changes the step's bits. A two-layer qwen3_moe_2b (one dense-free MoE stack) at seq 1024."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.models import CONFIGS, MoETransformer, attention_impl_used
from jaxmoe.optim import lm_loss

from bitwise import assert_bitwise, differs

pytestmark = pytest.mark.gpu

CONFIG = CONFIGS["qwen3_moe_2b"].replace(num_layers=2, param_dtype="bfloat16")
SEQ = 1024


def model_and_tokens(batch: int, seed: int = 0):
    model = MoETransformer(CONFIG, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, SEQ + 1))
    return model, jnp.asarray(tokens, jnp.int32)


def step_bits(model, tokens):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        nll, _ = lm_loss(logits, tokens[:, 1:], jnp.ones(tokens[:, 1:].shape, bool))
        return nll + aux.total_loss

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return [np.asarray(value), *(np.asarray(g) for g in jax.tree.leaves(grads))]


def test_attention_is_cudnn_on_the_gpu():
    assert attention_impl_used(CONFIG) == "cudnn"


def test_training_step_is_the_same_bits_twice():
    model, tokens = model_and_tokens(2)
    first, second = step_bits(model, tokens), step_bits(model, tokens)
    for a, b in zip(first, second, strict=True):
        assert_bitwise(a, b)
    other = step_bits(model, tokens.at[1, 7].set((tokens[1, 7] + 1) % CONFIG.vocab_size))
    assert any(differs(a, b) for a, b in zip(first, other, strict=True))


def test_a_sequence_has_the_same_logits_alone_and_in_a_batch():
    model, tokens = model_and_tokens(4)
    forward = jax.jit(lambda t: model(t)[0])
    alone = np.asarray(forward(tokens[2:3, :-1]))[0]
    batch = np.asarray(forward(tokens[:, :-1]))
    assert_bitwise(alone, batch[2])
    assert differs(alone, batch[1])
