"""The in-memory form of a Megatron-Core MoE checkpoint and Megatron's key names for it.

Every on-disk layout that `bridge.megatron_read.load` understands is normalised into one
`MegatronCheckpoint`: for each global layer, full (unsharded) torch tensors in Megatron's [out, in]
layout with all E experts stacked on a leading axis (`MoELayerWeights`), dense MLP layers as
`DenseLayerWeights`, the pre-MLP norm as `NormWeights`. The key tables map each field to its
canonical per-layer key (relative to `decoder.layers.{i}.`); reader and writer both use them.
"""

from __future__ import annotations

import dataclasses

import torch

import jaxmoe
from bridge.errors import ConfigError

LAYER_PREFIX = "decoder.layers."
EXPERTS = "mlp.experts.experts."

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
DENSE_KEYS = {
    "fc1_weight": "mlp.linear_fc1.weight",
    "fc1_bias": "mlp.linear_fc1.bias",
    "fc2_weight": "mlp.linear_fc2.weight",
    "fc2_bias": "mlp.linear_fc2.bias",
}
# Norm key stem -> (weight key, bias key). Local spec: legacy `pre_mlp_layernorm`, torch_dist
# `mlp.linear_fc1.layer_norm_*`; Transformer Engine spec: `pre_mlp_layernorm` in both.
NORM_KEYS = {
    "pre_mlp_layernorm": ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"),
    "mlp.linear_fc1.layer_norm": (
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_bias",
    ),
}


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
        return _present_tensors(self, MOE_KEYS)


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
        return _present_tensors(self, DENSE_KEYS)


def _present_tensors(
    weights: MoELayerWeights | DenseLayerWeights, keys: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Canonical key -> tensor for `weights`' present fields named in `keys`, and its norm's."""
    out = {
        key: getattr(weights, field)
        for field, key in keys.items()
        if getattr(weights, field) is not None
    }
    norm = weights.norm
    if norm is None:
        return out
    weight_key, bias_key = NORM_KEYS[norm.key]
    out[weight_key] = norm.weight
    if norm.bias is not None:
        out[bias_key] = norm.bias
    return out


@dataclasses.dataclass
class MegatronCheckpoint:
    """What `bridge.megatron_read.load` returns.

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
