"""benchmarks/research/demo_precisions.py's bookkeeping (seed lists, the per-seed ratios to bf16) and the
demo's row_alignment option it uses as its control."""

import pytest

from benchmarks.research.demo_precisions import seeds_from, summarize
from jaxmoe import demo


def test_seed_lists():
    assert seeds_from("0-3") == [0, 1, 2, 3]
    assert seeds_from("4,1") == [4, 1]


def test_summary_compares_each_seed_with_its_own_bf16_run():
    records = [
        dict(precision="bf16", seed=0, loss=0.5),
        dict(precision="bf16", seed=1, loss=0.8),
        dict(precision="fp8", seed=0, loss=0.55),
        dict(precision="fp8", seed=1, loss=0.8),
    ]
    (row,) = summarize(records, ["fp8"])
    assert row["seeds"] == 2
    assert row["min_ratio"] == pytest.approx(1.0)
    assert row["max_ratio"] == pytest.approx(1.1)
    assert row["mean_ratio_to_bf16"] == pytest.approx(1.05)
    assert row["sd_ratio"] == pytest.approx(0.0707107, rel=1e-5)


def test_demo_row_alignment_changes_only_the_padding():
    """Two steps of the tiny demo: 128-row expert padding trains (a finite loss near bf16's);
    the option reaches the model (a bad alignment is refused by MoEConfig)."""
    kwargs = dict(steps=2, hidden=32, batch=2, seq_len=8, log_every=2, quiet=True)
    plain = demo.train("mixtral", **kwargs)["loss"]
    padded = demo.train("mixtral", row_alignment=128, **kwargs)["loss"]
    assert padded == pytest.approx(plain, rel=1e-2)
    with pytest.raises(ValueError, match="expert_row_alignment"):
        demo.train("mixtral", row_alignment=0, **kwargs)
