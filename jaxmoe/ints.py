"""Integer arithmetic on Python ints and integer arrays alike."""

from __future__ import annotations


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0."""
    return -(-a // b)


def round_up(a, multiple):
    """The smallest multiple of `multiple` that is >= a (a >= 0)."""
    return cdiv(a, multiple) * multiple


def is_power_of_two(x: int) -> bool:
    """Whether the Python int x is a positive power of two."""
    return x > 0 and x & (x - 1) == 0


def cdiv_fusible(a, b: int):
    """`cdiv` of an integer array by a Python int b > 0, as a shift when b is a power of two:
    XLA counts an integer division or remainder as expensive and will not repeat one inside a
    reduction that reads its result many times (a broadcast), so the division costs a launch of
    its own; a shift fuses."""
    if is_power_of_two(b):
        return (a + (b - 1)) >> (b.bit_length() - 1)
    return cdiv(a, b)


def round_down_fusible(a, multiple: int):
    """a rounded down to a multiple of the Python int `multiple` > 0 (floor, as a - a % multiple),
    as a mask when `multiple` is a power of two (see `cdiv_fusible`)."""
    if is_power_of_two(multiple):
        return a & -multiple
    return a - a % multiple
