"""Shared pytest set-up: tests marked `gpu` need a Hopper GPU and are deselected elsewhere;
the `interpret` fixture runs Pallas Mosaic GPU kernels on CPU."""

import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ops import on_hopper


@pytest.fixture
def interpret():
    """Run Mosaic GPU kernels in the CPU interpreter with the race detector (no-op on a GPU).
    The detector checks the last interpreted kernel of the test."""
    if on_hopper():
        yield
        return
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        yield
        races = interpret_pallas_call.get_races()
    assert not races.races_found, "race detected"


def pytest_collection_modifyitems(config, items):
    if on_hopper():
        return
    reason = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)
