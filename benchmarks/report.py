"""What the benchmark scripts share in their input and output: the variants of a config given
on the command line (`parse_variants`), progress lines (`log`), one-line failure descriptions
(`error_text`) and the environment block of their JSON (`environment`, with the git commit)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time

import flax
import jax

_START = time.perf_counter()


def parse_variants(text: str) -> dict[str, dict]:
    """ "name:field=value,...;..." -> {name: {field: value}} (ints where they parse), for
    `dataclasses.replace` of a kernel config."""
    variants = {}
    for item in filter(None, text.split(";")):
        name, _, fields = item.partition(":")
        pairs = (f.split("=") for f in filter(None, fields.split(",")))
        variants[name] = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}
    return variants


def log(message: str) -> None:
    """A progress line with the wall time and the seconds since the start (flushed)."""
    print(
        f"[{datetime.datetime.now():%H:%M:%S} +{time.perf_counter() - _START:6.1f}s] {message}",
        flush=True,
    )


def error_text(e: BaseException) -> str:
    """A one-line description of a failure, for the records."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def environment(benchmark: str, **extra) -> dict:
    """The benchmark's name, date, device and versions, plus `extra` fields."""
    device = jax.devices()[0]
    return dict(
        benchmark=benchmark,
        date=datetime.date.today().isoformat(),
        time=datetime.datetime.now().isoformat(timespec="seconds"),
        device=device.device_kind,
        platform=device.platform,
        jax=jax.__version__,
        flax=flax.__version__,
        python=platform.python_version(),
        git_commit=git_commit(),
        **extra,
    )


def git_commit() -> str | None:
    """JAXMOE_GIT_COMMIT when set (a copy of the tree whose .git lags behind it), else HEAD."""
    if os.environ.get("JAXMOE_GIT_COMMIT"):
        return os.environ["JAXMOE_GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def add_output_arguments(parser, tag: bool = True) -> None:
    """The options of where a benchmark writes its JSON: --out (the folder, default
    benchmarks/results) and, with `tag`, --tag (added to the file name)."""
    if tag:
        parser.add_argument("--tag", default="", help="added to the result file name")
    parser.add_argument("--out", default=RESULTS_DIR, help="the folder of the result files")


def result_path(out_dir: str, benchmark: str, tag: str = "") -> str:
    """out_dir/<benchmark>_<date>[_<tag>].json (out_dir created)."""
    os.makedirs(out_dir, exist_ok=True)
    suffix = f"_{tag}" if tag else ""
    return os.path.join(out_dir, f"{benchmark}_{datetime.date.today().isoformat()}{suffix}.json")


def write_result(result: dict, path: str) -> None:
    """The result as indented JSON at path."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
