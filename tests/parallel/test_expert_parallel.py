"""The layer over a mesh of 8 host devices (`jaxmoe.expert_parallel`): y, the auxiliary losses, d x
and every parameter gradient have the same bits at expert-parallel degrees 1, 2, 4 and 8 (bf16
and MXFP8 on the wire; FP8-blockwise experts and wire at 1 and 8; DeepSeek-V3-style routing
at 1, 4 and 8); y equals the single-device
layer on each rank's tokens, and the gradients equal its gradients within rounding (they are
summed over the ranks in another, fixed, order)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmoe.expert_parallel
from jaxmoe import MoE, MoEConfig, mxfp8_inference
from jaxmoe.exchange import ExchangedRoute
from jaxmoe.expert_parallel import (
    expert_parallel_forward,
    expert_parallel_row_alignment,
    place_on_mesh,
)
from jaxmoe.ordered import sum_in_order
from jaxmoe.shapes import TINY_SHAPES

from bitwise import assert_bitwise, differs

H, BATCH, SEQ = 64, 8, 6
BF16 = MoEConfig(
    num_experts=8,
    top_k=2,
    ffn_hidden_size=64,
    aux_loss_coeff=1e-2,
    z_loss_coeff=1e-3,
    shared_expert_intermediate_size=32,
)
MXFP8 = BF16.replace(
    expert_precision="mxfp8",
    dispatch_dtype="mxfp8",
    combine_bwd_dtype="mxfp8",
    expert_row_alignment=32,
)
BLOCKWISE_WIRE = BF16.replace(dispatch_dtype="fp8_blockwise", combine_bwd_dtype="fp8_blockwise")
CONFIGS = {"bf16": BF16, "mxfp8": MXFP8}
MXFP8_EXPERTS = MXFP8.replace(dispatch_dtype="bf16", combine_bwd_dtype="bf16")
BLOCKWISE_EXPERTS = BF16.replace(  # H = 128 (`make(..., hidden_size=128)`)
    expert_precision="fp8_blockwise",
    expert_row_alignment=128,
    ffn_hidden_size=128,
    shared_expert_intermediate_size=None,
)


def make(config, hidden_size=H):
    model = MoE(config, hidden_size, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, hidden_size)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), (BATCH, SEQ, hidden_size))
    return model, x, cotangent


def mesh_for(ep):
    return jax.make_mesh((8 // ep, ep), ("data", "ep"))


def training_step(model, cotangent, mesh, padding_mask=None, transport="dense"):
    """(params, x) -> ((d x, d params), (y, aux)) of <y, cotangent> + the ranks' auxiliary
    losses, and the model's params."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        local = nnx.merge(graphdef, params, rest)
        y, aux = expert_parallel_forward(
            local, x, mesh, padding_mask=padding_mask, transport=transport
        )
        whole = lambda a: jax.reshard(a, NamedSharding(mesh, P()))  # one array to sum in order
        total = sum_in_order(jnp.ravel(whole(y).astype(jnp.float32) * cotangent))
        return total + sum_in_order(whole(aux.total_loss)), (y, aux)

    return jax.grad(loss, argnums=(1, 0), has_aux=True), params


def step(model, x, cotangent, mesh, padding_mask=None, transport="dense"):
    """(y, aux, d x, d params) of <y, cotangent> + the ranks' auxiliary losses."""
    grad, params = training_step(model, cotangent, mesh, padding_mask, transport)
    (d_x, d_params), (y, aux) = jax.jit(grad)(params, x)
    return y, aux, d_x, d_params


def assert_same_bits_at_every_degree(model, x, cotangent, degrees=(1, 2, 4, 8)):
    """y, aux, d x and d params of every degree bitwise those of ep = 1; returns ep = 1's."""
    runs = {ep: step(model, x, cotangent, mesh_for(ep)) for ep in degrees}
    y1, aux1, d_x1, d_params1 = runs[1]
    for y, aux, d_x, d_params in runs.values():
        assert_bitwise(np.asarray(y), np.asarray(y1))
        for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(aux1), strict=True):
            assert_bitwise(np.asarray(a), np.asarray(b))
        assert_bitwise(np.asarray(d_x), np.asarray(d_x1))
        for a, b in zip(jax.tree.leaves(d_params), jax.tree.leaves(d_params1), strict=True):
            assert_bitwise(np.asarray(a), np.asarray(b))
    return runs[1]


@pytest.mark.parametrize("precision", ["bf16", pytest.param("mxfp8", marks=pytest.mark.exhaustive)])
def test_same_bits_at_every_degree(precision):
    model, x, cotangent = make(CONFIGS[precision])
    y1 = assert_same_bits_at_every_degree(model, x, cotangent)[0]
    # ep = 1 is the single-device layer on each rank's tokens.
    for rank in range(8):
        alone = model(x[rank : rank + 1])[0]
        assert_bitwise(np.asarray(y1)[rank : rank + 1], np.asarray(alone))
    # Control: a change to one expert of the last rank changes y.
    model.experts.fc2_kernel[...] = model.experts.fc2_kernel[...].at[-1].multiply(2)
    assert differs(np.asarray(step(model, x, cotangent, mesh_for(8))[0]), np.asarray(y1))


@pytest.mark.parametrize(
    "precision, ep", [pytest.param("bf16", 8, marks=pytest.mark.exhaustive), ("mxfp8", 2)]
)
def test_ragged_transport_gives_the_dense_bits(precision, ep):
    """transport="ragged" (on CPU the emulation of `ragged_all_to_all`, `jaxmoe.exchange`):
    y, aux, d x and d params bitwise the dense transport's; MXFP8 with its wire copies."""
    model, x, cotangent = make(CONFIGS[precision])
    dense = step(model, x, cotangent, mesh_for(ep))
    ragged = step(model, x, cotangent, mesh_for(ep), transport="ragged")
    for a, b in zip(jax.tree.leaves(ragged), jax.tree.leaves(dense), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="transport must be one of"):
        expert_parallel_forward(model, x, mesh_for(ep), transport="nccl")


MXFP8_ROW_BYTES = H + H // 32  # a packed MXFP8 row (`jaxmoe.wire.pack_rows`): data, scales
BLOCKWISE_ROW_BYTES = H + 4 * -(-H // 128)  # data, one fp32 scale per 1 x 128 block


def row_exchanges(config, widths=(H, MXFP8_ROW_BYTES, BLOCKWISE_ROW_BYTES)) -> list[str]:
    """The dtypes of the row all-to-alls (last dim in `widths`: bf16 rows of H, packed quantized
    rows) in the expert-parallel training step at ep = 8, sorted."""
    model, x, cotangent = make(config)
    grad, params = training_step(model, cotangent, mesh_for(8))
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "all_to_all":
                found.extend(str(v.aval.dtype) for v in eqn.invars if v.aval.shape[-1] in widths)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(grad)(params, x).jaxpr)
    return sorted(found)


def test_mxfp8_rows_alone_cross_the_wire():
    """With dispatch_dtype and combine_bwd_dtype "mxfp8", the tokens sent to the experts and the
    output gradient sent back to them travel as MXFP8 rows alone, fp8 data and e8m0 scales
    packed in one all-to-all of H + H/32 bytes a row; the bf16 row exchanges left are the
    expert outputs coming back and their transpose (the rows' gradient going to the tokens).
    Control: bf16 on the wire, four bf16 row exchanges."""
    bf16 = ["bfloat16"] * 2
    assert row_exchanges(MXFP8) == bf16 + ["uint8"] * 2
    assert row_exchanges(BF16) == bf16 * 2


def test_blockwise_rows_alone_cross_the_wire():
    """The same with "fp8_blockwise" on the wire: fp8 data and one fp32 scale per 1x128 block
    (H = 64: one partial block) packed in one all-to-all of H + 4 bytes a row; no other
    float32 rows than the routing probabilities' per-row exchanges, which both configs have."""
    assert row_exchanges(BLOCKWISE_WIRE) == ["bfloat16"] * 2 + ["uint8"] * 2
    scales = lambda config: row_exchanges(config, widths=(1,)).count("float32")
    assert scales(BLOCKWISE_WIRE) == scales(BF16)


def test_blockwise_experts_same_bits_at_every_degree():
    """FP8-blockwise experts (H = F = 128, 128-row blocks) with the blockwise wire: the
    (expert, source) blocks' weight-gradient partials summed in order, as for bf16: the same
    bits at ep = 1 and 8 (ep = 1 the single-device layer on each rank's tokens). Control: a
    change to one expert of the last rank changes y."""
    config = BLOCKWISE_EXPERTS.replace(
        dispatch_dtype="fp8_blockwise", combine_bwd_dtype="fp8_blockwise"
    )
    model, x, cotangent = make(config, hidden_size=128)
    y1 = assert_same_bits_at_every_degree(model, x, cotangent, degrees=(1, 8))[0]
    for rank in (0, 7):
        assert_bitwise(np.asarray(y1)[rank : rank + 1], np.asarray(model(x[rank : rank + 1])[0]))
    model.experts.fc2_kernel[...] = model.experts.fc2_kernel[...].at[-1].multiply(2)
    assert differs(np.asarray(step(model, x, cotangent, mesh_for(8))[0]), np.asarray(y1))


def test_deepseek_v3_style_routing_same_bits_at_4_and_8():
    """The DeepSeek-V3-style layer of issue 18 at tiny sizes (`jaxmoe.shapes.TINY_SHAPES`
    "tiny_deepseek": 16 experts, top-4 sigmoid scores over 4 groups / top-2, an expert bias,
    fp32 router, sequence aux loss, a gated shared expert) with MXFP8 on the wire: y, aux, d x
    and every gradient at ep = 4 and 8 bitwise ep = 1. Control: a changed expert bias (routing
    only) changes y."""
    config = TINY_SHAPES["tiny_deepseek"].config.with_precision("mxfp8")
    config = config.replace(expert_precision="bf16")  # the wire in MXFP8, the experts in bf16
    model, x, cotangent = make(config)
    bias = jax.random.normal(jax.random.key(3), (config.num_experts,)) * 0.1
    model.router.expert_bias[...] = bias.astype(jnp.float32)
    y1 = assert_same_bits_at_every_degree(model, x, cotangent, degrees=(1, 4, 8))[0]
    model.router.expert_bias[...] = jnp.roll(model.router.expert_bias[...], 1)
    assert differs(np.asarray(step(model, x, cotangent, mesh_for(8))[0]), np.asarray(y1))


def test_ranks_that_receive_no_rows():
    """Sigmoid routing with an expert bias that rules out experts 4-7 (so at ep = 2 one rank, at
    ep = 8 four ranks, get no rows; their expert gradients are zero): the same bits at every
    degree, and the experts that got no rows have zero gradients."""
    config = BF16.replace(score_function="sigmoid", enable_expert_bias=True, aux_loss_coeff=0.0)
    model, x, cotangent = make(config)
    model.router.expert_bias[...] = jnp.array([0.0] * 4 + [-100.0] * 4, jnp.float32)
    runs = {ep: step(model, x, cotangent, mesh_for(ep)) for ep in (1, 2, 8)}
    assert int(np.asarray(runs[1][1].tokens_per_expert)[:, 4:].sum()) == 0
    for run in runs.values():
        for a, b in zip(jax.tree.leaves(run), jax.tree.leaves(runs[1]), strict=True):
            assert_bitwise(np.asarray(a), np.asarray(b))
    fc1_grad = np.asarray(runs[8][3]["experts"]["fc1_kernel"], np.float32)
    assert not fc1_grad[4:].any() and fc1_grad[:4].any()


@pytest.mark.parametrize("pad", [False, True], ids=["dropping", "padded_to_capacity"])
def test_capacity_is_per_rank(pad):
    """With capacity, each rank drops among its own tokens, with the capacity of its own token
    count (Megatron's per-rank semantics): y equals the single-device layer on each rank's
    tokens, and every degree gives the same bits."""
    config = BF16.replace(capacity_factor=1.0, pad_expert_input_to_capacity=pad)
    model, x, cotangent = make(config)
    ep1 = step(model, x, cotangent, mesh_for(1))
    ep4 = step(model, x, cotangent, mesh_for(4))
    for a, b in zip(jax.tree.leaves(ep4), jax.tree.leaves(ep1), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    for rank in range(8):
        alone = model(x[rank : rank + 1])[0]
        assert_bitwise(np.asarray(ep4[0])[rank : rank + 1], np.asarray(alone))
    assert int(np.asarray(ep1[1].tokens_per_expert).sum()) < BATCH * SEQ * 2  # pairs dropped


@pytest.mark.parametrize(
    "shape, names, like",
    [((8,), ("ep",), 8), ((2, 2, 2), ("pod", "data", "ep"), 2)],
    ids=["expert_axis_alone", "two_data_axes"],
)
def test_any_data_axes(shape, names, like):
    """An expert axis alone, or two data axes, give the bits of ("data", "ep") with the same
    expert-parallel degree (ranks numbered in mesh order)."""
    model, x, cotangent = make(BF16)
    got = step(model, x, cotangent, jax.make_mesh(shape, names))
    want = step(model, x, cotangent, mesh_for(like))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "config, hidden_size, transport",
    [
        (BF16, H, "dense"),
        (MXFP8_EXPERTS, H, "dense"),
        (MXFP8.replace(expert_precision="bf16"), H, "dense"),
        (BF16, H, "ragged"),
        (MXFP8.replace(expert_precision="bf16"), H, "ragged"),
        pytest.param(MXFP8, H, "dense", marks=pytest.mark.exhaustive),
        pytest.param(BLOCKWISE_EXPERTS, 128, "dense", marks=pytest.mark.exhaustive),
        pytest.param(
            BLOCKWISE_EXPERTS.replace(
                dispatch_dtype="fp8_blockwise", combine_bwd_dtype="fp8_blockwise"
            ),
            128,
            "dense",
            marks=pytest.mark.exhaustive,
        ),
    ],
    ids=[
        "bf16",
        "mxfp8_experts",
        "mxfp8_wire",
        "bf16_ragged",
        "mxfp8_wire_ragged",
        "mxfp8",
        "fp8_blockwise_experts",
        "fp8_blockwise",
    ],
)
def test_rows_past_the_blocks_never_reach_a_result(monkeypatch, config, hidden_size, transport):
    """The receiver's rows past its blocks (`ExchangedRoute.live_rows`) are skipped by the token
    copy (and a quantized copy's values, `send_tokens_with_values`), the bf16 GEMMs and the
    activation's backward pass, and hold unspecified values: with the XLA references filling
    them with NaN (`DEAD_ROW_FILL`), y, aux, d x and d params at ep = 2 keep their bits (and no
    NaN). With transport="ragged" the exchange's outputs also leave the rows that no piece
    writes unfilled (`live_rows.unspecified`, NaN here; tests/parallel/test_exchange.py checks they are
    NaN), and the results are the dense transport's bits. Control: one live row fewer (the last
    block's last row filled too) changes them."""
    from jaxmoe.ops import live_rows

    model, x, cotangent = make(config, hidden_size)
    zeros = step(model, x, cotangent, mesh_for(2))
    monkeypatch.setattr(live_rows, "DEAD_ROW_FILL", np.nan)
    poisoned = step(model, x, cotangent, mesh_for(2), transport=transport)
    for a, b in zip(jax.tree.leaves(poisoned), jax.tree.leaves(zeros), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
        assert not np.any(np.isnan(np.asarray(a, np.float32)))
    real = ExchangedRoute.live_rows
    monkeypatch.setattr(ExchangedRoute, "live_rows", property(lambda r: real.fget(r) - 1))
    short = step(model, x, cotangent, mesh_for(2), transport=transport)
    assert any(
        differs(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(short), jax.tree.leaves(zeros), strict=True)
    )


def test_control_one_group_per_expert_changes_the_gradient_bits(monkeypatch):
    """Negative control for the gradients: if the owner's GEMMs saw one group per expert (all
    sources' rows accumulated together), the expert gradients at ep = 2 would not have ep = 1's
    bits."""
    model, x, cotangent = make(BF16)
    ep1 = step(model, x, cotangent, mesh_for(1))[3]
    monkeypatch.setattr(ExchangedRoute, "group_sizes", property(lambda r: r.exchange.group_sizes))
    monkeypatch.setattr(ExchangedRoute, "row_group", property(lambda r: r.exchange.row_expert))
    monkeypatch.setattr(ExchangedRoute, "per_group", lambda r, w: w)
    monkeypatch.setattr(ExchangedRoute, "groups_per_weight", property(lambda r: 1))
    ep2 = step(model, x, cotangent, mesh_for(2))[3]
    assert differs(
        np.asarray(ep2["experts"]["fc1_kernel"][...]),
        np.asarray(ep1["experts"]["fc1_kernel"][...]),
    )


def test_same_bits_with_many_rows_per_expert(monkeypatch):
    """256 tokens a rank (64 rows an expert from each source, blocks at many starts): the same
    bits at ep = 1, 2 and 8 for bf16 experts (row alignment 1, raised to 32 under expert
    parallelism). Control: with the blocks at the config's alignment, the expert weight
    gradients depend on where the exchange puts them."""
    model, _, _ = make(BF16)
    x = jax.random.normal(jax.random.key(3), (8, 256, H)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(4), (8, 256, H))
    assert expert_parallel_row_alignment(model) == 32
    assert_same_bits_at_every_degree(model, x, cotangent, degrees=(1, 2, 8))
    monkeypatch.setattr(
        jaxmoe.expert_parallel, "expert_parallel_row_alignment", lambda m: m.row_alignment
    )
    grads = {ep: step(model, x, cotangent, mesh_for(ep))[3]["experts"] for ep in (1, 8)}
    assert any(
        differs(np.asarray(grads[8][name][...]), np.asarray(grads[1][name][...]))
        for name in ("fc1_kernel", "fc2_kernel")
    )


def test_experts_without_data_axes_are_used_as_they_are():
    """Each rank computes with fp32 copies of the parameters that are summed across ranks; the
    routed experts at ep = 8 of 8 ranks (no data axes: one copy) are used as they are, bf16
    (nothing to convert; the same bits, test_same_bits_at_every_degree). At ep = 4 of 8 they
    have two copies, fp32; the router and shared expert always have eight."""
    model, _, _ = make(BF16)
    params = nnx.split(model, nnx.Param, ...)[1]
    for ep, experts_dtype in ((8, jnp.bfloat16), (4, jnp.float32)):
        copies = jaxmoe.expert_parallel.OrderedCopies(mesh_for(ep), "ep")(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(copies):
            routed = jax.tree_util.keystr(path).startswith("['experts']")
            assert leaf.dtype == (experts_dtype if routed else jnp.float32), path


def single_device_gradients(model, x, cotangent):
    """The parameter gradients of the same loss on one device: each rank's tokens a call."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        local, total = nnx.merge(graphdef, params, rest), 0.0
        for rank in range(8):
            y, aux = local(x[rank : rank + 1])
            total += jnp.sum(y.astype(jnp.float32) * cotangent[rank : rank + 1])
            total += aux.total_loss
        return total

    return jax.jit(jax.grad(loss))(params)


def test_parameter_gradients_agree_with_one_device_within_rounding():
    """Every degree's parameter gradients against the single-device layer's (one call per
    rank's tokens, summed), normwise within 2^-7 (bf16 gradients summed in other orders)."""
    model, x, cotangent = make(BF16)
    reference = single_device_gradients(model, x, cotangent)
    for ep in (1, 2, 8):
        grads = step(model, x, cotangent, mesh_for(ep))[3]
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.linalg.norm(a - b) <= 2.0**-7 * np.linalg.norm(b)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "mxfp8_experts"])
def test_parameter_gradients_are_the_ranks_single_device_gradients_summed_in_order(precision):
    """At ep = 1 (8 data-parallel ranks) each parameter's gradient is, bitwise, the single-device
    gradients of the 8 ranks' tokens (each a separate call), summed with `sum_in_order` in fp32
    and rounded once: what the layer's reduction promises. By the degree invariance above, the
    same holds at every degree. (The rows themselves, padding included, are checked in
    tests/parallel/test_exchange.py: MXFP8's scale is nearly invisible in a gradient.)"""
    model, x, cotangent = make(CONFIGS.get(precision, MXFP8_EXPERTS))
    model.row_alignment = expert_parallel_row_alignment(model)  # the blocks' layout over a mesh
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def rank_gradients(params, x, cotangent):
        def loss(params):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return sum_in_order(jnp.ravel(y.astype(jnp.float32) * cotangent)) + aux.total_loss

        return jax.grad(loss)(params)

    per_rank = [rank_gradients(params, x[r : r + 1], cotangent[r : r + 1]) for r in range(8)]
    want = jax.tree.map(
        lambda *g: sum_in_order(jnp.stack([a.astype(jnp.float32) for a in g])).astype(g[0].dtype),
        *per_rank,
    )
    got = step(model, x, cotangent, mesh_for(1))[3]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))
    # Control: the same tree with every partial sum rounded to the parameter dtype differs.
    rounded = jax.tree.map(lambda *g: sum_in_order(jnp.stack(g)), *per_rank)
    assert any(
        differs(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(rounded), strict=True)
    )


def test_padding_tokens_are_left_out_at_every_degree():
    model, x, cotangent = make(BF16)
    mask = jnp.zeros((BATCH, SEQ), bool).at[:, -2:].set(True)
    y1, aux1 = step(model, x, cotangent, mesh_for(1), mask)[:2]
    y8, aux8 = step(model, x, cotangent, mesh_for(8), mask)[:2]
    assert_bitwise(np.asarray(y8), np.asarray(y1))
    assert_bitwise(np.asarray(aux8.tokens_per_expert), np.asarray(aux1.tokens_per_expert))
    assert int(np.asarray(aux1.tokens_per_expert).sum()) == BATCH * (SEQ - 2) * 2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m, x: (m, x, jax.make_mesh((8,), ("data",))), "has no 'ep'"),
        (lambda m, x: (m, x[:6], jax.make_mesh((2, 4), ("data", "ep"))), "multiple of the 8"),
        (
            lambda m, x: (MoE(BF16.replace(num_experts=6), H, rngs=nnx.Rngs(0)), x, mesh_for(4)),
            "6 experts do not split",
        ),
        (
            lambda m, x: (
                MoE(BF16.replace(load_balancing_type="global_aux_loss"), H, rngs=nnx.Rngs(0)),
                x,
                mesh_for(2),
            ),
            "global_aux_loss",
        ),
    ],
)
def test_bad_meshes_and_configs_are_refused(change, message):
    model, x, _ = make(BF16)
    model, x, mesh = change(model, x)
    with pytest.raises(ValueError, match=message):
        expert_parallel_forward(model, x, mesh)


def test_mxfp8_inference_same_bits_at_every_degree():
    """`jaxmoe.mxfp8_inference`'s layer (the experts as their MXFP8 copies alone, variables
    rather than parameters) over the mesh, placed by `place_on_mesh` and jitted: each expert's
    copies on its owner alone, and y at ep = 1, 2, 4, 8 bitwise the single-device inference of
    each rank's tokens. The copies' data are stored in 128 x 128 tiles (hidden and FFN sizes
    128). Control: a changed copy of the last expert changes y."""
    model, x, _ = make(MXFP8.replace(ffn_hidden_size=128), hidden_size=128)
    inference = mxfp8_inference(model)
    assert inference.experts.fc2_data[...].ndim == 5
    alone = np.concatenate([np.asarray(inference(x[r : r + 1])[0]) for r in range(BATCH)])

    def forward(module, mesh):
        graphdef, state = nnx.split(place_on_mesh(module, mesh))
        run = jax.jit(lambda state, x: expert_parallel_forward(nnx.merge(graphdef, state), x, mesh))
        return state, run(state, x)[0]

    for ep in (1, 2, 4, 8):
        state, y = forward(inference, mesh_for(ep))
        data = state["experts"]["fc1_data"][...]
        assert data.sharding.spec == P("ep") and data.addressable_shards[0].data.shape[0] == 8 // ep
        assert_bitwise(np.asarray(y), alone)
    scale = inference.experts.fc2_scale[...]
    inference.experts.fc2_scale[...] = scale.at[-1].add(1)  # the last expert's blocks doubled
    assert differs(np.asarray(forward(inference, mesh_for(8))[1]), alone)
