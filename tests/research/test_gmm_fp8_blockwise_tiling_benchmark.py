"""benchmarks/research/gmm_fp8_blockwise_tiling.py in the interpreter: every tiling runs, gives the
heuristic's bits, and the JSON is written."""

import json

import pytest

from benchmarks import gmm as gmm_benchmark
from benchmarks.research import gmm_fp8_blockwise_tiling as tiling


def test_variants_and_dgrad_problems_parse():
    assert tiling.parse_variants("a:wg_split=m,tile_k=256;b:") == {
        "a": {"wg_split": "m", "tile_k": 256},
        "b": {},
    }
    m, h, two_f, g = gmm_benchmark.SHAPES["mixtral"]
    assert tiling.problem("mixtral:dgrad") == (m, two_f, h, g)
    assert tiling.problem("mixtral") == (m, h, two_f, g)
    assert tiling.problem("mixtral:fc2") == (m, two_f // 2, h, g)
    assert tiling.problem("mixtral:fc2_dgrad") == (m, h, two_f // 2, g)


def test_tilings_give_the_heuristics_bits(tmp_path, monkeypatch, interpret):
    monkeypatch.setitem(gmm_benchmark.SHAPES, "tiny", (512, 512, 256, 3))
    result = tiling.main(
        [
            "--shapes",
            "tiny",  # the dgrad problem's shape: test_variants_and_dgrad_problems_parse
            "--variants",
            "wg_n:wg_split=n,tile_k=128,num_sms=3",
            "--wgrad-shapes",
            "tiny",
            "--wgrad-variants",
            "slots2:slots=2,num_sms=3,cluster_n=1",
            "--out",
            str(tmp_path),
        ]
    )
    kernels = [r for r in result["records"] if r["impl"] != "jaxmoe_bf16"]
    assert [r["shape"] for r in kernels] == ["tiny"] * 3 + ["tiny:wgrad"] * 2
    assert all(r["bitwise_heuristic"] for r in kernels), kernels
    with open(result["path"]) as f:
        assert json.load(f)["records"] == result["records"]
    for bad in ("nope", "tiny:wgrad"):
        with pytest.raises(SystemExit):
            tiling.main(["--shapes", bad, "--out", str(tmp_path)])


def test_timings_take_turns_and_report_the_median(monkeypatch):
    """On a GPU every call is timed once a round, the rounds in turn, and the median kept."""
    import jax.numpy as jnp

    order, times = [], iter([3.0, 1.0, 2.0, 6.0, 5.0, 4.0])
    monkeypatch.setattr(tiling.jax, "devices", lambda: [type("D", (), {"platform": "gpu"})()])

    def timed(call, iters):
        order.append(call.__name__)
        return next(times)

    monkeypatch.setattr(tiling, "device_seconds", timed)

    def bf16():
        return jnp.zeros(2)

    def kernel():
        return jnp.ones(2)

    records = []
    tiling.compare_tilings("s", {"heuristic": (kernel, None)}, bf16, 2e12, 1, 3, records)
    assert order == ["bf16", "kernel"] * 3
    by_impl = {r["impl"]: r for r in records}
    assert by_impl["jaxmoe_bf16"]["us"] == 3e6 and by_impl["jaxmoe_bf16"]["us_runs"] == [
        3e6,
        2e6,
        5e6,
    ]
    assert by_impl["heuristic"]["tflops"] == 2e12 / 4.0 / 1e12
    assert by_impl["heuristic"]["bitwise_heuristic"]


def test_profile_gmm_runs_the_fp8_blockwise_kernels_on_the_tiling_operands(interpret):
    """benchmarks/research/profile_gmm.py's fp8_blockwise ops: the kernels on the operands the tiling
    benchmark times, with the references' bits."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.research import profile_gmm
    from jaxmoe import fp8_blockwise as fb
    from jaxmoe.ops.device import on_hopper

    def check(got, reference, *operands):
        """The reference's bits in the interpreter. On the GPU the fp8 tensor cores add each
        k32 product sum with 2^-12 relative precision (four per 128-wide block, as
        tests/numerics/test_fp8_blockwise.py derives), so within that of the same reference on the
        operands' magnitudes, plus the bf16 output's rounding."""
        want = reference(*operands)
        if not on_hopper():
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
            return
        magnitude = np.asarray(reference(*(jnp.abs(a) for a in operands)))
        want = np.asarray(want)
        bound = 4 * 2.0**-12 * magnitude + 2.0**-8 * np.abs(want) + 1e-30
        assert np.all(np.abs(np.asarray(got, np.float32) - want) <= bound)

    m, k, n, g = 512, 256, 256, 3
    changes = {"num_sms": 2}
    sizes, x, dy, _ = tiling.wgrad_operands(m, k, n, g)
    got = profile_gmm.fp8_blockwise_call("wgrad_fp8_blockwise", m, k, n, g, changes)()
    check(
        got,
        lambda a, b: fb.tgmm_reference(fb.quantize_1x128(a, 0), fb.quantize_1x128(b, 0), sizes),
        x,
        dy,
    )
    sizes, x, w, _ = tiling.fprop_operands(m, k, n, g)
    got = profile_gmm.fp8_blockwise_call("fwd_fp8_blockwise", m, k, n, g, changes)()
    check(
        got,
        lambda a, b: fb.gmm_reference(fb.quantize_1x128(a), fb.quantize_128x128(b), sizes),
        x,
        w,
    )
