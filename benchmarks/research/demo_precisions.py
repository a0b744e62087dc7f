"""The demo's final loss by precision over several seeds, against bf16 and against bf16 with a
perturbation of the last bits only: `python -m benchmarks.research.demo_precisions [--seeds 0-5]`.

Training the demo is chaotic: a change in the last bits of a few gradient elements (bf16 with
each expert's rows padded to 128, `bf16_pad128`; the preset pads none: the same values, another
blocking of the weight gradient's row sums) moves the loss after 300 steps by a few percent.
So a precision's loss is compared with bf16's seed by seed, and the spread of that ratio with
the spread of `bf16_pad128`'s: a precision that trains as well as bf16 has ratios like the
control's. Runs on the default backend (CPU is fine: the same numerics as the GPU's up to
rounding). Writes benchmarks/results/demo_precisions_<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks import report
from benchmarks.report import add_output_arguments, log
from jaxmoe import demo

CONTROL = "bf16_pad128"


def seeds_from(text: str) -> list[int]:
    """ "0-5" or "0,3,7"."""
    if "-" in text:
        first, last = (int(v) for v in text.split("-"))
        return list(range(first, last + 1))
    return [int(v) for v in text.split(",")]


def run(precision: str, seed: int, steps: int) -> float:
    """The demo's relative loss after `steps` steps."""
    if precision == CONTROL:
        metrics = demo.train(
            precision="bf16", steps=steps, seed=seed, quiet=True, row_alignment=128
        )
    else:
        metrics = demo.train(precision=precision, steps=steps, seed=seed, quiet=True)
    return metrics["loss"]


def summarize(records: list, precisions: list) -> list:
    """Per precision: each seed's loss / bf16's, their mean, sd and extremes."""
    bf16 = {r["seed"]: r["loss"] for r in records if r["precision"] == "bf16"}
    summary = []
    for precision in precisions:
        ratios = [r["loss"] / bf16[r["seed"]] for r in records if r["precision"] == precision]
        summary.append(
            dict(
                precision=precision,
                seeds=len(ratios),
                mean_ratio_to_bf16=statistics.mean(ratios),
                sd_ratio=statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                min_ratio=min(ratios),
                max_ratio=max(ratios),
            )
        )
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default=f"mxfp8,fp8_blockwise,{CONTROL}")
    parser.add_argument("--seeds", default="0-5")
    parser.add_argument("--steps", type=int, default=300)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p and p != "bf16"]
    unknown = set(precisions) - set(demo.PRECISIONS) - {CONTROL}
    if unknown:
        parser.error(f"unknown precisions {sorted(unknown)}; known: {sorted(demo.PRECISIONS)}")
    result = report.environment(
        "demo_precisions", steps=args.steps, preset="mixtral", control=CONTROL
    )
    result["command"] = " ".join(sys.argv if argv is None else argv)
    records = []
    for seed in seeds_from(args.seeds):
        for precision in ["bf16", *precisions]:
            loss = run(precision, seed, args.steps)
            records.append(dict(precision=precision, seed=seed, loss=loss))
            log(f"seed {seed} {precision:14s} loss {loss:.4f}")
    result.update(records=records, summary=summarize(records, precisions))
    for row in result["summary"]:
        log(
            "{precision:14s} loss / bf16: mean {mean_ratio_to_bf16:.4f} sd {sd_ratio:.4f} "
            "range {min_ratio:.4f}..{max_ratio:.4f} over {seeds} seeds".format(**row)
        )
    path = report.result_path(args.out, "demo_precisions", args.tag)
    report.write_result(result, path)
    log(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
