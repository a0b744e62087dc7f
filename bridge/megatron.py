"""Megatron-Core MoE checkpoints <-> jaxmoe (shared spec `megatron_moe.md` §3.1, §3.2, §7).

    ckpt = bridge.megatron.load("ckpt_dir")              # torch_dist dir, legacy file or tree
    moe = bridge.megatron.build_moe(ckpt, layer=0)       # a ready jaxmoe.MoE
    bridge.megatron.save([moe0, moe1], "out", format="torch_dist")

`load` normalises every on-disk layout into one in-memory form, `MegatronCheckpoint`: for each
global layer, full (unsharded) torch tensors in Megatron's [out, in] layout with all E experts
stacked on a leading axis (`MoELayerWeights`), dense MLP layers as `DenseLayerWeights`. Layouts
read: torch_dist stacked `decoder.layers.*` keys (leading layer axis) and per-layer
`decoder.layers.{i}.*` keys, the `experts.experts.` prefix and the singleton `weight_w`/`weight_v`
form; legacy state dicts with SequentialMLP (`local_experts.{j}`), TEGroupedMLP
(`linear_fc1.weight{j}`) or the removed GroupedMLP (`weight1`/`weight2` raw views), merged across
tensor-, pipeline- and expert-parallel rank files. Only the MoE/MLP keys are read; torch_dist
`optimizer.*` entries are never requested; every pickle goes through `bridge.safe_load`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import torch
from flax import nnx

import jaxmoe
from bridge import legacy_format, torch_dist_format
from bridge.dlpack import jax_dtype, to_jax, to_torch, torch_dtype
from bridge.errors import (ConfigError, CorruptCheckpointError, ExpertCountError,
                           ShapeMismatchError, UnknownKeysError)
from bridge.safe_load import OpaqueGlobal, load_torch_file
from bridge.te_mxfp8 import MXFP8Weight, refit_mxfp8

__all__ = ["load", "build_moe", "save", "weights_from_moe", "megatron_args", "config_from_args",
           "MegatronCheckpoint", "MoELayerWeights", "DenseLayerWeights", "NormWeights",
           "refit_mxfp8", "MXFP8Weight"]

LAYER_PREFIX = "decoder.layers."
EXPERTS = "mlp.experts.experts."
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_KEY = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_TE_GROUPED_KEY = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SINGLETON_KEY = re.compile(r"^mlp\.experts\.experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_LEGACY_GROUPED_KEYS = ("mlp.experts.weight1", "mlp.experts.weight2")

# MoELayerWeights field -> canonical per-layer key (relative to `decoder.layers.{i}.`).
MOE_KEYS = {
    "router_weight": "mlp.router.weight",
    "router_bias": "mlp.router.bias",
    "expert_bias": "mlp.router.expert_bias",
    "fc1_weight": EXPERTS + "linear_fc1.weight",
    "fc1_bias": EXPERTS + "linear_fc1.bias",
    "fc2_weight": EXPERTS + "linear_fc2.weight",
    "fc2_bias": EXPERTS + "linear_fc2.bias",
    "shared_fc1_weight": "mlp.shared_experts.linear_fc1.weight",
    "shared_fc2_weight": "mlp.shared_experts.linear_fc2.weight",
    "shared_gate_weight": "mlp.shared_experts.gate_weight",
}
_DENSE_KEYS = {"fc1_weight": "mlp.linear_fc1.weight", "fc1_bias": "mlp.linear_fc1.bias",
               "fc2_weight": "mlp.linear_fc2.weight", "fc2_bias": "mlp.linear_fc2.bias"}
# Norm key stem -> (weight key, bias key). Local spec: legacy `pre_mlp_layernorm`, torch_dist
# `mlp.linear_fc1.layer_norm_*`; TE spec: `pre_mlp_layernorm` in both (spec §7.2).
NORM_KEYS = {"pre_mlp_layernorm": ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"),
             "mlp.linear_fc1.layer_norm": ("mlp.linear_fc1.layer_norm_weight",
                                           "mlp.linear_fc1.layer_norm_bias")}
# Column-parallel fc1 weights/biases (GLU-split over TP when gated) and the dim they shard on.
_COLUMN_PARALLEL = {EXPERTS + "linear_fc1.weight": -2, EXPERTS + "linear_fc1.bias": -1,
                    "mlp.shared_experts.linear_fc1.weight": -2,
                    "mlp.linear_fc1.weight": -2, "mlp.linear_fc1.bias": -1}
_ROW_PARALLEL = {EXPERTS + "linear_fc2.weight": -1, "mlp.shared_experts.linear_fc2.weight": -1,
                 "mlp.linear_fc2.weight": -1}
# (jaxmoe submodule, attribute, MoELayerWeights field, permutation Megatron -> jaxmoe layout).
JAXMOE_PARAMS = (
    ("router", "kernel", "router_weight", (1, 0)),
    ("router", "bias", "router_bias", None),
    ("router", "expert_bias", "expert_bias", None),
    ("experts", "fc1_kernel", "fc1_weight", (0, 2, 1)),
    ("experts", "fc1_bias", "fc1_bias", None),
    ("experts", "fc2_kernel", "fc2_weight", (0, 2, 1)),
    ("experts", "fc2_bias", "fc2_bias", None),
    ("shared_experts", "fc1_kernel", "shared_fc1_weight", (1, 0)),
    ("shared_experts", "fc2_kernel", "shared_fc2_weight", (1, 0)),
    ("shared_experts", "gate_kernel", "shared_gate_weight", (1, 0)),
)
_EXPERT_LAYOUTS = ("sequential", "te_grouped", "legacy_grouped")
_NO_EXTRA_STATE = [None]      # what the local spec's linears save as `_extra_state` in torch_dist


# ------------------------------------------------------------------------------- loaded objects
@dataclasses.dataclass
class NormWeights:
    """The MLP pre-norm (LayerNorm: weight and bias; RMSNorm: weight only) and the key stem it is
    stored under ("pre_mlp_layernorm" or "mlp.linear_fc1.layer_norm"). jaxmoe.MoE has no norm:
    apply it before the layer."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    key: str = "pre_mlp_layernorm"


@dataclasses.dataclass
class MoELayerWeights:
    """One MoE layer in Megatron's global layout ([out, in], all experts, no TP sharding).

    router_weight [E, H]; router_bias [E]; expert_bias [E] fp32; fc1_weight [E, 2F, H] with rows
    [gate; up] for a GLU (else [E, F, H]); fc1_bias [E, 2F|F]; fc2_weight [E, H, F]; fc2_bias
    [E, H]; shared_fc1_weight [2Fs|Fs, H]; shared_fc2_weight [H, Fs]; shared_gate_weight [1, H];
    absent tensors are None."""

    router_weight: torch.Tensor
    fc1_weight: torch.Tensor
    fc2_weight: torch.Tensor
    router_bias: torch.Tensor | None = None
    expert_bias: torch.Tensor | None = None
    fc1_bias: torch.Tensor | None = None
    fc2_bias: torch.Tensor | None = None
    shared_fc1_weight: torch.Tensor | None = None
    shared_fc2_weight: torch.Tensor | None = None
    shared_gate_weight: torch.Tensor | None = None
    norm: NormWeights | None = None

    @property
    def num_experts(self) -> int:
        """E."""
        return self.router_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        """H."""
        return self.router_weight.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Canonical per-layer key -> tensor for every present tensor (norm included)."""
        out = {key: getattr(self, field) for field, key in MOE_KEYS.items()
               if getattr(self, field) is not None}
        return out | _norm_tensors(self.norm)


@dataclasses.dataclass
class DenseLayerWeights:
    """A dense (non-MoE) MLP layer: fc1_weight [2F|F, H] ([gate; up] for a GLU), fc2_weight
    [H, F], optional biases and norm. Loaded so mixed models round-trip; jaxmoe does not run it."""

    fc1_weight: torch.Tensor
    fc2_weight: torch.Tensor
    fc1_bias: torch.Tensor | None = None
    fc2_bias: torch.Tensor | None = None
    norm: NormWeights | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Canonical per-layer key -> tensor for every present tensor (norm included)."""
        out = {key: getattr(self, field) for field, key in _DENSE_KEYS.items()
               if getattr(self, field) is not None}
        return out | _norm_tensors(self.norm)


def _norm_tensors(norm: NormWeights | None) -> dict[str, torch.Tensor]:
    if norm is None:
        return {}
    weight_key, bias_key = NORM_KEYS[norm.key]
    return {weight_key: norm.weight} | ({bias_key: norm.bias} if norm.bias is not None else {})


@dataclasses.dataclass
class MegatronCheckpoint:
    """What `load` returns.

    path: where it was read; format: "torch_dist" or "legacy"; expert_layout: how the experts were
    stored ("torch_dist", "torch_dist_singleton", "sequential", "te_grouped", "legacy_grouped");
    layers: global layer index -> MoELayerWeights | DenseLayerWeights (layers without an MLP are
    absent); num_layers; config: the MoEConfig (saved args or caller's), None when neither was
    available; args: the saved Megatron args as a dict (None when the checkpoint has none);
    iteration: the saved iteration, if any."""

    path: str
    format: str
    expert_layout: str
    layers: dict[int, MoELayerWeights | DenseLayerWeights]
    num_layers: int
    config: jaxmoe.MoEConfig | None = None
    args: dict | None = None
    iteration: int | None = None

    @property
    def moe_layers(self) -> list[int]:
        """Global indices of the MoE layers, ascending."""
        return sorted(i for i, w in self.layers.items() if isinstance(w, MoELayerWeights))

    @property
    def hidden_size(self) -> int:
        """H, from the first MoE layer's router."""
        return self.layer(self.moe_layers[0]).hidden_size

    def layer(self, index: int) -> MoELayerWeights:
        """The weights of MoE layer `index` (a global layer index)."""
        weights = self.layers.get(index)
        if not isinstance(weights, MoELayerWeights):
            what = "a dense MLP layer" if weights is not None else "not in the checkpoint"
            raise ConfigError(f"layer {index} is {what}; MoE layers: {self.moe_layers}")
        return weights


# ---------------------------------------------------------------------------- configuration
def config_from_args(args: Mapping[str, Any], **overrides) -> jaxmoe.MoEConfig:
    """MoEConfig from Megatron names: a TransformerConfig dict, a config.json, or Megatron-LM's
    saved argparse `args` (whose names differ: num_experts, swiglu, squared_relu)."""
    names = {key: value for key, value in dict(args).items()
             if not isinstance(value, OpaqueGlobal)}
    if names.get("num_moe_experts") is None and names.get("num_experts") is not None:
        names["num_moe_experts"] = names["num_experts"]
    if "activation" not in names and "activation_func" not in names:
        if names.get("swiglu"):
            names.update(activation="silu", gated_linear_unit=True)
        elif names.get("squared_relu"):
            names["activation"] = "squared_relu"
    try:
        return jaxmoe.MoEConfig.from_megatron(names, **overrides)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot build a MoEConfig from the Megatron config: {exc}") from exc


def megatron_args(config: jaxmoe.MoEConfig, *, hidden_size: int, num_layers: int,
                  params_dtype: torch.dtype) -> dict[str, Any]:
    """Megatron names for `config` (TransformerConfig fields plus Megatron-LM's argparse aliases),
    such that `config_from_args(megatron_args(c, ...)) == c`."""
    c = config
    args = dict(
        num_layers=num_layers, hidden_size=hidden_size, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        num_moe_experts=c.num_experts, num_experts=c.num_experts,
        moe_ffn_hidden_size=c.ffn_hidden_size, moe_router_topk=c.top_k,
        moe_router_score_function=c.score_function, moe_router_pre_softmax=c.pre_softmax,
        moe_router_topk_scaling_factor=c.topk_scaling_factor,
        moe_router_num_groups=c.num_groups, moe_router_group_topk=c.group_topk,
        moe_router_enable_expert_bias=c.enable_expert_bias,
        moe_router_bias_update_rate=c.bias_update_rate,
        moe_router_dtype="fp32" if c.router_dtype == "fp32" else None,
        moe_router_load_balancing_type=c.load_balancing_type, moe_aux_loss_coeff=c.aux_loss_coeff,
        moe_z_loss_coeff=c.z_loss_coeff, moe_input_jitter_eps=c.input_jitter_eps,
        moe_expert_capacity_factor=c.capacity_factor, moe_token_drop_policy=c.token_drop_policy,
        moe_pad_expert_input_to_capacity=c.pad_expert_input_to_capacity,
        activation=c.activation, gated_linear_unit=c.gated_linear_unit,
        swiglu=c.gated_linear_unit and c.activation == "silu",
        squared_relu=c.activation == "squared_relu", add_bias_linear=c.add_bias_linear,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_shared_expert_gate=c.shared_expert_gate,
        moe_dispatch_fwd_dtype=c.dispatch_dtype, moe_combine_bwd_dtype=c.combine_bwd_dtype,
    )
    if c.expert_precision == "mxfp8":
        args.update(fp8="e4m3", fp8_recipe="mxfp8")
    return args


def resolve_config(saved_args: dict | None, given) -> jaxmoe.MoEConfig | None:
    """The MoEConfig to use: from the checkpoint's saved args when readable, else the caller's
    `given` (MoEConfig, dict of Megatron names, or config.json path); both present and different
    is a ConfigError (nothing is silently ignored)."""
    if given is None:
        caller = None
    elif isinstance(given, jaxmoe.MoEConfig):
        caller = given
    elif isinstance(given, Mapping):
        caller = config_from_args(given)
    else:
        path = os.fspath(given)
        try:
            with open(path) as handle:
                caller = config_from_args(json.load(handle))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {path}: {exc}") from exc
    if saved_args is None or saved_args.get("num_moe_experts", saved_args.get("num_experts")) is None:
        return caller
    try:
        saved = config_from_args(saved_args)
    except ConfigError:
        if caller is None:
            raise
        return caller
    if caller is not None and caller != saved:
        diff = {f.name: (getattr(saved, f.name), getattr(caller, f.name))
                for f in dataclasses.fields(saved) if getattr(saved, f.name) != getattr(caller, f.name)}
        raise ConfigError(f"the given config differs from the checkpoint's saved args "
                          f"(field: (saved, given)): {diff}")
    return saved


def _args_dict(args: Any) -> dict | None:
    if args is None:
        return None
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, Mapping) else None


def check_layer(config: jaxmoe.MoEConfig, index: int, w: MoELayerWeights) -> None:
    """Raise ExpertCountError / ShapeMismatchError (naming the key and both shapes) when layer
    `index`'s tensors do not fit `config`."""
    e, h, f = config.num_experts, w.hidden_size, config.ffn_hidden_size
    if w.num_experts != e:
        raise ExpertCountError(f"{LAYER_PREFIX}{index}.{MOE_KEYS['router_weight']}: the checkpoint "
                               f"has {w.num_experts} experts (shape {tuple(w.router_weight.shape)}),"
                               f" the config num_experts={e} (expected shape ({e}, {h}))")
    fs = config.shared_expert_intermediate_size
    fs1 = None if fs is None else (2 * fs if config.gated_linear_unit else fs)
    bias = config.add_bias_linear
    expected = {
        "fc1_weight": (e, config.fc1_output_size, h), "fc2_weight": (e, h, f),
        "router_bias": (e,) if bias else None, "expert_bias": (e,) if config.enable_expert_bias else None,
        "fc1_bias": (e, config.fc1_output_size) if bias else None,
        "fc2_bias": (e, h) if bias else None,
        "shared_fc1_weight": None if fs is None else (fs1, h),
        "shared_fc2_weight": None if fs is None else (h, fs),
        "shared_gate_weight": (1, h) if config.shared_expert_gate else None,
    }
    for field, shape in expected.items():
        tensor = getattr(w, field)
        actual = None if tensor is None else tuple(tensor.shape)
        if actual != shape:
            raise ShapeMismatchError(
                f"{LAYER_PREFIX}{index}.{MOE_KEYS[field]}: checkpoint shape "
                f"{'absent' if actual is None else actual} but the config needs "
                f"{'absent' if shape is None else shape}")


# ------------------------------------------------------------------------------------ reading
def _progress_reporter(progress) -> Callable[[int, int, str], None] | None:
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
    report = _progress_reporter(progress)
    kind, location = legacy_format.resolve(path)
    if kind == "torch_dist":
        layer_tensors, num_layers, saved, layout = _read_torch_dist(location, report)
        fmt = "torch_dist"
    else:
        files = ([legacy_format.RankFile(location, 0, ())] if kind == "legacy_file"
                 else legacy_format.rank_files(location))
        layer_tensors, num_layers, saved, layout = _read_legacy(files, report)
        fmt = "legacy"
    saved = saved or {}
    args = _args_dict(saved.get("args"))
    layers = _assemble_layers(layer_tensors)
    ckpt = MegatronCheckpoint(path=path, format=fmt, expert_layout=layout, layers=layers,
                              num_layers=int(args.get("num_layers") or num_layers) if args else num_layers,
                              config=resolve_config(args, config), args=args,
                              iteration=saved.get("iteration"))
    if ckpt.config is not None:
        for index in ckpt.moe_layers:
            check_layer(ckpt.config, index, ckpt.layers[index])
    return ckpt


def _mlp_suffix(suffix: str) -> bool:
    return suffix.startswith(("mlp.", "pre_mlp_layernorm.")) and "_extra_state" not in suffix


def _read_torch_dist(path, report):
    index = torch_dist_format.read_index(path)
    wanted = []
    for key, entry in index.items():
        if not key.startswith(LAYER_PREFIX) or not hasattr(entry, "size"):
            continue
        match = _LAYER_KEY.match(key)
        suffix = match.group(2) if match else key[len(LAYER_PREFIX):]
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
                layers.setdefault(index_, {})[key[len(LAYER_PREFIX):]] = tensor[index_]
            num_layers = max(num_layers, tensor.shape[0])
    singleton = any(_SINGLETON_KEY.match(s) or s.endswith(("_w", "_v"))
                    for suffixes in layers.values() for s in suffixes)
    layers = {i: _join_singleton(i, suffixes) for i, suffixes in layers.items()}
    if report:
        report(1, 1, f"read {len(layers)} layers")
    return layers, num_layers, torch_dist_format.read_common_state(path, index), \
        "torch_dist_singleton" if singleton else "torch_dist"


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
        raise ExpertCountError(f"layer {index} {name}: expert indices {ids} are not 0..{len(ids) - 1}"
                               " (missing experts?)")
    return torch.stack([by_expert[j] for j in ids])


def _local_layers(model: Mapping[str, Any], num_local_experts: int | None
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
        raise UnknownKeysError(f"mixed expert layouts {sorted(layouts)} in one state dict",
                               sorted(layouts))
    return layers, count, layouts.pop() if layouts else None


def stack_local_experts(index: int, suffixes: dict[str, torch.Tensor],
                        num_local_experts: int | None) -> str | None:
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
    `weight2` [n*F, H] of [n, F, H] (= fc2.weight^T); spec §3.1."""
    if not all(key in suffixes for key in _LEGACY_GROUPED_KEYS):
        raise UnknownKeysError(f"layer {index}: GroupedMLP needs both weight1 and weight2",
                               [k for k in _LEGACY_GROUPED_KEYS if k not in suffixes])
    weight1, weight2 = (suffixes.pop(key) for key in _LEGACY_GROUPED_KEYS)
    hidden = weight1.shape[0]
    if n is None or weight1.shape[1] % n or weight2.shape[0] % n:
        raise ExpertCountError(f"layer {index}: GroupedMLP weight1 {tuple(weight1.shape)} / weight2 "
                               f"{tuple(weight2.shape)} do not split into {n} local experts")
    w1 = weight1.contiguous().view(n, hidden, weight1.shape[1] // n)
    w2 = weight2.contiguous().view(n, weight2.shape[0] // n, hidden)
    suffixes[EXPERTS + "linear_fc1.weight"] = w1.transpose(1, 2).contiguous()
    suffixes[EXPERTS + "linear_fc2.weight"] = w2.transpose(1, 2).contiguous()


def _is_gated(suffixes: dict[str, torch.Tensor], fc1_key: str) -> bool:
    """GLU iff fc1's output rows are twice fc2's input columns (holds per TP shard too)."""
    fc2 = suffixes[fc1_key.replace("linear_fc1.bias", "linear_fc1.weight")
                   .replace("linear_fc1.weight", "linear_fc2.weight")]
    fc1 = suffixes[fc1_key.replace("linear_fc1.bias", "linear_fc1.weight")]
    return fc1.shape[-2] == 2 * fc2.shape[-1]


def _merge_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Merge one layer's TP shards (rank order): fc1 [W_r; V_r] shards -> [W_0; W_1; ..; V_0; ..]
    (plain concatenation without a GLU), fc2 concatenated on its input dim, the rest replicated."""
    if len(shards) == 1:
        return shards[0]
    if any(shard.keys() != shards[0].keys() for shard in shards):
        raise CorruptCheckpointError("the tensor-parallel rank files of a layer hold different keys")
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
        raise UnknownKeysError(f"{description}: not a Megatron checkpoint dict", [type(state).__name__])
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[5:]), v) for k, v in state.items() if re.fullmatch(r"model\d+", str(k)))
    if chunks:
        return [chunk for _, chunk in chunks]
    if any(str(k).startswith(LAYER_PREFIX) for k in state):
        return [state]
    raise UnknownKeysError(f"{description}: no `model` state dict found", list(map(str, state))[:20])


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
                raise ExpertCountError(f"{file.path}: {experts} experts do not split over {ep_size} "
                                       "expert-parallel ranks")
            layers, count, layout = _local_layers(model, n_local)
            layouts.add(layout)
            grid.setdefault((chunk_id, coords.get("pp", 0)), {}).setdefault(
                coords.get("ep", 0), {})[file.tp] = (layers, count)

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
    local = {m.group(1) or m.group(2) for key in model
             for m in [re.search(r"\.local_experts\.(\d+)\.|\.linear_fc1\.weight(\d+)$", key)] if m}
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
                f"{fc1.shape[0]} (missing expert-parallel rank files?)")


def _assemble_layers(layer_tensors: dict[int, dict[str, torch.Tensor]]
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
        elif _DENSE_KEYS["fc1_weight"] in remaining:
            cls, keys = DenseLayerWeights, _DENSE_KEYS
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
        raise UnknownKeysError(f"{len(unknown)} MLP keys this bridge does not understand: "
                               f"{unknown}", unknown)
    return layers


# ----------------------------------------------------------------------------- jaxmoe modules
def _common_dtype(weights: MoELayerWeights) -> torch.dtype:
    dtypes = {t.dtype for f, t in dataclasses.asdict(weights).items()
              if isinstance(t, torch.Tensor) and f != "expert_bias"}
    if len(dtypes) != 1:
        raise ConfigError(f"the layer's tensors have several dtypes {sorted(map(str, dtypes))}; pass "
                          "param_dtype")
    return dtypes.pop()


def build_moe(ckpt: MegatronCheckpoint, layer: int, *, config=None, param_dtype=None,
              **moe_kwargs) -> jaxmoe.MoE:
    """A `jaxmoe.MoE` holding MoE layer `layer` of `ckpt`.

    config: overrides `ckpt.config` (MoEConfig, dict of Megatron names, or config.json path).
    param_dtype: jaxmoe's param dtype (default: the checkpoint's; the expert bias stays fp32).
    moe_kwargs go to `jaxmoe.MoE` (dtype, gmm_impl, ...). Parameters are copied into jaxmoe's
    [in, out] layout (the untransposed ones are shared with the torch tensors over DLPack)."""
    weights = ckpt.layer(layer)
    config = resolve_config(None, config) if config is not None else ckpt.config
    if config is None:
        raise ConfigError("the checkpoint has no saved args: pass config= (a MoEConfig, a dict of "
                          "Megatron names, or a config.json path)")
    check_layer(config, layer, weights)
    param_dtype = jnp.dtype(jax_dtype(param_dtype or _common_dtype(weights)))
    values = {}
    for module, attr, field, perm in JAXMOE_PARAMS:
        tensor = getattr(weights, field)
        if tensor is None:
            continue
        dtype = torch.float32 if field == "expert_bias" else torch_dtype(param_dtype)
        tensor = tensor.to(dtype)
        values[(module, attr)] = to_jax(tensor.permute(perm) if perm else tensor, copy=True)
    return _moe_with_params(config, weights.hidden_size, param_dtype, values, moe_kwargs)


def _moe_with_params(config, hidden_size, param_dtype, values, moe_kwargs) -> jaxmoe.MoE:
    """Build the module abstractly (no random init) and fill it: parameters from `values`, RNG
    keys seeded with 0, running statistics zero."""
    abstract = nnx.eval_shape(lambda: jaxmoe.MoE(config, hidden_size, param_dtype=param_dtype,
                                                 rngs=nnx.Rngs(0), **moe_kwargs))
    graphdef, state = nnx.split(abstract)

    def fill(path, leaf):
        names = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
        if names in values:
            value = values[names]
            if value.shape != leaf.shape or value.dtype != leaf.dtype:
                raise ShapeMismatchError(f"jaxmoe param {'.'.join(names)}: got {value.dtype}"
                                         f"{value.shape}, the module needs {leaf.dtype}{leaf.shape}")
            return value
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(leaf.shape, leaf.dtype)
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def weights_from_moe(moe: jaxmoe.MoE, norm: NormWeights | None = None,
                     dtype: torch.dtype | None = None) -> MoELayerWeights:
    """A jaxmoe.MoE's parameters as MoELayerWeights (Megatron layout torch tensors, copies).
    dtype: cast the non-expert-bias tensors (default: keep jaxmoe's param dtype)."""
    fields: dict[str, Any] = {"norm": norm}
    for module, attr, field, perm in JAXMOE_PARAMS:
        owner = getattr(moe, module)
        param = None if owner is None else getattr(owner, attr)
        if param is None:
            continue
        tensor = to_torch(jnp.asarray(param[...]))
        tensor = tensor.permute(perm) if perm else tensor
        if dtype is not None and field != "expert_bias":
            tensor = tensor.to(dtype)
        fields[field] = tensor.contiguous().clone()
    return MoELayerWeights(**fields)


# ------------------------------------------------------------------------------------ writing
def _layer_map(layers) -> tuple[dict[int, MoELayerWeights | DenseLayerWeights], int, dict | None,
                                jaxmoe.MoEConfig | None]:
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
            raise TypeError(f"save: layer {index} is a {type(item).__name__}; expected a "
                            "jaxmoe.MoE, MoELayerWeights, DenseLayerWeights or None")
        out[int(index)] = item
    if not out:
        raise ValueError("save: no layers given")
    if len(configs) > 1:
        raise ConfigError("save: the MoE layers have different configs; one checkpoint holds one")
    num_layers = len(layers) if not isinstance(layers, Mapping) else max(out) + 1
    return out, num_layers, None, configs.pop() if configs else None


def _with_norms(layers, norms, norm_key):
    if norms is not None:
        for index, norm in (norms.items() if isinstance(norms, Mapping) else enumerate(norms)):
            if norm is not None:
                if not isinstance(norm, NormWeights):
                    norm = NormWeights(*norm) if isinstance(norm, (tuple, list)) else NormWeights(norm)
                layers[index] = dataclasses.replace(layers[index], norm=norm)
    if norm_key is not None:
        if norm_key not in NORM_KEYS:
            raise ValueError(f"save: norm_key must be one of {sorted(NORM_KEYS)}, got {norm_key!r}")
        layers = {i: dataclasses.replace(w, norm=dataclasses.replace(w.norm, key=norm_key))
                  if w.norm is not None else w for i, w in layers.items()}
    return layers


def save(layers, path: str | os.PathLike, format: str = "torch_dist", *, norms=None,
         norm_key: str | None = None, expert_layout: str = "sequential",
         per_layer_keys: bool | None = None, args: Mapping[str, Any] | None = None,
         iteration: int = 0, progress=False) -> None:
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
        args = megatron_args(config, hidden_size=first.hidden_size, num_layers=num_layers,
                             params_dtype=first.fc1_weight.dtype)
    common = {"checkpoint_version": 3.0, "iteration": iteration}
    if args is not None:
        common["args"] = argparse.Namespace(**dict(args))
    report = _progress_reporter(progress)
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
    signatures = {tuple((k, tuple(t.shape), t.dtype) for k, t in sorted(w.tensors().items()))
                  for w in layer_map.values()}
    return len(signatures) == 1 and all(isinstance(w, MoELayerWeights) for w in layer_map.values())


def _torch_dist_state(layer_map, num_layers, per_layer_keys) -> dict[str, Any]:
    stacked = _stackable(layer_map, num_layers) if per_layer_keys is None else not per_layer_keys
    if stacked and not _stackable(layer_map, num_layers):
        raise ValueError("save: stacked torch_dist keys need MoE layers 0..L-1 with identical "
                         "shapes; pass per_layer_keys=True")
    state: dict[str, Any] = {}
    if stacked:
        first = layer_map[0]
        for key in first.tensors():
            state[LAYER_PREFIX + key] = torch.stack([layer_map[i].tensors()[key]
                                                     for i in range(num_layers)]).contiguous()
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
            key = f"{prefix}{EXPERTS}{linear}._extra_state/{shard((expert,), (weights.num_experts,))}"
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
    tensors = {name[len(EXPERTS):]: t for name, t in weights.tensors().items()
               if name.startswith(EXPERTS)}
    out: dict[str, Any] = {}
    if layout == "legacy_grouped":
        if len(tensors) != 2:
            raise ValueError("save: GroupedMLP (legacy_grouped) has no expert biases")
        hidden = weights.hidden_size
        out[prefix + "mlp.experts.weight1"] = (
            weights.fc1_weight.transpose(1, 2).contiguous().view(hidden, -1))
        out[prefix + "mlp.experts.weight2"] = (
            weights.fc2_weight.transpose(1, 2).contiguous().view(-1, hidden))
        return out
    for name, stacked in tensors.items():
        linear, kind = name.split(".")
        for j in range(stacked.shape[0]):
            key = (f"mlp.experts.local_experts.{j}.{name}" if layout == "sequential"
                   else f"mlp.experts.{linear}.{kind}{j}")
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
    rank_dir = os.path.join(path, legacy_format.iteration_dir_name(iteration),
                            legacy_format.rank_dir_name(0))
    os.makedirs(rank_dir, exist_ok=True)
    torch.save(state, os.path.join(rank_dir, legacy_format.RANK_FILE))
    with open(os.path.join(path, legacy_format.TRACKER_FILE), "w") as handle:
        handle.write(str(iteration))

