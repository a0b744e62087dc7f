"""Pallas Mosaic GPU kernels in the CPU interpreter, every kernel call race-checked.

The interpreter starts a fresh race-detector state for each kernel call, so checking the
detector once at the end of a test would see only the last kernel. `race_checked_interpreter`
keeps every call's state and fails if any of them found a race."""

import contextlib

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax.experimental.pallas import mosaic_gpu as plgpu


@contextlib.contextmanager
def race_checked_interpreter():
    """Interpret Mosaic GPU kernels with the race detector; on exit, assert that no kernel
    called inside raced. Yields the list of per-call detector states."""
    states = []
    original = gpu_callbacks.GPURaceDetectionState

    def recording(*args, **kwargs):
        state = original(*args, **kwargs)
        states.append(state)
        return state

    gpu_callbacks.GPURaceDetectionState = recording
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
            yield states
    finally:
        gpu_callbacks.GPURaceDetectionState = original
    raced = sum(bool(state.races_found) for state in states)
    assert not raced, f"race detected in {raced} of {len(states)} interpreted kernel calls"
