"""`benchmarks/chaos.py` writes a run's results (the request rows one a line) as JSON that reads
back whole and plots. No vLLM: a ChaosResult made by hand, as the run's end makes it."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from chaos import plot, write_rows_json  # noqa: E402

from kvpool.testing.chaos import ChaosConfig, ChaosResult, Fault, Request, config_record  # noqa: E402


def test_a_runs_results_round_trip_through_the_json_and_plot(tmp_path: Path) -> None:
    lock = threading.Lock()
    cfg = config_record(ChaosConfig(model_dir="/m", duration_s=90.0, log=lambda msg: lock.locked() and None))
    reqs = [
        Request(0.0, 1.0, "A", 0, "load", "ok", ttft_s=0.5, cached_tokens=0, prompt_tokens=100),
        Request(2.0, 3.0, "B", 0, "load", "ok", ttft_s=0.1, cached_tokens=80, prompt_tokens=100),
        Request(8.0, 9.0, "B", 1, "final", "ok", ttft_s=0.1, cached_tokens=50, prompt_tokens=100),
    ]
    result = ChaosResult(cfg, reqs, [Fault("kill", 2.5, 4.0)], {}, {"evictions": 3}, 7.0)
    data = {"environment": {"cpu": "x"}, "model": "tiny", "quick": True, **result.to_json()}
    path = write_rows_json(tmp_path / "chaos.json", data)
    back = json.loads(path.read_text())
    assert back == json.loads(json.dumps(data))  # every key, the rows wherever the dict had them
    assert len(back["requests"]) == 3 and back["pool_stats"] == {"evictions": 3} and back["t_load_end"] == 7.0
    png = plot(back, tmp_path / "chaos.png")
    assert png is not None and png.stat().st_size > 0
