"""Shared pytest set-up.

* Tests marked `gpu` need a Hopper GPU and are skipped elsewhere, except the layer suite
  (tests/test_gpu_layer.py) when `--layer-shapes tiny` runs it on CPU (the kernels in the
  interpreter) to check the suite itself.
* The `interpret` fixture runs Pallas Mosaic GPU kernels on CPU, each call race-checked; tests
  that use it are marked `slow` (`make test-quick` leaves them out).
* Eight host devices (`--xla_force_host_platform_device_count=8`) for meshes on CPU.
* `--results-json PATH` writes every test's outcome, duration and recorded properties
  (`record_property`) with the device and versions to PATH: the GPU suite's record
  (`make test-gpu`).
"""

import datetime
import json
import os
import platform
import subprocess

# Eight host (CPU) devices for the expert-parallel tests' meshes; everything else runs on the
# first. XLA reads the flag when JAX starts, so it is set before JAX is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxmoe.ops import on_hopper  # noqa: E402

from interpreter import race_checked_interpreter  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--results-json",
        default=None,
        help="write test outcomes, durations and recorded properties to this JSON",
    )
    parser.addoption(
        "--layer-shapes",
        default="mixtral,qwen3_30b,dsv3_ep8,deepseek_v3_style",
        help="tests/test_gpu_layer.py: comma-separated jaxmoe.shapes names, or "
        "'tiny' (a small layer, runnable on CPU with the kernels interpreted)",
    )
    parser.addoption(
        "--layer-precisions",
        default="bf16,mxfp8",
        help="tests/test_gpu_layer.py: comma-separated precisions (bf16, mxfp8, fp8_blockwise)",
    )


@pytest.fixture
def interpret():
    """Run Mosaic GPU kernels in the CPU interpreter with the race detector, every kernel call
    of the test checked (tests/interpreter.py); a no-op on a GPU."""
    if on_hopper():
        yield
        return
    with race_checked_interpreter():
        yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "interpret" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if on_hopper():
        return
    tiny_layer_suite = config.getoption("--layer-shapes") == "tiny"
    reason = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords and not (
            tiny_layer_suite and item.module.__name__ == "test_gpu_layer"
        ):
            item.add_marker(reason)


class ResultsRecorder:
    """Collects each test's outcome and writes them with the device and versions as JSON, after
    every test (a run cut by a time limit keeps what finished)."""

    def __init__(self, path: str, command: str):
        self.path, self.command, self.results = path, command, []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.results.append(
                dict(
                    test=report.nodeid,
                    outcome=report.outcome,
                    seconds=round(report.duration, 3),
                    properties=dict(report.user_properties),
                    failure=str(report.longrepr)[-4000:] if report.failed else None,
                )
            )
            self.write()

    def write(self):
        outcomes = [r["outcome"] for r in self.results]
        device = jax.devices()[0]
        record = dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=self.command,
            device=getattr(device, "device_kind", device.platform),
            platform=platform.platform(),
            jax=jax.__version__,
            git_commit=_git_commit(),
            summary={o: outcomes.count(o) for o in ("passed", "failed", "skipped")},
            tests=self.results,
        )
        with open(self.path, "w") as f:
            json.dump(record, f, indent=1, default=str)

    def pytest_sessionfinish(self, session):
        self.write()


def pytest_configure(config):
    path = config.getoption("--results-json")
    if path:
        command = "python -m pytest " + " ".join(config.invocation_params.args)
        config.pluginmanager.register(ResultsRecorder(path, command), "jaxmoe-results-json")


def _git_commit() -> str | None:
    """JAXMOE_GIT_COMMIT when set (a copy of the tree whose .git lags behind it), else HEAD."""
    if os.environ.get("JAXMOE_GIT_COMMIT"):
        return os.environ["JAXMOE_GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
