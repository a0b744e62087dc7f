"""Where the decode kernel's time goes, per warpgroup: Mosaic profiler regions on the GPU.

    python -m benchmarks.research.decode_trace [--shapes qwen3_30b,mixtral,dsv3_ep8]
        [--gemms fc1,fc2] [--tokens 64] [--small-scales] [--plain-weights] [--variant F=V,...]
        [--tag TAG] [--out DIR]

For each `jaxmoe.shapes` layer, expert GEMM (fc1 [R, H] x [E, 2F|F, H], fc2 [R, F] x [E, H, F])
and token count T (R = T * top_k rows, each token's k experts drawn at random as in
benchmarks/decode.py), the decode kernel (`gmm_decode_pallas`, default config, or with the
`DecodeConfig` fields of --variant as decode.py's --decode-sweep takes them; the weights in
`tile_weights`' layout as `mxfp8_inference` stores them; --plain-weights: [E, N, K]) runs once timed
(`kernel_us`, device time, no trace) and once with a `KernelTrace`: every warpgroup of every CTA
records the SM clock (cycles) at the edges of the kernel's regions: `item` (a compute
warpgroup's work item), `step` (its K step: dequantization and wgmmas), within the step
`wait_data` (waiting for the ring slot's TMA loads), `epilogue` (its output store), and the
memory warpgroup's `wait_free` (waiting for both compute warpgroups to release a ring slot: the
ring is full, so the loads wait on the math). Per role (`compute`: the two compute warpgroups,
`memory`: the TMA warpgroup), the mean over warpgroups of: `span` (first region entered to last
left), per region `n_*` and `sum_*` (count and summed cycles), `step_gaps` (cycles between a
step's end and the next step's start: an item boundary), `step_median`, the shares of the
span, and among the busy warpgroups (those with steps or waits) the spans' percentiles
(`busy_spans`: 0, 10, 50, 90, 100) and their mean over the longest (`busy_mean_over_max`: what a
perfect balance could win, the kernel's time being the longest span). `cycles_per_us` = the
longest span over `kernel_us` (the SM clock, roughly).
The traced call's output is checked bitwise against the untraced one (`same_bits`). Writes
decode_trace_<date>[_tag].json to --out. GPU only. --small-scales: the kernel's integer
dequantization (`gmm_decode_pallas(small_scales=True)`; the weights' scale bytes are 120-133).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.decode import parse_variant
from benchmarks.report import add_output_arguments, error_text, log
from benchmarks.timing import device_seconds
from jaxmoe.ops.pallas.gmm_common import NUM_COMPUTE_WGS
from jaxmoe.ops.pallas.gmm_decode_hopper import (
    default_decode_config,
    gmm_decode_pallas,
    tile_weights,
)
from jaxmoe.ops.pallas.regions import KernelTrace
from jaxmoe.shapes import SHAPES

BF16 = jnp.bfloat16
WARPGROUPS = NUM_COMPUTE_WGS + 1  # the memory warpgroup last


def regions_by_warpgroup(events: list[dict]) -> dict[int, list[tuple[str, float, float]]]:
    """Chrome-trace begin/end events -> {trace id: [(name, enter, leave), ...] by enter}, times
    in cycles (Mosaic's dump writes cycles / 1000 as `ts`)."""
    open_regions: dict[int, list] = collections.defaultdict(list)
    closed: dict[int, list] = collections.defaultdict(list)
    for event in events:
        tid, cycle = event["tid"], event["ts"] * 1e3
        if event["ph"] == "B":
            open_regions[tid].append((event["name"], cycle))
        else:
            name, enter = open_regions[tid].pop()
            closed[tid].append((name, enter, cycle))
    return {tid: sorted(regions, key=lambda r: r[1]) for tid, regions in closed.items()}


def warpgroup_summary(regions: list[tuple[str, float, float]]) -> dict:
    """One warpgroup's regions -> span, per-region counts and cycles, gaps between steps."""
    first = min(enter for _, enter, _ in regions)
    span = max(leave for _, _, leave in regions) - first
    out = {"span": span}
    for name, _, _ in regions:
        out.setdefault(f"n_{name}", 0)
        out.setdefault(f"sum_{name}", 0.0)
    for name, enter, leave in regions:
        out[f"n_{name}"] += 1
        out[f"sum_{name}"] += leave - enter
    steps = [(enter, leave) for name, enter, leave in regions if name == "step"]
    if steps:
        gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
        out["step_gaps"] = sum(gaps)
        out["step_median"] = statistics.median(leave - enter for enter, leave in steps)
        out["first_step"] = steps[0][0] - first
    return out


def trace_summary(events: list[dict], warpgroups: int = WARPGROUPS) -> dict:
    """Per role ("compute": every warpgroup but the last of a CTA, "memory": the last), the
    mean of `warpgroup_summary` over the warpgroups, the shares of the span of the summed
    regions and gaps, and the longest span (`max_span`)."""
    roles = collections.defaultdict(list)
    for tid, regions in regions_by_warpgroup(events).items():
        role = "memory" if (tid - 1) % warpgroups == warpgroups - 1 else "compute"
        roles[role].append(warpgroup_summary(regions))
    out = {}
    for role, summaries in roles.items():
        keys = sorted({k for s in summaries for k in s})
        mean = {k: statistics.mean(s.get(k, 0) for s in summaries) for k in keys}
        mean.update(
            {
                f"share_{k[4:] if k.startswith('sum_') else k}": mean[k] / mean["span"]
                for k in keys
                if k.startswith("sum_") or k == "step_gaps"
            }
        )
        mean["max_span"] = max(s["span"] for s in summaries)
        mean["warpgroups"] = len(summaries)
        busy = sorted(s["span"] for s in summaries if s.get("n_step", 0) or s.get("n_wait_free", 0))
        if busy:  # the spread that the kernel's time (the longest) pays for
            mean["busy_spans"] = {
                q: busy[min(round(q / 100 * (len(busy) - 1)), len(busy) - 1)]
                for q in (0, 10, 50, 90, 100)
            }
            mean["busy_mean_over_max"] = statistics.mean(busy) / busy[-1]
        out[role] = mean
    return out


def routed_group_sizes(num_experts: int, top_k: int, tokens: int) -> np.ndarray:
    """Rows per expert when each token picks top_k distinct experts at random (decode.py's)."""
    rng = np.random.default_rng(tokens)
    experts = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])
    return np.bincount(experts.ravel(), minlength=num_experts)


def trace_one(
    shape,
    gemm: str,
    tokens: int,
    small_scales: bool = False,
    tiled: bool = True,
    variant: dict | None = None,
) -> dict:
    config, h = shape.config, shape.hidden_size
    k, n = {
        "fc1": (h, config.fc1_output_size),
        "fc2": (config.ffn_hidden_size, h),
    }[gemm]
    counts = routed_group_sizes(config.num_experts, config.top_k, tokens)
    rows = tokens * config.top_k
    keys = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(keys[0], (rows, k), BF16)
    rhs = jax.random.normal(keys[1], (config.num_experts, n, k)).astype(jnp.float8_e4m3fn)
    if tiled:
        rhs = tile_weights(rhs)
    scale = jax.random.randint(keys[2], (config.num_experts, k // 32, n), 120, 134)
    scale = scale.astype(jnp.uint8)
    sizes = jnp.asarray(counts, jnp.int32)
    decode = dataclasses.replace(
        default_decode_config(rows, k, n, config.num_experts), **(variant or {})
    )
    record = dict(
        shape=shape.name,
        gemm=gemm,
        tokens=tokens,
        config=str(decode),
        small_scales=small_scales,
        weights="tiled" if tiled else "plain",
    )

    def call(trace=None):
        return jax.jit(
            lambda a, b, c, s: gmm_decode_pallas(
                a, b, c, s, out_dtype=BF16, config=decode, trace=trace, small_scales=small_scales
            )
        )

    plain = call()
    reference = plain(lhs, rhs, scale, sizes)
    record["kernel_us"] = statistics.median(
        device_seconds(lambda: plain(lhs, rhs, scale, sizes), iters=10) * 1e6 for _ in range(3)
    )
    # A CTA's items: at most one more than the mean (every num_sms-th item); each has its K
    # steps and their waits, an epilogue and the item region itself.
    tiles = sum(math.ceil((c + 7) / decode.tile_rows) for c in counts if c)
    per_cta = math.ceil(tiles * (n // decode.cta_n) / decode.num_sms) + 1
    directory = tempfile.mkdtemp(prefix="decode_trace_")
    trace = KernelTrace(directory, per_cta * (2 * (k // decode.tile_k) + 2) + 8)
    traced = call(trace)
    traced(lhs, rhs, scale, sizes).block_until_ready()  # compiles; its trace is dropped
    for path in glob.glob(os.path.join(directory, "*.json")):
        os.remove(path)
    out = traced(lhs, rhs, scale, sizes)
    out.block_until_ready()
    for _ in range(50):  # the trace is written by a host callback after the call
        paths = sorted(glob.glob(os.path.join(directory, "*.json")))
        if paths:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    with open(paths[-1]) as f:
        summary = trace_summary(json.load(f)["traceEvents"])
    record.update(summary, same_bits=bool(jnp.array_equal(out, reference)))
    record["cycles_per_us"] = max(s["max_span"] for s in summary.values()) / record["kernel_us"]
    return record


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3_30b,mixtral,dsv3_ep8")
    parser.add_argument("--gemms", default="fc1,fc2")
    parser.add_argument("--tokens", default="64")
    parser.add_argument("--small-scales", action="store_true")
    parser.add_argument("--plain-weights", action="store_true")
    parser.add_argument(
        "--variant", default="", help='DecodeConfig fields "f=v,..." set on the default config'
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        parser.error("the Mosaic profiler runs on a GPU only")
    result = report.environment("decode_trace")
    result.update(records=[], command=" ".join(sys.argv if argv is None else argv))
    path = report.result_path(args.out, "decode_trace", args.tag)
    for name in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            for gemm in args.gemms.split(","):
                try:
                    record = trace_one(
                        SHAPES[name],
                        gemm,
                        tokens,
                        args.small_scales,
                        not args.plain_weights,
                        parse_variant(args.variant) if args.variant else None,
                    )
                except Exception as e:  # a failed case is recorded, the others still run
                    record = dict(shape=name, gemm=gemm, tokens=tokens, error=error_text(e))
                result["records"].append(record)
                compute = record.get("compute", {})
                log(
                    f"{name} {gemm} T={tokens}: {record.get('kernel_us', float('nan')):.1f} us, "
                    f"compute steps {compute.get('share_step', float('nan')):.0%} of the span, "
                    f"step gaps {compute.get('share_step_gaps', float('nan')):.0%}, "
                    f"epilogues {compute.get('share_epilogue', float('nan')):.0%}"
                    + (f" ({record['error']})" if "error" in record else "")
                )
                report.write_result(result, path)
    result["path"] = path
    return result


if __name__ == "__main__":
    main()
