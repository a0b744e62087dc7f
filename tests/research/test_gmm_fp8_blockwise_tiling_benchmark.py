"""benchmarks/research/gmm_fp8_blockwise_tiling.py in the interpreter: every tiling runs, gives the
heuristic's bits, and the JSON is written."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import gmm as gmm_benchmark
from benchmarks.research import gmm_fp8_blockwise_tiling as tiling
from benchmarks.research import profile_gmm
from jaxmoe import fp8_blockwise as fb
from jaxmoe.ops.device import on_hopper

from bitwise import assert_bitwise, differs
from interpreter import matmul_in_k_order


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


def tgmm_reference_in_k_order(x, dy, sizes, k_order):
    """fb.tgmm_reference of x and dy quantized along the tokens, each 128-row block's fp8
    products summed by `k_order` (a [K, R] @ b [R, N] in fp32) instead of XLA's dot, whose
    order on the CPU is XLA's choice; the blocks folded as the reference folds them."""
    lq, dq = fb.quantize_1x128(x, 0), fb.quantize_1x128(dy, 0)
    a, d = np.asarray(lq.data, np.float32), np.asarray(dq.data, np.float32)
    a_scale, d_scale = np.asarray(lq.scale_inv), np.asarray(dq.scale_inv)
    out = np.zeros((len(sizes), a.shape[1], d.shape[1]), np.float32)
    block_groups = np.searchsorted(np.cumsum(sizes), np.arange(0, a.shape[0], fb.BLOCK), "right")
    for b, group in enumerate(block_groups):
        rows = slice(b * fb.BLOCK, (b + 1) * fb.BLOCK)
        out[group] += k_order(a[rows].T, d[rows]) * (a_scale[b][:, None] * d_scale[b][None, :])
    return out


def gmm_reference_in_k_order(x, w, sizes, k_order):
    """fb.gmm_reference of x in 1 x 128 and w in 128 x 128 blocks, each block's fp8 products
    summed by `k_order` (a [R, 128] @ b [128, N] in fp32) instead of XLA's dot; the blocks
    folded as the reference folds them."""
    xq, wq = fb.quantize_1x128(x), fb.quantize_128x128(w)
    a, b_all = np.asarray(xq.data, np.float32), np.asarray(wq.data, np.float32)
    a_scale, w_scale = np.asarray(xq.scale_inv), np.asarray(wq.scale_inv)
    n = b_all.shape[2]
    out = np.zeros((a.shape[0], n), np.float32)
    ends = np.cumsum(sizes)
    for group, (start, end) in enumerate(zip(ends - sizes, ends, strict=True)):
        for b in range(a.shape[1] // fb.BLOCK):
            cols = slice(b * fb.BLOCK, (b + 1) * fb.BLOCK)
            scale = a_scale[start:end, b, None] * np.repeat(w_scale[group, b], fb.BLOCK)[:n]
            out[start:end] += k_order(a[start:end, cols], b_all[group, cols]) * scale
    return out


def in_k_order(a, b):
    """The interpreter's wgmma's sum: products in K order."""
    return matmul_in_k_order(a, b, np.float32)


def in_reversed_k_order(a, b):
    """The negative control's sum: products in reversed K order."""
    return matmul_in_k_order(a[:, ::-1], b[::-1], np.float32)


def test_profile_gmm_runs_the_fp8_blockwise_kernels_on_the_tiling_operands(interpret):
    """benchmarks/research/profile_gmm.py's fp8_blockwise ops: the kernels on the operands the
    tiling benchmark times. In the interpreter, whose wgmma sums a block's products in K order,
    the bits of the references with their blocks' products summed in K order (on any CPU); in
    reversed K order other bits (the negative control). On the GPU the fp8 tensor cores add
    each k32 product sum with 2^-12 relative precision (four per 128-wide block, as
    tests/numerics/test_fp8_blockwise.py derives), so within that of the references on the
    operands' magnitudes, plus the bf16 output's rounding."""

    def check(got, reference_in_k_order, reference, *operands):
        got = np.asarray(got)
        if not on_hopper():
            want = reference_in_k_order(*operands, in_k_order)
            assert_bitwise(got, want.astype(jnp.bfloat16))
            other = reference_in_k_order(*operands, in_reversed_k_order)
            assert differs(got, other.astype(jnp.bfloat16))
            return
        want = np.asarray(reference(*operands))
        magnitude = np.asarray(reference(*(jnp.abs(a) for a in operands)))
        bound = 4 * 2.0**-12 * magnitude + 2.0**-8 * np.abs(want) + 1e-30
        assert np.all(np.abs(got.astype(np.float32) - want) <= bound)

    m, k, n, g = 512, 256, 256, 3
    changes = {"num_sms": 2}
    sizes, x, dy, _ = tiling.wgrad_operands(m, k, n, g)
    check(
        profile_gmm.fp8_blockwise_call("wgrad_fp8_blockwise", m, k, n, g, changes)(),
        lambda a, b, k_order: tgmm_reference_in_k_order(a, b, sizes, k_order),
        lambda a, b: fb.tgmm_reference(fb.quantize_1x128(a, 0), fb.quantize_1x128(b, 0), sizes),
        x,
        dy,
    )
    sizes, x, w, _ = tiling.fprop_operands(m, k, n, g)
    check(
        profile_gmm.fp8_blockwise_call("fwd_fp8_blockwise", m, k, n, g, changes)(),
        lambda a, b, k_order: gmm_reference_in_k_order(a, b, sizes, k_order),
        lambda a, b: fb.gmm_reference(fb.quantize_1x128(a), fb.quantize_128x128(b), sizes),
        x,
        w,
    )
