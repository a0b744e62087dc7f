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


RANK_BLOCK = 128  # slots per block when counting each slot's earlier slots of its expert


def _rank_in_expert(slot_expert: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """For slot_expert [S] (values 0..E, E = dropped): each slot's number of earlier slots with
    the same value [S], and the slots per expert [E]. Slots are counted in blocks of RANK_BLOCK:
    the blocks' per-expert counts summed over earlier blocks, plus the earlier slots of the
    slot's own block (one comparison of each block's slots with the E + 1 values and with
    themselves), all in int32."""
    num_slots = slot_expert.shape[0]
    num_blocks = -(-num_slots // RANK_BLOCK)
    keys = jnp.pad(
        slot_expert, (0, num_blocks * RANK_BLOCK - num_slots), constant_values=num_experts
    )
    keys = keys.reshape(num_blocks, RANK_BLOCK)
    # One count over each block's slots j answers both (one reduction, one kernel on the GPU):
    # row v <= E counts the block's slots of value v, row E + 1 + i the slots j < i that have
    # slot i's value.
    num_values = num_experts + 1
    values = jnp.broadcast_to(jnp.arange(num_values, dtype=keys.dtype), (num_blocks, num_values))
    wanted = jnp.concatenate([values, keys], axis=1)  # [blocks, E + 1 + RANK_BLOCK]
    row = jnp.arange(num_values + RANK_BLOCK)[:, None] - num_values  # < 0: a value's row
    counted = (row < 0) | (jnp.arange(RANK_BLOCK)[None, :] < row)  # [rows, j]
    counts = jnp.sum((keys[:, None, :] == wanted[:, :, None]) & counted, axis=2, dtype=jnp.int32)
    per_block, in_block = counts[:, :num_values], counts[:, num_values:]
    through_block = jnp.cumsum(per_block, axis=0, dtype=jnp.int32)
    before_block = through_block - per_block
    rank = jnp.take_along_axis(before_block, keys, axis=1) + in_block
    tokens_per_group = through_block[-1, :num_experts]  # the counts through the last block
    return rank.reshape(-1)[:num_slots], tokens_per_group


def _ascending_slots(keys: jax.Array) -> jax.Array:
    """[T, k] -> [T, k]: each token's slots in a stable ascending order of their keys (a stable
    argsort along k) by comparing every slot with the token's k - 1 others: slot j's place is
    the number of slots before it, and place p's slot the one slot whose place is p. Both sums
    run over k's static range as elementwise adds, so XLA fuses them into one elementwise pass
    (no sort kernel; a reduction here made one kernel a sum on the GPU)."""
    top_k = keys.shape[1]
    slot = jnp.arange(top_k, dtype=jnp.int32)
    place = jnp.zeros(keys.shape, jnp.int32)
    for i in range(top_k):  # slot i before slot j: a smaller key, or the same and i < j
        other = keys[:, i : i + 1]
        place += (other < keys) | ((other == keys) & (i < slot))
    ascending = jnp.zeros(keys.shape, jnp.int32)
    for j in range(top_k):
        ascending += jnp.where(place[:, j : j + 1] == slot, j, 0)
    return ascending


def make_plan(routing: Routing, config: MoEConfig, row_alignment: int | None = None) -> Plan:
    """Build the plan from a routing decision (see the module docstring for the layout), the
    experts' blocks padded to multiples of row_alignment (None: config.expert_row_alignment)."""
    num_tokens, top_k = routing.indices.shape
    num_experts = config.num_experts
    align = row_alignment or config.expert_row_alignment
    num_slots = num_tokens * top_k
    num_rows = buffer_rows(num_tokens, config, align)

    slot_expert = jnp.where(routing.kept, routing.indices, num_experts).reshape(-1)
    # Buffer order is a stable sort by expert; each slot's place in it is the number of earlier
    # slots with its expert, counted in integers (exact in any order) with no sort on the GPU.
    rank, tokens_per_group = _rank_in_expert(slot_expert, num_experts)

    if config.pad_expert_input_to_capacity:
        padded = jnp.full((num_experts,), _round_up(config.capacity(num_tokens), align))
    else:
        padded = _round_up(tokens_per_group, align)
    padded = padded.astype(jnp.int32)
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(padded)])

    # Slot -> row: its rank among its expert's slots, shifted to the expert's padded block.
    kept = slot_expert < num_experts
    slot_row = jnp.where(
        kept, block_start[jnp.minimum(slot_expert, num_experts - 1)] + rank, num_rows
    ).astype(jnp.int32)
    # Row -> slot: the inverse map (distinct rows; dropped slots and padding rows stay T * k).
    row_slot = (
        jnp.full((num_rows,), num_slots, jnp.int32)
        .at[slot_row]
        .set(jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    )
    slot_row = slot_row.reshape(num_tokens, top_k)

    # Each row's expert block: E block boundaries against every row at once (no sequential
    # binary-search loop).
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    row_expert = jnp.searchsorted(block_start[1:], rows, side="right", method="compare_all").astype(
        jnp.int32
    )

    combine_slot = _ascending_slots(jnp.where(routing.kept, routing.indices, num_experts))
    return Plan(
        row_slot=row_slot,
        row_expert=row_expert,
        slot_row=slot_row,
        combine_slot=combine_slot,
        group_sizes=padded,
        tokens_per_group=tokens_per_group.astype(jnp.int32),
    )
