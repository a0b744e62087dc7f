"""bridge.torch_reference against jaxmoe (bitwise where the stage is data movement or a declared
tie rule, bounded elsewhere) and the comparison tool `python -m bridge compare`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

import jaxmoe
from bridge import compare, megatron, torch_reference
from bridge.__main__ import main
from bridge.dlpack import to_jax, to_torch
from jaxmoe import routing as jax_routing

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "megatron")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUTING_CONFIGS = {
    "softmax_post": dict(num_experts=8, top_k=2),
    "softmax_pre": dict(num_experts=8, top_k=3, pre_softmax=True),
    "sigmoid_bias_groups": dict(
        num_experts=16,
        top_k=4,
        score_function="sigmoid",
        enable_expert_bias=True,
        num_groups=4,
        group_topk=2,
        topk_scaling_factor=2.5,
    ),
    "sqrtsoftplus": dict(num_experts=8, top_k=2, score_function="sqrtsoftplus"),
    "capacity_probs": dict(num_experts=8, top_k=2, capacity_factor=0.5),
    "capacity_position": dict(
        num_experts=8,
        top_k=2,
        capacity_factor=0.5,
        token_drop_policy="position",
        expert_row_alignment=8,
    ),
    "pad_to_capacity": dict(
        num_experts=8,
        top_k=2,
        capacity_factor=1.0,
        pad_expert_input_to_capacity=True,
        expert_row_alignment=4,
    ),
}


def tied_logits(num_tokens: int, num_experts: int, seed: int) -> np.ndarray:
    """bf16 logits drawn from 5 values, so most tokens have exact ties inside their top-k."""
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([-1.0, -0.5, 0.0, 0.25, 0.5], np.float32), (num_tokens, num_experts))


def test_top_k_breaks_ties_toward_the_lower_index():
    values, indices = torch_reference.top_k(torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0]]), 4)
    assert indices.tolist() == [[1, 2, 4, 0]] and values.tolist() == [[2.0, 2.0, 2.0, 1.0]]


@pytest.mark.parametrize("name", sorted(ROUTING_CONFIGS))
def test_routing_plan_and_dispatch_are_bitwise_equal(name):
    config = jaxmoe.MoEConfig(ffn_hidden_size=16, **ROUTING_CONFIGS[name])
    logits_np = tied_logits(64, config.num_experts, seed=1)
    bias_np = (
        np.random.default_rng(2).choice([0.0, 0.125], config.num_experts).astype(np.float32)
        if config.enable_expert_bias
        else None
    )
    logits = jnp.asarray(logits_np, jnp.bfloat16)
    bias = None if bias_np is None else jnp.asarray(bias_np)
    expected = jax_routing.route(logits, config, bias)
    got = torch_reference.route(
        torch.from_numpy(logits_np).to(torch.bfloat16),
        config,
        None if bias_np is None else torch.from_numpy(bias_np),
    )
    np.testing.assert_array_equal(got.indices.numpy(), np.asarray(expected.indices))
    np.testing.assert_array_equal(got.kept.numpy(), np.asarray(expected.kept))

    # The same routing decision gives the same plan and bitwise-identical dispatched rows.
    jax_plan = jaxmoe.make_plan(expected, config)
    torch_routing = torch_reference.Routing(
        to_torch(expected.probs), to_torch(expected.indices).long(), to_torch(expected.kept)
    )
    plan = torch_reference.make_plan(torch_routing, config)
    for field in (
        "row_slot",
        "row_expert",
        "slot_row",
        "combine_slot",
        "group_sizes",
        "tokens_per_group",
    ):
        np.testing.assert_array_equal(
            getattr(plan, field).numpy(), np.asarray(getattr(jax_plan, field)), err_msg=field
        )
    x = jax.random.normal(jax.random.key(3), (64, 32), jnp.bfloat16)
    rows = torch_reference.dispatch(to_torch(x), plan)
    np.testing.assert_array_equal(
        rows.view(torch.int16).numpy(), np.asarray(jaxmoe.dispatch(x, jax_plan)).view(np.int16)
    )
    np.testing.assert_array_equal(
        torch_reference.gather_slots(torch_routing.probs, plan).view(torch.int16).numpy(),
        np.asarray(jaxmoe.gather_slots(expected.probs, jax_plan)).view(np.int16),
    )

    # Combine the SAME expert outputs in both: identical order of the fp32 sum, one rounding.
    outputs = jax.random.normal(jax.random.key(4), (jax_plan.num_rows, 32), jnp.bfloat16) * 8
    combined = torch_reference.combine(to_torch(outputs), plan)
    np.testing.assert_array_equal(
        combined.view(torch.int16).numpy(),
        np.asarray(jaxmoe.combine(outputs, jax_plan)).view(np.int16),
    )


def random_moe(config: jaxmoe.MoEConfig, hidden: int, dtype, seed: int = 0) -> jaxmoe.MoE:
    """A jaxmoe.MoE with random non-trivial parameters (biases, expert bias, shared gate)."""
    moe = jaxmoe.MoE(config, hidden, param_dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(moe)

    def fill(path, leaf):
        names = {getattr(p, "key", None) for p in path}
        if names & {"bias", "fc1_bias", "fc2_bias", "expert_bias"}:
            return jnp.asarray(rng.standard_normal(leaf.shape) * 0.1, leaf.dtype)
        if leaf.ndim >= 2:
            return jnp.asarray(
                rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2]), leaf.dtype
            )
        return leaf

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_whole_layer_stages_within_bounds(dtype):
    """Options the fixtures do not cover: biases, gated shared expert, gelu without GLU,
    capacity dropping with alignment padding, z-loss; forward stages and all gradients."""
    config = jaxmoe.MoEConfig(
        num_experts=8,
        ffn_hidden_size=48,
        top_k=2,
        add_bias_linear=True,
        activation="gelu",
        gated_linear_unit=False,
        capacity_factor=1.0,
        expert_row_alignment=8,
        z_loss_coeff=1e-3,
        aux_loss_coeff=1e-2,
        load_balancing_type="seq_aux_loss",
    )
    moe = random_moe(config, 32, dtype)
    shared_config = config.replace(
        add_bias_linear=False,
        shared_expert_intermediate_size=24,
        shared_expert_gate=True,
        gated_linear_unit=True,
        activation="silu",
        router_dtype="fp32",
    )
    for layer in (moe, random_moe(shared_config, 32, dtype, seed=1)):
        ref = torch_reference.MoE.from_jaxmoe(layer)
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(5)).to(ref.dtype)
        dy = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6)).to(ref.dtype)
        jax_out = compare._stage_arrays(*compare._run_jaxmoe(layer, to_jax(x), to_jax(dy)))
        torch_out = compare._stage_arrays(*compare._run_torch(ref, x, dy))
        assert set(jax_out) == set(torch_out)
        assert np.array_equal(jax_out["indices"], torch_out["indices"])
        for name, reference in torch_out.items():
            bound = compare._bound(compare.BOUNDS, name, reference.dtype)
            result = compare.compare_stage(name, jax_out[name], reference, bound)
            assert result.ok, result


def run_cli(argv, capsys=None):
    status = main(argv)
    return status, (capsys.readouterr().out if capsys else "")


def test_compare_tool_report_in_process(tmp_path, capsys):
    name = "nemotron_sqrelu_bf16"
    out = tmp_path / "report.json"
    status, text = run_cli(
        [
            "compare",
            "--megatron",
            os.path.join(ROOT, name, "torch_dist"),
            "--layer",
            "0",
            "--io",
            os.path.join(ROOT, name, "io.pt"),
            "--config",
            os.path.join(ROOT, name, "config.json"),
            "--json",
            str(out),
        ],
        capsys,
    )
    assert status == 0, text
    report = json.loads(out.read_text())
    assert report["routing_exact"] is True and report["ok"] is True
    assert set(report["output"]) >= {"max_abs", "max_ulp", "bitwise_fraction"}
    assert report["vs_megatron"]["routing_exact"] is True
    stages = report["stages"]
    for stage in (
        "router_logits",
        "probs",
        "indices",
        "dispatched_rows",
        "fc1_output",
        "activation",
        "fc2_output",
        "combined",
        "output",
        "grad_x",
        "grad_router_weight",
        "grad_fc1_weight",
        "grad_fc2_weight",
    ):
        assert stages[stage]["ok"], stage
    assert stages["dispatched_rows"]["bitwise_fraction"] == 1.0
    assert "jaxmoe vs Megatron" in text and "PASS" in text


def test_compare_tool_fails_when_a_weight_is_perturbed(tmp_path, capsys):
    """jaxmoe and the reference both use the perturbed weight, but Megatron's recorded y and
    gradients no longer match: exit status 1."""
    name = "nemotron_sqrelu_bf16"
    ckpt = megatron.load(
        os.path.join(ROOT, name, "torch_dist"), os.path.join(ROOT, name, "config.json")
    )
    layer = ckpt.layer(0)
    layer.fc2_weight[3] = (layer.fc2_weight[3].float() * 1.25).to(layer.fc2_weight.dtype)
    megatron.save(ckpt, str(tmp_path / "perturbed"))
    out = tmp_path / "report.json"
    status, text = run_cli(
        [
            "compare",
            "--megatron",
            str(tmp_path / "perturbed"),
            "--layer",
            "0",
            "--io",
            os.path.join(ROOT, name, "io.pt"),
            "--json",
            str(out),
        ],
        capsys,
    )
    assert status == 1, text
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["vs_megatron"]["ok"] is False
    assert report["vs_megatron"]["routing_exact"] is True
    assert not report["vs_megatron"]["stages"]["output"]["ok"]
    assert "FAIL" in text


def test_compare_tool_as_a_subprocess(tmp_path):
    name = "deepseek_bf16"
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bridge",
            "compare",
            "--megatron",
            os.path.join(ROOT, name, "legacy_model_optim_rng.pt"),
            "--layer",
            "1",
            "--config",
            os.path.join(ROOT, name, "config.json"),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["routing_exact"] is True and report["layer"] == 1
    assert "vs_megatron" not in report and "shared_output" in report["stages"]
    help_text = subprocess.run(
        [sys.executable, "-m", "bridge", "compare", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "row_ulp <= 4" in help_text and "Exit status 0" in help_text


def test_grouped_mm_switch_stays_within_the_bf16_bounds():
    """torch._grouped_mm (the GPU path; it also runs on CPU) against the per-expert fp32 matmuls:
    only the GEMM summation order differs, so the bf16 stage bounds hold, forward and backward."""
    name = "deepseek_bf16"
    ckpt = megatron.load(
        os.path.join(ROOT, name, "torch_dist"), os.path.join(ROOT, name, "config.json")
    )
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    results = []
    for grouped in (False, True):
        ref = torch_reference.MoE.from_megatron(ckpt, 0, grouped_mm=grouped)
        inp = x.clone().requires_grad_(True)
        y, aux = ref(inp)
        (y.float().square().sum() + aux.total_loss).backward()
        results.append(
            {
                "output": y,
                "grad_x": inp.grad,
                "grad_fc1_weight": ref.fc1_weight.grad,
                "grad_fc2_weight": ref.fc2_weight.grad,
            }
        )
    for stage, plain in results[0].items():
        reference = compare.host(plain)
        bound = compare._bound(compare.BOUNDS, stage, reference.dtype)
        result = compare.compare_stage(stage, compare.host(results[1][stage]), reference, bound)
        assert result.ok, result


# ------------------------------------------------------------------------------------ capacity
# The four capacity configs of tests/fixtures/megatron/make_megatron_fixtures.py (H=64, F=64,
# 144 tokens as B=2 sequences of S=72), as jaxmoe configs with their parameter dtype.
_CAPACITY_BF16 = dict(
    num_experts=8, top_k=2, ffn_hidden_size=64, capacity_factor=1.0, aux_loss_coeff=1e-2
)
CAPACITY_CONFIGS = {
    "capacity_probs_bf16": (dict(_CAPACITY_BF16, token_drop_policy="probs"), jnp.bfloat16),
    "capacity_position_bf16": (dict(_CAPACITY_BF16, token_drop_policy="position"), jnp.bfloat16),
    "capacity_position_padded_bf16": (
        dict(_CAPACITY_BF16, token_drop_policy="position", pad_expert_input_to_capacity=True),
        jnp.bfloat16,
    ),
    "capacity_sigmoid_groups_fp32": (
        dict(
            num_experts=16,
            top_k=4,
            ffn_hidden_size=64,
            score_function="sigmoid",
            enable_expert_bias=True,
            num_groups=4,
            group_topk=2,
            topk_scaling_factor=2.0,
            load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-3,
            z_loss_coeff=1e-3,
            capacity_factor=1.5,
            token_drop_policy="probs",
        ),
        jnp.float32,
    ),
}
CAPACITY_SHAPE = (2, 72)


def capacity_checkpoint(name: str, path) -> megatron.MegatronCheckpoint:
    """A jaxmoe.MoE of capacity config `name` with Megatron's random init (and a random expert
    bias), written by bridge.megatron.save and loaded back."""
    fields, dtype = CAPACITY_CONFIGS[name]
    moe = jaxmoe.MoE(jaxmoe.MoEConfig(**fields), 64, param_dtype=dtype, rngs=nnx.Rngs(0))
    if moe.router.expert_bias is not None:
        moe.router.expert_bias[...] = jax.random.normal(jax.random.key(1), (16,)) * 0.05
    megatron.save(moe, str(path))
    return megatron.load(str(path))


def megatron_style_recording(
    ckpt: megatron.MegatronCheckpoint, x_sbh: torch.Tensor, dy_sbh: torch.Tensor
) -> dict:
    """The io.pt that Megatron-Core 0.19.2 would record for this layer, emulated in PyTorch
    where capacity is concerned: tokens in Megatron's [S, B] order, `apply_router_token_dropping`
    (per expert the top-`capacity` tokens by dense probability or by routing_map over the token
    axis, the earlier token first among equals; with pad-to-capacity the capacity mask itself
    is the map, fillers included at probability 0) and SequentialMLP on each expert's tokens,
    fillers included. Scores and losses are the reference's (their semantics are not at stake
    here)."""
    config, weights = ckpt.config, ckpt.layer(0)
    seq, batch, hidden = x_sbh.shape
    num_tokens, num_experts, ffn = seq * batch, config.num_experts, config.ffn_hidden_size
    x = x_sbh.reshape(num_tokens, hidden).clone().requires_grad_(True)
    router_weight = weights.router_weight.clone().requires_grad_(True)
    fc1 = weights.fc1_weight.clone().requires_grad_(True)
    fc2 = weights.fc2_weight.clone().requires_grad_(True)
    logits = torch_reference.router_logits(
        x, router_weight, None, torch.float32 if config.router_dtype == "fp32" else x.dtype
    )
    probs, indices = torch_reference.topk_routing(logits, config, weights.expert_bias)
    dense_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    capacity = config.capacity(num_tokens)
    key = dense_probs if config.token_drop_policy == "probs" else routing_map.float()
    chosen = torch.sort(key.detach().float(), dim=0, descending=True, stable=True)[1][:capacity]
    capacity_mask = torch.zeros_like(routing_map).scatter(0, chosen, True)
    final_map = (
        capacity_mask if config.pad_expert_input_to_capacity else (routing_map & capacity_mask)
    )
    final_probs = dense_probs * final_map
    y = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for e in range(num_experts):
        tokens = final_map[:, e].nonzero()[:, 0]
        h = (x[tokens].float() @ fc1[e].float().T).to(x.dtype).float()
        a = (F.silu(h[:, :ffn]) * h[:, ffn:] * final_probs[tokens, e, None].float()).to(x.dtype)
        y = y.index_add(0, tokens, (a.float() @ fc2[e].float().T).to(x.dtype).float())
    y = y.to(x.dtype)
    logits_bs = logits.reshape(seq, batch, num_experts).transpose(0, 1).reshape(-1, num_experts)
    aux = torch_reference.load_balancing_loss(
        logits_bs, config, (batch, seq)
    ) + torch_reference.z_loss(logits, config.z_loss_coeff)
    ((y.float() * dy_sbh.reshape(num_tokens, hidden).float()).sum() + aux).backward()
    grads = {"router.weight": router_weight.grad}
    for e in range(num_experts):
        grads[f"experts.local_experts.{e}.linear_fc1.weight"] = fc1.grad[e]
        grads[f"experts.local_experts.{e}.linear_fc2.weight"] = fc2.grad[e]
    return dict(
        x=x_sbh,
        dy=dy_sbh,
        y=y.detach().reshape(seq, batch, hidden),
        dx=x.grad.reshape(seq, batch, hidden),
        param_grads=grads,
        router_probs=final_probs.detach(),
        routing_map=final_map,
    )


@pytest.mark.parametrize("name", sorted(CAPACITY_CONFIGS))
def test_compare_tool_with_capacity(name, tmp_path, capsys):
    """Checkpoints of the capacity fixture configs written by bridge.megatron.save, 144 seeded
    random tokens: jaxmoe and the reference keep the same pairs and every stage is in bounds
    (for the fp32 config this includes grad_fc1_weight, whose row-ULPs are unbounded, see
    bridge/README.md)."""
    capacity_checkpoint(name, tmp_path / "ckpt")
    out = tmp_path / "report.json"
    status, text = run_cli(
        [
            "compare",
            "--megatron",
            str(tmp_path / "ckpt"),
            "--layer",
            "0",
            "--shape",
            *map(str, CAPACITY_SHAPE),
            "--json",
            str(out),
        ],
        capsys,
    )
    assert status == 0, text
    report = json.loads(out.read_text())
    assert report["routing_exact"] and report["dropped_pairs"] > 0
    assert report["stages"]["kept"]["ok"] and report["stages"]["output"]["shape"] == [2, 72, 64]


@pytest.mark.parametrize("name", sorted(CAPACITY_CONFIGS))
def test_compare_tool_with_a_megatron_style_capacity_recording(name, tmp_path):
    """vs_megatron on an emulated Megatron recording (`megatron_style_recording`): jaxmoe's kept
    pairs equal Megatron's routing_map without its pad-to-capacity fillers, and y, dx and the
    gradients agree although Megatron runs the fillers through the experts. Under "position"
    ranking jaxmoe's [B, S] tokens batch-major (the old rule) would keep other tokens."""
    ckpt = capacity_checkpoint(name, tmp_path / "ckpt")
    config = ckpt.config
    generator = torch.Generator().manual_seed(3)
    dtype = ckpt.layer(0).fc1_weight.dtype
    x, dy = (
        torch.randn(CAPACITY_SHAPE[::-1] + (64,), generator=generator).to(dtype) for _ in range(2)
    )
    io = megatron_style_recording(ckpt, x, dy)
    report = compare.compare_layer(ckpt, 0, io=io)
    vs = report["vs_megatron"]
    assert vs["routing_exact"], vs["stages"]["routing_map"]
    assert vs["ok"] and report["ok"], {k: v for k, v in vs["stages"].items() if not v["ok"]}
    assert (vs["routing_fillers"] > 0) == config.pad_expert_input_to_capacity
    assert report["dropped_pairs"] > 0
    if config.token_drop_policy == "position":
        assert not np.array_equal(
            batch_major_pairs(ckpt, x), compare.megatron_routing_pairs(io, config)[0]
        )


def batch_major_pairs(ckpt: megatron.MegatronCheckpoint, x_sbh: torch.Tensor) -> np.ndarray:
    """The kept (token, expert) map [S*B, E] (rows in Megatron's order) that jaxmoe's layer 0
    would give x_sbh.transpose(0, 1) if capacity ranked its [B, S] tokens batch-major (the rule
    before Megatron's sequence-major order was adopted)."""
    seq, batch, hidden = x_sbh.shape
    config = ckpt.config
    moe = megatron.build_moe(ckpt, 0)
    logits = moe.router.logits(to_jax(x_sbh.transpose(0, 1).reshape(-1, hidden)))
    bias = None if moe.router.expert_bias is None else moe.router.expert_bias[...]
    routing = jax_routing.route(logits, config, bias)
    kept = compare._kept_map(
        np.asarray(routing.indices), np.asarray(routing.kept), config.num_experts
    )
    return kept.reshape(batch, seq, -1).transpose(1, 0, 2).reshape(seq * batch, -1)
