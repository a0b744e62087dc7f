"""Per-stage device time of the MoE layer from a JAX profile.

Every kernel of the profile (GPU stream records; XLA:CPU op records on a machine without a GPU)
is traced back to the HLO instruction that launched it (the record's `hlo_op`, looked up in the
compiled module's text; else the kernel name, which XLA derives from the instruction name). The
instruction's op_name metadata carries the layer's named scopes (`jaxmoe.moe`: router, plan,
dispatch, fc1, activation, fc2, combine, shared_expert, aux_losses): the innermost one is the
stage ("other": outside the layer, e.g. the benchmark's loss), and `transpose(` marks the
backward pass (custom VJP rules included). The kind of work:
  gemm      the grouped-matmul Pallas kernels (gmm, tgmm, gmm_mxfp8, the FP8-blockwise and
            MXFP8-decode ones: jaxmoe/ops/pallas/, the bf16 ones also behind the router and
            the shared expert),
            unnamed Pallas kernels that write no 8-bit data, cuBLAS / Triton GEMM calls,
            fusions holding a dot;
  quantize  MXFP8 and FP8-blockwise (de)quantization: the quantize kernels, Pallas kernels
            writing fp8 / uint8 data, XLA ops under a jaxmoe quantize / dequantize function
            (op_name "jit(_quantize_impl)", ...);
  other     everything else (routing, sorting, the dispatch, combine and activation-backward
            kernels, gathers, elementwise, copies, the grouped matmuls' row tiles).
Kernels that XLA runs inside a command buffer (a CUDA graph) carry the buffer's name as their
`hlo_op` (a computation that the compiled module's text may not show): an XLA kernel is found
by its name, a Pallas kernel (jaxmoe names its kernels, `PALLAS_KERNEL_KINDS`) by its place
in the scheduled order of the module's Mosaic GPU custom calls (`MosaicSchedule`).
Records that cannot be traced back are "unattributed" and classified by kernel name alone.
"""

from __future__ import annotations

import collections
import itertools
import re
from typing import NamedTuple

from benchmarks.timing import TraceEvent, gpu_stream_events

STAGES = (
    "router",
    "plan",
    "dispatch",
    "fc1",
    "activation",
    "fc2",
    "combine",
    "shared_expert",
    "aux_losses",
)
_BYTE_DATA = re.compile(r"\b(f8e\w*|u8)\[")
_GEMM_KERNEL_NAME = re.compile(r"gemm|gmm|matmul|nvjet|xmma|cutlass|cublas", re.I)
_MOSAIC_KERNEL = "mosaic_gpu"
_GEMM_OPCODES = ("dot", "ragged-dot", "convolution")
# jaxmoe's Pallas kernels by name (a record is "<name>_mosaic_gpu_kernel") and their work.
PALLAS_KERNEL_KINDS = {
    "gmm": "gemm",
    "tgmm": "gemm",
    "gmm_mxfp8": "gemm",
    "gmm_fp8_blockwise": "gemm",
    "tgmm_fp8_blockwise": "gemm",
    "gmm_decode": "gemm",
    "gmm_dequantize": "gemm",
    "dense_narrow": "gemm",
    "quantize_rowwise": "quantize",
    "quantize_columnwise": "quantize",
    "dispatch_quantize": "quantize",
    "quantize_rowwise_1x128": "quantize",
    "quantize_columnwise_1x128": "quantize",
    "dispatch_quantize_1x128": "quantize",
    "quantize_128x128_transpose": "quantize",
    "quantize_1x128_transpose": "quantize",
    "quantize_1x128_transposed": "quantize",
    "requantize_1x128_transposed": "quantize",
    "weighted_swiglu_quantize_1x128_transpose": "quantize",
    "weighted_swiglu_backward_quantize_1x128_transpose": "quantize",
    "dispatch": "other",
    "combine": "other",
    "weighted_swiglu_forward": "other",
    "weighted_swiglu_backward": "other",
    "row_tiles": "other",
}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_SCOPE = re.compile(r"^(?:[\w-]+\()*([\w-]+)\)*$")


class Instruction(NamedTuple):
    """What the stage attribution needs of one HLO instruction."""

    name: str
    result_type: str  # e.g. "bf16[4096,7168]{1,0}" or a tuple of them
    opcode: str
    target: str  # custom_call_target ("" for other opcodes)
    op_name: str
    called: tuple  # names of the computations it calls (fusion bodies, ...)
    gemm_config: bool  # its backend config names a GEMM (Triton / cuBLAS fusions)


class HloModule(NamedTuple):
    """A compiled HLO module's instructions by name and its computations' instruction names."""

    name: str
    instructions: dict
    computations: dict
    entry: str = ""


def parse_hlo(text: str) -> HloModule:
    """Parse `jax.stages.Compiled.as_text()`: instructions with their result type, opcode,
    custom-call target, op_name and called computations."""
    module_name = re.match(r"HloModule\s+([\w.\-]+)", text)
    instructions, computations, current, entry = {}, {}, None, ""
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        match = _INSTRUCTION.match(line)
        if not match or current is None:
            continue
        name, body = match.groups()
        op_name = _OP_NAME.search(body)
        target = _TARGET.search(body)
        called = [n for group in _CALLED.findall(body) for n in re.findall(r"[\w.\-]+", group)]
        result_type, opcode = _split_type(body)
        instructions[name] = Instruction(
            name=name,
            result_type=result_type,
            opcode=opcode,
            target=target.group(1) if target else "",
            op_name=op_name.group(1) if op_name else "",
            called=tuple(called),
            gemm_config=bool(re.search(r"backend_config=.*gemm", body, re.I)),
        )
        current.append(name)
    return HloModule(
        name=module_name.group(1) if module_name else "",
        instructions=instructions,
        computations=computations,
        entry=entry,
    )


def _split_type(body: str) -> tuple[str, str]:
    """(result type, opcode) of an instruction body `type opcode(operands), attributes`."""
    if body.startswith("("):  # a tuple type
        depths = itertools.accumulate({"(": 1, ")": -1}.get(char, 0) for char in body)
        end = next(i for i, depth in enumerate(depths) if depth == 0)
        result_type, rest = body[: end + 1], body[end + 1 :]
    else:
        result_type, _, rest = body.partition(" ")
    match = re.match(r"\s*([\w\-]+)\(", rest)
    return result_type, match.group(1) if match else ""


def scope_stage(op_name: str) -> str:
    """The innermost layer stage among the named scopes of op_name, else "other"."""
    stage = "other"
    for component in op_name.split("/"):
        match = _SCOPE.match(component)
        if match and match.group(1) in STAGES:
            stage = match.group(1)
    return stage


def _fused(module: HloModule, instruction: Instruction, depth: int = 2) -> list:
    """The instructions of the computations `instruction` calls (two levels deep)."""
    inner = [
        module.instructions[n]
        for c in instruction.called
        for n in module.computations.get(c, ())
        if n in module.instructions
    ]
    if depth > 1:
        inner += [i for f in inner for i in _fused(module, f, depth - 1)]
    return inner


def _op_name(module: HloModule, instruction: Instruction) -> str:
    """The instruction's op_name, or (fusions without one) the most common op_name inside."""
    if instruction.op_name:
        return instruction.op_name
    inner = collections.Counter(i.op_name for i in _fused(module, instruction) if i.op_name)
    return inner.most_common(1)[0][0] if inner else ""


def _kind(module: HloModule, instruction: Instruction) -> str:
    """ "gemm", "quantize" or "other" for the work of one instruction."""
    if "quantize" in _op_name(module, instruction):
        return "quantize"
    if "mosaic" in instruction.target:
        return "quantize" if _BYTE_DATA.search(instruction.result_type) else "gemm"
    if (
        instruction.opcode in _GEMM_OPCODES
        or instruction.gemm_config
        or _GEMM_KERNEL_NAME.search(instruction.target)
        or any(i.opcode in _GEMM_OPCODES for i in _fused(module, instruction))
    ):
        return "gemm"
    return "other"


class Attribution(NamedTuple):
    """One profile record traced back to the layer: stage, pass and kind of work."""

    kernel: str
    hlo_op: str
    op_name: str
    stage: str  # a STAGES entry, "other" (outside the layer) or "unattributed"
    backward: bool
    kind: str  # "gemm", "quantize" or "other"
    matched_by: str  # "hlo_op", "kernel_name", "record_op_name" or "none"
    dur_us: float
    start_us: float


def _kernel_style(name: str) -> str:
    """An HLO name as XLA writes it into kernel and thunk names ("." and "-" as "_")."""
    return re.sub(r"[.\-]", "_", name)


class MosaicSchedule:
    """The module's Mosaic GPU custom calls in execution order (the compiled module is
    scheduled: the entry computation in program order, `call`s to command-buffer computations
    expanded) and a cursor over them, for the Pallas kernel records that name no instruction
    (XLA runs them inside command buffers, CUDA graphs whose records carry the buffer's name,
    or a computation missing from the module's text): such a record is the call after the
    last Pallas kernel seen, step after step."""

    def __init__(self, module: HloModule):
        self.calls: list[str] = []
        self._walk(module, module.entry, depth=0)
        self.position = {name: i for i, name in enumerate(self.calls)}
        self.cursor = 0

    def _walk(self, module, computation, depth):
        for name in module.computations.get(computation, ()):
            instruction = module.instructions[name]
            if _MOSAIC_KERNEL in instruction.target:
                self.calls.append(name)
            elif instruction.opcode == "call" and depth < 4:
                for called in instruction.called:
                    self._walk(module, called, depth + 1)

    def seen(self, name: str) -> None:
        """A Pallas kernel record matched to the call `name` by its own hlo_op."""
        if name in self.position:
            self.cursor = self.position[name] + 1

    def next_call(self) -> str | None:
        if not self.calls:
            return None
        call = self.calls[self.cursor % len(self.calls)]
        self.cursor = self.cursor % len(self.calls) + 1
        return call


def attribute(
    event: TraceEvent, module: HloModule, by_kernel_name: dict, schedule: MosaicSchedule
) -> Attribution:
    """Trace one profile record back to its HLO instruction, stage, pass and kind (records in
    start order: `schedule` places the Pallas kernels that name no instruction)."""
    args = event.args
    hlo_ops = [n.strip() for n in re.split(r"[,;]", str(args.get("hlo_op", ""))) if n.strip()]
    instruction, matched_by = None, "none"
    for name in reversed(hlo_ops):
        if name in module.instructions:
            instruction, matched_by = module.instructions[name], "hlo_op"
            break
    if instruction is None and event.name in by_kernel_name:
        instruction, matched_by = by_kernel_name[event.name], "kernel_name"
    if _MOSAIC_KERNEL in event.name:
        if instruction is not None:
            schedule.seen(instruction.name)
        else:
            call = schedule.next_call()
            if call is not None:
                instruction, matched_by = module.instructions[call], "schedule_order"
    if instruction is not None:
        op_name = _op_name(module, instruction)
        kind = PALLAS_KERNEL_KINDS.get(
            event.name.removesuffix(f"_{_MOSAIC_KERNEL}_kernel"), _kind(module, instruction)
        )
    else:
        op_name = _record_op_name(args)
        matched_by = "record_op_name" if op_name else "none"
        kind = (
            "quantize"
            if "quantize" in event.name or "quantize" in op_name
            else "gemm"
            if _GEMM_KERNEL_NAME.search(event.name)
            else "other"
        )
    stage = scope_stage(op_name) if op_name else "unattributed"
    return Attribution(
        kernel=event.name,
        hlo_op=instruction.name if instruction else ",".join(hlo_ops),
        op_name=op_name,
        stage=stage,
        backward="transpose(" in op_name,
        kind=kind,
        matched_by=matched_by,
        dur_us=event.dur_us,
        start_us=event.start_us,
    )


def _record_op_name(args: dict) -> str:
    """An op_name carried by the record itself (detailed XLA GPU annotations: op_name, or the
    module prefix + the instruction's short name), else ""."""
    if args.get("op_name"):
        return str(args["op_name"])
    if args.get("name"):
        return "/".join(filter(None, (str(args.get("prefix", "")), str(args["name"]))))
    long_name = str(args.get("long_name", args.get("tf_op", "")))
    return long_name if "/" in long_name else ""


def module_events(events: list[TraceEvent], module: HloModule) -> list[TraceEvent]:
    """The records of one compiled module's runs: GPU stream records when the profile has any
    (else the XLA:CPU op records, innermost only: their thunks nest), without the records of
    other modules when some records name this one."""
    device = gpu_stream_events(events)
    if not device:
        device = _innermost([e for e in events if "hlo_op" in e.args])
    mine = [e for e in device if e.args.get("hlo_module", module.name) == module.name]
    return mine or device


def _innermost(events: list[TraceEvent]) -> list[TraceEvent]:
    """The events of each thread that contain no other event of that thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.process, e.thread)].append(e)
    result = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.start_us, -e.dur_us))
        for e, following in zip(thread_events, thread_events[1:] + [None]):
            if following is None or following.start_us >= e.start_us + e.dur_us:
                result.append(e)
    return result


def describe_profile(events: list[TraceEvent], samples: int = 12) -> dict:
    """What the profile's records look like, for fixing the attribution offline: records per
    process / thread, the host records with the most time (name, count, total µs: where the
    host spends a step), the GPU's longest idle gaps (`idle_gaps`), the argument names of the
    GPU stream records (else of the XLA:CPU op records), and the full arguments of the first
    record of `samples` distinct kernels (long values cut)."""
    device = gpu_stream_events(events) or [e for e in events if "hlo_op" in e.args]
    threads = collections.Counter(f"{e.process} | {e.thread}" for e in events)
    first_of_kernel = {}
    for e in device:
        first_of_kernel.setdefault(e.name, e)
    host = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.process.startswith("/host"):
            host[e.name][0] += 1
            host[e.name][1] += e.dur_us
    return dict(
        records_per_thread=dict(threads.most_common(30)),
        host_records=[
            dict(name=name[:120], count=count, total_us=round(total, 1))
            for name, (count, total) in sorted(host.items(), key=lambda kv: -kv[1][1])[:40]
        ],
        idle_gaps=idle_gaps(events, device),
        record_arg_names=sorted({key for e in device for key in e.args}),
        sample_records=[
            dict(
                name=e.name,
                dur_us=e.dur_us,
                thread=e.thread,
                args={k: str(v)[:300] for k, v in e.args.items()},
            )
            for e in list(first_of_kernel.values())[:samples]
        ],
    )


def idle_gaps(events: list[TraceEvent], device: list[TraceEvent], count: int = 8) -> list:
    """The `count` longest gaps between one device record's end and the next one's start: the
    records on either side, and the host records that end inside the gap (what the host did
    while the GPU waited: a launch, a host callback, a synchronisation), at most 12 of each."""
    device = sorted(device, key=lambda e: e.start_us)
    gaps, end, before = [], None, None
    for e in device:
        if end is not None and e.start_us > end:
            gaps.append((e.start_us - end, end, before, e))
        if end is None or e.start_us + e.dur_us >= end:
            end, before = e.start_us + e.dur_us, e
    host = [e for e in events if e.process.startswith("/host")]
    report = []
    for gap, start, before, after in sorted(gaps, key=lambda g: -g[0])[:count]:
        inside = sorted(
            (e for e in host if start < e.start_us + e.dur_us <= after.start_us),
            key=lambda e: e.start_us,
        )
        report.append(
            dict(
                gap_us=round(gap, 2),
                after_kernel=before.name[:80],
                before_kernel=after.name[:80],
                host_records_ending_inside=[
                    dict(name=e.name[:80], thread=e.thread, dur_us=round(e.dur_us, 1))
                    for e in inside[:12]
                ],
            )
        )
    return report


def stage_breakdown(
    events: list[TraceEvent], hlo_text: str, steps: int
) -> tuple[dict, list[Attribution]]:
    """Device milliseconds per step by stage (forward / backward, GEMM / quantize / other) from
    the profile records of `steps` runs of the compiled module `hlo_text`, and the attributed
    records of the last step (for inspection). `span_ms` is the time per step from the first
    record's start to the last one's end; `idle_ms` is the part of it with no kernel running
    (launch gaps inside a step and gaps between the back-to-back steps)."""
    module = parse_hlo(hlo_text)
    by_kernel_name = {
        _kernel_style(name): instruction for name, instruction in module.instructions.items()
    }
    schedule = MosaicSchedule(module)
    rows = [
        attribute(e, module, by_kernel_name, schedule)
        for e in sorted(module_events(events, module), key=lambda e: e.start_us)
    ]
    per_step = 1e-3 / steps
    total = sum(r.dur_us for r in rows) * per_step
    stages = {}
    for stage in STAGES + ("other", "unattributed"):
        mine = [r for r in rows if r.stage == stage]
        if not mine:
            continue
        ms = sum(r.dur_us for r in mine) * per_step
        stages[stage] = dict(
            ms=ms,
            share=ms / total if total else None,
            fwd_ms=sum(r.dur_us for r in mine if not r.backward) * per_step,
            bwd_ms=sum(r.dur_us for r in mine if r.backward) * per_step,
            **{
                f"{kind}_ms": sum(r.dur_us for r in mine if r.kind == kind) * per_step
                for kind in ("gemm", "quantize", "other")
            },
        )
    kinds = {
        kind: sum(r.dur_us for r in rows if r.kind == kind) * per_step
        for kind in ("gemm", "quantize", "other")
    }
    span = (max(r.start_us + r.dur_us for r in rows) - rows[0].start_us) * per_step if rows else 0.0
    summary = dict(
        steps=steps,
        kernels_per_step=len(rows) / steps,
        device_ms=total,
        span_ms=span,
        idle_ms=span - total,
        fwd_ms=sum(r.dur_us for r in rows if not r.backward) * per_step,
        bwd_ms=sum(r.dur_us for r in rows if r.backward) * per_step,
        gemm_ms=kinds["gemm"],
        quantize_ms=kinds["quantize"],
        other_ms=kinds["other"],
        non_gemm_ms=total - kinds["gemm"],
        non_gemm_share=(total - kinds["gemm"]) / total if total else None,
        matched_by=dict(collections.Counter(r.matched_by for r in rows)),
        stages=stages,
    )
    return summary, rows[-(len(rows) // steps or len(rows)) :] if rows else []
