"""tools/sass_census.py's reading of a kernel's SASS listing (compiling the PTX needs ptxas and
nvdisasm, which CI does not install): labels and branch targets, loops from back edges (the
inner one and the one around it, predicated branches both), the barrier waits' slow paths
after the last EXIT left out, the opcode counts; and the `.maxnreg` it adds to a PTX."""

import pytest

from tools.sass_census import base, listing, loops, report, tool, with_maxnreg  # noqa: E402

SASS = """
        .text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R13, SR_TID.X ;
        /*0018*/              @!P3 EXIT ;
.L_x_1:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0030*/               @!P0 BRA `(.L_x_9) ;
.L_x_10:
        /*0040*/                   FFMA.SAT R28, R32, -R100, 0.5 ;
.L_x_2:
        /*0050*/                   FMUL R3, R4, R5 ;
        /*0060*/                   FMUL R3, R3, R5 ;
        /*0070*/               @P1 BRA `(.L_x_2) ;
        /*0080*/                   F2FP.BF16.F32.PACK_AB R6, R3, R3 ;
        /*0090*/                   ISETP.NE.AND P2, PT, R7, RZ, PT ;
        /*00a0*/               @P2 BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
.L_x_9:
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*00d0*/               @!P0 BRA `(.L_x_9) ;
        /*00e0*/                   BRA `(.L_x_10) ;
.L_x_11:
        /*00f0*/                   BRA `(.L_x_11) ;
"""


def test_listing_names_each_label_and_branch_target():
    found = listing(SASS)
    assert found.labels == {".L_x_1": 3, ".L_x_10": 5, ".L_x_2": 6, ".L_x_9": 13, ".L_x_11": 16}
    assert len(found.opcodes) == 17 and found.opcodes[5] == "FFMA.SAT"
    assert [t for t in found.targets if t] == [
        ".L_x_9",
        ".L_x_2",
        ".L_x_1",
        ".L_x_9",
        ".L_x_10",
        ".L_x_11",
    ]
    assert base("F2FP.BF16.F32.PACK_AB") == "F2FP"


def test_loops_are_the_back_edges_before_exit_innermost_first():
    found = loops(listing(SASS))
    assert [(loop.head, loop.first, loop.last, loop.size) for loop in found] == [
        (".L_x_2", 6, 8, 3),
        (".L_x_1", 3, 11, 9),
    ]
    assert found[0].opcodes == {"FMUL": 2, "BRA": 1}
    assert found[1].opcodes["BRA"] == 3 and found[1].opcodes["FFMA"] == 1
    # Control: without the EXIT, the slow path's jumps back into the body count as loops.
    assert len(loops(listing(SASS.replace("EXIT", "NOP")))) == 5


def test_report_lists_each_loop_then_the_kernel():
    lines = report(listing(SASS), top=2).splitlines()
    assert lines == [
        "loop at .L_x_2 (instructions 6-8): 3 instructions: FMUL 2 BRA 1",
        "loop at .L_x_1 (instructions 3-11): 9 instructions: BRA 3 FMUL 2",
        "kernel: 17 instructions: BRA 6 EXIT 2",
    ]


def test_maxnreg_follows_each_entrys_maxntid():
    ptx = ".entry k(\n)\n.maxntid 256, 1, 1\n{\n}\n"
    assert ".maxntid 256, 1, 1\n.maxnreg 128\n{" in with_maxnreg(ptx, 128)
    with pytest.raises(ValueError, match="maxntid"):
        with_maxnreg(".entry k()\n{\n}\n", 128)


def test_a_missing_tool_says_where_it_was_looked_for():
    with pytest.raises(FileNotFoundError, match="neither on PATH nor in an NVIDIA pip package"):
        tool("no_such_cuda_tool")
