"""bridge.megatron on the real Megatron-Core 0.19.2 fixtures (tests/fixtures/megatron): both
formats, every expert layout, TP/EP/PP rank merging, round trips, errors, unsafe pickles, the
MXFP8 refit, and the comparison tool on the capacity fixtures (token order, pad fillers)."""

from __future__ import annotations

import argparse
import enum
import json
import os
import pickle
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from test_bridge_reference import batch_major_pairs  # noqa: E402

from bridge import compare, megatron
from bridge.__main__ import main
from bridge.dlpack import to_jax
from bridge.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ExpertCountError,
    MissingRankFilesError,
    MXFP8LayoutError,
    ShapeMismatchError,
    UnknownKeysError,
    UnsafeCheckpointError,
)
from bridge.safe_load import load_torch_file
from jaxmoe import mxfp8

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
CAPACITY_FIXTURES = [
    "capacity_probs_bf16",
    "capacity_position_bf16",
    "capacity_position_padded_bf16",
    "capacity_sigmoid_groups_fp32",
]
FIXTURES = ["mixtral_fp32", "deepseek_bf16", "nemotron_sqrelu_bf16"] + CAPACITY_FIXTURES


def fixture(name: str, *parts: str) -> str:
    return os.path.join(ROOT, name, *parts)


def load_fixture(name: str, fmt: str) -> megatron.MegatronCheckpoint:
    path = fixture(name, "torch_dist" if fmt == "torch_dist" else "legacy_model_optim_rng.pt")
    return megatron.load(path, fixture(name, "config.json"))


def assert_layers_equal(
    a: megatron.MegatronCheckpoint, b: megatron.MegatronCheckpoint, with_norm: bool = True
) -> None:
    assert sorted(a.layers) == sorted(b.layers)
    for index in a.layers:
        ta, tb = a.layers[index].tensors(), b.layers[index].tensors()
        if not with_norm:
            ta, tb = ({k: v for k, v in t.items() if "norm" not in k} for t in (ta, tb))
        assert sorted(ta) == sorted(tb), index
        for key in ta:
            assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), (index, key)


def norm_values(ckpt):
    return {i: (w.norm.weight, w.norm.bias) for i, w in ckpt.layers.items()}


# ------------------------------------------------------------------------- fixtures, formats
@pytest.mark.parametrize("name", FIXTURES)
def test_both_formats_hold_identical_tensors(name):
    dist, legacy = load_fixture(name, "torch_dist"), load_fixture(name, "legacy")
    assert dist.format == "torch_dist" and legacy.format == "legacy"
    assert dist.moe_layers == legacy.moe_layers == [0, 1] and dist.num_layers == 2
    assert dist.config == legacy.config
    # The local spec stores the pre-MLP norm under different names in the two formats.
    assert {w.norm.key for w in dist.layers.values()} == {"mlp.linear_fc1.layer_norm"}
    assert {w.norm.key for w in legacy.layers.values()} == {"pre_mlp_layernorm"}
    assert_layers_equal(dist, legacy, with_norm=False)
    for i in dist.layers:
        for a, b in zip(norm_values(dist)[i], norm_values(legacy)[i]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", FIXTURES)
def test_matches_megatron_recordings(name):
    """Routing equals Megatron's routing_map exactly; y, dx and every parameter gradient are
    within the bounds of bridge/README.md; jaxmoe and the PyTorch reference agree per stage."""
    io_ = load_torch_file(fixture(name, "io.pt"))
    report = compare.compare_layer(load_fixture(name, "torch_dist"), 0, io=io_)
    vs = report["vs_megatron"]
    assert vs["routing_exact"], vs["stages"]["routing_map"]
    expected = {
        "routing_map",
        "output",
        "grad_x",
        "grad_router_weight",
        "grad_fc1_weight",
        "grad_fc2_weight",
    }
    assert expected <= set(vs["stages"])
    assert vs["ok"], {k: v for k, v in vs["stages"].items() if not v["ok"]}
    assert report["routing_exact"]
    assert report["ok"], {k: v for k, v in report["stages"].items() if not v["ok"]}


@pytest.mark.parametrize("name", CAPACITY_FIXTURES)
def test_capacity_fixtures_pass_the_compare_tool(name, tmp_path, capsys):
    """`python -m bridge compare --io` exits 0 on the capacity fixtures: Megatron dropped pairs,
    jaxmoe keeps exactly the pairs Megatron kept (Megatron's [S, B] token order), and with
    pad-to-capacity Megatron's map holds `capacity` tokens per expert, the fillers at
    probability 0. Under "position", ranking jaxmoe's [B, S] tokens batch-major would keep
    other tokens (the mismatch this order fixes)."""
    out = tmp_path / "report.json"
    status = main(
        [
            "compare",
            "--megatron",
            fixture(name, "torch_dist"),
            "--layer",
            "0",
            "--io",
            fixture(name, "io.pt"),
            "--config",
            fixture(name, "config.json"),
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert status == 0, text
    report = json.loads(out.read_text())
    assert report["routing_exact"] and report["vs_megatron"]["routing_exact"]
    io_ = load_torch_file(fixture(name, "io.pt"))
    ckpt = load_fixture(name, "torch_dist")
    config = ckpt.config
    routing_map = io_["routing_map"].numpy()
    num_tokens = routing_map.shape[0]
    assert report["dropped_pairs"] > 0
    fillers = report["vs_megatron"]["routing_fillers"]
    if config.pad_expert_input_to_capacity:
        assert np.all(routing_map.sum(0) == config.capacity(num_tokens)) and fillers > 0
    else:
        kept_pairs = num_tokens * config.top_k - report["dropped_pairs"]
        assert fillers == 0 and routing_map.sum() == kept_pairs
    if config.token_drop_policy == "position":
        assert not np.array_equal(
            batch_major_pairs(ckpt, io_["x"]), compare.megatron_routing_pairs(io_, config)[0]
        )


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.parametrize("name", FIXTURES)
def test_import_export_import_is_bitwise(name, fmt, tmp_path):
    original = load_fixture(name, fmt)
    moes = [megatron.build_moe(original, i) for i in original.moe_layers]
    norms = [original.layers[i].norm for i in original.moe_layers]
    out = str(tmp_path / ("export.pt" if fmt == "legacy" else "export"))
    megatron.save(moes, out, format=fmt, norms=norms)
    again = megatron.load(out)  # config from the saved args alone
    assert again.config == original.config and again.format == original.format
    assert_layers_equal(original, again)
    assert_reexport_matches_megatron(name, fmt, out)


def assert_reexport_matches_megatron(name: str, fmt: str, out: str) -> None:
    """Every key we wrote exists in Megatron's own file with the same tensor."""
    from bridge import torch_dist_format

    if fmt == "torch_dist":
        ours, theirs = out, fixture(name, "torch_dist")
        our_index, their_index = (torch_dist_format.read_index(p) for p in (ours, theirs))
        tensor_keys = [k for k, v in our_index.items() if hasattr(v, "size")]
        assert set(our_index) - {"common_state/shard_0_1"} <= set(their_index)
        ours_t = torch_dist_format.read(ours, our_index, tensor_keys)
        theirs_t = torch_dist_format.read(theirs, their_index, tensor_keys)
        for key in tensor_keys:
            assert torch.equal(ours_t[key], theirs_t[key]), key
        extra = [k for k in our_index if "_extra_state" in k]
        assert extra and torch_dist_format.read(ours, our_index, extra[:1])[extra[0]] == [None]
        return
    ours = load_torch_file(out)["model"]
    theirs = load_torch_file(fixture(name, "legacy_model_optim_rng.pt"))["model"]
    assert set(ours) <= set(theirs)
    for key, value in ours.items():
        if value is None:
            assert theirs[key] is None, key
        else:
            assert torch.equal(value, theirs[key]), key


def test_checkpoint_converts_between_formats_and_layouts(tmp_path):
    dist = load_fixture("mixtral_fp32", "torch_dist")
    for layout in ("sequential", "te_grouped", "legacy_grouped"):
        out = str(tmp_path / f"{layout}_tree")
        megatron.save(
            dist, out, format="legacy", expert_layout=layout, norm_key="pre_mlp_layernorm"
        )
        again = megatron.load(out)
        assert again.expert_layout == layout and again.config == dist.config
        assert {w.norm.key for w in again.layers.values()} == {"pre_mlp_layernorm"}
        assert_layers_equal(dist, again, with_norm=False)
    per_layer = str(tmp_path / "per_layer")
    megatron.save(dist, per_layer, per_layer_keys=True)
    keys = megatron.torch_dist_format.read_index(per_layer)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys
    assert_layers_equal(dist, megatron.load(per_layer))


def test_hand_built_grouped_layouts_are_read(tmp_path):
    """TEGroupedMLP `weight{j}` keys and the legacy GroupedMLP raw views (weight1 [H, n*2F] is
    the memory of [n, H, 2F], not a column concatenation), written here independently of the
    bridge's writer."""
    name = "mixtral_fp32"
    model = load_torch_file(fixture(name, "legacy_model_optim_rng.pt"))["model"]
    reference = load_fixture(name, "legacy")
    te, grouped = {}, {}
    for key, value in model.items():
        parts = key.split(".")
        if "local_experts" not in parts:
            te[key] = grouped[key] = value
            continue
        j, linear, kind = int(parts[6]), parts[7], parts[8]
        if kind != "_extra_state":
            te[".".join(parts[:5] + [linear, f"{kind}{j}"])] = value
    for layer in (0, 1):
        prefix = f"decoder.layers.{layer}.mlp.experts."
        fc1 = [model[f"{prefix}local_experts.{j}.linear_fc1.weight"] for j in range(8)]
        fc2 = [model[f"{prefix}local_experts.{j}.linear_fc2.weight"] for j in range(8)]
        grouped[prefix + "weight1"] = torch.stack([w.T for w in fc1]).contiguous().view(128, -1)
        grouped[prefix + "weight2"] = torch.stack([w.T for w in fc2]).contiguous().view(-1, 128)
    for layout, state in (("te_grouped", te), ("legacy_grouped", grouped)):
        path = str(tmp_path / f"{layout}.pt")
        torch.save(
            {
                "model": {k: v for k, v in state.items() if "local_experts" not in k},
                "checkpoint_version": 3.0,
            },
            path,
        )
        ckpt = megatron.load(path, fixture(name, "config.json"))
        assert ckpt.expert_layout == layout
        assert_layers_equal(reference, ckpt)


def test_mixed_dense_and_moe_layers(tmp_path):
    ckpt = load_fixture("nemotron_sqrelu_bf16", "torch_dist")
    moe_layer = ckpt.layers[1]
    generator = torch.Generator().manual_seed(0)
    dense = megatron.DenseLayerWeights(
        fc1_weight=torch.randn(2 * 64, 128, generator=generator).to(torch.bfloat16),
        fc2_weight=torch.randn(128, 64, generator=generator).to(torch.bfloat16),
        norm=megatron.NormWeights(
            torch.ones(128, dtype=torch.bfloat16), key="mlp.linear_fc1.layer_norm"
        ),
    )
    out = str(tmp_path / "mixed")
    megatron.save({0: dense, 1: moe_layer, 2: moe_layer}, out, args=ckpt.args)
    keys = megatron.torch_dist_format.read_index(out)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in keys
    assert "decoder.layers.0.mlp.router.weight" not in keys
    again = megatron.load(out, ckpt.config)
    assert isinstance(again.layers[0], megatron.DenseLayerWeights)
    assert again.moe_layers == [1, 2] and again.num_layers == 3
    assert torch.equal(again.layers[0].fc1_weight, dense.fc1_weight)
    for i in (1, 2):
        for key, value in moe_layer.tensors().items():
            assert torch.equal(again.layers[i].tensors()[key], value)
    with pytest.raises(ConfigError, match="dense MLP layer"):
        megatron.build_moe(again, 0)


# ------------------------------------------------------------------ legacy multi-rank trees
def split_like_megatron(model: dict, tp: int, ep: int, num_experts: int) -> dict:
    """{(tp_rank, ep_rank): state dict} as Megatron saves a TP x EP run: each TP rank's fc1 is
    [W_r; V_r] (its slice of the gate rows, then of the up rows), fc2 is split on its input dim,
    and EP rank r holds global experts r*n .. r*n+n-1 as local_experts.0..n-1."""
    n_local = num_experts // ep

    def fc1_shard(w, r):
        gate, up = w.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]]).clone()

    files = {}
    for t in range(tp):
        for e in range(ep):
            state = {}
            for key, value in model.items():
                parts = key.split(".")
                if "local_experts" in parts:
                    j = int(parts[6])
                    if not e * n_local <= j < (e + 1) * n_local:
                        continue
                    parts[6] = str(j - e * n_local)
                    key = ".".join(parts)
                if value is not None and key.endswith("linear_fc1.weight") and ".mlp." in key:
                    value = fc1_shard(value, t)
                elif value is not None and key.endswith("linear_fc2.weight") and ".mlp." in key:
                    value = value.chunk(tp, dim=1)[t].clone()
                state[key] = value
            files[(t, e)] = state
    return files


def write_tree(root, files, name_of, args=None):
    for coords, state in files.items():
        folder = os.path.join(root, "iter_0000100", name_of(*coords))
        os.makedirs(folder)
        payload = {"model": state, "checkpoint_version": 3.0, "iteration": 100}
        if args is not None:
            payload["args"] = argparse.Namespace(**args)
        torch.save(payload, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("100")


def test_tp2_ep2_tree_merges_back_bitwise(tmp_path):
    name = "deepseek_bf16"  # GLU experts and a GLU shared expert: both are TP-split
    model = load_torch_file(fixture(name, "legacy_model_optim_rng.pt"))["model"]
    files = split_like_megatron(model, tp=2, ep=2, num_experts=16)
    assert files[(1, 0)][
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    ].shape == (128, 128)
    write_tree(str(tmp_path), files, lambda t, e: f"mp_rank_{t:02d}_{e:03d}")
    merged = megatron.load(str(tmp_path), fixture(name, "config.json"))
    assert merged.iteration == 100
    assert_layers_equal(load_fixture(name, "legacy"), merged)

    shutil.rmtree(tmp_path / "iter_0000100" / "mp_rank_01_000")
    with pytest.raises(MissingRankFilesError, match="mp_rank_01_000"):
        megatron.load(str(tmp_path), fixture(name, "config.json"))


def test_missing_expert_parallel_ranks_are_detected(tmp_path):
    name = "deepseek_bf16"
    model = load_torch_file(fixture(name, "legacy_model_optim_rng.pt"))["model"]
    files = split_like_megatron(model, tp=1, ep=2, num_experts=16)
    del files[(0, 1)]
    write_tree(str(tmp_path), files, lambda t, e: f"mp_rank_{t:02d}_{e:03d}")
    with pytest.raises(ExpertCountError, match="missing expert-parallel rank files"):
        megatron.load(str(tmp_path), fixture(name, "config.json"))


def test_pipeline_stages_use_local_layer_indices(tmp_path):
    name = "mixtral_fp32"
    model = load_torch_file(fixture(name, "legacy_model_optim_rng.pt"))["model"]
    stages = {}
    for stage in (0, 1):
        prefix = f"decoder.layers.{stage}."
        stages[(0, stage)] = {
            "decoder.layers.0." + k[len(prefix) :]: v
            for k, v in model.items()
            if k.startswith(prefix)
        }
    write_tree(
        str(tmp_path),
        stages,
        lambda t, p: f"mp_rank_{t:02d}_{p:03d}",
        args=dict(pipeline_model_parallel_size=2, num_layers=2),
    )
    merged = megatron.load(str(tmp_path / "iter_0000100"), fixture(name, "config.json"))
    assert_layers_equal(load_fixture(name, "legacy"), merged)


# ------------------------------------------------------------------------------------ errors
def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        megatron.load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no Megatron checkpoint"):
        megatron.load(str(tmp_path / "empty"))
    data = open(fixture("mixtral_fp32", "legacy_model_optim_rng.pt"), "rb").read()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        megatron.load(str(tmp_path / "truncated.pt"))
    dist = tmp_path / "dist"
    shutil.copytree(fixture("mixtral_fp32", "torch_dist"), dist)
    os.chmod(dist / "__0_0.distcp", 0o644)
    blob = (dist / "__0_0.distcp").read_bytes()
    (dist / "__0_0.distcp").write_bytes(blob[: len(blob) // 3])
    with pytest.raises(CorruptCheckpointError):
        megatron.load(str(dist), fixture("mixtral_fp32", "config.json"))
    os.chmod(dist / ".metadata", 0o644)
    (dist / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match="metadata"):
        megatron.load(str(dist))


def test_unknown_keys_are_listed(tmp_path):
    state = load_torch_file(fixture("mixtral_fp32", "legacy_model_optim_rng.pt"))
    state["model"]["decoder.layers.1.mlp.router.qb_beta"] = torch.zeros(8)
    state["model"]["decoder.layers.0.mlp.fc1_latent_proj.weight"] = torch.zeros(4, 128)
    torch.save(state, tmp_path / "unknown.pt")
    with pytest.raises(UnknownKeysError) as info:
        megatron.load(str(tmp_path / "unknown.pt"))
    assert info.value.keys == [
        "decoder.layers.0.mlp.fc1_latent_proj.weight",
        "decoder.layers.1.mlp.router.qb_beta",
    ]


def test_config_mismatches_name_the_key_and_both_shapes():
    args = json.load(open(fixture("mixtral_fp32", "config.json")))
    with pytest.raises(ExpertCountError, match=r"8 experts.*num_experts=16"):
        megatron.load(fixture("mixtral_fp32", "torch_dist"), dict(args, num_moe_experts=16))
    with pytest.raises(
        ShapeMismatchError,
        match=r"decoder\.layers\.0\.mlp\.experts\.experts\.linear_fc1\.weight: "
        r"checkpoint shape \(8, 512, 128\) but the config needs \(8, 256, 128\)",
    ):
        megatron.load(fixture("mixtral_fp32", "torch_dist"), dict(args, moe_ffn_hidden_size=128))
    ckpt = megatron.load(fixture("mixtral_fp32", "torch_dist"))
    assert ckpt.config is None and ckpt.args is None
    with pytest.raises(ConfigError, match="pass config="):
        megatron.build_moe(ckpt, 0)


def test_saved_args_win_and_a_different_caller_config_is_an_error(tmp_path):
    ckpt = load_fixture("nemotron_sqrelu_bf16", "torch_dist")
    out = str(tmp_path / "with_args")
    megatron.save(ckpt, out)
    assert megatron.load(out).config == ckpt.config
    args = json.load(open(fixture("nemotron_sqrelu_bf16", "config.json")))
    with pytest.raises(ConfigError, match="top_k"):
        megatron.load(out, dict(args, moe_router_topk=3))


class _TouchesAFile:
    """Unpickling this calls open(path, "w"), which would create the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickles_that_run_code_are_refused(tmp_path):
    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "args": _TouchesAFile(str(target))}, evil)
    with pytest.raises(UnsafeCheckpointError, match=r"io\.open") as info:
        megatron.load(str(evil))
    assert "nothing was executed" in str(info.value)
    assert not target.exists()

    dist = tmp_path / "dist"
    shutil.copytree(fixture("mixtral_fp32", "torch_dist"), dist)
    os.chmod(dist / ".metadata", 0o644)
    (dist / ".metadata").write_bytes(pickle.dumps(_TouchesAFile(str(target))))
    with pytest.raises(UnsafeCheckpointError, match="open"):
        megatron.load(str(dist))
    assert not target.exists()


def test_megatron_enums_in_saved_args_load_as_inert_stand_ins(tmp_path, monkeypatch):
    """Real Megatron-LM args hold megatron enums; they are read without importing megatron."""
    module = types.ModuleType("megatron.core.transformer.enums")
    for parent in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))

    class AttnBackend(enum.Enum):
        auto = 5

    AttnBackend.__module__, AttnBackend.__qualname__ = module.__name__, "AttnBackend"
    module.AttnBackend = AttnBackend
    monkeypatch.setitem(sys.modules, module.__name__, module)
    path = str(tmp_path / "enum.pt")
    torch.save(
        {
            "args": argparse.Namespace(attention_backend=AttnBackend.auto, num_experts=8),
            "model": {},
        },
        path,
    )
    for name in [m for m in sys.modules if m.split(".")[0] == "megatron"]:
        monkeypatch.delitem(sys.modules, name)
    state = load_torch_file(path)
    assert state["args"].num_experts == 8
    assert state["args"].attention_backend.args == (5,)
    assert module.__name__ not in sys.modules


# ------------------------------------------------------------------------------ MXFP8 refit
def _swizzle_by_formula(compact: np.ndarray) -> np.ndarray:
    """TE's GEMM scale layout by its index formula (docs/numerics.md, "MXFP8"), independent of
    jaxmoe."""
    rows, cols = compact.shape
    rows_pad, cols_pad = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(rows_pad * cols_pad, np.uint8)
    for i in range(rows):
        for j in range(cols):
            offset = (
                ((i // 128) * (cols_pad // 4) + j // 4) * 512
                + (i % 32) * 16
                + ((i % 128) // 32) * 4
                + j % 4
            )
            out[offset] = compact[i, j]
    return out


def _padded(compact: np.ndarray, rows_pad: int, cols_pad: int, fill: np.ndarray) -> np.ndarray:
    out = fill[: rows_pad * cols_pad].reshape(rows_pad, cols_pad).copy()
    out[: compact.shape[0], : compact.shape[1]] = compact
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_refit_is_bitwise(fmt):
    weight = load_fixture("deepseek_bf16", "torch_dist").layer(0).fc1_weight[3, :96, :96]
    w = to_jax(weight.contiguous())
    row = mxfp8.quantize(w, axis=1, fmt=fmt)  # blocks along K
    col = mxfp8.quantize(w, axis=0, fmt=fmt)  # blocks along M
    row_scale, col_scale = np.asarray(row.scale), np.asarray(col.scale)  # [M, K/32], [M/32, K]
    garbage = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    te_row = _padded(row_scale, 128, 4, garbage)  # roundup(M,128), roundup(K/32,4)
    te_col = _padded(col_scale, 4, 128, garbage)  # roundup(M/32,4), roundup(K,128)
    data_row = torch.from_numpy(np.asarray(row.data).view(np.uint8).copy())
    data_col = torch.from_numpy(np.asarray(col.data).view(np.uint8).copy())
    variants = {
        "compact": (te_row, te_col, False),
        "swizzled": (
            _swizzle_by_formula(row_scale).reshape(128, 4),
            _swizzle_by_formula(col_scale.T).reshape(4, 128),
            True,
        ),
    }
    for scales_row, scales_col, swizzled in variants.values():
        for layout in ("megatron", "jaxmoe"):
            refit = megatron.refit_mxfp8(
                data_row,
                torch.from_numpy(scales_row),
                fmt=fmt,
                swizzled=swizzled,
                columnwise_data=data_col,
                columnwise_scale_inv=torch.from_numpy(scales_col),
                layout=layout,
            )
            for got, want in ((refit.rowwise, row), (refit.columnwise, col)):
                data, scale = np.asarray(want.data).view(np.uint8), np.asarray(want.scale)
                axis = want.axis
                if layout == "jaxmoe":
                    data, scale, axis = data.T, scale.T, 1 - axis
                assert got.axis == axis and got.fmt == fmt
                np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), data)
                np.testing.assert_array_equal(np.asarray(got.scale), scale)
    with pytest.raises(MXFP8LayoutError, match=r"must have shape \(128, 4\)"):
        megatron.refit_mxfp8(data_row, torch.from_numpy(row_scale.copy()), fmt=fmt)
    with pytest.raises(MXFP8LayoutError, match="divisible by 32"):
        megatron.refit_mxfp8(data_row[:, :40], torch.from_numpy(te_row), fmt=fmt)


def test_progress_callback_reports_loading():
    seen = []
    megatron.load(fixture("mixtral_fp32", "torch_dist"), progress=lambda *a: seen.append(a))
    assert seen and seen[-1][0] == seen[-1][1]


def test_torch_dist_reads_only_the_mlp_keys(monkeypatch):
    from bridge import torch_dist_format

    requested = []
    real_read = torch_dist_format.read

    def recording_read(path, index, keys):
        requested.extend(keys)
        return real_read(path, index, keys)

    monkeypatch.setattr(torch_dist_format, "read", recording_read)
    megatron.load(fixture("deepseek_bf16", "torch_dist"))
    assert requested and all(".mlp." in k or k.startswith("common_state/") for k in requested)
    assert not any(k.startswith("optimizer.") or "self_attention" in k for k in requested)


def test_release_directory_is_found(tmp_path):
    ckpt = load_fixture("mixtral_fp32", "legacy")
    megatron.save(ckpt, str(tmp_path), format="legacy")
    os.rename(tmp_path / "iter_0000000", tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert_layers_equal(ckpt, megatron.load(str(tmp_path)))
