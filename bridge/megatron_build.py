"""Building jaxmoe modules from checkpoint weights, and reading the weights back out of them.

`build_moe` turns one MoE layer of a `MegatronCheckpoint` into a ready `jaxmoe.MoE` (Megatron's
[out, in] layout permuted to jaxmoe's [in, out]), on one device or placed on a mesh for
`jaxmoe.expert_parallel_forward` (each device given only its experts); `weights_from_moe` is its
inverse (gathering a mesh-placed model to host memory). `JAXMOE_PARAMS` is the parameter
correspondence both use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from jax.sharding import Mesh

import jaxmoe
from bridge.dlpack import jax_dtype, to_jax, to_torch, torch_dtype
from bridge.errors import ConfigError, ExpertCountError, ShapeMismatchError
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
    ckpt: MegatronCheckpoint,
    layer: int,
    *,
    config=None,
    param_dtype=None,
    mesh: Mesh | None = None,
    expert_axis: str = "ep",
    **moe_kwargs,
) -> jaxmoe.MoE:
    """A `jaxmoe.MoE` holding MoE layer `layer` of `ckpt`.

    config: overrides `ckpt.config` (MoEConfig, dict of Megatron names, or config.json path).
    param_dtype: jaxmoe's param dtype (default: the checkpoint's; the expert bias stays fp32).
    mesh: place the module on this mesh as `jaxmoe.place_on_mesh(..., expert_axis=expert_axis)`
      lays it out for `jaxmoe.expert_parallel_forward`: the routed experts' parameters split over
      `expert_axis`, everything else replicated. Each device's array is made from the slice of
      the checkpoint tensor it holds (its E / ep experts), so no device ever holds the whole
      expert stack. An expert-parallel Megatron checkpoint is merged by `load` already; any
      mesh whose expert axis divides E fits it.
    moe_kwargs go to `jaxmoe.MoE` (dtype, gmm_impl, ...). Without a mesh the parameters are
    copied into jaxmoe's [in, out] layout on JAX's default device (the GPU on a GPU machine; on
    a CPU-only one the untransposed ones are shared with the torch tensors over DLPack)."""
    weights = ckpt.layer(layer)
    config = resolve_config(None, config) if config is not None else ckpt.config
    if config is None:
        raise ConfigError(
            "the checkpoint has no saved args: pass config= (a MoEConfig, a dict of "
            "Megatron names, or a config.json path)"
        )
    check_layer(config, layer, weights)
    if mesh is not None:
        _check_mesh(mesh, expert_axis, config.num_experts)
    param_dtype = jnp.dtype(jax_dtype(param_dtype or _common_dtype(weights)))
    values = {}
    for module, attr, field, perm in JAXMOE_PARAMS:
        tensor = getattr(weights, field)
        if tensor is None:
            continue
        dtype = torch.float32 if field == "expert_bias" else torch_dtype(param_dtype)
        values[(module, attr)] = (tensor.permute(perm) if perm else tensor, dtype)
    return _moe_with_params(
        config, weights.hidden_size, param_dtype, values, moe_kwargs, mesh, expert_axis
    )


def _check_mesh(mesh, expert_axis: str, num_experts: int) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"build_moe: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if expert_axis not in mesh.axis_names:
        raise ConfigError(
            f"build_moe: the mesh's axes {mesh.axis_names} have no expert axis {expert_axis!r} "
            "(pass expert_axis=)"
        )
    if num_experts % mesh.shape[expert_axis]:
        raise ExpertCountError(
            f"build_moe: the layer's {num_experts} experts do not split over "
            f"{expert_axis} = {mesh.shape[expert_axis]} ranks"
        )


def _moe_with_params(
    config, hidden_size, param_dtype, values, moe_kwargs, mesh=None, expert_axis="ep"
) -> jaxmoe.MoE:
    """Build the module abstractly (no random init) and fill it: parameters from `values` (torch
    tensors in jaxmoe's layout), RNG keys seeded with 0, running statistics zero. With a mesh,
    every array is made on its devices as `jaxmoe.place_on_mesh` lays the module out.
    values: {(module, attr): (torch tensor in jaxmoe's layout, the torch dtype to cast it to)}."""
    abstract = nnx.eval_shape(
        lambda: jaxmoe.MoE(
            config, hidden_size, param_dtype=param_dtype, rngs=nnx.Rngs(0), **moe_kwargs
        )
    )
    if mesh is not None:
        abstract = jaxmoe.place_on_mesh(abstract, mesh, expert_axis=expert_axis)
    graphdef, state = nnx.split(abstract)

    def fill(path, leaf):
        sharding = leaf.sharding if mesh is not None else None
        names = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))
        if names in values:
            tensor, dtype = values[names]
            if tuple(tensor.shape) != leaf.shape or jax_dtype(dtype) != leaf.dtype:
                raise ShapeMismatchError(
                    f"jaxmoe param {'.'.join(names)}: got {jax_dtype(dtype)}"
                    f"{tuple(tensor.shape)}, the module needs {leaf.dtype}{leaf.shape}"
                )
            if sharding is None:  # JAX's default device (shared with the tensor on a CPU)
                return jax.device_put(to_jax(tensor.to(dtype), copy=True), jax.devices()[0])
            # Each device's array from its own slice of the tensor (cast there): the devices of
            # expert rank e read experts [e E/ep, (e + 1) E/ep) alone.
            return jax.make_array_from_callback(
                leaf.shape, sharding, lambda index: to_jax(tensor[index].to(dtype), copy=True)
            )
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key = jax.random.key(0)
            return key if sharding is None else jax.device_put(key, sharding)
        return jnp.zeros(leaf.shape, leaf.dtype, device=sharding)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def weights_from_moe(
    moe: jaxmoe.MoE, norm: NormWeights | None = None, dtype: torch.dtype | None = None
) -> MoELayerWeights:
    """A jaxmoe.MoE's parameters as MoELayerWeights (Megatron layout torch tensors, copies).
    dtype: cast the non-expert-bias tensors (default: keep jaxmoe's param dtype). A model
    placed on a mesh (`build_moe(..., mesh=...)`, `jaxmoe.place_on_mesh`) is gathered to host
    memory: the same tensors as from the unplaced model."""
    fields: dict[str, Any] = {"norm": norm}
    for module, attr, field, perm in JAXMOE_PARAMS:
        owner = getattr(moe, module)
        param = None if owner is None else getattr(owner, attr)
        if param is None:
            continue
        tensor = _host_tensor(jnp.asarray(param[...]))
        tensor = tensor.permute(perm) if perm else tensor
        if dtype is not None and field != "expert_bias":
            tensor = tensor.to(dtype)
        fields[field] = tensor.contiguous().clone()
    return MoELayerWeights(**fields)


def _host_tensor(value: jax.Array) -> torch.Tensor:
    """A torch view of a single-device array (DLPack); an array split or replicated over
    several devices is gathered to a host numpy array first, its bytes passed to torch as
    same-width integers (numpy has no bfloat16 or float8 that torch imports) and viewed back."""
    if len(value.devices()) == 1:
        return to_torch(value)
    host = np.array(value)  # a writable host copy
    return torch.from_numpy(host.view(f"i{host.itemsize}")).view(torch_dtype(host.dtype))
