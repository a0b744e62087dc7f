"""Train the MoE language model: `python -m jaxmoe.train [--preset NAME] [--set key=value ...]
[--out DIR] [--resume] [--stop-after STEP]`.

A run trains `jaxmoe.models.MoETransformer` on packed byte-level documents (`jaxmoe.data`) with
AdamW (`jaxmoe.optim`), evaluates on held-out documents, checkpoints asynchronously
(`jaxmoe.checkpoint`) and writes to its out directory: checkpoints/, metrics.jsonl (one JSON
object a step) and loss.png (train and held-out loss against the step). `--resume` continues
from the last complete checkpoint with the same bits as a run that was never stopped: the
parameters, the non-parameter model state (expert biases), the optimizer state and the data
position are restored, and a step is a function of those alone (no randomness is drawn in a
step: the data order comes from the seed and the saved position).

The step: the batch is split into `micro_batches` equal micro-batches of rows; each one's loss is
its next-token nll summed and divided by the whole batch's count of loss tokens (so the
micro-batches' losses add up to the batch's mean nll) plus its MoE aux and z losses
(`LMAux.total_loss`) divided by micro_batches; the gradients are summed over the micro-batches in
order. fp8 precisions quantize the experts' weights once a step (`quantize_expert_weights`),
shared by the micro-batches. Then one AdamW update, and each MoE layer with an expert bias
updates it from the step's token counts (`jaxmoe.update_expert_bias`). `make_train_step` builds
the step from a `loss_and_grads(params, rest, micro_batch, expert_weights) -> ((loss, metrics),
grads)` (`make_loss_and_grads`), the seam where a mesh version replaces the single-device one:
with `TrainConfig.mesh = (data, ep)` the step runs over a ("data", "ep") device mesh
(`jaxmoe.models.parallel`), with the same loss curve and parameters, bitwise, for every split
of the same number of devices.

Logged every step (metrics.jsonl; a line every log_every steps, under a tqdm bar on stderr):
loss (the optimized objective), nll, aux and z losses, each MoE layer's expert load max/mean
(from its token counts), gradient norm (before clipping), learning rate, tokens/s (the batch's
positions, padding included) and MFU; every eval_every steps the held-out loss and bits per byte
(the nll over byte targets, ids < 256, in bits), which the printed lines repeat until the next.
MFU = tokens/s x FLOPs per token / the device's peak, with FLOPs per token = 6 x active
parameters (`count_parameters`) + 12 x num_layers x num_heads x head_dim x seq_len (the
attention scores and values, forward and backward); the peak is known for H100/H200 (dense
bf16, 989 TFLOP/s) and MFU is None elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxmoe import PRECISION_PRESETS, update_expert_bias
from jaxmoe import data as data_lib
from jaxmoe.checkpoint import Checkpointer
from jaxmoe.expert_parallel import mesh_shardings, place_on_mesh
from jaxmoe.models import CONFIGS, LMConfig, MoETransformer, count_parameters
from jaxmoe.models.parallel import (
    global_batch,
    make_mesh_loss_and_grads,
    mesh_micro_batches,
    training_mesh,
)
from jaxmoe.optim import last_gradient_norm, lm_loss, lr_schedule, make_optimizer

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak per GPU
GMM_IMPLS = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run, validated on construction (errors name the field).

    model: a `jaxmoe.models.CONFIGS` name; model_overrides: `LMConfig.with_overrides` keys
      ("num_layers", "moe.top_k"); precision: a `jaxmoe.PRECISION_PRESETS` name for the MoE
      layers ("bf16", "mxfp8", "fp8_blockwise").
    seq_len, batch_size: the batch's [batch_size, seq_len] tokens; micro_batches: the batch
      split into that many micro-batches of rows (gradient accumulation).
    steps: optimizer steps; lr, warmup, min_lr_ratio, weight_decay, clip_norm: `make_optimizer`'s
      (warm-up over `warmup` steps, cosine decay to lr * min_lr_ratio at `steps`).
    seed: the initialisation, the held-out split and the data order.
    data: "stdlib" (`jaxmoe.data.stdlib_corpus`) or paths for `jaxmoe.data.text_corpus`;
      held_out_fraction: the documents held out for evaluation.
    eval_every, eval_batches: evaluation every that many steps (and at the end) on that many
      fixed held-out batches; log_every: a printed line every that many steps; save_every,
      keep: a checkpoint every that many steps (and at the end), the last `keep` kept.
    out: the run's directory; resume: continue from its last complete checkpoint (without it,
      a directory that holds checkpoints or metrics is an error: nothing is overwritten).
    gmm_impl: the model's matmul implementation ("auto", "pallas", "xla").
    mesh: None (one device) or (data, ep): the step over a `jax.make_mesh((data, ep), ("data",
      "ep"))` of the first data x ep devices (all processes' under `jax.distributed`), each
      micro-batch's rows split over the data x ep ranks, the routed experts over ep
      (`jaxmoe.models.parallel.make_mesh_loss_and_grads`); the batch's rows per micro-batch
      and the experts must split over them."""

    model: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    precision: str = "bf16"
    seq_len: int = 128
    batch_size: int = 16
    micro_batches: int = 1
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    seed: int = 0
    data: str | tuple[str, ...] = "stdlib"
    held_out_fraction: float = 0.01
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 100
    keep: int = 3
    out: str = "runs/train"
    resume: bool = False
    gmm_impl: str = "auto"
    mesh: tuple[int, int] | None = None

    def __post_init__(self):
        def fail(name: str, why: str):
            raise ValueError(f"TrainConfig.{name}: {why} (got {getattr(self, name)!r})")

        def integer(name: str, low: int):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                fail(name, f"must be an int >= {low}")

        def number(name: str, low: float, high: float = math.inf, *, open_low=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(name, "must be a number")
            if not (low < value if open_low else low <= value) or not value <= high:
                fail(name, f"must lie in {'(' if open_low else '['}{low}, {high}]")

        for name in ("seq_len", "batch_size", "micro_batches", "steps", "eval_every"):
            integer(name, 1)
        for name in ("eval_batches", "log_every", "save_every", "keep"):
            integer(name, 1)
        integer("warmup", 0)
        integer("seed", 0)
        number("lr", 0.0, open_low=True)
        number("min_lr_ratio", 0.0, 1.0)
        number("weight_decay", 0.0)
        number("held_out_fraction", 0.0, 1.0, open_low=True)
        if self.clip_norm is not None:
            number("clip_norm", 0.0, open_low=True)
        if self.warmup > self.steps:
            fail("warmup", f"must not exceed steps ({self.steps})")
        if self.model not in CONFIGS:
            fail("model", f"must be one of {sorted(CONFIGS)}")
        if not isinstance(self.model_overrides, dict):
            fail("model_overrides", "must be a dict of LMConfig.with_overrides keys")
        if self.precision not in PRECISION_PRESETS:
            fail("precision", f"must be one of {tuple(PRECISION_PRESETS)}")
        if self.gmm_impl not in GMM_IMPLS:
            fail("gmm_impl", f"must be one of {GMM_IMPLS}")
        if not isinstance(self.resume, bool):
            fail("resume", "must be a bool")
        if not isinstance(self.out, str) or not self.out:
            fail("out", "must be a directory path")
        if isinstance(self.data, list | tuple):
            object.__setattr__(self, "data", tuple(self.data))
        paths = (self.data,) if isinstance(self.data, str) else self.data
        if not paths or not all(isinstance(p, str) and p for p in paths):
            fail("data", '"stdlib" or a list of paths')
        if self.batch_size % self.micro_batches:
            fail("batch_size", f"must split into micro_batches ({self.micro_batches}) rows each")
        config = self.model_config()
        if self.mesh is not None:
            self._check_mesh(config, fail)
        if self.seq_len > config.max_position:
            fail("seq_len", f"exceeds the model's max_position ({config.max_position})")
        moe = config.moe
        if moe.load_balancing_type == "global_aux_loss" or moe.input_jitter_eps is not None:
            raise ValueError(
                "TrainConfig: the MoE's load_balancing_type='global_aux_loss' and "
                "input_jitter_eps change its state in the forward pass, which the training "
                f"step does not carry (got {moe.load_balancing_type!r}, {moe.input_jitter_eps!r})"
            )

    def _check_mesh(self, config: LMConfig, fail: Callable) -> None:
        """`mesh` as a (data, ep) tuple of ints >= 1 that the micro-batches' rows and the
        experts split over, or a ValueError naming it."""
        mesh = self.mesh
        if isinstance(mesh, list | tuple):
            object.__setattr__(self, "mesh", mesh := tuple(mesh))
        if not (
            isinstance(mesh, tuple)
            and len(mesh) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh)
        ):
            fail("mesh", "must be None or (data, ep), two ints >= 1")
        ranks, ep = mesh[0] * mesh[1], mesh[1]
        rows = self.batch_size // self.micro_batches
        if rows % ranks:
            fail(
                "mesh",
                f"a micro-batch's {rows} rows (batch_size {self.batch_size} / micro_batches "
                f"{self.micro_batches}) do not split over its {ranks} ranks",
            )
        if config.moe.num_experts % ep:
            fail("mesh", f"the {config.moe.num_experts} experts do not split over ep = {ep}")

    def model_config(self) -> LMConfig:
        """The `LMConfig` trained: the named config with the overrides and the precision."""
        config = CONFIGS[self.model].with_overrides(self.model_overrides)
        return config.replace(moe=config.moe.with_precision(self.precision))

    def to_dict(self) -> dict:
        """The config as JSON-able values."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # `make run`: the tiny model on the stdlib corpus, sized for about two minutes on two CPU
    # cores with the compilation, to a held-out bits per byte over a bit below the unigram's.
    "cpu_tiny": TrainConfig(
        model="tiny",
        seq_len=128,
        batch_size=16,
        steps=120,
        lr=3e-3,
        warmup=20,
        min_lr_ratio=0.1,
        data="stdlib",
        eval_every=40,
        eval_batches=4,
        log_every=20,
        save_every=40,
        out="runs/cpu_tiny",
    ),
}


# --------------------------------------------------------------------------- the step
LossAndGrads = Callable[[Any, Any, dict, Any], tuple[tuple[jax.Array, dict], Any]]


def make_loss_and_grads(graphdef: nnx.GraphDef, micro_batches: int) -> LossAndGrads:
    """`loss_and_grads(params, rest, micro_batch, expert_weights) -> ((loss, metrics), grads)`
    on one device: params and rest (the model's `nnx.Param`s and other state, pure dicts),
    micro_batch a `PackedBatches` batch's arrays plus `step_tokens` (the whole step's count of
    loss tokens), expert_weights the MoE layers' quantized weights or None. loss = nll summed /
    step_tokens + aux.total_loss / micro_batches; metrics: nll, load_balancing_loss [L_moe],
    z_loss [L_moe] (both / micro_batches), tokens_per_expert [L_moe, E], tokens; grads: d loss /
    d params."""

    def loss_fn(params, rest, micro_batch, expert_weights):
        model = nnx.merge(graphdef, params, rest)
        logits, aux = model(
            micro_batch["inputs"],
            segment_ids=micro_batch["segment_ids"],
            positions=micro_batch["positions"],
            expert_weights=expert_weights,
        )
        nll, tokens = lm_loss(
            logits,
            micro_batch["targets"],
            micro_batch["loss_mask"],
            normalizer=micro_batch["step_tokens"],
        )
        metrics = dict(
            nll=nll,
            load_balancing_loss=aux.load_balancing_loss / micro_batches,
            z_loss=aux.z_loss / micro_batches,
            tokens_per_expert=aux.tokens_per_expert,
            tokens=tokens,
        )
        return nll + aux.total_loss / micro_batches, metrics

    return jax.value_and_grad(loss_fn, has_aux=True)


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    micro_batches: int,
    quantized: bool,
    loss_and_grads: LossAndGrads | None = None,
    split_micro_batches: Callable | None = None,
) -> Callable:
    """`step(params, rest, opt_state, batch) -> (params, rest, opt_state, metrics)`, to be
    jitted: the module docstring's step. `quantized`: the MoE experts are fp8 (their copies made
    once a step); `loss_and_grads`: None for `make_loss_and_grads(graphdef, micro_batches)`;
    `split_micro_batches(batch, micro_batches)`: each [B, ...] array -> [micro_batches, B /
    micro_batches, ...] (None: micro-batch i is rows [i B / micro_batches, (i + 1) B /
    micro_batches); over a mesh `jaxmoe.models.parallel.mesh_micro_batches`).
    metrics: those of loss_and_grads summed over the micro-batches, with loss and grad_norm."""
    loss_and_grads = loss_and_grads or make_loss_and_grads(graphdef, micro_batches)
    split_micro_batches = split_micro_batches or _contiguous_micro_batches

    def step(params, rest, opt_state, batch):
        model = nnx.merge(graphdef, params, rest)
        expert_weights = model.quantize_expert_weights() if quantized else None
        step_tokens = jnp.sum(batch["loss_mask"], dtype=jnp.int32)
        micro = split_micro_batches(batch, micro_batches)

        def one(index):
            micro_batch = {k: v[index] for k, v in micro.items()}
            (loss, metrics), grads = loss_and_grads(
                params, rest, dict(micro_batch, step_tokens=step_tokens), expert_weights
            )
            return grads, dict(metrics, loss=loss)

        if micro_batches == 1:
            grads, metrics = one(0)
        else:
            # Sums from zero over the micro-batches in order (x + 0 is x: the first is exact).
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(one, 0))
            add = lambda carry, index: (jax.tree.map(jnp.add, carry, one(index)), None)
            (grads, metrics), _ = jax.lax.scan(add, zeros, jnp.arange(micro_batches))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        for moe, counts in zip(model.moe_layers(), metrics["tokens_per_expert"]):
            bias = moe.router.expert_bias
            if bias is not None:
                bias[...] = update_expert_bias(bias[...], counts, moe.config.bias_update_rate)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        metrics = dict(metrics, grad_norm=last_gradient_norm(opt_state))
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest), opt_state, metrics

    return step


def _contiguous_micro_batches(batch: dict, micro_batches: int) -> dict:
    """Each [B, ...] array as [micro_batches, B / micro_batches, ...], in row order."""
    return {k: v.reshape((micro_batches, -1) + v.shape[1:]) for k, v in batch.items()}


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    """`evaluate(params, rest, batch) -> (nll, count, byte nll, byte count)`: the mean nll over
    the batch's loss tokens and over those whose target is a byte (id < 256)."""

    def evaluate(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model(
            batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        targets, mask = batch["targets"], batch["loss_mask"]
        nll, count = lm_loss(logits, targets, mask)
        byte_nll, byte_count = lm_loss(logits, targets, mask & (targets < 256))
        return nll, count, byte_nll, byte_count

    return evaluate


def jit_steps(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state: tuple,
    *,
    micro_batches: int,
    quantized: bool,
    mesh: Mesh | None = None,
) -> tuple[Callable, Callable, Callable]:
    """(step, evaluate, feed): `make_train_step`'s step (donating its state) and
    `make_eval_step`'s evaluation, jitted, and feed(batch), a host batch as the step takes it.
    mesh None: one device. A ("data", "ep") mesh (`jaxmoe.models.parallel.training_mesh`): the
    step of `make_mesh_loss_and_grads` and `mesh_micro_batches`, whose state (params, rest,
    opt_state; `state`, placed by `mesh_shardings`) keeps that layout (in and out shardings),
    fed by `global_batch`; the evaluation on every device with the parameters gathered."""
    if mesh is None:
        step = make_train_step(graphdef, tx, micro_batches=micro_batches, quantized=quantized)
        return jax.jit(step, donate_argnums=(0, 1, 2)), jax.jit(make_eval_step(graphdef)), _same
    step = make_train_step(
        graphdef,
        tx,
        micro_batches=micro_batches,
        quantized=quantized,
        loss_and_grads=make_mesh_loss_and_grads(graphdef, mesh, micro_batches),
        split_micro_batches=mesh_micro_batches(mesh),
    )
    placed, everywhere = mesh_shardings(state, mesh), NamedSharding(mesh, P())
    jitted = jax.jit(
        step,
        donate_argnums=(0, 1, 2),
        in_shardings=(*placed, NamedSharding(mesh, P(mesh.axis_names))),
        out_shardings=(*placed, everywhere),  # the state stays where the compiled step reads it
    )
    # Every device evaluates the whole held-out batch with the gathered parameters (inside
    # shard_map: the model's ops on local arrays, which explicit mesh axes need for ragged_dot).
    evaluate = jax.shard_map(
        make_eval_step(graphdef), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
    gathered = lambda params, rest, batch: evaluate(*jax.reshard((params, rest), everywhere), batch)
    return jitted, jax.jit(gathered), functools.partial(global_batch, mesh=mesh)


def _same(batch: dict) -> dict:
    """A host batch as the single-device step takes it: as it is."""
    return batch


# --------------------------------------------------------------------------- the run
@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the first step it ran (the resumed checkpoint's step, or 0), the
    loss of each step it ran (fp32), the final parameters and non-parameter state (pure dicts),
    the last held-out metrics, the corpus's unigram entropy and the files written."""

    start_step: int
    losses: dict[int, np.float32]
    params: Any
    rest: Any
    held_out: dict
    unigram_entropy_bits: float
    checkpoint: Path
    metrics: Path
    plot: Path


def load_corpus(data: str | Sequence[str]) -> list[data_lib.Document]:
    """The documents of a `TrainConfig.data`."""
    return data_lib.stdlib_corpus() if data == "stdlib" else data_lib.text_corpus(list(data))


def peak_flops(device: jax.Device) -> float | None:
    """The dense bf16 peak FLOP/s of a device in `PEAK_FLOPS` (by its kind), else None."""
    kind = getattr(device, "device_kind", "")
    return next((peak for name, peak in PEAK_FLOPS.items() if name in kind), None)


def flops_per_token(config: LMConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active parameters + 12 x L x heads x head_dim x seq_len."""
    active = count_parameters(config).active
    return 6.0 * active + 12.0 * config.num_layers * config.num_heads * config.head_dim * seq_len


def _held_out(evaluate, params, rest, batches) -> dict:
    """The held-out loss (nats per token) and bits per byte over the eval batches."""
    sums = np.zeros(4)
    for batch in batches:
        nll, count, byte_nll, byte_count = jax.device_get(evaluate(params, rest, batch))
        sums += [float(nll) * int(count), int(count), float(byte_nll) * int(byte_count), byte_count]
    return dict(
        held_out_loss=sums[0] / max(sums[1], 1),
        held_out_bits_per_byte=sums[2] / max(sums[3], 1) / math.log(2),
    )


def _record(step: int, metrics: dict, seconds: float, tokens: int, lr: float, mfu) -> dict:
    """The metrics.jsonl record of a step."""
    counts = np.asarray(metrics["tokens_per_expert"], np.float64)
    load = counts.max(axis=-1) / np.maximum(counts.mean(axis=-1), 1e-9)
    return dict(
        step=step,
        loss=float(metrics["loss"]),
        nll=float(metrics["nll"]),
        aux_loss=float(np.sum(metrics["load_balancing_loss"])),
        z_loss=float(np.sum(metrics["z_loss"])),
        expert_load_max_over_mean=[round(float(x), 4) for x in load],
        grad_norm=float(metrics["grad_norm"]),
        lr=lr,
        tokens_per_s=tokens / seconds,
        mfu=mfu,
    )


def _line(record: dict, held_out: dict) -> str:
    """A log line of a record and the last held-out evaluation (a record of step "step")."""
    text = (
        f"step {record['step']:6d}  loss {record['loss']:.4f}  nll {record['nll']:.4f}  "
        f"aux {record['aux_loss']:.2e}  z {record['z_loss']:.2e}  "
        f"grad {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
        f"tok/s {record['tokens_per_s']:,.0f}  "
        f"load {'/'.join(f'{x:.2f}' for x in record['expert_load_max_over_mean'])}"
    )
    if record["mfu"] is not None:
        text += f"  mfu {record['mfu']:.1%}"
    if held_out:
        text += (
            f"  held-out {held_out['held_out_loss']:.4f}"
            f" ({held_out['held_out_bits_per_byte']:.3f} bits/byte at step {held_out['step']})"
        )
    return text


def _read_metrics(path: Path, until: int) -> list[dict]:
    """The records of metrics.jsonl up to step `until` (later ones: steps a killed run did
    after its last checkpoint, which the resumed run does again)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= until]


def plot_losses(records: list[dict], path: Path) -> None:
    """The train nll and held-out loss against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([r["step"] for r in records], [r["nll"] for r in records], label="train nll")
    held = [r for r in records if "held_out_loss" in r]
    axes.plot(
        [r["step"] for r in held], [r["held_out_loss"] for r in held], "o-", label="held-out nll"
    )
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def train(
    config: TrainConfig, *, stop_after: int | None = None, progress: bool = True
) -> TrainResult:
    """Run `config` (the module docstring); returns a `TrainResult`. stop_after: end after that
    step, checkpointed (a run split into parts, e.g. by a job's time limit: `resume` continues
    it with the bits of one run); progress: the tqdm bar. Refuses, before anything is compiled:
    a run directory holding checkpoints or metrics without `resume`, an empty corpus, and (when
    resuming) a checkpoint of another model config."""
    last = config.steps if stop_after is None else stop_after
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= config.steps:
        raise ValueError(f"stop_after must be an int in [1, steps={config.steps}], got {last!r}")
    lm_config = config.model_config()
    mesh = None if config.mesh is None else training_mesh(*config.mesh)
    if mesh is not None and jax.process_count() > 1:
        raise NotImplementedError(
            "train: the checkpoints and metrics are written by one process; over processes, "
            "build the step with jaxmoe.models.parallel (docs/expert_parallel.md)"
        )
    out = Path(config.out)
    checkpoints, metrics_path, plot_path = (
        out / "checkpoints",
        out / "metrics.jsonl",
        out / "loss.png",
    )
    wrote_metrics = metrics_path.exists() and metrics_path.stat().st_size > 0
    if not config.resume and (wrote_metrics or checkpoints.is_dir() and any(checkpoints.iterdir())):
        raise FileExistsError(
            f"{out} holds a run (checkpoints or metrics.jsonl): pass --resume to continue it, "
            "or choose another --out"
        )
    docs = load_corpus(config.data)
    train_docs, held_docs = data_lib.split_documents(docs, config.held_out_fraction, config.seed)
    entropy = data_lib.unigram_entropy_bits(docs)
    batches = data_lib.PackedBatches(
        train_docs, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed
    )
    held_out = data_lib.PackedBatches(
        held_docs, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed
    )
    eval_batches = [
        held_out.batch_at(i) for i in range(min(config.eval_batches, held_out.batches_in_epoch(0)))
    ]

    model = MoETransformer(lm_config, rngs=nnx.Rngs(config.seed), gmm_impl=config.gmm_impl)
    if mesh is not None:
        model = place_on_mesh(model, mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    del model
    tx = make_optimizer(
        config.lr,
        config.warmup,
        config.steps,
        config.min_lr_ratio,
        config.weight_decay,
        config.clip_norm,
    )
    opt_state = tx.init(params)
    if mesh is not None:
        opt_state = jax.device_put(opt_state, mesh_shardings(opt_state, mesh))
    checkpointer = Checkpointer(checkpoints, keep=config.keep)
    for name in checkpointer.discarded:
        print(f"discarded the unfinished checkpoint {checkpoints / name}")
    start = 0
    if config.resume and checkpointer.latest_step() is not None:
        state = dict(params=params, rest=rest, opt_state=opt_state)
        restored = checkpointer.restore(state, model_config=lm_config.to_dict())
        params, rest, opt_state = (restored.state[k] for k in ("params", "rest", "opt_state"))
        batches.restore(restored.data_state)
        start = restored.step
        changed = {
            k: (v, restored.metadata["train_config"].get(k))
            for k, v in config.to_dict().items()
            if k not in ("out", "resume") and restored.metadata["train_config"].get(k) != v
        }
        print(f"resumed from {checkpointer.path(start)}")
        if changed:
            print(f"  training config changed since (now, then): {changed}")
    elif config.resume:
        print(f"no complete checkpoint in {checkpoints}: starting from step 0")
    records = _read_metrics(metrics_path, start)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    quantized = lm_config.moe.expert_precision != "bf16"
    jitted, evaluate, feed = jit_steps(
        graphdef,
        tx,
        (params, rest, opt_state),
        micro_batches=config.micro_batches,
        quantized=quantized,
        mesh=mesh,
    )
    example = feed(batches.batch_at(0))
    began = time.perf_counter()
    compiled = jitted.lower(params, rest, opt_state, example).compile()
    print(f"compiled the training step in {time.perf_counter() - began:.1f} s")
    schedule = lr_schedule(config.lr, config.warmup, config.steps, config.min_lr_ratio)
    tokens = config.batch_size * config.seq_len
    peak = peak_flops(jax.devices()[0])
    if peak is not None and mesh is not None:
        peak *= mesh.size
    per_token = flops_per_token(lm_config, config.seq_len)
    losses, last_eval = {}, {}
    bar = tqdm(
        total=config.steps, initial=start, file=sys.stderr, disable=not progress, unit="step"
    )
    with metrics_path.open("a") as log:
        for step in range(start + 1, last + 1):
            batch = feed(next(batches))
            began = time.perf_counter()
            params, rest, opt_state, metrics = compiled(params, rest, opt_state, batch)
            metrics = jax.device_get(metrics)
            seconds = time.perf_counter() - began
            losses[step] = np.float32(metrics["loss"])
            mfu = None if peak is None else tokens / seconds * per_token / peak
            record = _record(step, metrics, seconds, tokens, float(schedule(step - 1)), mfu)
            if step % config.eval_every == 0 or step == last:
                last_eval = dict(_held_out(evaluate, params, rest, eval_batches), step=step)
                record.update(last_eval)
            log.write(json.dumps(record) + "\n")
            log.flush()
            records.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            if step % config.log_every == 0 or step == last:
                bar.write(_line(record, last_eval), file=sys.stdout)
            if step % config.save_every == 0 or step == last:
                checkpointer.save(
                    step,
                    dict(params=params, rest=rest, opt_state=opt_state),
                    data_state=batches.state(),
                    model_config=lm_config.to_dict(),
                    train_config=config.to_dict(),
                )
    bar.close()
    checkpointer.wait()
    final = checkpointer.path(checkpointer.latest_step())
    checkpointer.close()
    if not last_eval:
        last_eval = dict(_held_out(evaluate, params, rest, eval_batches), step=last)
    plot_losses(records, plot_path)
    print(f"checkpoint: {final}\nmetrics:    {metrics_path}\nplot:       {plot_path}")
    print(
        f"held-out: {last_eval['held_out_loss']:.4f} nats/token, "
        f"{last_eval['held_out_bits_per_byte']:.3f} bits/byte "
        f"(the corpus's unigram entropy: {entropy:.3f} bits/byte)"
    )
    return TrainResult(
        start_step=start,
        losses=losses,
        params=params,
        rest=rest,
        held_out=last_eval,
        unigram_entropy_bits=entropy,
        checkpoint=final,
        metrics=metrics_path,
        plot=plot_path,
    )


# --------------------------------------------------------------------------- the CLI
def parse_value(text: str) -> Any:
    """A --set value: JSON if it parses, else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, int | None]:
    """(the `TrainConfig`, --stop-after) of command-line arguments: the preset, then each
    `--set key=value` (a TrainConfig field, or "model.<LMConfig key>" for the model's
    overrides), then --out and --resume. Errors name the unknown preset, key or bad value."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxmoe.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", default="cpu_tiny", help=f"one of {sorted(TRAIN_PRESETS)}")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TrainConfig field or model.<LMConfig key> (values parsed as JSON, else strings)",
    )
    parser.add_argument("--out", help="the run's directory (default: the preset's)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--stop-after", type=int, metavar="STEP", help="end after this step, checkpointed"
    )
    args = parser.parse_args(argv)
    if args.preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: one of {sorted(TRAIN_PRESETS)}")
    preset = TRAIN_PRESETS[args.preset]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    changes, overrides = {}, dict(preset.model_overrides)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key.startswith("model."):
            overrides[key.removeprefix("model.")] = parse_value(value)
        elif key in fields:
            changes[key] = parse_value(value)
        else:
            raise ValueError(f"--set: unknown key {key!r} (TrainConfig fields: {sorted(fields)})")
    if args.out is not None:
        changes["out"] = args.out
    if args.resume:
        changes["resume"] = True
    config = dataclasses.replace(preset, **{"model_overrides": overrides, **changes})
    return config, args.stop_after


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: parse and validate (a bad preset, key or value exits with status 2
    and the error), then train."""
    try:
        config, stop_after = parse_args(argv)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    train(config, stop_after=stop_after)


if __name__ == "__main__":
    main()
