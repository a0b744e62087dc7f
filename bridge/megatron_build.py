"""Building jaxmoe modules from checkpoint weights, and reading the weights back out of them.

`build_moe` turns one MoE layer of a `MegatronCheckpoint` into a ready `jaxmoe.MoE` (Megatron's
[out, in] layout permuted to jaxmoe's [in, out]); `weights_from_moe` is its inverse.
`JAXMOE_PARAMS` is the parameter correspondence both use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import torch
from flax import nnx

import jaxmoe
from bridge.dlpack import jax_dtype, to_jax, to_torch, torch_dtype
from bridge.errors import ConfigError, ShapeMismatchError
from bridge.megatron_config import check_layer, resolve_config
from bridge.megatron_weights import MegatronCheckpoint, MoELayerWeights, NormWeights

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


def _common_dtype(weights: MoELayerWeights) -> torch.dtype:
    dtypes = {
        t.dtype
        for f, t in dataclasses.asdict(weights).items()
        if isinstance(t, torch.Tensor) and f != "expert_bias"
    }
    if len(dtypes) != 1:
        raise ConfigError(
            f"the layer's tensors have several dtypes {sorted(map(str, dtypes))}; pass param_dtype"
        )
    return dtypes.pop()


def build_moe(
    ckpt: MegatronCheckpoint, layer: int, *, config=None, param_dtype=None, **moe_kwargs
) -> jaxmoe.MoE:
    """A `jaxmoe.MoE` holding MoE layer `layer` of `ckpt`.

    config: overrides `ckpt.config` (MoEConfig, dict of Megatron names, or config.json path).
    param_dtype: jaxmoe's param dtype (default: the checkpoint's; the expert bias stays fp32).
    moe_kwargs go to `jaxmoe.MoE` (dtype, gmm_impl, ...). Parameters are copied into jaxmoe's
    [in, out] layout (the untransposed ones are shared with the torch tensors over DLPack)."""
    weights = ckpt.layer(layer)
    config = resolve_config(None, config) if config is not None else ckpt.config
    if config is None:
        raise ConfigError(
            "the checkpoint has no saved args: pass config= (a MoEConfig, a dict of "
            "Megatron names, or a config.json path)"
        )
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
    abstract = nnx.eval_shape(
        lambda: jaxmoe.MoE(
            config, hidden_size, param_dtype=param_dtype, rngs=nnx.Rngs(0), **moe_kwargs
        )
    )
    graphdef, state = nnx.split(abstract)

    def fill(path, leaf):
        names = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
        if names in values:
            value = values[names]
            if value.shape != leaf.shape or value.dtype != leaf.dtype:
                raise ShapeMismatchError(
                    f"jaxmoe param {'.'.join(names)}: got {value.dtype}"
                    f"{value.shape}, the module needs {leaf.dtype}{leaf.shape}"
                )
            return value
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(leaf.shape, leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def weights_from_moe(
    moe: jaxmoe.MoE, norm: NormWeights | None = None, dtype: torch.dtype | None = None
) -> MoELayerWeights:
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
