"""benchmarks/results_index.py: the committed RESULTS.md is what the script writes (so CI catches a
stale index) and the pages name no missing results file; on small made-up folders, the latest
record per benchmark part, shape and card, rows for unknown formats, the archive's choice and
the stale-index check itself."""

import json

from benchmarks import results_index


def write(folder, name, record):
    """A record file `name` in folder (a string written as is: a broken record)."""
    path = folder / name
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


def layer_record(date, shapes, ms, device="NVIDIA H200"):
    """A layer benchmark record: jaxmoe_bf16's train step of `ms` at each of shapes."""
    records = [dict(shape=s, mode="train", impl="jaxmoe_bf16", ms=ms) for s in shapes]
    return dict(benchmark="layer", date=date, device=device, records=records)


def test_the_committed_index_is_current_and_every_named_results_file_exists():
    assert results_index.main(["--check"]) == 0


def test_latest_record_per_part_shape_and_card(tmp_path):
    write(tmp_path, "layer_2026-01-01.json", layer_record("2026-01-01", ["mixtral", "qwen"], 2.0))
    write(tmp_path, "layer_2026-01-02.json", layer_record("2026-01-02", ["mixtral"], 1.5))
    write(tmp_path, "layer_2026-01-02_kernels.json", {"not": "a record"})
    h100 = layer_record("2025-12-31", ["mixtral"], 3.0, device="NVIDIA H100 80GB HBM3")
    write(tmp_path, "layer_2025-12-31_h100.json", h100)
    rows = {(r.shape, r.card): r for r in results_index.latest_rows(str(tmp_path))}
    assert set(rows) == {("mixtral", "H200"), ("qwen", "H200"), ("mixtral", "H100 80GB HBM3")}
    assert rows["mixtral", "H200"].file == "layer_2026-01-02.json"
    assert rows["mixtral", "H200"].headline == "jaxmoe_bf16 1.50 ms"
    assert rows["qwen", "H200"].file == "layer_2026-01-01.json"
    assert rows["mixtral", "H100 80GB HBM3"].file == "layer_2025-12-31_h100.json"
    assert {r.benchmark for r in rows.values()} == {"layer (train)"}


def test_unknown_and_broken_records_get_a_row_without_numbers(tmp_path):
    write(tmp_path, "probe_2026-01-03_x.json", [1, 2, 3])
    write(tmp_path, "layer_2026-01-04.json", "{not json")
    write(tmp_path, "decode_2026-01-05.json", dict(date="2026-01-05", records=[{"shape": 1}]))
    rows = {r.file: r for r in results_index.latest_rows(str(tmp_path))}
    assert set(rows) == {
        "probe_2026-01-03_x.json",
        "layer_2026-01-04.json",
        "decode_2026-01-05.json",
    }
    for row in rows.values():
        assert (row.shape, row.card, row.commit, row.headline) == ("-", "-", "-", "")
    assert rows["probe_2026-01-03_x.json"].date == "2026-01-03"
    assert "layer_2026-01-04.json" in results_index.render(list(rows.values()))


def test_check_fails_on_a_stale_index(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write(results, "layer_2026-01-01.json", layer_record("2026-01-01", ["mixtral"], 2.0))
    args = ["--results", str(results), "--index", str(tmp_path / "RESULTS.md"), "--repo"]
    args.append(str(tmp_path))
    assert results_index.main(args) == 0
    assert results_index.main([*args, "--check"]) == 0
    write(results, "layer_2026-01-02.json", layer_record("2026-01-02", ["mixtral"], 1.0))
    assert results_index.main([*args, "--check"]) == 1


def test_check_fails_when_a_page_names_a_missing_results_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write(results, "layer_2026-01-01.json", layer_record("2026-01-01", ["mixtral"], 2.0))
    (tmp_path / "README.md").write_text("see `layer_2026-01-0{1,2}.json` and layer_2026-01-01.json")
    args = ["--results", str(results), "--index", str(tmp_path / "RESULTS.md"), "--repo"]
    args.append(str(tmp_path))
    assert results_index.main(args) == 0
    assert results_index.missing_citations(str(tmp_path), str(results)) == [
        ("README.md", "layer_2026-01-02.json")
    ]
    assert results_index.main([*args, "--check"]) == 1
    write(results, "layer_2026-01-02.json", layer_record("2026-01-01", ["qwen"], 2.0))
    assert results_index.missing_citations(str(tmp_path), str(results)) == []


def test_archive_takes_the_records_no_row_lists_and_no_page_cites(tmp_path):
    names = [f"layer_2026-01-0{day}.json" for day in range(1, 6)]
    for day, name in enumerate(names, start=1):
        write(tmp_path, name, layer_record(f"2026-01-0{day}", ["mixtral"], 2.0))
    write(tmp_path, "layer_2026-01-02.png", "a plot")
    write(tmp_path, "layer_2026-01-03_kernels.json", {})
    rows = results_index.latest_rows(str(tmp_path))
    assert [r.file for r in rows] == ["layer_2026-01-05.json"]
    text = "runs `layer_2026-01-0{1,4}` and the kernels of layer_2026-01-03_kernels.json."
    moved = results_index.to_archive(str(tmp_path), rows, text)
    assert moved == ["layer_2026-01-02.json", "layer_2026-01-02.png"]
    assert results_index.to_archive(str(tmp_path), rows, "layer_2026-01-*.json") == []


def test_brace_expansion():
    assert results_index.expand_braces("a_{x,y}_run{1..3}.json") == [
        f"a_{c}_run{i}.json" for c in "xy" for i in (1, 2, 3)
    ]
    assert results_index.expand_braces("plain.json") == ["plain.json"]


def test_readme_headline_tables_are_written_between_the_markers(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    write(results, "layer_2026-01-01.json", layer_record("2026-01-01", ["mixtral"], 2.0))
    train = dict(benchmark="train", date="2026-01-02", device="NVIDIA H100 80GB HBM3")
    train.update(model="m", seq_len=8, batch=2, impls={"jaxmoe": dict(tokens_per_s=2e3, mfu=0.5)})
    write(results, "train_2026-01-02.json", train)
    readme = tmp_path / "README.md"
    marks = f"{results_index.README_BEGIN}\nold\n{results_index.README_END}"
    readme.write_text(f"# top\n{marks}\ntail\n")
    args = ["--results", str(results), "--index", str(tmp_path / "RESULTS.md")]
    args += ["--repo", str(tmp_path)]
    assert results_index.main([*args, "--check"]) == 1  # the README's block is stale
    assert results_index.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# top\n") and text.endswith("tail\n") and "old" not in text
    assert "jaxmoe 2.0k tokens/s (MFU 50.0%)" in text and "jaxmoe_bf16 2.00 ms" in text
    assert "(benchmarks/results/train_2026-01-02.json)" in text
    assert results_index.main([*args, "--check"]) == 0
