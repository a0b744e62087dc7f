"""Sustained and burst throughput of the fp8 grouped matmuls on one power-capped GPU, with the
SM clock and board power each one runs at.

    python -m benchmarks.research.gmm_power [--shapes mixtral,dsv3_ep8] [--ops fwd,dgrad] [--seconds 4]
        [--rounds 2] [--variants "name:field=value,...;..."] [--impls REGEX] [--tag TAG]
        [--out DIR]

An H100 or H200 SXM board holds its power at a cap (700 W) by lowering the SM clock, so a GEMM
that spends more energy per flop runs at a lower clock once the board is at the cap, however
fast it is at full clock. For each shape and op, on the operands of `benchmarks/research/gmm_mxfp8.py`
(same sizes, data and 128-aligned Dirichlet groups), each implementation
  jaxmoe_fp8_blockwise     `ops.gmm` on BlockwiseTensors (1 x 128 x 128 x 128 blocks)
  torch_scaled_grouped_mm  torch's grouped fp8 matmul with rowwise scales
  jaxmoe_bf16              `ops.gmm` on the bf16 operands
  jaxmoe_fp8_blockwise_<name>  the FP8-blockwise kernel under its heuristic tiling with the
                           `GmmConfig` fields of --variants replaced (a tiling that moves fewer
                           bytes may spend less energy a flop, which only the sustained run shows)
(--impls: only those whose names match the regular expression) runs alone, calls back to back
for --seconds ("sustained": the board at its cap), while nvidia-smi samples the SM clock, board
power and temperature every 50 ms; then in bursts of 5 calls after 1 s idle ("burst": mostly
before the clock comes down). The implementations take turns, --rounds times. Writes
gmm_power_<date>[_TAG].json: per round and implementation the seconds per call and TFLOP/s of
both modes and the medians of the samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.gmm import SHAPES
from benchmarks.research.gmm_fp8_blockwise_tiling import replaced_tiling
from benchmarks.research.gmm_mxfp8 import aligned_sizes, torch_rowwise_fp8
from jaxmoe.fp8_blockwise import quantize_1x128, quantize_128x128
from jaxmoe.ops import gmm
from jaxmoe.ops.fp8_blockwise_gmm import quantize_blockwise_weights
from jaxmoe.ops.pallas.gmm_mxfp8_hopper import default_fp8_blockwise_config

BF16 = jnp.bfloat16
SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
SAMPLE_NAMES = ("sm_clock_mhz", "power_w", "temperature_c")
BURST_CALLS, BURST_IDLE_S, BURST_ROUNDS = 5, 1.0, 3


def parse_sample(line: str) -> tuple[float, ...]:
    """One nvidia-smi CSV line of SMI_FIELDS (noheader, nounits) as floats."""
    values = [v.strip() for v in line.strip().split(",")]
    if len(values) != len(SMI_FIELDS):
        raise ValueError(f"gmm_power: expected {len(SMI_FIELDS)} values, got {line!r}")
    return tuple(float(v) for v in values)


def sample_medians(samples: list[tuple[float, ...]]) -> dict:
    """The median of each sampled field, the first two samples left out where there are more
    than four (the clock settles after the load starts)."""
    if not samples:
        raise ValueError("gmm_power: nvidia-smi gave no samples")
    kept = samples[2:] if len(samples) > 4 else samples
    return {name: statistics.median(s[i] for s in kept) for i, name in enumerate(SAMPLE_NAMES)} | {
        "samples": len(kept)
    }


class Sampler:
    """nvidia-smi sampled on a thread while a `with` block runs; `.samples` afterwards."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        query = [
            "nvidia-smi",
            f"--query-gpu={','.join(SMI_FIELDS)}",
            "--format=csv,noheader,nounits",
        ]
        while not self._stop.is_set():
            out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
            self.samples.append(parse_sample(out.splitlines()[0]))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()


def sustained(call, sync, seconds: float) -> tuple[float, dict]:
    """(seconds per call, sample medians) of calls back to back for `seconds`."""
    call()
    sync()
    with Sampler() as sampler:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(BURST_CALLS):
                call()
            calls += BURST_CALLS
            sync()
        elapsed = time.perf_counter() - start
    return elapsed / calls, sample_medians(sampler.samples)


def burst(call, sync) -> float:
    """Median seconds per call of BURST_ROUNDS bursts of BURST_CALLS calls, each after
    BURST_IDLE_S of idling."""
    times = []
    for _ in range(BURST_ROUNDS):
        time.sleep(BURST_IDLE_S)
        start = time.perf_counter()
        for _ in range(BURST_CALLS):
            call()
        sync()
        times.append((time.perf_counter() - start) / BURST_CALLS)
    return statistics.median(times)


def variant_configs(name: str, op: str, variants: dict) -> dict:
    """{variant: GmmConfig}: the FP8-blockwise kernel's heuristic at shape `name` and op ("fwd":
    contraction K, N outputs; "dgrad": the reverse) with each variant's fields replaced;
    ValueError for a field GmmConfig does not have or another op."""
    if op not in ("fwd", "dgrad"):
        raise ValueError(f"gmm_power: unknown op {op!r} (fwd or dgrad)")
    m, k, n, g = SHAPES[name]
    contraction, out_n = (k, n) if op == "fwd" else (n, k)
    heuristic = default_fp8_blockwise_config(m, contraction, out_n, g, BF16)
    configs = {}
    for variant, fields in variants.items():
        unknown = set(fields) - {f.name for f in dataclasses.fields(heuristic)}
        if unknown:
            raise ValueError(f"gmm_power: --variants {variant}: no GmmConfig field {unknown}")
        configs[variant] = replaced_tiling(heuristic, contraction, fields)
    return configs


def implementations(name: str, op: str, torch, variants: dict | None = None):
    """(flops, {impl: (call, sync)}) of one op ("fwd" or "dgrad") at shape `name`, with the
    FP8-blockwise kernel under each tiling variant too (`variant_configs`)."""
    m, k, n, g = SHAPES[name]
    sizes = aligned_sizes(m, g)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), BF16)
    w = (jax.random.normal(kw, (g, k, n), BF16) * 0.02).astype(BF16)
    dy = jax.random.normal(kd, (m, n), BF16)
    gs = jnp.asarray(sizes)
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    blockwise = jax.jit(
        functools.partial(gmm, impl="pallas", preferred_element_type=BF16),
        static_argnames=("transpose_rhs", "config"),
    )
    bf16 = jax.jit(
        functools.partial(gmm, impl="pallas", preferred_element_type=BF16),
        static_argnames="transpose_rhs",
    )
    tw = torch.from_dlpack(w)
    if op == "fwd":
        x_b, w_bt = quantize_1x128(x), quantize_blockwise_weights(w).transposed
        t_lhs, t_scale = torch_rowwise_fp8(torch, torch.from_dlpack(x), 1)
        t_rhs, t_rhs_scale = torch_rowwise_fp8(torch, tw.transpose(-2, -1).contiguous(), 2)
        lhs, rhs = x_b, w_bt
        jax_calls = {"jaxmoe_bf16": lambda: bf16(x, w, gs)}
    elif op == "dgrad":
        dy_b, w_b = quantize_1x128(dy), quantize_128x128(w)
        t_lhs, t_scale = torch_rowwise_fp8(torch, torch.from_dlpack(dy), 1)
        t_rhs, t_rhs_scale = torch_rowwise_fp8(torch, tw, 2)
        lhs, rhs = dy_b, w_b
        jax_calls = {"jaxmoe_bf16": lambda: bf16(dy, w, gs, transpose_rhs=True)}
    else:
        raise ValueError(f"gmm_power: unknown op {op!r} (fwd or dgrad)")
    tilings = {"": None} | {
        f"_{v}": c for v, c in variant_configs(name, op, variants or {}).items()
    }
    fp8_calls = {
        f"jaxmoe_fp8_blockwise{suffix}": functools.partial(
            blockwise, lhs, rhs, gs, transpose_rhs=True, config=config
        )
        for suffix, config in tilings.items()
    }
    last = {}

    def jax_call(fn):
        def call():
            last["out"] = fn()

        return call

    def jax_sync():
        jax.block_until_ready(last["out"])

    impls = {impl: (jax_call(fn), jax_sync) for impl, fn in fp8_calls.items()}
    impls |= {
        "torch_scaled_grouped_mm": (
            lambda: torch._scaled_grouped_mm(
                t_lhs,
                t_rhs.transpose(-2, -1),
                t_scale,
                t_rhs_scale,
                offs=offs,
                out_dtype=torch.bfloat16,
            ),
            torch.cuda.synchronize,
        ),
        "jaxmoe_bf16": (jax_call(jax_calls["jaxmoe_bf16"]), jax_sync),
    }
    return 2.0 * float(sizes.sum()) * k * n, impls


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,dsv3_ep8")
    parser.add_argument("--ops", default="fwd,dgrad")
    parser.add_argument("--seconds", type=float, default=4.0, help="each sustained run")
    parser.add_argument("--rounds", type=int, default=2, help="turns of the implementations")
    parser.add_argument(
        "--variants",
        default="",
        help='FP8-blockwise tilings "name:field=value,...;..." (GmmConfig fields) run too',
    )
    parser.add_argument("--impls", default="", help="only the implementations matching this")
    report.add_output_arguments(parser)
    args = parser.parse_args(argv)
    variants = report.parse_variants(args.variants)
    for name in filter(None, args.shapes.split(",")):
        for op in filter(None, args.ops.split(",")):
            try:
                variant_configs(name, op, variants)
            except (KeyError, ValueError) as e:
                parser.error(f"{name} {op}: {report.error_text(e)}")
    if jax.devices()[0].platform != "gpu":
        parser.error("gmm_power measures a GPU's clock and power: run it on an NVIDIA GPU")
    import torch

    result = report.environment(
        "gmm_power", command=" ".join(sys.argv if argv is None else argv), records=[]
    )
    path = report.result_path(args.out, "gmm_power", args.tag)
    for name in filter(None, args.shapes.split(",")):
        for op in filter(None, args.ops.split(",")):
            flops, impls = implementations(name, op, torch, variants)
            impls = {i: c for i, c in impls.items() if re.search(args.impls, i)}
            for turn in range(args.rounds):
                for impl, (call, sync) in impls.items():
                    per_call, medians = sustained(call, sync, args.seconds)
                    per_burst = burst(call, sync)
                    record = dict(
                        shape=name,
                        op=op,
                        round=turn,
                        impl=impl,
                        sustained_ms=per_call * 1e3,
                        sustained_tflops=flops / per_call / 1e12,
                        burst_ms=per_burst * 1e3,
                        burst_tflops=flops / per_burst / 1e12,
                        **medians,
                    )
                    result["records"].append(record)
                    report.log(
                        f"{name:9s} {op:6s} {impl:32s} sustained {record['sustained_tflops']:7.1f}"
                        f" TFLOP/s at {medians['sm_clock_mhz']:6.0f} MHz {medians['power_w']:5.0f}"
                        f" W, burst {record['burst_tflops']:7.1f}"
                    )
            report.write_result(result, path)
    result["path"] = path
    return result


if __name__ == "__main__":
    main()
