"""Bitwise comparison helpers shared by the tests (integer views: NaN-aware, -0 != +0)."""

import numpy as np


def bits(a) -> np.ndarray:
    """The raw bits of `a` as unsigned integers of the same width."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bitwise(a, b):
    """Same shape, dtype and bits."""
    assert a.shape == b.shape and a.dtype == b.dtype
    mismatches = int(np.sum(bits(a) != bits(b)))
    assert mismatches == 0, f"{mismatches} of {a.size} elements differ"


def differs(a, b) -> bool:
    """Whether any element's bits differ."""
    return bool(np.any(bits(a) != bits(b)))
