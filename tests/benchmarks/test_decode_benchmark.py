"""CPU smoke test of the decode benchmark (benchmarks/decode.py) at a tiny size, so that it
cannot rot between GPU runs: every implementation of both parts is timed at two token counts,
the weight-read floors follow from the active experts, and the JSON holds it all."""

import json

import pytest

from benchmarks import decode
from jaxmoe.shapes import TINY_SHAPES

TOKENS = (1, 8)
LAYER_IMPLS = {
    "jaxmoe_bf16",
    "jaxmoe_mxfp8",
    "jaxmoe_mxfp8_decode",
    "torch_grouped_mm_eager",
}  # no CUDA graph on CPU
GMM_IMPLS = {
    "gmm_bf16",
    "gmm_mxfp8_dequantize",
    "gmm_mxfp8_fused",
    "gmm_mxfp8_decode",
    "gmm_mxfp8_decode_small_scales",  # random normal weights: scale bytes far below 134
    "gmm_mxfp8_decode[tile_rows=8]",
    "gmm_mxfp8_decode[tile_rows=16,wg_n=64]",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    result = decode.main(
        [
            "--shapes",
            "tiny",
            "--tokens",
            ",".join(map(str, TOKENS)),
            "--copies",
            "2",
            "--repeats",
            "1",
            "--min-window",
            "0.001",
            "--decode-sweep",
            "tile_rows=8;tile_rows=16,wg_n=64",
            "--out",
            str(out),
        ]
    )
    with open(result["path"]) as f:
        assert json.load(f)["records"] == result["records"]
    return result


def test_every_implementation_is_timed_at_every_token_count(result):
    records = result["records"]
    assert all("error" not in r for r in records), [r for r in records if "error" in r]
    for part, impls in (("layer", LAYER_IMPLS), ("gmm", GMM_IMPLS)):
        for tokens in TOKENS:
            timed = {r["impl"] for r in records if (r["part"], r["tokens"]) == (part, tokens)}
            assert timed == impls
    assert all(r["us"] > 0 and len(r["us_runs"]) == 1 for r in records)
    assert {(s["part"], s["tokens"]) for s in result["summary"]} == {
        (p, t) for p in ("layer", "gmm") for t in TOKENS
    }


def test_floors_count_the_active_experts_weights(result):
    shape = TINY_SHAPES["tiny"]
    config = shape.config
    bandwidth = result["floor_bandwidth_bytes_per_s"]
    assert bandwidth == max(
        result["copy_bandwidth_bytes_per_s"], result["read_bandwidth_bytes_per_s"]
    )
    for r in result["records"]:
        assert 1 <= r["active_experts"] <= min(config.num_experts, r["tokens"] * config.top_k)
        precision = "mxfp8" if "mxfp8" in r["impl"] else "bf16"
        weights = r["active_experts"] * shape.hidden_size * 3 * config.ffn_hidden_size  # GLU
        per_weight = 2.0 if precision == "bf16" else 1 + 1 / 32
        assert r["floor_us"] == pytest.approx(weights * per_weight / bandwidth * 1e6)
        assert r["share_of_floor"] == pytest.approx(r["floor_us"] / r["us"])
        copy = result["copy_bandwidth_bytes_per_s"]
        assert r["copy_floor_us"] == pytest.approx(weights * per_weight / copy * 1e6)
        assert r["share_of_copy_floor"] == pytest.approx(r["copy_floor_us"] / r["us"])
        assert r["share_of_copy_floor"] >= r["share_of_floor"] * (1 - 1e-12)  # the lower rate


def test_summary_gives_both_ratios_where_device_time_was_measured():
    records = [
        dict(shape="s", tokens=64, part="layer", impl="jaxmoe_bf16", us=300.0, device_us=240.0),
        dict(shape="s", tokens=64, part="layer", impl="jaxmoe_mxfp8", us=200.0, device_us=160.0),
        dict(shape="s", tokens=8, part="gmm", impl="gmm_bf16", us=90.0),
        dict(shape="s", tokens=8, part="gmm", impl="gmm_mxfp8_decode", us=60.0),
    ]
    layer, gmm = sorted(decode.summarize(records), key=lambda s: s["part"] != "layer")
    assert layer["speedup_over_bf16"] == {"jaxmoe_mxfp8": 1.5}
    assert layer["device_speedup_over_bf16"] == {"jaxmoe_mxfp8": 1.5}
    assert gmm["speedup_over_bf16"] == {"gmm_mxfp8_decode": 1.5}
    assert "device_speedup_over_bf16" not in gmm


def test_the_gemm_scope_names_its_fusions_and_pallas_kernels_as_the_profiler_does():
    body = "jit(run)/while/body"
    hlo = "\n".join(  # lines as XLA writes them, shortened
        [
            f"  %input_reduce_fusion.1 = s32[3,220]{{1,0}} fusion(%a), kind=kInput, "
            f'metadata={{op_name="{body}/expert_gemm/reduce_sum" stack_frame_id=1}}',
            f"  %loop-add_fusion = f32[] fusion(%b), kind=kLoop, "
            f'metadata={{op_type="add" op_name="{body}/add"}}',
            f"  %mpmd_map.7 = bf16[512,1536]{{1,0}} custom-call(%c), "
            f'custom_call_target="mosaic_gpu_v2", '
            f'metadata={{op_name="{body}/expert_gemm/gmm_decode/mpmd_map"}}',
            "  ROOT %cumsum.3 = s32[9]{0} fusion(%d), kind=kLoop, "
            'metadata={op_type="cumsum" op_name="jit(run)/expert_gemm/cumsum"}',
        ]
    )
    assert decode.scoped_kernel_names(hlo, "expert_gemm") == {
        "input_reduce_fusion_1",
        "gmm_decode_mosaic_gpu_kernel",
        "cumsum_3",
    }
    # A module compiled here: the scope's ops are found, the others are not.
    import jax
    import jax.numpy as jnp

    def f(x):
        with jax.named_scope("expert_gemm"):
            y = jnp.cumsum(x * 3)
        return jnp.sum(jnp.sin(y))

    text = jax.jit(f).lower(jnp.ones(64)).compile().as_text()
    inside = decode.scoped_kernel_names(text, "expert_gemm")
    assert inside and inside < decode.scoped_kernel_names(text, "jit(f)")  # not the sum of sines
    assert not decode.scoped_kernel_names(text, "no_such_scope")


def test_the_layers_gemm_scopes_hold_the_routed_experts_gemms_alone():
    """The layer part's GEMM accounting (`gemm_us`) reads the fc1 and fc2 scopes: they hold the
    routed experts' matmuls and none of the shared expert's or the router's."""
    import re

    from jaxmoe.shapes import TINY_SHAPES

    shape = TINY_SHAPES["tiny_deepseek"]  # a shared expert beside the routed ones
    assert shape.config.shared_expert_intermediate_size
    candidates, _, _ = decode.layer_candidates(shape, tokens=8, copies=2, on_gpu=False)
    call = candidates["jaxmoe_bf16"]
    text = call.func.lower(*call.args).compile().as_text()
    dots = lambda names: {n for n in names if re.search(r"(dot|gemm)", n)}  # noqa: E731
    scoped = set().union(
        *(decode.scoped_kernel_names(text, s) for s in decode.GEMM_SCOPES["layer"])
    )
    routed = dots(scoped)
    everything = dots(decode.scoped_kernel_names(text, "jit(run)"))
    shared = dots(decode.scoped_kernel_names(text, "shared_expert"))
    assert routed and shared and not routed & shared
    assert routed < everything  # the router's and the shared expert's matmuls are left out


def test_the_layer_part_builds_only_the_implementations_asked_for():
    """`--impls` limits which layers the part stacks copies of (on an 80 GB GPU all of them at
    mixtral's size did not fit); the torch MoE, which reads the bf16 layer's copies in place,
    counts the experts its own router picks."""
    shape = TINY_SHAPES["tiny"]
    only, active, own = decode.layer_candidates(shape, 8, 2, False, frozenset({"jaxmoe_mxfp8"}))
    assert set(only) == {"jaxmoe_mxfp8"} and own == {} and active >= 1
    both, active_both, own = decode.layer_candidates(
        shape, 8, 2, False, frozenset({"jaxmoe_bf16", "torch_grouped_mm_eager"})
    )
    assert set(both) == {"jaxmoe_bf16", "torch_grouped_mm_eager"}
    assert active_both == active and set(own) == {"torch_grouped_mm_eager"}
    assert 1 <= own["torch_grouped_mm_eager"] <= shape.config.num_experts
