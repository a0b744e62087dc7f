"""CPU smoke test of the wire-gather benchmark (benchmarks/research/wire_gather.py) at a tiny size, so
that it cannot rot between GPU runs: every route (the dispatch kernel in the interpreter, XLA's
gather, the one-pass rows from the tokens) is timed and gives the same bits."""

import json

from benchmarks.research import wire_gather


def test_wire_gather_benchmark_times_every_route_with_the_same_bits(interpret, tmp_path):
    result = wire_gather.main(
        ["--shapes", "qwen3_30b", "--tokens", "1", "--iters", "1", "--out", str(tmp_path)]
    )
    with open(result["path"]) as f:
        assert json.load(f)["records"] == result["records"]
    (record,) = result["records"]
    assert record["fp8_row_bytes"] == 1 * 8 * 2048
    assert record["same_bits"]
    assert all(record[f"{r}_us"] > 0 for r in ("kernel", "xla", "quantize", "one_pass"))
