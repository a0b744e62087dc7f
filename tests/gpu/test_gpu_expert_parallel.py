"""The expert-parallel layer on two GPUs, at real shapes, on the route users get ("auto": the
Pallas kernels, NCCL's all-to-alls): y, the auxiliary losses, d x and every parameter gradient
of the training step have the same bits at ep = 1 (two data-parallel ranks, each holding every
expert) and ep = 2 (each GPU holding half the experts), and y at ep = 1 is the single-GPU layer's
on each rank's tokens. Negative controls: a changed expert changes y on the same compiled step;
one group per expert instead of one per (expert, source) block changes the expert gradients.
Also the same step as two processes, one per GPU, under `jax.distributed` (tests/support/ep_worker.py,
suite "gpu"): the bits of one process.

Needs two Hopper GPUs (`nvidia-h200-x2`); skipped on fewer. The one-rank tests at the end need
one: the exchange's machinery over a one-device mesh, against the single-GPU layer."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_worker import flat, free_port, load, worker_path
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe import MoE
from jaxmoe.config import PRECISION_PRESETS
from jaxmoe.exchange import ExchangedRoute
from jaxmoe.expert_parallel import (
    expert_parallel_forward,
    expert_parallel_row_alignment,
    place_on_mesh,
)
from jaxmoe.shapes import SHAPES

from bitwise import assert_bitwise, differs

pytestmark = pytest.mark.gpu

GPUS = 2
TOKENS_PER_GPU = 4096
F32 = jnp.float32
MXFP8_WIRE = dict(dispatch_dtype="mxfp8", combine_bwd_dtype="mxfp8", expert_row_alignment=32)
# name -> (shape, config changes): bf16, MXFP8 on the wire alone (bf16 experts on the
# dequantized rows), MXFP8 and FP8-blockwise experts with their wires.
CASES = {
    "qwen3_30b-bf16": ("qwen3_30b", {}),
    "qwen3_30b-mxfp8_wire": ("qwen3_30b", MXFP8_WIRE),
    "deepseek_v3_style-bf16": ("deepseek_v3_style", {}),
    "deepseek_v3_style-mxfp8": ("deepseek_v3_style", PRECISION_PRESETS["mxfp8"]),
    "deepseek_v3_style-fp8_blockwise": ("deepseek_v3_style", PRECISION_PRESETS["fp8_blockwise"]),
}


def needs_two_gpus():
    if jax.device_count() < GPUS:
        pytest.skip(f"needs {GPUS} GPUs, has {jax.device_count()}")


def make(case: str):
    """(model, x [GPUS, T, H] bf16: rank r's tokens are x[r], dy of y's shape, fp32)."""
    name, changes = CASES[case]
    shape = SHAPES[name]
    config = shape.config.replace(**changes)
    model = MoE(config, shape.hidden_size, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x_shape = (GPUS, TOKENS_PER_GPU, shape.hidden_size)
    x = jax.random.normal(jax.random.key(1), x_shape, F32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), x_shape, F32)
    return model, x, dy


def mesh_for(ep: int, devices=None) -> jax.sharding.Mesh:
    """The ("data", "ep") = (GPUS / ep, ep) mesh of the first GPUS devices (or `devices`)."""
    devices = jax.devices()[:GPUS] if devices is None else devices
    return jax.make_mesh((GPUS // ep, ep), ("data", "ep"), devices=devices)


def compiled_step(model, mesh, transport="dense"):
    """(jitted (params, x, dy) -> ((d x, d params), (y, aux)) of sum(y * dy) + the ranks'
    auxiliary losses, the model's params placed on `mesh`)."""
    graphdef, params, rest = nnx.split(place_on_mesh(model, mesh), nnx.Param, ...)

    def loss(params, x, dy):
        model = nnx.merge(graphdef, params, rest)
        y, aux = expert_parallel_forward(model, x, mesh, transport=transport)
        return jnp.sum(y.astype(F32) * dy) + jnp.sum(aux.total_loss), (y, aux)

    return jax.jit(jax.grad(loss, argnums=(1, 0), has_aux=True)), params


def tokens_on(mesh, *arrays):
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    return [jax.device_put(a, sharding) for a in arrays]


def outputs(grads_and_values) -> dict[str, np.ndarray]:
    """{key path: host array} of ((d x, d params), (y, aux))."""
    (d_x, d_params), (y, aux) = grads_and_values
    return flat(dict(y=y, aux=aux, d_x=d_x, d_params=d_params))


def assert_same_outputs(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key in want:
        try:
            assert_bitwise(got[key], want[key])
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None


def run(model, x, dy, ep: int) -> dict[str, np.ndarray]:
    step, params = compiled_step(model, mesh_for(ep))
    return outputs(step(params, *tokens_on(mesh_for(ep), x, dy)))


@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_at_ep_1_and_2(case, record_property):
    needs_two_gpus()
    model, x, dy = make(case)
    start = time.perf_counter()
    ep1 = run(model, x, dy, 1)
    step, params = compiled_step(model, mesh_for(2))
    x2, dy2 = tokens_on(mesh_for(2), x, dy)
    ep2 = outputs(step(params, x2, dy2))
    record_property("seconds_two_compiled_steps", round(time.perf_counter() - start, 1))
    assert_same_outputs(ep2, ep1)
    counts = ep1["['aux'].tokens_per_expert"]
    assert counts.sum() == GPUS * TOKENS_PER_GPU * model.config.top_k  # dropless
    record_property("empty_experts", int((counts.sum(0) == 0).sum()))
    # ep = 1 is the single-GPU layer on each rank's tokens.
    forward = nnx.jit(lambda model, x: model(x)[0])
    for rank in range(GPUS):
        assert_bitwise(
            ep1["['y']"][rank : rank + 1], np.asarray(forward(model, x[rank : rank + 1]))
        )
    # Control, on the same compiled step: the last expert (on rank 1) doubled changes y.
    last_doubled = lambda a: a * (1 + (jnp.arange(len(a)) == len(a) - 1))[:, None, None]
    routed_fc2 = lambda path: jax.tree_util.keystr(path).startswith("['experts']['fc2_kernel']")
    changed = jax.tree_util.tree_map_with_path(
        lambda path, a: last_doubled(a).astype(a.dtype) if routed_fc2(path) else a, params
    )
    assert differs(outputs(step(changed, x2, dy2))["['y']"], ep2["['y']"])


@pytest.mark.parametrize("case", ["qwen3_30b-bf16", "qwen3_30b-mxfp8_wire"])
def test_ragged_transport_gives_the_dense_bits(case):
    """transport="ragged" (`jax.lax.ragged_all_to_all` over NCCL) at ep = 2: the step's
    outputs bitwise the dense transport's."""
    needs_two_gpus()
    model, x, dy = make(case)
    runs = {}
    for transport in ("dense", "ragged"):
        step, params = compiled_step(model, mesh_for(2), transport)
        runs[transport] = outputs(step(params, *tokens_on(mesh_for(2), x, dy)))
    assert_same_outputs(runs["ragged"], runs["dense"])


def test_control_one_group_per_expert_changes_the_gradient_bits(monkeypatch):
    """If the owner's GEMMs accumulated all sources' rows of an expert together (one group per
    expert) the expert gradients at ep = 2 would not have ep = 1's bits: the GPU kernels'
    order is visible to the comparison above."""
    needs_two_gpus()
    model, x, dy = make("qwen3_30b-bf16")
    ep1 = run(model, x, dy, 1)
    monkeypatch.setattr(ExchangedRoute, "group_sizes", property(lambda r: r.exchange.group_sizes))
    monkeypatch.setattr(ExchangedRoute, "row_group", property(lambda r: r.exchange.row_expert))
    monkeypatch.setattr(ExchangedRoute, "per_group", lambda r, w: w)
    monkeypatch.setattr(ExchangedRoute, "groups_per_weight", property(lambda r: 1))
    ep2 = run(model, x, dy, 2)
    key = "['d_params']['experts']['fc1_kernel'].value"
    assert differs(ep2[key], ep1[key])
    assert_bitwise(ep2["['y']"], ep1["['y']"])


# ------------------------------------------------------------------- one process per GPU
MULTIPROCESS_CASE = "qwen3_30b-mxfp8_wire"
WORKER_TIMEOUT_S = 420


def test_one_process_per_gpu_gives_the_bits_of_one(tmp_path):
    """tests/support/ep_worker.py as two processes of one `jax.distributed` job, one GPU each: the
    training step of `MULTIPROCESS_CASE` at ep = 2 (the all-to-alls cross the processes) and
    ep = 1 (the gradients' gather does) has the bits of this process's two GPUs. Control: a
    changed token of rank 1 changes y in that rank's rows alone."""
    needs_two_gpus()
    worker = Path(__file__).parents[1] / "support" / "ep_worker.py"
    coordinator, out = f"127.0.0.1:{free_port()}", tmp_path / "results.npz"
    procs = []
    for i in range(GPUS):
        log = open(tmp_path / f"worker{i}.log", "w")
        args = [sys.executable, str(worker), coordinator, str(GPUS), str(i), str(out), "gpu"]
        procs.append(
            subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONPATH=worker_path()),
            )
        )
        log.close()
    try:
        codes = [p.wait(timeout=WORKER_TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * GPUS:
        logs = "\n".join(
            f"--- worker {i} ---\n" + (tmp_path / f"worker{i}.log").read_text()[-6000:]
            for i in range(GPUS)
        )
        pytest.fail(f"jax.distributed workers: exit codes {codes}\n{logs}")
    results = load(str(out))
    model, x, dy = make(MULTIPROCESS_CASE)
    for ep in (2, 1):
        prefix = f"{MULTIPROCESS_CASE}/ep{ep}/"
        got = {k.removeprefix(prefix): v for k, v in results.items() if k.startswith(prefix)}
        step, params = compiled_step(model, mesh_for(ep))
        assert_same_outputs(got, outputs(step(params, *tokens_on(mesh_for(ep), x, dy))))
        if ep == 2:  # control: a changed token of rank 1 changes y in rank 1's rows alone
            changed = x.at[-1, 0, 0].add(jnp.bfloat16(1.0))
            y = outputs(step(params, *tokens_on(mesh_for(ep), changed, dy)))["['y']"]
            assert_bitwise(got["['y']"][0], y[0])
            assert differs(got["['y']"][1], y[1])


# ------------------------------------------------------------------- one rank on one GPU
ONE_RANK_CASES = ["qwen3_30b-bf16", "qwen3_30b-mxfp8_wire"]


def one_rank(case: str, transport: str) -> dict[str, np.ndarray]:
    """The training step of `case` over a one-device (1, 1) mesh of this process's first GPU,
    with rank 0's tokens: the exchange with itself as its only peer."""
    model, x, dy = make(case)
    mesh = jax.make_mesh((1, 1), ("data", "ep"), devices=jax.devices()[:1])
    step, params = compiled_step(model, mesh, transport)
    return outputs(step(params, *tokens_on(mesh, x[:1], dy[:1])))


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_one_rank_ragged_transport_gives_the_dense_bits(case):
    """On one GPU, a one-rank mesh: `jax.lax.ragged_all_to_all` (the "ragged" transport's
    pieces, on XLA:GPU) moves the rows where the dense all-to-all and its gathers put them: the
    step's outputs are bitwise the dense transport's."""
    assert_same_outputs(one_rank(case, "ragged"), one_rank(case, "dense"))


def single_gpu(case: str, mesh_alignment: bool = True) -> dict[str, np.ndarray]:
    """The same step as `one_rank` on the plain layer (`MoE.__call__`), aux with a leading axis
    of one rank; its expert buffer aligned as over a mesh (`expert_parallel_row_alignment`: an
    expert's weight-gradient reduction order depends on where its rows start) unless
    `mesh_alignment` is False."""
    model, x, dy = make(case)
    if mesh_alignment:
        model.row_alignment = expert_parallel_row_alignment(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x, dy):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(F32) * dy) + aux.total_loss, (y, aux)

    step = jax.jit(jax.grad(loss, argnums=(1, 0), has_aux=True))
    (d_x, d_params), (y, aux) = step(params, x[:1], dy[:1])
    return outputs(((d_x, d_params), (y, jax.tree.map(lambda a: a[None], aux))))


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_one_rank_is_the_single_gpu_layer(case):
    """On one GPU, the expert-parallel step over a one-rank mesh (the exchange plan, the token
    sends and row returns with itself as the only peer, the live-row kernels over the
    receiver's buffer, the (expert, source) groups and the gradients' ordered sums, on the
    kernels users get) gives, bitwise, the single-GPU layer's y, aux, d x and every parameter
    gradient. Control (bf16, whose plain layer aligns expert rows to 1, not 32): the plain
    layer at its own alignment has the same y but other expert-gradient bits."""
    got = one_rank(case, "dense")
    assert_same_outputs(got, single_gpu(case))
    if CASES[case][1].get("expert_row_alignment") is None:
        unaligned = single_gpu(case, mesh_alignment=False)
        assert_bitwise(unaligned["['y']"], got["['y']"])
        key = "['d_params']['experts']['fc1_kernel'].value"
        assert differs(unaligned[key], got[key])
