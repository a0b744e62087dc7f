"""The expert-parallel row exchange: expert-buffer rows to the ranks that own their experts, and
the expert outputs back (docs/expert_parallel.md).

Runs per rank inside `jax.shard_map` over the expert axis (`axis_name`, `num_ranks` ranks; rank r
owns experts [r * E/R, (r + 1) * E/R)). The sender's buffer is its local `Plan`'s, expert-major,
so the rows for one rank form one contiguous range of it. The receiver lays its buffer out
expert-major and source-minor: expert e's rows are the block from source 0, then source 1, ...,
each block at its padded size (a multiple of the row alignment), tokens in their source order.

Two transports move the same rows into the same places (`TRANSPORTS`):
  "dense"   `all_to_all` with room for a whole local buffer per peer, gathers on both sides, so
            no row is ever lost whatever the routing;
  "ragged"  `ragged_all_to_all`: only the real rows, in pieces of the (expert, source) blocks
            (contiguous on both sides), written in place in the receiver's layout, no gathers
            of the rows (the deduplicated tokens still are). On XLA:CPU, which does not
            implement it, an emulation with the primitive's semantics (`ragged_all_to_all`)
            stands in, so the CPU tests check the pieces.
Every step is a row permutation (the rows it does not fill: zero with "dense", unspecified with
"ragged", and read by nobody), so the two directions are each other's transpose: `send_rows`'s
VJP is `return_rows` and the reverse. No scatter-add, and a row's values are moved, never
summed.

Token rows going to the experts (the dispatch, and the output gradient in the combine's
backward pass) travel deduplicated (`send_tokens`): each token once to each rank that owns any
of its experts (room for all T tokens per peer), and the receiver copies it into the rows of
those experts; a quantized copy's data and scale rows travel packed as one row of bytes
(`jaxmoe.wire.pack_rows`). The other direction cannot be deduplicated without summing a
token's rows on the expert side, so the expert outputs (and the dispatch's gradient) come
back row by row and are summed on the token's own rank, in the single-device order.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import struct

from jaxmoe.dispatch import gather_slots, token_rows
from jaxmoe.ops.device import on_gpu
from jaxmoe.ops.live_rows import unspecified
from jaxmoe.ops.permute import combine_rows, dispatch_rows
from jaxmoe.ordered import broadcast_in_order
from jaxmoe.plan import Plan
from jaxmoe.wire import QuantizedRows, dequantize_rows, move_rows, pack_rows, unpack_rows

TRANSPORTS = ("dense", "ragged")
# XLA's in-process `ragged_all_to_all` kernel copies each piece with one small thread block, so a
# transfer of few pieces runs on few SMs; of the piece counts tried this one was the fastest
# (docs/expert_parallel.md). Blocks are cut into pieces so that a peer gets about this many.
PIECES_PER_PEER = 2048


@struct.dataclass
class Pieces:
    """One direction of a ragged transfer ([N] each, N = R * pieces a peer; piece i goes to rank
    i // (N / R), and the receiver's piece i comes from that rank), as `ragged_all_to_all`
    takes them: where each sent piece starts in the operand, its rows, where it starts in its
    receiver's output, and the rows of each received piece."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


@struct.dataclass
class ExchangePlan:
    """Index arrays of one rank's exchange (N: the sentinel, one past the source's last row).

    send_row:    [R * C] local buffer row sent in slot c to peer p (index p * C + c); M: none.
    back_row:    [M] slot (p * C + c) from which local buffer row m comes back; R * C: none.
    recv_slot:   [R * C] received slot (s * C + c) held by each receiver row; R * C: padding.
    return_slot: [R * C] receiver row that goes back in received slot s * C + c; R * C: none.
    group_sizes: [E/R] rows per local expert in the receiver's buffer (all sources, padded).
    row_expert:  [R * C] local expert of each receiver row; E/R past the last block.
    row_block:   [R * C] (expert, source) block e * R + s of each receiver row; E past the last.
    source_sizes:[R, E/R] padded block sizes received from each source.
    token_send:  [R * T] local token sent in token slot c to peer p (index p * T + c); T: none.
    recv_token:  [R * C] received token slot (s * T + c) copied into each receiver row; R * T:
                 padding.
    transport:   "dense" or "ragged" (module docstring); with "ragged", the pieces of the rows'
                 way out (`row_pieces`), back (`back_pieces`) and of the token slots
                 (`token_pieces`); None with "dense".
    """

    send_row: jax.Array
    back_row: jax.Array
    recv_slot: jax.Array
    return_slot: jax.Array
    group_sizes: jax.Array
    row_expert: jax.Array
    row_block: jax.Array
    source_sizes: jax.Array
    token_send: jax.Array
    recv_token: jax.Array
    row_pieces: Pieces | None = None
    back_pieces: Pieces | None = None
    token_pieces: Pieces | None = None
    transport: str = struct.field(pytree_node=False, default="dense")

    @property
    def num_rows(self) -> int:
        """Rows of the receiver's buffer (static: room for every source's whole buffer)."""
        return self.recv_slot.shape[0]


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _split(sizes: jax.Array, pieces: int) -> tuple[jax.Array, jax.Array]:
    """Runs of sizes[b] rows cut into `pieces` pieces of ceil(size / pieces) rows (the last
    ones shorter or empty): ([B, pieces] first row of each piece within its run, its rows)."""
    step = (sizes + pieces - 1) // pieces
    first = jnp.arange(pieces, dtype=jnp.int32)[None, :] * step[:, None]
    return first, jnp.clip(sizes[:, None] - first, 0, step[:, None])


def _pieces(starts, sizes, dest_starts, recv_sizes, pieces) -> Pieces:
    """`Pieces` of runs (starts[b], sizes[b]) landing at dest_starts[b] on their receiver, and
    of the received runs of recv_sizes[b] rows, each run cut by `_split`."""
    first, size = _split(sizes, pieces)
    return Pieces(
        input_offsets=(starts[:, None] + first).reshape(-1).astype(jnp.int32),
        send_sizes=size.reshape(-1).astype(jnp.int32),
        output_offsets=(dest_starts[:, None] + first).reshape(-1).astype(jnp.int32),
        recv_sizes=_split(recv_sizes, pieces)[1].reshape(-1).astype(jnp.int32),
    )


def exchange_plan(
    plan: Plan,
    num_ranks: int,
    axis_name: str,
    transport: str = "dense",
    pieces_per_peer: int = PIECES_PER_PEER,
) -> ExchangePlan:
    """The exchange of `plan`'s buffer over the `axis_name` axis of `num_ranks` ranks (inside
    shard_map) by `transport` (`TRANSPORTS`). Sends the per-expert block sizes to their owners
    with the rows' places in the token lists (one all_to_all; "ragged": one more, of where the
    blocks land). pieces_per_peer: about how many pieces "ragged" cuts each peer's rows into
    (`PIECES_PER_PEER`; the same bits at any)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"exchange: transport must be one of {TRANSPORTS}, got {transport!r}")
    if not isinstance(pieces_per_peer, int) or pieces_per_peer < 1:
        raise ValueError(
            f"exchange: pieces_per_peer must be a positive int, got {pieces_per_peer!r}"
        )
    num_experts = plan.group_sizes.shape[0]
    if num_experts % num_ranks:
        raise ValueError(f"exchange: {num_experts} experts do not split over {num_ranks} ranks")
    local_experts = num_experts // num_ranks
    num_rows = plan.num_rows  # M, also the per-peer room C
    ranks, slots = jnp.arange(num_ranks, dtype=jnp.int32), jnp.arange(num_rows, dtype=jnp.int32)

    # Sender: peer p's rows are the buffer range of its experts' blocks.
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(plan.group_sizes)])
    peer_start = block_start[ranks * local_experts]
    peer_count = block_start[(ranks + 1) * local_experts] - peer_start
    send_row = jnp.where(
        slots[None, :] < peer_count[:, None], peer_start[:, None] + slots[None, :], num_rows
    ).reshape(-1)
    owner = jnp.minimum(plan.row_expert // local_experts, num_ranks - 1)
    back_row = jnp.where(
        plan.row_expert < num_experts,
        owner * num_rows + jnp.arange(num_rows, dtype=jnp.int32) - peer_start[owner],
        num_ranks * num_rows,
    )

    # Deduplicated token sends: the tokens with a kept slot on peer p, in token order.
    num_tokens, num_slots = plan.slot_row.shape[0], plan.slot_row.size
    slot_expert = jnp.where(
        plan.slot_row < num_rows, plan.row_expert[jnp.minimum(plan.slot_row, num_rows - 1)], -1
    )
    slot_peer = jnp.where(slot_expert >= 0, slot_expert // local_experts, -1)  # [T, k]
    to_peer = jnp.any(slot_peer[:, :, None] == ranks, axis=1)  # [T, R]
    token_pos = _exclusive_cumsum(to_peer.astype(jnp.int32), axis=0)  # place in p's list
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    token_send = (
        jnp.full((num_ranks, num_tokens), num_tokens, jnp.int32)
        .at[ranks[None, :], jnp.where(to_peer, token_pos, num_tokens)]
        .set(jnp.broadcast_to(tokens[:, None], to_peer.shape), mode="drop")
    )
    # Each local row's place in its owner's token list travels with the rows, as 1 + place
    # (0: a padding row, whose receiver row stays zero; empty slots arrive as 0 too).
    row_token = plan.row_slot // (num_slots // num_tokens)
    row_pos = jnp.where(
        row_token < num_tokens, token_pos[jnp.minimum(row_token, num_tokens - 1), owner] + 1, 0
    )

    # What each peer learns from this rank travels in one all_to_all, a row of int32 a peer:
    # the block sizes of its experts, the rows' places in its token list (in the rows' slots)
    # and, for "ragged", where its experts' blocks start here and how many tokens it gets.
    to_each_peer = [plan.group_sizes.reshape(num_ranks, local_experts)]
    if transport == "ragged":
        counts = jnp.sum(to_peer, axis=0, dtype=jnp.int32)
        my_blocks = block_start[:num_experts]  # sender: block e of its buffer
        to_each_peer += [my_blocks.reshape(num_ranks, local_experts), counts[:, None]]
    to_each_peer.append(_take(row_pos[:, None], send_row)[:, 0].reshape(num_ranks, num_rows))
    widths = [a.shape[1] for a in to_each_peer]
    from_each_source = jnp.split(
        jax.lax.all_to_all(jnp.concatenate(to_each_peer, axis=1), axis_name, 0, 0, tiled=True),
        list(itertools.accumulate(widths[:-1])),
        axis=1,
    )
    source_sizes = from_each_source[0]  # [source, local expert]
    pos_slots = from_each_source[-1].reshape(-1, 1)  # [R * C, 1]: slot s * C + c from source s

    # Receiver: blocks (expert e, source s) in order e-major, s-minor.
    source_offset = _exclusive_cumsum(source_sizes, axis=1)  # where (s, e) starts in s's slots
    blocks = source_sizes.T.reshape(-1)  # [(e, s)]
    dest_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks)])
    total = num_ranks * num_rows
    rows = jnp.arange(total, dtype=jnp.int32)
    block = jnp.searchsorted(dest_start[1:], rows, side="right", method="compare_all")
    block = block.astype(jnp.int32)
    real = block < blocks.shape[0]
    clipped = jnp.minimum(block, blocks.shape[0] - 1)
    expert, source = clipped // num_ranks, clipped % num_ranks
    recv_slot = jnp.where(
        real,
        source * num_rows + source_offset[source, expert] + rows - dest_start[clipped],
        total,
    )
    # Inverse: received slot (s, c) -> receiver row, for the slots that carried rows.
    slot_source, slot_c = rows // num_rows, rows % num_rows
    sent_by_source = jnp.sum(source_sizes, axis=1)
    slot_expert = jnp.sum(slot_c[:, None] >= source_offset[slot_source][:, 1:], axis=1)
    slot_expert = slot_expert.astype(jnp.int32)
    return_slot = jnp.where(
        slot_c < sent_by_source[slot_source],
        dest_start[slot_expert * num_ranks + slot_source]
        + slot_c
        - source_offset[slot_source, slot_expert],
        total,
    )
    received_pos = _take(pos_slots, recv_slot)[:, 0]
    recv_token = jnp.where(
        real & (received_pos > 0), source * num_tokens + received_pos - 1, num_ranks * num_tokens
    )

    ragged = {}
    if transport == "ragged":
        # Rows: one run a block, (expert e) on the sender, (expert, source) on the receiver,
        # cut into pieces; each side learns the other's block offsets (the sender's came with
        # the sizes; where they land here goes back in a second all_to_all).
        per_block = max(1, -(-pieces_per_peer * num_ranks // num_experts))
        their_blocks = from_each_source[1].reshape(-1)  # [source, local expert]
        landing = dest_start[:-1].reshape(local_experts, num_ranks).T  # [source, local expert]
        lands_at = jax.lax.all_to_all(landing, axis_name, 0, 0, tiled=True).reshape(-1)
        received = landing.reshape(-1)
        ragged["row_pieces"] = _pieces(
            my_blocks, plan.group_sizes, lands_at, source_sizes.reshape(-1), per_block
        )
        ragged["back_pieces"] = _pieces(
            received, source_sizes.reshape(-1), their_blocks, plan.group_sizes, per_block
        )
        # Tokens: each peer's list, from token slot p * T on, lands at slot me * T there.
        me = jax.lax.axis_index(axis_name)
        ragged["token_pieces"] = _pieces(
            ranks * num_tokens,
            counts,
            jnp.full((num_ranks,), me * num_tokens, jnp.int32),
            from_each_source[2].reshape(-1),
            pieces_per_peer,
        )

    return ExchangePlan(
        send_row=send_row.astype(jnp.int32),
        back_row=back_row.astype(jnp.int32),
        recv_slot=recv_slot.astype(jnp.int32),
        return_slot=return_slot.astype(jnp.int32),
        group_sizes=jnp.sum(source_sizes, axis=0).astype(jnp.int32),
        row_expert=jnp.where(real, expert, local_experts).astype(jnp.int32),
        row_block=jnp.where(real, clipped, blocks.shape[0]).astype(jnp.int32),
        source_sizes=source_sizes.astype(jnp.int32),
        token_send=token_send.reshape(-1),
        recv_token=recv_token.astype(jnp.int32),
        transport=transport,
        **ragged,
    )


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] with zero rows where index == len(x) (the dispatch's row gather)."""
    return dispatch_rows(x, index, impl="xla")


def _all_to_all(slots: jax.Array, num_ranks: int, axis_name: str) -> jax.Array:
    """[R * C, ...] slots, block p to rank p -> [R * C, ...], block s from rank s."""
    blocks = slots.reshape((num_ranks, -1) + slots.shape[1:])
    return jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True).reshape(slots.shape)


def ragged_all_to_all(
    operand: jax.Array, output: jax.Array, pieces: Pieces, axis_name: str, num_ranks: int
) -> jax.Array:
    """`jax.lax.ragged_all_to_all(operand, output, *pieces, axis_name=...)` on a GPU; elsewhere
    (XLA:CPU does not implement it) the same result from a dense all_to_all of rooms of
    len(operand) rows, packed in piece order, and a scatter of the received pieces."""
    if on_gpu():
        return jax.lax.ragged_all_to_all(
            operand,
            output,
            pieces.input_offsets,
            pieces.send_sizes,
            pieces.output_offsets,
            pieces.recv_sizes,
            axis_name=axis_name,
        )
    per_peer, room = pieces.send_sizes.shape[0] // num_ranks, operand.shape[0]
    slots = jnp.arange(room, dtype=jnp.int32)

    def unpack(offsets, sizes, missing):
        """[R * room] row of each slot of the peers' rooms (pieces packed in order): offsets[i]
        plus its place in piece i; `missing` past the pieces."""
        offsets, sizes = offsets.reshape(num_ranks, per_peer), sizes.reshape(num_ranks, per_peer)
        starts = _exclusive_cumsum(sizes, axis=1)
        piece = jax.vmap(lambda s: jnp.searchsorted(s, slots, side="right") - 1)(starts)
        row = jnp.take_along_axis(offsets - starts, piece, axis=1) + slots[None, :]
        return jnp.where(slots[None, :] < sizes.sum(1)[:, None], row, missing).reshape(-1)

    sent = _take(operand, unpack(pieces.input_offsets, pieces.send_sizes, room))
    received = _all_to_all(sent, num_ranks, axis_name)
    landing = _all_to_all(pieces.output_offsets, num_ranks, axis_name)
    dest = unpack(landing, pieces.recv_sizes, output.shape[0])
    return output.at[dest].set(received, mode="drop")


def _ragged(operand, rows, pieces, num_ranks, axis_name):
    """operand's pieces moved into outputs of `rows` rows on their receivers, whose rows that no
    piece writes are unspecified (`jaxmoe.ops.live_rows.unspecified`: no pass fills them). No
    one reads them: the receiver's rows past its blocks are dead rows, a returned buffer's rows
    past its blocks are never combined, token slots past a peer's count are never copied."""
    output = unspecified((rows,) + operand.shape[1:], operand.dtype)
    return ragged_all_to_all(operand, output, pieces, axis_name, num_ranks)


def _send(rows, xplan, axis_name):
    num_ranks = xplan.source_sizes.shape[0]
    if xplan.transport == "ragged":
        return _ragged(rows, xplan.num_rows, xplan.row_pieces, num_ranks, axis_name)
    received = _all_to_all(_take(rows, xplan.send_row), num_ranks, axis_name)
    return _take(received, xplan.recv_slot)


def _return(rows, xplan, axis_name):
    if xplan.transport == "ragged":
        num_ranks = xplan.source_sizes.shape[0]
        return _ragged(rows, xplan.back_row.shape[0], xplan.back_pieces, num_ranks, axis_name)
    return _take(_returned_rooms(rows, xplan, axis_name), xplan.back_row)


def _returned_rooms(rows, xplan, axis_name):
    """The dense transport's return: the receiver's rows back in the rooms [R * C, ...] of their
    sources (room p from rank p), local buffer row m in slot `back_row[m]`."""
    num_ranks = xplan.source_sizes.shape[0]
    return _all_to_all(_take(rows, xplan.return_slot), num_ranks, axis_name)


def _token_slots(x: jax.Array, xplan: ExchangePlan, axis_name: str) -> jax.Array:
    """Token rows x [T, ...] -> the token slots received from every peer [R * T, ...]: each
    token sent once to each peer that owns one of its experts."""
    num_ranks = xplan.source_sizes.shape[0]
    sent = _take(x, xplan.token_send)
    if xplan.transport == "ragged":
        return _ragged(sent, sent.shape[0], xplan.token_pieces, num_ranks, axis_name)
    return _all_to_all(sent, num_ranks, axis_name)


def send_tokens(
    x: jax.Array | QuantizedRows, xplan: ExchangePlan, axis_name: str, impl: str = "xla"
) -> jax.Array | QuantizedRows:
    """Token rows x [T, ...] -> the receiver's buffer rows [R * C, ...]: each token sent once to
    each peer that owns one of its experts, then copied into those experts' rows. A quantized
    copy (`jaxmoe.wire`) travels as one buffer of bytes a row (`pack_rows`: data and scales,
    one collective). The same values as `send_rows(dispatch(x, plan))` on the live rows (the
    blocks, `live_rows`); the rows past them are not copied and hold unspecified values
    (`jaxmoe.ops.live_rows`). impl: the row copy's (`jaxmoe.ops.dispatch_rows`). Not
    differentiable (the routes give it a VJP)."""
    if isinstance(x, QuantizedRows):
        return _copy_rows(_quantized_token_slots(x, xplan, axis_name), xplan, impl)
    return _copy_live_rows(_token_slots(x, xplan, axis_name), xplan, impl)


def send_tokens_with_values(
    copy: QuantizedRows, xplan: ExchangePlan, axis_name: str, dtype, impl: str = "xla"
) -> tuple[QuantizedRows, jax.Array]:
    """(`send_tokens(copy)`, its values in dtype) from one exchange of the copy: the values are
    dequantized in the token slots (R x T rows, each token once a peer) and copied into the
    live rows, where dequantizing the copy's rows would run over all R x C of them (the same
    bits: dequantizing is elementwise). Rows past the live ones: unspecified."""
    slots = _quantized_token_slots(copy, xplan, axis_name)
    values = _copy_live_rows(dequantize_rows(slots, dtype), xplan, impl)
    return _copy_rows(slots, xplan, impl), values


def _quantized_token_slots(copy: QuantizedRows, xplan, axis_name) -> QuantizedRows:
    """The token slots of a quantized copy, its data and scales packed on the wire."""
    return unpack_rows(_token_slots(pack_rows(copy), xplan, axis_name), copy)


def _copy_rows(slots: QuantizedRows, xplan, impl) -> QuantizedRows:
    """A quantized copy's token slots into the receiver's live rows, data and scales alike."""
    return move_rows(slots, lambda a: _copy_live_rows(a, xplan, impl))


def _copy_live_rows(slots: jax.Array, xplan, impl) -> jax.Array:
    """Token slots into the receiver's live rows (`jaxmoe.ops.live_rows`; the dispatch kernel
    where it takes the rows, e.g. a copy's fp8 data, XLA's gather else)."""
    return dispatch_rows(slots, xplan.recv_token, live_rows=live_rows(xplan), impl=impl)


def live_rows(xplan: ExchangePlan) -> jax.Array:
    """The receiver's live rows: its (expert, source) blocks, packed from row 0 (int32)."""
    return jnp.sum(xplan.group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def send_rows(rows: jax.Array, xplan: ExchangePlan, axis_name: str) -> jax.Array:
    """The local buffer's rows [M, ...] -> the receiver's buffer [R * M, ...] (its rows past the
    blocks zero with "dense", unspecified with "ragged"). Values move unchanged; the VJP is
    `return_rows`."""
    return _send(rows, xplan, axis_name)


def _send_fwd(rows, xplan, axis_name):
    return _send(rows, xplan, axis_name), xplan


def _send_bwd(axis_name, xplan, grad):
    return _return(grad, xplan, axis_name), None


send_rows.defvjp(_send_fwd, _send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def return_rows(rows: jax.Array, xplan: ExchangePlan, axis_name: str) -> jax.Array:
    """The receiver's buffer rows [R * M, ...] -> back to their source, in its local buffer
    layout [M, ...] (rows that were not sent: zero with "dense", unspecified with "ragged"). The
    VJP is `send_rows`."""
    return _return(rows, xplan, axis_name)


def _return_fwd(rows, xplan, axis_name):
    return _return(rows, xplan, axis_name), xplan


def _return_bwd(axis_name, xplan, grad):
    return _send(grad, xplan, axis_name), None


return_rows.defvjp(_return_fwd, _return_bwd)


@struct.dataclass
class ExchangedRoute:
    """A route (see `jaxmoe.dispatch.LocalRoute`) across expert-parallel ranks: the local plan's
    buffer rows go to their experts' owners and come back before the combine. The GEMMs see the
    receiver's buffer as one group per (local expert, source) block, the R blocks of an expert
    reading its one matrix (`groups_per_weight`; biases are spread per block by `per_group`),
    so that each block's weight-gradient partial is its own and the partials are summed over
    the sources in the fixed order of `sum_in_order` (docs/expert_parallel.md, "Backward and
    the gradient reduction")."""

    plan: Plan
    exchange: ExchangePlan
    axis_name: str = struct.field(pytree_node=False)
    impl: str = struct.field(pytree_node=False, default="auto")

    @classmethod
    def build(
        cls, plan: Plan, impl: str, *, num_ranks: int, axis_name: str, transport: str = "dense"
    ) -> ExchangedRoute:
        return cls(plan, exchange_plan(plan, num_ranks, axis_name, transport), axis_name, impl)

    @property
    def group_sizes(self) -> jax.Array:
        return self.exchange.source_sizes.T.reshape(-1)

    @property
    def groups_per_weight(self) -> int:
        """One group per (expert, source): R groups per local expert."""
        return self.exchange.source_sizes.shape[0]

    @property
    def row_group(self) -> jax.Array:
        return self.exchange.row_block

    @property
    def live_rows(self) -> jax.Array:
        """The receiver buffer's rows that hold blocks (about M of its R x M), from row 0."""
        return live_rows(self.exchange)

    def per_group(self, weights: jax.Array) -> jax.Array:
        """[E/R, ...] -> [E/R * R, ...]: each local expert's weights once per source block; the
        gradient sums the blocks' partials with `sum_in_order` in fp32."""
        sources = self.exchange.source_sizes.shape[0]
        spread = broadcast_in_order(
            weights[:, None], (weights.shape[0], sources) + weights.shape[1:]
        )
        return spread.reshape((-1,) + weights.shape[1:])

    def to_experts(self, x: jax.Array | QuantizedRows) -> jax.Array | QuantizedRows:
        """Token rows (or a quantized copy, `jaxmoe.wire`: fp8 data and scale rows, packed on
        the wire) -> the receiver's buffer, deduplicated on the wire (`send_tokens`); VJP:
        `to_tokens`."""
        if isinstance(x, QuantizedRows):
            return send_tokens(x, self.exchange, self.axis_name, self.impl)
        return _route_to_experts(x, self)

    def to_experts_with_values(self, copy: QuantizedRows, dtype) -> tuple[QuantizedRows, jax.Array]:
        """A quantized copy of token rows -> (`to_experts(copy)`, its values in dtype, past the
        live rows unspecified), one exchange (`send_tokens_with_values`); no gradient."""
        return send_tokens_with_values(copy, self.exchange, self.axis_name, dtype, self.impl)

    def to_tokens(self, rows: jax.Array) -> jax.Array:
        """The receiver's buffer rows back to their sources, each token's rows combined there in
        the single-device order; VJP: the deduplicated `to_experts`."""
        return _route_to_tokens(rows, self)

    def slot_values(self, values: jax.Array) -> jax.Array:
        per_row = gather_slots(values, self.plan)[:, None]
        return send_rows(per_row, self.exchange, self.axis_name)[:, 0]


def _to_tokens(rows, route: ExchangedRoute):
    """The receiver's rows back to their sources and each token's rows combined there, as
    `jaxmoe.dispatch.combine` of the returned local buffer. With "dense" the combine reads the
    returned rooms through the rows' slots (`back_row`), where gathering them into the local
    buffer first would be a pass over all of its rows: the same values, summed the same way."""
    xplan, rows_of_tokens = route.exchange, token_rows(route.plan)
    if xplan.transport == "ragged":
        return combine_rows(_return(rows, xplan, route.axis_name), rows_of_tokens, impl=route.impl)
    rooms = _returned_rooms(rows, xplan, route.axis_name)
    num_rows = route.plan.num_rows  # "no row" (a dropped slot)
    slots = jnp.where(
        rows_of_tokens < num_rows,
        xplan.back_row[jnp.minimum(rows_of_tokens, num_rows - 1)],
        rooms.shape[0],
    )
    return combine_rows(rooms, slots, impl=route.impl)


@jax.custom_vjp
def _route_to_experts(x, route):
    return send_tokens(x, route.exchange, route.axis_name, route.impl)


def _route_to_experts_fwd(x, route):
    return _route_to_experts(x, route), (route, jnp.zeros((0,), x.dtype))


def _route_to_experts_bwd(residuals, grad):
    route, dtype_carrier = residuals
    return _to_tokens(grad, route).astype(dtype_carrier.dtype), None


_route_to_experts.defvjp(_route_to_experts_fwd, _route_to_experts_bwd)


@jax.custom_vjp
def _route_to_tokens(rows, route):
    return _to_tokens(rows, route)


def _route_to_tokens_fwd(rows, route):
    return _to_tokens(rows, route), route


def _route_to_tokens_bwd(route, grad):
    return send_tokens(grad, route.exchange, route.axis_name, route.impl), None


_route_to_tokens.defvjp(_route_to_tokens_fwd, _route_to_tokens_bwd)
