"""benchmarks/gmm_fp8_blockwise_tiling.py in the interpreter: every tiling runs, gives the
heuristic's bits, and the JSON is written."""

import json

import pytest

from benchmarks import gmm as gmm_benchmark
from benchmarks import gmm_fp8_blockwise_tiling as tiling


def test_variants_and_dgrad_problems_parse():
    assert tiling.parse_variants("a:wg_split=m,tile_k=256;b:") == {
        "a": {"wg_split": "m", "tile_k": 256},
        "b": {},
    }
    m, k, n, g = gmm_benchmark.SHAPES["mixtral"]
    assert tiling.problem("mixtral:dgrad") == (m, n, k, g)
    assert tiling.problem("mixtral") == (m, k, n, g)


def test_tilings_give_the_heuristics_bits(tmp_path, monkeypatch, interpret):
    monkeypatch.setitem(gmm_benchmark.SHAPES, "tiny", (512, 512, 256, 3))
    result = tiling.main(
        [
            "--shapes",
            "tiny,tiny:dgrad",
            "--variants",
            "steps1:max_concurrent_steps=1,num_sms=3;wg_n:wg_split=n,tile_k=128,num_sms=3",
            "--wgrad-shapes",
            "tiny",
            "--wgrad-variants",
            "k128:tile_k=128,tile_n=64,num_sms=3;slots2:slots=2,num_sms=3",
            "--out",
            str(tmp_path),
        ]
    )
    kernels = [r for r in result["records"] if r["impl"] != "jaxmoe_bf16"]
    assert [r["shape"] for r in kernels] == ["tiny"] * 4 + ["tiny:dgrad"] * 4 + ["tiny:wgrad"] * 3
    assert all(r["bitwise_heuristic"] for r in kernels), kernels
    with open(result["path"]) as f:
        assert json.load(f)["records"] == result["records"]
    with pytest.raises(SystemExit):
        tiling.main(["--shapes", "nope", "--out", str(tmp_path)])
