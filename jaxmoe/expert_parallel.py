"""The MoE layer over a device mesh: routed experts split over an expert axis, tokens over every
axis (docs/expert_parallel.md).

Each rank routes its own tokens with the replicated router, sends every row to the rank that
owns its expert (`jaxmoe.exchange`), runs its experts, and combines its tokens' rows when they
come back, in the single-device order. So y, the auxiliary losses (each rank's own tokens') and
d x have the same bits at any expert-parallel degree.

The parameters' gradients are summed over the ranks in one fixed order too: each rank works on
an fp32 copy of every parameter, each (expert, source) block of the expert GEMMs has its own
weight-gradient partial, and the partials are summed with `sum_in_order` over the global
source index, inside the owner first and across the data axes after (the same tree). The
transport (`jaxmoe.exchange.TRANSPORTS`) is a dense all-to-all (room for a whole local buffer
per peer) by default; "ragged" moves only the real rows (not yet run on GPUs: issue 16).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.exchange import TRANSPORTS, ExchangedRoute
from jaxmoe.moe import MoE, MoEAux
from jaxmoe.ordered import sum_in_order


def expert_parallel_forward(
    model: MoE,
    x: jax.Array,
    mesh: Mesh,
    *,
    expert_axis: str = "ep",
    padding_mask: jax.Array | None = None,
    transport: str = "dense",
) -> tuple[jax.Array, MoEAux]:
    """(y, aux) of `model` on x [B, ..., H] over `mesh`: the batch axis split over all mesh axes
    in their order (rank (d, e) of a ("data", "ep") mesh holds batch chunk d * ep + e, the same
    tokens whatever the split), the routed experts over `expert_axis` (E / ep each, rank e
    owning experts [e E/ep, (e + 1) E/ep)), everything else replicated. aux holds every rank's
    own values, stacked on a leading axis of mesh.size. Differentiable; jit it. Under `jax.jit`
    the parameters must already be on the mesh's devices: place the model with `place_on_mesh`
    (or build it with `bridge.megatron.build_moe(..., mesh=)`); arrays committed to one device
    (from DLPack, `jax.device_put(a, device)`) are moved to the mesh only in an eager call.

    Multi-process (`jax.distributed`, e.g. one process per GPU): every process makes the same
    call (the same jitted step) with the same `mesh`, built over all processes' devices with
    explicit axes (`jax.make_mesh`'s default). Pass x (and padding_mask) as a global jax.Array
    split over the mesh as the tokens are, `NamedSharding(mesh, P(mesh.axis_names))`: e.g.
    `jax.make_array_from_process_local_data(sharding, rows, x_shape)`, each process giving the
    rows of its own devices in batch order. The parameters may be global arrays (the routed
    experts split over `expert_axis`, the rest replicated) or host-local values equal on every
    process. y, aux and the gradients are global
    arrays (`jax.experimental.multihost_utils.process_allgather` brings one to every host);
    their bits are those of one process with the same devices (docs/expert_parallel.md).
    transport: how rows cross the expert axis (`jaxmoe.exchange.TRANSPORTS`; the same bits)."""
    config = model.config
    _check_mesh("expert_parallel_forward", mesh, expert_axis, config.num_experts)
    ranks, ep = mesh.size, mesh.shape[expert_axis]
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
    # Every rank computes with its own fp32 copy of each parameter (the experts' over the data
    # axes only, as they are split over the expert axis), so that its gradient leaves the ranks
    # as per-rank partials, summed by `OrderedCopies` in one fixed order.
    copies = OrderedCopies(mesh, expert_axis)
    copy_specs = jax.tree_util.tree_map_with_path(lambda path, _: copies.spec(path), params)
    rest_specs = jax.tree_util.tree_map_with_path(
        lambda path, _: state_spec(path, expert_axis), rest
    )
    tokens = P(mesh.axis_names)
    if transport not in TRANSPORTS:
        raise ValueError(
            f"expert_parallel_forward: transport must be one of {TRANSPORTS}, got {transport!r}"
        )
    route_for = functools.partial(
        ExchangedRoute.build, num_ranks=ep, axis_name=expert_axis, transport=transport
    )

    row_alignment = expert_parallel_row_alignment(model)

    def rank_forward(params, rest, x, padding_mask):
        local = nnx.merge(graphdef, jax.tree.map(lambda p: p[0], params), rest)
        local.row_alignment = row_alignment
        y, aux, _ = local.forward_with_stages(x, padding_mask=padding_mask, route_for=route_for)
        return y, jax.tree.map(lambda a: a[None], aux)

    def placed(tree, specs):
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)

    sharded = jax.shard_map(
        rank_forward,
        mesh=mesh,
        in_specs=(copy_specs, rest_specs, tokens, tokens),
        out_specs=(tokens, tokens),
        check_vma=False,  # the custom VJPs inside return per-rank partials
    )
    return sharded(
        copies(params), placed(rest, rest_specs), placed(x, tokens), placed(padding_mask, tokens)
    )


# A weight-gradient GEMM's reduction order depends on where its group starts: modulo 16 rows in
# the Pallas kernel (ops/pallas/tgmm_hopper.py), modulo 32 in XLA:CPU's ragged dot (checked in
# tests/ops/test_gmm.py). Blocks that start on multiples of 32 sum their rows the same way wherever
# the exchange puts them.
GROUP_START_ALIGNMENT = 32


def expert_parallel_row_alignment(model: MoE) -> int:
    """The expert buffer's row alignment under `expert_parallel_forward`, at every degree:
    `model.row_alignment` rounded up to a multiple of GROUP_START_ALIGNMENT when the routed
    experts have trainable parameters, so that each (expert, source) block's weight-gradient
    partial has the same bits at every degree; forward-only experts (`mxfp8_inference`) keep
    theirs (a row's outputs do not depend on it)."""
    if not jax.tree.leaves(nnx.state(model.experts, nnx.Param)):
        return model.row_alignment
    return math.lcm(model.row_alignment, GROUP_START_ALIGNMENT)


def _in_experts(path) -> bool:
    """Whether a parameter or variable belongs to the routed experts (split over the expert
    axis)."""
    return any(getattr(key, "key", None) == "experts" for key in path)


def state_spec(path, expert_axis: str) -> P:
    """How a module's array is laid out over the mesh: the routed experts' (their leading axis
    E; the parameters, and `jaxmoe.mxfp8_inference`'s MXFP8 copies) split over the expert axis,
    the rest replicated."""
    return P(expert_axis) if _in_experts(path) else P()


class OrderedCopies:
    """params -> per-rank fp32 copies [n, ...] (n: the ranks of the copy axes, in mesh order),
    whose gradient is the copies' cotangents summed with `sum_in_order` over n in fp32 and
    rounded once to the parameter's dtype. Rank g = its linear index over the copy axes, so the
    tree is the same for every split of the ranks (docs/expert_parallel.md). The routed
    experts' parameters are copied over the data axes and split over the expert axis, the
    others copied over every axis. A parameter with n = 1 (the routed experts without data
    axes) is passed on as it is, [1, ...]: its one cotangent, which the expert GEMMs round once
    from their fp32 sum of the sources' partials, is its gradient (the same bits as through an
    fp32 copy, without converting every expert weight and gradient)."""

    def __init__(self, mesh: Mesh, expert_axis: str):
        self.mesh, self.expert_axis = mesh, expert_axis
        self.apply = jax.custom_vjp(self._copies)
        self.apply.defvjp(lambda p: (self._copies(p), _dtypes(p)), self._sum)

    def __call__(self, params):
        return self.apply(params)

    def layout(self, path) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the axes a parameter is copied over, the axes its own leading dims are split over)."""
        if _in_experts(path):
            data = tuple(a for a in self.mesh.axis_names if a != self.expert_axis)
            return data, (self.expert_axis,)
        return tuple(self.mesh.axis_names), ()

    def spec(self, path) -> P:
        """The partition spec of a parameter's copies [n, ...]."""
        axes, dims = self.layout(path)
        return P(axes, *dims)

    def count(self, path) -> int:
        """How many copies of a parameter there are (the ranks of its copy axes)."""
        axes, _ = self.layout(path)
        return math.prod(self.mesh.shape[a] for a in axes)

    def _copies(self, params):
        def copy(path, p):
            _, dims = self.layout(path)
            p = jax.device_put(p, NamedSharding(self.mesh, P(*dims)))  # onto the mesh first
            n = self.count(path)
            # One copy (the routed experts without data axes): the parameter itself; its
            # gradient needs no sum across ranks (the GEMM rounds its partials' sum once).
            spread = (
                p[None] if n == 1 else jnp.broadcast_to(p.astype(jnp.float32)[None], (n,) + p.shape)
            )
            return jax.device_put(spread, NamedSharding(self.mesh, self.spec(path)))

        return jax.tree_util.tree_map_with_path(copy, params)

    def _sum(self, dtypes, cotangents):
        def total(path, g, like):
            axes, dims = self.layout(path)
            n = self.count(path)

            def rank_sum(local):
                if n == 1:
                    total = local[0].astype(like.dtype)
                else:
                    every = jax.lax.all_gather(local[0], axes, axis=0)
                    total = sum_in_order(every.astype(jnp.float32), axis=0, dtype=like.dtype)
                # Materialised without its copies axis at every degree: a reshape fused into
                # the consumer (an optimizer's multiply-adds) changes which products XLA
                # contracts into FMAs, and so the updated parameters' bits.
                return jax.lax.optimization_barrier(total)

            return jax.shard_map(
                rank_sum,
                mesh=self.mesh,
                in_specs=self.spec(path),
                out_specs=P(*dims),
                check_vma=False,
            )(g)

        return (jax.tree_util.tree_map_with_path(total, cotangents, dtypes),)


def _dtypes(params):
    """Empty arrays that carry each parameter's dtype to the backward pass."""
    return jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), params)


def place_on_mesh(model: nnx.Module, mesh: Mesh, *, expert_axis: str = "ep") -> nnx.Module:
    """`model` (a `MoE`, or any module holding MoE layers: `jaxmoe.models.MoETransformer`) with
    its state on `mesh`, laid out as `expert_parallel_forward` splits it: the routed experts'
    parameters and variables (leading axis E; `jaxmoe.mxfp8_inference`'s MXFP8 copies too)
    split over `expert_axis` (`P(expert_axis)`, rank e holding experts [e E/ep, (e + 1) E/ep),
    replicated over the other axes), every other parameter and variable replicated (`P()`).
    Returns a new module; `model` is left as it is.

    An abstract model (`nnx.eval_shape`, `jax.ShapeDtypeStruct` leaves) gives the abstract placed
    model: ShapeDtypeStructs carrying their shardings, from which each parameter can be built
    directly on its devices (`jax.make_array_from_callback`; `bridge.megatron.build_moe(...,
    mesh=...)` does). Raises ValueError when `expert_axis` is not a mesh axis or some layer's E
    does not split over it."""
    state = nnx.state(model)
    shardings = _shardings("place_on_mesh", state, mesh, expert_axis)

    def put(value, sharding: NamedSharding):
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        return jax.device_put(value, sharding)

    return nnx.merge(nnx.graphdef(model), jax.tree.map(put, state, shardings))


def mesh_shardings(tree, mesh: Mesh, *, expert_axis: str = "ep"):
    """The `NamedSharding` of every array of a state pytree as `place_on_mesh` lays it out (by
    `state_spec` of its key path): a module's state, its pure dicts, or an optimizer state over
    them (whose per-parameter entries sit under the same keys). Use them as a jitted step's in
    and out shardings, so that its outputs stay where its inputs were. Raises ValueError when
    `expert_axis` is not a mesh axis or the leading axis E of a routed experts' array does not
    split over it."""
    return _shardings("mesh_shardings", tree, mesh, expert_axis)


def _shardings(caller: str, tree, mesh: Mesh, expert_axis: str):
    """`mesh_shardings` of `tree`, errors naming `caller`."""
    _check_mesh(caller, mesh, expert_axis)

    def sharding(path, leaf) -> NamedSharding:
        spec = state_spec(path, expert_axis)
        if spec != P():
            _check_mesh(caller, mesh, expert_axis, leaf.shape[0])
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, tree)


def _check_mesh(caller: str, mesh, expert_axis: str, num_experts: int | None = None) -> None:
    """TypeError/ValueError unless `mesh` is a Mesh with `expert_axis` and E (when given) splits
    over it."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{caller}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"{caller}: mesh {mesh.axis_names} has no {expert_axis!r}")
    if num_experts is not None and num_experts % mesh.shape[expert_axis]:
        raise ValueError(
            f"{caller}: {num_experts} experts do not split over "
            f"{expert_axis} = {mesh.shape[expert_axis]} ranks"
        )
