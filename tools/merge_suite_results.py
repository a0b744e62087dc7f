"""Merge the `--results-json` records of several pytest processes (the GPU suite runs one per
layer case, see README "On the GPU") into one record for benchmarks/results.

    python tools/merge_suite_results.py OUT.json PART.json [PART.json ...]

The merged record keeps the first part's environment (date, device, platform, jax), lists every
part's command and git commit, concatenates the tests (each tagged with its part's file name)
and sums the summary. Parts that disagree on device or jax version are refused: they are not
one run."""

from __future__ import annotations

import json
import os
import sys


def merge(parts: dict[str, dict]) -> dict:
    """The merged record of {part name: record}."""
    if not parts:
        raise ValueError("merge_suite_results: no parts")
    first = next(iter(parts.values()))
    for name, part in parts.items():
        for key in ("device", "jax"):
            if part[key] != first[key]:
                raise ValueError(
                    f"merge_suite_results: {name} ran on {key} {part[key]!r}, not {first[key]!r}"
                )
    commits = {name: part["git_commit"] for name, part in parts.items()}
    distinct = set(commits.values())
    return dict(
        date=first["date"],
        device=first["device"],
        platform=first["platform"],
        jax=first["jax"],
        git_commit=distinct.pop() if len(distinct) == 1 else None,
        part_git_commit=commits,
        command={name: part["command"] for name, part in parts.items()},
        summary={k: sum(p["summary"].get(k, 0) for p in parts.values()) for k in first["summary"]},
        tests=[dict(t, part=name) for name, part in parts.items() for t in part["tests"]],
    )


def main(argv=None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        raise SystemExit(__doc__)
    out, *paths = args
    parts = {}
    for path in paths:
        with open(path) as f:
            parts[os.path.basename(path)] = json.load(f)
    merged = merge(parts)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    print(merged["summary"], "->", out)
    return merged


if __name__ == "__main__":
    main()
