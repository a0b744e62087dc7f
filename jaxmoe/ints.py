"""Integer arithmetic on Python ints and integer arrays alike."""

from __future__ import annotations

import jax.numpy as jnp


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0."""
    return -(-a // b)


def round_up(a, multiple):
    """The smallest multiple of `multiple` that is >= a (a >= 0)."""
    return cdiv(a, multiple) * multiple


def exclusive_cumsum(x):
    """[sum(x[:i]) for i in range(len(x))] of a 1-D integer array, as one comparison of every
    pair of positions reduced along rows: a short row reduction on the GPU, where XLA lowers
    jnp.cumsum to a reduce-window."""
    position = jnp.arange(x.shape[0])
    return jnp.sum(jnp.where(position[None, :] < position[:, None], x[None, :], 0), axis=1)
