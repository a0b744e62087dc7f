"""benchmarks/research/decode_trace.py's reading of a Mosaic profiler trace (the trace itself needs a GPU)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.research.decode_trace import regions_by_warpgroup, trace_summary
from jaxmoe.ops.pallas.regions import KernelTrace, named


def events(tid, regions):
    """Begin/end events of nested (name, enter, leave) regions, ts in cycles / 1000 as Mosaic
    writes them."""
    marks = []
    for name, enter, leave in regions:
        marks += [(enter, 1, "B", name), (leave, 0, "E", name)]
    marks.sort(key=lambda m: (m[0], m[1]))  # a region left at t closes before one entered at t
    return [dict(name=n, ph=ph, ts=t / 1e3, pid=1, tid=tid) for t, _, ph, n in marks]


# One CTA: compute warpgroups (tids 1, 2) each run an item of two steps and an epilogue; the
# memory warpgroup (tid 3) runs the item only.
COMPUTE = [("item", 0, 1000), ("step", 100, 400), ("step", 500, 800), ("epilogue", 850, 950)]
TRACE = events(1, COMPUTE) + events(2, COMPUTE) + events(3, [("item", 0, 900)])


def test_regions_pair_nested_begin_and_end_events():
    by_tid = regions_by_warpgroup(TRACE)
    assert by_tid[3] == [("item", 0.0, 900.0)]
    assert sorted(by_tid[1]) == sorted((n, float(a), float(b)) for n, a, b in COMPUTE)


def test_summary_splits_roles_and_sums_regions_and_step_gaps():
    summary = trace_summary(TRACE, warpgroups=3)
    compute, memory = summary["compute"], summary["memory"]
    assert compute["warpgroups"] == 2 and memory["warpgroups"] == 1
    assert compute["span"] == 1000 and memory["span"] == 900
    assert compute["n_step"] == 2 and compute["sum_step"] == 600
    assert compute["step_gaps"] == 100 and compute["step_median"] == 300
    assert compute["first_step"] == 100
    assert compute["share_step"] == pytest.approx(0.6)
    assert compute["share_epilogue"] == pytest.approx(0.1)
    assert compute["share_step_gaps"] == pytest.approx(0.1)
    assert memory["sum_item"] == 900 and "step_gaps" not in memory


def test_busy_spans_leave_out_idle_warpgroups():
    """The spread of the busy warpgroups' spans: a second CTA whose compute warpgroups ran one
    step twice as long, a third that only entered its profiler's Init region (no items)."""
    slow = [("item", 0, 2000), ("step", 100, 1900)]
    idle = [("Init", 0, 50)]
    trace = TRACE + events(4, slow) + events(5, slow) + events(7, idle) + events(8, idle)
    compute = trace_summary(trace, warpgroups=3)["compute"]
    assert compute["warpgroups"] == 6
    assert compute["busy_spans"] == {0: 1000, 10: 1000, 50: 2000, 90: 2000, 100: 2000}
    assert compute["busy_mean_over_max"] == pytest.approx(0.75)
    assert compute["max_span"] == 2000
    assert "busy_spans" not in trace_summary(TRACE, warpgroups=3)["memory"]  # no waits: idle


def test_kernel_trace_refuses_an_empty_buffer():
    assert KernelTrace("/tmp/t", 16).compiler_params()["profile_space"] == 16
    with pytest.raises(ValueError, match="max_regions"):
        KernelTrace("/tmp/t", 0).compiler_params()


def test_a_named_region_changes_no_equation():
    """Without a trace, a region is only a name scope: the same equations (Mosaic lowers the
    decode kernel to the same module with or without its regions; checked once, 2026-12-03)."""

    def f(x):
        return jnp.sin(x) * 2.0

    plain = jax.make_jaxpr(f)(1.0)
    scoped = jax.make_jaxpr(named("step")(f))(1.0)
    assert str(scoped) == str(plain)
    assert [e.source_info.name_stack.stack[-1].name for e in scoped.eqns] == ["step"] * 2
