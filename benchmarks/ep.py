"""Expert-parallel benchmark: the row exchange of the dispatch and combine, bf16 vs MXFP8 on the
wire, next to a dense all-to-all of the same bytes, and the whole layer's weak scaling.

    PYTHONPATH=. python benchmarks/ep.py [--shape qwen3_30b] [--tokens-per-device T]
        [--ep 1,2] [--dispatch bf16,mxfp8] [--experts bf16] [--parts exchange,layer]
        [--iters 1] [--min-window 0.1] [--repeats 5] [--tag TAG] [--out DIR]

On N devices (2 H200s: `--ep` defaults to every power of two up to the device count), for each
expert-parallel degree R in --ep, on a ("data", "ep") = (1, R) mesh of the first R devices, in
one process:
  exchange  the layer's routing (router, plan, `exchange_plan`) of random tokens, T per rank,
            builds every rank's plan; then, timed in turns (`benchmarks.timing.timed_runs`),
            inside `jax.shard_map`:
              dispatch fwd   `send_rows` of the local expert buffer [M, H] to the experts' owners
              dispatch bwd   its transpose (`return_rows` of a receiver buffer [R * M, H])
              combine fwd    `return_rows` of the receiver buffer back to the sources
              combine bwd    its transpose (`send_rows` of a local buffer)
            each with a bf16 wire (the bf16 cases' bwd is `jax.vjp` of the fwd, the custom VJP
            the layer runs) and an MXFP8 wire (e4m3 data + e8m0 scales, two transfers, as
            `ExchangedRoute.to_experts` sends an MXTensor), plus `exchange_plan` itself and the
            reference: a dense `jax.lax.all_to_all` of the same buffers ([R * M, H] per rank,
            the transport's slots: room for a whole local buffer per peer). Reported: ms, the
            ratio to that reference, the bus bandwidth ((R - 1) / R of the slot buffer leaves
            each rank) and the payload rate (the rows of the plan's blocks for the other ranks'
            experts, alignment padding included: what a ragged transport would move). One
            plan serves both wires (the MXFP8 layer's 32-row expert alignment), so they differ
            only in the bytes per row (2H vs H + H/32).
  layer     the whole layer's training step, jitted: loss = sum(y * dy) + the auxiliary losses,
            gradients w.r.t. x and every parameter (all returned, with the token counts), of
            `expert_parallel_forward` at ep = R on R devices with T tokens per device, next to
            the plain single-device layer (`MoE.__call__`) on ONE device with T tokens, timed
            once before the degrees. Weak-scaling efficiency = per-device tokens/s at ep = R /
            tokens/s of the single device. Dispatch variants: bf16, and MXFP8
            (dispatch_dtype and combine_bwd_dtype "mxfp8", 32-row alignment); routed experts in
            bf16 unless --experts mxfp8.
Sizes: `--shape` from `jaxmoe.shapes`, or deepseek_v3_full (DeepSeek-V3's MoE layer: H 7168,
256 experts of F 2048, top-8 sigmoid with 8 groups / top-4, expert bias, one shared expert), or
the CPU smoke sizes tiny / tiny_deepseek; T = --tokens-per-device (default: the shape's tokens).
On CPU (e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8) it runs at the tiny sizes as a
check of the script; the JSON's `platform` says where it ran.
Writes ep_<date>[_tag].json to --out after every degree (environment, per-case ms, bytes, GB/s,
ratios, efficiency) and prints a summary table at the end.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.timing import sync, timed_runs  # noqa: E402
from jaxmoe import MoE, MoEConfig  # noqa: E402
from jaxmoe.config import MXFP8_ALIGNMENTS  # noqa: E402
from jaxmoe.dispatch import dispatch  # noqa: E402
from jaxmoe.exchange import exchange_plan, return_rows, send_rows  # noqa: E402
from jaxmoe.expert_parallel import expert_parallel_forward, place_on_mesh  # noqa: E402
from jaxmoe.mxfp8 import BLOCK_SIZE  # noqa: E402
from jaxmoe.ops.quantize import quantize  # noqa: E402
from jaxmoe.plan import make_plan  # noqa: E402
from jaxmoe.shapes import SHAPES, LayerShape  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
AXES = ("data", "ep")
WIRES = ("bf16", "mxfp8")
PARTS = ("exchange", "layer")
# DeepSeek-V3's MoE layer (for EP = 4 / 8): deepseek_v3_style's routing with all 256 experts and
# its one shared expert, ungated; 8192 tokens per device (2 sequences of 4096).
DEEPSEEK_V3_FULL = LayerShape(
    "deepseek_v3_full",
    SHAPES["deepseek_v3_style"].config.replace(num_experts=256, shared_expert_gate=False),
    7168,
    batch=2,
    seq_len=4096,
)
# CPU smoke-test sizes: E = 8 and 16 split over up to 8 ranks.
TINY_SHAPES = {
    shape.name: shape
    for shape in (
        LayerShape(
            "tiny",
            MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=64, aux_loss_coeff=1e-2),
            64,
            batch=2,
            seq_len=16,
        ),
        LayerShape(
            "tiny_deepseek",
            DEEPSEEK_V3_FULL.config.replace(
                num_experts=16,
                top_k=4,
                ffn_hidden_size=64,
                num_groups=4,
                group_topk=2,
                shared_expert_intermediate_size=64,
            ),
            64,
            batch=2,
            seq_len=16,
        ),
    )
}
ALL_SHAPES = {**SHAPES, DEEPSEEK_V3_FULL.name: DEEPSEEK_V3_FULL, **TINY_SHAPES}
# Where each exchange case sits in the layer's training step.
IN_LAYER = {
    ("dispatch", "fwd", "bf16"): "the tokens to the experts (bf16 dispatch)",
    ("dispatch", "fwd", "mxfp8"): "the quantized tokens to the experts (dispatch_dtype mxfp8)",
    ("dispatch", "bwd", "bf16"): "the tokens' gradient back (every variant)",
    ("dispatch", "bwd", "mxfp8"): "not in the layer (the dispatch gradient is bf16)",
    ("combine", "fwd", "bf16"): "the expert outputs back to the tokens (every variant)",
    ("combine", "fwd", "mxfp8"): "not in the layer (the expert outputs are bf16)",
    ("combine", "bwd", "bf16"): "y's gradient to the experts (every variant)",
    ("combine", "bwd", "mxfp8"): "y's quantized gradient (combine_bwd_dtype and experts mxfp8)",
}
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


# ---------------------------------------------------------------------------- configuration
def layer_config(config: MoEConfig, dispatch_wire: str, experts: str) -> MoEConfig:
    """`config` with the dispatch and combine gradient on `dispatch_wire` and the routed experts
    in `experts` precision (any MXFP8 option: a 32-row expert alignment unless already an MXFP8
    one)."""
    changes = {}
    if experts == "mxfp8":
        changes["expert_precision"] = "mxfp8"
    if dispatch_wire == "mxfp8":
        changes.update(dispatch_dtype="mxfp8", combine_bwd_dtype="mxfp8")
    if changes and config.expert_row_alignment not in MXFP8_ALIGNMENTS:
        changes["expert_row_alignment"] = 32
    return config.replace(**changes)


def token_layout(shape: LayerShape, tokens_per_device: int) -> tuple[int, int]:
    """(batch, seq_len) of one device's T tokens: the shape's sequence length when it divides
    T, else one sequence of T."""
    seq_len = shape.seq_len if tokens_per_device % shape.seq_len == 0 else tokens_per_device
    return tokens_per_device // seq_len, seq_len


def mesh_of(degree: int) -> jax.sharding.Mesh:
    """The (data, ep) = (1, degree) mesh of the first `degree` devices."""
    return jax.make_mesh((1, degree), AXES, devices=jax.devices()[:degree])


def on_ranks(mesh, fn: Callable) -> Callable:
    """jit(shard_map(fn)) over every rank of `mesh`, every argument and result leaf stacked on a
    leading rank axis (fn sees and returns the rank's own leaves without it)."""
    spec = P(mesh.axis_names)

    def body(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def init_weights(shape: LayerShape):
    """(graphdef, params, other state) of a bf16-parameter `jaxmoe.MoE` for `shape`
    (nnx.Rngs(0)), the weights made in one compiled call on the default device."""
    make = lambda: MoE(shape.config, shape.hidden_size, param_dtype=BF16, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(nnx.eval_shape(make))
    params, rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[1:])()
    return graphdef, params, rest


def variant_graphdef(shape: LayerShape, config: MoEConfig):
    """The graph of a bf16-parameter `jaxmoe.MoE` with `config` (same parameters as `shape`'s)."""
    return nnx.graphdef(
        nnx.eval_shape(lambda: MoE(config, shape.hidden_size, param_dtype=BF16, rngs=nnx.Rngs(0)))
    )


def random_tokens(key, shape, sharding) -> jax.Array:
    """bf16 N(0, 1) of `shape`, made where `sharding` puts it."""
    return jax.jit(
        lambda: jax.random.normal(key, shape, F32).astype(BF16), out_shardings=sharding
    )()


# --------------------------------------------------------------------------------- timing
def warm_and_time(cases: list[dict], args) -> None:
    """Compile and run every case once (its compile_s, or its error), then time the ones that
    ran in turns (`timed_runs`; one at a time if the turns fail). Fills each case's record."""
    runnable = []
    for case in cases:
        start = time.perf_counter()
        try:
            sync(case["call"]())
        except Exception as e:  # recorded; the other cases still run
            case["record"]["error"] = error_text(e)
            log(f"  {case['label']}: FAILED {error_text(e)[:200]}")
            continue
        case["record"]["compile_s"] = round(time.perf_counter() - start, 3)
        runnable.append(case)
    timing = lambda fns: timed_runs(
        fns, iters=args.iters, repeats=args.repeats, min_window=args.min_window
    )
    try:
        runs = timing([c["call"] for c in runnable])
    except Exception as e:  # retried one by one
        log(f"  timing in turns failed ({error_text(e)[:120]}); one at a time")
        runs = []
        for case in runnable:
            try:
                runs.append(timing([case["call"]])[0])
            except Exception as e:
                runs.append(e)
    for case, times in zip(runnable, runs):
        if isinstance(times, Exception):
            case["record"]["error"] = error_text(times)
            continue
        case["record"].update(ms=statistics.median(times) * 1e3, ms_runs=[t * 1e3 for t in times])
        log(f"  {case['label']:32s} {case['record']['ms']:10.3f} ms")


# ------------------------------------------------------------------------------- exchange
def exchange_setup(shape: LayerShape, config: MoEConfig, router, mesh, tokens_per_device: int):
    """Every rank's routing of its own random tokens: (per-rank inputs of the exchange cases,
    stacked on a leading rank axis; the plan's statistics)."""
    degree, hidden = mesh.shape["ep"], shape.hidden_size
    batch, seq_len = token_layout(shape, tokens_per_device)
    spec = NamedSharding(mesh, P(mesh.axis_names))
    x = random_tokens(jax.random.key(1), (degree * batch, seq_len, hidden), spec)
    router_graphdef, router_state = nnx.split(router)
    router_state = jax.device_put(router_state, NamedSharding(mesh, P()))
    impl = "auto"
    local_experts = config.num_experts // degree

    def rank_setup(state, x):
        tokens = x.reshape(-1, hidden)
        _, routing = nnx.merge(router_graphdef, state)(tokens, impl, x.shape[:-1])
        plan = make_plan(routing, config)
        xplan = exchange_plan(plan, degree, "ep")
        rows = dispatch(tokens, plan, impl)
        mx = dispatch(quantize(tokens, axis=1, impl=impl), plan, impl)
        owner = jnp.arange(config.num_experts) // local_experts
        to_peers = owner != jax.lax.axis_index("ep")
        return dict(
            plan=plan,
            xplan=xplan,
            rows=rows,
            rows_fp8=mx.data,
            rows_scale=mx.scale,
            received=send_rows(rows, xplan, "ep"),
            received_fp8=send_rows(mx.data, xplan, "ep"),
            received_scale=send_rows(mx.scale, xplan, "ep"),
            rows_to_peers=jnp.sum(jnp.where(to_peers, plan.group_sizes, 0)),
            real_rows_to_peers=jnp.sum(jnp.where(to_peers, plan.tokens_per_group, 0)),
            rows_received=jnp.sum(xplan.group_sizes),
        )

    tokens = P(mesh.axis_names)
    per_rank = jax.shard_map(
        lambda state, x: jax.tree.map(lambda a: a[None], rank_setup(state, x)),
        mesh=mesh,
        in_specs=(P(), tokens),
        out_specs=tokens,
        check_vma=False,
    )
    inputs = jax.jit(per_rank)(router_state, x)
    stats = {
        name: [int(v) for v in np.asarray(inputs.pop(name))]
        for name in ("rows_to_peers", "real_rows_to_peers", "rows_received")
    }
    num_rows = inputs["rows"].shape[1]
    plan_stats = dict(
        ep=degree,
        tokens_per_rank=tokens_per_device,
        buffer_rows=num_rows,  # M: the local expert buffer
        slot_rows=degree * num_rows,  # R * M: the transport's slots, per rank
        expert_row_alignment=config.expert_row_alignment,
        rows_to_peers_mean=float(np.mean(stats["rows_to_peers"])),
        real_rows_to_peers_mean=float(np.mean(stats["real_rows_to_peers"])),
        rows_received_max=max(stats["rows_received"]),
        **stats,
    )
    return inputs, plan_stats


def exchange_cases(inputs: dict, mesh, plan_stats: dict, hidden: int) -> list[dict]:
    """The timed exchange cases of one degree (each a record and a call)."""
    degree = mesh.shape["ep"]
    send = lambda xplan, *bufs: tuple(send_rows(b, xplan, "ep") for b in bufs)
    back = lambda xplan, *bufs: tuple(return_rows(b, xplan, "ep") for b in bufs)

    def transpose_of(op):
        """The VJP of op (bf16 rows) with cotangent ct: the custom VJP the layer runs."""

        def bwd(xplan, rows, ct):
            return jax.vjp(lambda r: op(xplan, r)[0], rows)[1](ct)

        return bwd

    def dense(bufs):
        return tuple(
            jax.lax.all_to_all(
                b.reshape((degree, -1) + b.shape[1:]), "ep", 0, 0, tiled=True
            ).reshape(b.shape)
            for b in bufs
        )

    xplan = inputs["xplan"]
    local = {"bf16": (inputs["rows"],), "mxfp8": (inputs["rows_fp8"], inputs["rows_scale"])}
    recv = {
        "bf16": (inputs["received"],),
        "mxfp8": (inputs["received_fp8"], inputs["received_scale"]),
    }
    row_bytes = {"bf16": 2 * hidden, "mxfp8": hidden + hidden // BLOCK_SIZE}
    cases = []

    def add(record: dict, fn: Callable, *args):
        call_fn = on_ranks(mesh, fn)
        label = f"ep{degree} {record['exchange']} {record['pass']} {record['wire']}"
        cases.append(
            dict(record=dict(ep=degree, **record), call=lambda: call_fn(*args), label=label)
        )

    add(
        {"exchange": "exchange_plan", "pass": "fwd", "wire": "int32", "op": "exchange_plan"},
        lambda plan: exchange_plan(plan, degree, "ep"),
        inputs["plan"],
    )
    for wire in WIRES:
        slot_bytes = degree * plan_stats["buffer_rows"] * row_bytes[wire]
        sizes = dict(
            row_bytes=row_bytes[wire],
            buffer_bytes=slot_bytes,  # per rank, the all-to-all's slots
            bus_bytes=slot_bytes * (degree - 1) // degree,  # leaving each rank
            payload_bytes=plan_stats["rows_to_peers_mean"] * row_bytes[wire],
        )
        add(
            {"exchange": "dense_all_to_all", "pass": "-", "wire": wire, "op": "all_to_all"} | sizes,
            dense,
            recv[wire],
        )
        for exchange, direction in (
            ("dispatch", "fwd"),
            ("dispatch", "bwd"),
            ("combine", "fwd"),
            ("combine", "bwd"),
        ):
            # dispatch fwd and combine bwd send local rows to the owners; the other two return
            # the receiver's rows to their sources.
            sends = (exchange, direction) in (("dispatch", "fwd"), ("combine", "bwd"))
            op = send if sends else back
            record = {
                "exchange": exchange,
                "pass": direction,
                "wire": wire,
                "op": "send_rows" if sends else "return_rows",
                "in_layer": IN_LAYER[(exchange, direction, wire)],
                **sizes,
            }
            if direction == "bwd" and wire == "bf16":
                # the transpose of the forward op, whose input is the other side's buffer
                forward = back if sends else send
                primal = recv["bf16"][0] if sends else local["bf16"][0]
                cotangent = local["bf16"][0] if sends else recv["bf16"][0]
                add(record, transpose_of(forward), xplan, primal, cotangent)
            else:
                add(record, op, xplan, *(local if sends else recv)[wire])
    return cases


def exchange_rates(records: list[dict]) -> None:
    """Each timed exchange record's bus bandwidth, payload rate and ratio to the dense
    all-to-all of the same wire and degree."""
    dense = {
        (r["ep"], r["wire"]): r["ms"]
        for r in records
        if r["exchange"] == "dense_all_to_all" and "ms" in r
    }
    for r in records:
        if "ms" not in r or "buffer_bytes" not in r:
            continue
        seconds = r["ms"] / 1e3
        r["busbw_GBps"] = r["bus_bytes"] / seconds / 1e9 if r["ep"] > 1 else None
        r["payload_GBps"] = r["payload_bytes"] / seconds / 1e9 if r["ep"] > 1 else None
        reference = dense.get((r["ep"], r["wire"]))
        r["ratio_to_dense"] = r["ms"] / reference if reference else None


# ---------------------------------------------------------------------------------- layer
def layer_step(graphdef, mesh) -> Callable:
    """jit of step(params, rest, x, dy) -> (loss, tokens per expert, d x, d params) with
    loss = sum(y * dy) + the auxiliary losses: `expert_parallel_forward` over `mesh`, or the
    single-device layer when mesh is None."""

    def loss(params, x, rest, dy):
        model = nnx.merge(graphdef, params, rest)
        if mesh is None:
            y, aux = model(x)
        else:
            y, aux = expert_parallel_forward(model, x, mesh)
        value = jnp.sum(y.astype(F32) * dy.astype(F32)) + jnp.sum(aux.total_loss)
        return value, aux.tokens_per_expert

    def step(params, rest, x, dy):
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (value, counts), (d_params, d_x) = grad(params, x, rest, dy)
        return value, counts, d_x, d_params

    return jax.jit(step)


def layer_cases(shape, weights, mesh, tokens_per_device: int, args) -> list[dict]:
    """The training step of each dispatch variant: single-device (mesh None) or expert-parallel
    over `mesh` with T tokens per device."""
    base_graphdef, params, rest = weights
    batch, seq_len = token_layout(shape, tokens_per_device)
    degree = 1 if mesh is None else mesh.shape["ep"]
    if mesh is None:  # the weights stay where they were made
        tokens = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:  # one placed copy serves every variant (the same parameters)
        tokens = NamedSharding(mesh, P(mesh.axis_names))
        placed = place_on_mesh(nnx.merge(base_graphdef, params, rest), mesh)
        params, rest = nnx.split(placed, nnx.Param, ...)[1:]
        del placed
    x_shape = (degree * batch, seq_len, shape.hidden_size)
    x = random_tokens(jax.random.key(1), x_shape, tokens)
    dy = random_tokens(jax.random.key(2), x_shape, tokens)
    cases = []
    for wire in args.dispatch:
        config = layer_config(shape.config, wire, args.experts)
        graphdef = variant_graphdef(shape, config)
        step = layer_step(graphdef, mesh)
        impl = "single_device" if mesh is None else "expert_parallel"
        cases.append(
            dict(
                record=dict(
                    impl=impl,
                    ep=degree,
                    devices=degree,
                    dispatch=wire,
                    experts=config.expert_precision,
                    expert_row_alignment=config.expert_row_alignment,
                    tokens_per_device=tokens_per_device,
                ),
                call=lambda step=step: step(params, rest, x, dy),
                label=f"{impl} ep{degree} {wire}",
            )
        )
    return cases


def layer_rates(records: list[dict]) -> None:
    """Tokens/s (per device and in all) and the weak-scaling efficiency of each timed layer
    record: its per-device tokens/s over the single device's, same dispatch variant."""
    single = {r["dispatch"]: r["ms"] for r in records if r["impl"] == "single_device" and "ms" in r}
    for r in records:
        if "ms" not in r:
            continue
        per_device = r["tokens_per_device"] / (r["ms"] / 1e3)
        r["tokens_per_s_per_device"] = per_device
        r["tokens_per_s"] = per_device * r["devices"]
        reference = single.get(r["dispatch"])
        r["efficiency"] = reference / r["ms"] if reference else None


# -------------------------------------------------------------------------------- reporting
def environment() -> dict:
    """Device, versions and date of the run."""
    device = jax.devices()[0]
    return dict(
        benchmark="ep",
        date=datetime.date.today().isoformat(),
        time=datetime.datetime.now().isoformat(timespec="seconds"),
        platform=device.platform,
        device=device.device_kind,
        device_count=jax.device_count(),
        on_cpu=device.platform == "cpu",
        note="host (CPU) devices: a check of the script, not a measurement of the exchange"
        if device.platform == "cpu"
        else None,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax=jax.__version__,
        flax=flax.__version__,
        python=platform.python_version(),
    )


def print_summary(result: dict) -> None:
    """The exchange cases (ms, ratio to the dense all-to-all, bus and payload GB/s) and the
    layer's weak scaling."""
    where = "CPU host devices (not GPU times)" if result["on_cpu"] else result["device"]
    print(
        f"\n== {result['shape']['name']}, T = {result['shape']['tokens_per_device']} per "
        f"device, on {where} =="
    )
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    if result["exchange"]:
        print(
            "\n-- exchange per rank: ms (median), x dense = ms / dense all_to_all of the same "
            "buffers, bus GB/s, payload GB/s --"
        )
        print(
            f"{'ep':>3s} {'case':24s} {'wire':6s} {'ms':>9s} {'x dense':>8s} {'bus GB/s':>9s} "
            f"{'payload':>8s}"
        )
        for r in result["exchange"]:
            name = f"{r['exchange']} {r['pass']}".replace(" -", "")
            if "ms" not in r:
                print(f"{r['ep']:3d} {name:24s} {r['wire']:6s} FAILED {r.get('error', '')[:80]}")
                continue
            print(
                f"{r['ep']:3d} {name:24s} {r['wire']:6s} {r['ms']:9.3f} "
                f"{fmt(r.get('ratio_to_dense'), '8.2f'):>8s} "
                f"{fmt(r.get('busbw_GBps'), '9.1f'):>9s} {fmt(r.get('payload_GBps'), '8.1f'):>8s}"
            )
    if result["layer"]:
        print(
            "\n-- layer train step (fwd + bwd): ms, tokens/s per device, weak-scaling "
            "efficiency vs the single device --"
        )
        print(
            f"{'impl':16s} {'ep':>3s} {'dispatch':8s} {'experts':7s} {'ms':>9s} "
            f"{'tok/s/dev':>11s} {'eff.':>6s}"
        )
        for r in result["layer"]:
            head = f"{r['impl']:16s} {r['ep']:3d} {r['dispatch']:8s} {r['experts']:7s}"
            if "ms" not in r:
                print(f"{head} FAILED {r.get('error', '')[:80]}")
                continue
            print(
                f"{head} {r['ms']:9.3f} {r['tokens_per_s_per_device']:11.0f} "
                f"{fmt(r.get('efficiency'), '6.2f'):>6s}"
            )
    for e in result["errors"]:
        print(f"FAILED {e}")


def write(result: dict, path: str) -> None:
    exchange_rates(result["exchange"])
    layer_rates(result["layer"])
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def default_degrees() -> list[int]:
    """Every power of two up to the device count."""
    degrees, d = [], 1
    while d <= jax.device_count():
        degrees.append(d)
        d *= 2
    return degrees


def main(argv=None) -> dict:
    """Parse the command line (`argv`: None for sys.argv), run the parts for every degree,
    writing the JSON after each, print the summary; returns the result (with `path`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3_30b", choices=list(ALL_SHAPES))
    parser.add_argument(
        "--tokens-per-device", type=int, default=None, help="T (default: the shape's tokens)"
    )
    parser.add_argument(
        "--ep",
        default=None,
        help="comma-separated expert-parallel degrees (default: every power of two up to the "
        "device count)",
    )
    parser.add_argument("--dispatch", default=",".join(WIRES), help="layer dispatch variants")
    parser.add_argument("--experts", default="bf16", choices=WIRES, help="routed experts")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--iters", type=int, default=1, help="the fewest calls per timed run")
    parser.add_argument(
        "--min-window", type=float, default=0.1, help="seconds: the shortest timed run"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="", help="added to the result file name")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    shape = ALL_SHAPES[args.shape]
    tokens_per_device = args.tokens_per_device or shape.num_tokens
    degrees = [int(d) for d in args.ep.split(",")] if args.ep else default_degrees()
    args.dispatch = [w for w in args.dispatch.split(",") if w]
    parts = [p for p in args.parts.split(",") if p]
    for value, allowed in ((args.dispatch, WIRES), (parts, PARTS)):
        if set(value) - set(allowed):
            parser.error(f"unknown {sorted(set(value) - set(allowed))}; choose from {allowed}")
    if any(d < 1 or d > jax.device_count() for d in degrees):
        parser.error(f"--ep {degrees}: only {jax.device_count()} devices")
    batch, seq_len = token_layout(shape, tokens_per_device)
    os.makedirs(args.out, exist_ok=True)
    path = (
        os.path.join(
            args.out,
            f"ep_{datetime.date.today().isoformat()}" + (f"_{args.tag}" if args.tag else ""),
        )
        + ".json"
    )
    result = dict(
        **environment(),
        shape=dict(
            name=shape.name,
            hidden=shape.hidden_size,
            tokens_per_device=tokens_per_device,
            batch_per_device=batch,
            seq_len=seq_len,
            **{
                k: v
                for k, v in vars(shape.config).items()
                if isinstance(v, (int, float, str, type(None)))
            },
        ),
        degrees=degrees,
        experts=args.experts,
        dispatch_variants=args.dispatch,
        plans=[],
        exchange=[],
        layer=[],
        errors=[],
        method=f"median of {args.repeats} timed runs of back-to-back calls (>= {args.iters} "
        f"calls and >= {args.min_window} s each, every device synchronised), the cases of one "
        "degree and part in turns, each timed run after as many untimed calls of the same "
        "case (benchmarks/timing.py); host wall time",
    )
    log(
        f"ep benchmark on {jax.device_count()} x {result['device']} ({result['platform']}): "
        f"{shape.name}, T = {tokens_per_device} per device, degrees {degrees}, parts {parts}"
    )
    weights = init_weights(shape)
    graphdef = weights[0]
    if "layer" in parts:
        log("layer: single device")
        cases = layer_cases(shape, weights, None, tokens_per_device, args)
        warm_and_time(cases, args)
        result["layer"] += [c["record"] for c in cases]
        del cases
        write(result, path)
    for degree in degrees:
        mesh = mesh_of(degree)
        if shape.config.num_experts % degree:
            result["errors"].append(dict(ep=degree, error="experts do not split"))
            continue
        if "exchange" in parts:
            log(f"ep {degree}: exchange")
            try:
                config = layer_config(shape.config, "mxfp8", args.experts)
                router = nnx.merge(graphdef, *weights[1:]).router
                inputs, plan_stats = exchange_setup(shape, config, router, mesh, tokens_per_device)
                result["plans"].append(plan_stats)
                cases = exchange_cases(inputs, mesh, plan_stats, shape.hidden_size)
                warm_and_time(cases, args)
                result["exchange"] += [c["record"] for c in cases]
            except Exception as e:  # the other parts and degrees still run
                result["errors"].append(dict(ep=degree, part="exchange", error=error_text(e)))
                log(f"ep {degree}: exchange FAILED {error_text(e)}")
            inputs = cases = None
            gc.collect()
            write(result, path)
        if "layer" in parts:
            log(f"ep {degree}: layer")
            try:
                cases = layer_cases(shape, weights, mesh, tokens_per_device, args)
                warm_and_time(cases, args)
                result["layer"] += [c["record"] for c in cases]
            except Exception as e:
                result["errors"].append(dict(ep=degree, part="layer", error=error_text(e)))
                log(f"ep {degree}: layer FAILED {error_text(e)}")
            cases = None
            gc.collect()
            write(result, path)
    write(result, path)
    print_summary(result)
    print(f"wrote {path}")
    return dict(result, path=path)


if __name__ == "__main__":
    main()
