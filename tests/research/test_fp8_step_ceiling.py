"""benchmarks/research/fp8_step_ceiling.py on a synthetic layer benchmark file whose bounds are worked
out by hand, and on a real one from benchmarks/results."""

import json
import os

import pytest

from benchmarks.research import fp8_step_ceiling as ceiling

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks", "results"
)
TARGETS = dict(fprop=1.7, dgrad=1.7, wgrad=1.45)  # the script's defaults
SHAPE = dict(num_experts=2, hidden=1000, ffn_hidden_size=500, gated_linear_unit=True)


def kernel(name, stage, backward, us, kind="gemm"):
    return dict(kernel=name, stage=stage, backward=backward, kind=kind, dur_us=us)


def write_layer(tmp_path, fp8_wgrad_us=3000.0):
    """bf16: fprop 4 + dgrad 4 + wgrad 4 + rest 1 = 13 ms; FP8: 2 + 2 + wgrad + weights'
    quantize 1 + rest 2; cached: the same without the quantize. Each variant's profiled step
    took twice its mean device time (the scaling halves it back)."""
    tmp_path.mkdir(exist_ok=True)

    def step(fprop, dgrad, wgrad, quantize, rest, gemm="gmm", tgmm="tgmm"):
        rows = [
            kernel(f"{gemm}_mosaic_gpu_kernel", "fc1", False, 2 * fprop * 0.75),
            kernel(f"{gemm}_mosaic_gpu_kernel", "fc2", False, 2 * fprop * 0.25),
            kernel(f"{gemm}_mosaic_gpu_kernel", "fc1", True, 2 * dgrad),
            kernel(f"{tgmm}_mosaic_gpu_kernel", "fc2", True, 2 * wgrad),
            # the router's GEMM and an activation kernel are the rest
            kernel("gmm_mosaic_gpu_kernel", "router", False, 2 * rest / 2),
            kernel("activation_kernel", "activation", True, 2 * rest / 2, kind="other"),
        ]
        if quantize:
            rows.append(
                kernel("quantize_128x128_transpose_kernel", "fc1", False, 2 * quantize, "quantize")
            )
        return rows

    variants = {
        "jaxmoe_bf16": step(4000, 4000, 4000, 0, 1000),
        "jaxmoe_fp8_blockwise": step(2000, 2000, fp8_wgrad_us, 1000, 2000, "gmm_fp8", "tgmm_fp8"),
        "jaxmoe_fp8_blockwise_cached_weights": step(
            2000, 2000, fp8_wgrad_us, 0, 2000, "gmm_fp8", "tgmm_fp8"
        ),
    }
    layer = dict(
        device="test",
        date="2026-12-06",
        shapes={"s": SHAPE},
        bandwidth_bytes_per_s=dict(copy=4e12, read=3e12),
        stages=[
            dict(shape="s", mode="train", impl=impl, device_ms=sum(r["dur_us"] for r in rows) / 2e3)
            for impl, rows in variants.items()
        ],
    )
    path = tmp_path / "layer_x.json"
    path.write_text(json.dumps(layer))
    (tmp_path / "layer_x_kernels.json").write_text(
        json.dumps({f"s/train/{impl}": dict(kernels=rows) for impl, rows in variants.items()})
    )
    return str(path)


def test_bounds_of_a_synthetic_step(tmp_path):
    result = ceiling.main([write_layer(tmp_path), "--out", str(tmp_path / "out")])
    r = result["shapes"]["s"]
    assert r["parts_ms"]["bf16"] == pytest.approx(
        dict(fprop=4, dgrad=4, wgrad=4, weight_quantize=0, rest=1)
    )
    assert r["parts_ms"]["fp8"] == pytest.approx(
        dict(fprop=2, dgrad=2, wgrad=3, weight_quantize=1, rest=2)
    )
    assert r["measured_speedup"] == pytest.approx(dict(uncached=13 / 10, cached=13 / 9))
    assert r["rest_by_stage_ms"]["bf16"] == pytest.approx(
        {"router forward": 0.5, "activation backward": 0.5}
    )
    assert r["rest_by_stage_ms"]["fp8"] == pytest.approx(
        {"router forward": 1.0, "activation backward": 1.0}
    )
    assert r["rest_excess_over_bf16_ms"]["cached"] == pytest.approx(
        {"router forward": 0.5, "activation backward": 0.5}
    )
    elements = 2 * 1000 * (1000 + 500)
    quantize = dict(
        measured=1.0,
        copy_floor=elements * 4 / 4e12 * 1e3,
        read_only_floor=elements * 2 / 3e12 * 1e3,
        cached=0.0,
    )
    assert r["weight_quantize_ms"] == pytest.approx(quantize)
    targets_ms = 4 / 1.7 + 4 / 1.7 + 4 / 1.45
    for gemm, gemm_ms in (("measured", 7.0), ("targets", targets_ms)):
        assert r["ceiling_speedup"][gemm] == pytest.approx(
            {k: 13 / (gemm_ms + q + 1) for k, q in quantize.items()}
        )
    written = json.loads((tmp_path / "out").joinpath(os.listdir(tmp_path / "out")[0]).read_text())
    assert written["shapes"]["s"]["ceiling_speedup"] == r["ceiling_speedup"]


def test_a_slower_fp8_pass_lowers_the_measured_ceiling_alone(tmp_path):
    fast = ceiling.analyse(write_layer(tmp_path / "a"), TARGETS)
    slow = ceiling.analyse(write_layer(tmp_path / "b", fp8_wgrad_us=4000.0), TARGETS)
    assert (
        slow["s"]["ceiling_speedup"]["measured"]["cached"]
        < fast["s"]["ceiling_speedup"]["measured"]["cached"]
    )
    assert slow["s"]["ceiling_speedup"]["targets"] == fast["s"]["ceiling_speedup"]["targets"]


def test_a_file_without_the_fp8_variants_is_refused(tmp_path):
    path = write_layer(tmp_path)
    layer = json.loads(open(path).read())
    layer["stages"] = [s for s in layer["stages"] if s["impl"] == "jaxmoe_bf16"]
    open(path, "w").write(json.dumps(layer))
    with pytest.raises(ValueError, match="no train stage records"):
        ceiling.analyse(path, TARGETS)


def test_the_committed_h100_step_is_below_its_ceilings():
    path = os.path.join(RESULTS, "layer_2026-12-06_s57_h100.json")
    r = ceiling.analyse(path, TARGETS)["mixtral"]
    device = {name: sum(p.values()) for name, p in r["parts_ms"].items()}
    assert device["bf16"] == pytest.approx(25.371, abs=1e-3)  # the stage record's mean
    assert r["measured_speedup"]["cached"] < r["ceiling_speedup"]["measured"]["cached"]
    assert r["measured_speedup"]["uncached"] < r["ceiling_speedup"]["measured"]["measured"]
    # the rest's excess over bf16's, by stage, adds up to the rest's
    excess = r["rest_excess_over_bf16_ms"]["cached"]
    rest = {name: p["rest"] for name, p in r["parts_ms"].items()}
    assert sum(excess.values()) == pytest.approx(rest["cached"] - rest["bf16"])
    assert list(excess.values()) == sorted(excess.values(), reverse=True)
