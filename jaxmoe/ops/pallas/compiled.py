"""How every kernel of this package is built: `plgpu.kernel` under `jax.jit`.

A jitted kernel keeps its compiled executable for the shapes it was called with, so an eager
call (outside any jit) compiles once: without it each eager call lowers the kernel again, which
costs seconds a call in the Mosaic GPU interpreter. Under an outer jit it is an ordinary nested
call that XLA inlines, so the kernel and its bits are the same either way."""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def compiled_kernel(body, **kernel_args):
    """`jax.jit(plgpu.kernel(body, **kernel_args))`."""
    return jax.jit(plgpu.kernel(body, **kernel_args))
