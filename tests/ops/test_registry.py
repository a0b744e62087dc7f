"""The implementation registry: what "auto", "xla" and a kernel's name resolve to."""

import pytest

from jaxmoe.ops import registry
from jaxmoe.ops.device import on_hopper


def _register_fake(op, present):
    registry.register(
        op,
        "fake",
        device=lambda: present,
        problem=lambda size: None if size % 2 == 0 else f"size {size} is odd",
    )


def test_auto_picks_a_present_kernel_that_can_run_the_call():
    _register_fake("test_op_present", present=True)
    assert registry.resolve("test_op_present", "auto", 4) == "fake"
    assert registry.resolve("test_op_present", "auto", 3) == "xla"  # its problem
    assert registry.resolve("test_op_present", "xla", 4) == "xla"


def test_auto_skips_a_kernel_whose_device_is_absent_and_the_name_still_runs_it():
    _register_fake("test_op_absent", present=False)
    assert registry.resolve("test_op_absent", "auto", 4) == "xla"
    assert registry.resolve("test_op_absent", "fake", 4) == "fake"  # the interpreter's way in


def test_asking_for_a_kernel_that_cannot_run_the_call_says_why():
    _register_fake("test_op_problem", present=True)
    with pytest.raises(ValueError, match=r"test_op_problem\(impl='fake'\): size 3 is odd"):
        registry.resolve("test_op_problem", "fake", 3)


def test_unknown_impl_and_duplicate_registration_are_errors():
    _register_fake("test_op_names", present=True)
    with pytest.raises(ValueError, match="must be one of"):
        registry.resolve("test_op_names", "triton", 4)
    with pytest.raises(ValueError, match="already has"):
        _register_fake("test_op_names", present=True)
    with pytest.raises(ValueError, match="already has"):
        registry.register("test_op_names", "xla", problem=lambda: None)


@pytest.mark.parametrize(
    "op",
    [
        "gmm",
        "tgmm",
        "dense",
        "quantize",
        "dispatch_quantize",
        "dispatch_rows",
        "combine_rows",
        "gmm[MXTensor]",
        "tgmm[MXTensor]",
        "gmm[BlockwiseTensor]",
        "tgmm[BlockwiseTensor]",
    ],
)
def test_every_op_has_its_pallas_kernel_and_auto_agrees_with_the_device(op):
    import jaxmoe.ops  # noqa: F401  (registers the kernels)

    assert registry.implementations(op) == ("auto", "xla", "pallas")
    (kernel,) = registry.kernels(op)
    assert kernel.device is on_hopper
