"""The benchmarks' plots drawn from their checked-in results: every result JSON under
benchmarks/results/ belongs to a benchmark whose `plot(results, path)` turns it into a PNG, so a
change to what a benchmark writes that its plot no longer reads fails here, not at the end of
an hour-long `make bench`. No vLLM, no service: only matplotlib and the saved JSON."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the `bench` extra; without it the benchmarks draw no plots

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
DOCS = REPO / "docs" / "benchmarks.md"
NOTES = BENCH / "NOTES.md"
if str(BENCH) not in sys.path:  # the benchmarks import `common`, `plotting` and `host` from there
    sys.path.insert(0, str(BENCH))

import replot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RESULT_FILES = sorted(RESULTS.glob("*.json"))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width >= 600 and height >= 300, f"{path.name}: {width}x{height}, not a readable figure"


def test_every_result_file_belongs_to_a_benchmark_with_a_plot() -> None:
    assert RESULT_FILES, "no checked-in results"
    for f in RESULT_FILES:
        name = replot.benchmark_of(f)
        assert name is not None, f"{f.name}: no benchmark in replot.BENCHMARKS claims it"
        assert callable(replot.plot_function(name))
    # The other way round: every benchmark but the device check (no accelerator has run it
    # yet) has results here to draw.
    covered = {replot.benchmark_of(f) for f in RESULT_FILES}
    assert set(replot.BENCHMARKS) - covered <= {"device"}


@pytest.mark.parametrize("json_path", RESULT_FILES, ids=[f.name for f in RESULT_FILES])
def test_plot_from_checked_in_results(json_path: Path, tmp_path: Path) -> None:
    out = tmp_path / json_path.with_suffix(".png").name
    assert replot.replot(json_path, out) == out
    assert_png(out)


def test_device_plot_from_a_cpu_smoke_run(tmp_path: Path) -> None:
    # No device.json is checked in (it needs an accelerator): the CPU smoke run writes one.
    out = tmp_path / "device-quick.json"
    run = subprocess.run([sys.executable, str(BENCH / "device.py"), "--device", "cpu", "--quick", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_png(out.with_suffix(".png"))  # the script drew it next to its JSON
    again = tmp_path / "again.png"
    assert replot.plot_function("device")(json.loads(out.read_text()), again) == again
    assert_png(again)


def embedded_plots(doc: Path) -> set[Path]:
    """The PNGs `doc` embeds, each resolved against the directory of `doc`, which must hold it."""
    found = set()
    for rel in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", doc.read_text()):
        path = (doc.parent / rel).resolve()
        assert path.is_file(), f"{doc.relative_to(REPO)} embeds {rel}, which does not exist next to it"
        found.add(path)
    assert found, f"{doc.relative_to(REPO)} embeds no plot"
    return found


def test_docs_embed_existing_plots() -> None:
    # The results page shows one plot per benchmark; benchmarks/NOTES.md, the investigations
    # behind it, shows the others. Every full run's plot is shown in one of the two (quick
    # runs' plots are smoke output).
    embedded = embedded_plots(DOCS) | embedded_plots(NOTES)
    full = {f.with_suffix(".png").resolve() for f in RESULT_FILES if "-quick" not in f.stem}
    missing = sorted(p.name for p in full - embedded)
    assert not missing, f"embedded in neither docs/benchmarks.md nor benchmarks/NOTES.md: {missing}"


def test_replot_cli_redraws_one_file(tmp_path: Path) -> None:
    out = tmp_path / "store.png"
    run = subprocess.run([sys.executable, str(BENCH / "replot.py"), str(RESULTS / "store.json"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_png(out)
    # A result saved under another name (a run's --out) says whose it is with --benchmark.
    other = tmp_path / "run-elsewhere.json"
    other.write_text((RESULTS / "store-quick.json").read_text())
    run = subprocess.run([sys.executable, str(BENCH / "replot.py"), str(other)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--benchmark" in run.stderr
    run = subprocess.run([sys.executable, str(BENCH / "replot.py"), "--benchmark", "store", str(other)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_png(other.with_suffix(".png"))
