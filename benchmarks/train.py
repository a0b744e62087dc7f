"""The language model's training step on one GPU: jaxmoe's MoE LM next to the same model with its
MoE layers written on `jax.lax.ragged_dot` (MaxText's GPU path) and on tokamax's `ragged_dot`
(the JAX kernel library; not a dependency: install it to run that one), and Hugging Face
transformers' `Qwen3MoeForCausalLM` of the same config (its `grouped_mm` experts, SDPA
attention, fused AdamW), eager and under `torch.compile`.

    python -m benchmarks.train [--model qwen3_moe_2b] [--seq-len 4096] [--batch 2]
                               [--impls jaxmoe,jaxmoe_ragged_dot,jaxmoe_tokamax,hf_compile,hf_eager]
                               [--steps 10] [--set KEY=VALUE ...]

Every implementation trains the same architecture (`jaxmoe.models.CONFIGS[--model]`) on random
token ids (one segment a row) with AdamW, bf16 parameters and compute, and consumes every output
of the step (the loss is read back, the parameters and optimizer state are carried to the next
step). Each runs in its own process, one after another on the same card in one run, so that each
one's peak device memory is its own: after `--warmup` steps (compilation), `--steps` steps are
timed one by one (wall clock, synchronised), and the record keeps their median. Tokens/s =
batch x seq_len / median step; MFU = tokens/s x FLOPs a token / the card's dense bf16 peak, with
FLOPs a token = 6 x active parameters + 12 x layers x heads x head_dim x seq_len
(`jaxmoe.train.flops_per_token`). Peak memory: JAX's `peak_bytes_in_use`, torch's
`max_memory_allocated`, each over its own process. Writes benchmarks/results/train_<date>.json
and a bar plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import report
from benchmarks.report import add_output_arguments, error_text, log

IMPLS = ("jaxmoe", "jaxmoe_ragged_dot", "jaxmoe_tokamax", "hf_compile", "hf_eager")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_moe_2b", help="a jaxmoe.models.CONFIGS name")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an LMConfig override (`LMConfig.with_overrides` keys; JSON values)",
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated of {IMPLS}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    impls = [name for name in args.impls.split(",") if name]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {IMPLS}")
    args.impls = impls
    return args


def model_config(args):
    """The benchmark's `LMConfig`: the named model with bf16 parameters and --seq-len positions."""
    from jaxmoe.models import CONFIGS
    from jaxmoe.train import parse_value

    if args.model not in CONFIGS:
        raise SystemExit(f"--model: unknown {args.model!r}; choose from {sorted(CONFIGS)}")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = parse_value(value)
    config = CONFIGS[args.model].with_overrides(overrides)
    return config.replace(
        param_dtype="bfloat16",
        dtype="bfloat16",
        max_position=max(config.max_position, args.seq_len),
    )


def random_tokens(args, vocab_size: int, seed: int = 0):
    """[batch, seq_len + 1] int32 token ids (inputs and their next-token targets)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, (args.batch, args.seq_len + 1), dtype=np.int32)


def time_steps(step, sync, args) -> list[float]:
    """Runs `step` --warmup times untimed, then --steps times, each timed to its result."""
    for _ in range(args.warmup):
        sync(step())
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        sync(step())
        seconds.append(time.perf_counter() - start)
    return seconds


# ----------------------------------------------------------------------------------- jaxmoe
def ragged_dot_moe(moe, ragged_dot=None):
    """The competitor MoE in place of a `jaxmoe.MoE` layer: the layer's own parameters, computed
    by `benchmarks.layer_competitors.jax_moe` (a plain JAX MoE) on `ragged_dot` (None:
    `jax.lax.ragged_dot`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.layer_competitors import check_supported, jax_moe
    from jaxmoe.moe import MoEAux

    check_supported(moe.config)

    class RaggedDotMoE(nnx.Module):
        def __init__(self, moe):
            self.inner = moe

        def __call__(self, x, *, padding_mask=None, expert_weights=None):
            del padding_mask, expert_weights  # random tokens: one segment a row, bf16 experts
            config = self.inner.config
            state = nnx.state(self.inner, nnx.Param)
            weights = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}
            tokens = x.reshape(-1, x.shape[-1])
            y, aux_loss, _ = jax_moe(
                weights, tokens, config, x.shape[-2], ragged_dot or jax.lax.ragged_dot
            )
            aux = MoEAux(
                load_balancing_loss=aux_loss,
                z_loss=jnp.zeros((), jnp.float32),
                tokens_per_expert=jnp.zeros((config.num_experts,), jnp.int32),
            )
            return y.reshape(x.shape), aux

    return RaggedDotMoE(moe)


def jax_worker(impl: str, args) -> dict:
    """One jaxmoe implementation's step times and peak memory."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxmoe.models import MoETransformer, attention_impl_used
    from jaxmoe.optim import lm_loss

    config = model_config(args)
    model = MoETransformer(config, rngs=nnx.Rngs(0))
    if impl == "jaxmoe_ragged_dot":
        model = model.with_moe_layers(ragged_dot_moe)
    elif impl == "jaxmoe_tokamax":
        import tokamax  # the JAX kernel library (its Mosaic GPU ragged_dot on Hopper)

        model = model.with_moe_layers(lambda moe: ragged_dot_moe(moe, tokamax.ragged_dot))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = optimizer.init(params)
    tokens = jnp.asarray(random_tokens(args, config.vocab_size))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.ones(targets.shape, bool)

    def loss_fn(params):
        logits, aux = nnx.merge(graphdef, params, rest)(inputs)
        loss, _ = lm_loss(logits, targets, mask)
        return loss + aux.total_loss

    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state).compile()
    state = dict(params=params, opt_state=opt_state)
    losses = []

    def step():
        state["params"], state["opt_state"], loss = compiled(state["params"], state["opt_state"])
        losses.append(loss)
        return loss

    seconds = time_steps(step, lambda loss: float(loss), args)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        seconds=seconds,
        losses=[float(x) for x in losses],
        peak_memory_bytes=stats.get("peak_bytes_in_use"),
        attention=attention_impl_used(config),
    )


# ----------------------------------------------------------------------------------- torch
def hf_config(config):
    """transformers' `Qwen3MoeConfig` of the same architecture as the jaxmoe `LMConfig`."""
    from transformers import Qwen3MoeConfig

    moe = config.moe
    return Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.dense_ffn_hidden_size or moe.ffn_hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=not moe.pre_softmax,
        max_position_embeddings=config.max_position,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        router_aux_loss_coef=moe.aux_loss_coeff,
        output_router_logits=moe.aux_loss_coeff > 0,
        mlp_only_layers=[i for i, k in enumerate(config.layer_kinds()) if k == "dense"],
        decoder_sparse_step=1,
    )


def torch_worker(impl: str, args) -> dict:
    """transformers' Qwen3MoeForCausalLM step times and peak memory (eager or compiled)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    config = model_config(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the benchmark's own test
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM._from_config(
        hf_config(config),
        attn_implementation="sdpa",
        experts_implementation="grouped_mm",
        torch_dtype=torch.bfloat16,
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device == "cuda",
    )
    tokens = torch.from_numpy(random_tokens(args, config.vocab_size)).to(device).long()
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, :-1].contiguous()
    forward = torch.compile(model) if impl == "hf_compile" else model
    losses = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = forward(input_ids=inputs, labels=labels)
        loss = out.loss  # the next-token loss plus the router's aux loss (output_router_logits)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        return loss

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = time_steps(step, lambda loss: float(loss), args)
    return dict(
        seconds=seconds,
        losses=[float(x) for x in losses],
        peak_memory_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        attention="sdpa",
        experts="grouped_mm",
    )


# ----------------------------------------------------------------------------------- driver
def run_worker(impl: str, args) -> dict:
    """`impl` in a process of its own (its peak memory its own); its record or its error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "worker.json")
        argv = [sys.executable, "-m", "benchmarks.train", "--worker", f"{impl}:{out}"]
        argv += ["--model", args.model, "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr)]
        argv += [f"--set={item}" for item in args.set]
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode or not os.path.exists(out):
            return dict(error=(proc.stderr or proc.stdout)[-3000:], wall_seconds=wall)
        with open(out) as f:
            return dict(json.load(f), wall_seconds=wall)


def summarize(record: dict, args, per_token: float, peak: float | None) -> dict:
    """Tokens/s, MFU and peak memory a token from a worker's step times."""
    if "error" in record:
        return record
    median = statistics.median(record["seconds"])
    tokens = args.batch * args.seq_len
    tokens_per_s = tokens / median
    return dict(
        record,
        median_step_ms=1e3 * median,
        tokens_per_s=tokens_per_s,
        mfu=None if peak is None else tokens_per_s * per_token / peak,
        peak_memory_gib=None
        if record.get("peak_memory_bytes") is None
        else record["peak_memory_bytes"] / 2**30,
        peak_memory_bytes_per_token=None
        if record.get("peak_memory_bytes") is None
        else record["peak_memory_bytes"] / tokens,
    )


def outcome(record: dict) -> str:
    """A worker's record as one log line."""
    if "tokens_per_s" not in record:
        return f"failed: {record['error'][-400:]}"
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    peak = "n/a" if record["peak_memory_gib"] is None else f"{record['peak_memory_gib']:.1f} GiB"
    return (
        f"{record['median_step_ms']:.1f} ms a step, {record['tokens_per_s'] / 1e3:.1f}k tokens/s, "
        f"MFU {mfu}, peak memory {peak}"
    )


def plot(result: dict, path: str) -> None:
    """Bar plot of tokens/s (MFU on the bars) per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    rows = [(name, r) for name, r in result["impls"].items() if "tokens_per_s" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar([n for n, _ in rows], [r["tokens_per_s"] / 1e3 for _, r in rows])
    for bar, (_, r) in zip(bars, rows):
        if r.get("mfu") is not None:
            ax.annotate(f"MFU {100 * r['mfu']:.1f}%", (bar.get_x() + 0.1, bar.get_height()))
    ax.set_ylabel("thousand tokens / s")
    ax.set_title(f"{result['model']} training step, seq {result['seq_len']} x {result['batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        impl, out = args.worker.split(":", 1)
        record = (jax_worker if impl.startswith("jaxmoe") else torch_worker)(impl, args)
        with open(out, "w") as f:
            json.dump(record, f)
        return

    import jax

    from jaxmoe.models import count_parameters
    from jaxmoe.train import flops_per_token, peak_flops

    config = model_config(args)
    counts = count_parameters(config)
    per_token = flops_per_token(config, args.seq_len)
    device = jax.devices()[0]
    peak = peak_flops(device)
    result = report.environment(
        "train",
        model=args.model,
        seq_len=args.seq_len,
        batch=args.batch,
        total_parameters=counts.total,
        active_parameters=counts.active,
        flops_per_token=per_token,
        peak_bf16_flops=peak,
        mfu_formula="tokens/s x (6 x active parameters + 12 x layers x heads x head_dim x "
        "seq_len) / the card's dense bf16 peak",
        impls={},
    )
    path = report.result_path(args.out, "train", args.tag)
    for impl in args.impls:
        log(f"{impl} ...")
        try:
            record = summarize(run_worker(impl, args), args, per_token, peak)
        except Exception as e:  # noqa: BLE001  a failed competitor is recorded, not fatal
            record = dict(error=error_text(e))
        result["impls"][impl] = record
        log(f"{impl}: {outcome(record)}")
        base = result["impls"].get("jaxmoe", {}).get("tokens_per_s")
        for other in result["impls"].values():
            if base and "tokens_per_s" in other:
                other["jaxmoe_speedup"] = base / other["tokens_per_s"]
        report.write_result(result, path)  # after each one: a run cut short keeps what finished
    plot(result, path.removesuffix(".json") + ".png")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
