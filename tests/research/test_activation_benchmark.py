"""CPU smoke test of the activation benchmark (benchmarks/research/activation.py) at its CPU size: every
layout's backward runs, those with 32 lanes keep the layer's bits (the tree does not depend on
the levels a pass), and the JSON holds every variant."""

import json

from benchmarks.research import activation


def test_activation_benchmark_runs_and_records_every_layout(tmp_path, interpret):
    result = activation.main(["--shapes", "dsv3_ep8", "--tag", "t", "--out", str(tmp_path)])
    [path] = tmp_path.iterdir()
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    variants = result["shapes"]["dsv3_ep8"]["variants"]
    expected = {f"lanes{lanes}_levels{levels}" for lanes, levels in activation.LAYOUTS}
    forwards = {"forward_xla", "forward_kernel", "forward_kernel_live_eighth"}
    quantized = {"quantized_two_passes", "quantized_fused"}
    for name in activation.FUSED_VARIANTS:
        quantized |= {f"quantized_fused_{name}", f"backward_quantized_fused_{name}"}
    quantized |= {"backward_quantized_two_passes", "backward_quantized_fused"}
    assert set(variants) == expected | {"kernel", "copy_h"} | forwards | quantized
    assert all(v["us"] > 0 and len(v["us_turns"]) == 1 for v in variants.values())
    for lanes, levels in activation.LAYOUTS:
        if lanes == 32:
            assert variants[f"lanes{lanes}_levels{levels}"]["same_bits"]
    # The one-pass kernel (interpreted here): d h as the layout's bits nearly everywhere, d p
    # within the sigmoid's rounding.
    assert variants["kernel"]["d_h_equal_fraction"] > 0.99
    assert variants["kernel"]["d_p_max_rel"] < 1e-4
    assert variants["forward_kernel"]["a_equal_fraction"] == 1.0  # the interpreter's sigmoid
    # fc2's copies of a from h in one pass, and fc1's copies of d h from h and the gradient:
    # the two passes' bits.
    two_passes = {"quantized_two_passes", "backward_quantized_two_passes"}
    assert all(variants[name]["same_bits"] for name in quantized - two_passes)
    # Negative control: another lane count sums in another order, which changes some bits.
    assert not all(v["same_bits"] for k, v in variants.items() if k.startswith("lanes"))


def test_chosen_variants_in_turns(tmp_path, interpret):
    """--variants keeps the variants its regex matches, --turns times each that often; a
    variant whose reference is left out records no comparison."""
    result = activation.main(
        ["--shapes", "dsv3_ep8", "--variants", "quantized_fused_two", "--turns", "2"]
        + ["--out", str(tmp_path)]
    )
    variants = result["shapes"]["dsv3_ep8"]["variants"]
    assert set(variants) == {
        "quantized_fused_two_slots",
        "backward_quantized_fused_two_slots",
    }
    for entry in variants.values():
        assert len(entry["us_turns"]) == 2 and entry["same_bits"] is None
