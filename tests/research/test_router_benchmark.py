"""CPU smoke test of the router benchmark (benchmarks/research/router.py) at a tiny size, so that it
cannot rot between GPU runs: the layer's dense, its kernel configs and XLA's dot are timed, and
every kernel config gives the dense's bits."""

import json

import pytest

from benchmarks.research import router

NARROW = {f"narrow[tile_n={n}]" for n in (16, 32, 64)}
EVERY_CONFIG = {"dense", "xla_dot", "kernel[tile_k=64,tile_n=64]"} | NARROW


@pytest.mark.parametrize(
    "impls",
    [{"xla_dot", "narrow[tile_n=16]"}, None],
    ids=["some", "every"],
)
def test_router_benchmark_times_every_config_with_the_same_bits(interpret, tmp_path, impls):
    """Every config asked for (`--impls`; all of them by default) and the dense are timed,
    and every kernel config gives the dense's bits."""
    argv = ["--shapes", "tiny", "--tokens", "8", "--iters", "1", "--out", str(tmp_path)]
    result = router.main(argv + (["--impls", ";".join(sorted(impls))] if impls else []))
    with open(result["path"]) as f:
        assert json.load(f)["records"] == result["records"]
    records = {r["impl"]: r for r in result["records"]}
    assert set(records) == (impls or EVERY_CONFIG) | {"dense"}
    assert all(r["us"] > 0 for r in records.values())
    for name in set(records) - {"xla_dot"}:
        assert records[name]["same_bits"], name
    with pytest.raises(SystemExit):
        router.main(argv + ["--impls", "nope"])


def test_side_by_side_warpgroups_give_the_dense_bits(interpret):
    """The variant with the warpgroups side by side along N (rows padded to 64, not 128) at a
    size where it applies: the same bits as the layer's dense."""
    calls, operands = router.candidates(8, 128, 128)
    name = "kernel[tile_k=64,tile_n=64,wg_split=n]"
    assert name in calls
    assert (calls[name](*operands) == calls["dense"](*operands)).all()
