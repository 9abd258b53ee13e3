"""docs/benchmarks.md is generated from benchmarks/results/*.json by benchmarks/results_page.py:
the checked-in page is exactly what the generator writes, it stays short, it reaches every result
file, and the generator copes with results that lack a field. Standard library only: no
matplotlib, no vLLM."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
DOCS = REPO / "docs" / "benchmarks.md"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import results_page  # noqa: E402

MAX_LINES = 400


def test_the_page_is_generated_not_edited() -> None:
    assert DOCS.read_text() == results_page.render(RESULTS), (
        "docs/benchmarks.md is not what benchmarks/results/*.json give: run `python benchmarks/results_page.py` "
        "(and put prose about a run in benchmarks/NOTES.md, not on the page)")


def test_the_page_is_short() -> None:
    lines = DOCS.read_text().count("\n")
    assert lines <= MAX_LINES, f"docs/benchmarks.md has {lines} lines, more than {MAX_LINES}"


def test_the_page_links_every_result_file_and_the_notes() -> None:
    page = DOCS.read_text()
    missing = [f.name for f in sorted(RESULTS.glob("*.json")) if f"(../benchmarks/results/{f.name})" not in page]
    assert not missing, f"docs/benchmarks.md does not link {missing}"
    assert "(../benchmarks/NOTES.md)" in page


def test_render_is_deterministic() -> None:
    assert results_page.render(RESULTS) == results_page.render(RESULTS)


def test_results_without_an_environment_or_a_benchmark_still_render(tmp_path: Path) -> None:
    # A TTFT result whose environment lost its commit, date and CPU, and a file no benchmark claims.
    data = json.loads((RESULTS / "ttft-zen4-1206.json").read_text())
    for key in ("git_commit", "date_utc", "cpu_model", "cpu_count", "vllm"):
        data["environment"].pop(key, None)
    (tmp_path / "ttft-bare.json").write_text(json.dumps(data))
    (tmp_path / "notes-of-mine.json").write_text("{}")
    shutil.copy(RESULTS / "chaos.json", tmp_path / "chaos.json")
    page = results_page.render(tmp_path)
    assert "(../benchmarks/results/ttft-bare.json)" in page and "(../benchmarks/results/notes-of-mine.json)" in page
    row = next(line for line in page.splitlines() if line.startswith("| ttft | [`ttft-bare`]"))
    assert "ttft-bare.json) (–, –, –)" in row, row  # the index: its date, CPU and commit read "–"
    assert "commit not recorded" in page
    # No PNG next to the copies: nothing is embedded that would not resolve.
    assert "![" not in page
    assert results_page.render(tmp_path / "empty-dir-that-does-not-exist").startswith("# Benchmarks\n")


def test_the_headline_rule(tmp_path: Path) -> None:
    # Per CPU model: the full TTFT run with the most configurations, the newest of those; a
    # smoke run and a run with fewer configurations do not count, however new.
    base = json.loads((RESULTS / "ttft-zen4-1206.json").read_text())

    def run(name: str, date: str, configs: int, cpu: str) -> None:
        data = json.loads(json.dumps(base))
        data["environment"].update(date_utc=date, cpu_model=cpu)
        data["configs"] = {f"c{i}": {} for i in range(configs)}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    run("ttft-a-old-wide", "2026-01-01T00:00:00+00:00", 5, "CPU A")
    run("ttft-a-new-wide", "2026-01-02T00:00:00+00:00", 5, "CPU A")
    run("ttft-a-newest-narrow", "2026-01-03T00:00:00+00:00", 2, "CPU A")
    run("ttft-a-quick", "2026-01-04T00:00:00+00:00", 9, "CPU A")
    run("ttft-b-only", "2026-01-01T00:00:00+00:00", 1, "CPU B")
    heads = results_page.headline_runs(results_page.load_runs(tmp_path))
    assert [r.name for r in heads] == ["ttft-a-new-wide", "ttft-b-only"]


def test_check_says_when_the_page_is_stale(tmp_path: Path, capsys) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(results_page.render(RESULTS))
    assert results_page.main(["--check", "--out", str(page)]) == 0
    page.write_text(page.read_text() + "edited by hand\n")
    assert results_page.main(["--check", "--out", str(page)]) == 1
    err = capsys.readouterr().err.strip()
    assert "python benchmarks/results_page.py" in err and "\n" not in err
