"""benchmarks/research/ncu_stalls.py on a small Nsight Compute source-page CSV."""

import csv

import pytest

from benchmarks.research.ncu_stalls import SAMPLES, main, opcode

HEADER = ["Address", "Source", SAMPLES, "Instructions Executed", "stall_selected", "stall_long_sb"]
ROWS = [  # a loop body (executed 100 times) of three instructions, one other instruction
    ["0x0", "  LDS.U16 R1, [R2]", "10", "100", "2", "8"],
    ["0x10", "  @!P1 FMUL R3, R1, R4", "30", "100", "25", "5"],
    ["0x20", "  FMUL R5, R1, R4", "20", "100", "18", "2"],
    ["0x30", "  BRA 0x0", "40", "7", "0", "40"],
]


def test_groups_by_execution_count_and_mixes_the_most_sampled_body(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["Kernel Name", "k"], HEADER, *ROWS])
    main([str(path), "--mix"])
    out = capsys.readouterr().out
    assert "100 stall samples over 4 instructions" in out
    assert "100      3    60.0%  selected 75%, long_sb 25%" in out
    assert "opcodes of the 3 instructions executed 100 times" in out
    assert "     2  FMUL\n     1  LDS.U16" in out


def test_opcode_drops_the_predicate():
    assert opcode("  @!P1 BRA 0x7f00") == "BRA"
    assert opcode("HGMMA.64x32x16.F32.BF16 R40, R56") == "HGMMA.64x32x16.F32.BF16"


def test_kernel_picks_one_section_of_a_report_of_several(tmp_path, capsys):
    """--kernel reads the first kernel whose name contains it; a name no kernel has is refused
    with the report's kernel names."""
    other = [["0x0", "  EXIT", "5", "1", "5", "0"]]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(
            [["Kernel Name", "loop_fusion"], HEADER, *other, ["Kernel Name", "tgmm_kernel"]]
            + [HEADER, *ROWS]
        )
    main([str(path), "--kernel", "tgmm"])
    assert "100 stall samples over 4 instructions" in capsys.readouterr().out
    main([str(path), "--kernel", "loop"])
    assert "5 stall samples over 1 instructions" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no kernel named like 'gmm_fwd'.*loop_fusion"):
        main([str(path), "--kernel", "gmm_fwd"])
