"""A chaos run under load: two vLLM OpenAI servers share one `kvpool server` (SSD tier on) while
a steady stream of requests with repeated prefixes runs and, every few seconds, a random fault
strikes the pool. Every answer is checked against greedy outputs a plain vLLM server computed
beforehand (token ids only: a different cache split may change the last bits of a logprob).

The faults (`FAULT_KINDS`):

  kill        SIGKILL of the pool server, a new one on the same socket ~2 s later
  pause       SIGSTOP of the pool server for a few seconds, then SIGCONT (a hung store)
  writer      a client SIGKILLed in the middle of a stream of large puts
  corrupt     a rogue client of the pool overwrites random ranges of the shared arena: readers
              must see CHECKSUM_MISMATCH (a miss, recomputed), never wrong tokens
  ssd_full    the SSD tier's file system (a small tmpfs) filled up for a few seconds
              (needs root and `mount -t tmpfs`; otherwise recorded as unavailable)
  slow        each instance reaches the pool through a Unix-socket proxy (`SlowProxy`); for a
              few seconds it delays every chunk it forwards (a slow store)

`ChaosRun(config).run()` returns a `ChaosResult`: every request, every fault, and `summary()`
(counts of wrong, failed and hung requests, faults by kind, hit rate, TTFT percentiles during
and outside faults, cold TTFT). The test (tests/vllm/test_chaos.py) runs it short, the benchmark
(benchmarks/chaos.py) long. `python -m kvpool.testing.chaos proxy ...` is the proxy's process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvpool.testing.launch import ChildProcess, OpenAIServer, PoolServer, ServerError, stream_completion
from kvpool.testing.proc import unix_socket_accepts

__all__ = ["FAULT_KINDS", "REQUEST_COLUMNS", "ChaosConfig", "ChaosResult", "ChaosRun", "Fault", "Request", "SlowProxy",
           "percentile", "tmpfs_mount"]

FAULT_KINDS = ("kill", "pause", "writer", "corrupt", "ssd_full", "slow")
BLOCK = 128

# A client that puts 4 MiB objects in a loop until it is killed (argv: socket path).
_WRITER = r"""
import itertools, os, sys
import numpy as np
from kvpool.server.client import PoolClient
c = PoolClient(sys.argv[1], "chaos-writer", ping=False)
c.wait_connected(5)
buf = np.random.default_rng().integers(0, 256, size=4 << 20, dtype=np.uint8)
print("writing", flush=True)
for i in itertools.count():
    buf[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    c.put([f"chaos-writer-{os.getpid()}-{i}"], [[buf]])
"""

# A client of the pool that overwrites random ranges of the arena it maps (argv: socket path,
# number of ranges, range size, seed); prints how many bytes it changed.
_ROGUE = r"""
import sys
import numpy as np
from kvpool.server.client import PoolClient
c = PoolClient(sys.argv[1], "chaos-rogue", ping=False)
if not c.wait_connected(5):
    print(0); sys.exit(0)
arena = c.arena
n, size, seed = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(seed)
changed = 0
for _ in range(n):
    off = int(rng.integers(0, max(1, len(arena) - size)))
    new = rng.integers(0, 256, size=size, dtype=np.uint8)
    changed += int(np.count_nonzero(arena[off:off + size] != new))
    arena[off:off + size] = new
print(changed, flush=True)
c.close()
"""


# ---- the slow-store proxy ------------------------------------------------------------------------


class SlowProxy:
    """A byte-for-byte Unix-socket proxy in front of `kvpool server`; while the file `flag`
    exists, every chunk it forwards (either way) waits a random `delay_s` first.

    The pool's trust checks pass through it: the client's SO_PEERCRED check sees the proxy
    (our uid), and the arena's name, owner and mode come from the server unchanged. The server
    sees the proxy's pid as the client process, so each instance gets a proxy of its own (one
    quota owner per instance, as without the proxy).
    """

    def __init__(self, listen: str, upstream: str, flag: str, delay_s: tuple[float, float] = (0.3, 0.8)) -> None:
        self.listen, self.upstream, self.flag, self.delay_s = listen, upstream, flag, delay_s
        self._rng = random.Random()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                if os.path.exists(self.flag):
                    await asyncio.sleep(self._rng.uniform(*self.delay_s))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_unix_connection(self.upstream)
        except OSError:
            c_writer.close()  # no server behind us: the client sees a closed handshake, a miss
            return
        tasks = [asyncio.ensure_future(self._pipe(c_reader, u_writer)),
                 asyncio.ensure_future(self._pipe(u_reader, c_writer))]
        # One side closing ends the connection, as it would without the proxy.
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        for w in (u_writer, c_writer):
            w.close()

    async def serve_forever(self) -> None:
        if os.path.exists(self.listen):
            os.unlink(self.listen)
        server = await asyncio.start_unix_server(self._serve, path=self.listen)
        os.chmod(self.listen, 0o600)
        async with server:
            await server.serve_forever()


class ProxyProcess(ChildProcess):
    """`python -m kvpool.testing.chaos proxy` as a child process; ready once its socket accepts."""

    name = "chaos proxy"
    poll_interval_s = 0.05

    def __init__(self, listen: str, upstream: str, flag: str, delay_s: tuple[float, float],
                 log_path: str | os.PathLike[str] | None = None) -> None:
        self.listen = listen
        super().__init__([sys.executable, "-m", "kvpool.testing.chaos", "proxy", "--listen", listen,
                          "--upstream", upstream, "--flag", flag, "--delay-s", str(delay_s[0]), str(delay_s[1])],
                         log_path=log_path)

    def _ready(self) -> bool:
        return unix_socket_accepts(self.listen)


# ---- the SSD tier on a small tmpfs ---------------------------------------------------------------


def tmpfs_mount(path: Path, size_mb: int) -> str | None:
    """Mount a tmpfs of `size_mb` MiB, mode 0700, on `path`; None if done, else why not."""
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("mount") is None:
        return "no mount command"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"mount -t tmpfs failed: {(r.stderr or r.stdout).strip()}"
    return None


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# ---- configuration and records -------------------------------------------------------------------


@dataclasses.dataclass
class ChaosConfig:
    """One chaos run. Times are seconds."""

    model_dir: str
    work_dir: str | None = None  # logs, sockets, the SSD tier (a fresh temporary dir when None)
    duration_s: float = 75.0  # of load with faults
    fault_every_s: float = 8.0  # mean time from one fault's start to the next one's
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    n_prefixes: int = 6
    n_suffixes: int = 4
    prefix_blocks: tuple[int, int] = (3, 8)
    suffix_tokens: tuple[int, int] = (16, 200)
    max_tokens: int = 4
    clients: int = 2  # request threads, each alternating between the two instances
    hung_s: float = 60.0  # a request taking longer is "hung"
    pool_memory: str = "64MB"
    ssd_mb: int = 64  # size of the tmpfs under the SSD tier
    lookup_timeout_s: float = 0.3
    transfer_timeout_s: float = 1.0
    breaker_cooldown_s: float = 0.5
    slow_delay_s: tuple[float, float] = (0.3, 0.8)
    kill_down_s: float = 2.0
    pause_s: float = 2.5
    writer_s: float = 1.5
    ssd_full_s: float = 4.0
    slow_s: float = 4.0
    corrupt_ranges: int = 64
    corrupt_bytes: int = 4096
    settle_s: float = 5.0  # after the last fault, before the final round
    final_rounds: int = 2
    dtype: str = "float32"
    cores: tuple[str, str] = ("0", "1")  # VLLM_CPU_OMP_THREADS_BIND of instance A and B
    reference_cores: str = "0-1"
    max_model_len: int = 2048
    log: Callable[[str], None] = lambda msg: None
    server_env: dict[str, str] = dataclasses.field(default_factory=dict)  # more environment for both instances


@dataclasses.dataclass
class Request:
    """One request of the run (times from the run's start)."""

    t_start: float
    t_end: float
    instance: str
    prompt: int
    phase: str  # warmup, load, final
    status: str  # ok, wrong, failed, hung
    ttft_s: float | None = None
    total_s: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


REQUEST_COLUMNS = tuple(f.name for f in dataclasses.fields(Request))


def request_row(r: Request) -> list[Any]:
    """`r` as a JSON row in `REQUEST_COLUMNS` order, times rounded to the millisecond."""
    return [round(v, 3) if isinstance(v, float) else v for v in dataclasses.astuple(r)]


@dataclasses.dataclass
class Fault:
    """One fault the chaos run injected: its kind and when it was in force."""

    kind: str
    t_start: float
    t_end: float
    detail: str = ""


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (q in 0..100, numpy's); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


@dataclasses.dataclass
class ChaosResult:
    """A chaos run's record: every request's outcome, the faults injected, and the pool's counters."""

    config: dict[str, Any]
    requests: list[Request]
    faults: list[Fault]
    unavailable: dict[str, str]  # fault kind -> why it could not run
    pool_stats: dict[str, Any]
    t_load_end: float

    def during_fault(self, r: Request) -> bool:
        return any(r.t_start < f.t_end and r.t_end > f.t_start for f in self.faults)

    def summary(self) -> dict[str, Any]:
        reqs = self.requests
        by_status = {s: sum(r.status == s for r in reqs) for s in ("ok", "wrong", "failed", "hung")}
        ok = [r for r in reqs if r.status in ("ok", "wrong") and r.ttft_s is not None]
        load = [r for r in ok if r.phase == "load"]
        during = [r.ttft_s for r in load if self.during_fault(r)]
        outside = [r.ttft_s for r in load if not self.during_fault(r)]
        cold = [r.ttft_s for r in load if not self.during_fault(r) and r.cached_tokens == 0]
        final = [r for r in reqs if r.phase == "final"]
        prompt_tokens = sum(r.prompt_tokens for r in load)
        cached = sum(r.cached_tokens for r in load)
        deadline = self.config["lookup_timeout_s"] + self.config["transfer_timeout_s"]
        cold_p50 = percentile(cold, 50)
        p99_during = percentile(during, 99)

        def pct(xs: list[float]) -> dict[str, float | None]:
            return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99)}

        faults = {k: sum(f.kind == k for f in self.faults) for k in FAULT_KINDS}
        return {
            "requests": len(reqs),
            **by_status,
            "faults": len(self.faults),
            "faults_by_kind": faults,
            "unavailable": dict(self.unavailable),
            "hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else None,
            "requests_with_hits": sum(r.cached_tokens > 0 for r in load),
            "final_requests": len(final),
            "final_requests_with_hits": sum(r.cached_tokens > 0 for r in final),
            "ttft_all": pct([r.ttft_s for r in load]),
            "ttft_during_faults": pct(during),
            "ttft_outside_faults": pct(outside),
            "ttft_cold": pct(cold),
            "deadline_s": deadline,
            "target": "p99 TTFT during faults <= cold TTFT p50 + lookup_timeout_s + transfer_timeout_s",
            "target_bound_s": None if cold_p50 is None else cold_p50 + deadline,
            "target_met": None if cold_p50 is None or p99_during is None else p99_during <= cold_p50 + deadline,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "summary": self.summary(),
            "faults": [dataclasses.asdict(f) for f in self.faults],
            # One row per request (REQUEST_COLUMNS), times in ms: a long run has thousands.
            "request_columns": list(REQUEST_COLUMNS),
            "requests": [request_row(r) for r in self.requests],
            "pool_stats": self.pool_stats,
            "t_load_end": self.t_load_end,
        }


# ---- the run -------------------------------------------------------------------------------------


def config_record(cfg: ChaosConfig) -> dict[str, Any]:
    """The run's settings for its results JSON: every field but the log callback, read as is
    (`dataclasses.asdict` would deep-copy the callback, and a progress bar's holds a lock)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "log"}


class ChaosRun:
    """Reference outputs, the deployment, load with faults, a final round; see the module doc."""

    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.work = Path(config.work_dir or tempfile.mkdtemp(prefix="kvpool-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work, 0o700)
        self.prompts = self._prompts()
        self.reference: list[list[int]] = []
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.unavailable: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self.pool: PoolServer | None = None
        self.proxies: list[ProxyProcess] = []
        self.instances: dict[str, OpenAIServer] = {}
        self.ssd_root = self.work / "ssd"
        self.ssd_dir = self.ssd_root / "tier"
        self.flag = str(self.work / "slow.flag")
        self._mounted = False

    # ---- prompts and the reference ----

    def _vocab(self) -> int:
        try:
            return int(json.loads((Path(self.cfg.model_dir) / "config.json").read_text())["vocab_size"])
        except (OSError, KeyError, ValueError):
            return 2048

    def _prompts(self) -> list[list[int]]:
        rng, cfg, vocab = random.Random(f"kvpool-chaos/{self.cfg.seed}"), self.cfg, self._vocab()
        prompts = []
        for _ in range(cfg.n_prefixes):
            prefix = [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.prefix_blocks) * BLOCK)]
            for _ in range(cfg.n_suffixes):
                prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.suffix_tokens))])
        return prompts

    def _server(self, name: str, cores: str, kv: dict[str, Any] | None) -> OpenAIServer:
        return OpenAIServer(
            self.cfg.model_dir, served_model_name="model", max_model_len=self.cfg.max_model_len, block_size=BLOCK,
            prefix_caching=False, dtype=self.cfg.dtype, max_num_batched_tokens=self.cfg.max_model_len,
            kv_transfer_config=kv, log_path=self.work / f"{name}.log", startup_timeout_s=600,
            request_timeout_s=self.cfg.hung_s,
            env={"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1",
                 "VLLM_RPC_BASE_PATH": str(self.work), **self.cfg.server_env},
        )

    def compute_reference(self) -> None:
        self.cfg.log(f"reference: {len(self.prompts)} prompts on a plain vLLM server")
        with self._server("reference", self.cfg.reference_cores, None) as ref:
            self.reference = [ref.complete(p, self.cfg.max_tokens, ignore_eos=True).token_ids for p in self.prompts]

    # ---- the deployment ----

    def _kv_config(self, sock: str, lookup_port: int) -> dict[str, Any]:
        return {
            "kv_connector": "KVPoolConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": "server", "server_socket": sock, "lookup_rpc_port": lookup_port,
                "lookup_timeout_s": self.cfg.lookup_timeout_s, "transfer_timeout_s": self.cfg.transfer_timeout_s,
                "breaker_cooldown_s": self.cfg.breaker_cooldown_s,
            },
        }

    def start_deployment(self) -> None:
        cfg = self.cfg
        self.ssd_root.mkdir(mode=0o700, exist_ok=True)
        if "ssd_full" in cfg.kinds:
            why = tmpfs_mount(self.ssd_root, cfg.ssd_mb)
            if why is None:
                self._mounted = True
            else:
                self.unavailable["ssd_full"] = why
        self.ssd_dir.mkdir(mode=0o700, exist_ok=True)
        upstream = str(self.work / "pool.sock")
        self.pool = PoolServer(upstream, memory_size=cfg.pool_memory, log_path=self.work / "pool.log",
                               extra_args=["--enable-offload", "--offload-path", str(self.ssd_dir)])
        self.pool.start()
        kvs = {}
        for i, name in enumerate(("A", "B")):
            listen = str(self.work / f"proxy-{name}.sock")
            proxy = ProxyProcess(listen, upstream, self.flag, cfg.slow_delay_s, self.work / f"proxy-{name}.log")
            self.proxies.append(proxy.start())
            kvs[name] = self._kv_config(listen, i + 1)
        self.instances = {name: self._server(f"instance-{name}", core, kvs[name])
                          for name, core in zip(("A", "B"), cfg.cores)}
        for srv in self.instances.values():
            srv.start(wait=False)
        for srv in self.instances.values():
            srv.wait_ready()
        cfg.log("deployment up: pool server, 2 proxies, instances A and B")

    def stop_deployment(self) -> None:
        for srv in self.instances.values():
            srv.stop()
        for p in self.proxies:
            p.stop()
        if self.pool is not None:
            self.pool.stop()
        if self._mounted:
            _umount(self.ssd_root)
            self._mounted = False

    # ---- requests ----

    def now(self) -> float:
        return time.monotonic() - self._t0

    def ask(self, client: httpx.Client, instance: str, i: int, phase: str) -> Request:
        t = self.now()
        t0 = time.monotonic()
        rec = Request(t, t, instance, i, phase, "ok")
        try:
            # ignore_eos: always max_tokens, so any greedy vLLM reference (an OpenAI server or
            # an offline engine) is compared token for token.
            c = stream_completion(client, "model", self.prompts[i], self.cfg.max_tokens, ignore_eos=True)
        except (ServerError, httpx.HTTPError, ValueError) as exc:
            elapsed = time.monotonic() - t0
            rec.status = "hung" if isinstance(exc, httpx.TimeoutException) or elapsed >= self.cfg.hung_s else "failed"
            rec.error, rec.total_s = f"{type(exc).__name__}: {exc}"[:500], elapsed
        else:
            rec.ttft_s, rec.total_s = c.ttft_s, c.total_s
            rec.cached_tokens, rec.prompt_tokens = c.cached_tokens, c.prompt_tokens
            if c.total_s >= self.cfg.hung_s:
                rec.status = "hung"
            elif c.token_ids != self.reference[i]:
                rec.status = "wrong"
                rec.error = f"tokens {c.token_ids}, reference {self.reference[i]}"
        rec.t_end = self.now()
        with self._lock:
            self.requests.append(rec)
        if rec.status != "ok":
            self.cfg.log(f"request {phase} #{i} on {instance}: {rec.status} ({rec.error})")
        return rec

    def _clients(self) -> dict[str, httpx.Client]:
        return {name: httpx.Client(base_url=srv.base_url, timeout=httpx.Timeout(self.cfg.hung_s), trust_env=False)
                for name, srv in self.instances.items()}

    def _load_thread(self, k: int) -> None:
        rng = random.Random(f"{self.cfg.seed}/load/{k}")
        clients = self._clients()
        names = sorted(clients)
        try:
            n = k
            while not self._stop.is_set():
                name = names[n % 2]
                n += 1
                self.ask(clients[name], name, rng.randrange(len(self.prompts)), "load")
        finally:
            for c in clients.values():
                c.close()

    # ---- faults ----

    def _available(self) -> list[str]:
        return [k for k in self.cfg.kinds if k not in self.unavailable]

    def inject(self, kind: str) -> Fault:
        """Run one fault to its end (the pool back to normal) and record it."""
        assert self.pool is not None
        cfg, start, detail = self.cfg, self.now(), ""
        if kind == "kill":
            self.pool.kill()
            time.sleep(cfg.kill_down_s)
            self.pool.start()
        elif kind == "pause":
            self.pool.pause()
            time.sleep(cfg.pause_s)
            self.pool.resume()
        elif kind == "writer":
            proc = subprocess.Popen([sys.executable, "-c", _WRITER, self.pool.socket_path], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            assert proc.stdout is not None
            # The clock starts once it writes: on a busy machine its start-up alone can take seconds.
            started = threading.Thread(target=proc.stdout.readline, daemon=True)
            started.start()
            started.join(30)
            time.sleep(cfg.writer_s)
            proc.kill()
            out = proc.communicate(timeout=30)[0].decode(errors="replace")
            detail = "killed while writing" if not started.is_alive() and proc.returncode == -signal.SIGKILL \
                else f"killed before writing: {out[-300:]}"
        elif kind == "corrupt":
            r = subprocess.run([sys.executable, "-c", _ROGUE, self.pool.socket_path, str(cfg.corrupt_ranges),
                                str(cfg.corrupt_bytes), str(self.rng.randrange(1 << 30))],
                               capture_output=True, text=True, timeout=60)
            detail = f"{r.stdout.strip() or r.stderr[-300:]} arena bytes changed"
        elif kind == "ssd_full":
            filler = self.ssd_root / "filler"
            written = 0
            with open(filler, "wb") as f:
                chunk = b"\0" * (1 << 20)
                try:
                    while True:
                        f.write(chunk)
                        f.flush()
                        written += len(chunk)
                except OSError:
                    pass  # ENOSPC: full
            time.sleep(cfg.ssd_full_s)
            filler.unlink()
            detail = f"filler of {written >> 20} MiB"
        elif kind == "slow":
            Path(self.flag).touch()
            time.sleep(cfg.slow_s)
            os.unlink(self.flag)
        else:
            raise ValueError(f"unknown fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
        fault = Fault(kind, start, self.now(), detail)
        with self._lock:
            self.faults.append(fault)
        cfg.log(f"fault {kind}: {fault.t_start:.1f}-{fault.t_end:.1f} s {detail}")
        return fault

    def _fault_loop(self, until: float) -> None:
        deck: list[str] = []
        next_at = self.now() + self.rng.uniform(0.3, 0.7) * self.cfg.fault_every_s
        while self.now() < until:
            if self.now() < next_at:
                time.sleep(min(0.1, next_at - self.now()))
                continue
            if not deck:  # every available kind once per round, in a random order
                deck = self._available()
                self.rng.shuffle(deck)
            start = self.now()
            self.inject(deck.pop())
            next_at = start + self.rng.uniform(0.6, 1.4) * self.cfg.fault_every_s

    # ---- the whole run ----

    def _pool_stats(self) -> dict[str, Any]:
        from kvpool.server.client import PoolClient

        assert self.pool is not None
        try:
            with PoolClient(self.pool.socket_path, "chaos-stats", ping=False) as c:
                stats, clients = c.server_stats()
            return {"stats": stats, "clients": len(clients)}
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            return {"error": f"{type(exc).__name__}: {exc}"}

    def run(self) -> ChaosResult:
        cfg = self.cfg
        if not self.reference:
            self.compute_reference()
        self.start_deployment()
        try:
            self._t0 = time.monotonic()
            clients = self._clients()
            for name in sorted(clients):  # first requests (and the pool's first copies)
                for i in range(0, len(self.prompts), cfg.n_suffixes):
                    self.ask(clients[name], name, i, "warmup")
            threads = [threading.Thread(target=self._load_thread, args=(k,), daemon=True) for k in range(cfg.clients)]
            for t in threads:
                t.start()
            self._fault_loop(self.now() + cfg.duration_s)
            self._stop.set()
            for t in threads:
                t.join(cfg.hung_s + 30)
            t_load_end = self.now()
            cfg.log(f"load done at {t_load_end:.0f} s; final round after {cfg.settle_s:.0f} s")
            time.sleep(cfg.settle_s)
            for _ in range(cfg.final_rounds):
                for i in range(len(self.prompts)):
                    for name in sorted(clients):
                        self.ask(clients[name], name, i, "final")
            for c in clients.values():
                c.close()
            stats = self._pool_stats()
        finally:
            self._stop.set()
            if os.path.exists(self.flag):
                os.unlink(self.flag)
            self.stop_deployment()
        conf = config_record(cfg)
        conf["prompts"] = len(self.prompts)
        return ChaosResult(conf, sorted(self.requests, key=lambda r: r.t_start), self.faults, dict(self.unavailable),
                           stats, t_load_end)


# ---- the proxy's process -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvpool.testing.chaos")
    sub = p.add_subparsers(dest="cmd", required=True)
    px = sub.add_parser("proxy", help="a Unix-socket proxy that delays while a flag file exists")
    px.add_argument("--listen", required=True)
    px.add_argument("--upstream", required=True)
    px.add_argument("--flag", required=True)
    px.add_argument("--delay-s", nargs=2, type=float, default=(0.3, 0.8))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    proxy = SlowProxy(args.listen, args.upstream, args.flag, tuple(args.delay_s))
    try:
        asyncio.run(proxy.serve_forever())
    except (KeyboardInterrupt, SystemExit):
        pass


if __name__ == "__main__":
    main()
