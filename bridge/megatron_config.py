"""Mapping between Megatron-Core's configuration names and jaxmoe's `MoEConfig`.

`config_from_args` reads Megatron names (a TransformerConfig dict, a config.json, or Megatron-LM's
saved argparse args), `megatron_args` writes them, `resolve_config` decides between a checkpoint's
saved args and the caller's config, and `check_layer` checks a layer's tensor shapes against a
config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

import jaxmoe
from bridge.errors import ConfigError, ExpertCountError, ShapeMismatchError
from bridge.megatron_weights import LAYER_PREFIX, MOE_KEYS, MoELayerWeights
from bridge.safe_load import OpaqueGlobal


def config_from_args(args: Mapping[str, Any], **overrides) -> jaxmoe.MoEConfig:
    """MoEConfig from Megatron names: a TransformerConfig dict, a config.json, or Megatron-LM's
    saved argparse `args` (whose names differ: num_experts, swiglu, squared_relu)."""
    names = {key: value for key, value in dict(args).items() if not isinstance(value, OpaqueGlobal)}
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


def megatron_args(
    config: jaxmoe.MoEConfig, *, hidden_size: int, num_layers: int, params_dtype: torch.dtype
) -> dict[str, Any]:
    """Megatron names for `config` (TransformerConfig fields plus Megatron-LM's argparse aliases),
    such that `config_from_args(megatron_args(c, ...)) == c`."""
    c = config
    args = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        num_moe_experts=c.num_experts,
        num_experts=c.num_experts,
        moe_ffn_hidden_size=c.ffn_hidden_size,
        moe_router_topk=c.top_k,
        moe_router_score_function=c.score_function,
        moe_router_pre_softmax=c.pre_softmax,
        moe_router_topk_scaling_factor=c.topk_scaling_factor,
        moe_router_num_groups=c.num_groups,
        moe_router_group_topk=c.group_topk,
        moe_router_enable_expert_bias=c.enable_expert_bias,
        moe_router_bias_update_rate=c.bias_update_rate,
        moe_router_dtype="fp32" if c.router_dtype == "fp32" else None,
        moe_router_load_balancing_type=c.load_balancing_type,
        moe_aux_loss_coeff=c.aux_loss_coeff,
        moe_z_loss_coeff=c.z_loss_coeff,
        moe_input_jitter_eps=c.input_jitter_eps,
        moe_expert_capacity_factor=c.capacity_factor,
        moe_token_drop_policy=c.token_drop_policy,
        moe_pad_expert_input_to_capacity=c.pad_expert_input_to_capacity,
        activation=c.activation,
        gated_linear_unit=c.gated_linear_unit,
        swiglu=c.gated_linear_unit and c.activation == "silu",
        squared_relu=c.activation == "squared_relu",
        add_bias_linear=c.add_bias_linear,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_shared_expert_gate=c.shared_expert_gate,
        moe_dispatch_fwd_dtype=c.dispatch_dtype,
        moe_combine_bwd_dtype=c.combine_bwd_dtype,
    )
    if c.expert_precision in ("mxfp8", "fp8_blockwise"):
        args.update(
            fp8="e4m3", fp8_recipe="mxfp8" if c.expert_precision == "mxfp8" else "blockwise"
        )
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
    if (
        saved_args is None
        or saved_args.get("num_moe_experts", saved_args.get("num_experts")) is None
    ):
        return caller
    try:
        saved = config_from_args(saved_args)
    except ConfigError:
        if caller is None:
            raise
        return caller
    if caller is not None and caller != saved:
        diff = {
            f.name: (getattr(saved, f.name), getattr(caller, f.name))
            for f in dataclasses.fields(saved)
            if getattr(saved, f.name) != getattr(caller, f.name)
        }
        raise ConfigError(
            f"the given config differs from the checkpoint's saved args "
            f"(field: (saved, given)): {diff}"
        )
    return saved


def check_layer(config: jaxmoe.MoEConfig, index: int, w: MoELayerWeights) -> None:
    """Raise ExpertCountError / ShapeMismatchError (naming the key and both shapes) when layer
    `index`'s tensors do not fit `config`."""
    e, h, f = config.num_experts, w.hidden_size, config.ffn_hidden_size
    if w.num_experts != e:
        raise ExpertCountError(
            f"{LAYER_PREFIX}{index}.{MOE_KEYS['router_weight']}: the checkpoint "
            f"has {w.num_experts} experts (shape {tuple(w.router_weight.shape)}),"
            f" the config num_experts={e} (expected shape ({e}, {h}))"
        )
    fs = config.shared_expert_intermediate_size
    fs1 = None if fs is None else (2 * fs if config.gated_linear_unit else fs)
    bias = config.add_bias_linear
    expected = {
        "fc1_weight": (e, config.fc1_output_size, h),
        "fc2_weight": (e, h, f),
        "router_bias": (e,) if bias else None,
        "expert_bias": (e,) if config.enable_expert_bias else None,
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
                f"{'absent' if shape is None else shape}"
            )
