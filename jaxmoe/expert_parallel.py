"""The MoE layer over a device mesh: routed experts split over an expert axis, tokens over every
axis (docs/expert_parallel.md).

Each rank routes its own tokens with the replicated router, sends every row to the rank that
owns its expert (`jaxmoe.exchange`), runs its experts, and combines its tokens' rows when they
come back, in the single-device order. So y, the auxiliary losses (each rank's own tokens') and
d x have the same bits at any expert-parallel degree.

Status (issue 16): the parameters' gradients are summed over the ranks by JAX's transpose of
`shard_map` (an XLA all-reduce), whose order depends on the degree; they agree with the
single-device layer within rounding, not yet bitwise. The transport is a dense all-to-all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.exchange import ExchangedRoute
from jaxmoe.moe import MoE, MoEAux


def expert_parallel_forward(
    model: MoE,
    x: jax.Array,
    mesh: Mesh,
    *,
    expert_axis: str = "ep",
    padding_mask: jax.Array | None = None,
) -> tuple[jax.Array, MoEAux]:
    """(y, aux) of `model` on x [B, ..., H] over `mesh`: the batch axis split over all mesh axes
    in their order (rank (d, e) of a ("data", "ep") mesh holds batch chunk d * ep + e, the same
    tokens whatever the split), the routed experts over `expert_axis` (E / ep each, rank e
    owning experts [e E/ep, (e + 1) E/ep)), everything else replicated. aux holds every rank's
    own values, stacked on a leading axis of mesh.size. Differentiable; jit it."""
    config = model.config
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_parallel_forward: mesh {mesh.axis_names} has no {expert_axis!r}")
    ranks, ep = mesh.size, mesh.shape[expert_axis]
    if config.num_experts % ep:
        raise ValueError(
            f"expert_parallel_forward: {config.num_experts} experts do not split over "
            f"{expert_axis} = {ep} ranks"
        )
    if x.ndim < 2 or x.shape[0] % ranks:
        raise ValueError(
            f"expert_parallel_forward: x must be [B, ..., H] with B a multiple of the "
            f"{ranks} ranks, got {x.shape}"
        )
    if config.load_balancing_type == "global_aux_loss":
        raise ValueError(
            "expert_parallel_forward: global_aux_loss keeps running counts in the module; "
            "under expert parallelism use aux_loss or seq_aux_loss"
        )
    if padding_mask is None:
        padding_mask = jnp.zeros(x.shape[:-1], bool)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    param_specs = jax.tree_util.tree_map_with_path(
        lambda path, _: P(expert_axis) if _in_experts(path) else P(), params
    )
    rest_specs = jax.tree.map(lambda _: P(), rest)
    tokens = P(mesh.axis_names)
    route_for = functools.partial(ExchangedRoute.build, num_ranks=ep, axis_name=expert_axis)

    def rank_forward(params, rest, x, padding_mask):
        local = nnx.merge(graphdef, params, rest)
        y, aux, _ = local.forward_with_stages(x, padding_mask=padding_mask, route_for=route_for)
        return y, jax.tree.map(lambda a: a[None], aux)

    def placed(tree, specs):
        return jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), tree, specs)

    sharded = jax.shard_map(
        rank_forward,
        mesh=mesh,
        in_specs=(param_specs, rest_specs, tokens, tokens),
        out_specs=(tokens, tokens),
        # The custom VJPs (GEMMs, exchange) return per-rank partial cotangents of parameters
        # that are replicated over some axes; shard_map's transpose then sums them over those
        # axes (not yet in a fixed order: docs/expert_parallel.md).
        check_vma=False,
    )
    return sharded(
        placed(params, param_specs),
        placed(rest, rest_specs),
        placed(x, tokens),
        placed(padding_mask, tokens),
    )


def _in_experts(path) -> bool:
    """Whether a parameter belongs to the routed experts (split over the expert axis)."""
    return any(getattr(key, "key", None) == "experts" for key in path)
