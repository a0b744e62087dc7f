"""The one place that asks what the default JAX device is: every implementation choice
("auto") and every kernel's grid size reads it here (or, inside `compiling_for`, the device
being compiled for)."""

from __future__ import annotations

import contextlib

import jax
from jax._src import config

INTERPRET_NUM_SMS = 4  # persistent-grid size off the GPU (the Mosaic GPU interpreter on CPU)
_targets = []  # the devices of the `compiling_for` contexts entered, innermost last


@contextlib.contextmanager
def compiling_for(device):
    """Inside, every choice is made for `device` rather than for the default device: for
    tracing a program that is compiled ahead of time for another device, e.g. a compile-only
    GPU device of `jax.experimental.topologies` on a machine without a GPU
    (tools/hopper_program.py). `device` needs `platform`, and for a GPU `compute_capability`
    and `core_count`, as JAX's devices have them."""
    _targets.append(device)
    try:
        yield device
    finally:
        _targets.pop()


def _device():
    return _targets[-1] if _targets else jax.devices()[0]


def on_gpu() -> bool:
    """Whether the default JAX device is a GPU."""
    return _device().platform == "gpu"


def on_hopper() -> bool:
    """Whether the default JAX device is an NVIDIA Hopper GPU (sm_90)."""
    device = _device()
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


def num_sms() -> int:
    """SM count of the GPU (a persistent kernel's grid size), or INTERPRET_NUM_SMS off the GPU.
    Never reads core_count from a CPU device."""
    device = _device()
    return device.core_count if device.platform == "gpu" else INTERPRET_NUM_SMS


def compiled_for_gpu(interpret) -> bool:
    """Whether a Pallas kernel built now with this `interpret` argument is compiled for the GPU
    (it can run inline PTX) rather than interpreted (an `interpret` argument, or
    `plgpu.force_gpu_interpret_mode` around the call)."""
    return not interpret and config.pallas_tpu_interpret_mode_context_manager.value is None
