"""benchmarks/device.py, the accelerator data path's device check, as a CPU smoke run: it must
run from the checkout (no install, no vLLM), verify every case byte for byte and say so in its
JSON, so the script handed to an accelerator machine is known to work before it gets there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device.py"


def test_quick_cpu_run_verifies_every_case(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    # From another directory: the script must find src/ from its own location.
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert results["machine"]["smoke_run"] is True
    assert results["all_verified"] is True
    cases = results["cases"]
    layouts = {c["layout"] for c in cases}
    dtypes = {c["dtype"] for c in cases}
    assert {"flash_attn", "flashinfer_nhd"} <= layouts and {"bfloat16", "float16"} <= dtypes
    assert len(cases) == len(layouts) * len(dtypes)
    for c in cases:
        assert c["verified"] and c["mismatches"] == 0 and not c["failures"], c["case"]
        assert c["bytes_checked"] > 0, c["case"]
        # The partial load must have had both present and missing keys, in several rounds.
        assert c["rounds"] >= 3 and c["partial_load"]["missing"] > 0 and c["partial_load"]["present"] > 0
        assert all(v > 0 for v in c["gbps"].values()), c["case"]
