"""CPU smoke test of the expert-parallel benchmark (benchmarks/ep.py) on the 8 host devices, so
that it cannot rot between GPU runs: the whole script at the tiny size with ep 1 and 2, every
exchange case (dispatch and combine, fwd and bwd: the deduplicated token sends on bf16 and MXFP8
wires, the bf16 returns; the dense all-to-all of each wire's buffer, the quantize alone, the plan
exchange) and every layer step (single device, expert-parallel at ep 1 and 2, bf16 and MXFP8
dispatch, the dense and the ragged transport) timed, with finite positive times, rates and
efficiencies; and the plot, or its absence without matplotlib (not installed here; the plot
itself is drawn where it is)."""

import importlib.util
import json
import math
import os
import sys

import pytest

from benchmarks import ep as ep_benchmark

DEGREES = (1, 2)
REPEATS = 2
HIDDEN, TOKENS = 64, 64  # the tiny shape: H, and T per device
# (exchange, pass, wire, buffer) of the layer's exchanges: token sends and bf16 returns.
CASES = {
    ("dispatch", "fwd", "bf16", "tokens"),
    ("dispatch", "fwd", "mxfp8", "tokens"),
    ("dispatch", "bwd", "bf16", "rows"),
    ("combine", "fwd", "bf16", "rows"),
    ("combine", "bwd", "bf16", "tokens"),
    ("combine", "bwd", "mxfp8", "tokens"),
}
DENSE = {("dense_all_to_all", "-", w, b) for w, b in (("bf16", "tokens"), ("mxfp8", "tokens"))}
DENSE.add(("dense_all_to_all", "-", "bf16", "rows"))
VARIANTS = ("dense", "ragged/4")  # --transports dense,ragged --ragged-pieces 4
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def positive(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    argv = ["--shape", "tiny", "--ep", "1,2", "--repeats", str(REPEATS), "--min-window", "0.005"]
    argv += ["--profile", "--transports", "dense,ragged", "--ragged-pieces", "4"]
    returned = ep_benchmark.main(argv + ["--tag", "test", "--out", str(out)])
    assert os.path.basename(returned["path"]).startswith("ep_")
    with open(returned["path"]) as f:
        written = json.load(f)
    assert written == {k: v for k, v in returned.items() if k != "path"}
    return dict(written, path=returned["path"])


def test_environment_says_where_it_ran(result):
    assert result["benchmark"] == "ep"
    assert result["platform"] == "cpu" and result["on_cpu"] and result["note"]
    assert result["device_count"] == 8
    assert result["degrees"] == list(DEGREES)
    assert result["shape"]["name"] == "tiny" and result["shape"]["tokens_per_device"] == TOKENS
    assert not result["errors"]


def test_every_exchange_case_is_timed(result):
    """Every exchange once per transport variant (the dense one, the ragged one at each
    --ragged-pieces count); the dense all-to-all references, of the payload alone too at
    ep > 1, once."""
    records = {
        (r["ep"], r["exchange"], r["pass"], r["wire"], r.get("buffer"), r.get("transport")): r
        for r in result["exchange"]
    }
    assert len(records) == len(result["exchange"])  # one record per key
    assert result["exchange_variants"] == list(VARIANTS)
    expected = set()
    for d in DEGREES:
        expected.add((d, "quantize", "-", "mxfp8", None, None))
        for variant in VARIANTS:
            expected.add((d, "exchange_plan", "fwd", "int32", None, variant))
            expected |= {(d, *case, variant) for case in CASES}
        expected |= {(d, *case, None) for case in DENSE}
        if d > 1:
            expected |= {(d, e, p, w, f"{b}_payload", None) for e, p, w, b in DENSE}
    assert set(records) == expected
    plans = {p["ep"]: p for p in result["plans"]}
    for key, r in records.items():
        assert "error" not in r, r
        assert positive(r["ms"]) and len(r["ms_runs"]) == REPEATS, r
        assert all(positive(t) for t in r["ms_runs"]), r
        if r["exchange"] in ("exchange_plan", "quantize"):
            continue
        degree, plan = key[0], plans[key[0]]
        assert positive(r["ratio_to_dense"]), r
        # The wire buffer: token slots [R * T, ...] for token sends, receiver rows [R * C, H];
        # the payload references: the mean real rows leaving a rank, split over the peers.
        room = r["buffer"].removesuffix("_payload")
        payload = plan["tokens_to_peers_mean" if room == "tokens" else "real_rows_returned_mean"]
        per_peer = TOKENS if room == "tokens" else plan["buffer_rows"]
        if r["buffer"].endswith("_payload"):
            per_peer = min(per_peer, -(-math.ceil(payload) // (degree - 1) // 8) * 8)
            assert per_peer >= payload / (degree - 1)
        assert r["slot_rows"] == degree * per_peer
        assert r["buffer_bytes"] == degree * per_peer * r["row_bytes"]
        assert r["bus_bytes"] == (degree - 1) * per_peer * r["row_bytes"]
        assert r["payload_rows"] == payload
        assert r["payload_bytes"] == pytest.approx(payload * r["row_bytes"])
        if r["exchange"] != "dense_all_to_all":  # the quantize is timed where the layer pays it
            assert r["includes_quantize"] == (r["wire"] == "mxfp8") and r["in_layer"], r
            ragged = r["transport"].startswith("ragged/")
            assert r["pieces_per_peer"] == (int(r["transport"].split("/")[1]) if ragged else None)
            payload_ratio = r["ratio_to_payload_all_to_all"]
            assert positive(payload_ratio) if degree > 1 else payload_ratio is None, r
        if degree == 1:  # nothing leaves the rank
            assert r["bus_bytes"] == 0 and r["busbw_GBps"] is None
        else:
            assert positive(r["busbw_GBps"]) and positive(r["payload_GBps"]), r
    # The wires differ only in the bytes per row (2H vs H + H/32); the returns are bf16 rows.
    assert records[(2, "dispatch", "fwd", "bf16", "tokens", "dense")]["row_bytes"] == 2 * HIDDEN
    assert records[(2, "dispatch", "fwd", "mxfp8", "tokens", "dense")]["row_bytes"] == HIDDEN + 2
    assert records[(2, "combine", "fwd", "bf16", "rows", "dense")]["row_bytes"] == 2 * HIDDEN


def test_the_plans_count_what_leaves_a_rank(result):
    assert [p["ep"] for p in result["plans"]] == list(DEGREES)
    for plan in result["plans"]:
        degree = plan["ep"]
        assert plan["token_slot_rows"] == degree * TOKENS
        assert plan["receiver_rows"] == degree * plan["buffer_rows"]
        real_rows = sum(plan["real_rows_to_peers"])  # (token, expert) pairs, 32 tokens x 2 a rank
        # Every real row a rank sends out comes back from its receiver.
        assert sum(plan["real_rows_returned"]) == real_rows
        to_peers = sum(plan["tokens_to_peers"])
        if degree == 1:
            assert real_rows == to_peers == 0 and plan["rows_per_token_to_peers"] is None
            assert plan["tokens_sent"] == [TOKENS]  # every token to its own rank's experts
        else:  # each token at most once per peer: no more tokens than rows, up to T per peer
            assert 0 < to_peers <= real_rows <= degree * TOKENS * 2
            assert all(t <= (degree - 1) * TOKENS for t in plan["tokens_to_peers"])
            assert 1 <= plan["rows_per_token_to_peers"] <= 2


def test_the_layer_is_timed_at_every_degree_with_its_efficiency(result):
    records = {(r["impl"], r["ep"], r["dispatch"], r["transport"]): r for r in result["layer"]}
    expected = {("single_device", 1, w, "-") for w in ("bf16", "mxfp8")}
    expected |= {
        ("expert_parallel", d, w, t)
        for d in DEGREES
        for w in ("bf16", "mxfp8")
        for t in ("dense", "ragged")
    }
    assert set(records) == expected
    assert result["transports"] == ["dense", "ragged"]
    for (impl, degree, *_), r in records.items():
        assert "error" not in r, r
        assert positive(r["ms"]) and len(r["ms_runs"]) == REPEATS, r
        assert positive(r["tokens_per_s_per_device"]) and positive(r["efficiency"]), r
        assert r["tokens_per_s"] == pytest.approx(degree * r["tokens_per_s_per_device"])
        assert r["experts"] == "bf16"
        if impl == "single_device":
            assert r["efficiency"] == 1.0
    assert records[("expert_parallel", 2, "mxfp8", "ragged")]["expert_row_alignment"] == 32


def test_every_layer_step_is_profiled(result):
    """--profile: each step's first device, its busy and span time and top ops."""
    for r in result["layer"]:
        profile = r["profile"]
        assert positive(profile["busy_ms"]) and positive(profile["span_ms"]), r
        assert 0 <= profile["collectives_ms"] <= profile["busy_ms"]
        assert 0 < len(profile["top"]) <= ep_benchmark.PROFILE_TOP
        assert all(positive(op["ms"]) and op["calls_per_step"] > 0 for op in profile["top"])


def test_the_plot_is_recorded_or_skipped(result):
    png = os.path.splitext(result["path"])[0] + ".png"
    if HAVE_MATPLOTLIB:
        assert result["plot"] == png and os.path.getsize(png) > 0
    else:
        assert result["plot"] is None and not os.path.exists(png)


def test_without_matplotlib_the_plot_is_skipped_with_a_note(result, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    png = str(tmp_path / "ep.png")
    assert ep_benchmark.save_plot(result, png) is None
    assert not os.path.exists(png)
    assert "no plot" in capsys.readouterr().out


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_the_plot_is_drawn(result, tmp_path):
    png = str(tmp_path / "ep.png")
    assert ep_benchmark.save_plot(result, png) == png and os.path.getsize(png) > 0
