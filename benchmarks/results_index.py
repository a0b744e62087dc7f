"""The index of the benchmark records: benchmarks/RESULTS.md, generated from the JSON files in
benchmarks/results.

    python -m benchmarks.results_index            # writes benchmarks/RESULTS.md
    python -m benchmarks.results_index --check    # exits 1 when RESULTS.md is stale
    python -m benchmarks.results_index --archive  # first git mv's unneeded records into archive/

Every JSON record in the results folder (not its companions: `<record>_kernels.json`, the
layer benchmark's profiled kernels, and `<record>.png`, a plot) is read and split into rows, one
per benchmark part, shape and card: the layer benchmark's train and inference modes, for
instance, or one row per test module of a GPU suite record. RESULTS.md lists the latest record
of each (by the record's time, else its date, else the file name's), linked to its file, with
its date, the commit it names (if any), its card and the headline numbers its format has (a
small extractor per benchmark; a record whose format none knows gets a row without them).

--archive moves into results/archive/ (with `git mv`) the records that no row lists and that no
document cites: README.md, bridge/README.md, every page under docs/ but the results ledger, and
jaxmoe/ name a record by its file name (or its stem, or a shell pattern with `*`, `{a,b}` or
`{1..5}`), or one of its companions'. --check also fails when README.md, bridge/README.md or a
page under docs/ (not docs/notes/, diaries left as written) names a results file that is in
neither benchmarks/results, its archive/ nor its profiles/.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import glob
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable

from benchmarks.report import RESULTS_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX_PATH = os.path.join(REPO, "benchmarks", "RESULTS.md")
ARCHIVE = "archive"
# Pages whose citations keep a record out of the archive; the ledger cites nearly every record.
CITING = ("README.md", "bridge/README.md", "docs/**/*.md", "jaxmoe/**/*.py")
LEDGER = "docs/notes/2026-12-07-results-ledger.md"
# Pages whose every named results file must exist (the notes are diaries, left as written).
CHECKED = ("README.md", "bridge/README.md", "docs/**/*.md")
NOTES = "docs/notes/"
# The user's benchmarks first, in this order, then any other benchmarks/NAME.py's records.
USER_ORDER = ("layer", "gmm", "decode", "ep", "gpu_suite")
# Records whose benchmark name is not their script's (benchmarks/NAME.py or research/NAME.py).
COMMANDS = {
    "gpu_suite": "make test-gpu",
    "gmm_fp8_blockwise": "python -m benchmarks.research.gmm_fp8_blockwise_tiling",
}
# The README's headline tables: these benchmarks' rows, between the two marker lines.
HEADLINES = ("train", "layer (train)", "decode (layer)")
README_BEGIN = "<!-- headline results: written by python -m benchmarks.results_index -->"
README_END = "<!-- end of headline results -->"
MAX_ITEMS = 8  # headline numbers a row shows before "+N more"
_DATED = re.compile(r"^(?P<prefix>.+?)_(?P<date>\d{4}-\d\d-\d\d)")
_CITATION = re.compile(r"[\w.{}*,/-]*\d{4}-\d\d-[\w.{}*,/-]*")


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the index: a record's numbers for one benchmark part, shape and card."""

    benchmark: str  # the benchmark, with its part in parentheses where it has several
    shape: str
    card: str
    date: str
    commit: str
    file: str  # the record's file name in the results folder
    headline: str
    order: tuple  # what "latest" compares: (time or date, the file name's natural order)


def natural_key(name: str) -> tuple:
    """The file name with its digit runs compared as numbers (run2 before run10)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def fmt(value, unit: str = "") -> str | None:
    """A number with three or four significant digits and its unit; None for a non-number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    a = abs(value)
    text = (
        f"{value:.0f}"
        if a >= 100
        else f"{value:.1f}"
        if a >= 10
        else f"{value:.2f}"
        if a >= 1
        else f"{value:.3g}"
    )
    return f"{text}{unit}" if unit in ("", "x") else f"{text} {unit}"


def dicts(value) -> list[dict]:
    """The dict items of a list (a record's entries), nothing for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


# (part, shape) -> {group: [items]}: what an extractor returns; joined into the headline.
Parts = dict[tuple[str, str], dict[str, list[str]]]


def collect(
    entries: Iterable[dict],
    part: Callable[[dict], str],
    group: Callable[[dict], str],
    item: Callable[[dict], str | None],
    shape: Callable[[dict], object] = lambda e: e.get("shape"),
) -> Parts:
    """Group a record's entries by part and shape, then by `group` within the headline; entries
    without a shape are left out, those whose `item` is None counted under their shape only."""
    parts: Parts = {}
    for e in entries:
        name = shape(e)
        if not isinstance(name, str):
            continue
        groups = parts.setdefault((part(e), name), {})
        text = item(e)
        if text is not None:
            groups.setdefault(group(e), []).append(text)
    return parts


def headline(groups: dict[str, list[str]]) -> str:
    """ "group: a, b; group2: c", at most MAX_ITEMS items, then how many more."""
    shown, out = 0, []
    total = sum(len(items) for items in groups.values())
    for name, items in groups.items():
        items = items[: MAX_ITEMS - shown]
        if not items:
            break
        shown += len(items)
        out.append(f"{name}: {', '.join(items)}" if name else ", ".join(items))
    more = f"; +{total - shown} more" if total > shown else ""
    return "; ".join(out) + more


def labelled(label: str, value, unit: str) -> str | None:
    """ "label value unit", None where the value is not a number."""
    text = fmt(value, unit)
    return f"{label} {text}" if text is not None else None


def tokens_group(e: dict) -> str:
    """The headline group of an entry timed at a token count: "T=64"."""
    return f"T={e['tokens']}" if "tokens" in e else ""


def layer_parts(d: dict) -> Parts:
    """benchmarks/layer.py: each implementation's ms a step, per mode."""
    return collect(
        dicts(d.get("records")),
        part=lambda e: str(e.get("mode", "")),
        group=lambda e: "",
        item=lambda e: labelled(str(e.get("impl")), e.get("ms"), "ms"),
    )


def gmm_parts(d: dict) -> Parts:
    """benchmarks/gmm.py: jaxmoe's and torch's ms per op on the Dirichlet routing."""
    return collect(
        (
            e
            for e in dicts(d.get("results"))
            if e.get("routing", "dirichlet") == "dirichlet"
            and e.get("impl") in ("jaxmoe", "torch_grouped_mm")
        ),
        part=lambda e: "",
        group=lambda e: str(e.get("op")),
        item=lambda e: labelled(str(e.get("impl")), e.get("ms"), "ms"),
    )


def gmm_mxfp8_parts(d: dict) -> Parts:
    """benchmarks/research/gmm_mxfp8.py: GEMM ms per op of jaxmoe's recipes and torch's; the
    quantize kernels' TB/s."""
    shown = (
        "jaxmoe_bf16",
        "jaxmoe_fp8_blockwise",
        "jaxmoe_mxfp8_dequant",
        "torch_scaled_grouped_mm",
    )
    entries = dicts(d.get("results"))
    gemms = collect(
        (e for e in entries if e.get("op") != "quantize" and e.get("impl") in shown),
        part=lambda e: "gemm",
        group=lambda e: str(e.get("op")),
        item=lambda e: labelled(str(e.get("impl")), e.get("ms"), "ms"),
    )
    quantizes = collect(
        (e for e in entries if e.get("op") == "quantize"),
        part=lambda e: "quantize",
        group=lambda e: "",
        item=lambda e: labelled(str(e.get("impl")), e.get("tbps"), "TB/s"),
    )
    return gemms | quantizes


def decode_parts(d: dict) -> Parts:
    """benchmarks/decode.py: each implementation's us a call, per part (gmm, layer) and token
    count."""
    return collect(
        dicts(d.get("records")),
        part=lambda e: str(e.get("part", "")),
        group=tokens_group,
        item=lambda e: labelled(str(e.get("impl")), e.get("us"), "us"),
    )


def ep_parts(d: dict) -> Parts:
    """benchmarks/ep.py: the layer steps' ms (implementation, ep, dispatch wire, transport) and
    the exchange ops' ms."""
    shape = d.get("shape")
    name = shape.get("name") if isinstance(shape, dict) else shape

    def step(e: dict) -> str | None:
        transport = e.get("transport")
        via = f"/{transport}" if transport not in (None, "-") else ""
        label = f"{e.get('impl')} ep={e.get('ep')} {e.get('dispatch')}{via}"
        return labelled(label, e.get("ms"), "ms")

    layer = collect(
        dicts(d.get("layer")),
        part=lambda e: "layer",
        group=lambda e: "",
        item=step,
        shape=lambda e: name,
    )
    exchange = collect(
        dicts(d.get("exchange")),
        part=lambda e: "exchange",
        group=lambda e: f"ep={e.get('ep')}",
        item=lambda e: labelled(
            " ".join(str(e.get(k)) for k in ("exchange", "pass", "wire") if e.get(k) != "-"),
            e.get("ms"),
            "ms",
        ),
        shape=lambda e: name,
    )
    return layer | exchange


def gpu_suite_parts(d: dict) -> Parts:
    """make test-gpu: per test module, how many tests passed, failed and were skipped."""
    counts: dict[str, dict[str, int]] = {}
    for t in dicts(d.get("tests")):
        test = t.get("test")
        if not isinstance(test, str):
            continue
        module = os.path.basename(test.split("::")[0]).removesuffix(".py")
        outcome = counts.setdefault(module, {"passed": 0, "failed": 0, "skipped": 0})
        key = t.get("outcome")
        outcome[key] = outcome.get(key, 0) + 1
    return {("", module): {"": [f"{n} {k}" for k, n in c.items()]} for module, c in counts.items()}


def activation_parts(d: dict) -> Parts:
    """benchmarks/research/activation.py: each variant's us."""
    shapes = d.get("shapes")
    parts: Parts = {}
    for name, s in shapes.items() if isinstance(shapes, dict) else ():
        variants = s.get("variants") if isinstance(s, dict) else None
        if not isinstance(variants, dict):
            continue
        items = [labelled(v, r.get("us"), "us") for v, r in variants.items() if isinstance(r, dict)]
        parts[("", name)] = {"": [i for i in items if i is not None]}
    return parts


def records_parts(
    metric: str, unit: str, label: Callable[[dict], str], keep: Callable[[dict], bool]
) -> Callable[[dict], Parts]:
    """An extractor of a `records` list: `label` and `metric` of each entry `keep` takes,
    grouped by token count where entries have one."""

    def parts(d: dict) -> Parts:
        return collect(
            (e for e in dicts(d.get("records")) if keep(e)),
            part=lambda e: "",
            group=tokens_group,
            item=lambda e: labelled(label(e), e.get(metric), unit),
        )

    return parts


def wire_gather_parts(d: dict) -> Parts:
    """benchmarks/research/wire_gather.py: each route's us (the `*_us` fields), per token count."""
    return collect(
        dicts(d.get("records")),
        part=lambda e: "",
        group=tokens_group,
        item=lambda e: (
            ", ".join(
                filter(
                    None,
                    (
                        labelled(k.removesuffix("_us"), v, "us")
                        for k, v in e.items()
                        if k.endswith("_us")
                    ),
                )
            )
            or None
        ),
    )


def gmm_power_parts(d: dict) -> Parts:
    """benchmarks/research/gmm_power.py: each implementation's sustained TFLOP/s, per op (round
    0)."""
    return collect(
        (e for e in dicts(d.get("records")) if e.get("round", 0) == 0),
        part=lambda e: "",
        group=lambda e: str(e.get("op")),
        item=lambda e: labelled(str(e.get("impl")), e.get("sustained_tflops"), "TFLOP/s"),
    )


def fp8_step_ceiling_parts(d: dict) -> Parts:
    """benchmarks/research/fp8_step_ceiling.py: the measured speed-ups over bf16 and the
    ceiling at the measured GEMMs."""
    shapes = d.get("shapes")
    parts: Parts = {}
    for name, s in shapes.items() if isinstance(shapes, dict) else ():
        if not isinstance(s, dict):
            continue
        measured = s.get("measured_speedup") or {}
        ceiling = (s.get("ceiling_speedup") or {}).get("measured") or {}
        items = [
            labelled("measured", measured.get("uncached"), "x"),
            labelled("cached weights", measured.get("cached"), "x"),
            labelled("ceiling", ceiling.get("measured"), "x"),
        ]
        parts[("", name)] = {"": [i for i in items if i is not None]}
    return parts


def demo_precisions_parts(d: dict) -> Parts:
    """benchmarks/research/demo_precisions.py: each precision's final loss over bf16's (the
    mean over seeds)."""
    return collect(
        dicts(d.get("summary")),
        part=lambda e: "",
        group=lambda e: "",
        item=lambda e: labelled(str(e.get("precision")), e.get("mean_ratio_to_bf16"), "x"),
        shape=lambda e: d.get("preset"),
    )


def train_parts(d: dict) -> Parts:
    """benchmarks/train.py: each implementation's tokens/s and MFU (the model as the shape)."""
    impls = d.get("impls") if isinstance(d.get("impls"), dict) else {}
    items = []
    for name, r in impls.items():
        if not isinstance(r, dict) or not isinstance(r.get("tokens_per_s"), (int, float)):
            items.append(f"{name} failed")
            continue
        mfu = r.get("mfu")
        items.append(
            f"{name} {r['tokens_per_s'] / 1e3:.1f}k tokens/s"
            + (f" (MFU {100 * mfu:.1f}%)" if isinstance(mfu, (int, float)) else "")
        )
    shape = f"{d.get('model')} seq {d.get('seq_len')} x {d.get('batch')}"
    return {("", shape): {"": items}}


EXTRACTORS: dict[str, Callable[[dict], Parts]] = {
    "train": train_parts,
    "layer": layer_parts,
    "gmm": gmm_parts,
    "decode": decode_parts,
    "ep": ep_parts,
    "gpu_suite": gpu_suite_parts,
    "activation": activation_parts,
    "decode_trace": records_parts(
        "kernel_us", "us", lambda e: str(e.get("gemm")), keep=lambda e: True
    ),
    "demo_precisions": demo_precisions_parts,
    "fp8_step_ceiling": fp8_step_ceiling_parts,
    "gmm_fp8_blockwise": records_parts(
        "us", "us", lambda e: str(e.get("impl")), keep=lambda e: True
    ),
    "gmm_mxfp8": gmm_mxfp8_parts,
    "gmm_power": gmm_power_parts,
    "router": records_parts(
        "us",
        "us",
        lambda e: str(e.get("impl")),
        keep=lambda e: e.get("impl") in ("dense", "xla_dot"),
    ),
    "wire_gather": wire_gather_parts,
}


def companions(name: str) -> tuple[str, ...]:
    """The files that belong to the record `name` (X.json): X_kernels.json and X.png."""
    stem = name.removesuffix(".json")
    return (f"{stem}_kernels.json", f"{stem}.png")


def record_names(results_dir: str) -> list[str]:
    """The JSON records directly in results_dir (not their companions), in natural order."""
    names = {os.path.basename(p) for p in glob.glob(os.path.join(results_dir, "*.json"))}
    records = [n for n in names if not any(n in companions(other) for other in names)]
    return sorted(records, key=natural_key)


def first_str(*values) -> str:
    """The first of values that is a non-empty string ("" when none is)."""
    return next((v for v in values if isinstance(v, str) and v), "")


def record_rows(name: str, record) -> list[Row]:
    """The index rows of one record (`record`: its parsed JSON)."""
    d = record if isinstance(record, dict) else {}
    dated = _DATED.match(name)
    benchmark = first_str(d.get("benchmark"), dated and dated["prefix"], name.removesuffix(".json"))
    date = first_str(d.get("date"), dated and dated["date"])[:10]
    when = first_str(d.get("time"), d.get("date"), date)
    commit = first_str(d.get("git_commit"), d.get("commit"), d.get("tree"), d.get("base_commit"))
    shapes = d.get("shapes")
    nested = (
        [s.get("device") for s in shapes.values() if isinstance(s, dict)]
        if isinstance(shapes, dict)
        else []
    )
    card = first_str(d.get("device"), *nested).removeprefix("NVIDIA ")
    devices = d.get("device_count")
    if isinstance(devices, int) and devices > 1:
        card = f"{card} x{devices}"
    extract = EXTRACTORS.get(benchmark)
    parts = extract(d) if extract else {}
    if not parts:
        parts = {("", "-"): {}}
    return [
        Row(
            benchmark=f"{benchmark} ({part})" if part else benchmark,
            shape=shape,
            card=card or "-",
            date=date or "-",
            commit=re.sub(r"^([0-9a-f]{10})[0-9a-f]+", r"\1", commit) or "-",
            file=name,
            headline=headline(groups),
            order=(when, natural_key(name)),
        )
        for (part, shape), groups in parts.items()
    ]


def latest_rows(results_dir: str) -> list[Row]:
    """The latest row per benchmark (part), shape and card, sorted: the user's benchmarks first."""
    latest: dict[tuple[str, str, str], Row] = {}
    for name in record_names(results_dir):
        with open(os.path.join(results_dir, name)) as f:
            try:
                record = json.load(f)
            except json.JSONDecodeError:
                record = None
        for row in record_rows(name, record):
            key = (row.benchmark, row.shape, row.card)
            if key not in latest or row.order > latest[key].order:
                latest[key] = row
    return sorted(latest.values(), key=section_key)


def base_name(benchmark: str) -> str:
    """The benchmark of a row's benchmark column, without its part."""
    return benchmark.split(" (")[0]


def is_user(name: str) -> bool:
    """Whether benchmark `name` is one of the user's: the GPU suite or a benchmarks/NAME.py."""
    return name == "gpu_suite" or os.path.exists(os.path.join(REPO, "benchmarks", f"{name}.py"))


def section_key(row: Row) -> tuple:
    """The index's order: the user's benchmarks (USER_ORDER, then by name), then the others by
    name; within one, by part, shape and card."""
    name = base_name(row.benchmark)
    rank = USER_ORDER.index(name) if name in USER_ORDER else len(USER_ORDER)
    return (not is_user(name), rank, row.benchmark, natural_key(row.shape), row.card)


def command(name: str) -> str:
    """How the records of benchmark `name` are made ("" when no script of that name exists)."""
    if name in COMMANDS:
        return COMMANDS[name]
    for package in ("benchmarks", "benchmarks.research"):
        if os.path.exists(os.path.join(REPO, *package.split("."), f"{name}.py")):
            return f"python -m {package}.{name}"
    return ""


def cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("|", "\\|")


def render(rows: list[Row]) -> str:
    """RESULTS.md's text."""
    out = [
        "# Benchmark results: the latest record of each benchmark, shape and card",
        "",
        "Generated by `python -m benchmarks.results_index` from the JSON records in",
        "[results/](results/) (`--check` fails when this file is stale). Each row is the newest",
        "record of its benchmark (and part), shape and card, linked to its file; the headline",
        "numbers are as the benchmark recorded them, medians where it times several runs (see",
        "[docs/performance.md](../docs/performance.md) for how each is measured). Older records",
        "that the docs cite stay in results/; the others are in results/archive/ (and in git",
        "history), which this index does not list. results/profiles/ holds Nsight Compute",
        "reports (text).",
    ]
    for user, group in itertools.groupby(rows, key=lambda r: is_user(base_name(r.benchmark))):
        out += ["", "## The user's benchmarks" if user else "## Research and profiling"]
        for benchmark, section in itertools.groupby(group, key=lambda r: r.benchmark):
            how = command(base_name(benchmark))
            out += ["", f"### {benchmark}" + (f" (`{how}`)" if how else ""), ""]
            out += [
                "| shape | card | date | commit | headline | record |",
                "|---|---|---|---|---|---|",
            ]
            for r in section:
                out.append(
                    f"| {cell(r.shape)} | {cell(r.card)} | {r.date} | {r.commit} | "
                    f"{cell(r.headline) or '-'} | [{r.file}](results/{r.file}) |"
                )
    return "\n".join(out) + "\n"


def render_headlines(rows: list[Row]) -> str:
    """The README's headline tables (HEADLINES' rows), linked from the repo root."""
    out = []
    for benchmark in HEADLINES:
        section = [r for r in rows if r.benchmark == benchmark]
        if not section:
            continue
        how = command(base_name(benchmark))
        out += ["", f"**{benchmark}**" + (f" (`{how}`)" if how else ""), ""]
        out += ["| shape | card | date | commit | headline |", "|---|---|---|---|---|"]
        out += [
            f"| {cell(r.shape)} | {cell(r.card)} | {r.date} | {r.commit} | "
            f"[{cell(r.headline) or '-'}](benchmarks/results/{r.file}) |"
            for r in section
        ]
    return "\n".join(out[1:])


def with_headlines(readme: str, rows: list[Row]) -> str:
    """`readme` with the text between its marker lines replaced by `render_headlines` (unchanged
    when it has no markers)."""
    if README_BEGIN not in readme or README_END not in readme:
        return readme
    head, rest = readme.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{render_headlines(rows)}\n{README_END}{tail}"


def expand_braces(pattern: str) -> list[str]:
    """Shell brace expansion: "a_{x,y}.json" and "run{1..3}" into their names."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    options = [str(i) for i in range(int(r[1]), int(r[2]) + 1)] if r else body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [name for o in options for name in expand_braces(head + o + tail)]


def named_files(text: str) -> list[str]:
    """The dated file names (or paths, stems, patterns) that `text` names, braces expanded."""
    return [
        name.rstrip(".,;:")
        for token in _CITATION.findall(text)
        for name in expand_braces(token.rstrip(".,;:"))
    ]


def cited(name: str, patterns: set[str]) -> bool:
    """Whether a citation names record `name` or one of its companions."""
    files = (name, *companions(name))
    stems = {f.rsplit(".", 1)[0] for f in files}
    return any(fnmatch.fnmatchcase(f, p) for p in patterns for f in (*files, *stems))


def pages(repo: str, patterns: tuple[str, ...], left_out: str) -> list[str]:
    """The files under repo that match `patterns` (recursive globs), relative to repo, but for
    those starting with `left_out` (a file or a folder)."""
    found = {
        p for pattern in patterns for p in glob.glob(os.path.join(repo, pattern), recursive=True)
    }
    return sorted(
        r for r in (os.path.relpath(p, repo) for p in found) if not r.startswith(left_out)
    )


def read(repo: str, names: list[str]) -> str:
    """The text of the files `names` under repo, one after the other."""
    texts = []
    for name in names:
        with open(os.path.join(repo, name)) as f:
            texts.append(f.read())
    return "\n".join(texts)


def to_archive(results_dir: str, rows: list[Row], text: str) -> list[str]:
    """The records (with their companions) that no row lists and `text` does not cite."""
    listed = {r.file for r in rows}
    patterns = {os.path.basename(n) for n in named_files(text)}
    moved = []
    for name in record_names(results_dir):
        if name not in listed and not cited(name, patterns):
            moved += [
                f for f in (name, *companions(name)) if os.path.exists(os.path.join(results_dir, f))
            ]
    return moved


def archive(results_dir: str, names: list[str]) -> None:
    """git mv the files `names` from results_dir into results_dir/archive."""
    if not names:
        return
    target = os.path.join(results_dir, ARCHIVE)
    os.makedirs(target, exist_ok=True)
    paths = [os.path.join(results_dir, n) for n in names]
    subprocess.run(["git", "mv", *paths, target], check=True, cwd=REPO)


def missing_citations(repo: str, results_dir: str) -> list[tuple[str, str]]:
    """(page, name) for every results file a CHECKED page names that is not there: a path must
    exist under repo as written, a bare name in results_dir, its archive or its profiles."""
    missing = []
    for page in pages(repo, CHECKED, NOTES):
        for name in named_files(read(repo, [page])):
            if not name.endswith((".json", ".png", ".txt")) or name.startswith("_"):
                continue
            folders = (
                [repo]
                if "/" in name
                else [
                    results_dir,
                    os.path.join(results_dir, ARCHIVE),
                    os.path.join(results_dir, "profiles"),
                ]
            )
            if not any(glob.glob(os.path.join(folder, name)) for folder in folders):
                missing.append((page, name))
    return missing


def main(argv: list[str] | None = None) -> int:
    """Write RESULTS.md and the README's headline tables (--archive: after moving the unneeded
    records), or --check both."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS_DIR, help="the folder of the records")
    parser.add_argument("--index", default=INDEX_PATH, help="the index file to write or check")
    parser.add_argument("--repo", default=REPO, help="the tree whose pages cite the records")
    parser.add_argument(
        "--readme", default=None, help="the README with headline tables (default: the repo's)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the index is stale or a page names a results file that is not there",
    )
    mode.add_argument(
        "--archive",
        action="store_true",
        help="first git mv the records no row lists and no page cites into results/archive",
    )
    args = parser.parse_args(argv)
    args.readme = args.readme or os.path.join(args.repo, "README.md")
    rows = latest_rows(args.results)
    if args.archive:
        citing = read(args.repo, pages(args.repo, CITING, left_out=LEDGER))
        moved = to_archive(args.results, rows, citing)
        archive(args.results, moved)
        print(f"moved {len(moved)} files into {os.path.join(args.results, ARCHIVE)}")
    text = render(rows)
    if args.check:
        problems = [
            f"{page} names {name}, which is not there"
            for page, name in missing_citations(args.repo, args.results)
        ]
        current = open(args.index).read() if os.path.exists(args.index) else ""
        if current != text:
            problems.append(f"{args.index} is stale: run python -m benchmarks.results_index")
        readme = open(args.readme).read() if os.path.exists(args.readme) else ""
        if with_headlines(readme, rows) != readme:
            problems.append(f"{args.readme}'s headline tables are stale: run the same")
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    with open(args.index, "w") as f:
        f.write(text)
    print(f"wrote {args.index}: {len(rows)} rows")
    if os.path.exists(args.readme):
        readme = open(args.readme).read()
        with open(args.readme, "w") as f:
            f.write(with_headlines(readme, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
