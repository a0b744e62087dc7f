"""Timing on one device, shared by the benchmarks: medians of back-to-back calls with the
implementations taking turns (`timed_runs`), device time from the JAX profiler's GPU stream
records (`device_seconds`), those records themselves (`profile_events`), and the device's
memory bandwidth (`memory_bandwidths`).

A timed fn returns JAX arrays, torch tensors or a pytree of them; `sync` waits for all of them.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp


def time_it(fn, *, iters: int, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` runs of `iters` back-to-back calls."""
    return time_round_robin([fn], iters=iters, repeats=repeats)[0]


def time_round_robin(fns, *, iters: int, repeats: int = 5, min_window: float = 0.2) -> list[float]:
    """Median seconds per call of each fn over the `timed_runs`."""
    return [
        statistics.median(times)
        for times in timed_runs(fns, iters=iters, repeats=repeats, min_window=min_window)
    ]


def timed_runs(fns, *, iters: int, repeats: int = 5, min_window: float = 0.2) -> list[list[float]]:
    """Seconds per call of each fn in each of `repeats` timed runs of back-to-back calls (at
    least `iters` calls and `min_window` seconds each), the fns taking turns within each repeat.
    The H200 runs these kernels at its power limit, where the clock depends on the recent load,
    so each timed run follows as many untimed calls of the same fn (its own steady state, not
    the previous fn's), and the turns spread slower drifts over all fns alike."""
    counts = []
    for fn in fns:
        sync(fn())
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        per_call = (time.perf_counter() - start) / iters
        counts.append(max(iters, math.ceil(min_window / per_call)))
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, calls, times in zip(fns, counts, samples):
            for _ in range(calls):
                out = fn()
            sync(out)
            start = time.perf_counter()
            for _ in range(calls):
                out = fn()
            sync(out)
            times.append((time.perf_counter() - start) / calls)
    return samples


def device_seconds(fn, *, calls: int = 1, iters: int = 10) -> float:
    """Device seconds per op call: the summed durations of the work that `iters` back-to-back
    runs of fn put on the GPU (fn makes `calls` calls of the op), divided by iters * calls.
    For ops shorter than the host's dispatch of them, which a host clock would time instead.
    JAX results: the GPU stream records of the JAX profiler; torch: CUDA events around the
    runs."""
    out = fn()
    sync(out)
    if _is_torch_tensor(out):
        import torch

        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(iters):
            out = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (iters * calls)
    busy_us = sum(e.dur_us for e in gpu_stream_events(profile_events(fn, runs=iters)))
    if not busy_us:
        raise RuntimeError("device_seconds: the profile holds no GPU stream records")
    return busy_us / 1e6 / (iters * calls)


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One complete event of a profile: where it ran (process "/device:GPU:0" or "/host:CPU",
    thread "Stream #14(Kernel)" or a host thread), its name (a kernel, an XLA op), start and
    duration in microseconds, and its arguments (the profiler's stats: hlo_op, hlo_module...)."""

    process: str
    thread: str
    name: str
    start_us: float
    dur_us: float
    args: dict


def profile_events(fn, *, runs: int) -> list[TraceEvent]:
    """The complete events of a JAX profile of `runs` back-to-back calls of fn (synchronised at
    the end; fn should have run before, so that no compilation is traced)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=options):
            for _ in range(runs):
                out = fn()
            sync(out)
        return read_trace_events(trace_dir)


def read_trace_events(trace_dir: str) -> list[TraceEvent]:
    """The complete ("X") events of the trace viewer JSON (`*trace.json.gz`) that
    `jax.profiler.trace` wrote under trace_dir, with process and thread names resolved."""
    [path] = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data

    def names(kind, key):
        return {
            key(e): e["args"]["name"]
            for e in events
            if e.get("ph") == "M" and e.get("name") == kind
        }

    process = names("process_name", lambda e: e["pid"])
    thread = names("thread_name", lambda e: (e["pid"], e.get("tid")))
    return [
        TraceEvent(
            process=process.get(e["pid"], ""),
            thread=thread.get((e["pid"], e.get("tid")), ""),
            name=e.get("name", ""),
            start_us=float(e.get("ts", 0.0)),
            dur_us=float(e.get("dur", 0.0)),
            args=e.get("args", {}),
        )
        for e in events
        if e.get("ph") == "X"
    ]


def gpu_stream_events(events: list[TraceEvent]) -> list[TraceEvent]:
    """The events that ran on a GPU stream (kernels, copies, memsets)."""
    return [
        e for e in events if e.process.startswith("/device:GPU") and e.thread.startswith("Stream")
    ]


def sync(out):
    """`out` (a pytree), once the JAX arrays and CUDA torch tensors in it are computed."""
    leaves = jax.tree.leaves(out)
    if any(_is_torch_tensor(leaf) and leaf.is_cuda for leaf in leaves):
        import torch

        torch.cuda.synchronize()
    jax.block_until_ready([leaf for leaf in leaves if isinstance(leaf, jax.Array)])
    return out


def _is_torch_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def memory_bandwidths(repeats: int, min_window: float, num_bytes: int = 1 << 30) -> dict:
    """Bytes/s of a device-to-device copy of `num_bytes` ("copy": read + written bytes /
    seconds; XLA's copy of a parameter into a new output, a memcpy on a GPU) and of reading them
    once ("read": an fp32 sum, one scalar written), timed as `timed_runs`. (Until 2026-12-06 the
    copy was an elementwise kernel, `a * 2`: 3.2 TB/s on the H200, where a memcpy reaches about
    4.3.)"""
    source = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: jnp.copy(a))  # one read and one write of every element
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    times = timed_runs(
        [lambda: copy(source), lambda: read(source)],
        iters=3,
        repeats=repeats,
        min_window=min_window,
    )
    copy_s, read_s = (statistics.median(t) for t in times)
    return dict(copy=2 * num_bytes / copy_s, read=num_bytes / read_s)
