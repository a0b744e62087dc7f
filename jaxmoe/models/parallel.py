"""The language model's training step over a ("data", "ep") device mesh, with the bits of every
split of the same ranks (docs/expert_parallel.md, "The language model over a mesh").

A batch's sequences are split over all R = data x ep ranks as `jaxmoe.expert_parallel_forward`
splits tokens (rank (d, e) holds the rows of chunk d * ep + e), the routed experts over "ep",
everything else replicated. Inside one `jax.shard_map`, each rank runs the whole model on its
own rows, every MoE layer exchanging rows with its expert-parallel peers
(`jaxmoe.exchange.ExchangedRoute`); each rank's loss partials (its tokens' nll sum, its
auxiliary losses) leave the map and are summed over the global rank index with `sum_in_order`,
and every parameter's gradient is the ranks' partials summed in one fixed order
(`jaxmoe.expert_parallel.OrderedCopies`). A rank's work depends on its rows alone and every sum
across ranks has a tree fixed by R, so the loss, the gradients and the updated parameters are
the same bits at meshes (R, 1), ..., (1, R).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.exchange import TRANSPORTS, ExchangedRoute
from jaxmoe.expert_parallel import OrderedCopies, expert_parallel_row_alignment, state_spec
from jaxmoe.optim import lm_loss
from jaxmoe.ordered import sum_in_order

F32 = jnp.float32
# The arrays of a `jaxmoe.data.PackedBatches` batch, each [B, S], split over the ranks by rows.
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def make_mesh_loss_and_grads(
    graphdef: nnx.GraphDef,
    mesh: Mesh,
    micro_batches: int,
    *,
    expert_axis: str = "ep",
    transport: str = "dense",
) -> Callable:
    """`loss_and_grads(params, rest, micro_batch, expert_weights) -> ((loss, metrics), grads)`
    of `jaxmoe.train.make_loss_and_grads` over `mesh` (pass it to `jaxmoe.train
    .make_train_step`; jit the step with the state placed by `mesh_shardings`):

    - the micro-batch's rows split over all mesh axes in their order (R ranks; rank g =
      its linear index holds rows [g B/R, (g + 1) B/R)), the routed experts over
      `expert_axis`, everything else replicated;
    - loss = the ranks' nll sums summed with `sum_in_order` over g, / step_tokens, + the aux
      total of the ranks' mean auxiliary losses / micro_batches (each MoE layer's load-balancing
      and z losses are those of the rank's own tokens, as under data parallelism: the step's
      aux loss is their mean over the ranks, `sum_in_order` over g then / R);
    - metrics as the single-device step's: nll, load_balancing_loss and z_loss [L_moe] (the
      ranks' means / micro_batches), tokens_per_expert [L_moe, E] and tokens (all ranks' counts:
      the expert bias update sees the global counts); all replicated;
    - grads: every parameter's ranks' partials summed in fp32 over g in `sum_in_order`'s tree,
      rounded once to its dtype (`OrderedCopies`), laid out as `mesh_shardings` lays out the
      parameters.

    The loss and metrics are the single-device step's within rounding (other summation orders),
    except the auxiliary losses, which are per rank (means of the ranks' values). Multi-process
    (`jax.distributed`): as `jaxmoe.expert_parallel_forward`; pass the micro-batch as global
    arrays split over the mesh by rows (`global_batch`). transport: `jaxmoe.exchange.TRANSPORTS`
    (the same bits). Raises TypeError/ValueError for a mesh without `expert_axis` or an unknown
    transport, and, when traced, for a micro-batch whose rows do not split over the R ranks."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"make_mesh_loss_and_grads: mesh must be a Mesh, got {type(mesh).__name__}")
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"make_mesh_loss_and_grads: mesh {mesh.axis_names} has no {expert_axis!r}")
    if transport not in TRANSPORTS:
        raise ValueError(
            f"make_mesh_loss_and_grads: transport must be one of {TRANSPORTS}, got {transport!r}"
        )
    ranks = mesh.size
    rows = P(mesh.axis_names)
    copies = OrderedCopies(mesh, expert_axis)
    route_for = functools.partial(
        ExchangedRoute.build,
        num_ranks=mesh.shape[expert_axis],
        axis_name=expert_axis,
        transport=transport,
    )
    whole = lambda a: jax.reshard(a, NamedSharding(mesh, P()))  # one array to sum in order

    def rank_loss(params, rest, batch, expert_weights):
        """One rank's partials, each with a leading axis of 1: its nll sum, its MoE layers'
        losses [L_moe], token counts [L_moe, E] and count of loss tokens."""
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p[0], params), rest)
        for moe in model.moe_layers():
            moe.row_alignment = expert_parallel_row_alignment(moe)
        logits, aux = model(
            batch["inputs"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
            route_for=route_for,
            expert_weights=expert_weights,
        )
        total, tokens = lm_loss(logits, batch["targets"], batch["loss_mask"], normalizer=1)
        partials = (total, aux.load_balancing_loss, aux.z_loss, aux.tokens_per_expert, tokens)
        return tuple(a[None] for a in partials)

    def loss_fn(params, rest, micro_batch, expert_weights):
        batch = {k: micro_batch[k] for k in BATCH_KEYS}
        length = batch["inputs"].shape[0]
        if length % ranks:
            raise ValueError(
                f"make_mesh_loss_and_grads: a micro-batch of {length} rows does not split over "
                f"the mesh's {ranks} ranks {dict(mesh.shape)}"
            )
        spec = lambda tree: jax.tree_util.tree_map_with_path(
            lambda path, _: state_spec(path, expert_axis), tree
        )
        sharded = jax.shard_map(
            rank_loss,
            mesh=mesh,
            in_specs=(
                jax.tree_util.tree_map_with_path(lambda path, _: copies.spec(path), params),
                spec(rest),
                {k: rows for k in batch},
                # The quantized expert copies [E, ...] are split like the experts.
                jax.tree.map(lambda _: P(expert_axis), expert_weights),
            ),
            out_specs=rows,
            check_vma=False,  # the custom VJPs inside return per-rank partials
        )
        totals, balance, z, counts, tokens = sharded(copies(params), rest, batch, expert_weights)
        nll = sum_in_order(whole(totals)) / jnp.asarray(micro_batch["step_tokens"], F32)
        mean = lambda a: sum_in_order(whole(a), axis=0) / (ranks * micro_batches)
        balance, z = mean(balance), mean(z)
        metrics = dict(
            nll=nll,
            load_balancing_loss=balance,
            z_loss=z,
            tokens_per_expert=jnp.sum(whole(counts), axis=0),  # integers: exact in any order
            tokens=jnp.sum(whole(tokens)),
        )
        return nll + sum_in_order(balance + z), metrics

    return jax.value_and_grad(loss_fn, has_aux=True)


def training_mesh(data: int, ep: int) -> Mesh:
    """`jax.make_mesh((data, ep), ("data", "ep"))` over the first data x ep devices
    (`jax.devices()`: every process's under `jax.distributed`); ValueError when there are
    fewer."""
    devices = jax.devices()
    if data * ep > len(devices):
        raise ValueError(
            f"training_mesh: a ({data}, {ep}) mesh needs {data * ep} devices, there are "
            f"{len(devices)} ({devices[0].platform})"
        )
    return jax.make_mesh((data, ep), ("data", "ep"), devices=devices[: data * ep])


def mesh_micro_batches(mesh: Mesh) -> Callable:
    """`split(batch, micro_batches)` for `jaxmoe.train.make_train_step` over `mesh`: each [B, ...]
    array of a batch split over the mesh by rows (`global_batch`) -> [micro_batches, B /
    micro_batches, ...], micro-batch i made of the i-th block of every rank's rows, in rank
    order, and split over the ranks as the batch was: each rank accumulates over its own rows
    (no rows move), as data-parallel training does. With one micro-batch it is the batch."""
    ranks, axes = mesh.size, mesh.axis_names

    def split(batch: dict[str, jax.Array], micro_batches: int) -> dict[str, jax.Array]:
        def one(v):
            if v.shape[0] % (ranks * micro_batches):
                raise ValueError(
                    f"mesh_micro_batches: {v.shape[0]} rows do not split into {micro_batches} "
                    f"micro-batches over the mesh's {ranks} ranks"
                )
            block = v.shape[0] // (ranks * micro_batches)
            per_rank = jax.lax.reshape(
                v,
                (ranks, micro_batches, block) + v.shape[1:],
                out_sharding=NamedSharding(mesh, P(axes)),
            )
            return jax.lax.reshape(
                jnp.swapaxes(per_rank, 0, 1),
                (micro_batches, ranks * block) + v.shape[1:],
                out_sharding=NamedSharding(mesh, P(None, axes)),
            )

        return {k: one(v) for k, v in batch.items()}

    return split


def global_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """A batch of [B, ...] host arrays as global arrays split over all of `mesh`'s axes by rows
    (`NamedSharding(mesh, P(mesh.axis_names))`, `make_mesh_loss_and_grads`'s layout), each
    process giving only the rows of its own devices
    (`jax.make_array_from_process_local_data`; sliced here from the full batch, which every
    process reads alike). Raises ValueError when B does not split over the ranks."""
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    placed = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % mesh.size:
            raise ValueError(
                f"global_batch: {key} has {value.shape[0]} rows, which do not split over the "
                f"mesh's {mesh.size} ranks"
            )
        blocks = sharding.addressable_devices_indices_map(value.shape).values()
        local = sorted({i for block in blocks for i in range(*block[0].indices(len(value)))})
        placed[key] = jax.make_array_from_process_local_data(sharding, value[local], value.shape)
    return placed
