"""The expert-parallel row exchange (`jaxmoe.exchange`) on 8 host devices: every rank's rows
reach the owner of their expert in the documented layout (expert-major, source-minor, blocks at
their padded sizes), come back to where they were, and the two directions are each other's
transpose, at 1, 2, 4 and 8 ranks, with empty experts and a rank that receives nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe import MoEConfig, make_plan, route
from jaxmoe.dispatch import dispatch
from jaxmoe.exchange import (
    PIECES_PER_PEER,
    Pieces,
    exchange_plan,
    ragged_all_to_all,
    return_rows,
    send_rows,
    send_tokens,
)
from jaxmoe.wire import quantize_tokens

from bitwise import assert_bitwise, differs
from jaxprs import equations

TOKENS, H = 24, 16  # tokens per rank


def rank_ids(mesh):
    """[R] int32 0..R-1, one per rank of the "ep" axis."""
    n = mesh.shape["ep"]
    return jax.device_put(jnp.arange(n, dtype=jnp.int32), NamedSharding(mesh, P("ep")))


def config(align=8):
    return MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=32, expert_row_alignment=align)


def local_logits(rank_seed: jax.Array, starve_last_rank: bool, num_ranks: int) -> jax.Array:
    logits = jax.random.normal(jax.random.fold_in(jax.random.key(0), rank_seed), (TOKENS, 8))
    if starve_last_rank:  # no token picks the experts of the last rank
        owned = jnp.arange(8) >= 8 - 8 // num_ranks
        logits = jnp.where(owned, -1e9, logits)
    return logits


def run(num_ranks: int, starve_last_rank=False, align=8, transport="dense", pieces=None):
    """Per rank: (local buffer rows, receiver buffer, rows back, group sizes, source sizes,
    local block sizes, the tokens sent deduplicated), stacked over ranks."""
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
    cfg = config(align)

    def body(rank):
        logits = local_logits(rank[0], starve_last_rank, num_ranks)
        plan = make_plan(route(logits, cfg), cfg)
        # Token t of rank r holds the values r * 1000 + t (+ column / 100): every row is unique.
        x = (rank[0] * 1000 + jnp.arange(TOKENS))[:, None] + jnp.arange(H) / 100.0
        rows = dispatch(x.astype(jnp.float32), plan, "xla")
        xplan = exchange_plan(plan, num_ranks, "ep", transport, pieces or PIECES_PER_PEER)
        received = send_rows(rows, xplan, "ep")
        back = return_rows(received, xplan, "ep")
        tokens = send_tokens(x.astype(jnp.float32), xplan, "ep")
        return tuple(
            a[None]
            for a in (
                rows,
                received,
                back,
                xplan.group_sizes,
                xplan.source_sizes,
                plan.group_sizes,
                tokens,
            )
        )

    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    return [np.asarray(a) for a in jax.jit(sharded)(rank_ids(mesh))]


def expected_receiver_buffer(rows, block_sizes, rank, num_ranks):
    """Expert-major, source-minor: for each local expert, each source's block as it stands in
    that source's buffer (padding rows included)."""
    local = 8 // num_ranks
    pieces = []
    for e in range(rank * local, (rank + 1) * local):
        for s in range(num_ranks):
            start = int(block_sizes[s][:e].sum())
            pieces.append(rows[s][start : start + int(block_sizes[s][e])])
    return np.concatenate(pieces) if pieces else np.zeros((0, H), np.float32)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("starve_last_rank", [False, True])
def test_rows_reach_their_owner_and_come_back(num_ranks, starve_last_rank):
    rows, received, back, group_sizes, source_sizes, block_sizes, _ = run(
        num_ranks, starve_last_rank
    )
    local = 8 // num_ranks
    for rank in range(num_ranks):
        want = expected_receiver_buffer(rows, block_sizes, rank, num_ranks)
        assert_bitwise(received[rank][: len(want)], want)
        assert not received[rank][len(want) :].any()  # the rest of the buffer is zero
        owned = block_sizes[:, rank * local : (rank + 1) * local]
        np.testing.assert_array_equal(group_sizes[rank], owned.sum(0))
        np.testing.assert_array_equal(source_sizes[rank], owned)
        assert_bitwise(back[rank], rows[rank])  # every row returns to its place
    if starve_last_rank and num_ranks > 1:
        assert not received[-1].any() and group_sizes[-1].sum() == 0


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("variant", ["plain", "starved", "capacity"])
def test_deduplicated_token_send_fills_the_same_rows(num_ranks, variant):
    """`send_tokens` (each token once per peer, copied into its experts' rows there) gives the
    receiver buffer of `send_rows(dispatch(x))` bitwise, also with a rank that gets nothing and
    with slots dropped by capacity; its all-to-all moves R * T token rows, not R * M. Control:
    a receiver buffer with two rows swapped differs."""
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
    cfg = config()
    if variant == "capacity":
        cfg = cfg.replace(capacity_factor=0.5)

    def body(rank):
        logits = local_logits(rank[0], variant == "starved", num_ranks)
        plan = make_plan(route(logits, cfg), cfg)
        xplan = exchange_plan(plan, num_ranks, "ep")
        x = (rank[0] * 1000 + jnp.arange(TOKENS))[:, None] + jnp.arange(H) / 100.0
        x = x.astype(jnp.float32)
        by_row = send_rows(dispatch(x, plan, "xla"), xplan, "ep")
        return send_tokens(x, xplan, "ep")[None], by_row[None], xplan.token_send[None]

    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    deduplicated, by_row, token_send = map(np.asarray, jax.jit(sharded)(rank_ids(mesh)))
    assert_bitwise(deduplicated, by_row)
    assert token_send.shape == (num_ranks, num_ranks * TOKENS)
    assert (token_send < TOKENS).sum() <= num_ranks * TOKENS * 2  # at most k copies a token
    swapped = deduplicated.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert differs(swapped, by_row)


@pytest.mark.parametrize("transport", ["dense", "ragged"])
@pytest.mark.parametrize("wire_dtype", ["mxfp8", "fp8_blockwise"])
def test_a_quantized_copy_crosses_in_one_collective(transport, wire_dtype):
    """A quantized token copy's data and scale rows travel packed in one buffer of bytes a row
    (`jaxmoe.wire.pack_rows`): one collective carries the copy (the rest carry int32 indices),
    and the receiver gets the bits of sending data and scales each on its own. Control: a copy
    with one scale changed arrives changed."""
    num_ranks, width = 4, 256
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
    cfg = config()

    def body(rank, bump):
        plan = make_plan(route(local_logits(rank[0], False, num_ranks), cfg), cfg)
        xplan = exchange_plan(plan, num_ranks, "ep", transport)
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), rank[0]), (TOKENS, width))
        copy = quantize_tokens(x.astype(jnp.bfloat16), wire_dtype, impl="xla")
        leaves = jax.tree.leaves(copy)
        changed = jax.tree.unflatten(
            jax.tree.structure(copy), [leaves[0], leaves[1] + bump.astype(leaves[1].dtype)]
        )
        one_by_one = [send_tokens(a, xplan, "ep") for a in leaves]
        packed = jax.tree.leaves(send_tokens(changed, xplan, "ep"))
        return tuple(a[None] for a in packed + one_by_one)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"))
    ranks = rank_ids(mesh)

    def payload_collectives(bump):
        jaxpr = jax.make_jaxpr(lambda r: sharded(r, bump))(ranks).jaxpr
        kinds = ("all_to_all", "ragged_all_to_all")
        moved = [e.invars[0].aval.dtype for e in equations(jaxpr) if e.primitive.name in kinds]
        return [d for d in moved if d != jnp.int32]

    # The packed send (uint8) and the two one-by-one reference sends (data, scales).
    assert len(payload_collectives(jnp.zeros((), jnp.int32))) == 3
    data, scale, want_data, want_scale = jax.jit(sharded)(ranks, jnp.zeros((), jnp.int32))
    assert_bitwise(np.asarray(data), np.asarray(want_data))
    assert_bitwise(np.asarray(scale), np.asarray(want_scale))
    bumped_scale = jax.jit(sharded)(ranks, jnp.ones((), jnp.int32))[1]
    assert differs(np.asarray(bumped_scale), np.asarray(want_scale))


@pytest.mark.parametrize("num_ranks", [1, 2, 8])
@pytest.mark.parametrize("starve_last_rank", [False, True])
def test_ragged_transport_moves_the_same_rows(num_ranks, starve_last_rank):
    """transport="ragged" (pieces of the (expert, source) blocks written in place; the tokens'
    lists in pieces): the receiver buffer, the rows back and the deduplicated token send of
    the dense transport, bitwise."""
    dense = run(num_ranks, starve_last_rank)
    ragged = run(num_ranks, starve_last_rank, transport="ragged")
    for a, b in zip(ragged, dense, strict=True):
        assert_bitwise(a, b)


def test_ragged_outputs_leave_the_rows_no_piece_writes_unfilled(monkeypatch):
    """transport="ragged" writes its outputs' rows only where pieces land (no pass fills the
    rest: `jaxmoe.ops.live_rows.unspecified`, uninitialized on a GPU): with `DEAD_ROW_FILL` =
    NaN, the receiver buffer is NaN exactly past its blocks and the rows back exactly past the
    local blocks, and every written row has the dense transport's bits."""
    from jaxmoe.ops import live_rows

    _, dense_received, dense_back, *_ = run(2)
    monkeypatch.setattr(live_rows, "DEAD_ROW_FILL", np.nan)
    _, received, back, group_sizes, _, block_sizes, _ = run(2, transport="ragged")
    unfilled = 0
    for rank in range(2):
        for got, want, written in (
            (received[rank], dense_received[rank], group_sizes[rank].sum()),
            (back[rank], dense_back[rank], block_sizes[rank].sum()),
        ):
            assert_bitwise(got[:written], want[:written])
            assert np.isnan(got[written:]).all()
            unfilled += len(got) - written
    assert unfilled > 0


@pytest.mark.parametrize("transport, collectives", [("dense", 1), ("ragged", 2)])
def test_the_plan_takes_one_all_to_all_and_ragged_one_more(transport, collectives):
    """`exchange_plan` sends each peer what it learns from this rank (block sizes, the rows'
    token places; for "ragged" the block offsets and token counts) in one all_to_all; "ragged"
    then sends back where the blocks land (it depends on the first). A collective's latency
    is what these small transfers cost."""
    num_ranks = 4
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])

    def body(rank):
        plan = make_plan(route(local_logits(rank[0], False, num_ranks), config()), config())
        return exchange_plan(plan, num_ranks, "ep", transport).recv_token[None]

    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    jaxpr = jax.make_jaxpr(sharded)(rank_ids(mesh)).jaxpr
    assert [e.primitive.name for e in equations(jaxpr)].count("all_to_all") == collectives


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_ragged_transport_moves_the_same_rows_in_any_number_of_pieces(pieces):
    """`exchange_plan(..., pieces_per_peer=)` (how finely the ragged transport cuts a peer's
    rows: one piece a block, a few, more pieces than rows) changes nothing but the pieces;
    nonsense is refused."""
    dense = run(2)
    for a, b in zip(run(2, transport="ragged", pieces=pieces), dense, strict=True):
        assert_bitwise(a, b)
    plan = make_plan(route(local_logits(0, False, 2), config()), config())
    with pytest.raises(ValueError, match="pieces_per_peer must be a positive int"):
        exchange_plan(plan, 2, "ep", "ragged", 0)


def test_ragged_all_to_all_stands_in_with_the_primitives_semantics():
    """The CPU stand-in for `jax.lax.ragged_all_to_all` against its documented semantics on 4
    ranks: rank r sends pieces of sizes (r + i) % 3 (some empty) of its rows to rank i // 2,
    each landing at an offset chosen by the sender, into an output that keeps its other rows.
    Control: swapping two landing offsets moves rows."""
    num_ranks, per_peer, rows, out_rows = 4, 2, 32, 20
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
    n = num_ranks * per_peer

    def sizes_of(r):
        return (np.arange(n) + r) % 3  # piece i of rank r

    def layout(r):
        """(input offsets, output offsets) of rank r's pieces: sent pieces apart in the operand,
        landing after the pieces that earlier ranks sent to the same receiver."""
        sizes = sizes_of(r)
        inputs = np.cumsum(np.concatenate([[0], sizes[:-1] + 1]))
        outputs = np.zeros(n, np.int32)
        for i in range(n):
            dest, j = divmod(i, per_peer)
            before = sum(
                sizes_of(s)[dest * per_peer : (dest + 1) * per_peer].sum() for s in range(r)
            )
            outputs[i] = 1 + before + sizes[dest * per_peer : i].sum()
        return inputs, outputs

    def expected(swap):
        out = [np.full((out_rows,), -1.0) for _ in range(num_ranks)]
        for r in range(num_ranks):
            inputs, outputs = layout(r)
            if swap and r == 1:
                outputs[[0, 1]] = outputs[[1, 0]]
            for i, size in enumerate(sizes_of(r)):
                dest = i // per_peer
                out[dest][outputs[i] : outputs[i] + size] = r * 100 + inputs[i] + np.arange(size)
        return np.stack(out)

    def body(rank):
        r = rank[0]
        tables = [layout(q) for q in range(num_ranks)]
        inputs = jnp.asarray(np.stack([t[0] for t in tables]), jnp.int32)[r]
        outputs = jnp.asarray(np.stack([t[1] for t in tables]), jnp.int32)[r]
        sizes = jnp.asarray(np.stack([sizes_of(q) for q in range(num_ranks)]), jnp.int32)
        # recv_sizes[i]: what rank i // per_peer sends me in its piece (me * per_peer + i % per_peer)
        src, j = jnp.arange(n) // per_peer, jnp.arange(n) % per_peer
        recv = sizes[src, r * per_peer + j]
        operand = (r * 100 + jnp.arange(rows)).astype(jnp.float32)[:, None]
        output = jnp.full((out_rows, 1), -1.0, jnp.float32)
        swapped = jnp.where(r == 1, outputs[jnp.asarray([1, 0] + list(range(2, n)))], outputs)
        moved = [
            ragged_all_to_all(operand, output, Pieces(inputs, sizes[r], o, recv), "ep", num_ranks)
            for o in (outputs, swapped)
        ]
        return tuple(m[None, :, 0] for m in moved)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    ours, swapped = map(np.asarray, jax.jit(sharded)(rank_ids(mesh)))
    np.testing.assert_array_equal(ours, expected(swap=False))
    assert differs(swapped, ours)
    np.testing.assert_array_equal(swapped, expected(swap=True))


def test_layout_follows_the_alignment():
    """With alignment 32 every (expert, source) block starts at a multiple of 32 rows."""
    rows, received, back, group_sizes, source_sizes, block_sizes, _ = run(4, align=32)
    assert np.all(block_sizes % 32 == 0) and np.all(group_sizes % 32 == 0)
    for rank in range(4):
        want = expected_receiver_buffer(rows, block_sizes, rank, 4)
        assert_bitwise(received[rank][: len(want)], want)
        assert_bitwise(back[rank], rows[rank])


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_directions_are_each_others_transpose(num_ranks):
    """<send(x), g> == <x, return(g)> exactly (small integers: every sum exact), and the VJPs
    are the other direction's values. Control: a receiver buffer with one row moved breaks the
    identity."""
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
    cfg = config()

    def body(rank):
        plan = make_plan(route(local_logits(rank[0], False, num_ranks), cfg), cfg)
        xplan = exchange_plan(plan, num_ranks, "ep")
        key = jax.random.fold_in(jax.random.key(1), rank[0])
        x = jax.random.randint(key, (plan.num_rows, H), -8, 8).astype(jnp.float32)
        g = jax.random.randint(jax.random.fold_in(key, 1), (xplan.num_rows, H), -8, 8)
        g = g.astype(jnp.float32)
        sent, send_vjp = jax.vjp(lambda r: send_rows(r, xplan, "ep"), x)
        back, return_vjp = jax.vjp(lambda r: return_rows(r, xplan, "ep"), g)
        lhs = jax.lax.psum(jnp.sum(sent * g), "ep")
        rhs = jax.lax.psum(jnp.sum(x * back), "ep")
        moved = jax.lax.psum(jnp.sum(jnp.roll(sent, 1, axis=0) * g), "ep")
        assert_vjp = [send_vjp(g)[0] - back, return_vjp(x)[0] - send_rows(x, xplan, "ep")]
        return lhs[None], rhs[None], moved[None], *(jnp.abs(d).max()[None] for d in assert_vjp)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    lhs, rhs, moved, d_send, d_return = map(np.asarray, jax.jit(sharded)(rank_ids(mesh)))
    assert lhs[0] == rhs[0] and moved[0] != lhs[0]
    assert d_send.max() == 0 and d_return.max() == 0


def test_experts_must_split_over_the_ranks():
    mesh = jax.make_mesh((3,), ("ep",), devices=jax.devices()[:3])
    cfg = config()

    def body(rank):
        plan = make_plan(route(local_logits(rank[0], False, 3), cfg), cfg)
        return exchange_plan(plan, 3, "ep").group_sizes[None]

    with pytest.raises(ValueError, match="8 experts do not split over 3 ranks"):
        jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(rank_ids(mesh))
