"""The layer over a mesh of two processes (`jax.distributed`, 4 host devices each, cross-process
collectives by gloo; tests/support/ep_worker.py is each process's script): y, the auxiliary losses, d x
and every parameter gradient have the bits of this process's 8 devices at ep = 1, bf16 and
MXFP8 on the wire, for meshes whose all-to-all and gather cross the processes, x a global array
from each process's rows, the parameters host-local or split over the processes. Control: a
changed token of process 1 changes the bits."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from ep_worker import RUNS, flat, free_port, load, worker_path
from test_expert_parallel import BATCH, CONFIGS, make, mesh_for, step

from bitwise import assert_bitwise, differs

PROCESSES, DEVICES_EACH, TIMEOUT_S = 2, 4, 240


def run_workers(out: Path, logs: Path, suite: str = "cpu") -> None:
    """Runs tests/support/ep_worker.py's `suite` as `PROCESSES` processes of one jax.distributed
    job; fails the test with their output if one fails or they take over TIMEOUT_S (then all are
    killed)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={DEVICES_EACH}"]),
        PYTHONPATH=worker_path(),
    )
    worker = Path(__file__).parents[1] / "support" / "ep_worker.py"
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(PROCESSES):
        log = open(logs / f"worker{i}.log", "w")
        args = [sys.executable, str(worker), coordinator, str(PROCESSES), str(i), str(out), suite]
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    deadline, killed = time.monotonic() + TIMEOUT_S, set()
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:  # the others wait for a failed worker until jax.distributed gives up: end them
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                killed.add(i)
    codes = [p.returncode for p in procs]
    if codes != [0] * PROCESSES:
        why = f"timed out after {TIMEOUT_S} s" if time.monotonic() >= deadline else "failed"
        report = "\n".join(
            f"--- worker {i}: {'killed' if i in killed else f'exit {c}'} ---\n"
            + _tail((logs / f"worker{i}.log").read_text())
            for i, c in enumerate(codes)
        )
        pytest.fail(f"jax.distributed workers {why}:\n{report}")


def _tail(text: str, lines: int = 60) -> str:
    kept = [line for line in text.splitlines() if not line.startswith("[Gloo]")]
    return "\n".join(kept[-lines:])


def of(results, precision, mesh) -> dict[str, np.ndarray]:
    """One run's entries of the workers' results, by key path."""
    prefix = f"{precision}/{mesh}/"
    return {k.removeprefix(prefix): v for k, v in results.items() if k.startswith(prefix)}


def one_process(precision, x=None) -> dict[str, np.ndarray]:
    """This process's (y, aux, d x, d params) at ep = 1 over its 8 host devices."""
    model, x0, cotangent = make(CONFIGS[precision])
    return flat(step(model, x0 if x is None else x, cotangent, mesh_for(1)))


def test_two_processes_give_the_bits_of_one(tmp_path):
    """One test (one launch of the workers, also under pytest-xdist)."""
    run_workers(tmp_path / "results.npz", tmp_path)
    results = load(str(tmp_path / "results.npz"))
    assert set(RUNS) == set(CONFIGS)
    for precision, meshes in RUNS.items():
        want = one_process(precision)
        for mesh in meshes:
            got = of(results, precision, mesh)
            assert sorted(got) == sorted(want), (precision, mesh)
            for key in want:
                assert_bitwise(got[key], want[key])
    # Negative control: with one token of the last rank (process 1's) changed in the
    # reference, y differs in that rank's rows alone, and d x and every parameter gradient
    # differ.
    _, x, _ = make(CONFIGS["bf16"])
    want = one_process("bf16", x.at[-1, 0, 0].add(jnp.bfloat16(1.0)))
    for mesh in RUNS["bf16"]:
        got = of(results, "bf16", mesh)
        assert_bitwise(got["[0]"][: BATCH - 1], want["[0]"][: BATCH - 1])
        assert differs(got["[0]"][-1], want["[0]"][-1])
        for key in want:
            if key == "[2]" or key.startswith("[3]"):
                assert differs(got[key], want[key]), (mesh, key)
