"""CPU smoke test of the expert-parallel benchmark (benchmarks/ep.py) on the 8 host devices, so
that it cannot rot between GPU runs: the whole script at the tiny size with ep 1 and 2, every
exchange case (dispatch and combine, fwd and bwd, bf16 and MXFP8 wires, the dense all-to-all
reference, the plan exchange) and every layer step (single device, expert-parallel at ep 1 and
2, bf16 and MXFP8 dispatch) timed, with finite positive times, rates and efficiencies."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import ep as ep_benchmark  # noqa: E402

DEGREES = (1, 2)
REPEATS = 2
PASSES = [(e, p) for e in ("dispatch", "combine") for p in ("fwd", "bwd")]


def positive(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    argv = ["--shape", "tiny", "--ep", "1,2", "--repeats", str(REPEATS), "--min-window", "0.005"]
    returned = ep_benchmark.main(argv + ["--tag", "test", "--out", str(out)])
    assert os.path.basename(returned["path"]).startswith("ep_")
    with open(returned["path"]) as f:
        written = json.load(f)
    assert written == {k: v for k, v in returned.items() if k != "path"}
    return written


def test_environment_says_where_it_ran(result):
    assert result["benchmark"] == "ep"
    assert result["platform"] == "cpu" and result["on_cpu"] and result["note"]
    assert result["device_count"] == 8
    assert result["degrees"] == list(DEGREES)
    assert result["shape"]["name"] == "tiny" and result["shape"]["tokens_per_device"] == 32
    assert not result["errors"]


def test_every_exchange_case_is_timed(result):
    records = {(r["ep"], r["exchange"], r["pass"], r["wire"]): r for r in result["exchange"]}
    expected = {(d, "exchange_plan", "fwd", "int32") for d in DEGREES}
    for d in DEGREES:
        for wire in ("bf16", "mxfp8"):
            expected.add((d, "dense_all_to_all", "-", wire))
            expected |= {(d, e, p, wire) for e, p in PASSES}
    assert set(records) == expected
    for key, r in records.items():
        assert "error" not in r, r
        assert positive(r["ms"]) and len(r["ms_runs"]) == REPEATS, r
        assert all(positive(t) for t in r["ms_runs"]), r
        if r["exchange"] == "exchange_plan":
            continue
        assert positive(r["ratio_to_dense"]), r
        assert r["buffer_bytes"] == key[0] * r["row_bytes"] * result["plans"][0]["buffer_rows"]
        if key[0] == 1:  # nothing leaves the rank
            assert r["bus_bytes"] == 0 and r["busbw_GBps"] is None
        else:
            assert positive(r["busbw_GBps"]) and positive(r["payload_GBps"]), r
    # One plan for both wires: they differ only in the bytes per row (2H vs H + H/32).
    assert records[(2, "dispatch", "fwd", "bf16")]["row_bytes"] == 2 * 64
    assert records[(2, "dispatch", "fwd", "mxfp8")]["row_bytes"] == 64 + 2
    assert [p["ep"] for p in result["plans"]] == list(DEGREES)
    for plan in result["plans"]:
        assert plan["slot_rows"] == plan["ep"] * plan["buffer_rows"]
        sent = sum(plan["real_rows_to_peers"])  # (token, expert) pairs, 32 tokens x 2 a rank
        assert sent == 0 if plan["ep"] == 1 else 0 < sent <= plan["ep"] * 32 * 2


def test_the_layer_is_timed_at_every_degree_with_its_efficiency(result):
    records = {(r["impl"], r["ep"], r["dispatch"]): r for r in result["layer"]}
    expected = {("single_device", 1, w) for w in ("bf16", "mxfp8")}
    expected |= {("expert_parallel", d, w) for d in DEGREES for w in ("bf16", "mxfp8")}
    assert set(records) == expected
    for (impl, degree, _), r in records.items():
        assert "error" not in r, r
        assert positive(r["ms"]) and len(r["ms_runs"]) == REPEATS, r
        assert positive(r["tokens_per_s_per_device"]) and positive(r["efficiency"]), r
        assert r["tokens_per_s"] == pytest.approx(degree * r["tokens_per_s_per_device"])
        assert r["experts"] == "bf16"
        if impl == "single_device":
            assert r["efficiency"] == 1.0
    assert records[("expert_parallel", 2, "mxfp8")]["expert_row_alignment"] == 32
