"""Reading Megatron-Core checkpoints: every on-disk layout -> one `MegatronCheckpoint`.

Layouts read: torch_dist stacked `decoder.layers.*` keys (leading layer axis) and per-layer
`decoder.layers.{i}.*` keys, the `experts.experts.` prefix and the singleton `weight_w`/`weight_v`
form; legacy state dicts with SequentialMLP (`local_experts.{j}`), TEGroupedMLP
(`linear_fc1.weight{j}`) or the removed GroupedMLP (`weight1`/`weight2` raw views), merged across
tensor-, pipeline- and expert-parallel rank files. Only the MoE/MLP keys are read; torch_dist
`optimizer.*` entries are never requested; every pickle goes through `bridge.safe_load`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bridge import legacy_format, torch_dist_format
from bridge.errors import CorruptCheckpointError, ExpertCountError, UnknownKeysError
from bridge.megatron_config import check_layer, resolve_config
from bridge.megatron_weights import (
    DENSE_KEYS,
    EXPERTS,
    LAYER_PREFIX,
    MOE_KEYS,
    NORM_KEYS,
    DenseLayerWeights,
    MegatronCheckpoint,
    MoELayerWeights,
    NormWeights,
)
from bridge.safe_load import load_torch_file

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_KEY = re.compile(
    r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$"
)
_TE_GROUPED_KEY = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SINGLETON_KEY = re.compile(r"^mlp\.experts\.experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_LEGACY_GROUPED_KEYS = ("mlp.experts.weight1", "mlp.experts.weight2")
# Column-parallel fc1 weights/biases (GLU-split over TP when gated) and the dim they shard on.
_COLUMN_PARALLEL = {
    EXPERTS + "linear_fc1.weight": -2,
    EXPERTS + "linear_fc1.bias": -1,
    "mlp.shared_experts.linear_fc1.weight": -2,
    "mlp.linear_fc1.weight": -2,
    "mlp.linear_fc1.bias": -1,
}
_ROW_PARALLEL = {
    EXPERTS + "linear_fc2.weight": -1,
    "mlp.shared_experts.linear_fc2.weight": -1,
    "mlp.linear_fc2.weight": -1,
}


def progress_reporter(progress) -> Callable[[int, int, str], None] | None:
    """`load`'s and `save`'s `progress` argument as a callable(done, total, message), or None:
    False -> None, a callable -> itself, True -> a progress line on stderr."""
    if not progress:
        return None
    if callable(progress):
        return progress

    def to_stderr(done: int, total: int, what: str) -> None:
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r[bridge.megatron] {done}/{total} {what}\033[K{end}")
        sys.stderr.flush()

    return to_stderr


def load(path: str | os.PathLike, config=None, *, progress=False) -> MegatronCheckpoint:
    """Read a Megatron-Core checkpoint (format detected): a torch_dist directory, a legacy
    `torch.save` file, or a legacy tree (checkpoint dir with latest_checkpointed_iteration.txt,
    `iter_*/` or `release/`, or the iteration dir with `mp_rank_*/model_optim_rng.pt`).

    config: used when the checkpoint has no readable saved args: a MoEConfig, a dict of Megatron
      names, or the path of a config.json. When the saved args exist they win, and a different
      caller config is an error.
    progress: True for a stderr progress line, or a callable(done, total, message).
    Raises the `bridge.errors` types for missing, corrupt, unsafe or inconsistent checkpoints."""
    path = os.fspath(path)
    report = progress_reporter(progress)
    kind, location = legacy_format.resolve(path)
    if kind == "torch_dist":
        layer_tensors, num_layers, saved, layout = _read_torch_dist(location, report)
        fmt = "torch_dist"
    else:
        files = (
            [legacy_format.RankFile(location, 0, ())]
            if kind == "legacy_file"
            else legacy_format.rank_files(location)
        )
        layer_tensors, num_layers, saved, layout = _read_legacy(files, report)
        fmt = "legacy"
    saved = saved or {}
    args = _args_dict(saved.get("args"))
    layers = _assemble_layers(layer_tensors)
    ckpt = MegatronCheckpoint(
        path=path,
        format=fmt,
        expert_layout=layout,
        layers=layers,
        num_layers=int(args.get("num_layers") or num_layers) if args else num_layers,
        config=resolve_config(args, config),
        args=args,
        iteration=saved.get("iteration"),
    )
    if ckpt.config is not None:
        for index in ckpt.moe_layers:
            check_layer(ckpt.config, index, ckpt.layers[index])
    return ckpt


def _args_dict(args: Any) -> dict | None:
    """The saved args (an argparse.Namespace or a mapping) as a dict; None when absent."""
    if args is None:
        return None
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, Mapping) else None


def _mlp_suffix(suffix: str) -> bool:
    return suffix.startswith(("mlp.", "pre_mlp_layernorm.")) and "_extra_state" not in suffix


def _read_torch_dist(path, report):
    index = torch_dist_format.read_index(path)
    wanted = []
    for key, entry in index.items():
        if not key.startswith(LAYER_PREFIX) or not hasattr(entry, "size"):
            continue
        match = _LAYER_KEY.match(key)
        suffix = match.group(2) if match else key[len(LAYER_PREFIX) :]
        if _mlp_suffix(suffix):
            wanted.append(key)
    if report:
        report(0, 1, f"reading {len(wanted)} MLP tensors from {path}")
    tensors = torch_dist_format.read(path, index, wanted)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    num_layers = 0
    for key, tensor in tensors.items():
        match = _LAYER_KEY.match(key)
        if match:
            index_ = int(match.group(1))
            layers.setdefault(index_, {})[match.group(2)] = tensor
            num_layers = max(num_layers, index_ + 1)
        else:
            for index_ in range(tensor.shape[0]):
                layers.setdefault(index_, {})[key[len(LAYER_PREFIX) :]] = tensor[index_]
            num_layers = max(num_layers, tensor.shape[0])
    singleton = any(
        _SINGLETON_KEY.match(s) or s.endswith(("_w", "_v"))
        for suffixes in layers.values()
        for s in suffixes
    )
    layers = {i: _join_singleton(i, suffixes) for i, suffixes in layers.items()}
    if report:
        report(1, 1, f"read {len(layers)} layers")
    return (
        layers,
        num_layers,
        torch_dist_format.read_common_state(path, index),
        "torch_dist_singleton" if singleton else "torch_dist",
    )


def _join_singleton(index: int, suffixes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Singleton-local-shards keys -> canonical: per-expert `experts.experts.{e}.*` stacked, and
    GLU halves `weight_w`/`weight_v` (`bias_w`/`bias_v`) concatenated as [gate; up]."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for suffix, tensor in suffixes.items():
        if suffix.endswith(("weight_w", "weight_v", "bias_w", "bias_v")):
            halves.setdefault(suffix[:-2], {})[suffix[-1]] = tensor
        else:
            out[suffix] = tensor
    for stem, parts in halves.items():
        if set(parts) != {"w", "v"}:
            raise UnknownKeysError(f"layer {index}: GLU half without its pair", [stem + "_w/_v"])
        dim = -2 if stem.endswith("weight") else -1
        out[stem] = torch.cat([parts["w"], parts["v"]], dim=dim)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for suffix in [s for s in out if _SINGLETON_KEY.match(s)]:
        match = _SINGLETON_KEY.match(suffix)
        experts.setdefault(match.group(2), {})[int(match.group(1))] = out.pop(suffix)
    for name, by_expert in experts.items():
        out[EXPERTS + name] = _stack_experts(index, name, by_expert)
    return out


def _stack_experts(index: int, name: str, by_expert: dict[int, torch.Tensor]) -> torch.Tensor:
    ids = sorted(by_expert)
    if ids != list(range(len(ids))):
        raise ExpertCountError(
            f"layer {index} {name}: expert indices {ids} are not 0..{len(ids) - 1}"
            " (missing experts?)"
        )
    return torch.stack([by_expert[j] for j in ids])


def _local_layers(
    model: Mapping[str, Any], num_local_experts: int | None
) -> tuple[dict[int, dict[str, torch.Tensor]], int, str | None]:
    """A legacy (module) state dict -> ({local layer: canonical suffix -> tensor}, layer count,
    expert layout). Experts stay this rank's local experts and TP shards."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    count = 0
    for key, value in model.items():
        match = _LAYER_KEY.match(key)
        if not match:
            continue
        index, suffix = int(match.group(1)), match.group(2)
        count = max(count, index + 1)
        if _mlp_suffix(suffix) and isinstance(value, torch.Tensor):
            layers.setdefault(index, {})[suffix] = value
    layouts = set()
    for index, suffixes in layers.items():
        layout = stack_local_experts(index, suffixes, num_local_experts)
        if layout:
            layouts.add(layout)
    if len(layouts) > 1:
        raise UnknownKeysError(
            f"mixed expert layouts {sorted(layouts)} in one state dict", sorted(layouts)
        )
    return layers, count, layouts.pop() if layouts else None


def stack_local_experts(
    index: int, suffixes: dict[str, torch.Tensor], num_local_experts: int | None
) -> str | None:
    """Rewrite layer `index`'s local expert keys in `suffixes` (module names relative to the
    layer, modified in place) as stacked canonical `mlp.experts.experts.*` keys; return the
    layout found ("sequential", "te_grouped", "legacy_grouped" or None)."""
    sequential: dict[str, dict[int, torch.Tensor]] = {}
    grouped: dict[str, dict[int, torch.Tensor]] = {}
    for suffix in list(suffixes):
        if match := _SEQUENTIAL_KEY.match(suffix):
            sequential.setdefault(match.group(2), {})[int(match.group(1))] = suffixes.pop(suffix)
        elif match := _TE_GROUPED_KEY.match(suffix):
            name = f"{match.group(1)}.{match.group(2)}"
            grouped.setdefault(name, {})[int(match.group(3))] = suffixes.pop(suffix)
    found = [name for name, parts in (("sequential", sequential), ("te_grouped", grouped)) if parts]
    if any(key in suffixes for key in _LEGACY_GROUPED_KEYS):
        found.append("legacy_grouped")
    if len(found) > 1:
        raise UnknownKeysError(f"layer {index}: several expert layouts {found}", found)
    for name, by_expert in (sequential or grouped).items():
        suffixes[EXPERTS + name] = _stack_experts(index, name, by_expert)
    if found == ["legacy_grouped"]:
        _unview_legacy_grouped(index, suffixes, num_local_experts)
    return found[0] if found else None


def _unview_legacy_grouped(index: int, suffixes: dict[str, torch.Tensor], n: int | None) -> None:
    """GroupedMLP `weight1` [H, n*X] is a raw view of [n, H, X] (= fc1.weight^T per expert) and
    `weight2` [n*F, H] of [n, F, H] (= fc2.weight^T)."""
    if not all(key in suffixes for key in _LEGACY_GROUPED_KEYS):
        raise UnknownKeysError(
            f"layer {index}: GroupedMLP needs both weight1 and weight2",
            [k for k in _LEGACY_GROUPED_KEYS if k not in suffixes],
        )
    weight1, weight2 = (suffixes.pop(key) for key in _LEGACY_GROUPED_KEYS)
    hidden = weight1.shape[0]
    if n is None or weight1.shape[1] % n or weight2.shape[0] % n:
        raise ExpertCountError(
            f"layer {index}: GroupedMLP weight1 {tuple(weight1.shape)} / weight2 "
            f"{tuple(weight2.shape)} do not split into {n} local experts"
        )
    w1 = weight1.contiguous().view(n, hidden, weight1.shape[1] // n)
    w2 = weight2.contiguous().view(n, weight2.shape[0] // n, hidden)
    suffixes[EXPERTS + "linear_fc1.weight"] = w1.transpose(1, 2).contiguous()
    suffixes[EXPERTS + "linear_fc2.weight"] = w2.transpose(1, 2).contiguous()


def _is_gated(suffixes: dict[str, torch.Tensor], fc1_key: str) -> bool:
    """GLU iff fc1's output rows are twice fc2's input columns (holds per TP shard too)."""
    fc2 = suffixes[
        fc1_key.replace("linear_fc1.bias", "linear_fc1.weight").replace(
            "linear_fc1.weight", "linear_fc2.weight"
        )
    ]
    fc1 = suffixes[fc1_key.replace("linear_fc1.bias", "linear_fc1.weight")]
    return fc1.shape[-2] == 2 * fc2.shape[-1]


def _merge_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Merge one layer's TP shards (rank order): fc1 [W_r; V_r] shards -> [W_0; W_1; ..; V_0; ..]
    (plain concatenation without a GLU), fc2 concatenated on its input dim, the rest replicated."""
    if len(shards) == 1:
        return shards[0]
    if any(shard.keys() != shards[0].keys() for shard in shards):
        raise CorruptCheckpointError(
            "the tensor-parallel rank files of a layer hold different keys"
        )
    merged = {}
    for key, first in shards[0].items():
        parts = [shard[key] for shard in shards]
        if key in _COLUMN_PARALLEL:
            dim = _COLUMN_PARALLEL[key]
            if _is_gated(shards[0], key):
                halves = [part.chunk(2, dim=dim) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            merged[key] = torch.cat(parts, dim=dim)
        elif key in _ROW_PARALLEL:
            merged[key] = torch.cat(parts, dim=_ROW_PARALLEL[key])
        else:
            merged[key] = first
    return merged


def _merge_expert_parallel(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate the EP ranks' local experts (rank r holds global experts r*n .. r*n+n-1)."""
    merged = dict(parts[0])
    for key in merged:
        if key.startswith(EXPERTS):
            merged[key] = torch.cat([part[key] for part in parts], dim=0)
    return merged


def _model_chunks(state: Any, description: str) -> list[Mapping[str, Any]]:
    """The module state dicts of a legacy file: `model`, or `model0..N` (virtual pipeline), or
    the file itself when it is a bare state dict."""
    if not isinstance(state, Mapping):
        raise UnknownKeysError(
            f"{description}: not a Megatron checkpoint dict", [type(state).__name__]
        )
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[5:]), v) for k, v in state.items() if re.fullmatch(r"model\d+", str(k)))
    if chunks:
        return [chunk for _, chunk in chunks]
    if any(str(k).startswith(LAYER_PREFIX) for k in state):
        return [state]
    raise UnknownKeysError(
        f"{description}: no `model` state dict found", list(map(str, state))[:20]
    )


def _router_experts(model: Mapping[str, Any]) -> int | None:
    for key, value in model.items():
        if key.endswith(".mlp.router.weight"):
            return value.shape[0]
    return None


def _read_legacy(files: list[legacy_format.RankFile], report):
    total = len(files)
    states = {}
    for done, file in enumerate(files, 1):
        states[file] = load_torch_file(file.path)
        if report:
            report(done, total, f"read {file.path}")
    first_state = states[files[0]]
    saved = first_state if isinstance(first_state, Mapping) else {}
    args = _args_dict(saved.get("args")) or {}
    roles = _suffix_roles(files, states, args)

    # (virtual chunk, pp) -> ep -> tp -> canonical local layers
    grid: dict[tuple[int, int], dict[int, dict[int, Any]]] = {}
    layouts = set()
    ep_size = 1 + max(f.suffixes[roles.index("ep")] for f in files) if "ep" in roles else 1
    for file in files:
        coords = dict(zip(roles, file.suffixes))
        chunks = _model_chunks(states[file], file.path)
        for chunk_id, model in enumerate(chunks):
            experts = _router_experts(model)
            n_local = None if experts is None else experts // ep_size
            if experts is not None and experts % ep_size:
                raise ExpertCountError(
                    f"{file.path}: {experts} experts do not split over {ep_size} "
                    "expert-parallel ranks"
                )
            layers, count, layout = _local_layers(model, n_local)
            layouts.add(layout)
            grid.setdefault((chunk_id, coords.get("pp", 0)), {}).setdefault(
                coords.get("ep", 0), {}
            )[file.tp] = (layers, count)

    merged_layers: dict[int, dict[str, torch.Tensor]] = {}
    offset = 0
    for key in sorted(grid):
        by_ep = grid[key]
        count = by_ep[0][0][1]
        local_indices = sorted(by_ep[0][0][0])
        for local in local_indices:
            per_ep = []
            for ep in sorted(by_ep):
                shards = [by_ep[ep][tp][0].get(local, {}) for tp in sorted(by_ep[ep])]
                per_ep.append(_merge_tensor_parallel(shards))
            merged_layers[offset + local] = _merge_expert_parallel(per_ep)
        offset += count
    _check_expert_totals(merged_layers)
    layouts.discard(None)
    return merged_layers, offset, saved, layouts.pop() if layouts else "sequential"


def _suffix_roles(files, states, args) -> tuple[str, ...]:
    """What the 3-digit suffixes of the rank folders mean: (), ("pp",), ("ep",) or ("pp", "ep").
    One suffix is ambiguous in Megatron's naming: decided by the saved args, else by whether the
    first file holds fewer experts than its router has."""
    count = len(files[0].suffixes)
    if count != 1:
        return ("pp", "ep")[:count]
    if int(args.get("expert_model_parallel_size") or 1) > 1:
        return ("ep",)
    if int(args.get("pipeline_model_parallel_size") or 1) > 1:
        return ("pp",)
    model = _model_chunks(states[files[0]], files[0].path)[0]
    experts = _router_experts(model)
    local = {
        m.group(1) or m.group(2)
        for key in model
        for m in [re.search(r"\.local_experts\.(\d+)\.|\.linear_fc1\.weight(\d+)$", key)]
        if m
    }
    if experts is not None and local and len(local) < experts:
        return ("ep",)
    return ("pp",)


def _check_expert_totals(layers: dict[int, dict[str, torch.Tensor]]) -> None:
    for index, suffixes in layers.items():
        router = suffixes.get(MOE_KEYS["router_weight"])
        fc1 = suffixes.get(MOE_KEYS["fc1_weight"])
        if router is not None and fc1 is not None and fc1.shape[0] != router.shape[0]:
            raise ExpertCountError(
                f"layer {index}: the router has {router.shape[0]} experts but the rank files hold "
                f"{fc1.shape[0]} (missing expert-parallel rank files?)"
            )


def _assemble_layers(
    layer_tensors: dict[int, dict[str, torch.Tensor]],
) -> dict[int, MoELayerWeights | DenseLayerWeights]:
    layers, unknown = {}, []
    for index in sorted(layer_tensors):
        remaining = dict(layer_tensors[index])
        norm = None
        for stem, (weight_key, bias_key) in NORM_KEYS.items():
            if weight_key in remaining:
                norm = NormWeights(remaining.pop(weight_key), remaining.pop(bias_key, None), stem)
        if MOE_KEYS["router_weight"] in remaining:
            cls, keys = MoELayerWeights, MOE_KEYS
        elif DENSE_KEYS["fc1_weight"] in remaining:
            cls, keys = DenseLayerWeights, DENSE_KEYS
        else:
            unknown += [f"{LAYER_PREFIX}{index}.{s}" for s in remaining]
            continue
        fields = {field: remaining.pop(key, None) for field, key in keys.items()}
        unknown += [f"{LAYER_PREFIX}{index}.{s}" for s in remaining]
        missing = [keys[f] for f in ("fc1_weight", "fc2_weight") if fields[f] is None]
        if missing:
            raise UnknownKeysError(f"layer {index}: MLP without {missing}", missing)
        layers[index] = cls(**fields, norm=norm)
    if unknown:
        raise UnknownKeysError(
            f"{len(unknown)} MLP keys this bridge does not understand: {unknown}", unknown
        )
    return layers
