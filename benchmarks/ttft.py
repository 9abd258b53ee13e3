#!/usr/bin/env python
"""Time to first token: kvpool against a cold prefill, vLLM's prefix cache and two peer connectors.

    .venv/bin/python benchmarks/ttft.py            # full run: 1K, 4K, 8K tokens, 3 prompts each
    .venv/bin/python benchmarks/ttft.py --quick    # smoke run: 1K and 4K, 1 prompt each

On the `bench` model (~96M-parameter random Llama, built locally, nothing downloaded) it starts
one vLLM OpenAI server at a time, every one with the same pinned CPU threads
(`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`), and sends prompts of random
token ids (exact lengths) with `max_tokens=1`, streaming, so TTFT is the time from sending the
request to the first generated token. For every prompt it sends the prompt once (cold: the
first time that server sees it), waits `--wait-s` (1 s: MooncakeStoreConnector saves
asynchronously; every configuration waits the same), and sends it again (hit). The usage
record's `cached_tokens` says whether the second request really hit.

Configurations (one server each, in this order):

  vllm      no KV connector, prefix caching ON: its first request is the "vLLM cold" reference,
            its second is vLLM's own prefix-cache hit
  kvpool    KVPoolConnector, backend local (in-process pool), prefix caching off
  example   vLLM's ExampleConnector (safetensors files on disk), prefix caching off. It is known
            to crash the engine on long prompts: a crash is recorded for that size and the
            server is restarted for the remaining sizes
  mooncake  vLLM's MooncakeStoreConnector against a local `mooncake_master` over TCP, prefix
            caching off (needs `pip install mooncake-transfer-engine-non-cuda` and Debian's
            `libibverbs1`; if it cannot run, what failed is recorded and the rest goes on)

Writes `benchmarks/results/ttft.json` (`ttft-quick.json` with --quick): every sample, the
medians, the ratios, the targets and the environment; and `ttft.png` when matplotlib happens
to be installed. The numbers come from whatever machine runs this; on a shared machine they
are noisy (the load average is recorded with every sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO / "src"))

import httpx  # noqa: E402

from kvpool.demo.model import SPECS, build_model  # noqa: E402
from kvpool.demo.serve import DEFAULT_ENV, OpenAIServer, ServerError, free_port  # noqa: E402

BLOCK_SIZE = 128
MAX_MODEL_LEN = 8448  # 8192 prompt tokens + 1 generated, rounded up to whole blocks
SIZES = {"1K": 1024, "4K": 4096, "8K": 8192}
CONFIG_ORDER = ("vllm", "kvpool", "example", "mooncake")
LABELS = {
    "vllm_cold": "vLLM cold (no connector)",
    "kvpool_cold": "kvpool cold",
    "kvpool_hit": "kvpool hit",
    "prefix_hit": "vLLM prefix-cache hit",
    "example_hit": "ExampleConnector hit",
    "mooncake_hit": "MooncakeStore hit",
}
# The targets (kvpool hit against ...).
TARGETS = {
    "hit_vs_cold_4K": "kvpool hit <= 1/10 of kvpool cold TTFT at 4K tokens",
    "hit_vs_prefix": "kvpool hit within 1.5x of vLLM's prefix-cache hit",
    "hit_vs_example": "kvpool hit faster than the ExampleConnector hit",
    "hit_vs_mooncake": "kvpool hit no slower than the MooncakeStoreConnector hit",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def make_prompt(n_tokens: int, index: int, vocab_size: int) -> list[int]:
    """Seeded random token ids, skipping the special ids 0-2 (<s>, </s>, <unk>)."""
    rng = random.Random(f"kvpool-ttft/{n_tokens}/{index}")
    return [rng.randrange(3, vocab_size) for _ in range(n_tokens)]


# ---------------------------------------------------------------------------------------------
# Servers


@dataclasses.dataclass
class ServerPlan:
    """How to start one configuration's server (and whatever it needs alongside)."""

    name: str
    prefix_caching: bool
    kv_transfer_config: dict[str, Any] | None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Called before each (re)start; returns a cleanup callable.
    setup: Callable[[], Callable[[], None]] | None = None


class MooncakeMaster:
    """A `mooncake_master` bound to 127.0.0.1 on free ports, in its own process group."""

    def __init__(self, binary: str, log_path: Path) -> None:
        self.binary = binary
        self.log_path = log_path
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def args(self) -> list[str]:
        return [
            self.binary,
            "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.1",
            "--default_kv_lease_ttl=11000",
        ]

    def start(self) -> None:
        with open(self.log_path, "ab") as f:
            f.write(f"$ {' '.join(self.args)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with code {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mooncake_master not listening on 127.0.0.1:{self.port} after 30 s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


def mooncake_probe() -> tuple[str | None, str | None, str | None]:
    """(mooncake_master path, package version, None) or (None, None, why it cannot run)."""
    try:
        version = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        try:
            version = importlib.metadata.version("mooncake-transfer-engine")
        except importlib.metadata.PackageNotFoundError:
            return None, None, ("mooncake-transfer-engine-non-cuda is not installed "
                                "(pip install mooncake-transfer-engine-non-cuda; needs Debian libibverbs1)")
    probe = subprocess.run([sys.executable, "-c", "from mooncake.store import MooncakeDistributedStore"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return None, version, f"`from mooncake.store import MooncakeDistributedStore` failed: {probe.stderr.strip()[-1500:]}"
    binary = shutil.which("mooncake_master", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if binary is None:
        return None, version, "mooncake_master not found next to the Python interpreter nor on PATH"
    return binary, version, None


def build_plans(workdir: Path, configs: list[str], mooncake: tuple[str | None, str | None, str | None]) -> dict[str, ServerPlan]:
    plans: dict[str, ServerPlan] = {}
    rpc_port = 40000 + os.getpid() % 20000
    if "vllm" in configs:
        plans["vllm"] = ServerPlan("vllm", prefix_caching=True, kv_transfer_config=None)
    if "kvpool" in configs:
        plans["kvpool"] = ServerPlan("kvpool", prefix_caching=False, kv_transfer_config={
            "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            # A lookup_rpc_port of our own: other vLLM instances on this host (tests) use low ones.
            "kv_connector_extra_config": {"backend": "local", "local_cpu_size": "8GB",
                                          "lookup_rpc_port": rpc_port},
        })
    if "example" in configs:
        storage = workdir / "example-storage"

        def example_setup() -> Callable[[], None]:
            storage.mkdir(parents=True, exist_ok=True)
            return lambda: None

        plans["example"] = ServerPlan("example", prefix_caching=False, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }, setup=example_setup)
    if "mooncake" in configs and mooncake[0] is not None:
        binary = mooncake[0]
        cfg_path = workdir / "mooncake.json"
        n_starts = [0]

        def mooncake_setup() -> Callable[[], None]:
            # A fresh master for every server start: nothing stored by an earlier server remains.
            n_starts[0] += 1
            master = MooncakeMaster(binary, workdir / "logs" / f"mooncake_master-{n_starts[0]}.log")
            master.start()
            cfg_path.write_text(json.dumps({
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"127.0.0.1:{master.port}",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "2GB",
                "local_buffer_size": "1GB",
            }, indent=2))
            return master.stop

        plans["mooncake"] = ServerPlan("mooncake", prefix_caching=False, kv_transfer_config={
            "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": rpc_port},
        }, env={
            "MOONCAKE_CONFIG_PATH": str(cfg_path),
            # Advertise loopback to the master instead of the host's outward address.
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
        }, setup=mooncake_setup)
    return plans


class Runner:
    """Starts, restarts and stops one configuration's server."""

    def __init__(self, plan: ServerPlan, model_dir: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.plan = plan
        self.model_dir = model_dir
        self.workdir = workdir
        self.args = args
        self.server: OpenAIServer | None = None
        self.cleanup: Callable[[], None] | None = None
        self.starts = 0
        self.log_paths: list[str] = []
        self.startup_s: list[float] = []

    def start(self) -> OpenAIServer:
        self.stop()
        self.starts += 1
        log_path = self.workdir / "logs" / f"{self.plan.name}-{self.starts}.log"
        self.log_paths.append(str(log_path))
        if self.plan.setup is not None:
            self.cleanup = self.plan.setup()
        t0 = time.monotonic()
        srv = OpenAIServer(
            self.model_dir, served_model_name="bench", max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE, prefix_caching=self.plan.prefix_caching,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            kv_transfer_config=self.plan.kv_transfer_config,
            env={"VLLM_CPU_KVCACHE_SPACE": str(self.args.kvcache_gib), **self.plan.env},
            log_path=log_path, startup_timeout_s=300, request_timeout_s=self.args.request_timeout_s,
        )
        try:
            srv.start()
        except BaseException:
            self.stop()
            raise
        self.server = srv
        self.startup_s.append(round(time.monotonic() - t0, 1))
        log(f"{self.plan.name}: server up in {self.startup_s[-1]} s (log {log_path})")
        # Warm-up (not recorded): a short prompt cold and hit, so first-request costs
        # (allocations, lazy imports, connections to a store) do not land on a measurement.
        warm = make_prompt(512, 10_000 + self.starts, SPECS["bench"].vocab_size)
        srv.complete(warm, max_tokens=1)
        time.sleep(self.args.wait_s)
        srv.complete(warm, max_tokens=1)
        return srv

    def alive(self) -> bool:
        """After a failed request: is the server still serving? (Gives a dying engine ~10 s.)"""
        srv = self.server
        if srv is None or srv.proc is None:
            return False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if srv.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{srv.base_url}/health", timeout=2).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
            time.sleep(1)
        return True

    def stop(self) -> None:
        srv, self.server = self.server, None
        if srv is not None:
            srv.stop()
        cleanup, self.cleanup = self.cleanup, None
        if cleanup is not None:
            cleanup()


def _error_excerpt(log_text: str, limit: int = 1500) -> str:
    """The most telling lines of a crashed server's log: errors and the last traceback lines."""
    lines = log_text.splitlines()
    keep = [ln for ln in lines if any(w in ln for w in ("Error", "error", "Traceback", "Exception", "Fatal", "Killed", "Segmentation"))]
    text = "\n".join(keep[-12:]) or "\n".join(lines[-12:])
    return text[-limit:]


def measure_one(srv: OpenAIServer, prompt: list[int], index: int) -> dict[str, Any]:
    la = loadavg()
    r = srv.complete(prompt, max_tokens=1)
    return {
        "prompt": index,
        "ttft_ms": round(r.ttft_s * 1000, 2),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "loadavg1": la,
    }


def run_config(plan: ServerPlan, sizes: list[str], reps: int, model_dir: Path, workdir: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """All sizes for one configuration: {size: {cold: [...], hit: [...], status, error?}}."""
    runner = Runner(plan, model_dir, workdir, args)
    out: dict[str, Any] = {"sizes": {}, "kv_transfer_config": plan.kv_transfer_config,
                           "prefix_caching": plan.prefix_caching, "env": plan.env}
    vocab = SPECS["bench"].vocab_size
    try:
        for size in sizes:
            n = SIZES[size]
            entry: dict[str, Any] = {"cold": [], "hit": [], "status": "ok"}
            out["sizes"][size] = entry
            if runner.server is None:
                try:
                    runner.start()
                except (ServerError, RuntimeError, httpx.HTTPError) as e:
                    entry["status"] = "failed_to_start"
                    entry["error"] = str(e)[-3000:]
                    log(f"{plan.name} {size}: server failed to start: {str(e)[:300]}")
                    runner.stop()
                    continue
            for i in range(reps):
                prompt = make_prompt(n, i, vocab)
                phase = "cold"
                try:
                    cold = measure_one(runner.server, prompt, i)
                    entry["cold"].append(cold)
                    time.sleep(args.wait_s)
                    phase = "hit"
                    hit = measure_one(runner.server, prompt, i)
                    entry["hit"].append(hit)
                    log(f"{plan.name} {size} #{i}: cold {cold['ttft_ms']:.0f} ms, "
                        f"hit {hit['ttft_ms']:.0f} ms (cached {hit['cached_tokens']}/{hit['prompt_tokens']}), "
                        f"load {hit['loadavg1']}")
                except (ServerError, httpx.HTTPError) as e:
                    srv = runner.server
                    alive = runner.alive()
                    excerpt = _error_excerpt(srv.log_tail(20000)) if srv is not None else ""
                    entry["status"] = "error" if alive else "crashed"
                    entry["error"] = {
                        "phase": phase, "prompt": i, "request_error": f"{type(e).__name__}: {str(e)[:1500]}",
                        "server_log": runner.log_paths[-1], "log_excerpt": excerpt,
                    }
                    log(f"{plan.name} {size} #{i}: {entry['status']} during the {phase} request: "
                        f"{type(e).__name__}: {str(e)[:200]}")
                    if not alive:
                        runner.stop()  # the next size starts a fresh server
                    break
    finally:
        runner.stop()
    out["server_starts"] = runner.starts
    out["startup_s"] = runner.startup_s
    out["server_logs"] = runner.log_paths
    return out


# ---------------------------------------------------------------------------------------------
# Summary


def _median(samples: list[dict[str, Any]]) -> float | None:
    return round(statistics.median(s["ttft_ms"] for s in samples), 2) if samples else None


def _is_hit(sample: dict[str, Any]) -> bool:
    # A full hit leaves at most one block to compute (vLLM computes the last token itself).
    return sample["cached_tokens"] >= sample["prompt_tokens"] - BLOCK_SIZE


def summarize(results: dict[str, Any], sizes: list[str]) -> dict[str, Any]:
    med: dict[str, dict[str, Any]] = {}
    for size in sizes:
        row: dict[str, Any] = {}
        for cfg, kind, col in (("vllm", "cold", "vllm_cold"), ("kvpool", "cold", "kvpool_cold"),
                               ("kvpool", "hit", "kvpool_hit"), ("vllm", "hit", "prefix_hit"),
                               ("example", "cold", "example_cold"), ("example", "hit", "example_hit"),
                               ("mooncake", "cold", "mooncake_cold"), ("mooncake", "hit", "mooncake_hit")):
            r = results.get(cfg)
            if r is None:
                row[col] = {"status": "not_run"}
                continue
            if "error" in r and "sizes" not in r:
                row[col] = {"status": "unavailable", "reason": r["error"]}
                continue
            e = r["sizes"].get(size)
            if e is None:
                row[col] = {"status": "not_run"}
                continue
            samples = e[kind]
            cell: dict[str, Any] = {"status": e["status"] if not samples or e["status"] == "ok" else "partial",
                                    "n": len(samples)}
            if kind == "hit":
                hits = [s for s in samples if _is_hit(s)]
                cell["n_hit"] = len(hits)
                cell["cached_tokens"] = [s["cached_tokens"] for s in samples]
                if samples and not hits:
                    cell["status"] = "missed"
                samples = hits
            elif samples:
                cell["cached_tokens"] = [s["cached_tokens"] for s in samples]
            cell["median_ms"] = _median(samples)
            if e["status"] != "ok":
                cell["failure"] = e["status"]
            row[col] = cell
        med[size] = row
    ratios: dict[str, dict[str, float | None]] = {}
    for size, row in med.items():
        hit = row["kvpool_hit"].get("median_ms")

        def ratio(col: str) -> float | None:
            other = row[col].get("median_ms")
            return round(hit / other, 3) if hit and other else None

        ratios[size] = {
            "kvpool_hit/kvpool_cold": ratio("kvpool_cold"),
            "kvpool_hit/vllm_cold": ratio("vllm_cold"),
            "kvpool_hit/prefix_hit": ratio("prefix_hit"),
            "kvpool_hit/example_hit": ratio("example_hit"),
            "kvpool_hit/mooncake_hit": ratio("mooncake_hit"),
        }
    return {"medians": med, "ratios": ratios, "targets": judge(med, ratios)}


def judge(med: dict[str, Any], ratios: dict[str, Any]) -> dict[str, Any]:
    """Each target: met / not met / not measured, with the evidence per size."""
    out: dict[str, Any] = {}
    r4 = ratios.get("4K", {}).get("kvpool_hit/kvpool_cold")
    out["hit_vs_cold_4K"] = {"target": TARGETS["hit_vs_cold_4K"], "ratio": r4,
                             "met": None if r4 is None else r4 <= 0.1}

    def per_size(key: str, col: str, ok: Callable[[float], bool], peer_crash_counts_as_met: bool) -> dict[str, Any]:
        detail: dict[str, Any] = {}
        verdicts: list[bool] = []
        for size, rs in ratios.items():
            r = rs[key]
            if r is not None:
                detail[size] = {"ratio": r, "met": ok(r)}
                verdicts.append(ok(r))
            else:
                status = med[size][col].get("failure") or med[size][col].get("status")
                if peer_crash_counts_as_met and status == "crashed" and med[size]["kvpool_hit"].get("median_ms"):
                    detail[size] = {"ratio": None, "met": True, "note": "peer crashed; kvpool served the hit"}
                    verdicts.append(True)
                else:
                    detail[size] = {"ratio": None, "met": None, "note": f"not measured ({status})"}
        return {"met": (all(verdicts) if verdicts else None), "per_size": detail}

    out["hit_vs_prefix"] = {"target": TARGETS["hit_vs_prefix"],
                            **per_size("kvpool_hit/prefix_hit", "prefix_hit", lambda r: r <= 1.5, False)}
    out["hit_vs_example"] = {"target": TARGETS["hit_vs_example"],
                             **per_size("kvpool_hit/example_hit", "example_hit", lambda r: r < 1.0, True)}
    out["hit_vs_mooncake"] = {"target": TARGETS["hit_vs_mooncake"],
                              **per_size("kvpool_hit/mooncake_hit", "mooncake_hit", lambda r: r <= 1.0, False)}
    return out


def _fmt_cell(cell: dict[str, Any]) -> str:
    m = cell.get("median_ms")
    status = cell.get("failure") or cell.get("status")
    if m is None:
        return {"not_run": "-", "unavailable": "n/a", "missed": "missed"}.get(status, status)
    text = f"{m:.0f}" if m >= 100 else f"{m:.1f}"
    if cell.get("n_hit") is not None and cell["n_hit"] < cell["n"]:
        text += f" ({cell['n_hit']}/{cell['n']} hit)"
    if status not in ("ok", None):
        text += f" [{status}]"
    return text


def format_tables(summary: dict[str, Any], sizes: list[str]) -> str:
    med, ratios = summary["medians"], summary["ratios"]
    cols = ["vllm_cold", "kvpool_cold", "kvpool_hit", "prefix_hit", "example_hit", "mooncake_hit"]
    heads = ["tokens"] + [LABELS[c] for c in cols]
    rows = [[size] + [_fmt_cell(med[size][c]) for c in cols] for size in sizes]
    out = ["Median TTFT, ms (lower is better)", _table(heads, rows), ""]
    rheads = ["tokens", "kvpool hit / kvpool cold", "kvpool hit / vLLM cold", "kvpool hit / prefix-cache hit",
              "kvpool hit / Example hit", "kvpool hit / Mooncake hit"]
    keys = ["kvpool_hit/kvpool_cold", "kvpool_hit/vllm_cold", "kvpool_hit/prefix_hit",
            "kvpool_hit/example_hit", "kvpool_hit/mooncake_hit"]
    rrows = [[size] + [("-" if ratios[size][k] is None else f"{ratios[size][k]:.3f}") for k in keys] for size in sizes]
    out += ["Ratios of medians", _table(rheads, rrows), ""]
    crows = []
    for size in sizes:
        crow = [size]
        for c in ("kvpool_hit", "prefix_hit", "example_hit", "mooncake_hit"):
            ct = med[size][c].get("cached_tokens")
            crow.append("-" if not ct else ",".join(str(x) for x in ct) + f" of {SIZES[size]}")
        crows.append(crow)
    out += ["cached_tokens reported by the hit requests",
            _table(["tokens", "kvpool", "prefix cache", "Example", "Mooncake"], crows), ""]
    out.append("Targets")
    for t in summary["targets"].values():
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        extra = ""
        if "ratio" in t and t["ratio"] is not None:
            extra = f" (ratio {t['ratio']:.3f})"
        elif "per_size" in t:
            extra = " (" + ", ".join(
                f"{s}: {d['ratio']:.3f}" if d["ratio"] is not None else f"{s}: {d.get('note', '-')}"
                for s, d in t["per_size"].items()) + ")"
        out.append(f"  [{verdict}] {t['target']}{extra}")
    return "\n".join(out)


def _table(heads: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(heads), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


# ---------------------------------------------------------------------------------------------
# Environment, plot, main


def count_params(model_dir: Path) -> int:
    """Parameter count from the safetensors headers (no torch needed)."""
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                p = 1
                for d in v["shape"]:
                    p *= d
                total += p
    return total


def environment(model_dir: Path, mooncake_version: str | None) -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    spec = SPECS["bench"]
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vllm": version("vllm") or version("vllm-cpu"),
        "torch": version("torch"),
        "kvpool": version("kvpool"),
        "mooncake_transfer_engine": mooncake_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "memory_gib": mem_gib,
        "model": {"spec": dataclasses.asdict(spec), "params": count_params(model_dir),
                  "kv_bytes_per_token": 2 * spec.num_hidden_layers * spec.num_key_value_heads
                  * (spec.hidden_size // spec.num_attention_heads) * (4 if spec.dtype == "float32" else 2)},
        "server_env": dict(DEFAULT_ENV),
        "note": "2-core machine shared with other jobs (vLLM test runs at times): numbers are noisy; "
                "see loadavg1 in every sample",
    }


def plot(summary: dict[str, Any], sizes: list[str], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cols = ["vllm_cold", "kvpool_cold", "kvpool_hit", "prefix_hit", "example_hit", "mooncake_hit"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        ys = [summary["medians"][s][c].get("median_ms") or 0 for s in sizes]
        ax.bar([i + j * width for i in range(len(sizes))], ys, width, label=LABELS[c])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], sizes)
    ax.set_yscale("log")
    ax.set_ylabel("median TTFT, ms (log)")
    ax.set_title("TTFT by prompt length (2-core shared CPU machine)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1K and 4K only, one prompt each (smoke run)")
    p.add_argument("--sizes", help="comma-separated subset of 1K,4K,8K")
    p.add_argument("--reps", type=int, help="distinct prompts per size (default 3; 1 with --quick)")
    p.add_argument("--configs", default=",".join(CONFIG_ORDER), help=f"subset of {','.join(CONFIG_ORDER)}")
    p.add_argument("--wait-s", type=float, default=1.0, help="pause between the cold and the hit request")
    p.add_argument("--kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for every server")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="default 8192: every prompt is prefilled in one step")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", help="model, logs and connector storage (default: a new temp dir; the model "
                                     "is cached in $TMPDIR/kvpool-bench-model)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/ttft.json, ttft-quick.json with --quick)")
    args = p.parse_args(argv)

    sizes = args.sizes.split(",") if args.sizes else (["1K", "4K"] if args.quick else list(SIZES))
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s!r}: one of {', '.join(SIZES)}")
    reps = args.reps or (1 if args.quick else 3)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIG_ORDER:
            p.error(f"unknown configuration {c!r}: one of {', '.join(CONFIG_ORDER)}")
    configs = [c for c in CONFIG_ORDER if c in configs]
    out_path = Path(args.out) if args.out else REPO / "benchmarks" / "results" / ("ttft-quick.json" if args.quick else "ttft.json")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = build_model(Path(tempfile.gettempdir()) / "kvpool-bench-model", SPECS["bench"])

    mooncake = mooncake_probe() if "mooncake" in configs else (None, None, None)
    env = environment(model_dir, mooncake[1])
    log(f"model: {env['model']['params'] / 1e6:.1f}M parameters ({model_dir}); vLLM {env['vllm']}; "
        f"{env['cpu_count']} CPUs; sizes {sizes} x {reps} prompts; configs {configs}; workdir {workdir}")
    log("NOTE: numbers from a shared, noisy 2-core machine; one server at a time")

    plans = build_plans(workdir, configs, mooncake)
    results: dict[str, Any] = {}
    t_start = time.monotonic()
    for c in configs:
        if c not in plans:  # mooncake unavailable
            results[c] = {"error": mooncake[2]}
            log(f"{c}: skipped: {mooncake[2]}")
            continue
        log(f"{c}: starting")
        try:
            results[c] = run_config(plans[c], sizes, reps, model_dir, workdir, args)
        except Exception as e:  # keep the other configurations' results
            results[c] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(f"{c}: failed: {type(e).__name__}: {str(e)[:300]}")

    summary = summarize(results, sizes)
    report = {
        "benchmark": "ttft",
        "quick": args.quick,
        "sizes": {s: SIZES[s] for s in sizes},
        "prompts_per_size": reps,
        "wait_between_cold_and_hit_s": args.wait_s,
        "max_tokens": 1,
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "vllm_cpu_kvcache_space_gib": args.kvcache_gib,
        "duration_s": round(time.monotonic() - t_start, 1),
        "environment": env,
        "configs": results,
        **summary,
    }
    if mooncake[2] is not None:
        report["mooncake_unavailable"] = mooncake[2]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    png = plot(summary, sizes, out_path.with_suffix(".png"))

    print()
    print(f"TTFT on the bench model ({env['model']['params'] / 1e6:.1f}M params, fp32), vLLM {env['vllm']}, "
          f"{env['cpu_count']} CPUs, {env['date_utc']}")
    print("NOTE: measured on a shared, noisy 2-core machine; medians of "
          f"{reps} prompt(s) per size; cold and hit {args.wait_s:g} s apart")
    print()
    print(format_tables(summary, sizes))
    print()
    print(f"results: {out_path}" + (f", plot: {png}" if png else " (no plot: matplotlib not installed)"))
    print(f"server logs: {workdir / 'logs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
