#!/usr/bin/env python
"""Redraw benchmark plots from saved results, without rerunning anything.

    .venv/bin/python benchmarks/replot.py                                # every benchmarks/results/*.json
    .venv/bin/python benchmarks/replot.py benchmarks/results/store.json  # one
    .venv/bin/python benchmarks/replot.py X.json --out /tmp/X.png

Every benchmark that writes a result JSON has a `plot(results, path)` that draws its PNG from
that JSON's dict alone; the benchmark calls it after a run, this script calls the same function
on a saved file. A JSON belongs to the benchmark whose name its file name starts with
(`store.json`, `store-quick.json`, `ttft-threads.json` ...). The PNG goes next to the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
if str(BENCH_DIR) not in sys.path:  # the benchmarks import `common`, `plotting` and `host` from here
    sys.path.insert(0, str(BENCH_DIR))

# The benchmarks that draw a plot: the one list (their scripts are benchmarks/NAME.py, their
# results benchmarks/results/NAME[-variant].json).
BENCHMARKS = ("store", "tiers", "pd", "ttft", "hitpath", "hybrid", "chaos", "scale", "trace", "device")


def benchmark_of(json_path: Path) -> str | None:
    """The benchmark a result file belongs to, by its name (None: none of ours)."""
    stem = json_path.stem
    names = [b for b in BENCHMARKS if stem == b or stem.startswith(b + "-")]
    return max(names, key=len) if names else None


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module. Loaded from its file under a name of its own, not with
    `import NAME`: `trace` is also a standard-library module, and whichever came first on
    sys.path would win."""
    module_name = f"kvpool_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def plot_function(name: str) -> Callable[[dict[str, Any], Path], Path | None]:
    """The benchmark's `plot(results, path) -> path, or None without matplotlib`."""
    return load(name).plot


def replot(json_path: Path, out: Path | None = None, benchmark: str | None = None) -> Path | None:
    """Draw the plot of one saved result file at `out` (default: next to it, .png), as the
    `benchmark` it names or, by default, the one its file name says."""
    name = benchmark or benchmark_of(json_path)
    if name is None:
        raise ValueError(f"{json_path.name}: not a result of one of {', '.join(BENCHMARKS)}")
    results = json.loads(json_path.read_text())
    return plot_function(name)(results, out or json_path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="*", type=Path,
                    help="result files (default: every benchmarks/results/*.json of a known benchmark)")
    ap.add_argument("--out", type=Path, help="where the PNG goes (one JSON only; default: next to it)")
    ap.add_argument("--benchmark", choices=BENCHMARKS,
                    help="whose results these are, for a file named otherwise (`--out` of a run elsewhere)")
    args = ap.parse_args(argv)
    files = args.json or sorted(p for p in RESULTS_DIR.glob("*.json") if benchmark_of(p))
    if args.out and len(files) != 1:
        ap.error("--out takes exactly one JSON")
    for f in files:
        if (args.benchmark or benchmark_of(f)) is None:
            ap.error(f"{f}: its name is not one of {', '.join(BENCHMARKS)}[-...].json: say --benchmark")
    for f in files:
        png = replot(f, args.out, args.benchmark)
        if png is None:
            print("matplotlib is not installed (the `bench` extra): no plots", file=sys.stderr)
            return 1
        print(f"{f.name} -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
