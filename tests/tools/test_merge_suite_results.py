"""tools/merge_suite_results.py: the GPU suite's per-process records merged into one."""

import json
from pathlib import Path

import pytest

from tools import merge_suite_results


def part(commit, outcomes, device="NVIDIA H200"):
    return dict(
        date="2026-12-01T10:00:00+00:00",
        command="python -m pytest x",
        device=device,
        platform="Linux",
        jax="0.11.2",
        git_commit=commit,
        summary={o: outcomes.count(o) for o in ("passed", "failed", "skipped")},
        tests=[dict(test=f"t{i}", outcome=o) for i, o in enumerate(outcomes)],
    )


def test_merges_tests_summaries_and_commits(tmp_path):
    paths = []
    for name, record in (
        ("a.json", part("abc", ["passed", "failed"])),
        ("b.json", part("abc", ["passed"])),
    ):
        paths.append(str(tmp_path / name))
        Path(paths[-1]).write_text(json.dumps(record))
    out = tmp_path / "merged.json"
    merged = merge_suite_results.main([str(out), *paths])
    assert merged == json.loads(out.read_text())
    assert merged["summary"] == {"passed": 2, "failed": 1, "skipped": 0}
    assert [t["part"] for t in merged["tests"]] == ["a.json", "a.json", "b.json"]
    assert merged["git_commit"] == "abc" and merged["part_git_commit"] == {
        "a.json": "abc",
        "b.json": "abc",
    }


def test_mixed_commits_have_no_single_commit_and_other_devices_are_refused():
    merged = merge_suite_results.merge({"a": part("abc", ["passed"]), "b": part("def", ["passed"])})
    assert merged["git_commit"] is None
    with pytest.raises(ValueError, match="device"):
        merge_suite_results.merge(
            {"a": part("abc", []), "b": part("abc", [], device="NVIDIA A100")}
        )
