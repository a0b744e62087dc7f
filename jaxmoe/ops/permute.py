"""The layer's two row permutations with a choice of implementation: `dispatch_rows` (token
rows -> expert buffer rows, a gather) and `combine_rows` (each token's k buffer rows summed
back into its token row). Both are bitwise equal on every impl.

  impl "xla"     the references below (gathers from the array with one zero row appended).
  impl "pallas"  the Hopper kernels (ops/pallas/dispatch_hopper.py, combine_hopper.py), TMA
                 copies bound by HBM bandwidth: bf16 / fp16 / fp32 rows (the dispatch also
                 float8 rows) of a multiple of 128 bytes and 32 elements. Other problems raise
                 ValueError.
  impl "auto"    "pallas" on a Hopper GPU when the problem qualifies, else "xla".

Neither has a differentiation rule of its own: `jaxmoe.dispatch` pairs them as each other's
transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.ops import registry
from jaxmoe.ops.live_rows import check_live_rows, fill_dead_rows
from jaxmoe.ops.pallas.combine_hopper import combine_pallas, combine_problem
from jaxmoe.ops.pallas.dispatch_hopper import dispatch_pallas, dispatch_problem

F32 = jnp.float32

registry.register("dispatch_rows", "pallas", problem=dispatch_problem)
registry.register("combine_rows", "pallas", problem=combine_problem)


def _with_zero_row(a: jax.Array) -> jax.Array:
    return jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)], axis=0)


def dispatch_rows(
    x: jax.Array,
    row_token: jax.Array,
    *,
    per_token: int = 1,
    live_rows: jax.Array | None = None,
    impl: str = "auto",
) -> jax.Array:
    """rows [M, H]: rows[r] = x[row_token[r] // per_token] for x [T, H], zeros where that is T
    (a padding row). row_token: [M] integers in [0, T * per_token]; per_token > 1 when they
    are the rows' slots (`jaxmoe.plan.Plan.row_slot`, per_token = top_k), whose division the
    kernel makes as it reads them. live_rows: an integer scalar, or None; rows at and past it
    are not gathered and hold unspecified values (`jaxmoe.ops.live_rows`)."""
    if x.ndim != 2 or row_token.ndim != 1:
        raise ValueError(
            f"dispatch_rows: x must be [T, H] and row_token [M], got {x.shape} and "
            f"{row_token.shape}"
        )
    check_live_rows("dispatch_rows", live_rows)
    if registry.resolve("dispatch_rows", impl, x.shape, x.dtype, row_token.shape[0]) == "pallas":
        return dispatch_pallas(x, row_token, per_token=per_token, live_rows=live_rows)
    rows = jnp.take(_with_zero_row(x), row_token // per_token, axis=0, mode="clip")
    return fill_dead_rows(rows, live_rows)


def combine_rows(
    rows: jax.Array, token_rows: jax.Array, out_dtype=None, *, impl: str = "auto"
) -> jax.Array:
    """y [T, H] in out_dtype (default rows.dtype): each token's k rows added in fp32 in slot
    order, starting from slot 0, and rounded once:
        y[t] = round(f32 rows[token_rows[t, 0]] + ... + f32 rows[token_rows[t, k-1]]),
    where a slot with token_rows[t, j] == M (no row: dropped) adds +0.0. A token's value
    depends on its own rows alone, in a fixed order: batch-invariant and deterministic.
    rows: [M, H]; token_rows: [T, k] integers in [0, M]."""
    out_dtype = jnp.dtype(out_dtype or rows.dtype)
    if rows.ndim != 2 or token_rows.ndim != 2 or token_rows.shape[1] < 1:
        raise ValueError(
            f"combine_rows: rows must be [M, H] and token_rows [T, k >= 1], got "
            f"{rows.shape} and {token_rows.shape}"
        )
    if (
        registry.resolve("combine_rows", impl, rows.shape, rows.dtype, token_rows.shape, out_dtype)
        == "pallas"
    ):
        return combine_pallas(rows, token_rows, out_dtype)
    padded = _with_zero_row(rows)
    total = None
    for j in range(token_rows.shape[1]):
        term = jnp.take(padded, token_rows[:, j], axis=0, mode="clip").astype(F32)
        total = term if total is None else total + term
    return total.astype(out_dtype)
