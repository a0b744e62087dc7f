"""Megatron-Core MoE checkpoints <-> jaxmoe: the public entry point.

    ckpt = bridge.megatron.load("ckpt_dir")              # torch_dist dir, legacy file or tree
    moe = bridge.megatron.build_moe(ckpt, layer=0)       # a ready jaxmoe.MoE
    bridge.megatron.save([moe0, moe1], "out", format="torch_dist")

Expert parallel: `build_moe(ckpt, 0, mesh=jax.make_mesh((2, 4), ("data", "ep")))` makes each
device's arrays from its own experts' slice (the routed experts split over "ep", the rest
replicated: `jaxmoe.place_on_mesh`'s layout), ready for `jaxmoe.expert_parallel_forward`; an
EP-sharded Megatron checkpoint is merged by `load` first. `save` (and `weights_from_moe`)
gather a model placed so to host memory and write the checkpoint the unplaced model writes.

This module only re-exports; the work is split by job:
  * `bridge.megatron_weights`: the in-memory checkpoint (`MegatronCheckpoint`, `MoELayerWeights`,
    `DenseLayerWeights`, `NormWeights`) and Megatron's key names (`MOE_KEYS`, ...);
  * `bridge.megatron_config`: Megatron config names <-> `jaxmoe.MoEConfig` (`config_from_args`,
    `megatron_args`, `resolve_config`, `check_layer`);
  * `bridge.megatron_read`: `load`, reading and merging torch_dist and legacy checkpoints;
  * `bridge.megatron_build`: `build_moe` (weights -> jaxmoe.MoE) and `weights_from_moe`;
  * `bridge.megatron_write`: `save`, writing torch_dist and legacy checkpoints;
  * `bridge.te_mxfp8`: `refit_mxfp8`, Transformer Engine MXFP8 storage -> jaxmoe MXTensors, and
    `expert_fprop_copy`, a layer's refitted experts stacked for `jaxmoe.mxfp8_inference`;
  * `bridge.torch_dist_format`: the torch_dist (DCP) file I/O, re-exported for inspecting what
    `save` wrote (`megatron.torch_dist_format.read_index(path)`).
"""

from bridge import torch_dist_format
from bridge.megatron_build import JAXMOE_PARAMS, build_moe, weights_from_moe
from bridge.megatron_config import check_layer, config_from_args, megatron_args, resolve_config
from bridge.megatron_read import load, stack_local_experts
from bridge.megatron_weights import (
    MOE_KEYS,
    DenseLayerWeights,
    MegatronCheckpoint,
    MoELayerWeights,
    NormWeights,
)
from bridge.megatron_write import save
from bridge.te_mxfp8 import MXFP8Weight, expert_fprop_copy, refit_mxfp8

__all__ = [
    "load",
    "build_moe",
    "save",
    "weights_from_moe",
    "megatron_args",
    "config_from_args",
    "resolve_config",
    "check_layer",
    "stack_local_experts",
    "JAXMOE_PARAMS",
    "MOE_KEYS",
    "MegatronCheckpoint",
    "MoELayerWeights",
    "DenseLayerWeights",
    "NormWeights",
    "refit_mxfp8",
    "expert_fprop_copy",
    "MXFP8Weight",
    "torch_dist_format",
]
