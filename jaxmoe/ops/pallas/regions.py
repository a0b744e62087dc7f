"""Named regions of a Mosaic GPU kernel and their trace.

A function wrapped by `named` runs under a `jax.named_scope`; Mosaic's profiler, when a kernel is
built with a `KernelTrace`'s compiler parameters, records the SM clock when each warpgroup enters
and leaves every such region and writes the records as a Chrome trace (one JSON file per kernel
call) into the trace's directory. Without a trace the scopes cost nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax


def named(name: str):
    """Decorator: the function's work is region `name` of the kernel's trace."""

    def wrap(fn):
        @functools.wraps(fn)
        def scoped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return scoped

    return wrap


@dataclasses.dataclass(frozen=True)
class KernelTrace:
    """Record a kernel's named regions: at most `max_regions` per warpgroup and call (more are
    dropped), written to `directory` as `<ns>-trace.json` after every call."""

    directory: str
    max_regions: int

    def compiler_params(self) -> dict:
        """The `plgpu.CompilerParams` fields that turn Mosaic's profiler on."""
        if self.max_regions <= 0:
            raise ValueError(f"KernelTrace: max_regions={self.max_regions} must be positive")
        return dict(
            profile_space=self.max_regions,
            profile_dir=self.directory,
            profile_bounds_check=True,
        )
