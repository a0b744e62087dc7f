"""CPU smoke test of the LM training benchmark (benchmarks/train.py) at a tiny size, so that it
cannot rot between GPU runs: the jaxmoe model and its ragged_dot twin train the same function
(the same first losses within bf16 rounding), and the driver runs a transformers worker in its
own process and writes the JSON and plot."""

import json

import numpy as np
import pytest

from benchmarks import train as bench

TINY = [
    "--model=qwen3_moe_2b",
    "--set=num_layers=2",
    "--set=hidden_size=64",
    "--set=num_heads=2",
    "--set=num_kv_heads=1",
    "--set=head_dim=32",
    "--set=vocab_size=512",
    "--set=moe.num_experts=8",
    "--set=moe.top_k=2",
    "--set=moe.ffn_hidden_size=64",
    "--seq-len=32",
    "--batch=2",
    "--steps=2",
    "--warmup=0",
]


def test_the_ragged_dot_model_trains_the_same_function():
    args = bench.parse_args(TINY)
    ours = bench.jax_worker("jaxmoe", args)
    ragged = bench.jax_worker("jaxmoe_ragged_dot", args)
    assert len(ours["seconds"]) == len(ragged["seconds"]) == 2
    np.testing.assert_allclose(ours["losses"], ragged["losses"], rtol=1e-3)
    assert ours["losses"][1] < ours["losses"][0]  # the step trains
    assert ours["attention"] == "xla"


def test_driver_writes_the_record_and_the_plot(tmp_path):
    bench.main([*TINY, "--impls=hf_eager", f"--out={tmp_path}", "--tag=t"])
    (path,) = tmp_path.glob("train_*_t.json")
    record = json.loads(path.read_text())
    hf = record["impls"]["hf_eager"]
    assert "error" not in hf, hf.get("error")
    assert np.isfinite(hf["losses"]).all() and hf["tokens_per_s"] > 0
    assert record["active_parameters"] < record["total_parameters"]
    assert record["flops_per_token"] > 6 * record["active_parameters"]
    assert path.with_suffix(".png").exists()


def test_unknown_impls_and_overrides_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls=jaxmoe,torchtitan"])
    assert "torchtitan" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nope"):
        bench.model_config(bench.parse_args(["--set=nope=1"]))
