"""Stage-by-stage comparison of jaxmoe against the PyTorch reference (and Megatron's recordings).

Both layers are built from one Megatron checkpoint layer and fed the same input bytes (moved from
torch to JAX over DLPack, data pointers checked). For every stage the report gives the fraction of
bitwise-equal elements, the max absolute difference and the max ULP distance in the stage's dtype
(integer-view metric of docs/determinism.md, "The ULP metric of the compare tool": key = i if
i >= 0 else -(i & 0x7f..f); NaN equals NaN only at the same position), and the max row-ULP
(matrix-ULP for fp32 weight gradients, see `row_ulp_distance`). Each stage has a bound (see
`BOUNDS` and bridge/README.md for their derivation); the run passes when every stage is within
its bound. Routing under capacity is compared as kept (token, expert) pairs
(`megatron_routing_pairs` for Megatron's side).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

from bridge import megatron, torch_reference
from bridge.dlpack import to_jax
from bridge.errors import ConfigError

F32 = jnp.float32
INPUT_SHAPE = (2, 32)  # (batch, sequence) of the seeded random input


@dataclasses.dataclass(frozen=True)
class Bound:
    """A stage's acceptance rule. kind: "exact" (integers equal), "bitwise" (bytes equal),
    "row_ulp" (every difference is at most `limit` ULPs of the largest reference magnitude in its
    row, i.e. along the last axis) or "matrix_ulp" (the same with the largest magnitude of its
    matrix, the last two axes: one expert's weight gradient)."""

    kind: str
    limit: int | None = None

    def describe(self) -> str:
        """One-line text of the rule."""
        return self.kind if self.limit is None else f"{self.kind} <= {self.limit}"


def _row_ulp(n: int) -> Bound:
    return Bound("row_ulp", limit=n)


# jaxmoe vs the PyTorch reference: (stage, dtype class) -> bound. "weight_grad" covers the
# gradients of weight matrices (grad_*_weight), "grad" every other gradient.
# Derivation in bridge/README.md.
_EXACT, _BITWISE = Bound("exact"), Bound("bitwise")
_FP32_WEIGHT_GRAD = Bound("matrix_ulp", limit=64)
BOUNDS: dict[tuple[str, str], Bound] = {
    ("indices", "int"): _EXACT,
    ("kept", "int"): _EXACT,
    ("dispatched_rows", "fp32"): _BITWISE,
    ("dispatched_rows", "bf16"): _BITWISE,
    ("router_logits", "fp32"): _row_ulp(16),
    ("probs", "fp32"): _row_ulp(16),
    ("aux_loss", "fp32"): _row_ulp(16),
    ("weight_grad", "fp32"): _FP32_WEIGHT_GRAD,
}
for _stage in (
    "fc1_output",
    "activation",
    "fc2_output",
    "combined",
    "shared_output",
    "output",
    "grad",
):
    BOUNDS[(_stage, "fp32")] = _row_ulp(64)
for _stage in (
    "router_logits",
    "probs",
    "fc1_output",
    "activation",
    "fc2_output",
    "combined",
    "shared_output",
    "output",
):
    BOUNDS[(_stage, "bf16")] = _row_ulp(1)
BOUNDS[("grad", "bf16")] = BOUNDS[("weight_grad", "bf16")] = _row_ulp(4)
# jaxmoe vs Megatron's recorded outputs (io.pt).
MEGATRON_BOUNDS: dict[tuple[str, str], Bound] = {
    ("routing_map", "int"): _EXACT,
    ("output", "fp32"): _row_ulp(64),
    ("output", "bf16"): _row_ulp(4),
    ("grad", "fp32"): _row_ulp(64),
    ("grad", "bf16"): _row_ulp(4),
    ("weight_grad", "fp32"): _FP32_WEIGHT_GRAD,
    ("weight_grad", "bf16"): _row_ulp(4),
}


def _bound(table, stage: str, dtype: np.dtype) -> Bound:
    if stage.startswith("grad_") and stage.endswith("_weight"):
        group = "weight_grad"
    else:
        group = "grad" if stage.startswith("grad") else stage
    if not _is_float(dtype):
        dtype_class = "int"
    else:
        dtype_class = "fp32" if np.dtype(dtype).itemsize == 4 else "bf16"
    return table[(group, dtype_class)]


def _is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype) == ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------ metrics
_INT_VIEWS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def ulp_keys(a: np.ndarray) -> np.ndarray:
    """Monotone integer keys of floats (docs/determinism.md, "The ULP metric of the compare
    tool"), as int64; +0 and -0 share a key."""
    bits = a.view(_INT_VIEWS[a.dtype.itemsize]).astype(np.int64)
    magnitude_mask = (1 << (8 * a.dtype.itemsize - 1)) - 1
    return np.where(bits >= 0, bits, -(bits & magnitude_mask))


def row_ulp_distance(
    actual: np.ndarray, reference: np.ndarray, axes: tuple[int, ...] = (-1,)
) -> np.ndarray:
    """|actual - reference| in ULPs (of the reference dtype) of the largest |reference| in each
    row (the last axis; `axes=(-2, -1)`: in each matrix): robust where per-element ULPs explode,
    i.e. for values produced by cancellation near zero."""
    info = ml_dtypes.finfo(reference.dtype)
    ref = reference.astype(np.float64)
    axes = axes[-ref.ndim :] if ref.ndim else ()
    row_max = np.max(np.abs(ref), axis=axes, keepdims=True) if axes else np.abs(ref)
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(row_max)), info.minexp)
    return np.abs(actual.astype(np.float64) - ref) / np.exp2(exponent - info.nmant)


def stage_metrics(a: np.ndarray, b: np.ndarray, matrix: bool = False) -> dict[str, float]:
    """bitwise_fraction, max_abs, max_ulp (per element, docs/determinism.md, "The ULP metric of
    the compare tool", in b's dtype) and max_row_ulp (see `row_ulp_distance`) of `a` against the
    reference `b`; with `matrix` also max_matrix_ulp (the same over the last two axes).
    One-sided NaNs give inf; integer arrays get their max abs difference as every ULP figure."""
    keys = ("max_abs", "max_ulp", "max_row_ulp") + (("max_matrix_ulp",) if matrix else ())

    def result(bitwise_fraction, value=None, **values):
        return dict(
            bitwise_fraction=bitwise_fraction, **{key: values.get(key, value) for key in keys}
        )

    if a.shape != b.shape or a.dtype != b.dtype:
        return result(0.0, math.inf)
    if a.size == 0:
        return result(1.0, 0.0)
    view = _INT_VIEWS[a.dtype.itemsize]
    bitwise = a.view(view) == b.view(view)
    if not _is_float(a.dtype):
        return result(
            float(bitwise.mean()), float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))
        )
    nan_a, nan_b = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    bitwise |= nan_a & nan_b
    if (nan_a != nan_b).any():
        return result(float(bitwise.mean()), math.inf)
    finite = ~(nan_a | nan_b)
    abs_diff = np.abs(a.astype(np.float64) - b.astype(np.float64))[finite]
    ulp = np.abs(ulp_keys(a) - ulp_keys(b))[finite]
    values = dict(
        max_abs=float(abs_diff.max(initial=0.0)),
        max_ulp=float(ulp.max(initial=0)),
        max_row_ulp=float(row_ulp_distance(a, b)[finite].max(initial=0.0)),
    )
    if matrix:
        values["max_matrix_ulp"] = float(
            row_ulp_distance(a, b, axes=(-2, -1))[finite].max(initial=0.0)
        )
    return result(float(bitwise.mean()), **values)


def within(bound: Bound, metrics: Mapping[str, float]) -> bool:
    """Whether a stage's `metrics` satisfy `bound`."""
    if bound.kind in ("exact", "bitwise"):
        return metrics["bitwise_fraction"] == 1.0
    return metrics["max_" + bound.kind] <= bound.limit


@dataclasses.dataclass
class StageResult:
    """One compared stage (max_matrix_ulp: only for stages bounded in matrix-ULPs)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bitwise_fraction: float
    max_abs: float
    max_ulp: float
    max_row_ulp: float
    bound: str
    ok: bool
    max_matrix_ulp: float | None = None

    def as_json(self) -> dict[str, Any]:
        """JSON-safe dict (inf written as the string "inf")."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        for key in ("max_abs", "max_ulp", "max_row_ulp", "max_matrix_ulp"):
            if out[key] is not None and math.isinf(out[key]):
                out[key] = "inf"
        return out


def compare_stage(
    name: str, actual: np.ndarray, reference: np.ndarray, bound: Bound
) -> StageResult:
    """Metrics of `actual` against `reference` and whether they satisfy `bound`."""
    metrics = stage_metrics(actual, reference, matrix=bound.kind == "matrix_ulp")
    return StageResult(
        name=name,
        dtype=str(reference.dtype),
        shape=tuple(reference.shape),
        bound=bound.describe(),
        ok=within(bound, metrics),
        **metrics,
    )


# --------------------------------------------------------------------------------- the runs
def host(value) -> np.ndarray:
    """A torch tensor or JAX array as a host numpy array (bf16 as ml_dtypes.bfloat16); torch
    CPU tensors cross over DLPack without a copy."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.int64, torch.bool):
            return value.numpy()
        return np.asarray(to_jax(value, copy=True))
    return np.asarray(jax.device_get(value))


def _run_jaxmoe(moe, x: jax.Array, dy: jax.Array):
    def objective(moe, x):
        y, aux, stages = moe.forward_with_stages(x)
        return jnp.sum(y.astype(F32) * dy.astype(F32)) + aux.total_loss, (y, aux, stages)

    (_, (y, aux, stages)), (param_grads, grad_x) = nnx.value_and_grad(
        objective, argnums=(0, 1), has_aux=True
    )(moe, x)
    grads = {}
    for module, attr, field, perm in megatron.JAXMOE_PARAMS:
        owner = param_grads.get(module) if module in param_grads else None
        if field == "expert_bias" or owner is None or attr not in owner:
            continue
        value = np.asarray(jax.device_get(owner[attr][...]))
        grads["grad_" + field] = value.transpose(perm) if perm else value
    return y, aux, stages, grad_x, grads


def _run_torch(ref: torch_reference.MoE, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    y, aux, stages = ref.forward_with_stages(x)
    ((y.float() * dy.float()).sum() + aux.total_loss).backward()
    grads = {
        "grad_" + name: host(p.grad) for name, p in ref.named_parameters() if p.grad is not None
    }
    return y, aux, stages, x.grad, grads


def _stage_arrays(y, aux, stages, grad_x, grads) -> dict[str, np.ndarray]:
    out = {
        name: host(getattr(stages, name))
        for name in (
            "router_logits",
            "probs",
            "dispatched_rows",
            "fc1_output",
            "activation",
            "fc2_output",
            "combined",
        )
    }
    out["indices"] = host(stages.indices).astype(np.int64)
    out["kept"] = host(stages.kept)
    if stages.shared_output is not None:
        out["shared_output"] = host(stages.shared_output)
    out["output"] = host(y)
    out["aux_loss"] = np.asarray(host(aux.total_loss), np.float32).reshape(1)
    out["grad_x"] = host(grad_x)
    out.update(grads)
    return out


def _megatron_grads(param_grads: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """io.pt's {local param name: grad} -> {"grad_<MoELayerWeights field>": global tensor}."""
    suffixes = {"mlp." + name: grad for name, grad in param_grads.items()}
    megatron.stack_local_experts(0, suffixes, None)
    by_key = {key: field for field, key in megatron.MOE_KEYS.items()}
    return {"grad_" + by_key[key]: host(value) for key, value in suffixes.items() if key in by_key}


def _kept_map(indices: np.ndarray, kept: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, k] expert ids and kept flags -> [T, E] bool map of the kept (token, expert) pairs."""
    return ((indices[..., None] == np.arange(num_experts)) & kept[..., None]).any(-2)


# Stages indexed by token (or global), comparable even when the two routings differ.
_TOKEN_STAGES = ("router_logits", "probs", "indices", "kept", "output", "aux_loss")


def compare_layer(
    ckpt: megatron.MegatronCheckpoint,
    layer: int,
    *,
    io: Mapping | None = None,
    device: str = "cpu",
    seed: int = 0,
    config=None,
    input_shape: tuple[int, int] = INPUT_SHAPE,
) -> dict[str, Any]:
    """Run jaxmoe and the PyTorch reference on layer `layer` and compare every stage (plus
    Megatron's recorded y, dx, parameter grads and routing_map when `io` is given). Without
    `io` the input is seeded random of shape `input_shape` (batch, sequence) + (H,). Returns the
    report dict (see `bridge/README.md`); report["ok"] tells whether every bound holds."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if len(input_shape) != 2 or min(input_shape) < 1:
        raise ValueError(f"input_shape must be (batch, sequence) >= 1, got {input_shape!r}")
    config = megatron.resolve_config(None, config) if config is not None else ckpt.config
    if config is None:
        raise ConfigError("the checkpoint has no saved args: pass --config CONFIG_JSON")
    if config.input_jitter_eps is not None:
        raise ConfigError(
            "input jitter draws different random numbers in each framework; "
            "compare with moe_input_jitter_eps unset"
        )
    torch_device = torch.device("cuda" if device == "gpu" else "cpu")
    jax_device = jax.devices("gpu" if device == "gpu" else "cpu")[0]
    weights = ckpt.layer(layer)
    dtype = weights.fc1_weight.dtype
    if io is not None:
        # Megatron feeds [S, B, H]; jaxmoe's seq_aux_loss wants sequences on axis -2.
        x = io["x"].transpose(0, 1).contiguous().to(torch_device, dtype)
        dy = io["dy"].transpose(0, 1).contiguous().to(torch_device, dtype)
    else:
        generator = torch.Generator().manual_seed(seed)
        shape = tuple(input_shape) + (weights.hidden_size,)
        x = torch.randn(shape, generator=generator).to(torch_device, dtype)
        dy = torch.randn(shape, generator=generator).to(torch_device, dtype)

    torch.set_float32_matmul_precision("highest")
    with jax.default_device(jax_device), jax.default_matmul_precision("highest"):
        moe = megatron.build_moe(ckpt, layer, config=config)
        nnx.update(moe, jax.device_put(nnx.state(moe), jax_device))
        x_jax, dy_jax = to_jax(x), to_jax(dy)  # zero-copy, data pointers checked
        jax_out = _stage_arrays(*_run_jaxmoe(moe, x_jax, dy_jax))
    ref = torch_reference.MoE.from_megatron(ckpt, layer, config=config, device=torch_device)
    torch_out = _stage_arrays(*_run_torch(ref, x, dy))

    stages = {}
    routing_exact = all(
        np.array_equal(jax_out[name], torch_out[name]) for name in ("indices", "kept")
    )
    for name, reference in torch_out.items():
        if name not in jax_out:
            continue
        if not routing_exact and name not in _TOKEN_STAGES and not name.startswith("grad"):
            continue  # buffers laid out by different routings are not comparable
        stages[name] = compare_stage(
            name, jax_out[name], reference, _bound(BOUNDS, name, reference.dtype)
        )
    report: dict[str, Any] = dict(
        checkpoint=ckpt.path,
        layer=layer,
        device=device,
        dtype=str(dtype).replace("torch.", ""),
        routing_exact=routing_exact,
        dropped_pairs=int(np.sum(~jax_out["kept"])),
        output={
            key: stages["output"].as_json()[key]
            for key in ("max_abs", "max_ulp", "max_row_ulp", "bitwise_fraction")
        },
        stages={name: result.as_json() for name, result in stages.items()},
    )
    ok = routing_exact and all(result.ok for result in stages.values())
    if io is not None:
        report["vs_megatron"] = _vs_megatron(jax_out, io, config)
        ok = ok and report["vs_megatron"]["ok"]
    report["ok"] = ok
    return report


def megatron_routing_pairs(io: Mapping, config) -> tuple[np.ndarray, int]:
    """The (token, expert) pairs Megatron routed a token to and kept, from io.pt: its
    `routing_map` [S*B, E] (tokens sequence-major), which Megatron records after capacity
    dropping, minus the pad-to-capacity fillers. With pad_expert_input_to_capacity Megatron's
    map holds exactly `capacity` tokens per expert: the kept routed ones plus fillers, real
    tokens not routed there, at probability 0 in `router_probs`; a pair at probability 0 is
    taken as a filler (a routed pair whose probability underflowed to 0 contributes nothing
    either). Returns (map, number of fillers removed)."""
    routing_map = host(io["routing_map"]).astype(bool)
    if not config.pad_expert_input_to_capacity:
        return routing_map, 0
    weighted = host(io["router_probs"]).astype(np.float32) != 0
    return routing_map & weighted, int(np.sum(routing_map & ~weighted))


def _vs_megatron(jax_out: Mapping[str, np.ndarray], io: Mapping, config) -> dict[str, Any]:
    """jaxmoe (run on x transposed to [B, S, H]) against io.pt's [S, B, H] recordings. The
    routing check compares jaxmoe's kept pairs with `megatron_routing_pairs`."""
    batch, seq = jax_out["output"].shape[:2]
    num_experts = config.num_experts
    kept = _kept_map(jax_out["indices"], jax_out["kept"], num_experts)
    kept = kept.reshape(batch, seq, num_experts).transpose(1, 0, 2).reshape(-1, num_experts)
    megatron_pairs, fillers = megatron_routing_pairs(io, config)
    pairs = {
        "routing_map": (kept, megatron_pairs),
        "output": (jax_out["output"].transpose(1, 0, 2), host(io["y"])),
        "grad_x": (jax_out["grad_x"].transpose(1, 0, 2), host(io["dx"])),
    }
    for name, reference in _megatron_grads(io["param_grads"]).items():
        pairs[name] = (jax_out[name], reference)
    results = {
        name: compare_stage(name, actual, reference, _bound(MEGATRON_BOUNDS, name, reference.dtype))
        for name, (actual, reference) in pairs.items()
    }
    return dict(
        routing_exact=results["routing_map"].ok,
        routing_fillers=fillers,
        output={
            key: results["output"].as_json()[key]
            for key in ("max_abs", "max_ulp", "max_row_ulp", "bitwise_fraction")
        },
        stages={name: r.as_json() for name, r in results.items()},
        ok=all(r.ok for r in results.values()),
    )


def format_table(report: Mapping[str, Any]) -> str:
    """The report as a readable text table."""
    lines = [
        f"{report['checkpoint']} layer {report['layer']} ({report['dtype']}, "
        f"{report['device']}): routing_exact={report['routing_exact']}, "
        f"{report['dropped_pairs']} (token, expert) pairs dropped by capacity"
    ]

    def table(title, stages):
        lines.append(f"\n{title}")
        lines.append(
            f"{'stage':<24}{'dtype':<10}{'bitwise':>8}{'max_abs':>10}{'max_ulp':>11}"
            f"{'row_ulp':>9}{'mat_ulp':>9}  {'bound':<18}ok"
        )
        for name, s in stages.items():
            cells = [
                "-" if s[k] is None else s[k] if isinstance(s[k], str) else fmt.format(s[k])
                for k, fmt in (
                    ("max_abs", "{:.3g}"),
                    ("max_ulp", "{:.0f}"),
                    ("max_row_ulp", "{:.2f}"),
                    ("max_matrix_ulp", "{:.2f}"),
                )
            ]
            lines.append(
                f"{name:<24}{s['dtype']:<10}{s['bitwise_fraction']:>8.4f}{cells[0]:>10}"
                f"{cells[1]:>11}{cells[2]:>9}{cells[3]:>9}  {s['bound']:<18}"
                f"{'yes' if s['ok'] else 'NO'}"
            )

    table("jaxmoe vs PyTorch reference", report["stages"])
    if "vs_megatron" in report:
        vs = report["vs_megatron"]
        fillers = (
            f"; routing_map without its {vs['routing_fillers']} pad-to-capacity fillers"
            if vs["routing_fillers"]
            else ""
        )
        table(f"jaxmoe vs Megatron (io.pt{fillers})", vs["stages"])
    lines.append(
        "\nPASS: every stage is within its bound"
        if report["ok"]
        else "\nFAIL: some stage is outside its bound"
    )
    return "\n".join(lines)


def bounds_help() -> str:
    """The bound tables as text (for --help)."""
    rows = [f"  {stage:<17}{cls:<6}{b.describe()}" for (stage, cls), b in BOUNDS.items()]
    rows += [
        f"  vs Megatron {stage:<12}{cls:<6}{b.describe()}"
        for (stage, cls), b in MEGATRON_BOUNDS.items()
    ]
    return (
        "stage bounds (weight_grad = gradients of weight matrices, grad = other gradients; "
        "see bridge/README.md):\n" + "\n".join(rows)
    )
