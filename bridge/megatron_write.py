"""Writing MoE layers as Megatron-Core checkpoints (torch_dist or legacy), with Megatron's key
names, shapes and saved args, so that `bridge.megatron_read.load` (and Megatron) read them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

import jaxmoe
from bridge import legacy_format, torch_dist_format
from bridge.errors import ConfigError
from bridge.megatron_build import weights_from_moe
from bridge.megatron_config import megatron_args
from bridge.megatron_read import progress_reporter
from bridge.megatron_weights import (
    EXPERTS,
    LAYER_PREFIX,
    NORM_KEYS,
    DenseLayerWeights,
    MegatronCheckpoint,
    MoELayerWeights,
    NormWeights,
)

_EXPERT_LAYOUTS = ("sequential", "te_grouped", "legacy_grouped")
_NO_EXTRA_STATE = [None]  # what the local spec's linears save as `_extra_state` in torch_dist


def _layer_map(
    layers,
) -> tuple[
    dict[int, MoELayerWeights | DenseLayerWeights], int, dict | None, jaxmoe.MoEConfig | None
]:
    """Normalise save()'s input to {index: weights}, num_layers, saved args, config."""
    if isinstance(layers, MegatronCheckpoint):
        return dict(layers.layers), layers.num_layers, layers.args, layers.config
    if isinstance(layers, (jaxmoe.MoE, MoELayerWeights, DenseLayerWeights)):
        layers = [layers]
    items = layers.items() if isinstance(layers, Mapping) else enumerate(layers)
    out, configs = {}, set()
    for index, item in items:
        if item is None:
            continue
        if isinstance(item, jaxmoe.MoE):
            configs.add(item.config)
            item = weights_from_moe(item)
        if not isinstance(item, (MoELayerWeights, DenseLayerWeights)):
            raise TypeError(
                f"save: layer {index} is a {type(item).__name__}; expected a "
                "jaxmoe.MoE, MoELayerWeights, DenseLayerWeights or None"
            )
        out[int(index)] = item
    if not out:
        raise ValueError("save: no layers given")
    if len(configs) > 1:
        raise ConfigError("save: the MoE layers have different configs; one checkpoint holds one")
    num_layers = len(layers) if not isinstance(layers, Mapping) else max(out) + 1
    return out, num_layers, None, configs.pop() if configs else None


def _with_norms(layers, norms, norm_key):
    if norms is not None:
        for index, norm in norms.items() if isinstance(norms, Mapping) else enumerate(norms):
            if norm is not None:
                if not isinstance(norm, NormWeights):
                    norm = (
                        NormWeights(*norm) if isinstance(norm, (tuple, list)) else NormWeights(norm)
                    )
                layers[index] = dataclasses.replace(layers[index], norm=norm)
    if norm_key is not None:
        if norm_key not in NORM_KEYS:
            raise ValueError(f"save: norm_key must be one of {sorted(NORM_KEYS)}, got {norm_key!r}")
        layers = {
            i: dataclasses.replace(w, norm=dataclasses.replace(w.norm, key=norm_key))
            if w.norm is not None
            else w
            for i, w in layers.items()
        }
    return layers


def save(
    layers,
    path: str | os.PathLike,
    format: str = "torch_dist",
    *,
    norms=None,
    norm_key: str | None = None,
    expert_layout: str = "sequential",
    per_layer_keys: bool | None = None,
    args: Mapping[str, Any] | None = None,
    iteration: int = 0,
    progress=False,
) -> None:
    """Write MoE layers as a Megatron-Core checkpoint, with Megatron's key names and shapes.

    layers: a jaxmoe.MoE, MoELayerWeights, a MegatronCheckpoint, or a sequence (None = layer
      without an MLP to write) / mapping of global layer index -> those (DenseLayerWeights too).
    format: "torch_dist" (DCP files + metadata.json in the directory `path`) or "legacy"
      (a single torch.save file when `path` ends in .pt, else the tree
      path/latest_checkpointed_iteration.txt + iter_XXXXXXX/mp_rank_00/model_optim_rng.pt).
    norms: per-layer pre-MLP norms (NormWeights, (weight, bias) or weight); norm_key: store every
      norm under this key stem (default: the stem each NormWeights carries).
    expert_layout (legacy): "sequential" (local_experts.{j}), "te_grouped" (weight{j}) or
      "legacy_grouped" (GroupedMLP weight1/weight2).
    per_layer_keys (torch_dist): decoder.layers.{i}.* keys instead of stacked ones (default: only
      when the layers are not a homogeneous run of MoE layers 0..L-1).
    args: the Megatron args to store (default: derived from the layers' MoEConfig).
    The saved args let `load` rebuild the config without the caller's help."""
    if format not in ("torch_dist", "legacy"):
        raise ValueError(f"save: format must be 'torch_dist' or 'legacy', got {format!r}")
    if expert_layout not in _EXPERT_LAYOUTS:
        raise ValueError(f"save: expert_layout must be one of {_EXPERT_LAYOUTS}")
    layer_map, num_layers, saved_args, config = _layer_map(layers)
    layer_map = _with_norms(layer_map, norms, norm_key)
    if args is None:
        args = saved_args
    if args is None and config is not None:
        first = layer_map[min(i for i, w in layer_map.items() if isinstance(w, MoELayerWeights))]
        args = megatron_args(
            config,
            hidden_size=first.hidden_size,
            num_layers=num_layers,
            params_dtype=first.fc1_weight.dtype,
        )
    common = {"checkpoint_version": 3.0, "iteration": iteration}
    if args is not None:
        common["args"] = argparse.Namespace(**dict(args))
    report = progress_reporter(progress)
    path = os.fspath(path)
    if format == "torch_dist":
        state = _torch_dist_state(layer_map, num_layers, per_layer_keys)
        state["common_state/shard_0_1"] = [common]
        torch_dist_format.write(path, state, (lambda m: report(0, 1, m)) if report else None)
    else:
        model = _legacy_state(layer_map, expert_layout)
        _write_legacy(path, common | {"model": model}, iteration)
    if report:
        report(1, 1, f"wrote {path}")


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A compact copy (torch.save writes a view's whole storage)."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _stackable(layer_map, num_layers) -> bool:
    if sorted(layer_map) != list(range(num_layers)):
        return False
    signatures = {
        tuple((k, tuple(t.shape), t.dtype) for k, t in sorted(w.tensors().items()))
        for w in layer_map.values()
    }
    return len(signatures) == 1 and all(isinstance(w, MoELayerWeights) for w in layer_map.values())


def _torch_dist_state(layer_map, num_layers, per_layer_keys) -> dict[str, Any]:
    stacked = _stackable(layer_map, num_layers) if per_layer_keys is None else not per_layer_keys
    if stacked and not _stackable(layer_map, num_layers):
        raise ValueError(
            "save: stacked torch_dist keys need MoE layers 0..L-1 with identical "
            "shapes; pass per_layer_keys=True"
        )
    state: dict[str, Any] = {}
    if stacked:
        first = layer_map[0]
        for key in first.tensors():
            state[LAYER_PREFIX + key] = torch.stack(
                [layer_map[i].tensors()[key] for i in range(num_layers)]
            ).contiguous()
        for i in range(num_layers):
            _add_extra_states(state, LAYER_PREFIX, first, (i,), (num_layers,))
        return state
    for index, weights in sorted(layer_map.items()):
        prefix = f"{LAYER_PREFIX}{index}."
        for key, tensor in weights.tensors().items():
            state[prefix + key] = _owned(tensor)
        if isinstance(weights, MoELayerWeights):
            _add_extra_states(state, prefix, weights, (), ())
    return state


def _add_extra_states(state, prefix, weights: MoELayerWeights, offset, shape) -> None:
    """The local spec's (empty) `_extra_state` ShardedObjects of the expert and shared-expert
    linears, keyed `{key}/shard_{offsets}_{global shape}` as Megatron does."""

    def shard(extra_offset, extra_shape):
        offsets, sizes = offset + extra_offset, shape + extra_shape
        return f"shard_{'.'.join(map(str, offsets)) or 0}_{'.'.join(map(str, sizes)) or 1}"

    for linear in ("linear_fc1", "linear_fc2"):
        for expert in range(weights.num_experts):
            key = (
                f"{prefix}{EXPERTS}{linear}._extra_state/{shard((expert,), (weights.num_experts,))}"
            )
            state[key] = list(_NO_EXTRA_STATE)
        if weights.shared_fc1_weight is not None:
            key = f"{prefix}mlp.shared_experts.{linear}._extra_state/{shard((), ())}"
            state[key] = list(_NO_EXTRA_STATE)


def _legacy_state(layer_map, expert_layout) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for index, weights in sorted(layer_map.items()):
        prefix = f"{LAYER_PREFIX}{index}."
        for key, tensor in weights.tensors().items():
            if not key.startswith(EXPERTS):
                model[prefix + key] = _owned(tensor)
        if isinstance(weights, MoELayerWeights):
            model.update(_legacy_experts(prefix, weights, expert_layout))
            if weights.shared_fc1_weight is not None:
                for linear in ("linear_fc1", "linear_fc2"):
                    model[f"{prefix}mlp.shared_experts.{linear}._extra_state"] = None
    return model


def _legacy_experts(prefix, weights: MoELayerWeights, layout) -> dict[str, Any]:
    tensors = {
        name[len(EXPERTS) :]: t for name, t in weights.tensors().items() if name.startswith(EXPERTS)
    }
    out: dict[str, Any] = {}
    if layout == "legacy_grouped":
        if len(tensors) != 2:
            raise ValueError("save: GroupedMLP (legacy_grouped) has no expert biases")
        hidden = weights.hidden_size
        out[prefix + "mlp.experts.weight1"] = (
            weights.fc1_weight.transpose(1, 2).contiguous().view(hidden, -1)
        )
        out[prefix + "mlp.experts.weight2"] = (
            weights.fc2_weight.transpose(1, 2).contiguous().view(-1, hidden)
        )
        return out
    for name, stacked in tensors.items():
        linear, kind = name.split(".")
        for j in range(stacked.shape[0]):
            key = (
                f"mlp.experts.local_experts.{j}.{name}"
                if layout == "sequential"
                else f"mlp.experts.{linear}.{kind}{j}"
            )
            out[prefix + key] = _owned(stacked[j])
    if layout == "sequential":
        for j in range(weights.num_experts):
            for linear in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}mlp.experts.local_experts.{j}.{linear}._extra_state"] = None
    return out


def _write_legacy(path: str, state: dict[str, Any], iteration: int) -> None:
    if path.endswith(".pt"):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path)
        return
    rank_dir = os.path.join(
        path, legacy_format.iteration_dir_name(iteration), legacy_format.rank_dir_name(0)
    )
    os.makedirs(rank_dir, exist_ok=True)
    torch.save(state, os.path.join(rank_dir, legacy_format.RANK_FILE))
    with open(os.path.join(path, legacy_format.TRACKER_FILE), "w") as handle:
        handle.write(str(iteration))
