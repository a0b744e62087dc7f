"""Text generation with the MoE language model: prefill, then KV-cache decode steps, greedy or
sampled (temperature, nucleus), with the MoE layers as trained or as their MXFP8 inference
copies; `python -m jaxmoe.generate --checkpoint DIR --prompt TEXT ...` for a training checkpoint.

    outputs = generate(model, [prompt_ids, ...], max_new_tokens=64, temperature=0.8, top_p=0.95)

What a prompt generates does not depend on the other prompts of the call (batch invariance):
its tokens and every step's logits are those of the prompt alone. Every array of a call has a
shape fixed by max_len and the padded row count alone, and every operation computes a row from
that row only:
  - prefill is `MoETransformer.prefill`, the training forward: the prompts as one batch of
    left-aligned rows, each padded to max_len tokens (the padding a segment of its own, which no
    real token sees), so the first token's logits are the training forward's bits;
  - the decode steps attend over the cache's max_len entries, masked past each row's length;
  - the token-row matmuls run on `jaxmoe.ops.dense` and the MoE computes each token alone (when
    it is dropless: with a capacity_factor, which tokens are dropped depends on the others);
  - the rows are padded to a power of two, at least two: XLA:CPU computes a one-row matmul in
    another order than a row of a larger one, and powers of two bound the compilations;
  - sampling draws each row's token with its own key, `fold_in(fold_in(key(seed), i), step)`
    for the prompt's index i in the caller's list, from sums in an order fixed by the
    vocabulary size (`jaxmoe.ordered`, `jax.lax.associative_scan`).
So a prompt's tokens depend on its own tokens, its index in the list (when sampling), the seed,
the options and max_len: never on its neighbours.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe import data as data_lib
from jaxmoe.checkpoint import TMP_SUFFIX, Checkpointer
from jaxmoe.inference import Mxfp8GroupedMLP, mxfp8_inference
from jaxmoe.models import KVCache, LMConfig, MoETransformer
from jaxmoe.ordered import row_sums_in_order

MOE_CHOICES = ("bf16", "mxfp8")
F32 = jnp.float32


# --------------------------------------------------------------------------- checks
def check_options(
    *,
    max_new_tokens,
    temperature,
    top_p,
    seed,
    eos_id=None,
    moe="bf16",
    vocab_size: int | None = None,
) -> None:
    """ValueError naming the first bad generation option: max_new_tokens a positive int,
    temperature a finite number >= 0 (0: greedy), top_p in (0, 1], seed an int, eos_id None or
    a token id (in [0, vocab_size) when that is given), moe one of `MOE_CHOICES`."""

    def is_int(value) -> bool:
        return isinstance(value, int | np.integer) and not isinstance(value, bool)

    def is_number(value) -> bool:
        return isinstance(value, int | float | np.number) and not isinstance(value, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    high = math.inf if vocab_size is None else vocab_size
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < high):
        raise ValueError(f"eos_id must be None or a token id in [0, {high}), got {eos_id!r}")
    _check_moe(moe)


def _check_moe(moe) -> None:
    if moe not in MOE_CHOICES:
        raise ValueError(f"moe must be one of {MOE_CHOICES}, got {moe!r}")


def check_prompts(
    prompts, config: LMConfig, *, max_new_tokens: int, max_len: int | None = None
) -> tuple[list[np.ndarray], int]:
    """(the prompts as int32 arrays, max_len: None for config.max_position), or a ValueError
    naming the bad one: a non-empty list of non-empty 1-D integer sequences of ids in
    [0, vocab_size), each with max_new_tokens more tokens fitting max_len (<= max_position)."""
    if isinstance(max_len, bool) or not (max_len is None or isinstance(max_len, int)):
        raise ValueError(f"max_len must be None or an int, got {max_len!r}")
    limit = config.max_position if max_len is None else max_len
    if not 1 <= limit <= config.max_position:
        raise ValueError(f"max_len must be in [1, max_position={config.max_position}], got {limit}")
    if isinstance(prompts, str | bytes | np.ndarray) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token sequences, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        array = np.asarray(prompt)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got {array!r}")
        if array.size == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        bad = array[(array < 0) | (array >= config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt {i}: token id {int(bad[0])} is outside [0, {config.vocab_size})"
            )
        if array.size + max_new_tokens > limit:
            what = "max_position" if max_len is None else "max_len"
            raise ValueError(
                f"prompt {i}: its {array.size} tokens + max_new_tokens {max_new_tokens} exceed "
                f"{what} ({limit})"
            )
        checked.append(array.astype(np.int32))
    return checked, limit


# --------------------------------------------------------------------------- the MoE layers
def inference_model(model: MoETransformer, moe: str = "bf16") -> MoETransformer:
    """The model `generate` runs for `moe`: "bf16", the model itself (its MoE layers as they
    are: as trained); "mxfp8", a copy with each MoE layer replaced by `jaxmoe.mxfp8_inference`
    of it (its routed experts as MXFP8 copies, quantized once). A model whose MoE config is not
    MXFP8 is first rebuilt with `MoEConfig.with_precision("mxfp8")` around the same parameters
    (the experts' widths must then be multiples of 32); for a model trained in MXFP8 the copies
    give the training forward's bits. A model whose MoE layers are all inference copies is
    returned as it is (make it once for many calls)."""
    _check_moe(moe)
    copied = [isinstance(layer.experts, Mxfp8GroupedMLP) for layer in model.moe_layers()]
    if moe == "bf16" or all(copied):
        return model
    if model.config.moe.expert_precision != "mxfp8":
        config = model.config.replace(moe=model.config.moe.with_precision("mxfp8"))
        gmm_impl = model.embed.gmm_impl
        rebuilt = nnx.eval_shape(
            lambda: MoETransformer(config, rngs=nnx.Rngs(0), gmm_impl=gmm_impl)
        )
        nnx.update(rebuilt, nnx.state(model))
        model = rebuilt
    return model.with_moe_layers(mxfp8_inference)


# --------------------------------------------------------------------------- sampling
def _sample(logits, keys, step, temperature, top_p):
    """Each row's next token [B] int32 from its logits [B, V]: the argmax where temperature is
    0, else a draw from softmax(logits / temperature) restricted to the nucleus (the most likely
    tokens whose probabilities, the larger first, add up to top_p; all with top_p = 1) with the
    row's key folded with `step`. Every sum runs in an order fixed by V."""
    z = logits.astype(F32)
    greedy = jnp.argmax(z, axis=-1).astype(jnp.int32)
    scaled = z / jnp.where(temperature > 0, temperature, 1.0)
    e = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    probs = e / row_sums_in_order(e, keepdims=True)
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass = jax.lax.associative_scan(jnp.add, sorted_probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(mass[:, :1]), mass[:, :-1]], axis=-1)
    in_nucleus = jnp.put_along_axis(
        jnp.zeros(probs.shape, bool), order, before < top_p, axis=-1, inplace=False
    )
    filtered = jnp.where(in_nucleus | (top_p >= 1), scaled, -jnp.inf)
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, step)
    sampled = jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, tokens, lengths, keys, temperature, top_p):
    """(first tokens [B], their logits [B, V], the cache) of prompts tokens [B, max_len]."""
    model = nnx.merge(graphdef, state)
    h, cache = model.prefill(tokens, lengths=lengths)
    logits = model.head(h[jnp.arange(h.shape[0]), lengths - 1])
    return _sample(logits, keys, 0, temperature, top_p), logits, cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _decode(graphdef, state, tokens, cache: KVCache, keys, step, temperature, top_p):
    """(next tokens [B], their logits [B, V], the cache) after each row's token tokens [B]."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(tokens[:, None], cache)
    logits = logits[:, 0]
    return _sample(logits, keys, step, temperature, top_p), logits, cache


# --------------------------------------------------------------------------- generate
def generate(
    model: MoETransformer,
    prompts: Sequence[np.ndarray | Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    max_len: int | None = None,
    moe: str = "bf16",
    return_logits: bool = False,
) -> list[np.ndarray] | list[tuple[np.ndarray, np.ndarray]]:
    """Each prompt's generated tokens (int32, at most max_new_tokens; ending with eos_id where
    it was generated): greedy (temperature 0) or sampled from softmax(logits / temperature)
    within the top_p nucleus, with the key `fold_in(fold_in(key(seed), i), step)` for the
    prompt's index i in `prompts` and the step (0 for the first new token), so that a prompt's
    samples do not depend on the other prompts (the module docstring: batch invariance).

    prompts: token id sequences (1-D, non-empty), prefilled as one batch of rows padded to
      max_len (None: the model's max_position), which also bounds each prompt's tokens plus
      max_new_tokens; every prompt's result depends on max_len, no other prompt's length.
    moe: "bf16" (the MoE layers as trained) or "mxfp8" (`inference_model`).
    return_logits: give (tokens, logits [n, V] in the compute dtype) for each prompt instead:
      the logits each new token was chosen from (before the temperature).
    Bad options or prompts raise a ValueError before anything is compiled (`check_options`,
    `check_prompts`)."""
    check_options(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        eos_id=eos_id,
        moe=moe,
        vocab_size=model.config.vocab_size,
    )
    prompts, max_len = check_prompts(
        prompts, model.config, max_new_tokens=max_new_tokens, max_len=max_len
    )
    model = inference_model(model, moe)
    count = len(prompts)
    rows = max(2, 1 << (count - 1).bit_length())
    tokens = np.zeros((rows, max_len), np.int32)
    lengths = np.ones((rows,), np.int32)  # padding rows: a one-token prompt
    for i, prompt in enumerate(prompts):
        tokens[i, : prompt.size], lengths[i] = prompt, prompt.size
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(rows))
    graphdef, state = nnx.split(model)
    options = (jnp.float32(temperature), jnp.float32(top_p))
    token, logits, cache = _prefill(graphdef, state, tokens, lengths, keys, *options)
    new = [[] for _ in range(count)]
    chosen_from = [[] for _ in range(count)]
    done = np.zeros(count, bool)
    for step in range(max_new_tokens):
        if step:
            token, logits, cache = _decode(
                graphdef, state, token, cache, keys, jnp.int32(step), *options
            )
        host = np.asarray(token)
        host_logits = np.asarray(logits) if return_logits else None
        for i in np.flatnonzero(~done):
            new[i].append(host[i])
            if return_logits:
                chosen_from[i].append(host_logits[i])
            done[i] = eos_id is not None and host[i] == eos_id
        if done.all():
            break
    outputs = [np.array(t, np.int32) for t in new]
    if return_logits:
        return [(t, np.stack(z)) for t, z in zip(outputs, chosen_from, strict=True)]
    return outputs


# --------------------------------------------------------------------------- checkpoints
def _open_checkpoint(directory: str | Path, step: int | None) -> tuple[Checkpointer, int, dict]:
    """(a reading `Checkpointer`, the step, its metadata) of a training run's directory (its
    checkpoints/ folder) or of a checkpoints directory itself; step None: the latest."""
    path = Path(directory)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    unfinished = sorted(p.name for p in path.glob(f"*{TMP_SUFFIX}*"))
    if unfinished:
        # Opening a Checkpointer removes them: not from a reader, while a run may be saving.
        raise ValueError(
            f"{path} holds unfinished saves {unfinished}: a run is saving or was cut off "
            "(resume it, or remove them)"
        )
    # Never deletes: this reader saves nothing.
    checkpointer = Checkpointer(path, keep=2**31 - 1, async_save=False)
    steps = checkpointer.steps()
    chosen = checkpointer.latest_step() if step is None else step
    if chosen not in steps:
        checkpointer.close()
        raise FileNotFoundError(
            f"no complete checkpoint {'' if step is None else f'of step {step} '}in {path} "
            f"(steps: {steps})"
        )
    metadata = checkpointer._read(chosen, "metadata", checkpointer.path(chosen))
    return checkpointer, chosen, metadata


def checkpoint_config(directory: str | Path, *, step: int | None = None) -> tuple[LMConfig, int]:
    """(the `LMConfig` stored with a training checkpoint, its step) without reading its arrays;
    directory and step as `load_model`'s."""
    checkpointer, step, metadata = _open_checkpoint(directory, step)
    checkpointer.close()
    return LMConfig.from_dict(metadata["model_config"]), step


def load_model(
    directory: str | Path, *, step: int | None = None, gmm_impl: str = "auto"
) -> MoETransformer:
    """The `MoETransformer` of a `jaxmoe.train` checkpoint: its stored `LMConfig`, parameters
    and other model state (expert biases), every array checked against its saved crc32
    (`jaxmoe.checkpoint`). directory: the run's out directory or its checkpoints/ folder; step:
    None for the latest complete checkpoint. A directory with unfinished saves is refused
    rather than cleaned (a run may be writing it). The optimizer state is read and dropped."""
    checkpointer, step, metadata = _open_checkpoint(directory, step)
    try:
        config = LMConfig.from_dict(metadata["model_config"])
        abstract = nnx.eval_shape(
            lambda: MoETransformer(config, rngs=nnx.Rngs(0), gmm_impl=gmm_impl)
        )
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        wanted = dict(params=nnx.to_pure_dict(params), rest=nnx.to_pure_dict(rest))
        others = {
            name: jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
            for name, entry in metadata["arrays"].items()
            if name.split(".")[0] not in wanted
        }
        restored = checkpointer.restore({**wanted, **others}, step=step).state
    finally:
        checkpointer.close()
    nnx.replace_by_pure_dict(params, restored["params"])
    nnx.replace_by_pure_dict(rest, restored["rest"])
    return nnx.merge(graphdef, params, rest)


# --------------------------------------------------------------------------- the CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's arguments (argparse exits with status 2 on a malformed one)."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxmoe.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a jaxmoe.train run's directory or its checkpoints/"
    )
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt's text (repeat for a batch)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="the nucleus's probability mass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moe", default="bf16", help="bf16: the MoE layers as trained; mxfp8: MXFP8 copies"
    )
    parser.add_argument("--max-len", type=int, help="the cache's length (default: max_position)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: load the checkpoint's model, generate a continuation of each prompt
    (BOS + its UTF-8 bytes, ending at EOS) and print the prompt and the continuation. Bad
    arguments (an empty prompt, a prompt with max_new_tokens over max_position, a bad
    temperature or top_p, an unknown --moe, a missing checkpoint) exit with status 2 and the
    error, before the model is read or compiled."""
    args = parse_args(argv)
    try:
        check_options(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            moe=args.moe,
        )
        for i, text in enumerate(args.prompt):
            if not text:
                raise ValueError(f"--prompt {i} is empty")
        config, step = checkpoint_config(args.checkpoint, step=args.step)
        if config.vocab_size != data_lib.VOCAB_SIZE:
            raise ValueError(
                f"the checkpoint's model has {config.vocab_size} token ids, not the byte "
                f"tokenizer's {data_lib.VOCAB_SIZE} (jaxmoe.data)"
            )
        prompts = [np.concatenate([[data_lib.BOS], data_lib.encode(t)]) for t in args.prompt]
        check_prompts(prompts, config, max_new_tokens=args.max_new_tokens, max_len=args.max_len)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    model = load_model(args.checkpoint, step=step)
    outputs = generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=data_lib.EOS,
        max_len=args.max_len,
        moe=args.moe,
    )
    print(f"checkpoint {args.checkpoint}, step {step}, moe {args.moe}")
    for i, (text, tokens) in enumerate(zip(args.prompt, outputs, strict=True)):
        ending = "EOS" if tokens[-1] == data_lib.EOS else f"{tokens.size} new tokens"
        print(f"=== prompt {i} ({ending}): {text!r}")
        print(text + data_lib.decode(tokens))


if __name__ == "__main__":
    main()
