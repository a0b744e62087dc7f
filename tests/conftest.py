"""Shared pytest set-up: tests marked `gpu` need a Hopper GPU and are deselected elsewhere."""

import pytest

from jaxmoe.ops import on_hopper


def pytest_collection_modifyitems(config, items):
    if on_hopper():
        return
    reason = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)
