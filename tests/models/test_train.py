"""The training loop (jaxmoe/train.py) on a one-layer model and a corpus of a few generated
documents: resuming continues with the bits of an uninterrupted run (after a clean stop and
after SIGKILL during a save), checkpoints of another model config and existing runs are
refused, and the command line's errors come before anything is compiled."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmoe.checkpoint import TMP_SUFFIX, CheckpointError
from jaxmoe.train import TrainConfig, main, make_train_step, parse_args, train

from bitwise import assert_bitwise, differs

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = {
    "num_layers": 1,
    "first_k_dense": 0,
    "hidden_size": 32,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "moe.num_experts": 4,
    "moe.ffn_hidden_size": 32,
    "moe.shared_expert_intermediate_size": None,
    "moe.enable_expert_bias": True,
    "moe.score_function": "sigmoid",
}
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Twelve small text files of pseudo-random words."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    for i in range(12):
        text = " ".join(rng.choice(words, size=rng.integers(20, 60)))
        (directory / f"doc{i:02d}.txt").write_text(text + "\n")
    return directory


def config(corpus: Path, out: Path, **changes) -> TrainConfig:
    base = TrainConfig(
        model="tiny",
        model_overrides=OVERRIDES,
        seq_len=32,
        batch_size=4,
        steps=STEPS,
        lr=1e-2,
        warmup=1,
        data=(str(corpus),),
        held_out_fraction=0.2,
        eval_every=STEPS,
        eval_batches=1,
        log_every=STEPS,
        save_every=2,
        out=str(out),
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The uninterrupted run of STEPS steps."""
    return train(config(corpus, tmp_path_factory.mktemp("straight")), progress=False)


def assert_same_run(result, reference, steps):
    for step in steps:
        assert_bitwise(result.losses[step], reference.losses[step])
    for tree in ("params", "rest"):
        a, b = getattr(result, tree), getattr(reference, tree)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert_bitwise(np.asarray(x), np.asarray(y))


def test_resuming_gives_the_bits_of_the_uninterrupted_run(straight, corpus, tmp_path):
    """STEPS/2 steps, a stop, a resume to STEPS: every later step's loss and the final
    parameters and expert biases are the uninterrupted run's bits, and metrics.jsonl holds
    every step once. Control: resuming with another seed (other data) gives other bits."""
    out = tmp_path / "run"
    half = train(config(corpus, out), stop_after=STEPS // 2, progress=False)
    assert sorted(half.losses) == list(range(1, STEPS // 2 + 1))
    shutil.copytree(out, tmp_path / "copy")
    resumed = train(config(corpus, out, resume=True), progress=False)
    assert resumed.start_step == STEPS // 2
    assert_same_run(resumed, straight, range(STEPS // 2 + 1, STEPS + 1))
    records = [json.loads(line) for line in resumed.metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [np.float32(r["loss"]) for r in records] == [straight.losses[s] for s in range(1, 7)]
    other = train(config(corpus, tmp_path / "copy", resume=True, seed=1), progress=False)
    assert other.start_step == STEPS // 2
    assert differs(other.losses[STEPS // 2 + 1], straight.losses[STEPS // 2 + 1])


# Run by the test below in a subprocess: the training CLI, with orbax's rename of step 4's
# temporary directory held (a save in progress) after printing a line the test waits for.
KILLED_RUN = """
import sys, time
import orbax.checkpoint as ocp
from jaxmoe import train

AtomicRename = ocp.path.atomicity.AtomicRenameTemporaryPath
finalize = AtomicRename.finalize

async def held(self):
    if self.get_final().name == "4":
        print("SAVING 4", flush=True)
        time.sleep(600)
    await finalize(self)

AtomicRename.finalize = held
train.main(sys.argv[1:])
"""


def cli_args(cfg: TrainConfig) -> list[str]:
    """The command line of a TrainConfig (every field by --set)."""
    args = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "model_overrides":
            args += [f"model.{k}={json.dumps(v)}" for k, v in value.items()]
        elif field.name not in ("out", "resume"):
            args.append(f"{field.name}={json.dumps(value)}")
    return [a for arg in args for a in ("--set", arg)] + ["--out", cfg.out]


def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(
    straight, corpus, tmp_path
):
    """SIGKILL while step 4's checkpoint is being written: only step 2's is complete, step 4's
    temporary directory is left; --resume discards it, starts from step 2 and gives the
    uninterrupted run's bits."""
    out = tmp_path / "run"
    cfg = config(corpus, out)
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(ROOT / ".pytest_cache" / "jax"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
    )
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, *cli_args(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("SAVING 4"):
                break
        assert lines and lines[-1].startswith("SAVING 4"), "".join(lines)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", f"4{TMP_SUFFIX}"]
    resumed = train(config(corpus, out, resume=True), progress=False)
    assert resumed.start_step == 2 and not (checkpoints / f"4{TMP_SUFFIX}").exists()
    assert_same_run(resumed, straight, range(3, STEPS + 1))


def test_existing_runs_and_other_model_configs_are_refused(straight, corpus):
    """Without --resume a directory holding a run is an error; resuming it with another model
    config names the checkpoint and the differing key."""
    out = straight.metrics.parent
    with pytest.raises(FileExistsError, match="pass --resume"):
        train(config(corpus, out), progress=False)
    other = dict(OVERRIDES, **{"moe.top_k": 1})
    with pytest.raises(
        CheckpointError, match=r"checkpoints/6 is of another model config: moe\.top"
    ):
        train(config(corpus, out, resume=True, model_overrides=other), progress=False)


def test_micro_batches_share_one_quantization_and_add_up_to_the_batch(corpus, monkeypatch):
    """A step over 2 micro-batches: MXFP8 experts are quantized once (traced); the nll and
    gradient norm equal the single batch's within rounding (each micro-batch's nll sum is
    divided by the whole batch's count before they are added)."""
    from flax import nnx

    from jaxmoe import data
    from jaxmoe.models import MoETransformer
    from jaxmoe.optim import make_optimizer

    def setup(precision):
        model = MoETransformer(
            config(corpus, Path("unused"), precision=precision).model_config(),
            rngs=nnx.Rngs(0),
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    tx = make_optimizer(1e-2, 1, 6)
    batch = data.PackedBatches(data.text_corpus(corpus), seq_len=32, batch_size=4).batch_at(0)
    calls = []
    quantize = MoETransformer.quantize_expert_weights
    monkeypatch.setattr(
        MoETransformer, "quantize_expert_weights", lambda m: calls.append(1) or quantize(m)
    )
    graphdef, params, rest = setup("mxfp8")
    step = make_train_step(graphdef, tx, micro_batches=2, quantized=True)
    jax.eval_shape(step, params, rest, tx.init(params), batch)
    assert len(calls) == 1
    graphdef, params, rest = setup("bf16")
    metrics = {
        n: jax.jit(make_train_step(graphdef, tx, micro_batches=n, quantized=False))(
            params, rest, tx.init(params), batch
        )[3]
        for n in (1, 2)
    }
    for key in ("nll", "grad_norm"):
        np.testing.assert_allclose(metrics[2][key], metrics[1][key], rtol=2**-10)
    assert int(metrics[2]["tokens"]) == int(batch["loss_mask"].sum())
    assert_bitwise(metrics[2]["tokens_per_expert"], metrics[1]["tokens_per_expert"])


def test_command_line(corpus, tmp_path, capsys):
    """--preset, --set (JSON values, dotted model keys), --out, --resume, --stop-after; unknown
    presets and keys, seq_len over max_position, a batch that does not split, and an empty
    corpus are errors naming them, raised before anything is compiled."""
    cfg, stop_after = parse_args(
        ["--set", "model.num_layers=2", "--set", "lr=0.01", "--set", 'data=["a", "b"]']
        + ["--set", "precision=mxfp8", "--out", "x", "--resume", "--stop-after", "3"]
    )
    assert (cfg.model_overrides, cfg.lr, cfg.data, cfg.out, cfg.resume, stop_after) == (
        {"num_layers": 2},
        0.01,
        ("a", "b"),
        "x",
        True,
        3,
    )
    assert cfg.model_config().moe.expert_precision == "mxfp8"
    with pytest.raises(ValueError, match="unknown preset 'gpu'"):
        parse_args(["--preset", "gpu"])
    with pytest.raises(ValueError, match="unknown key 'step'"):
        parse_args(["--set", "step=3"])
    with pytest.raises(ValueError, match="unknown key 'layers'"):
        parse_args(["--set", "model.layers=3"])
    with pytest.raises(ValueError, match=r"seq_len: exceeds the model's max_position \(512\)"):
        parse_args(["--set", "seq_len=1024"])
    with pytest.raises(ValueError, match=r"batch_size: must split into micro_batches \(3\)"):
        parse_args(["--set", "micro_batches=3"])
    with pytest.raises(ValueError, match="steps: must be an int"):
        parse_args(["--set", "steps=many"])
    with pytest.raises(SystemExit) as exit_:
        main(["--set", "batch=3"])
    assert exit_.value.code == 2 and "unknown key 'batch'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    began = time.perf_counter()
    with pytest.raises(ValueError, match="empty"):
        train(config(corpus, tmp_path / "run", data=(str(empty),)), progress=False)
    assert time.perf_counter() - began < 5
