"""How a benchmark rewrites its section of docs/benchmarks.md: its own results are replaced, the
notes written by hand below the keep marker and every other section stay as they were."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from common import KEEP_MARKER, replace_docs_section  # noqa: E402

BEFORE = "# Benchmarks\n\n## Other\n\nother text\n\n"
AFTER = "## Last\n\nlast text\n"


def test_a_rerun_replaces_the_results_and_keeps_the_notes_below_the_marker(tmp_path: Path) -> None:
    notes = f"{KEEP_MARKER}\n\n### Why\n\nhand-written analysis\n"
    doc = tmp_path / "b.md"
    doc.write_text(BEFORE + "## Trace\n\nold table\n\n" + notes + "\n" + AFTER)
    replace_docs_section("## Trace", ["new table", "![plot](results/x.png)"], doc)
    assert doc.read_text() == (BEFORE + "## Trace\n\nnew table\n\n![plot](results/x.png)\n\n" + notes + "\n" + AFTER)
    # Twice is the same as once: the notes are not duplicated.
    replace_docs_section("## Trace", ["new table", "![plot](results/x.png)"], doc)
    assert doc.read_text().count("hand-written analysis") == 1


def test_the_last_section_keeps_its_notes_too(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(BEFORE + "## Trace\n\nold\n\n" + KEEP_MARKER + "\n\nnotes\n")
    replace_docs_section("## Trace", ["new"], doc)
    assert doc.read_text() == BEFORE + "## Trace\n\nnew\n\n" + KEEP_MARKER + "\n\nnotes\n"


def test_without_the_marker_the_whole_section_is_replaced(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(BEFORE + "## Trace\n\nold table\n\nold words\n\n" + AFTER)
    replace_docs_section("## Trace", ["new table"], doc)
    assert doc.read_text() == BEFORE + "## Trace\n\nnew table\n\n" + AFTER


def test_a_new_section_is_appended(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(BEFORE.rstrip("\n") + "\n")
    replace_docs_section("## Trace", ["table"], doc)
    assert doc.read_text() == BEFORE + "## Trace\n\ntable\n"
