"""The language model's training step over meshes of 8 host devices (`jaxmoe.models.parallel`,
`TrainConfig.mesh`): a two-layer model (one dense FFN, one MoE layer of 8 experts with an expert
bias) trained 3 AdamW steps on 8 sequences of 32 tokens has the same loss curve, final
parameters and expert biases, bitwise, at meshes (8, 1), (4, 2), (2, 4) and (1, 8); its loss is
the single-device step's within rounding; `jaxmoe.train.train` with a mesh runs that step; bad
meshes are refused before anything is compiled."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmoe import data as data_lib
from jaxmoe.expert_parallel import mesh_shardings, place_on_mesh
from jaxmoe.models import MoETransformer
from jaxmoe.models.parallel import global_batch, mesh_micro_batches, training_mesh
from jaxmoe.optim import make_optimizer
from jaxmoe.train import TrainConfig, jit_steps, load_corpus, parse_args, train

from bitwise import assert_bitwise, differs

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))
STEPS = 3
OVERRIDES = {
    "num_layers": 2,
    "first_k_dense": 1,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "dense_ffn_hidden_size": 128,
    "moe.num_experts": 8,
    "moe.ffn_hidden_size": 64,
    "moe.shared_expert_intermediate_size": 64,
    "moe.enable_expert_bias": True,
    "moe.score_function": "sigmoid",
}


def write_corpus(directory) -> None:
    """Twenty small text files of pseudo-random words, the same at every call."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    for i in range(20):
        text = " ".join(rng.choice(words, size=rng.integers(20, 60)))
        (Path(directory) / f"doc{i:02d}.txt").write_text(text + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory)
    return directory


def config(corpus, **changes) -> TrainConfig:
    base = TrainConfig(
        model="tiny",
        model_overrides=OVERRIDES,
        seq_len=32,
        batch_size=8,
        steps=STEPS,
        lr=1e-2,
        warmup=1,
        data=(str(corpus),),
        held_out_fraction=0.2,
        eval_every=STEPS,
        eval_batches=1,
        log_every=STEPS,
        save_every=STEPS,
    )
    return dataclasses.replace(base, **changes)


def training_batches(config: TrainConfig) -> list[dict[str, np.ndarray]]:
    """The first STEPS batches of `train(config)`."""
    docs = data_lib.split_documents(
        load_corpus(config.data), config.held_out_fraction, config.seed
    )[0]
    batches = data_lib.PackedBatches(
        docs, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed
    )
    return [batches.batch_at(i) for i in range(STEPS)]


class Run:
    """The training step of `config` (over `config.mesh`, or one device), compiled once, and
    the first STEPS steps from the initial state on given batches."""

    def __init__(self, config: TrainConfig, example: dict[str, np.ndarray]):
        lm_config = config.model_config()
        self.mesh = None if config.mesh is None else training_mesh(*config.mesh)
        model = MoETransformer(lm_config, rngs=nnx.Rngs(config.seed))
        if self.mesh is not None:
            model = place_on_mesh(model, self.mesh)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        tx = make_optimizer(config.lr, config.warmup, config.steps)
        opt_state = tx.init(params)
        if self.mesh is not None:
            opt_state = jax.device_put(opt_state, mesh_shardings(opt_state, self.mesh))
        self.initial = (params, rest, opt_state)
        quantized = lm_config.moe.expert_precision != "bf16"
        step, _, self.feed = jit_steps(
            graphdef,
            tx,
            self.initial,
            micro_batches=config.micro_batches,
            quantized=quantized,
            mesh=self.mesh,
        )
        self.step = step.lower(*self.initial, self.feed(example)).compile()

    def __call__(self, batches):
        """(every step's loss, metrics, the final params and rest), from the initial state
        (copied: the step donates its state)."""
        state = jax.tree.map(lambda a: a.copy(), self.initial)
        losses, metrics = [], []
        for batch in batches:
            *state, step_metrics = self.step(*state, self.feed(batch))
            metrics.append(jax.device_get(step_metrics))
            losses.append(np.float32(metrics[-1]["loss"]))
        return np.array(losses), metrics, state[0], state[1]


def changed_token(batches):
    """The batches with one input token of the last rank's last row in the first one changed."""
    changed = [dict(b) for b in batches]
    inputs = changed[0]["inputs"].copy()
    inputs[-1, 5] = (inputs[-1, 5] + 1) % 256
    changed[0]["inputs"] = inputs
    return changed


def assert_same_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert_bitwise(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def runs(corpus):
    """{mesh: (compiled Run, its STEPS steps' results)} for every mesh and None (one device)."""
    batches = training_batches(config(corpus))
    out = {}
    for mesh in (*MESHES, None):
        run = Run(config(corpus, mesh=mesh), batches[0])
        out[mesh] = (run, run(batches))
    return out


def test_loss_curve_and_parameters_are_bitwise_the_same_at_every_mesh(runs, corpus):
    """Every step's loss, the final parameters and expert biases at (4, 2), (2, 4), (1, 8)
    bitwise those at (8, 1); the expert bias follows the global token counts (every rank's
    tokens, top_k pairs each). Control: one changed token of the last rank's rows in the first
    batch changes the first loss and the parameters, on the same compiled step."""
    losses, metrics, params, rest = runs[MESHES[0]][1]
    for mesh in MESHES[1:]:
        got_losses, _, got_params, got_rest = runs[mesh][1]
        assert_bitwise(got_losses, losses)
        assert_same_trees(got_params, params)
        assert_same_trees(got_rest, rest)
    batches = training_batches(config(corpus))
    top_k = config(corpus).model_config().moe.top_k
    for batch, step in zip(batches, metrics, strict=True):
        real = int(np.sum(batch["segment_ids"] != 0))
        assert step["tokens_per_expert"].sum(axis=-1).tolist() == [top_k * real]
    assert losses[0] != losses[1] and np.all(np.isfinite(losses))

    other_losses, _, other_params, _ = runs[MESHES[-1]][0](changed_token(batches))
    assert differs(other_losses[:1], losses[:1])
    for name in ("embed", "layers"):
        assert any(
            differs(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(other_params[name]), jax.tree.leaves(params[name]))
        )


@pytest.mark.exhaustive
def test_mxfp8_experts_and_micro_batches_bitwise_at_8x1_and_1x8(corpus):
    """MXFP8 experts (their weight copies made once a step, split over "ep" like the experts)
    and two micro-batches of 8 sequences (each rank accumulating over its own rows): every
    loss and the final parameters bitwise the same at (8, 1) and (1, 8). Control: a changed
    token changes the first loss on the same compiled step."""
    changes = dict(precision="mxfp8", batch_size=16, micro_batches=2)
    batches = training_batches(config(corpus, **changes))
    first, last = (
        Run(config(corpus, mesh=mesh, **changes), batches[0]) for mesh in ((8, 1), (1, 8))
    )
    losses, _, params, _ = first(batches)
    other_losses, _, other_params, _ = last(batches)
    assert_bitwise(other_losses, losses)
    assert_same_trees(other_params, params)
    assert differs(last(changed_token(batches))[0][:1], losses[:1])


def test_mesh_loss_agrees_with_one_device(runs):
    """The mesh step's losses against the single-device step's: the nll and loss of the first
    step within 2^-14 relative (sums in other orders; the MoE's aux losses are each rank's
    own tokens', averaged), the later steps' within 2^-10 (AdamW amplifies the rounding of
    tiny gradients). The final parameters differ in bits (the gradients' sums in another
    order), which the bitwise test above would otherwise not tell from a trivial match."""
    mesh_losses, mesh_metrics, mesh_params, _ = runs[MESHES[1]][1]
    one_losses, one_metrics, one_params, _ = runs[None][1]
    rel = lambda a, b: abs(float(a) - float(b)) / abs(float(b))
    assert rel(mesh_metrics[0]["nll"], one_metrics[0]["nll"]) <= 2.0**-14
    assert rel(mesh_losses[0], one_losses[0]) <= 2.0**-14
    for a, b in zip(mesh_losses[1:], one_losses[1:], strict=True):
        assert rel(a, b) <= 2.0**-10
    assert any(
        differs(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(mesh_params), jax.tree.leaves(one_params), strict=True)
    )


def test_train_runs_the_mesh_step(runs, corpus, tmp_path):
    """`train` with mesh=(4, 2) (`--set mesh=[4,2]`): the losses and final parameters of the
    mesh step above, bitwise; the parameters it returns keep the experts split over "ep"."""
    assert parse_args(["--set", "mesh=[4,2]"])[0].mesh == (4, 2)
    result = train(config(corpus, mesh=(4, 2), out=str(tmp_path / "run")), progress=False)
    losses, _, params, rest = runs[(4, 2)][1]
    assert_bitwise(np.array([result.losses[s] for s in range(1, STEPS + 1)]), losses)
    assert_same_trees(result.params, params)
    assert_same_trees(result.rest, rest)
    fc1 = result.params["layers"][1]["ffn"]["experts"]["fc1_kernel"]
    assert fc1.sharding.spec == P("ep") and fc1.addressable_shards[0].data.shape[0] == 4


def test_micro_batches_are_each_ranks_own_rows():
    """`mesh_micro_batches`: micro-batch i holds the i-th block of every rank's rows, in rank
    order, and each rank keeps its own rows."""
    mesh = training_mesh(4, 2)
    rows = np.arange(32 * 3).reshape(32, 3)
    split = jax.jit(lambda batch: mesh_micro_batches(mesh)(batch, 2))(
        global_batch({"x": rows}, mesh)
    )
    got = np.asarray(split["x"])
    # Rank g holds rows [4 g, 4 g + 4); its micro-batch i rows 4 g + 2 i, 4 g + 2 i + 1.
    want = rows.reshape(8, 2, 2, 3).transpose(1, 0, 2, 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(got, want)
    assert tuple(split["x"].sharding.spec)[:2] == (None, ("data", "ep"))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mesh=(4, 4), batch_size=16), "needs 16 devices, there are 8"),
        (dict(mesh=(4, 2), batch_size=4), "4 rows .* do not split over its 8 ranks"),
        (dict(mesh=(2, 2), micro_batches=4), "micro-batch's 2 rows"),
        (dict(mesh=(1, 3), batch_size=6), "8 experts do not split over ep = 3"),
        (dict(mesh=(2,)), "two ints >= 1"),
        (dict(mesh=(2, 0)), "two ints >= 1"),
    ],
)
def test_bad_meshes_are_refused_before_compiling(corpus, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        train(config(corpus, out=str(tmp_path / "run"), **changes), progress=False)
