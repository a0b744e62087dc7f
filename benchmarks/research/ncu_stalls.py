"""Warp-stall samples of one kernel grouped by how often each SASS instruction ran.

    ncu --import report.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.research.ncu_stalls sass.csv [--kernel tgmm]

Instructions that ran equally often belong to the same loop level of the kernel (per row block,
per work item, per masked block, the memory warpgroup's loop, ...), so the groups show where a
persistent kernel's warps spend their time without reading the SASS. Prints, per execution
count, the share of all stall samples and the top stall reasons; with --mix the opcode counts
of the most-sampled group (a loop body's instruction budget); then the top instructions. A report
of several kernels has one section per kernel: --kernel picks the first whose name contains it.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line, without its predicate."""
    words = source.split()
    return words[1] if words[0].startswith("@") else words[0]


def kernel_section(rows: list[list[str]], name_part: str) -> list[list[str]]:
    """The rows of the first kernel whose name contains name_part (all rows when the CSV has no
    "Kernel Name" lines); ValueError naming the kernels when none matches."""
    starts = [i for i, row in enumerate(rows) if row and row[0] == "Kernel Name"]
    if not starts:
        return rows
    names = [rows[i][1] for i in starts]
    for start, end, name in zip(starts, starts[1:] + [len(rows)], names):
        if name_part in name:
            return rows[start + 1 : end]
    raise ValueError(f"no kernel named like {name_part!r} in the report: {names}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--instructions", type=int, default=15)
    parser.add_argument(
        "--mix",
        action="store_true",
        help="also the opcode mix of the most-sampled group (one loop body's instructions)",
    )
    parser.add_argument("--kernel", default="", help="a part of the kernel's name")
    args = parser.parse_args(argv)
    with open(args.csv) as f:
        rows = kernel_section(list(csv.reader(f)), args.kernel)
    header_at = next(i for i, row in enumerate(rows) if SAMPLES in row)
    header = rows[header_at]
    body = [r for r in rows[header_at + 1 :] if len(r) == len(header)]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[col[SAMPLES]]) for r in body) or 1.0
    groups = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])
    for r in body:
        group = groups[int(number(r[col["Instructions Executed"]]))]
        group[0] += number(r[col[SAMPLES]])
        group[1] += 1
        group[2].update({reason: number(r[col[reason]]) for reason in reasons})
    print(
        f"{total:.0f} stall samples over {len(body)} instructions\n"
        f"{'executed':>10} {'instrs':>6} {'samples':>8}  top reasons"
    )
    by_samples = sorted(groups.items(), key=lambda g: -g[1][0])
    for executed, (samples, count, why) in by_samples[: args.groups]:
        top = ", ".join(
            f"{reason[6:]} {100 * n / samples:.0f}%" for reason, n in why.most_common(3) if samples
        )
        print(f"{executed:>10} {count:>6} {100 * samples / total:7.1f}%  {top}")
    if args.mix and by_samples:
        executed = by_samples[0][0]
        mix = collections.Counter(
            opcode(r[col["Source"]])
            for r in body
            if int(number(r[col["Instructions Executed"]])) == executed
        )
        print(f"\nopcodes of the {sum(mix.values())} instructions executed {executed} times")
        for name, n in mix.most_common():
            print(f"{n:>6}  {name}")
    print("\ntop instructions")
    for r in sorted(body, key=lambda r: -number(r[col[SAMPLES]]))[: args.instructions]:
        executed = int(number(r[col["Instructions Executed"]]))
        print(
            f"{100 * number(r[col[SAMPLES]]) / total:5.1f}% x{executed:>8}  "
            f"{r[col['Source']].strip()[:70]}"
        )


if __name__ == "__main__":
    main()
