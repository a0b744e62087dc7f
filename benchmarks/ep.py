"""Expert-parallel benchmark: the token exchange of the dispatch and combine, bf16 vs MXFP8 on
the wire, next to a dense all-to-all of a buffer of the same shape and dtype, and the whole
layer's weak scaling.

    python -m benchmarks.ep [--shape qwen3_30b] [--tokens-per-device T]
        [--ep 1,2] [--dispatch bf16,mxfp8] [--experts bf16] [--parts exchange,layer]
        [--transports dense,ragged] [--ragged-pieces 128,512] [--iters 1] [--min-window 0.1]
        [--repeats 5] [--profile] [--tag TAG] [--out DIR]

On N devices (2 H200s: `--ep` defaults to every power of two up to the device count), for each
expert-parallel degree R in --ep, on a ("data", "ep") = (1, R) mesh of the first R devices, in
one process:
  exchange  the layer's routing (router, plan, `exchange_plan`) of random tokens, T per rank,
            builds every rank's plan (the MXFP8 layer's 32-row expert alignment; C = M, the
            local buffer's rows, is the return's room per peer); then, timed in turns
            (`benchmarks.timing.timed_runs`), inside `jax.shard_map`, the exchange alone as
            `jaxmoe.exchange` runs it in the layer (`ExchangedRoute.to_experts` / `to_tokens`):
              dispatch fwd  bf16   `send_tokens` of the tokens [T, H] (deduplicated: each token
                                   once per peer owning any of its experts, in [R * T, H]
                                   slots, then copied into its expert rows on the receiver)
                            mxfp8  `jaxmoe.ops.quantize.quantize(tokens, axis=1)` + one
                                   `send_tokens` of the copy: its e4m3 data [T, H] and e8m0
                                   scales [T, H/32] packed in one uint8 row of H + H/32 bytes
                                   (`jaxmoe.wire.pack_rows`; the layer quantizes right before
                                   sending, so the quantize is INSIDE this case's time; the
                                   `quantize` record times it alone, for the exchange-only share)
              dispatch bwd  bf16   `return_rows` of the receiver's gradient rows [R * C, H] to
                                   their sources (the layer's `_return`; the `combine` that
                                   follows on the token's rank is layer compute, not timed)
              combine fwd   bf16   `return_rows` of the expert outputs [R * C, H] (idem)
              combine bwd   bf16   `send_tokens` of the token-level output gradient [T, H]
                            mxfp8  quantize + `send_tokens`, as dispatch fwd mxfp8
                                   (combine_bwd_dtype "mxfp8")
            The returns are bf16 in every layer variant, so they have no MXFP8 case. These and
            `exchange_plan` run once per transport of --transports ("transport" in the
            records: "dense", or "ragged/U" once per U of --ragged-pieces, the pieces a peer).
            Also timed: `quantize` of the [T, H] tokens alone, and the references: a dense
            `jax.lax.all_to_all` of a buffer of each wire's shape and dtype, per rank
            ("buffer" in the records): tokens [R * T, H] bf16, tokens [R * T, H + H/32] uint8
            (MXFP8 packed), rows [R * C, H] bf16; at ep > 1 also of the payload's bytes alone
            ("tokens_payload", "rows_payload": the mean real rows leaving a rank, split over
            the other ranks, rounded up to 8 a peer). Reported: ms, the ratio to the dense
            all-to-all of the same buffer (`ratio_to_dense`) and to that of the payload alone
            (`ratio_to_payload_all_to_all`, the measure for a transport that moves only the
            real rows), the bus bandwidth ((R - 1) / R of the slot buffer
            leaves each rank) and the payload rate (the rows that really leave a rank, mean over
            ranks: for token sends the tokens sent to the other ranks, `token_send < T` in their
            slots; for returns the receiver's real rows, no alignment padding, of the other
            ranks' tokens). The wires differ only in the bytes per row (2H vs H + H/32).
  layer     the whole layer's training step, jitted: loss = sum(y * dy) + the auxiliary losses,
            gradients w.r.t. x and every parameter (all returned, with the token counts), of
            `expert_parallel_forward` at ep = R on R devices with T tokens per device, next to
            the plain single-device layer (`MoE.__call__`) on ONE device with T tokens, timed
            once before the degrees. Weak-scaling efficiency = per-device tokens/s at ep = R /
            tokens/s of the single device. Dispatch variants: bf16, and MXFP8
            (dispatch_dtype and combine_bwd_dtype "mxfp8", 32-row alignment); routed experts in
            bf16 unless --experts mxfp8; each expert-parallel step once per --transports entry
            (`jaxmoe.exchange.TRANSPORTS`: "dense", the default, and "ragged" at jaxmoe's
            `PIECES_PER_PEER`).
Sizes: `--shape` from `jaxmoe.shapes`, or deepseek_v3_full (DeepSeek-V3's MoE layer: H 7168,
256 experts of F 2048, top-8 sigmoid with 8 groups / top-4, expert bias, one shared expert), or
the CPU smoke sizes tiny / tiny_deepseek; T = --tokens-per-device (default: the shape's tokens).
On CPU (e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8) it runs at the tiny sizes as a
check of the script; the JSON's `platform` says where it ran.

Writes ep_<date>[_tag].json to --out after every degree, and the plot ep_<date>[_tag].png next to
it (one panel per degree: the four exchange passes' ms, bf16 and MXFP8 bars with the dense
all-to-all of the same buffer beside each, the quantize share of the MXFP8 bars hatched; a last
panel: the layer's weak-scaling efficiency per degree, bf16 and MXFP8 dispatch; needs
matplotlib, skipped with a printed note without it), and prints a summary table at the end.
The JSON: the environment (device, versions, `on_cpu`, `method`), `shape`, `degrees`,
`transports`, `exchange_variants`, `plot` (the PNG's path, or null without matplotlib),
`errors`, and
  plans     per degree: T, `token_slot_rows` R * T, `buffer_rows` C, `receiver_rows` R * C,
            per-rank lists and means of the tokens sent (all peers / the other ranks), the
            (token, expert) rows to the other ranks (padded / real), the real rows returned to
            the other ranks and the rows received, `rows_per_token_to_peers` (real rows per
            token sent to a peer: what the deduplication saves on the wire)
  exchange  one record per case: ep, exchange (dispatch / combine / dense_all_to_all /
            quantize / exchange_plan), pass (fwd / bwd / -), wire (bf16 / mxfp8 / int32), op,
            in_layer, includes_quantize; transport and pieces_per_peer (the layer's exchanges
            and plans); for transfers buffer (tokens / rows / tokens_payload / rows_payload),
            row_bytes, slot_rows, buffer_bytes (the all-to-all's slots per rank), bus_bytes
            (leaving each rank), payload_rows and payload_bytes (mean per rank); compile_s, ms
            (median), ms_runs, busbw_GBps and payload_GBps (null at ep 1: nothing leaves),
            ratio_to_dense, ratio_to_payload_all_to_all (the layer's exchanges, ep > 1)
  layer     one record per step: impl (single_device / expert_parallel), ep, devices,
            dispatch, experts, expert_row_alignment, tokens_per_device, compile_s, ms, ms_runs,
            tokens_per_s_per_device, tokens_per_s, efficiency; with --profile, `profile`
            (`op_profile`: the first device's busy and span ms per step, the NCCL kernels' ms,
            the top kernels by time; on CPU the XLA op records)
(a case that failed has `error` instead of its times).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import report
from benchmarks.report import add_output_arguments, error_text, log
from benchmarks.timing import gpu_stream_events, profile_events, sync, timed_runs
from jaxmoe import MoE, MoEConfig
from jaxmoe.config import MXFP8_ALIGNMENTS
from jaxmoe.exchange import (
    PIECES_PER_PEER,
    TRANSPORTS,
    exchange_plan,
    return_rows,
    send_tokens,
)
from jaxmoe.expert_parallel import expert_parallel_forward, place_on_mesh
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.quantize import quantize
from jaxmoe.plan import make_plan
from jaxmoe.shapes import DEEPSEEK_V3_FULL, SHAPES, TINY_SHAPES, LayerShape
from jaxmoe.wire import pack_rows

BF16, F32 = jnp.bfloat16, jnp.float32
AXES = ("data", "ep")
WIRES = ("bf16", "mxfp8")
PARTS = ("exchange", "layer")
ALL_SHAPES = {**SHAPES, DEEPSEEK_V3_FULL.name: DEEPSEEK_V3_FULL, **TINY_SHAPES}
# Where each exchange case sits in the layer's training step (the returns are bf16 in every
# variant, so they have no MXFP8 case).
IN_LAYER = {
    ("dispatch", "fwd", "bf16"): "the tokens to the experts (dispatch_dtype bf16)",
    ("dispatch", "fwd", "mxfp8"): "the tokens quantized and sent as MXFP8 (dispatch_dtype mxfp8)",
    ("dispatch", "bwd", "bf16"): "the expert rows' gradient back to the tokens' ranks, before "
    "its combine there (every variant)",
    ("combine", "fwd", "bf16"): "the expert outputs back to the tokens' ranks, before the "
    "combine there (every variant)",
    ("combine", "bwd", "bf16"): "y's gradient to the experts (combine_bwd_dtype bf16)",
    ("combine", "bwd", "mxfp8"): "y's gradient quantized and sent as MXFP8 "
    "(combine_bwd_dtype mxfp8)",
}


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
def exchange_variants(transports: list[str], ragged_pieces: list[int]) -> list[tuple[str, int]]:
    """(transport, pieces a peer) of each timed exchange variant: "dense" once, "ragged" once
    per pieces count."""
    variants = []
    for transport in transports:
        pieces = ragged_pieces if transport == "ragged" else [PIECES_PER_PEER]
        variants += [(transport, u) for u in pieces]
    return variants


def variant_label(transport: str, pieces: int) -> str:
    return f"ragged/{pieces}" if transport == "ragged" else transport


def exchange_setup(
    shape: LayerShape,
    config: MoEConfig,
    router,
    mesh,
    tokens_per_device: int,
    variants: list[tuple[str, int]],
):
    """Every rank's routing of its own random tokens: (per-rank inputs of the exchange cases,
    stacked on a leading rank axis, with an `exchange_plan` per variant in `xplans`; the plan's
    statistics)."""
    degree, hidden = mesh.shape["ep"], shape.hidden_size
    batch, seq_len = token_layout(shape, tokens_per_device)
    spec = NamedSharding(mesh, P(mesh.axis_names))
    x_shape = (degree * batch, seq_len, hidden)
    x = random_tokens(jax.random.key(1), x_shape, spec)
    dy = random_tokens(jax.random.key(2), x_shape, spec)
    router_graphdef, router_state = nnx.split(router)
    router_state = jax.device_put(router_state, NamedSharding(mesh, P()))
    impl = "auto"
    local_experts = config.num_experts // degree

    def rank_setup(state, x, dy):
        tokens, grad = x.reshape(-1, hidden), dy.reshape(-1, hidden)
        num_tokens = tokens.shape[0]
        _, routing = nnx.merge(router_graphdef, state)(tokens, impl, x.shape[:-1])
        plan = make_plan(routing, config)
        xplan = exchange_plan(plan, degree, "ep")
        rank = jax.lax.axis_index("ep")
        mx = quantize(tokens, axis=1, impl=impl)
        owner = jnp.arange(config.num_experts) // local_experts
        to_peers = owner != rank
        sent = xplan.token_send.reshape(degree, num_tokens) < num_tokens  # [peer, slot]
        real = xplan.recv_token < degree * num_tokens  # receiver rows holding a token's copy
        from_peers = real & (xplan.recv_token // num_tokens != rank)
        return dict(
            plan=plan,
            xplans={
                variant_label(t, u): exchange_plan(plan, degree, "ep", t, u) for t, u in variants
            },
            tokens=tokens,  # dispatch fwd: the layer's tokens [T, H]
            grad=grad,  # combine bwd: the token-level output gradient [T, H]
            outputs=send_tokens(tokens, xplan, "ep"),  # combine fwd: expert outputs [R * C, H]
            row_grad=send_tokens(grad, xplan, "ep"),  # dispatch bwd: receiver gradient rows
            # The dense references' buffers: the token slots [R * T, ...] of each wire.
            token_slots=jnp.tile(tokens, (degree, 1)),
            token_slots_mxfp8=jnp.tile(pack_rows(mx), (degree, 1)),
            tokens_sent=jnp.sum(sent),
            tokens_to_peers=jnp.sum(jnp.where(jnp.arange(degree)[:, None] != rank, sent, False)),
            rows_to_peers=jnp.sum(jnp.where(to_peers, plan.group_sizes, 0)),
            real_rows_to_peers=jnp.sum(jnp.where(to_peers, plan.tokens_per_group, 0)),
            real_rows_returned=jnp.sum(from_peers),
            rows_received=jnp.sum(xplan.group_sizes),
        )

    tokens = P(mesh.axis_names)
    per_rank = jax.shard_map(
        lambda state, x, dy: jax.tree.map(lambda a: a[None], rank_setup(state, x, dy)),
        mesh=mesh,
        in_specs=(P(), tokens, tokens),
        out_specs=tokens,
        check_vma=False,
    )
    inputs = jax.jit(per_rank)(router_state, x, dy)
    counts = (
        "tokens_sent",
        "tokens_to_peers",
        "rows_to_peers",
        "real_rows_to_peers",
        "real_rows_returned",
        "rows_received",
    )
    stats = {name: [int(v) for v in np.asarray(inputs.pop(name))] for name in counts}
    mean = lambda name: float(np.mean(stats[name]))
    num_rows = inputs["plan"].row_slot.shape[1]
    plan_stats = dict(
        ep=degree,
        tokens_per_rank=tokens_per_device,  # T
        token_slot_rows=degree * tokens_per_device,  # R * T: a token send's slots, per rank
        buffer_rows=num_rows,  # C = M: the local expert buffer, the return's room per peer
        receiver_rows=degree * num_rows,  # R * C: the receiver buffer, a return's slots
        expert_row_alignment=config.expert_row_alignment,
        tokens_sent_mean=mean("tokens_sent"),
        tokens_to_peers_mean=mean("tokens_to_peers"),
        rows_to_peers_mean=mean("rows_to_peers"),
        real_rows_to_peers_mean=mean("real_rows_to_peers"),
        real_rows_returned_mean=mean("real_rows_returned"),
        # (token, expert) rows per token sent to a peer: what the deduplication saves
        rows_per_token_to_peers=mean("real_rows_to_peers") / mean("tokens_to_peers")
        if mean("tokens_to_peers")
        else None,
        rows_received_max=max(stats["rows_received"]),
        **stats,
    )
    return inputs, plan_stats


def payload_room(payload_rows: float, degree: int, room: int) -> int:
    """Rows a peer of a dense all-to-all that moves about `payload_rows` real rows out of a rank
    (split evenly over the other ranks, rounded up to 8, at most the full room)."""
    per_peer = -(-int(np.ceil(payload_rows)) // max(degree - 1, 1))
    return min(room, -(-per_peer // 8) * 8)


def exchange_cases(
    inputs: dict, mesh, plan_stats: dict, hidden: int, variants: list[tuple[str, int]]
) -> list[dict]:
    """The timed exchange cases of one degree (each a record and a call): the plan, the quantize
    and the layer's exchanges once per variant (`exchange_variants`), and the dense all-to-all
    references, of the full rooms and (ep > 1) of the payload alone."""
    degree = mesh.shape["ep"]
    row_bytes = {"bf16": 2 * hidden, "mxfp8": hidden + hidden // BLOCK_SIZE}
    # Per buffer: (rows per peer, mean payload rows leaving a rank).
    rooms = {
        "tokens": (plan_stats["tokens_per_rank"], plan_stats["tokens_to_peers_mean"]),
        "rows": (plan_stats["buffer_rows"], plan_stats["real_rows_returned_mean"]),
    }
    buffers = dict(rooms)
    if degree > 1:  # a dense all-to-all of the payload's bytes alone ("<room>_payload")
        for name, (room, payload) in rooms.items():
            buffers[f"{name}_payload"] = (payload_room(payload, degree, room), payload)
    cases = []

    def sizes(buffer: str, wire: str) -> dict:
        per_peer, payload_rows = buffers[buffer]
        return dict(
            buffer=buffer,
            row_bytes=row_bytes[wire],
            slot_rows=degree * per_peer,
            buffer_bytes=degree * per_peer * row_bytes[wire],  # per rank, the all-to-all's slots
            bus_bytes=(degree - 1) * per_peer * row_bytes[wire],  # leaving each rank
            payload_rows=payload_rows,
            payload_bytes=payload_rows * row_bytes[wire],
        )

    def add(record: dict, fn: Callable, *args):
        call_fn = on_ranks(mesh, fn)
        label = f"ep{degree} {record['exchange']} {record['pass']} {record['wire']}"
        label += f" {record.get('buffer', '')} {record.get('transport', '')}".rstrip()
        cases.append(
            dict(record=dict(ep=degree, **record), call=lambda: call_fn(*args), label=label)
        )

    def dense(*bufs):
        return tuple(
            jax.lax.all_to_all(
                b.reshape((degree, -1) + b.shape[1:]), "ep", 0, 0, tiled=True
            ).reshape(b.shape)
            for b in bufs
        )

    def send_bf16(xplan, x):  # as the layer: the rows copied on the dispatch kernel
        return send_tokens(x, xplan, "ep", impl="auto")

    def send_mxfp8(xplan, x):  # as the layer: quantize the tokens, then send the copy
        copy = quantize(x, axis=1, impl="auto")
        return jax.tree.leaves(send_tokens(copy, xplan, "ep", impl="auto"))

    def back(xplan, rows):
        return return_rows(rows, xplan, "ep")

    def quantize_only(x):  # the part of the MXFP8 token sends that is not the exchange
        mx = quantize(x, axis=1, impl="auto")
        return mx.data, mx.scale

    add(
        {"exchange": "quantize", "pass": "-", "wire": "mxfp8", "op": "quantize"},
        quantize_only,
        inputs["tokens"],
    )
    slots = {
        ("tokens", "bf16"): inputs["token_slots"],
        ("tokens", "mxfp8"): inputs["token_slots_mxfp8"],
        ("rows", "bf16"): inputs["outputs"],
    }
    for (room, wire), buf in slots.items():
        record = {"exchange": "dense_all_to_all", "pass": "-", "wire": wire, "op": "all_to_all"}
        for buffer in (room, f"{room}_payload"):
            if buffer in buffers:
                rows = degree * buffers[buffer][0]
                add(record | sizes(buffer, wire), dense, buf[:, :rows])
    token_sends = {
        "bf16": ("send_tokens", send_bf16),
        "mxfp8": ("quantize+send_tokens", send_mxfp8),
    }
    for transport, pieces in variants:
        label = variant_label(transport, pieces)
        on_variant = dict(
            transport=label, pieces_per_peer=pieces if transport == "ragged" else None
        )
        add(
            {"exchange": "exchange_plan", "pass": "fwd", "wire": "int32", "op": "exchange_plan"}
            | on_variant,
            lambda plan, t=transport, u=pieces: exchange_plan(plan, degree, "ep", t, u),
            inputs["plan"],
        )
        for exchange, direction, wire, source in (
            ("dispatch", "fwd", "bf16", "tokens"),
            ("dispatch", "fwd", "mxfp8", "tokens"),
            ("dispatch", "bwd", "bf16", "row_grad"),
            ("combine", "fwd", "bf16", "outputs"),
            ("combine", "bwd", "bf16", "grad"),
            ("combine", "bwd", "mxfp8", "grad"),
        ):
            sends = source in ("tokens", "grad")
            op, fn = token_sends[wire] if sends else ("return_rows", back)
            record = {
                "exchange": exchange,
                "pass": direction,
                "wire": wire,
                "op": op,
                "includes_quantize": wire == "mxfp8",
                "in_layer": IN_LAYER[(exchange, direction, wire)],
                **on_variant,
                **sizes("tokens" if sends else "rows", wire),
            }
            add(record, fn, inputs["xplans"][label], inputs[source])
    return cases


def exchange_rates(records: list[dict]) -> None:
    """Each timed exchange record's bus bandwidth, payload rate, ratio to the dense all-to-all
    of the same buffer (shape and wire) and degree (`ratio_to_dense`) and to the dense
    all-to-all of its payload's bytes alone (`ratio_to_payload_all_to_all`; ep > 1)."""
    dense = {
        (r["ep"], r["buffer"], r["wire"]): r["ms"]
        for r in records
        if r["exchange"] == "dense_all_to_all" and "ms" in r
    }
    for r in records:
        if "ms" not in r or "buffer_bytes" not in r:
            continue
        seconds = r["ms"] / 1e3
        r["busbw_GBps"] = r["bus_bytes"] / seconds / 1e9 if r["ep"] > 1 else None
        r["payload_GBps"] = r["payload_bytes"] / seconds / 1e9 if r["ep"] > 1 else None
        reference = dense.get((r["ep"], r["buffer"], r["wire"]))
        r["ratio_to_dense"] = r["ms"] / reference if reference else None
        if r["exchange"] != "dense_all_to_all":
            payload = dense.get((r["ep"], f"{r['buffer']}_payload", r["wire"]))
            r["ratio_to_payload_all_to_all"] = r["ms"] / payload if payload else None


# ---------------------------------------------------------------------------------- layer
def layer_step(graphdef, mesh, transport: str = "dense") -> Callable:
    """jit of step(params, rest, x, dy) -> (loss, tokens per expert, d x, d params) with
    loss = sum(y * dy) + the auxiliary losses: `expert_parallel_forward` over `mesh` (rows
    moved by `transport`), or the single-device layer when mesh is None."""

    def loss(params, x, rest, dy):
        model = nnx.merge(graphdef, params, rest)
        if mesh is None:
            y, aux = model(x)
        else:
            y, aux = expert_parallel_forward(model, x, mesh, transport=transport)
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
    impl = "single_device" if mesh is None else "expert_parallel"
    for wire in args.dispatch:
        config = layer_config(shape.config, wire, args.experts)
        graphdef = variant_graphdef(shape, config)
        for transport in ["-"] if mesh is None else args.transports:
            step = layer_step(graphdef, mesh, "dense" if mesh is None else transport)
            cases.append(
                dict(
                    record=dict(
                        impl=impl,
                        ep=degree,
                        devices=degree,
                        dispatch=wire,
                        transport=transport,
                        experts=config.expert_precision,
                        expert_row_alignment=config.expert_row_alignment,
                        tokens_per_device=tokens_per_device,
                    ),
                    call=lambda step=step: step(params, rest, x, dy),
                    label=f"{impl} ep{degree} {wire} {transport}",
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


PROFILE_STEPS = 3
PROFILE_TOP = 30


def op_profile(call: Callable, steps: int = PROFILE_STEPS) -> dict:
    """Where one device's time goes in a step: from a JAX profile of `steps` calls, the records
    of the first device's GPU streams (on CPU: its XLA op records) per step: busy ms (summed
    records, streams may overlap), span ms (first start to last end, over `steps`), the
    collectives' share (NCCL kernels), and the PROFILE_TOP kernels by time (name, HLO op,
    calls and ms per step)."""
    events = profile_events(call, runs=steps)
    events = gpu_stream_events(events) or [e for e in events if "hlo_op" in e.args]  # CPU: ops
    first = min(e.process for e in events)
    mine = [e for e in events if e.process == first]
    per_step = 1e-3 / steps
    by_name = {}
    for e in mine:
        key = (e.name[:120], str(e.args.get("hlo_op", ""))[:80])
        calls, us = by_name.get(key, (0, 0.0))
        by_name[key] = (calls + 1, us + e.dur_us)
    nccl = sum(e.dur_us for e in mine if "nccl" in e.name.lower())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:PROFILE_TOP]
    return dict(
        device=first,
        steps=steps,
        busy_ms=sum(e.dur_us for e in mine) * per_step,
        span_ms=(max(e.start_us + e.dur_us for e in mine) - min(e.start_us for e in mine))
        * per_step,
        collectives_ms=nccl * per_step,
        streams=sorted({e.thread for e in mine}),
        top=[
            dict(name=name, hlo_op=op, calls_per_step=calls / steps, ms=us * per_step)
            for (name, op), (calls, us) in top
        ],
    )


def profile_cases(cases: list[dict]) -> None:
    """`op_profile` of every timed case, into its record's `profile` (or `profile_error`)."""
    for case in cases:
        if "ms" not in case["record"]:
            continue
        try:
            case["record"]["profile"] = op_profile(case["call"])
            p = case["record"]["profile"]
            log(
                f"  {case['label']:32s} profile: busy {p['busy_ms']:.3f} ms/step, span "
                f"{p['span_ms']:.3f}, collectives {p['collectives_ms']:.3f}"
            )
        except Exception as e:  # the timings stand without it
            case["record"]["profile_error"] = error_text(e)


# -------------------------------------------------------------------------------- reporting
def environment() -> dict:
    """Device, versions and date of the run."""
    on_cpu = jax.devices()[0].platform == "cpu"
    return report.environment(
        "ep",
        device_count=jax.device_count(),
        on_cpu=on_cpu,
        note="host (CPU) devices: a check of the script, not a measurement of the exchange"
        if on_cpu
        else None,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
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
            "\n-- exchange per rank: ms (median), x dense = ms / dense all_to_all of a buffer of "
            "the same shape and wire, x payload = ms / dense all_to_all of the payload's bytes "
            "alone, bus GB/s, payload GB/s (MXFP8 token sends: quantize included) --"
        )
        print(
            f"{'ep':>3s} {'case':24s} {'transport':10s} {'wire':6s} {'buffer':14s} {'ms':>9s} "
            f"{'x dense':>8s} {'x payload':>9s} {'bus GB/s':>9s} {'payload':>8s}"
        )
        for r in result["exchange"]:
            name = f"{r['exchange']} {r['pass']}".replace(" -", "")
            head = (
                f"{r['ep']:3d} {name:24s} {r.get('transport', '-'):10s} {r['wire']:6s} "
                f"{r.get('buffer', '-'):14s}"
            )
            if "ms" not in r:
                print(f"{head} FAILED {r.get('error', '')[:80]}")
                continue
            print(
                f"{head} {r['ms']:9.3f} {fmt(r.get('ratio_to_dense'), '8.2f'):>8s} "
                f"{fmt(r.get('ratio_to_payload_all_to_all'), '9.2f'):>9s} "
                f"{fmt(r.get('busbw_GBps'), '9.1f'):>9s} {fmt(r.get('payload_GBps'), '8.1f'):>8s}"
            )
    if result["layer"]:
        print(
            "\n-- layer train step (fwd + bwd): ms, tokens/s per device, weak-scaling "
            "efficiency vs the single device --"
        )
        print(
            f"{'impl':16s} {'ep':>3s} {'dispatch':8s} {'transport':9s} {'experts':7s} {'ms':>9s} "
            f"{'tok/s/dev':>11s} {'eff.':>6s}"
        )
        for r in result["layer"]:
            head = (
                f"{r['impl']:16s} {r['ep']:3d} {r['dispatch']:8s} {r['transport']:9s} "
                f"{r['experts']:7s}"
            )
            if "ms" not in r:
                print(f"{head} FAILED {r.get('error', '')[:80]}")
                continue
            print(
                f"{head} {r['ms']:9.3f} {r['tokens_per_s_per_device']:11.0f} "
                f"{fmt(r.get('efficiency'), '6.2f'):>6s}"
            )
    for e in result["errors"]:
        print(f"FAILED {e}")


def plot(result: dict, path: str) -> None:
    """One panel per degree: the exchange cases' ms (bf16 and MXFP8 wires, the MXFP8 bars'
    quantize part hatched) with the dense all-to-all of the same buffer beside each; and a last
    panel of the layer's weak-scaling efficiency per degree and dispatch variant. Needs
    matplotlib (ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exchange = [r for r in result["exchange"] if "ms" in r]
    degrees = result["degrees"]
    passes = [("dispatch", "fwd"), ("dispatch", "bwd"), ("combine", "fwd"), ("combine", "bwd")]
    buffer_of = {
        p: "tokens" if p in (("dispatch", "fwd"), ("combine", "bwd")) else "rows" for p in passes
    }
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    bars = [  # (label, wire, transport variant (None: the dense all-to-all reference), colour)
        ("dense a2a bf16", "bf16", None, "lightsteelblue"),
        ("dense a2a MXFP8", "mxfp8", None, "navajowhite"),
    ]
    for i, variant in enumerate(result.get("exchange_variants", ["dense"])):
        bars += [
            (f"bf16 {variant}", "bf16", variant, palette[2 * i % len(palette)]),
            (f"MXFP8 {variant}", "mxfp8", variant, palette[(2 * i + 1) % len(palette)]),
        ]
    width = 0.8 / len(bars)
    fig, axes = plt.subplots(
        1, len(degrees) + 1, figsize=(4.2 * (len(degrees) + 1), 4.5), squeeze=False
    )
    axes = axes[0]
    where = "CPU host devices" if result["on_cpu"] else result["device"]
    for ax, degree in zip(axes, degrees):
        find = lambda **kv: next(
            (
                r
                for r in exchange
                if r["ep"] == degree and all(r.get(k) == v for k, v in kv.items())
            ),
            None,
        )
        quantize_ms = (find(exchange="quantize") or {}).get("ms")
        for i, (label, wire, variant, colour) in enumerate(bars):
            is_dense = variant is None
            xs, heights = [], []
            for j, (name, direction) in enumerate(passes):
                r = (
                    find(
                        exchange="dense_all_to_all", wire=wire, buffer=buffer_of[(name, direction)]
                    )
                    if is_dense
                    else find(exchange=name, **{"pass": direction}, wire=wire, transport=variant)
                )
                if r is not None and (not is_dense or find(exchange=name, wire=wire)):
                    xs.append(j + (i - (len(bars) - 1) / 2) * width)
                    heights.append(r["ms"])
            ax.bar(xs, heights, width, label=label, color=colour)
            if wire == "mxfp8" and not is_dense and quantize_ms and xs:
                ax.bar(
                    xs,
                    [min(quantize_ms, h) for h in heights],
                    width,
                    fill=False,
                    hatch="//",
                    edgecolor="black",
                    linewidth=0,
                    label="of which quantize" if variant == bars[3][2] else None,
                )
        ax.set_xticks(range(len(passes)))
        ax.set_xticklabels(
            [
                f"{n} {d}\n[{'R*T' if buffer_of[(n, d)] == 'tokens' else 'R*C'}, H]"
                for n, d in passes
            ],
            fontsize=8,
        )
        ax.set_ylabel("ms per call (median)")
        ax.set_title(f"exchange, ep = {degree}", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[-1]
    variants = [(w, t) for w in result["dispatch_variants"] for t in result["transports"]]
    width = 0.8 / max(1, len(variants))
    for i, (wire, transport) in enumerate(variants):
        xs, values = [], []
        for j, degree in enumerate(degrees):
            r = next(
                (
                    r
                    for r in result["layer"]
                    if r["impl"] == "expert_parallel"
                    and r["ep"] == degree
                    and r["dispatch"] == wire
                    and r["transport"] == transport
                ),
                None,
            )
            if r is not None and r.get("efficiency") is not None:
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                values.append(r["efficiency"])
        ax.bar(xs, values, width, label=f"{wire} dispatch, {transport}")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(degrees)))
    ax.set_xticklabels([f"ep {d}" for d in degrees])
    ax.set_ylabel("tokens/s per device / single device's")
    ax.set_title("layer train step: weak-scaling efficiency", fontsize=10)
    ax.legend(fontsize=7)
    fig.suptitle(
        f"{result['shape']['name']}, T = {result['shape']['tokens_per_device']} per device, "
        f"on {where}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_plot(result: dict, path: str) -> str | None:
    """`plot` to `path`, returned; None, with a printed note, when matplotlib is missing (or
    the plot fails: the measurements still get written)."""
    try:
        plot(result, path)
    except ImportError as e:
        log(f"no plot: matplotlib missing ({error_text(e)[:120]})")
        return None
    except Exception as e:  # a plotting failure must not lose the run's JSON
        log(f"no plot: plotting failed ({error_text(e)[:200]})")
        return None
    return path


def write(result: dict, path: str) -> None:
    """The rates, the plot (ep_<date>[_tag].png next to the JSON; `plot`: its path, or null
    without matplotlib) and the JSON at `path`."""
    exchange_rates(result["exchange"])
    layer_rates(result["layer"])
    result["plot"] = save_plot(result, os.path.splitext(path)[0] + ".png")
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
    parser.add_argument(
        "--transports",
        default="dense",
        help="row transports (`jaxmoe.exchange.TRANSPORTS`) of the exchange cases and layer steps",
    )
    parser.add_argument(
        "--ragged-pieces",
        default=str(PIECES_PER_PEER),
        help="pieces a peer of the ragged transport's exchange cases, comma-separated (one "
        "variant each; the layer steps take jaxmoe's PIECES_PER_PEER)",
    )
    parser.add_argument("--experts", default="bf16", choices=WIRES, help="routed experts")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--iters", type=int, default=1, help="the fewest calls per timed run")
    parser.add_argument(
        "--min-window", type=float, default=0.1, help="seconds: the shortest timed run"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile each layer step: the first device's kernels by time (`op_profile`)",
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    shape = ALL_SHAPES[args.shape]
    tokens_per_device = args.tokens_per_device or shape.num_tokens
    degrees = [int(d) for d in args.ep.split(",")] if args.ep else default_degrees()
    args.dispatch = [w for w in args.dispatch.split(",") if w]
    args.transports = [t for t in args.transports.split(",") if t]
    try:
        ragged_pieces = [int(u) for u in args.ragged_pieces.split(",") if u]
    except ValueError:
        parser.error(f"--ragged-pieces {args.ragged_pieces!r}: comma-separated integers")
    if not ragged_pieces or min(ragged_pieces) < 1:
        parser.error(f"--ragged-pieces {args.ragged_pieces!r}: positive integers")
    variants = exchange_variants(args.transports, ragged_pieces)
    parts = [p for p in args.parts.split(",") if p]
    for value, allowed in ((args.dispatch, WIRES), (parts, PARTS), (args.transports, TRANSPORTS)):
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
        transports=args.transports,
        exchange_variants=[variant_label(t, u) for t, u in variants],
        plans=[],
        plot=None,
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
        if args.profile:
            profile_cases(cases)
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
                inputs, plan_stats = exchange_setup(
                    shape, config, router, mesh, tokens_per_device, variants
                )
                result["plans"].append(plan_stats)
                cases = exchange_cases(inputs, mesh, plan_stats, shape.hidden_size, variants)
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
                if args.profile:
                    profile_cases(cases)
                result["layer"] += [c["record"] for c in cases]
            except Exception as e:
                result["errors"].append(dict(ep=degree, part="layer", error=error_text(e)))
                log(f"ep {degree}: layer FAILED {error_text(e)}")
            cases = None
            gc.collect()
            write(result, path)
    write(result, path)
    print_summary(result)
    print(f"wrote {path}" + (f" and {result['plot']}" if result["plot"] else " (no plot)"))
    return dict(result, path=path)


if __name__ == "__main__":
    main()
