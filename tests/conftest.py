"""Shared pytest set-up.

* Tests marked `gpu` need a Hopper GPU and are skipped elsewhere, except the layer suite
  (tests/gpu/test_gpu_layer.py) when `--layer-shapes tiny` runs it on CPU (the kernels in the
  interpreter) to check the suite itself.
* The `interpret` fixture runs Pallas Mosaic GPU kernels on CPU, each call race-checked; tests
  that use it are marked `slow` (`make test-quick` leaves them out).
* Eight host devices (`--xla_force_host_platform_device_count=8`) for meshes on CPU.
* On CPU, compiled programs are cached in .pytest_cache/jax and shared by the workers.
* `FURTHER_CASES`: further cases of tested properties, marked `exhaustive` (`make test-all`).
* `--results-json PATH` writes every test's outcome, duration and recorded properties
  (`record_property`) with the device and versions to PATH: the GPU suite's record
  (`make test-gpu`).
"""

import datetime
import json
import os
import platform

# Eight host (CPU) devices for the expert-parallel tests' meshes; everything else runs on the
# first. XLA reads the flag when JAX starts, so it is set before JAX is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from benchmarks.report import git_commit  # noqa: E402
from jaxmoe.ops import on_hopper  # noqa: E402

from interpreter import race_checked_interpreter  # noqa: E402

# On CPU, XLA's compilations (5-30 s for a kernel in the interpreter) are cached on disk and shared
# by the test processes: a kernel or layer program that several tests build compiles once a run.
# Not on a GPU, where the suite checks that separately compiled executables agree.
if not on_hopper():
    jax.config.update(
        "jax_compilation_cache_dir",
        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax"),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_addoption(parser):
    parser.addoption(
        "--results-json",
        default=None,
        help="write test outcomes, durations and recorded properties to this JSON",
    )
    parser.addoption(
        "--layer-shapes",
        default="mixtral,qwen3_30b,dsv3_ep8,deepseek_v3_style",
        help="tests/gpu/test_gpu_layer.py: comma-separated jaxmoe.shapes names, or "
        "'tiny' (a small layer, runnable on CPU with the kernels interpreted)",
    )
    parser.addoption(
        "--layer-precisions",
        default="bf16,mxfp8",
        help="tests/gpu/test_gpu_layer.py: comma-separated precisions (bf16, mxfp8, fp8_blockwise)",
    )


@pytest.fixture
def interpret():
    """Run Mosaic GPU kernels in the CPU interpreter with the race detector, every kernel call
    of the test checked (tests/support/interpreter.py); a no-op on a GPU."""
    if on_hopper():
        yield
        return
    with race_checked_interpreter():
        yield


# Further cases of properties that `make test` checks on other cases (more dtypes, shapes, kernel
# configurations of the same kernel in the interpreter): marked `exhaustive`, so that only
# `make test-all` runs them and CI stays within its time (each interpreted kernel instance
# costs 5-30 s of XLA:CPU compilation there). Node ids relative to tests/.
FURTHER_CASES = frozenset(
    {
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape4-37-bfloat16]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape4-37-float32]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape5-45-bfloat16]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape5-45-float32]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape6-45-bfloat16]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[gather-shape6-45-float32]",
        "kernels/test_quantize_pallas.py::test_float_arithmetic_equals_the_reference_on_normal_values"
        "[gather-e5m2]",
        "kernels/test_quantize_pallas.py::test_dispatch_quantize_equals_quantize_of_the_gathered_rows"
        "[e5m2]",
        "kernels/test_quantize_pallas.py::test_long_pipelines_reuse_every_slot[columnwise-float32]",
        "kernels/test_quantize_pallas.py::test_long_pipelines_reuse_every_slot[rowwise-float32]",
        "kernels/test_quantize_pallas.py::test_long_pipelines_reuse_every_slot[gather-float32]",
        "kernels/test_quantize_pallas.py::test_long_pipelines_reuse_every_slot[fake_gather-float32]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[fake_gather-shape8-37-float32]",
        "kernels/test_quantize_pallas.py::test_partial_tiles[fake_gather-shape9-9-float32]",
        "kernels/test_quantize_pallas.py::test_float_arithmetic_equals_the_reference_on_normal_values"
        "[fake_gather-e5m2]",
        "kernels/test_quantize_1x128_pallas.py::test_partial_tiles[gather-shape2-37-bfloat16]",
        "kernels/test_quantize_1x128_pallas.py::test_partial_tiles[gather-shape2-37-float32]",
        "kernels/test_quantize_1x128_pallas.py::test_partial_tiles[gather-shape3-45-float32]",
        "kernels/test_quantize_1x128_pallas.py::test_partial_tiles[gather-shape4-9-bfloat16]",
        "kernels/test_quantize_1x128_pallas.py::test_partial_tiles[gather-shape4-9-float32]",
        "kernels/test_quantize_1x128_pallas.py::test_kernels_equal_the_reference_bitwise[gather-bf16-e5m2]",
        "kernels/test_swiglu_quantize_pallas.py::test_copies_equal_the_reference_bitwise[1]",
        "kernels/test_swiglu_backward_quantize_pallas.py::"
        "test_copies_and_partial_sums_equal_the_two_kernels_bitwise[1]",
        "kernels/test_swiglu_backward_quantize_pallas.py::test_e5m2_and_float_arithmetic",
        "kernels/test_gmm_pallas.py::test_lowering_for_hopper_is_as_fast_for_256_experts_as_for_8",
        "kernels/test_gmm_pallas.py::test_cluster_pairs_match_xla[dgrad_layout]",
        "kernels/test_gmm_pallas.py::test_wgrad_structure_ring_reuse_boundaries_and_nan_isolation"
        "[split_n_overlap_epilogue_epi2]",
        "kernels/test_gmm_pallas.py::test_wgrad_structure_ring_reuse_boundaries_and_nan_isolation"
        "[split_k_ring2_epi2]",
        "kernels/test_gmm_pallas.py::test_wgrad_structure_ring_reuse_boundaries_and_nan_isolation"
        "[split_n_32wide]",
        "kernels/test_gmm_pallas.py::test_wgrad_structure_ring_reuse_boundaries_and_nan_isolation"
        "[split_k_128wide_ring4]",
        "kernels/test_gmm_pallas.py::test_forward_matches_xla[dgrad_layout-tiny_groups]",
        "kernels/test_gmm_pallas.py::test_forward_matches_xla[dgrad_layout-all_in_one]",
        "kernels/test_gmm_mxfp8_pallas.py::test_lowering_at_real_shapes[mixtral_decode-fused_dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_lowering_at_real_shapes[mixtral-fused_dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_lowering_at_real_shapes[dsv3-fused_dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_forward_matches_dequantized_reference"
        "[tiny_groups-fused_dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_forward_matches_dequantized_reference"
        "[ragged_tail_and_empty-fused_dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_forward_matches_dequantized_reference"
        "[tiny_groups-fp8_wgmma]",
        "kernels/test_gmm_mxfp8_pallas.py::test_forward_matches_dequantized_reference"
        "[tiny_groups-dequantize]",
        "kernels/test_gmm_mxfp8_pallas.py::test_forward_matches_dequantized_reference"
        "[ragged_tail_and_empty-dequantize]",
        "ops/test_permute.py::test_layer_dispatch_and_combine_are_each_others_transpose",
        "research/test_router_benchmark.py::test_router_benchmark_times_every_config_with_the_same_bits"
        "[every]",
        "ops/test_dense.py::test_host_group_sizes_give_the_bits_of_traced_ones[64]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_equals_the_reference_on_exact_operands"
        "[l2_scales_split_n]",
        "gpu/test_gpu_expert_parallel_tiny.py::test_same_bits_at_ep_1_and_2[deepseek_v3_style-bf16]",
        *(
            "kernels/test_tiles.py::test_banded_items_are_the_banded_order_stably_partitioned_by_kind"
            f"[{seed}]"
            for seed in range(4, 8)
        ),
        "ops/test_permute.py::test_dispatch_kernel_equals_the_reference[float32-16-64-40]",
        "ops/test_permute.py::test_dispatch_kernel_equals_the_reference[float16-24-256-173]",
        "ops/test_permute.py::test_combine_kernel_equals_the_reference[bfloat16-float32-24-4-1024-100]",
        "ops/test_permute.py::test_combine_kernel_equals_the_reference[float32-bfloat16-9-8-512-300]",
        "ops/test_permute.py::test_combine_kernel_equals_the_reference[float32-float32-9-3-32-20]",
        "ops/test_dense.py::test_kernel_matches_xla[37-128-16-float32]",
        "ops/test_dense.py::test_kernel_matches_xla[200-96-64-bfloat16]",
        "ops/test_groups_per_weight.py::test_shared_matrices_equal_repeated_ones[pallas-bf16-bf16_rhs]",
        "parallel/test_expert_parallel.py::test_parameter_gradients_are_the_ranks_single_device_gradients"
        "_summed_in_order[mxfp8]",
        "parallel/test_expert_parallel.py::test_parameter_gradients_are_the_ranks_single_device_gradients"
        "_summed_in_order[mxfp8_experts]",
        "parallel/test_expert_parallel.py::test_blockwise_experts_same_bits_at_every_degree",
        "parallel/test_expert_parallel.py::test_parameter_gradients_agree_with_one_device_within_rounding",
        "layer/test_mxfp8_layer.py::test_training_forward_equals_inference_forward[squared_relu-False]",
        "layer/test_fp8_blockwise_layer.py::test_blockwise_experts_with_a_blockwise_wire"
        "[combine_bwd_dtype-no_bias]",
        "layer/test_fp8_blockwise_layer.py::test_blockwise_experts_with_a_blockwise_wire"
        "[dispatch_dtype-bias]",
        "layer/test_mxfp8_inference.py::test_inference_forward_is_the_training_forward_at_any_batch"
        "[bf16]",
        "layer/test_mxfp8_layer.py::test_gradients_equal_the_dequantize_then_bf16_reference_bitwise"
        "[False]",
        "layer/test_fp8_blockwise_layer.py::test_weights_quantized_once_per_step_give_the_same_bits",
        "bridge/test_bridge_reference.py::test_whole_layer_stages_within_bounds[fp32]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_equals_the_reference_on_exact_operands[split_k]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_equals_the_reference_on_exact_operands[banded]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_equals_the_reference_on_exact_operands[pairs]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_equals_the_reference_on_exact_operands"
        "[l2_banded_pairs]",
        "numerics/test_fp8_blockwise.py::test_wgrad_kernel_lowers_at_real_shapes[l2_banded_pairs]",
        # The research and profiling scripts' full runs (their parsing and one run of each stay);
        # the kernels they drive are tested in tests/kernels.
        "research/test_activation_benchmark.py::"
        "test_activation_benchmark_runs_and_records_every_layout",
        "research/test_gmm_fp8_blockwise_tiling_benchmark.py::test_tilings_give_the_heuristics_bits",
        "research/test_gmm_mxfp8_benchmark.py::test_transposing_kernels_run_with_each_config",
        "research/test_wire_gather_benchmark.py::"
        "test_wire_gather_benchmark_times_every_route_with_the_same_bits",
        "kernels/test_copies_pipeline.py::test_profile_script_runs_both_kernels",
        # The expert-parallel benchmark's whole script at every degree (one module fixture): the
        # exchange and the layer over meshes are tested in tests/parallel.
        *(
            f"benchmarks/test_benchmark_ep.py::{name}"
            for name in (
                "test_environment_says_where_it_ran",
                "test_every_exchange_case_is_timed",
                "test_the_plans_count_what_leaves_a_rank",
                "test_the_layer_is_timed_at_every_degree_with_its_efficiency",
                "test_every_layer_step_is_profiled",
                "test_the_plot_is_recorded_or_skipped",
                "test_without_matplotlib_the_plot_is_skipped_with_a_note",
                "test_the_plot_is_drawn",
            )
        ),
        # The compare tool as a subprocess (the same report is checked in process).
        "bridge/test_bridge_reference.py::test_compare_tool_as_a_subprocess",
        # The LM's two-process mesh step (the layer's two-process test stays).
        "parallel/test_lm_mesh_multiprocess.py::test_two_processes_give_the_bits_of_one",
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything
def pytest_collection_modifyitems(config, items):
    collected = {item.nodeid.removeprefix("tests/") for item in items}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    moved = sorted(
        {c for c in FURTHER_CASES if not os.path.exists(os.path.join(tests_dir, c.split("::")[0]))}
    )
    if moved:
        raise pytest.UsageError(f"FURTHER_CASES names test files that do not exist: {moved}")
    if not any("::" in arg for arg in config.args):  # whole files collected
        files = {node_id.split("::")[0] for node_id in collected}
        stale = {c for c in FURTHER_CASES if c.split("::")[0] in files} - collected
        if stale:
            raise pytest.UsageError(f"FURTHER_CASES names tests that do not exist: {sorted(stale)}")
    for item in items:
        if "interpret" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.removeprefix("tests/") in FURTHER_CASES:
            item.add_marker(pytest.mark.exhaustive)
    if on_hopper():
        return
    tiny_layer_suite = config.getoption("--layer-shapes") == "tiny"
    reason = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords and not (
            tiny_layer_suite and item.module.__name__ == "test_gpu_layer"
        ):
            item.add_marker(reason)


class ResultsRecorder:
    """Collects each test's outcome and writes them with the device and versions as JSON, after
    every test (a run cut by a time limit keeps what finished)."""

    def __init__(self, path: str, command: str):
        self.path, self.command, self.results = path, command, []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.results.append(
                dict(
                    test=report.nodeid,
                    outcome=report.outcome,
                    seconds=round(report.duration, 3),
                    properties=dict(report.user_properties),
                    failure=str(report.longrepr)[-4000:] if report.failed else None,
                )
            )
            self.write()

    def write(self):
        outcomes = [r["outcome"] for r in self.results]
        device = jax.devices()[0]
        record = dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=self.command,
            device=getattr(device, "device_kind", device.platform),
            platform=platform.platform(),
            jax=jax.__version__,
            git_commit=git_commit(),
            summary={o: outcomes.count(o) for o in ("passed", "failed", "skipped")},
            tests=self.results,
        )
        with open(self.path, "w") as f:
            json.dump(record, f, indent=1, default=str)

    def pytest_sessionfinish(self, session):
        self.write()


def pytest_configure(config):
    path = config.getoption("--results-json")
    if path:
        command = "python -m pytest " + " ".join(config.invocation_params.args)
        config.pluginmanager.register(ResultsRecorder(path, command), "jaxmoe-results-json")
