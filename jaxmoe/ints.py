"""Integer arithmetic on Python ints and integer arrays alike."""

from __future__ import annotations


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0."""
    return -(-a // b)


def round_up(a, multiple):
    """The smallest multiple of `multiple` that is >= a (a >= 0)."""
    return cdiv(a, multiple) * multiple
