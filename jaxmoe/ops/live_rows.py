"""Passes that skip a buffer's rows past a live count.

Under expert parallelism the receiver's expert buffer has static room for every source's whole
buffer (R x M rows) and about M real ones, packed at its start: rows [0, live_rows) hold the
(expert, source) blocks, rows [live_rows, R x M) nothing. A pass given `live_rows` (an int32
scalar, traced) computes only the live rows; its output rows at and past the count are
unspecified, and no pass reads them into a live row's result (a row's GEMM output, activation
and gradient depend on that row alone; the weight gradients read each group's rows only). The
Pallas kernels leave those rows unwritten; the XLA references, which run over every row anyway,
compute them as they come (no pass of their own), unless `DEAD_ROW_FILL` is set: a test sets
NaN there to check that no dead row reaches a result. `unspecified` makes a buffer for a pass
that writes only some of its rows (the ragged exchange's), by the same rule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DEAD_ROW_FILL = None  # a value for the XLA references' rows past the live count (tests: NaN)


def fill_dead_rows(x: jax.Array, live_rows: jax.Array | None, axis: int = 0) -> jax.Array:
    """x with its entries at and past `live_rows` along `axis` (its rows, or the columns of a
    transposed copy) set to `DEAD_ROW_FILL` (x itself when either is None)."""
    if live_rows is None or DEAD_ROW_FILL is None:
        return x
    live = jnp.arange(x.shape[axis], dtype=jnp.int32) < live_rows
    shape = [1] * x.ndim
    shape[axis] = -1
    return jnp.where(live.reshape(shape), x, _fill_value(x.dtype))


def unspecified(shape: tuple[int, ...], dtype) -> jax.Array:
    """A buffer of `shape` whose values nothing reads before a pass writes them: uninitialized on
    a GPU (`jax.lax.empty`: no pass over it), zeros on the CPU, `DEAD_ROW_FILL` when it is set."""
    if DEAD_ROW_FILL is not None:
        return jnp.full(shape, _fill_value(dtype), dtype)
    return jax.lax.empty(shape, dtype)


def _fill_value(dtype):
    """DEAD_ROW_FILL in dtype; an integer array (MXFP8's E8M0 scale bytes) takes its largest
    value for NaN (0xFF: E8M0's NaN)."""
    if jnp.issubdtype(dtype, jnp.floating) or not math.isnan(DEAD_ROW_FILL):
        return jnp.asarray(DEAD_ROW_FILL, dtype)
    return jnp.asarray(jnp.iinfo(dtype).max, dtype)


def check_live_rows(caller: str, live_rows) -> None:
    """ValueError unless live_rows is None or an integer scalar."""
    if live_rows is None:
        return
    if jnp.ndim(live_rows) != 0 or not jnp.issubdtype(jnp.result_type(live_rows), jnp.integer):
        raise ValueError(f"{caller}: live_rows must be an integer scalar, got {live_rows!r}")
