"""`benchmarks/ttft.py`'s later runs of a configuration (rounds, the reference's bracketing run)
are pooled with its first, each sample tagged with its run; a size a later run could not
measure keeps the earlier samples and says why. No vLLM: plain result dicts."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from ttft import merge_runs  # noqa: E402


def run(cold_ms: list[float], status: str = "ok") -> dict:
    entry = {kind: [] for kind in ("hit", "ext", "part", "discarded")}
    entry["cold"] = [{"ttft_ms": t} for t in cold_ms]
    entry["ext"] = [{"ttft_ms": t / 30} for t in cold_ms]
    entry["status"] = status
    return {"sizes": {"4K": entry}, "server_starts": 1, "server_logs": ["a.log"]}


def test_the_second_run_is_pooled_and_tagged() -> None:
    first, again = run([930.0, 940.0, 950.0]), run([1080.0, 1090.0, 1100.0])
    merge_runs(first, again)
    cold = first["sizes"]["4K"]["cold"]
    assert [s["run"] for s in cold] == [1, 1, 1, 2, 2, 2]
    assert statistics.median(s["ttft_ms"] for s in cold) == 1015.0
    assert len(first["sizes"]["4K"]["ext"]) == 6
    assert first["runs"] == 2 and first["server_starts"] == 2 and len(first["server_logs"]) == 2


def test_a_size_the_second_run_lost_keeps_the_first_runs_samples() -> None:
    first, again = run([930.0, 940.0, 950.0]), run([], status="crashed")
    merge_runs(first, again)
    entry = first["sizes"]["4K"]
    assert [s["ttft_ms"] for s in entry["cold"]] == [930.0, 940.0, 950.0]
    assert entry["run_status"] == {"2": "crashed"}


def test_every_round_is_tagged_in_turn() -> None:
    first = run([930.0])
    for later in ([940.0], [], [950.0]):
        merge_runs(first, run(later, status="ok" if later else "crashed"))
    entry = first["sizes"]["4K"]
    assert [(s["run"], s["ttft_ms"]) for s in entry["cold"]] == [(1, 930.0), (2, 940.0), (4, 950.0)]
    assert entry["run_status"] == {"3": "crashed"} and first["runs"] == 4 and first["server_starts"] == 4
