"""benchmarks/research/gmm_power.py off the GPU: its nvidia-smi parsing and sample medians, and the
refusal to run without a GPU."""

import pytest

from benchmarks.research import gmm_power


def test_samples_parse_and_settle():
    assert gmm_power.parse_sample("1410, 697.33, 58\n") == (1410.0, 697.33, 58.0)
    with pytest.raises(ValueError, match="expected 3 values"):
        gmm_power.parse_sample("1410, 697.33")
    # the first two of more than four samples (the clock settling) are left out
    samples = [(1980.0, 300.0, 40.0), (1700.0, 650.0, 45.0)] + [(1410.0, 698.0, 58.0)] * 3
    assert gmm_power.sample_medians(samples) == dict(
        sm_clock_mhz=1410.0, power_w=698.0, temperature_c=58.0, samples=3
    )
    assert gmm_power.sample_medians(samples[:3])["sm_clock_mhz"] == 1700.0
    with pytest.raises(ValueError, match="no samples"):
        gmm_power.sample_medians([])


def test_refuses_to_run_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        gmm_power.main(["--shapes", "mixtral"])
    assert "run it on an NVIDIA GPU" in capsys.readouterr().err


def test_variants_replace_the_heuristics_fields():
    from jaxmoe.ops.pallas.gmm_mxfp8_hopper import default_fp8_blockwise_config

    variants = gmm_power.report.parse_variants("pairs:cluster_n=2;k128:tile_k=128")
    m, k, n, g = gmm_power.SHAPES["dsv3_ep8"]
    for op, contraction, out_n in (("fwd", k, n), ("dgrad", n, k)):
        heuristic = default_fp8_blockwise_config(m, contraction, out_n, g)
        configs = gmm_power.variant_configs("dsv3_ep8", op, variants)
        assert configs["pairs"].cluster_n == 2 and heuristic.cluster_n == 1
        assert configs["pairs"].tile_k == heuristic.tile_k == 256
        assert configs["k128"].tile_k == 128 and configs["k128"].cluster_n == 1
    with pytest.raises(ValueError, match="no GmmConfig field"):
        gmm_power.variant_configs("mixtral", "fwd", {"bad": {"tile_q": 1}})
    with pytest.raises(ValueError, match="unknown op"):
        gmm_power.variant_configs("mixtral", "wgrad", {})


def test_refuses_an_unknown_variant_field_before_running(capsys):
    with pytest.raises(SystemExit):
        gmm_power.main(["--shapes", "mixtral", "--variants", "bad:tile_q=1"])
    assert "no GmmConfig field" in capsys.readouterr().err
