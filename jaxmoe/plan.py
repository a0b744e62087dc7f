"""The permutation plan: where every routed (token, expert) pair lives in the expert buffer.

Layout of the buffer (Megatron's `permute`, dropless or dropping):
  * expert-major; within an expert, ascending token index (a stable sort by expert);
  * each expert's block is padded with zero rows (probability 0) up to a multiple of
    `expert_row_alignment`, or to exactly the capacity with `pad_expert_input_to_capacity`;
  * rows past the last expert's block are zero rows too (the buffer has a static size).

Megatron fills pad-to-capacity slots with real tokens at probability 0; jaxmoe uses zero rows.
Both contribute exactly zero to outputs and gradients for finite inputs, and zero rows keep the
MXFP8 column scales of real rows independent of which tokens happen to fill the padding.

The plan is computed once per layer call (integer ops only) and reused by dispatch, experts,
combine and all of their backward passes. Nothing here is differentiated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.config import MoEConfig
from jaxmoe.routing import Routing

MIN_BUFFER_ROWS = 8


@struct.dataclass
class Plan:
    """Index arrays describing the expert buffer of M rows for T tokens with k slots each.

    row_slot:     [M] flat slot id (t * k + j) held by each row; T * k for padding rows.
    row_expert:   [M] expert of each row; E for rows past the last expert block.
    slot_row:     [T, k] buffer row of each slot (Megatron's top-k slot order); M if dropped.
    combine_slot: [T, k] the token's slots reordered by ascending expert id (dropped slots last).
    group_sizes:  [E] rows per expert in the buffer, padding rows included (what gmm consumes).
    tokens_per_group: [E] real (token, expert) rows per expert.
    """

    row_slot: jax.Array
    row_expert: jax.Array
    slot_row: jax.Array
    combine_slot: jax.Array
    group_sizes: jax.Array
    tokens_per_group: jax.Array

    @property
    def num_rows(self) -> int:
        return self.row_slot.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_row.shape[0]

    @property
    def top_k(self) -> int:
        return self.slot_row.shape[1]

    def row_token(self) -> jax.Array:
        """[M] token id of each row; T (one past the last token) for padding rows."""
        return self.row_slot // self.top_k


def _round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def buffer_rows(num_tokens: int, config: MoEConfig, row_alignment: int | None = None) -> int:
    """Static row count of the expert buffer: room for every routed pair plus the worst-case
    alignment padding (or exactly E * padded capacity), at least MIN_BUFFER_ROWS, a multiple of
    the alignment (row_alignment; None: config.expert_row_alignment)."""
    align = row_alignment or config.expert_row_alignment
    capacity = config.capacity(num_tokens)
    if config.pad_expert_input_to_capacity:
        rows = config.num_experts * _round_up(capacity, align)
    else:
        rows = num_tokens * config.top_k + config.num_experts * (align - 1)
    return _round_up(max(rows, MIN_BUFFER_ROWS), align)


def make_plan(routing: Routing, config: MoEConfig, row_alignment: int | None = None) -> Plan:
    """Build the plan from a routing decision (see the module docstring for the layout), the
    experts' blocks padded to multiples of row_alignment (None: config.expert_row_alignment)."""
    num_tokens, top_k = routing.indices.shape
    num_experts = config.num_experts
    align = row_alignment or config.expert_row_alignment
    num_slots = num_tokens * top_k
    num_rows = buffer_rows(num_tokens, config, align)

    slot_expert = jnp.where(routing.kept, routing.indices, num_experts).reshape(-1)
    order = jnp.argsort(slot_expert, stable=True)  # expert-major, tokens ascending
    sorted_expert = slot_expert[order]
    # Per-expert counts (integer adds: exact in any order) and where each expert's run starts.
    tokens_per_group = jnp.bincount(slot_expert, length=num_experts + 1)[:num_experts]
    sorted_start = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(tokens_per_group)[:-1].astype(jnp.int32)]
    )

    if config.pad_expert_input_to_capacity:
        padded = jnp.full((num_experts,), _round_up(config.capacity(num_tokens), align))
    else:
        padded = _round_up(tokens_per_group, align)
    padded = padded.astype(jnp.int32)
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(padded)])

    # Slot -> row: position inside its expert's sorted run, shifted to the padded block start.
    sorted_pos = jnp.arange(num_slots, dtype=jnp.int32)
    sorted_row = jnp.where(
        sorted_expert < num_experts,
        block_start[jnp.minimum(sorted_expert, num_experts - 1)]
        + sorted_pos
        - sorted_start[jnp.minimum(sorted_expert, num_experts - 1)],
        num_rows,
    )
    inverse_order = jnp.argsort(order)
    slot_row = sorted_row[inverse_order].reshape(num_tokens, top_k).astype(jnp.int32)

    # Row -> slot: find the row's expert block, then its rank inside the block.
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # E block boundaries against every row at once: no sequential binary-search loop.
    row_expert = jnp.searchsorted(block_start[1:], rows, side="right", method="compare_all").astype(
        jnp.int32
    )
    clipped = jnp.minimum(row_expert, num_experts - 1)
    rank = rows - block_start[clipped]
    is_real = (row_expert < num_experts) & (rank < tokens_per_group[clipped])
    row_slot = jnp.where(
        is_real, order[jnp.minimum(sorted_start[clipped] + rank, num_slots - 1)], num_slots
    ).astype(jnp.int32)

    combine_key = jnp.where(routing.kept, routing.indices, num_experts)
    combine_slot = jnp.argsort(combine_key, axis=1, stable=True).astype(jnp.int32)
    return Plan(
        row_slot=row_slot,
        row_expert=row_expert,
        slot_row=slot_row,
        combine_slot=combine_slot,
        group_sizes=padded,
        tokens_per_group=tokens_per_group.astype(jnp.int32),
    )
