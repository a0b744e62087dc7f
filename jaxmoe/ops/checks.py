"""Argument checks shared by the ops: clear errors for bad shapes, dtypes and group sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def known_on_host(a) -> bool:
    """Whether a's values can be read without tracing it or stalling an accelerator stream."""
    if isinstance(a, jax.core.Tracer):
        return False
    return not isinstance(a, jax.Array) or all(d.platform == "cpu" for d in a.devices())


def check_group_sizes(
    group_sizes, num_groups: int | None, num_rows: int, op: str, multiple: int = 1
) -> None:
    """group_sizes must be [num_groups] integers (any length when num_groups is None); when
    their values are known on the host, each >= 0 and a multiple of `multiple`, adding up to at
    most num_rows."""
    if group_sizes.ndim != 1 or (num_groups is not None and group_sizes.shape[0] != num_groups):
        raise ValueError(f"{op}: group_sizes must be [G={num_groups}], got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{op}: group_sizes must be integers, got {group_sizes.dtype}")
    if not known_on_host(group_sizes):
        return
    sizes = jax.device_get(group_sizes)
    if (sizes < 0).any() or sizes.sum() > num_rows:
        raise ValueError(
            f"{op}: group_sizes must be >= 0 and add up to at most M={num_rows}; "
            f"got {sizes.tolist()} (sum {int(sizes.sum())})"
        )
    if (sizes % multiple).any():
        raise ValueError(
            f"{op}: group sizes must be multiples of {multiple} (columnwise blocks "
            f"may not mix groups), got {sizes.tolist()}"
        )


def check_floating(op: str, **arrays) -> None:
    """TypeError unless every named array is floating point."""
    for name, a in arrays.items():
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{op}: {name} must be floating point, got {a.dtype}")
