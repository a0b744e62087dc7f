"""Grouped-matmul benchmark on one GPU: jaxmoe's Pallas kernels next to the competitors.

    python -m benchmarks.gmm [--shapes mixtral,qwen3_30b,dsv3_ep8] [--routings dirichlet,empty]
                             [--sweep [--sweep-ops fwd,dgrad,wgrad]] [--out DIR]

For each shape of `SHAPES` (the fc1 GEMM of a SwiGLU expert at the layer sizes of
`jaxmoe/shapes.py`) and each routing (Dirichlet-skewed group sizes, and the same with a quarter
of the experts empty), in one process and on the same data:
  fwd    out = x @ W[g]            jaxmoe gmm | torch._grouped_mm | JAX ragged_dot_mgpu |
                                   jax.lax.ragged_dot | dense matmul of the same FLOPs (ceiling)
  dgrad  dx = dy @ W[g]^T          jaxmoe gmm(transpose_rhs) | torch | JAX example | dense
  wgrad  dW[g] = x_g^T @ dy_g      jaxmoe tgmm | torch._grouped_mm (2d x 2d) |
                                   JAX transposed_ragged_dot_mgpu | dense
Times are medians over repeats of back-to-back launches (device synchronised at both ends, at
least --min-window seconds each), the implementations of one op taking turns within each repeat
(`timed_runs`; each record keeps its timed runs, `ms_runs`, next to their median).
Writes gmm_<date>.json (+ .png) to --out and prints TFLOP/s and ratios. `--sweep` also times
the default jaxmoe kernel configs next to single changes to them and torch, in turns, and
checks that they give the same bits (the tuning data behind the heuristic); with
`--routings ""` only the sweep runs (written to gmm_<date>_sweep.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import add_output_arguments
from benchmarks.timing import sync, time_it, time_round_robin, timed_runs
from jaxmoe.ops import gmm, tgmm
from jaxmoe.ops.pallas.gmm_hopper import default_config
from jaxmoe.ops.pallas.tgmm_hopper import default_tgmm_config

SHAPES = {  # name: (M tokens*k, K, N, G)
    "mixtral": (16384, 4096, 28672, 8),
    "qwen3_30b": (65536, 2048, 1536, 128),
    "dsv3_ep8": (32768, 7168, 4096, 32),
}


def default_kernel_config(name: str, op: str):
    """The default jaxmoe kernel config of op ("fwd", "dgrad" or "wgrad") at benchmark shape
    `name`, with bf16 outputs (dgrad contracts over N and produces K columns)."""
    m, k, n, g = SHAPES[name]
    return {
        "fwd": lambda: default_config(m, k, n, g),
        "dgrad": lambda: default_config(m, n, k, g),
        "wgrad": lambda: default_tgmm_config(m, k, n, jnp.bfloat16),
    }[op]()


def group_sizes_for(routing: str, m: int, g: int, seed: int = 0) -> np.ndarray:
    """Dirichlet-skewed sizes summing to m; "empty" gives a quarter of the experts no rows."""
    rng = np.random.default_rng(seed)
    active = np.ones(g, bool)
    if routing == "empty":
        active[rng.permutation(g)[: g // 4]] = False
    weights = np.zeros(g)
    weights[active] = rng.dirichlet(np.full(active.sum(), 1.0))
    return rng.multinomial(m, weights).astype(np.int32)


def bench_shape(name, routing, iters, torch, record, min_window=0.2):
    m, k, n, g = SHAPES[name]
    sizes = group_sizes_for(routing, m, g)
    flops = 2.0 * m * k * n
    key = jax.random.key(0)
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (g, k, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    example_cfg = dict(
        block_m=128,
        block_n=128,
        block_k=64,
        max_concurrent_steps=4,
        grid_block_n=4 if n % 512 == 0 else 1,
    )

    fwd = {
        "jaxmoe": jax.jit(
            lambda a, b, s: gmm(a, b, s, impl="pallas", preferred_element_type=jnp.bfloat16)
        ),
        "jax_example": jax.jit(
            lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **example_cfg)
        ),
        "lax_ragged_dot": jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s)),
    }
    dgrad = {
        "jaxmoe": jax.jit(
            lambda d, b, s: gmm(
                d, b, s, transpose_rhs=True, impl="pallas", preferred_element_type=jnp.bfloat16
            )
        ),
        "jax_example": jax.jit(
            lambda d, b, s: ragged_dot_mgpu.ragged_dot(
                d, b, group_sizes=s, transpose_rhs=True, **example_cfg
            )
        ),
    }
    wgrad = {
        "jaxmoe": jax.jit(
            lambda a, d, s: tgmm(a, d, s, impl="pallas", preferred_element_type=jnp.bfloat16)
        ),
        "jax_example": jax.jit(
            lambda a, d, s: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                a,
                d,
                group_sizes=s,
                block_m=128,
                block_n=128,
                block_k=64,
                max_concurrent_steps=4,
                grid_block_n=1,
            )
        ),
    }
    dense_jax = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))

    def report(op, impl, seconds=None, error=None, failure=None, runs=()):
        if failure is not None:  # a competitor that cannot run this shape
            record.append(
                dict(
                    shape=name,
                    routing=routing,
                    op=op,
                    impl=impl,
                    error=f"{type(failure).__name__}: {str(failure)[:300]}",
                )
            )
            print(
                f"  {name:10s} {routing:9s} {op:6s} {impl:16s} FAILED "
                f"{type(failure).__name__}: {str(failure)[:200]}",
                flush=True,
            )
            return
        record.append(
            dict(
                shape=name,
                routing=routing,
                op=op,
                impl=impl,
                ms=seconds * 1e3,
                tflops=flops / seconds / 1e12,
                rel_error=error,
                ms_runs=[t * 1e3 for t in runs],
            )
        )
        print(
            f"  {name:10s} {routing:9s} {op:6s} {impl:16s} {seconds * 1e3:8.3f} ms "
            f"{flops / seconds / 1e12:7.1f} TF/s"
            + (f"  err {error:.2e}" if error is not None else ""),
            flush=True,
        )

    def run(op, candidates):
        """Time the candidates (impl, fn, check) of one op in turn (`timed_runs`; the record
        keeps every timed run, the median is the result), after checking each against torch;
        the slow jax.lax.ragged_dot is timed on its own."""
        timed = []
        for impl, fn, check in candidates:
            try:
                error = check() if check else None
                if impl == "lax_ragged_dot":
                    report(op, impl, time_it(fn, iters=2, repeats=2), error)
                else:
                    sync(fn())
                    timed.append((impl, fn, error))
            except Exception as e:
                report(op, impl, failure=e)
        runs = timed_runs([fn for _, fn, _ in timed], iters=iters, min_window=min_window)
        for (impl, _, error), times in zip(timed, runs):
            report(op, impl, statistics.median(times), error, runs=times)

    def rel_err(ours, ref, rows=None):
        """||ours - ref|| / ||ref|| on the GPU (ours: a JAX array, ref: a torch tensor)."""
        a = torch.from_dlpack(ours).float()
        b = ref.float()
        if rows is not None:
            a, b = a[:rows], b[:rows]
        return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30))

    def checked(op_fns, ref, *args, rows=None):
        """(impl, fn, check) of each jax impl: fn on args, checked against torch's `ref`."""
        return [
            (
                impl,
                functools.partial(fn, *args),
                functools.partial(lambda f: rel_err(f(*args), ref, rows), fn),
            )
            for impl, fn in op_fns.items()
        ]

    dense = routing == "dirichlet"
    routed = int(sizes.sum())
    # ---- forward
    if routing != "dirichlet":
        del fwd["lax_ragged_dot"]
    wd, twd = w[0], tw[0]
    run(
        "fwd",
        checked(fwd, torch._grouped_mm(tx, tw, offs=offs), x, w, gs, rows=routed)
        + [("torch_grouped_mm", lambda: torch._grouped_mm(tx, tw, offs=offs), None)]
        + (
            [("dense_xla", lambda: dense_jax(x, wd), None), ("dense_torch", lambda: tx @ twd, None)]
            if dense
            else []
        ),
    )
    # ---- dgrad
    twt, wdt = tw.transpose(-2, -1), w[0].T
    run(
        "dgrad",
        checked(dgrad, torch._grouped_mm(tdy, twt, offs=offs), dy, w, gs, rows=routed)
        + [("torch_grouped_mm", lambda: torch._grouped_mm(tdy, twt, offs=offs), None)]
        + ([("dense_xla", lambda: dense_jax(dy, wdt), None)] if dense else []),
    )
    # ---- wgrad
    txt, xt = tx.t(), x.T
    run(
        "wgrad",
        checked(wgrad, torch._grouped_mm(txt, tdy, offs=offs), x, dy, gs)
        + [("torch_grouped_mm", lambda: torch._grouped_mm(txt, tdy, offs=offs), None)]
        + ([("dense_xla", lambda: dense_jax(xt, dy), None)] if dense else []),
    )


def sweep(name, iters, record, torch, ops=("fwd", "dgrad", "wgrad")):
    """Time the default jaxmoe config of each op next to single changes to it and to
    torch._grouped_mm, in turns (`time_round_robin`), on the Dirichlet routing. Every variant's
    output bits are compared with the default config's (the K-reduction order must not depend
    on the config)."""
    m, k, n, g = SHAPES[name]
    host_sizes = group_sizes_for("dirichlet", m, g)
    sizes = jnp.asarray(host_sizes)
    flops = 2.0 * m * k * n
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (g, k, n), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    offs = torch.from_numpy(np.cumsum(host_sizes).astype(np.int32)).cuda()

    def gmm_variants(base):
        other_width = 4 if base.grid_tile_width == 8 else 8
        return [
            base,
            dataclasses.replace(base, cluster_n=2),
            dataclasses.replace(base, cluster_n=2, grid_tile_width=other_width),
            dataclasses.replace(base, grid_tile_width=other_width),
        ]

    def tgmm_variants(base):
        return [
            base,
            dataclasses.replace(base, overlap_epilogue=not base.overlap_epilogue),
            dataclasses.replace(base, epilogue_slots=2),
            dataclasses.replace(base, wg_split="n"),
        ] + [
            dataclasses.replace(base, piece_rows=rows)
            for rows in (8, 32, 64)
            if rows != base.piece_rows
        ]

    cases = {
        "fwd": (
            gmm_variants(default_kernel_config(name, "fwd")),
            lambda c: jax.jit(
                functools.partial(gmm, impl="pallas", config=c, preferred_element_type=jnp.bfloat16)
            ),
            (x, w, sizes),
            lambda: torch._grouped_mm(tx, tw, offs=offs),
        ),
        "dgrad": (
            gmm_variants(default_kernel_config(name, "dgrad")),
            lambda c: jax.jit(
                functools.partial(
                    gmm,
                    impl="pallas",
                    config=c,
                    transpose_rhs=True,
                    preferred_element_type=jnp.bfloat16,
                )
            ),
            (dy, w, sizes),
            lambda: torch._grouped_mm(tdy, tw.transpose(-2, -1), offs=offs),
        ),
        "wgrad": (
            tgmm_variants(default_kernel_config(name, "wgrad")),
            lambda c: jax.jit(
                functools.partial(
                    tgmm, impl="pallas", config=c, preferred_element_type=jnp.bfloat16
                )
            ),
            (x, dy, sizes),
            lambda: torch._grouped_mm(tx.t(), tdy, offs=offs),
        ),
    }
    for op in ops:
        configs, make, args, torch_fn = cases[op]
        timed, reference_bits = [], None
        for config in configs:
            try:
                fn = functools.partial(make(config), *args)
                out_bits = jax.lax.bitcast_convert_type(fn(), jnp.uint16)
                reference_bits = out_bits if reference_bits is None else reference_bits
                timed.append((config, fn, bool(jnp.all(out_bits == reference_bits))))
            except Exception as e:
                print(f"  sweep {name} {op} {config} FAILED {str(e)[:160]}", flush=True)
        seconds = time_round_robin([torch_fn] + [fn for _, fn, _ in timed], iters=iters, repeats=3)
        torch_tflops = flops / seconds[0] / 1e12
        print(f"  sweep {name} {op} torch_grouped_mm {torch_tflops:.1f} TF/s", flush=True)
        for (config, _, same_bits), t in zip(timed, seconds[1:]):
            tflops = flops / t / 1e12
            record.append(
                dict(
                    shape=name,
                    op=op,
                    config=dataclasses.asdict(config),
                    ms=t * 1e3,
                    tflops=tflops,
                    vs_torch=tflops / torch_tflops,
                    torch_tflops=torch_tflops,
                    same_bits_as_default=same_bits,
                )
            )
            print(
                f"  sweep {name} {op} {config} {tflops:.1f} TF/s "
                f"({tflops / torch_tflops:.3f}x torch) same bits: {same_bits}",
                flush=True,
            )


def cell(value, ratio=False) -> str:
    """A table cell: TFLOP/s (7.1f) or a ratio (8.3f); a dash where there is no value."""
    if not value:
        return " " * (7 if ratio else 6) + "-"
    return f"{value:8.3f}" if ratio else f"{value:7.1f}"


def summarize(record):
    """Table of TFLOP/s per (shape, routing, op) and the ratios the issue targets."""
    rows = {}
    for r in record:
        if "tflops" in r and "config" not in r:
            rows.setdefault((r["shape"], r["routing"], r["op"]), {})[r["impl"]] = r["tflops"]
    ratios = []
    print(
        f"\n{'shape':10s} {'routing':9s} {'op':6s} {'jaxmoe':>7s} {'torch':>7s} {'jaxex':>7s} "
        f"{'dense':>7s} {'vs_torch':>8s} {'vs_jaxex':>8s} {'of_dense':>8s}"
    )
    for (shape, routing, op), t in rows.items():
        dense = max(t.get("dense_xla", 0), t.get("dense_torch", 0)) or None
        ours, torch_t, jax_ex = t.get("jaxmoe"), t.get("torch_grouped_mm"), t.get("jax_example")
        ratio = dict(
            shape=shape,
            routing=routing,
            op=op,
            vs_torch=ours / torch_t if ours and torch_t else None,
            vs_jax_example=ours / jax_ex if ours and jax_ex else None,
            of_dense=ours / dense if ours and dense else None,
        )
        ratios.append(ratio)
        print(
            f"{shape:10s} {routing:9s} {op:6s} {cell(ours)} {cell(torch_t)} {cell(jax_ex)} "
            f"{cell(dense)} {cell(ratio['vs_torch'], True)} "
            f"{cell(ratio['vs_jax_example'], True)} {cell(ratio['of_dense'], True)}"
        )
    return ratios


def bar_plot(record, shapes, impls, title, path, routing=None):
    """Grouped bars of TFLOP/s per (shape, op) and impl, from benchmark records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(s, o) for s in shapes for o in ("fwd", "dgrad", "wgrad")]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = [
            next(
                (
                    r["tflops"]
                    for r in record
                    if r.get("impl") == impl
                    and r["shape"] == s
                    and r["op"] == o
                    and r.get("routing") == routing
                    and "tflops" in r
                ),
                0,
            )
            for s, o in cases
        ]
        ax.bar(np.arange(len(cases)) + i * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{s}\n{o}" for s, o in cases], fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(record, path):
    bar_plot(
        record,
        SHAPES,
        ["jaxmoe", "torch_grouped_mm", "jax_example", "lax_ragged_dot", "dense_xla"],
        "Grouped matmul on one H200, Dirichlet routing",
        path,
        routing="dirichlet",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--routings", default="dirichlet,empty")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--min-window",
        type=float,
        default=0.2,
        help="seconds: the shortest timed run of back-to-back calls",
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-ops", default="fwd,dgrad,wgrad")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    import torch

    device = jax.devices()[0]
    record, sweep_record = [], []
    for name in args.shapes.split(","):
        for routing in filter(None, args.routings.split(",")):
            bench_shape(name, routing, args.iters, torch, record, args.min_window)
        if args.sweep:
            sweep(name, max(args.iters // 2, 5), sweep_record, torch, args.sweep_ops.split(","))
    ratios = summarize(record)
    date = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        benchmark="gmm",
        date=date,
        device=device.device_kind,
        num_sms=getattr(device, "core_count", None),
        jax=jax.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        shapes={k: dict(zip(("M", "K", "N", "G"), SHAPES[k])) for k in args.shapes.split(",")},
        method=f"median of 5 repeats of back-to-back calls (>= {args.iters} calls and >= "
        f"{args.min_window} s per timed run), synchronised; within each repeat the "
        "implementations of an op take turns, each timed run after as many untimed calls "
        "of the same implementation; bf16 in/out, fp32 accumulate; "
        "rel_error = ||out - torch|| / ||torch||",
        results=record,
        ratios=ratios,
        sweep=sweep_record,
    )
    tag = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"gmm_{date}{tag}{'' if record else '_sweep'}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if record:
        plot(record, path.replace(".json", ".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
