"""PyTorch bridge for jaxmoe: zero-copy tensors (`bridge.dlpack`), Megatron-Core checkpoints
(`bridge.megatron`), a PyTorch twin of the jaxmoe layer (`bridge.torch_reference`) and the
stage-by-stage comparison tool (`bridge.compare`, `python -m bridge compare`).

jaxmoe never imports torch; everything torch lives here."""

from bridge import dlpack, errors, megatron, te_mxfp8, torch_reference
from bridge.dlpack import mxtensor_from_torch, mxtensor_to_torch, to_jax, to_torch

__all__ = [
    "to_jax",
    "to_torch",
    "mxtensor_to_torch",
    "mxtensor_from_torch",
    "dlpack",
    "errors",
    "megatron",
    "te_mxfp8",
    "torch_reference",
]
