"""MoE decode benchmark on one GPU: the layer's inference forward at decode sizes, where reading
the active experts' weights bounds the time, next to that bound.

    python -m benchmarks.decode [--shapes qwen3_30b,mixtral,dsv3_ep8]
        [--tokens 1,8,64,256] [--copies 8] [--parts layer,gmm] [--repeats 3]
        [--min-window 0.1] [--impls NAME,...] [--profile] [--tag TAG] [--out DIR]

For each `jaxmoe.shapes` layer and token count T (one sequence of T tokens):
  layer  the inference forward: jaxmoe_bf16 (the bf16 layer), jaxmoe_mxfp8
         (`jaxmoe.mxfp8_inference` as it comes: the experts stored only as their MXFP8 fprop
         copies, MXFP8 dispatch, `Mxfp8Kernel.AUTO`), jaxmoe_mxfp8_decode (the same with
         `kernel=Mxfp8Kernel.DECODE`: the same bits, the fp8 weights read once by the decode
         kernel, which AUTO takes at up to 64 rows per expert) and torch_grouped_mm
         (`layer_competitors.torch_moe`, bf16)
  gmm    the two expert GEMMs alone (fc1 [R, H] x [E, H, 2F|F], fc2 [R, F] x [E, F, H]) on
         R = T * top_k rows, each token's k experts drawn at random: gmm_bf16 (`ops.gmm`) and
         MXFP8 on its fprop weight copies stored as `mxfp8_inference` stores them (the data
         in the decode kernel's 128 x 128 tiles; `ops.gmm` on MXTensors), the rows MXFP8 and,
         for the kernels that read them so, their bf16 values made before the timed calls (as
         the layer's dispatch and activation hand them over; until 2026-12-04 evening each
         call dequantized its rows itself, a kernel of 2-6 us), kernels DEQUANTIZE,
         FUSED_DEQUANTIZE and DECODE (`gmm_mxfp8_dequantize`, `gmm_mxfp8_fused`,
         `gmm_mxfp8_decode`), and the decode kernel's integer dequantization
         (`gmm_mxfp8_decode_small_scales`, when the weights qualify, as these do);
         --decode-sweep "f=v,f=v;..." adds the decode kernel once per
         ";"-separated variant, its `DecodeConfig` fields f set to v on the default config
         (`gmm_mxfp8_decode[f=v,...]`: the same bits; on the integer route when the weights
         qualify)
  floor  the bytes of the active experts' weights (bf16: 2 bytes a weight; MXFP8: 1 + 1/32;
         active: those jaxmoe's routing picks, the torch MoE's its own router's)
         over the memory bandwidth measured in the same run: the higher of a device-to-device
         copy's ((read + written bytes) / time) and a read-only pass's (bytes / time of a sum),
         both recorded; a kernel that only reads its weights can beat the copy's rate (the
         bf16 gmm did, 2026-12-01), so the copy alone is no floor. `share_of_floor` = floor /
         time; `share_of_copy_floor` the same at the copy's rate (issue 19 defines its floor
         so: the active experts' bytes over the copy bandwidth).
No host dispatch is timed: each timed call runs `copies` forwards inside one executable
(`lax.scan`; torch: one CUDA graph on a GPU), each on its own copy of the weights (so that no
copy is served from L2) and its own tokens; times are per forward. --profile adds each
implementation's device time per forward by kernel name (`kernels_us`, from a JAX profile; GPU
only), which shows what besides the GEMM kernels a forward runs, and the expert GEMM calls' own
device time (`gemm_us`: in the gmm part their kernels and tile metadata, not the scan and sums of
the timing harness; in jaxmoe's layers the kernels of the routed experts' fc1 and fc2 scopes) and
its share of the floor. Implementations take turns
(`benchmarks.timing.timed_runs`), median of the repeats; --impls runs only the named ones (and the
--decode-sweep variants; the layer part makes weight copies for those alone).
Writes decode_<date>[_tag].json (after every shape) and, with matplotlib, decode_<date>[_tag].png
to --out.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks import report
from benchmarks.layer_competitors import torch_moe
from benchmarks.report import add_output_arguments, error_text, log
from benchmarks.timing import (
    gpu_stream_events,
    memory_bandwidths,
    profile_events,
    sync,
    timed_runs,
)
from jaxmoe import MoE, mxfp8_inference
from jaxmoe.inference import loaded_copy, stored_copy
from jaxmoe.mxfp8 import BLOCK_SIZE, dequantize
from jaxmoe.ops import Mxfp8Kernel, gmm, quantize, quantize_mxfp8_weights
from jaxmoe.ops.pallas.e4m3_registers import small_scale_dequantization_is_exact
from jaxmoe.ops.pallas.gmm_decode_hopper import default_decode_config
from jaxmoe.shapes import SHAPES, TINY_SHAPES, LayerShape

BF16, F32 = jnp.bfloat16, jnp.float32
DEFAULT_SHAPES = ("qwen3_30b", "mixtral", "dsv3_ep8")
PARTS = ("layer", "gmm")
# The bandwidth measurement's buffer: 1 GiB on a GPU (well past its L2), 16 MiB on a CPU.
BANDWIDTH_BYTES = {True: 1 << 30, False: 1 << 24}
BYTES_PER_WEIGHT = {"bf16": 2.0, "mxfp8": 1.0 + 1.0 / BLOCK_SIZE}
# The named scope of the gmm part's GEMM calls: their kernels (the GEMM and its tile metadata)
# apart from the benchmark's own work (the scan, the sums that use the outputs).
GEMM_SCOPE = "expert_gemm"
# The scopes of each part's expert GEMM calls: in the layer, the routed experts' fc1 and fc2
# (`jaxmoe.experts`, `jaxmoe.recipes`; the shared expert's GEMMs are in a scope of their own).
GEMM_SCOPES = {"gmm": (GEMM_SCOPE,), "layer": ("fc1", "fc2")}


def expert_weights_per_expert(shape: LayerShape) -> int:
    """Weights of one routed expert: fc1 H x (2F or F) and fc2 F x H."""
    config = shape.config
    return shape.hidden_size * (config.fc1_output_size + config.ffn_hidden_size)


def floor_us(shape: LayerShape, active_experts: float, precision: str, bandwidth: float) -> float:
    """Microseconds to read the active experts' weights once at `bandwidth` bytes/s."""
    weight_bytes = active_experts * expert_weights_per_expert(shape) * BYTES_PER_WEIGHT[precision]
    return weight_bytes / bandwidth * 1e6


def stacked(tree, copies: int):
    """`copies` distinct copies of every array of tree, stacked on a new leading axis."""
    return jax.jit(lambda t: jax.tree.map(lambda a: jnp.stack([a] * copies), t))(tree)


def scanned(forward):
    """fn(per-copy inputs stacked on axis 0) -> (sum of every forward's first output, the
    forwards' second outputs): the copies' forwards in one executable, all outputs used."""

    def run(*stacked_inputs):
        def body(total, inputs):
            out, extra = forward(*inputs)
            return total + jnp.sum(out.astype(F32)), extra

        return jax.lax.scan(body, jnp.float32(0), stacked_inputs)

    return jax.jit(run)


# ---------------------------------------------------------------------------------- parts
def layer_candidates(
    shape: LayerShape, tokens: int, copies: int, on_gpu: bool, impls: frozenset = frozenset()
):
    """impl -> call of the layer part (only those in `impls`, or all when it is empty: each
    holds `copies` copies of its weights), the mean number of experts jaxmoe's routing
    activates, and {impl: the same for an implementation that routes the tokens itself} (the
    torch MoE: its bf16 router may pick other experts)."""

    def wanted(impl: str) -> bool:
        return not impls or impl in impls

    keys = jax.random.split(jax.random.key(tokens), copies)
    xs = jax.vmap(lambda k: jax.random.normal(k, (1, tokens, shape.hidden_size), BF16))(keys)
    candidates = {}
    bf16_model = MoE(shape.config, shape.hidden_size, param_dtype=BF16, rngs=nnx.Rngs(0))
    mx_shape = shape.with_precision("mxfp8")
    mx_trained = MoE(mx_shape.config, shape.hidden_size, param_dtype=BF16, rngs=nnx.Rngs(0))
    models = {
        "jaxmoe_bf16": lambda: bf16_model,
        "jaxmoe_mxfp8": lambda: mxfp8_inference(mx_trained),
        "jaxmoe_mxfp8_decode": lambda: mxfp8_inference(mx_trained, kernel=Mxfp8Kernel.DECODE),
    }

    def forward(graphdef, state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        return y, aux.tokens_per_expert

    torch_wanted = any(wanted(i) for i in ("torch_grouped_mm", "torch_grouped_mm_eager"))
    counts, bf16_states = None, None
    for impl, model in models.items():
        # The torch MoE reads the bf16 layer's stacked copies, so they are made for it too.
        if not (wanted(impl) or (impl == "jaxmoe_bf16" and torch_wanted)):
            continue
        graphdef, state = nnx.split(model())
        states = stacked(state, copies)
        run = scanned(functools.partial(forward, graphdef))
        if wanted(impl):
            candidates[impl] = functools.partial(run, states, xs)
        if counts is None:  # every model routes alike: the same router weights
            counts = run(states, xs)[1]
        if impl == "jaxmoe_bf16":
            bf16_states = states
    active = float(jnp.mean(jnp.sum(counts > 0, axis=-1))) if counts is not None else None
    if not torch_wanted:
        return candidates, active, {}

    weights = {  # in place (DLPack, no second copy)
        ".".join(map(str, path)): torch.from_dlpack(v[...])
        for path, v in nnx.to_flat_state(bf16_states)
    }
    torch_xs = torch.from_dlpack(xs.reshape(copies, tokens, shape.hidden_size))

    def torch_forward(i):  # (y, aux, expert ids) of copy i
        w = {name: a[i] for name, a in weights.items()}
        return torch_moe(w, torch_xs[i], shape.config, tokens)

    def torch_copies():
        total = torch.zeros((), dtype=torch.float32, device=torch_xs.device)
        for i in range(copies):
            total = total + torch_forward(i)[0].float().sum()
        return total

    def torch_experts(i):
        with torch.no_grad():
            return len(torch.unique(torch_forward(i)[2]))

    torch_active = statistics.mean(torch_experts(i) for i in range(copies))
    if not on_gpu:
        candidates["torch_grouped_mm_eager"] = torch_copies
        return candidates, active, {"torch_grouped_mm_eager": torch_active}
    try:
        candidates["torch_grouped_mm"] = cuda_graph(torch_copies)
        own = {"torch_grouped_mm": torch_active}
    except Exception as e:  # then timed with its host dispatch, under another name
        log(f"{shape.name} T={tokens}: no CUDA graph of the torch MoE ({error_text(e)})")
        candidates["torch_grouped_mm_eager"] = torch_copies
        own = {"torch_grouped_mm_eager": torch_active}
    return candidates, active, own


def cuda_graph(fn):
    """fn captured in one CUDA graph (after a warm-up on a side stream), replayed per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def gmm_candidates(shape: LayerShape, tokens: int, copies: int, impl: str, sweep=()):
    """impl -> call of the gmm part, and the mean number of experts the rows activate."""
    config, h = shape.config, shape.hidden_size
    rng = np.random.default_rng(tokens)
    experts = np.stack(
        [
            np.stack([rng.permutation(config.num_experts)[: config.top_k] for _ in range(tokens)])
            for _ in range(copies)
        ]
    )
    sizes = np.stack([np.bincount(e.ravel(), minlength=config.num_experts) for e in experts])
    rows = tokens * config.top_k
    keys = jax.random.split(jax.random.key(7), 4)
    fc1 = jax.random.normal(keys[0], (config.num_experts, h, config.fc1_output_size), BF16)
    fc2 = jax.random.normal(keys[1], (config.num_experts, config.ffn_hidden_size, h), BF16)
    x1 = jax.random.normal(keys[2], (copies, rows, h), BF16)
    x2 = jax.random.normal(keys[3], (copies, rows, config.ffn_hidden_size), BF16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    weights = stacked((fc1, fc2), copies)
    # Stored as `mxfp8_inference` stores them: fp8 data in tiles, block-major scale bytes.
    fprop = [quantize_mxfp8_weights(w, impl, dgrad=False).fprop for w in (fc1, fc2)]
    copies_q = stacked(tuple(stored_copy(t) for t in fprop), copies)
    x_q = jax.jit(jax.vmap(lambda a, b: (quantize(a, axis=1), quantize(b, axis=1))))(x1, x2)
    # The rows' bf16 values too, made outside the timed calls: the layer hands the decode
    # kernel its rows so (the dispatch's one-pass rows, the activation's fused
    # quantize-dequantize), so no dequantization of the MXTensor rows runs inside a GEMM there.
    x_values = jax.jit(jax.vmap(lambda a, b: (dequantize(a, BF16), dequantize(b, BF16))))(*x_q)

    def bf16(w, a, b, sizes):
        with jax.named_scope(GEMM_SCOPE):
            return gmm(a, w[0], sizes, impl=impl), gmm(b, w[1], sizes, impl=impl)

    def mxfp8(kernel, w, a, b, a_values, b_values, sizes, fields=None, small_scales=False):
        def run(x, values, stored):
            weights = loaded_copy(*stored)
            w = weights.fprop
            config = None
            if fields is not None:  # a --decode-sweep variant of the decode kernel's config
                num_weights, n, k = w.shape
                config = dataclasses.replace(
                    default_decode_config(x.shape[0], k, n, num_weights), **fields
                )
            return gmm(
                x,
                w,
                sizes,
                transpose_rhs=True,
                impl=impl,
                kernel=kernel,
                config=config,
                small_scales=small_scales,
                rhs_tiled=weights.fprop_tiled,
                lhs_values=values,
            )

        with jax.named_scope(GEMM_SCOPE):
            return run(a, a_values, w[0]), run(b, b_values, w[1])

    candidates = {"gmm_bf16": functools.partial(scanned(bf16), weights, x1, x2, group_sizes)}
    for name, kernel in (
        ("gmm_mxfp8_dequantize", Mxfp8Kernel.DEQUANTIZE),
        ("gmm_mxfp8_fused", Mxfp8Kernel.FUSED_DEQUANTIZE),
        ("gmm_mxfp8_decode", Mxfp8Kernel.DECODE),
    ):
        run = scanned(functools.partial(mxfp8, kernel))
        candidates[name] = functools.partial(run, copies_q, *x_q, *x_values, group_sizes)
    small = all(small_scale_dequantization_is_exact(*stored) for stored in copies_q)
    if small:
        run = scanned(functools.partial(mxfp8, Mxfp8Kernel.DECODE, small_scales=True))
        candidates["gmm_mxfp8_decode_small_scales"] = functools.partial(
            run, copies_q, *x_q, *x_values, group_sizes
        )
    for fields in sweep:  # on the integer route when the weights qualify
        run = scanned(
            functools.partial(mxfp8, Mxfp8Kernel.DECODE, fields=fields, small_scales=small)
        )
        candidates[variant_name(fields)] = functools.partial(
            run, copies_q, *x_q, *x_values, group_sizes
        )
    return candidates, float(np.mean(np.sum(sizes > 0, axis=-1)))


def variant_name(fields: dict) -> str:
    """The implementation name of a --decode-sweep variant: gmm_mxfp8_decode[f=v,...]."""
    return "gmm_mxfp8_decode[" + ",".join(f"{f}={v}" for f, v in fields.items()) + "]"


def parse_variant(text: str) -> dict:
    """The DecodeConfig fields of a --decode-sweep variant: "tile_rows=16,wg_n=64" ->
    {"tile_rows": 16, "wg_n": 64}."""
    fields = {}
    for item in text.split(","):
        field, value = item.split("=")
        fields[field.strip()] = int(value)
    return fields


# ------------------------------------------------------------------------------ the run
def bench(shape: LayerShape, tokens: int, part: str, args, bandwidths: dict, records: list):
    """Time one part at one token count; append a record per implementation. bandwidths:
    `memory_bandwidths`' copy and read rates; the floor is set by the higher."""
    on_gpu = jax.devices()[0].platform == "gpu"
    base = dict(shape=shape.name, tokens=tokens, part=part)
    try:
        if part == "layer":
            candidates, active, own_active = layer_candidates(
                shape, tokens, args.copies, on_gpu, frozenset(args.impls)
            )
        else:
            own_active = {}
            candidates, active = gmm_candidates(
                shape, tokens, args.copies, args.impl, args.decode_sweep
            )
    except Exception as e:  # recorded, the other parts go on
        records.append(dict(base, error=error_text(e)))
        log(f"{shape.name} T={tokens} {part}: FAILED {error_text(e)}")
        return
    if args.impls:
        swept = {variant_name(fields) for fields in args.decode_sweep}
        candidates = {k: v for k, v in candidates.items() if k in args.impls | swept}
    runnable = {}
    for impl, call in candidates.items():
        try:
            sync(call())
            runnable[impl] = call
        except Exception as e:  # a case an implementation cannot run
            records.append(dict(base, impl=impl, error=error_text(e)))
            log(f"{shape.name} T={tokens} {part}: {impl} FAILED {error_text(e)}")
    runs = timed_runs(
        list(runnable.values()), iters=1, repeats=args.repeats, min_window=args.min_window
    )
    bandwidth = max(bandwidths.values())
    for impl, times in zip(runnable, runs):
        us = statistics.median(times) / args.copies * 1e6
        precision = "mxfp8" if "mxfp8" in impl else "bf16"
        experts = own_active.get(impl, active)  # the experts this implementation's routing reads
        floor = floor_us(shape, experts, precision, bandwidth)
        copy_floor = floor_us(shape, experts, precision, bandwidths["copy"])
        record = dict(
            base,
            impl=impl,
            us=us,
            us_runs=[t / args.copies * 1e6 for t in times],
            active_experts=experts,
            floor_us=floor,
            share_of_floor=floor / us,
            copy_floor_us=copy_floor,
            share_of_copy_floor=copy_floor / us,
        )
        if args.profile and on_gpu:
            record.update(kernel_breakdown(runnable[impl], args.copies, part))
            if record.get("gemm_us"):
                record.update(
                    gemm_share_of_floor=floor / record["gemm_us"],
                    gemm_share_of_copy_floor=copy_floor / record["gemm_us"],
                )
        records.append(record)
        log(
            f"{shape.name} T={tokens:4d} {part}: {impl:22s} {us:9.1f} us "
            f"({floor / us:6.1%} of the {precision} floor {floor:.1f} us for {experts:.1f} "
            f"experts, {copy_floor / us:6.1%} at the copy's rate)"
        )


def kernel_breakdown(call, copies: int, part: str, runs: int = 2, top: int = 40):
    """Device us per forward of the GPU work a call launches, by kernel name (the `top`
    longest, the rest summed as "other"), from a profile of `runs` calls of `copies` forwards.
    For a jitted call also the expert GEMM calls' own kernels (`gemm_kernels`: those of the
    part's GEMM_SCOPES, found by `scoped_kernel_names`) and their device us per forward
    (`gemm_us`; `bench` adds the floors' shares of it): in the gmm part the time a user's two
    GEMM calls take, without the benchmark's; in the layer the routed experts' fc1 and fc2 calls
    with what runs inside them (their tile metadata; with MXFP8, fc2's input quantize where XLA
    keeps it there)."""
    per_kernel = collections.Counter()
    for event in gpu_stream_events(profile_events(call, runs=runs)):
        per_kernel[event.name] += event.dur_us / (runs * copies)
    longest = dict(per_kernel.most_common(top))
    longest["other"] = sum(per_kernel.values()) - sum(longest.values())
    result = dict(device_us=sum(per_kernel.values()), kernels_us=longest)
    if isinstance(call, functools.partial) and hasattr(call.func, "lower"):
        compiled = call.func.lower(*call.args, **call.keywords).compile().as_text()
        scoped = set().union(*(scoped_kernel_names(compiled, s) for s in GEMM_SCOPES[part]))
        own = sorted(scoped & set(per_kernel))
        gemm_us = sum(per_kernel[name] for name in own)
        result.update(gemm_kernels=own, gemm_us=gemm_us if own else None)
    return result


def scoped_kernel_names(hlo_text: str, scope: str) -> set[str]:
    """The kernels, named as the GPU profiler names them, of the instructions of a compiled HLO
    module whose op_name passes through the named scope `scope`: a fusion as its instruction
    ("input_reduce_fusion.2" -> "input_reduce_fusion_2"), a Pallas Mosaic GPU call (a custom
    call whose op_name ends in ".../<kernel name>/mpmd_map") as "<kernel name>_mosaic_gpu_kernel"."""
    names = set()
    pattern = r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*?op_name="([^"]*)"'
    for name, op_name in re.findall(pattern, hlo_text, re.MULTILINE):
        path = op_name.split("/")
        if scope not in path:
            continue
        if len(path) >= 2 and path[-1] == "mpmd_map":
            names.add(f"{path[-2]}_mosaic_gpu_kernel")
        else:
            names.add(re.sub(r"[.\-]", "_", name))
    return names


def summarize(records: list) -> list:
    """Per shape, token count and part: jaxmoe bf16's time over each other implementation's
    (`speedup_over_bf16`), and, where --profile measured it, the same of device time alone
    (`device_speedup_over_bf16`: without the time between kernels, which moves by tens of
    microseconds a call from machine to machine)."""
    summary = []
    reference = {"layer": "jaxmoe_bf16", "gmm": "gmm_bf16"}
    cases = sorted({(r["shape"], r["tokens"], r["part"]) for r in records if "us" in r})
    for shape, tokens, part in cases:
        case = [r for r in records if (r["shape"], r["tokens"], r["part"]) == (shape, tokens, part)]
        entry = dict(shape=shape, tokens=tokens, part=part)
        for key, field in (("speedup_over_bf16", "us"), ("device_speedup_over_bf16", "device_us")):
            times = {r["impl"]: r[field] for r in case if field in r}
            ref = times.get(reference[part])
            if ref:
                entry[key] = {i: ref / t for i, t in times.items() if i != reference[part]}
        entry.setdefault("speedup_over_bf16", {})
        summary.append(entry)
    return summary


def plot(result: dict, path: str) -> None:
    """One panel per shape and part: microseconds per forward against T, and the floors.
    Needs matplotlib (ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result["records"] if "us" in r]
    panels = sorted({(r["shape"], r["part"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (shape, part) in zip(axes[0], panels):
        mine = [r for r in records if (r["shape"], r["part"]) == (shape, part)]
        for impl in sorted({r["impl"] for r in mine}):
            points = sorted((r["tokens"], r["us"]) for r in mine if r["impl"] == impl)
            ax.plot(*zip(*points), marker="o", label=impl)
        for precision, style in (("bf16", ":"), ("mxfp8", "--")):
            points = sorted(
                {
                    (r["tokens"], r["floor_us"])
                    for r in mine
                    if ("mxfp8" in r["impl"]) == (precision == "mxfp8")
                }
            )
            if points:
                ax.plot(*zip(*points), "k" + style, label=f"{precision} weight-read floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="us per forward")
        ax.set_title(f"{shape} {part}")
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE decode, {result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    """Parse the command line (`argv`: None for sys.argv), run every shape, part and token
    count, writing the JSON after each shape; returns the result (with `path`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--tokens", default="1,8,64,256")
    parser.add_argument("--copies", type=int, default=8, help="forwards per timed call")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--impl", default="auto", help="gmm impl of the gmm part")
    parser.add_argument(
        "--decode-sweep",
        default="",
        help='decode-kernel variants "field=v,...;...": DecodeConfig fields',
    )
    parser.add_argument(
        "--impls", default="", help="run only these implementations (comma-separated names)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="add each impl's device time by kernel (GPU)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-window", type=float, default=0.1, help="seconds per timed run")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    known = {**SHAPES, **TINY_SHAPES}
    shapes = [s for s in args.shapes.split(",") if s]
    parts = [p for p in args.parts.split(",") if p]
    if set(shapes) - set(known) or set(parts) - set(PARTS):
        parser.error(f"unknown shapes or parts; shapes: {sorted(known)}, parts: {PARTS}")
    token_counts = [int(t) for t in args.tokens.split(",")]
    args.impls = {i for i in args.impls.split(",") if i}
    args.decode_sweep = [parse_variant(v) for v in args.decode_sweep.split(";") if v]
    os.makedirs(args.out, exist_ok=True)
    stem = f"decode_{datetime.date.today().isoformat()}" + (f"_{args.tag}" if args.tag else "")
    path = os.path.join(args.out, stem + ".json")
    on_gpu = jax.devices()[0].platform == "gpu"
    bandwidths = memory_bandwidths(args.repeats, args.min_window, BANDWIDTH_BYTES[on_gpu])
    bandwidth = max(bandwidths.values())
    log(", ".join(f"{k} bandwidth {v / 1e12:.2f} TB/s" for k, v in bandwidths.items()))
    result = report.environment(
        "decode",
        torch=torch.__version__,
        copy_bandwidth_bytes_per_s=bandwidths["copy"],
        read_bandwidth_bytes_per_s=bandwidths["read"],
        floor_bandwidth_bytes_per_s=bandwidth,
        copies=args.copies,
    )
    result.update(records=[], summary=[], command=" ".join(sys.argv if argv is None else argv))
    for name in shapes:
        for tokens in token_counts:
            for part in parts:
                bench(known[name], tokens, part, args, bandwidths, result["records"])
        result["summary"] = summarize(result["records"])
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    try:
        plot(result, path.replace(".json", ".png"))
    except ImportError as e:
        log(f"no plot: {e}")
    result["path"] = path
    return result


if __name__ == "__main__":
    main()
