"""tools/hopper_program.py's reading of a compiled program (the compiling itself needs JAX's
CUDA plugin, which CI does not install): the entry computation's launching instructions, in
order, multi-output fusions, collectives and the root included, parameters, tuples and
bitcasts left out; the memory line."""

import jax
import jax.numpy as jnp

from tools.hopper_program import LAUNCHING, is_collective, launches, memory_line  # noqa: E402

HLO = """HloModule m

%fused_reduce (p: s32[4,128]) -> s32[4] {
  %p = s32[4,128]{1,0} parameter(0)
  ROOT %r = s32[4]{0} reduce(%p, %c), dimensions={1}, to_apply=%add
}

ENTRY %main (a: s32[4,128], b: bf16[64,8]) -> (s32[4], bf16[64,8]) {
  %a = s32[4,128]{1,0} parameter(0)
  %b = bf16[64,8]{1,0} parameter(1)
  %input_reduce_fusion = s32[4]{0} fusion(%a), metadata={op_name="jit(f)/plan/reduce_sum"}
  %pair = (s32[64,8]{1,0}, s32[64,8]{1,0}) fusion(%b), kind=kLoop, calls=%fused_pair
  %gte = s32[64,8]{1,0} get-tuple-element(%pair), index=0
  %bitcast.1 = s32[512]{0} bitcast(%gte)
  %sort.3 = s32[512]{0} sort(%bitcast.1), dimensions={0}, to_apply=%less
  %mpmd_map.5 = bf16[64,8]{1,0} custom-call(%b, %sort.3), metadata={op_name="jit(f)/fc1/mpmd_map"}
  %all-to-all-start = ((bf16[64,8]{1,0}), bf16[64,8]{1,0}) all-to-all-start(%mpmd_map.5), replica_groups={{0,1}}
  %all-to-all-done = bf16[64,8]{1,0} all-to-all-done(%all-to-all-start)
  %all-reduce.2 = f32[] all-reduce(%c), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[4]{0}, bf16[64,8]{1,0}) tuple(%input_reduce_fusion, %mpmd_map.5)
}
"""


def test_the_entry_computations_launches_in_order():
    found = launches(HLO)
    assert [(k["name"], k["opcode"]) for k in found] == [
        ("input_reduce_fusion", "fusion"),
        ("pair", "fusion"),
        ("sort.3", "sort"),
        ("mpmd_map.5", "custom-call"),
        ("all-to-all-start", "all-to-all-start"),
        ("all-to-all-done", "all-to-all-done"),
        ("all-reduce.2", "all-reduce"),
    ]
    assert found[0]["op_name"] == "jit(f)/plan/reduce_sum" and found[1]["op_name"] == ""
    assert found[3]["op_name"] == "jit(f)/fc1/mpmd_map"
    assert found[1]["shape"] == "(s32[64,8]{1,0}, s32[64,8]{1,0})"


def test_a_compiled_program_is_read():
    """An XLA:CPU program (the same HLO text form): its sort is found, nothing else but
    launching instructions is listed."""
    x = jnp.arange(256, dtype=jnp.float32)[::-1]
    text = jax.jit(lambda x: jnp.sort(x) * jnp.sum(x)).lower(x).compile().as_text()
    found = launches(text)
    assert "sort" in [k["opcode"] for k in found]
    assert all(k["opcode"] in LAUNCHING for k in found)


def test_collectives_are_listed_and_nothing_else_new():
    assert is_collective("all-to-all") and is_collective("ragged-all-to-all-start")
    assert is_collective("all-gather-done") and is_collective("collective-permute")
    assert not is_collective("bitcast") and not is_collective("get-tuple-element")
    assert not is_collective("all-to-all-begin")


def test_the_memory_line_gives_the_programs_buffers():
    """An XLA:CPU program's arguments (4 MiB of fp32) and outputs, in GiB."""
    x = jnp.zeros((1024, 1024), jnp.float32)
    line = memory_line(jax.jit(lambda x: x @ x).lower(x).compile())
    assert line.startswith("memory a GPU: arguments 0.00391 GiB, outputs 0.00391 GiB, temporaries")
