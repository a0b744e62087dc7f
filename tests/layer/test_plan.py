"""`jaxmoe.make_plan` against the layout written out in NumPy: a stable argsort of the slots by
expert, each expert's block padded to the row alignment (or to the capacity), zero rows after;
each token's slots in ascending expert order (a stable argsort along k) for the combine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmoe
from jaxmoe import MoEConfig
from jaxmoe.plan import RANK_BLOCK, buffer_rows


def numpy_plan(indices, kept, config, num_rows):
    """Buffer rows of every slot and slot of every row, from NumPy's stable sort."""
    num_tokens, top_k = indices.shape
    num_experts, align = config.num_experts, config.expert_row_alignment
    slot_expert = np.where(kept, indices, num_experts).reshape(-1)
    order = np.argsort(slot_expert, kind="stable")
    counts = np.bincount(slot_expert, minlength=num_experts + 1)[:num_experts]
    if config.pad_expert_input_to_capacity:
        cap = config.capacity(num_tokens)
        padded = np.full(num_experts, -(-cap // align) * align)
    else:
        padded = -(-counts // align) * align
    block_start = np.concatenate([[0], np.cumsum(padded)])
    slot_row = np.full(num_tokens * top_k, num_rows)
    row_slot = np.full(num_rows, num_tokens * top_k)
    seen = np.zeros(num_experts, int)
    for slot in order:
        e = slot_expert[slot]
        if e == num_experts:
            continue
        slot_row[slot] = block_start[e] + seen[e]
        row_slot[slot_row[slot]] = slot
        seen[e] += 1
    return slot_row.reshape(num_tokens, top_k), row_slot, padded, counts


CASES = [
    # tokens, top_k, experts, alignment, drop share, pad to capacity
    (5, 2, 4, 1, 0.0, False),
    (3 * RANK_BLOCK // 4 + 1, 4, 8, 1, 0.0, False),  # slots not a multiple of the rank block
    (2 * RANK_BLOCK, 8, 128, 32, 0.0, False),  # empty experts, 32-row blocks
    (RANK_BLOCK + 7, 2, 8, 16, 0.3, False),  # dropped slots
    (96, 2, 8, 8, 0.2, True),  # pad to capacity
]


@pytest.mark.parametrize("tokens,top_k,experts,align,drop,pad", CASES)
def test_plan_is_the_stable_sort_layout(tokens, top_k, experts, align, drop, pad):
    rng = np.random.default_rng(tokens * experts + top_k)
    # Skewed choice of experts (some get many slots, some none), distinct per token.
    weights = rng.dirichlet(np.full(experts, 0.3))
    indices = np.stack(
        [rng.choice(experts, top_k, replace=False, p=weights) for _ in range(tokens)]
    ).astype(np.int32)
    kept = rng.random((tokens, top_k)) >= drop
    capacity_factor = 2.0 if pad else None
    config = MoEConfig(
        num_experts=experts,
        ffn_hidden_size=8,
        top_k=top_k,
        expert_row_alignment=align,
        capacity_factor=capacity_factor,
        pad_expert_input_to_capacity=pad,
    )
    if pad:  # what capacity dropping guarantees: no expert over its capacity
        cap = config.capacity(tokens)
        for e in range(experts):
            slots = np.flatnonzero((indices == e) & kept)
            kept.reshape(-1)[slots[cap:]] = False
    decision = jaxmoe.Routing(
        probs=jnp.ones((tokens, top_k), jnp.float32),
        indices=jnp.asarray(indices),
        kept=jnp.asarray(kept),
    )
    plan = jax.jit(jaxmoe.make_plan, static_argnums=1)(decision, config)
    num_rows = buffer_rows(tokens, config)
    slot_row, row_slot, padded, counts = numpy_plan(indices, kept, config, num_rows)
    np.testing.assert_array_equal(np.asarray(plan.slot_row), slot_row)
    np.testing.assert_array_equal(np.asarray(plan.row_slot), row_slot)
    np.testing.assert_array_equal(np.asarray(plan.group_sizes), padded)
    np.testing.assert_array_equal(np.asarray(plan.tokens_per_group), counts)
    starts = np.concatenate([[0], np.cumsum(padded)])
    row_expert = np.searchsorted(starts[1:], np.arange(num_rows), side="right")
    np.testing.assert_array_equal(np.asarray(plan.row_expert), row_expert)
    combine_key = np.where(kept, indices, experts)  # dropped slots tie, last, in slot order
    combine_slot = np.argsort(combine_key, axis=1, kind="stable")
    np.testing.assert_array_equal(np.asarray(plan.combine_slot), combine_slot)
    if drop == 0.0 and not pad:
        assert (np.asarray(plan.slot_row) < num_rows).all()
