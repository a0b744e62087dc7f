"""One process of tests/parallel/test_expert_parallel_multiprocess.py (a helper, not a test module).

    python tests/support/ep_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npz [cpu|gpu|lm]

Joins `jax.distributed` and runs the layer's training step with `expert_parallel_forward` over
meshes of all processes' devices; process 0 writes y, the auxiliary losses, d x and every
parameter gradient, gathered to the host, to OUT.npz (`save`; read back with `load`).
  cpu (default)  each process with the host devices that XLA_FLAGS gives it; the layer and
                 loss of tests/parallel/test_expert_parallel.py (`make`, `step`); entries
                 "<precision>/<mesh>/<key path>"
  gpu            one GPU per process (process i takes local GPU i); the layer of
                 tests/gpu/test_gpu_expert_parallel.py's `MULTIPROCESS_CASE` at ep = 2 and 1;
                 entries "<case>/ep<degree>/<key path>"
  lm             the language model's training run of tests/parallel/test_lm_mesh.py over
                 tests/parallel/test_lm_mesh_multiprocess.py's `MULTIPROCESS_MESH` of all
                 processes' host devices; entries "losses", "params<key path>", "rest<key path>"
"""

import os
import socket
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def meshes() -> dict[str, Mesh]:
    """("data", "ep") meshes of 8 devices whose collectives cross the processes. Devices in
    process order (process p holds the p-th half): at 1x8 the experts' all-to-all spans both
    processes; 4x2 pairs a device of each process on "ep", so the all-to-all and the
    gradients' gather over "data" both do."""
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    interleaved = devices.reshape(jax.process_count(), -1).T.reshape(-1)

    def mesh(order, shape):
        return Mesh(order.reshape(shape), ("data", "ep"), axis_types=(AxisType.Explicit,) * 2)

    return {
        "1x8": mesh(devices, (1, 8)),
        "4x2": mesh(interleaved, (4, 2)),
    }


def placed(model, mesh: Mesh):
    """`model` with its parameters as global arrays: the routed experts' split over "ep", the
    others replicated (each process holds only its devices' shards)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def put(path, p):
        spec = P("ep") if path[0].key == "experts" else P()
        return jax.device_put(p, NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(put, params), rest)


def global_tokens(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """x [B, ...] as a global array split over the mesh like `expert_parallel_forward`'s tokens,
    each process giving only the rows of its own devices, in batch order (sliced here from the
    same full x; a real job would load only its own)."""
    tokens = NamedSharding(mesh, P(mesh.axis_names))
    index = tokens.addressable_devices_indices_map(x.shape).values()
    rows = sorted({i for block in index for i in range(*block[0].indices(len(x)))})
    global_x = jax.make_array_from_process_local_data(tokens, x[rows], x.shape)
    assert not global_x.is_fully_addressable
    return global_x


def flat(tree) -> dict[str, np.ndarray]:
    """{key path: host array} of a tree of arrays, e.g. `step`'s (y, aux, d x, d params)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def save(path: str, arrays: dict[str, np.ndarray]):
    """An .npz of the arrays' bits (unsigned integers) and dtype names (bf16 survives)."""
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    entries = {}
    for key, a in arrays.items():
        entries[key] = a.view(uint[a.dtype.itemsize])
        entries[f"dtype:{key}"] = np.array(a.dtype.name)
    np.savez(path, **entries)


def load(path: str) -> dict[str, np.ndarray]:
    """`save`'s arrays."""
    with np.load(path) as entries:
        return {
            key: entries[key].view(jnp.dtype(str(entries[f"dtype:{key}"])))
            for key in entries.files
            if not key.startswith("dtype:")
        }


TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_path() -> str:
    """PYTHONPATH for a worker process: this folder and the test folders whose modules it
    imports (tests/parallel, tests/gpu)."""
    return os.pathsep.join(os.path.join(TESTS, d) for d in ("support", "parallel", "gpu"))


def free_port() -> int:
    """A free TCP port on the loopback address, for the jax.distributed coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The meshes each precision runs on (each run is a compilation, the test's cost): bf16 at 1x8
# (the all-to-all spans the processes; parameters host-local) and at 4x2 with the parameters
# split over the processes ("4x2_placed": the all-to-all and the gradients' gather cross
# them); MXFP8 on the latter. (4x2 with host-local parameters combines the two; 2x4, only the
# gather crossing, is a case of 4x2.)
RUNS = {"bf16": ("1x8", "4x2_placed"), "mxfp8": ("4x2_placed",)}


def gpu_suite() -> dict[str, np.ndarray]:
    """tests/gpu/test_gpu_expert_parallel.py's multi-process case, on meshes of every process's
    GPU."""
    from test_gpu_expert_parallel import MULTIPROCESS_CASE, compiled_step, make, outputs

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    model, x, dy = make(MULTIPROCESS_CASE)
    results = {}
    for ep in (2, 1):
        mesh = jax.make_mesh((len(devices) // ep, ep), ("data", "ep"), devices=devices)
        step, params = compiled_step(model, mesh)
        got = step(params, *(global_tokens(np.asarray(a), mesh) for a in (x, dy)))
        for key, value in outputs(multihost_utils.process_allgather(got, tiled=True)).items():
            results[f"{MULTIPROCESS_CASE}/ep{ep}/{key}"] = value
        print(f"ep {ep} done", flush=True)
    return results


def cpu_suite() -> dict[str, np.ndarray]:
    """tests/parallel/test_expert_parallel.py's layer over `RUNS`' meshes of 8 host devices."""
    from test_expert_parallel import CONFIGS, make, step

    assert jax.device_count() == 8
    results = {}
    for precision, names in RUNS.items():
        model, x, cotangent = make(CONFIGS[precision])
        runs = {name: (model, mesh) for name, mesh in meshes().items()}
        runs["4x2_placed"] = (placed(model, meshes()["4x2"]), meshes()["4x2"])
        for name in names:
            layer, mesh = runs[name]
            outputs = step(layer, global_tokens(np.asarray(x), mesh), cotangent, mesh)
            on_host = multihost_utils.process_allgather(outputs, tiled=True)
            for key, value in flat(on_host).items():
                results[f"{precision}/{name}/{key}"] = value
    return results


def lm_suite() -> dict[str, np.ndarray]:
    """tests/parallel/test_lm_mesh.py's STEPS training steps over `MULTIPROCESS_MESH` (every
    process's devices): every step's loss and the final parameters and expert biases."""
    from test_lm_mesh import Run, config, training_batches, write_corpus
    from test_lm_mesh_multiprocess import MULTIPROCESS_MESH

    corpus = tempfile.mkdtemp()
    write_corpus(corpus)
    cfg = config(corpus, mesh=MULTIPROCESS_MESH)
    batches = training_batches(cfg)
    losses, _, params, rest = Run(cfg, batches[0])(batches)
    params, rest = multihost_utils.process_allgather((params, rest), tiled=True)
    results = {"losses": losses}
    for name, tree in (("params", params), ("rest", rest)):
        results.update({name + key: value for key, value in flat(tree).items()})
    return results


def main(coordinator: str, num_processes: int, process_id: int, out: str, suite: str = "cpu"):
    local = dict(local_device_ids=[process_id]) if suite == "gpu" else {}
    jax.distributed.initialize(coordinator, num_processes, process_id, **local)
    assert jax.process_count() == num_processes
    results = {"cpu": cpu_suite, "gpu": gpu_suite, "lm": lm_suite}[suite]()
    if process_id == 0:
        save(out, results)


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # not waiting at jax.distributed's shutdown barrier for the other process
