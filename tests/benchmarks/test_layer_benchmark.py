"""CPU smoke test of the layer benchmark (benchmarks/layer.py) at tiny sizes, so that it cannot
rot between GPU runs: the whole script on a DeepSeek-like layer's train step (jaxmoe, the
plain-JAX and the eager PyTorch competitor; torch.compile is left out: dynamo's start-up alone
takes about as long as the rest of this test on a 2-core machine), the inference outputs of the
competitors with softmax routing against jaxmoe's, and the stage attribution of GPU-style
profile records."""

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
import torch

from benchmarks import layer
from benchmarks.layer_competitors import jax_moe, torch_moe
from benchmarks.layer_stages import idle_gaps, stage_breakdown
from benchmarks.timing import TraceEvent

# bf16 outputs and gradients summed in other orders (fp32 accumulation, one bf16 rounding per
# stage). With an fp32 router (DeepSeek-like) the routing agrees exactly; bf16 logits (the
# Mixtral-like layer) may round differently and flip near-tied experts of a few tokens.
REL_TOLERANCE = 2e-2
MAX_ROUTING_MISMATCH = 0.1
IMPLS = ("jaxmoe_bf16", "jax_ragged_dot", "torch_grouped_mm", "dense_gemms")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer")
    layer.main(
        [
            "--shapes",
            "tiny_deepseek",
            "--modes",
            "train",
            "--impls",
            ",".join(IMPLS),
            "--min-window",
            "0.01",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    [path] = glob.glob(str(out / "layer_*[0-9].json"))
    with open(path) as f:
        result = json.load(f)
    with open(path.replace(".json", "_kernels.json")) as f:
        kernels = json.load(f)
    return result, kernels


def test_every_implementation_is_timed(run):
    result, _ = run
    assert not result["errors"]
    records = {(r["mode"], r["impl"]): r for r in result["records"]}
    assert set(records) == {("train", impl) for impl in IMPLS}
    for record in records.values():
        assert "error" not in record, record
        assert record["ms"] > 0 and len(record["ms_runs"]) == 2 and min(record["ms_runs"]) > 0
        assert record["tokens_per_s"] > 0 and record["expert_tflops"] > 0
    [summary] = result["summary"]
    assert set(summary["speedup"]) == set(IMPLS) - {layer.REFERENCE}
    ratio = records[("train", "torch_grouped_mm")]["ms"] / records[("train", "dense_gemms")]["ms"]
    assert summary["dense_gemms_over_torch"] == pytest.approx(ratio)
    # The non-GEMM floor: the stage bytes at the run's higher measured bandwidth, and its share
    # beside the profiled GEMM time.
    bandwidth = max(result["bandwidth_bytes_per_s"].values())
    stage_bytes = result["shapes"]["tiny_deepseek"]["unfused_stage_bytes"]["train"]
    floor_ms = sum(stage_bytes.values()) / bandwidth * 1e3
    assert summary["non_gemm_floor_ms"] == pytest.approx(floor_ms)
    [breakdown] = result["stages"]
    share = floor_ms / (breakdown["gemm_ms"] + floor_ms)
    assert summary["non_gemm_floor_share"] == pytest.approx(share) and 0 < share < 1


def test_cached_weights_give_the_same_step(tmp_path):
    """The step on fp8 expert copies made beforehand (`MoE.quantize_expert_weights`) computes
    what the step quantizing them itself does: the same deviations from jaxmoe_bf16, to the
    last bit."""
    impls = ("jaxmoe_bf16", "jaxmoe_mxfp8", "jaxmoe_mxfp8_cached_weights")
    layer.main(
        ["--shapes", "tiny", "--modes", "train", "--impls", ",".join(impls), "--no-profile"]
        + ["--min-window", "0.01", "--repeats", "1", "--out", str(tmp_path)]
    )
    [path] = glob.glob(str(tmp_path / "layer_*[0-9].json"))
    with open(path) as f:
        records = {r["impl"]: r for r in json.load(f)["records"]}
    assert all(records[impl]["ms"] > 0 for impl in impls)
    errors = [records[impl]["max_rel_error"] for impl in impls[1:]]
    assert errors[0] > 0 and errors[0] == errors[1]


def test_unfused_stage_bytes_count_each_pass_once():
    """qwen3_30b: T = 8192 tokens, H = 2048, F = 768 (GLU: F1 = 1536), top-8: M = 65536 rows."""
    t, h, f, f1, m = 8192, 2048, 768, 1536, 65536
    shape = layer.SHAPES["qwen3_30b"]
    assert (shape.num_tokens, shape.hidden_size, shape.config.top_k) == (t, h, 8)
    assert (shape.config.ffn_hidden_size, shape.config.fc1_output_size) == (f, f1)
    forward = dict(dispatch=2 * (t * h + m * h), activation=2 * (m * f1 + m * f))
    forward["combine"] = forward["dispatch"]
    assert layer.unfused_stage_bytes(shape, "inference") == forward
    train = layer.unfused_stage_bytes(shape, "train")
    assert train["dispatch"] == train["combine"] == 2 * forward["dispatch"]
    assert train["activation"] == forward["activation"] + 2 * (2 * m * f1 + m * f)


def test_competitors_match_jaxmoe(run):
    result, _ = run
    for record in result["records"]:
        if record["impl"] in (layer.REFERENCE, *layer.UNCHECKED):
            assert "rel_error" not in record
            continue
        assert set(record["rel_error"]) == {
            "dx",
            "router.kernel",
            "experts.fc1_kernel",
            "experts.fc2_kernel",
            "shared_experts.fc1_kernel",
            "shared_experts.fc2_kernel",
            "shared_experts.gate_kernel",
        }, record
        assert record["max_rel_error"] < REL_TOLERANCE, record


def test_stage_breakdown_from_cpu_profile(run):
    result, kernels = run
    [breakdown] = result["stages"]
    assert (breakdown["mode"], breakdown["impl"]) == ("train", layer.REFERENCE)
    stages = breakdown["stages"]
    assert set(breakdown["matched_by"]) == {"hlo_op"}
    for stage in (
        "router",
        "plan",
        "dispatch",
        "fc1",
        "activation",
        "fc2",
        "combine",
        "shared_expert",
        "aux_losses",
    ):
        assert stages[stage]["ms"] > 0, stage
    for stage in ("router", "fc1", "fc2", "shared_expert"):
        assert stages[stage]["gemm_ms"] > 0, stage
    assert stages["fc1"]["bwd_ms"] > 0 and stages["fc1"]["fwd_ms"] > 0
    assert stages.get("unattributed", {}).get("share", 0) < 0.05
    assert breakdown["device_ms"] == pytest.approx(sum(s["ms"] for s in stages.values()))
    dump = kernels[f"tiny_deepseek/train/{layer.REFERENCE}"]
    assert "hlo_op" in dump["record_arg_names"]
    assert len(dump["kernels"]) == pytest.approx(breakdown["kernels_per_step"], abs=1)


def test_inference_outputs_of_softmax_competitors_match_jaxmoe():
    shape = layer.TINY_SHAPES["tiny"]
    config, tokens = shape.config, shape.num_tokens
    graphdef, (params, rest) = layer.jaxmoe_graphdef(shape, None), layer.init_weights(shape)
    x = jax.random.normal(
        jax.random.key(1), (shape.batch, shape.seq_len, shape.hidden_size), jnp.bfloat16
    )
    reference = layer.comparable(
        jax.jit(layer.jaxmoe_forward, static_argnums=0)(graphdef, params, rest, x),
        "inference",
        tokens,
    )
    indices = jax.jit(layer.jaxmoe_routing, static_argnums=0)(graphdef, params, rest, x)
    weights, x_tokens = layer.flat_arrays(params), x.reshape(tokens, -1)
    outputs = {
        "jax_ragged_dot": jax.jit(jax_moe, static_argnums=(2, 3))(
            weights, x_tokens, config, shape.seq_len
        ),
        "torch_grouped_mm": torch_moe(
            {k: torch.from_dlpack(v) for k, v in weights.items()},
            torch.from_dlpack(x_tokens),
            config,
            shape.seq_len,
        ),
    }
    for impl, out in outputs.items():
        check = layer.compare(layer.comparable(out, "inference", tokens), reference, indices)
        errors = check["rel_error"]
        assert set(errors) == {"y", "aux_loss", "y_routed_alike"}, impl
        assert max(errors["y_routed_alike"], errors["aux_loss"]) < REL_TOLERANCE, (impl, check)
        assert check["routing_mismatch"] <= MAX_ROUTING_MISMATCH, (impl, check)


GPU_STYLE_HLO = """HloModule jit_train, is_scheduled=true

%fused_dot (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %custom-call.3 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(fc1)/body/mpmd_map"}
  %custom-call.4 = (f8e4m3fn[64,64]{1,0}, u8[64,2]{1,0}) custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(dispatch)/body/mpmd_map"}
  %triton_gemm.2 = bf16[64,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train)/transpose(jvp(router))/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %loop_add_fusion.7 = bf16[64,64]{1,0} add(%a, %b), metadata={op_name="jit(train)/transpose(jvp(combine))/add"}
}
"""


def test_stage_attribution_of_gpu_style_records():
    def record(kernel, dur_us, start_us, **args):
        return TraceEvent(
            "/device:GPU:0",
            "Stream #14(Kernel)",
            kernel,
            start_us,
            dur_us,
            {"hlo_module": "jit_train", **args},
        )

    events = [
        record("body_mosaic_gpu_kernel", 100.0, 0.0, hlo_op="custom-call.3"),
        record("body_mosaic_gpu_kernel", 10.0, 100.0, hlo_op="custom-call.4"),
        record("triton_gemm_2", 30.0, 110.0),  # matched by kernel name
        record("loop_add_fusion_7", 5.0, 140.0, hlo_op="loop_add_fusion.7"),
        record(
            "some_kernel", 5.0, 145.0, name="transpose(jvp(plan))/sort", prefix="jit(train)"
        ),  # the record's own op name
        record("other_module_kernel", 50.0, 150.0, hlo_module="jit_other"),
        TraceEvent("/host:CPU", "python", "host work", 0.0, 500.0, {}),
    ]
    summary, rows = stage_breakdown(events, GPU_STYLE_HLO, steps=1)
    stages = summary["stages"]
    assert summary["device_ms"] == pytest.approx(0.150)
    assert stages["fc1"]["gemm_ms"] == pytest.approx(0.100) and stages["fc1"]["bwd_ms"] == 0
    assert stages["dispatch"]["quantize_ms"] == pytest.approx(0.010)
    assert stages["router"]["gemm_ms"] == pytest.approx(0.030)
    assert stages["router"]["bwd_ms"] == pytest.approx(0.030)
    assert stages["combine"]["other_ms"] == pytest.approx(0.005)
    assert stages["plan"]["bwd_ms"] == pytest.approx(0.005)
    assert summary["non_gemm_ms"] == pytest.approx(0.020)
    assert summary["matched_by"] == {"hlo_op": 3, "kernel_name": 1, "record_op_name": 1}
    assert [r.kernel for r in rows][:2] == ["body_mosaic_gpu_kernel"] * 2


def test_idle_gaps_name_the_kernels_around_them_and_the_host_work_inside():
    """Gaps between device records, longest first; an overlapping record does not open one;
    host records ending inside a gap are listed, others not."""
    gpu = lambda name, start, dur: TraceEvent("/device:GPU:0", "Stream #14", name, start, dur, {})
    host = lambda name, start, dur: TraceEvent("/host:CPU", "t", name, start, dur, {})
    device = [gpu("a", 0.0, 10.0), gpu("b", 5.0, 2.0), gpu("c", 12.0, 3.0), gpu("d", 40.0, 1.0)]
    events = device + [host("launch", 20.0, 15.0), host("early", 0.0, 5.0), host("late", 39.0, 5.0)]
    gaps = idle_gaps(events, device)
    assert [(g["gap_us"], g["after_kernel"], g["before_kernel"]) for g in gaps] == [
        (25.0, "c", "d"),
        (2.0, "a", "c"),
    ]
    assert [h["name"] for h in gaps[0]["host_records_ending_inside"]] == ["launch"]
    assert gaps[1]["host_records_ending_inside"] == []


COMMAND_BUFFER_HLO = """HloModule jit_train, is_scheduled=true

%command_buffer.5 (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %custom-call.1 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(fc1)/gmm/mpmd_map"}
  %loop_add_fusion.2 = bf16[64,64]{1,0} add(%a, %b), metadata={op_name="jit(train)/jvp(activation)/add"}
  ROOT %custom-call.3 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/transpose(jvp(fc2))/gmm/mpmd_map"}
}

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  ROOT %call.6 = bf16[64,64]{1,0} call(%a, %b), to_apply=%command_buffer.5
}
"""


def test_kernels_inside_a_command_buffer_are_attributed_in_order():
    """Kernels of a CUDA graph carry the buffer's name as hlo_op: XLA kernels are found by
    name, Pallas kernels by their order among the buffer's Mosaic GPU calls, step after step."""

    def record(kernel, start_us):
        return TraceEvent(
            "/device:GPU:0",
            "Stream #14(Kernel)",
            kernel,
            start_us,
            10.0,
            {"hlo_module": "jit_train", "hlo_op": "command_buffer_5"},
        )

    events = [
        record(kernel, 100.0 * step + offset)
        for step in range(2)
        for kernel, offset in (
            ("gmm_mosaic_gpu_kernel", 0),
            ("loop_add_fusion_2", 10),
            ("gmm_mosaic_gpu_kernel", 20),
        )
    ]
    summary, rows = stage_breakdown(events, COMMAND_BUFFER_HLO, steps=2)
    assert [(r.stage, r.backward, r.kind) for r in rows] == [
        ("fc1", False, "gemm"),
        ("activation", False, "other"),
        ("fc2", True, "gemm"),
    ]
    assert summary["matched_by"] == {"schedule_order": 4, "kernel_name": 2}
    assert summary["non_gemm_ms"] == pytest.approx(0.010)


SCHEDULED_HLO = """HloModule jit_train, is_scheduled=true

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %mpmd_map.9 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(router)/gmm/mpmd_map"}
  %mpmd_map.10 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(fc1)/gmm/mpmd_map"}
  %loop_add_fusion.2 = bf16[64,64]{1,0} add(%a, %b), metadata={op_name="jit(train)/jvp(activation)/add"}
  %mpmd_map.11 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/jvp(combine)/combine/mpmd_map"}
  ROOT %mpmd_map.12 = bf16[64,64]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train)/transpose(jvp(fc2))/gmm/mpmd_map"}
}
"""


def test_kernels_of_buffers_missing_from_the_text_follow_the_schedule():
    """On the GPU the compiled module's text shows no command-buffer computation: a Pallas
    record naming an unknown buffer is the scheduled Mosaic call after the last one seen (one
    matched by its own hlo_op moves the cursor), step after step."""

    def record(kernel, start_us, hlo_op="command_buffer_48"):
        return TraceEvent(
            "/device:GPU:0",
            "Stream #14(Kernel)",
            kernel,
            start_us,
            10.0,
            {"hlo_module": "jit_train", "hlo_op": hlo_op},
        )

    events = []
    for step in range(2):
        t = 100.0 * step
        events += [
            record("gmm_mosaic_gpu_kernel", t),
            record("gmm_mosaic_gpu_kernel", t + 10, hlo_op="mpmd_map.10"),
            record("loop_add_fusion_2", t + 20),
            record("combine_mosaic_gpu_kernel", t + 30),
            record("gmm_mosaic_gpu_kernel", t + 40),
        ]
    summary, rows = stage_breakdown(events, SCHEDULED_HLO, steps=2)
    assert [(r.stage, r.backward, r.kind) for r in rows] == [
        ("router", False, "gemm"),
        ("fc1", False, "gemm"),
        ("activation", False, "other"),
        ("combine", False, "other"),
        ("fc2", True, "gemm"),
    ]
    assert summary["matched_by"] == {"schedule_order": 6, "hlo_op": 2, "kernel_name": 2}


def test_every_named_pallas_kernel_has_a_kind():
    """A jaxmoe kernel missing from PALLAS_KERNEL_KINDS is classed by its output type (a
    bf16-writing one as a GEMM), which misstates the non-GEMM share."""
    from benchmarks.layer_stages import PALLAS_KERNEL_KINDS

    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "jaxmoe", "ops", "pallas"
    )
    names = set()
    for path in glob.glob(os.path.join(root, "*.py")):
        with open(path) as f:
            names.update(re.findall(r'kernel_name=\(?"(\w+)"', f.read()))
    assert "weighted_swiglu_backward" in names and "dispatch" in names  # the scan finds them
    assert names <= set(PALLAS_KERNEL_KINDS), names - set(PALLAS_KERNEL_KINDS)
