"""bridge.megatron.build_moe(..., mesh=...) on the real Megatron fixtures (tests/fixtures/megatron)
and 8 host devices: the routed experts' parameters are made split over the expert axis (each
device from its own experts' slice of the checkpoint tensor), the rest replicated, with the bits
of the single-device build; `expert_parallel_forward` gives the same y from either build; a
placed model saves the checkpoint the unplaced one saves, and loads back to the same placed
parameters; bad meshes are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_bridge_megatron import assert_layers_equal, fixture, load_fixture  # noqa: E402

import jaxmoe
from bridge import megatron, megatron_build
from bridge.errors import ConfigError, ExpertCountError

from bitwise import assert_bitwise  # noqa: E402

NAME = "deepseek_bf16"  # 16 experts, a shared expert, an fp32 expert bias
MESHES = {"2x4": (2, 4), "1x8": (1, 8)}


@pytest.fixture(scope="module")
def ckpt() -> megatron.MegatronCheckpoint:
    return load_fixture(NAME, "torch_dist")


@pytest.fixture(scope="module")
def plain(ckpt) -> jaxmoe.MoE:
    return megatron.build_moe(ckpt, 0)


def mesh_of(shape) -> Mesh:
    return jax.make_mesh(shape, ("data", "ep"))


def leaves(model) -> dict[str, jax.Array]:
    """Every array the module holds (parameters and other variables), by path."""
    _, state = nnx.split(model)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def assert_placed_like(model, reference, mesh):
    """model's arrays have reference's bits, the experts' split over "ep" (each device holding
    its experts' slice), every other array replicated on every device of the mesh."""
    ours, theirs = leaves(model), leaves(reference)
    assert sorted(ours) == sorted(theirs)
    ep = mesh.shape["ep"]
    for path, value in ours.items():
        want = np.asarray(jax.device_get(theirs[path]))
        expert = path.startswith("['experts']")
        spec = P("ep") if expert else P()
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), path
        assert value.sharding.spec == spec and value.sharding.mesh == mesh, path
        assert {s.device for s in value.addressable_shards} == set(mesh.devices.flat), path
        for shard in value.addressable_shards:
            if expert:
                e = int(np.argwhere(mesh.devices == shard.device)[0][1])  # its ep coordinate
                per = value.shape[0] // ep
                assert shard.index[0] == slice(e * per, (e + 1) * per), path
                assert shard.data.shape == (per,) + value.shape[1:], path
            else:
                assert shard.data.shape == value.shape, path
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                want_shard = jax.random.key_data(theirs[path])[shard.index]
                assert_bitwise(np.asarray(jax.random.key_data(shard.data)), np.asarray(want_shard))
            else:
                assert_bitwise(np.asarray(shard.data), want[shard.index])


@pytest.mark.parametrize("shape", MESHES.values(), ids=MESHES.keys())
def test_build_places_each_devices_experts(ckpt, plain, shape, monkeypatch):
    mesh = mesh_of(shape)
    converted = []  # the shapes of the torch tensors passed to JAX
    to_jax = megatron_build.to_jax

    def spy(tensor, **kwargs):
        converted.append(tuple(tensor.shape))
        return to_jax(tensor, **kwargs)

    monkeypatch.setattr(megatron_build, "to_jax", spy)
    model = megatron.build_moe(ckpt, 0, mesh=mesh)
    assert_placed_like(model, plain, mesh)
    # Each device's experts came from their own slice: no whole expert stack went to JAX.
    experts = ckpt.config.num_experts
    stacks = [s for s in converted if len(s) == 3]
    assert stacks and all(s[0] == experts // shape[1] for s in stacks), converted
    # place_on_mesh lays an unplaced model out the same way.
    assert_placed_like(jaxmoe.place_on_mesh(plain, mesh), plain, mesh)


def uncommitted(model):
    """model with its arrays copied through host memory, uncommitted to a device: the plain
    build's arrays are DLPack imports, committed to device 0, which a mesh computation refuses."""

    def copy(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jnp.asarray(np.asarray(jax.random.key_data(a))))
        return jnp.asarray(np.asarray(a))

    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(copy, state))


@pytest.mark.parametrize("shape", MESHES.values(), ids=MESHES.keys())
def test_expert_parallel_forward_matches_the_unplaced_build(ckpt, plain, shape):
    mesh = mesh_of(shape)
    model = megatron.build_moe(ckpt, 0, mesh=mesh)
    io = torch.load(fixture(NAME, "io.pt"), weights_only=True)
    tokens = io["x"].transpose(0, 1).reshape(8, -1, plain.hidden_size)  # 8 rows of 8 tokens
    x = jnp.asarray(np.asarray(megatron_build.to_jax(tokens, copy=True)))

    def forward(module):
        graphdef, state = nnx.split(module)
        run = lambda state, x: jaxmoe.expert_parallel_forward(nnx.merge(graphdef, state), x, mesh)
        return jax.jit(run)(state, x)

    (y, aux), (y_plain, aux_plain) = forward(model), forward(uncommitted(plain))
    assert_bitwise(np.asarray(y), np.asarray(y_plain))
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(aux_plain), strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_placed_model_saves_and_loads_back(ckpt, fmt, tmp_path):
    mesh = mesh_of(MESHES["2x4"])
    placed = [megatron.build_moe(ckpt, i, mesh=mesh) for i in ckpt.moe_layers]
    unplaced = [megatron.build_moe(ckpt, i) for i in ckpt.moe_layers]
    for a, b in zip(placed, unplaced, strict=True):
        ta, tb = megatron.weights_from_moe(a).tensors(), megatron.weights_from_moe(b).tensors()
        assert sorted(ta) == sorted(tb)
        for key in ta:
            assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key

    norms = [ckpt.layers[i].norm for i in ckpt.moe_layers]
    suffix = ".pt" if fmt == "legacy" else ""
    outs = {kind: str(tmp_path / f"{kind}{suffix}") for kind in ("placed", "unplaced")}
    megatron.save(placed, outs["placed"], format=fmt, norms=norms)
    megatron.save(unplaced, outs["unplaced"], format=fmt, norms=norms)
    again, unplaced_again = (megatron.load(outs[kind]) for kind in ("placed", "unplaced"))
    assert again.args == unplaced_again.args and again.config == ckpt.config
    assert_layers_equal(again, unplaced_again)
    assert_layers_equal(again, ckpt)
    for i, model in zip(ckpt.moe_layers, placed, strict=True):
        assert_placed_like(megatron.build_moe(again, i, mesh=mesh), model, mesh)


def test_bad_meshes_are_refused(ckpt, plain):
    mesh = mesh_of(MESHES["2x4"])
    with pytest.raises(ConfigError, match="no expert axis 'expert'"):
        megatron.build_moe(ckpt, 0, mesh=mesh, expert_axis="expert")
    six = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "ep"))
    with pytest.raises(ExpertCountError, match="16 experts do not split over ep = 3"):
        megatron.build_moe(ckpt, 0, mesh=six)
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        megatron.build_moe(ckpt, 0, mesh=(2, 4))
    with pytest.raises(ValueError, match="has no 'expert'"):
        jaxmoe.place_on_mesh(plain, mesh, expert_axis="expert")
    with pytest.raises(ValueError, match="16 experts do not split over ep = 3"):
        jaxmoe.place_on_mesh(plain, six)
