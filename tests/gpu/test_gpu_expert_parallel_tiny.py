"""tests/gpu/test_gpu_expert_parallel.py's checks at tiny sizes on two host devices (the one-rank
checks on one; XLA's ops in place of the kernels and NCCL), so that the GPU suite, which runs
its two-GPU checks only where two GPUs are lent, cannot rot between its runs. The FP8-blockwise
case needs dimensions of 128 (the CPU covers it in tests/parallel/test_expert_parallel.py) and the
one-process-per-GPU case real GPUs."""

import pytest
import test_gpu_expert_parallel as on_gpus

from jaxmoe.shapes import TINY_SHAPES

CASES = [case for case in on_gpus.CASES if not case.endswith("fp8_blockwise")]


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setitem(on_gpus.SHAPES, "qwen3_30b", TINY_SHAPES["tiny"])
    monkeypatch.setitem(on_gpus.SHAPES, "deepseek_v3_style", TINY_SHAPES["tiny_deepseek"])
    monkeypatch.setattr(on_gpus, "TOKENS_PER_GPU", 64)


@pytest.mark.parametrize("case", CASES)
def test_same_bits_at_ep_1_and_2(case, record_property):
    on_gpus.test_same_bits_at_ep_1_and_2(case, record_property)


def test_ragged_transport_gives_the_dense_bits():
    on_gpus.test_ragged_transport_gives_the_dense_bits("qwen3_30b-mxfp8_wire")


def test_control_one_group_per_expert_changes_the_gradient_bits(monkeypatch):
    on_gpus.test_control_one_group_per_expert_changes_the_gradient_bits(monkeypatch)


@pytest.mark.parametrize("case", on_gpus.ONE_RANK_CASES)
def test_one_rank_ragged_transport_gives_the_dense_bits(case):
    on_gpus.test_one_rank_ragged_transport_gives_the_dense_bits(case)


@pytest.mark.parametrize("case", on_gpus.ONE_RANK_CASES)
def test_one_rank_is_the_single_gpu_layer(case):
    on_gpus.test_one_rank_is_the_single_gpu_layer(case)
