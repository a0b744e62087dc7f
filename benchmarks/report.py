"""What the benchmark scripts share in their output: progress lines (`log`), one-line failure
descriptions (`error_text`) and the environment block of their JSON (`environment`)."""

from __future__ import annotations

import datetime
import platform
import time

import flax
import jax

_START = time.perf_counter()


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
        **extra,
    )
