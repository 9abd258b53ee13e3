#!/usr/bin/env python
"""Store throughput: put/get GB/s and 64-key lookup latency, kvpool backends against copy ceilings.

    .venv/bin/python benchmarks/store.py            # full run (< 3 min): 256 MiB working set, 5 rounds
    .venv/bin/python benchmarks/store.py --quick    # smoke run (< 60 s): 64 MiB, 3 rounds

(redis, mooncake and yuanrong: 64 MiB per round, quick 32 MiB; `--dist-working-set`.)

For 256 KiB and 2 MiB values (one contiguous buffer each, put and read in batches of 16 keys,
as a vLLM step moves a chunk of blocks) it measures, side by side in one run:

  memcpy   in-process numpy copies: source -> arena (put), arena -> destination (get). The
           reference ceiling: what copying the bytes once costs on this machine, nothing else.
  shm      `multiprocessing.shared_memory` between two processes: a writer process copies the
           values into a shared segment, a reader process copies them out. A store with zero
           bookkeeping could not do better across processes.
  local    the `local` backend: the pool engine inside the calling process, so put and get run in
           ONE process (it cannot be shared between processes; that is what `server` is for).
  server   a `kvpool server` daemon and two client processes (each `create_backend` with
           `backend: server`): a writer process puts, a reader process gets. Only when
           `kvpool.server.daemon` exists; otherwise reported as "not available".
  redis    a real `redis-server` (kvpool.testing.services), a writer and a reader client process.
  mooncake a real `mooncake_master` (the spec's flags), TCP; the writer client mounts the pool as
           its segment, the reader mounts none. Objects live in the holder's segment and vanish
           when it closes, so the writer stays alive until the reader's gets and lookups are done.
  yuanrong a real datasystem worker (`dscli`, own metastore), one for both value sizes (a
           `key_prefix` each); a writer and a reader client process.
  memcache not run: its client cannot start without the Ascend driver (docs/backends.md).
  These three use a smaller working set, and their pools hold every round (no eviction while
  measured: their eviction is not exact LRU and would drop the round being read); a service
  that is missing is "not available: <why>", one that fails is "failed: <why>" (not fatal).

Every case first writes the working set three times (warm-up: page faults of a fresh arena and
the first evictions are not what is measured), then times `rounds` rounds of fresh keys. memcpy
runs a block of `rounds` rounds before the first case and after each other case, and its figure is
the median of all those rounds: it is cheap, every target is relative to it, and on a shared
machine a single block can land in someone else's burst. Each
round puts the working set (pool capacity is about twice the working set, so steady-state puts
evict the oldest values, as in a full pool) and then the reader gets all of it into
pre-faulted buffers. The writer and the reader take turns (never both copying at once: this
machine may have 2 cores). A round's GB/s is bytes / wall time of the calls (1 GB = 1e9 bytes);
the table shows the median round. Every value read is compared byte for byte with what was
written, outside the timed region; a mismatch fails the run.

Lookup: `batch_exists(keys, lease=True)` on 64 stored keys, as the connector's scheduler-side
lookup calls it, repeated `lookups` times on the same keys (a hot prefix); median and p99 in ms.
Also without a lease (`lease=False`) for comparison.

Targets (from issue 3): `server` put and get each >= 40% of the memcpy figure of the same run
(memcpy figure: the mean of memcpy's put and get GB/s for that value size), and a 64-key
batched lookup (lease=True) under 0.5 ms median.

Writes `benchmarks/results/store.json` (`store-quick.json` with --quick) and, on a full run,
regenerates docs/benchmarks.md from every result file (`--no-docs` skips this).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    RESULTS_DIR, choose, fmt, machine_info, markdown_table, percentile, progress, pyplot, update_results_page, say,
    write_json,
)
from plotting import COLORS, finish

from kvpool.testing.launch import PoolServer
from kvpool.testing.proc import tail

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"256KiB": 256 * KiB, "2MiB": 2 * MiB}
BATCH = 16
LOOKUP_KEYS = 64
WARMUP_ROUNDS = 3
SERVER_MODULE = "kvpool.server.daemon"
PUT_TARGET = 0.40  # of the memcpy figure
LOOKUP_TARGET_MS = 0.5
# Backends reached through an external service: smaller working set (their pools live in that
# service's memory, and a round-trip per batch makes rounds slower), see --dist-working-set.
DISTRIBUTED = ("redis", "mooncake", "yuanrong")
MEMCACHE_WHY = "not available: needs the Ascend driver"


def _source(working_set: int, seed: int) -> np.ndarray:
    """The bytes every case writes (and every reader expects): random, so nothing compresses or dedups."""
    return np.frombuffer(np.random.default_rng(seed).bytes(working_set), dtype=np.uint8)


def _prefault(n: int) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    buf.fill(1)
    return buf


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _views(buf: np.ndarray, size: int) -> list[np.ndarray]:
    return [buf[i : i + size] for i in range(0, buf.size, size)]


# ---- copy ceilings -------------------------------------------------------------------------------


def run_memcpy(size: int, working_set: int, rounds: int, seed: int) -> dict[str, Any]:
    src = _source(working_set, seed)
    arena = _prefault(2 * working_set)
    dst = _prefault(working_set)
    src_v, dst_v = _views(src, size), _views(dst, size)
    puts, gets = [], []
    for rnd in range(-WARMUP_ROUNDS, rounds):
        slot = _views(arena[(rnd % 2) * working_set :][:working_set], size)
        t = time.perf_counter()
        for a, s in zip(slot, src_v):
            np.copyto(a, s)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        for d, a in zip(dst_v, slot):
            np.copyto(d, a)
        get_s = time.perf_counter() - t
        if not np.array_equal(dst, src):
            raise AssertionError("memcpy: bytes differ")
        if rnd >= 0:
            puts.append(_gbps(working_set, put_s))
            gets.append(_gbps(working_set, get_s))
    return {"put_gbps": puts, "get_gbps": gets}


def _shm_worker(role: str, conn, name: str, size: int, working_set: int, seed: int) -> None:
    try:
        shm = shared_memory.SharedMemory(name=name)
        try:
            arena = np.ndarray((2 * working_set,), dtype=np.uint8, buffer=shm.buf)
            src = _source(working_set, seed)  # the writer's values; the reader's expected bytes
            dst = _prefault(working_set) if role == "reader" else None
            if role == "writer":  # warm-up: fault in the whole segment
                for rnd in range(-WARMUP_ROUNDS, 0):
                    for a, s in zip(_views(arena[(rnd % 2) * working_set :][:working_set], size), _views(src, size)):
                        np.copyto(a, s)
            conn.send(("ready",))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                rnd = msg[1]
                slot = _views(arena[(rnd % 2) * working_set :][:working_set], size)
                if role == "writer":
                    t = time.perf_counter()
                    for a, s in zip(slot, _views(src, size)):
                        np.copyto(a, s)
                    conn.send(("done", time.perf_counter() - t, True))
                else:
                    t = time.perf_counter()
                    for d, a in zip(_views(dst, size), slot):
                        np.copyto(d, a)
                    elapsed = time.perf_counter() - t
                    conn.send(("done", elapsed, bool(np.array_equal(dst, src))))
            del arena, slot
        finally:
            shm.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_shm(size: int, working_set: int, rounds: int, seed: int) -> dict[str, Any]:
    shm = shared_memory.SharedMemory(create=True, size=2 * working_set)
    try:
        return _two_processes(_shm_worker, (shm.name, size, working_set, seed), rounds, lookups=0)
    finally:
        shm.close()
        shm.unlink()


# ---- backends ------------------------------------------------------------------------------------


class BackendCase:
    """Puts/gets rounds of fresh keys through one Backend client; used in-process and in workers."""

    def __init__(self, backend, size: int, working_set: int, seed: int, tag: str) -> None:
        self.backend = backend
        self.size = size
        self.n = working_set // size
        self.working_set = working_set
        self.src = _source(working_set, seed)
        self.tag = tag
        self._dst: np.ndarray | None = None

    def keys(self, rnd: int) -> list[str]:
        return [f"{self.tag}-{self.size}-r{rnd}-{i}" for i in range(self.n)]

    def _batches(self, op: str, rnd: int, buf: np.ndarray) -> float:
        """Seconds to `op` ("put" or "get") round `rnd`'s keys from/into `buf`, BATCH keys a call."""
        call = self.backend.batch_put if op == "put" else self.backend.batch_get_into
        keys, views = self.keys(rnd), _views(buf, self.size)
        codes: list[int] = []
        t = time.perf_counter()
        for j in range(0, self.n, BATCH):
            codes += call(keys[j : j + BATCH], [[v] for v in views[j : j + BATCH]])
        elapsed = time.perf_counter() - t
        if any(codes):
            raise AssertionError(f"{op} round {rnd}: codes {sorted(set(codes))}")
        return elapsed

    def put(self, rnd: int) -> tuple[float, bool]:
        return self._batches("put", rnd, self.src), True

    def get(self, rnd: int) -> tuple[float, bool]:
        if self._dst is None:
            self._dst = _prefault(self.working_set)
        self._dst.fill(0)
        return self._batches("get", rnd, self._dst), bool(np.array_equal(self._dst, self.src))

    def lookup(self, rnd: int, iterations: int) -> dict[str, list[float]]:
        keys = self.keys(rnd)
        keys = (keys * (LOOKUP_KEYS // len(keys) + 1))[:LOOKUP_KEYS] if len(keys) < LOOKUP_KEYS else keys[-LOOKUP_KEYS:]
        out: dict[str, list[float]] = {}
        for lease in (False, True):
            lat = []
            for _ in range(iterations):
                t = time.perf_counter()
                found = self.backend.batch_exists(keys, lease=lease)
                lat.append((time.perf_counter() - t) * 1e3)
                if not all(found):
                    raise AssertionError(f"lookup: {found.count(False)} of {len(keys)} stored keys not found")
            out["lease" if lease else "no_lease"] = lat
        return out


def _backend_worker(role: str, conn, extra: dict, size: int, working_set: int, seed: int) -> None:
    try:
        from kvpool.backends import create_backend
        from kvpool.config import load_config

        cfg = extra.get(role, extra) if "writer" in extra else extra  # per-role config (mooncake)
        backend = create_backend(load_config(cfg), f"bench-{role}-{os.getpid()}")
        try:
            case = BackendCase(backend, size, working_set, seed, tag=str(cfg.get("backend", "srv"))[:3])
            if role == "writer":
                for rnd in range(-WARMUP_ROUNDS, 0):
                    case.put(rnd)
            conn.send(("ready",))
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if msg[0] == "lookup":
                    conn.send(("done", case.lookup(msg[1], msg[2])))
                else:
                    elapsed, ok = case.put(msg[1]) if role == "writer" else case.get(msg[1])
                    conn.send(("done", elapsed, ok))
        finally:
            backend.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _two_processes(target, args: tuple, rounds: int, lookups: int) -> dict[str, Any]:
    """A writer process puts round r, then a reader process gets it; the parent only orchestrates."""
    ctx = mp.get_context("spawn")
    pipes, procs = {}, {}
    for role in ("writer", "reader"):
        parent, child = ctx.Pipe()
        pipes[role] = parent
        procs[role] = ctx.Process(target=target, args=(role, child, *args), daemon=True)
        procs[role].start()

    def recv(role: str, timeout: float = 120.0):
        if not pipes[role].poll(timeout):
            raise TimeoutError(f"{role} process did not answer within {timeout:.0f} s")
        msg = pipes[role].recv()
        if msg[0] == "error":
            raise RuntimeError(f"{role} process failed:\n{msg[1]}")
        return msg

    try:
        recv("writer")  # set up and warmed up: the warm-up rounds are written
        recv("reader")
        pipes["reader"].send(("round", -1))  # the reader's warm-up: read the last warm-up round
        recv("reader")
        puts, gets, ok = [], [], True
        working_set = args[-2]
        for rnd in range(rounds):
            pipes["writer"].send(("round", rnd))
            _, put_s, _ = recv("writer")
            pipes["reader"].send(("round", rnd))
            _, get_s, same = recv("reader")
            ok &= same
            puts.append(_gbps(working_set, put_s))
            gets.append(_gbps(working_set, get_s))
        if not ok:
            raise AssertionError("the reader process got bytes that differ from what was written")
        out: dict[str, Any] = {"put_gbps": puts, "get_gbps": gets}
        if lookups:
            pipes["reader"].send(("lookup", rounds - 1, lookups))
            out["lookup_ms"] = recv("reader")[1]
        return out
    finally:
        for role in ("writer", "reader"):
            try:
                pipes[role].send(("stop",))
            except OSError:
                pass
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _pool_capacity(working_set: int) -> int:
    # Two working sets plus slack: steady-state puts evict the round before last, never the
    # round being read.
    return 2 * working_set + working_set // 4


def _dist_capacity(working_set: int, rounds: int) -> int:
    # redis (sampled LRU) and mooncake (evicts a ratio of unleased objects, not the oldest)
    # do not evict exact LRU: in a pool of ~2 working sets they drop values of the round being
    # read (-704, not found). Their pools hold every round instead (warm-up + timed + one spare,
    # under Mooncake's 0.9 eviction watermark), so no eviction happens while they are measured.
    return int((WARMUP_ROUNDS + rounds + 1) * working_set / 0.85)


def run_local(size: int, working_set: int, rounds: int, seed: int, lookups: int) -> dict[str, Any]:
    from kvpool.backends import create_backend
    from kvpool.config import load_config

    backend = create_backend(
        load_config({"backend": "local", "local_cpu_size": _pool_capacity(working_set)}), "bench-local"
    )
    try:
        case = BackendCase(backend, size, working_set, seed, tag="local")
        for rnd in range(-WARMUP_ROUNDS, 0):
            case.put(rnd)
        case.get(-1)
        puts, gets = [], []
        for rnd in range(rounds):
            put_s, _ = case.put(rnd)
            get_s, same = case.get(rnd)
            if not same:
                raise AssertionError("local: bytes read differ from what was written")
            puts.append(_gbps(working_set, put_s))
            gets.append(_gbps(working_set, get_s))
        out: dict[str, Any] = {"put_gbps": puts, "get_gbps": gets}
        if lookups:
            out["lookup_ms"] = case.lookup(rounds - 1, lookups)
        return out
    finally:
        backend.close()


def server_available() -> bool:
    return importlib.util.find_spec(SERVER_MODULE) is not None


def run_server(size: int, working_set: int, rounds: int, seed: int, lookups: int) -> dict[str, Any]:
    """A `kvpool server` on a private socket (a short path: sun_path holds 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvpb-") as d:
        with PoolServer(os.path.join(d, "s.sock"), memory_size=_pool_capacity(working_set),
                        log_path=os.path.join(d, "server.log"), startup_timeout_s=15) as daemon:
            try:
                extra = {"backend": "server", "server_socket": daemon.socket_path}
                return _two_processes(_backend_worker, (extra, size, working_set, seed), rounds, lookups)
            except Exception as exc:
                raise RuntimeError(f"{exc}\n--- server log ---\n{daemon.log_tail(2000)}") from exc


class _Skip(Exception):
    """A backend that cannot run here: reported as "not available: <why>", not as a failure."""


def _service(factory):
    from kvpool.testing.services import ServiceError

    try:
        return factory()
    except ServiceError as exc:
        raise _Skip(str(exc).splitlines()[0]) from exc


def run_redis(size: int, working_set: int, rounds: int, seed: int, lookups: int) -> dict[str, Any]:
    """A real `redis-server` (maxmemory = start-up footprint + pool capacity, allkeys-lru)."""
    from kvpool.testing.services import RedisService

    workdir = tempfile.mkdtemp(prefix="kvpb-redis-")
    svc = _service(lambda: RedisService(workdir, capacity=_dist_capacity(working_set, rounds)))
    try:
        extra = {"backend": "redis", "redis_url": svc.url}
        return _two_processes(_backend_worker, (extra, size, working_set, seed), rounds, lookups)
    finally:
        svc.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def run_mooncake(size: int, working_set: int, rounds: int, seed: int, lookups: int) -> dict[str, Any]:
    """A real `mooncake_master` (the spec's flags); the writer mounts the pool's whole capacity
    as its segment, the reader mounts none. Objects live in the segment of the client that holds
    them and vanish when it closes, so the writer stays alive until the reader is done
    (`_two_processes` stops both only after the reader's last get and its lookups)."""
    from kvpool.testing.services import MooncakeMaster

    workdir = tempfile.mkdtemp(prefix="kvpb-mc-")
    master = _service(lambda: MooncakeMaster(workdir))
    try:
        holder = master.write_config(os.path.join(workdir, "writer.json"), _dist_capacity(working_set, rounds),
                                     local_buffer_size="16MB")
        client = master.write_config(os.path.join(workdir, "reader.json"), 0, local_buffer_size="16MB")
        extra = {"writer": {"backend": "mooncake", "mooncake_config_path": holder},
                 "reader": {"backend": "mooncake", "mooncake_config_path": client}}
        return _two_processes(_backend_worker, (extra, size, working_set, seed), rounds, lookups)
    except Exception as exc:
        raise RuntimeError(f"{exc}\n--- mooncake_master log ---\n{tail(master.log, 2000)}") from exc
    finally:
        master.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class YuanrongPool:
    """One datasystem worker for both value sizes (`dscli start`/`stop` take ~6 s each); each size
    is a `key_prefix` of its own, and the previous size's objects are evictable."""

    def __init__(self, working_set: int) -> None:
        from kvpool.testing.services import YuanrongWorker

        self.workdir = tempfile.mkdtemp(prefix="kvpb-yr-")
        mb = -(-_pool_capacity(working_set) // MiB)
        try:
            self.worker = _service(lambda: YuanrongWorker(self.workdir, shared_memory_mb=mb))
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def run(self, size: int, working_set: int, rounds: int, seed: int, lookups: int) -> dict[str, Any]:
        path = os.path.join(self.workdir, f"yr-{size}.json")
        with open(path, "w") as f:
            json.dump({"worker_addr": self.worker.address, "key_prefix": f"b{os.getpid()}s{size}:",
                       "connect_timeout_ms": 5000, "request_timeout_ms": 5000}, f)
        extra = {"backend": "yuanrong", "yuanrong_config_path": path}
        try:
            return _two_processes(_backend_worker, (extra, size, working_set, seed), rounds, lookups)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n--- worker log ---\n{self.worker.worker_log_tail()}") from exc

    def close(self) -> None:
        try:
            self.worker.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


# ---- report --------------------------------------------------------------------------------------

CASES = ("memcpy", "shm", "local", "server", "redis", "mooncake", "yuanrong", "memcache")
LABELS = {
    "memcpy": "memcpy (1 process)",
    "shm": "shared_memory (2 processes)",
    "local": "local (1 process)",
    "server": "server (2 client processes)",
    "redis": "redis (2 client processes)",
    "mooncake": "mooncake (2 client processes, TCP)",
    "yuanrong": "yuanrong (2 client processes)",
    "memcache": "memcache",
}


def _summary(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in ("put", "get"):
        xs = raw[f"{op}_gbps"]
        out[f"{op}_gbps"] = statistics.median(xs)
        out[f"{op}_gbps_min"], out[f"{op}_gbps_max"] = min(xs), max(xs)
    if "lookup_ms" in raw:
        for mode, lat in raw["lookup_ms"].items():
            out[f"lookup_{mode}_median_ms"] = statistics.median(lat)
            out[f"lookup_{mode}_p99_ms"] = percentile(lat, 99)
            out[f"lookup_{mode}_first100_median_ms"] = statistics.median(lat[:100])
            out[f"lookup_{mode}_last100_median_ms"] = statistics.median(lat[-100:])
    return out


def table(results: dict[str, Any]) -> str:
    head = ["backend", "working set"]
    for label in SIZES:
        head += [f"put {label} GB/s", f"get {label} GB/s"]
    head += ["lookup64 lease median ms", "p99 ms", "lookup64 no-lease median ms", "p99 ms"]
    rows = []
    for case in CASES:
        row = [LABELS[case]]
        entry = results["cases"].get(case, {})
        if entry.get("status") != "ok":
            why = entry.get("status", "not run")
            if entry.get("why"):
                why += ": " + entry["why"]
            row += [why.replace("|", "\\|")] + [""] * (len(head) - 2)
            rows.append(row)
            continue
        row.append(f"{entry.get('working_set', results['parameters']['working_set']) // MiB} MiB")
        for label in SIZES:
            s = entry["sizes"][label]
            row += [fmt(s["put_gbps"], 2), fmt(s["get_gbps"], 2)]
        look = entry["sizes"][next(iter(SIZES))]
        for mode in ("lease", "no_lease"):
            row += [fmt(look.get(f"lookup_{mode}_median_ms"), 3), fmt(look.get(f"lookup_{mode}_p99_ms"), 3)]
        rows.append(row)
    return markdown_table(head, rows)


def targets(results: dict[str, Any]) -> dict[str, Any]:
    cases = results["cases"]
    out: dict[str, Any] = {}
    if cases.get("server", {}).get("status") != "ok":
        why = cases.get("server", {}).get("status", "not run")
        for label in SIZES:
            for op in ("put", "get"):
                out[f"server_{op}_{label}_ge_40pct_memcpy"] = {"met": None, "why": f"server {why}"}
        out["server_lookup64_median_lt_0.5ms"] = {"met": None, "why": f"server {why}"}
        return out
    for label in SIZES:
        m = cases["memcpy"]["sizes"][label]
        ceiling = (m["put_gbps"] + m["get_gbps"]) / 2
        raw = results["raw"]["memcpy"][label]
        best = percentile(raw["put_gbps"] + raw["get_gbps"], 90)
        for op in ("put", "get"):
            got = cases["server"]["sizes"][label][f"{op}_gbps"]
            out[f"server_{op}_{label}_ge_40pct_memcpy"] = {
                "met": got >= PUT_TARGET * ceiling, "value_gbps": got, "memcpy_gbps": ceiling,
                "ratio": got / ceiling, "memcpy_p90_gbps": best, "ratio_to_p90": got / best,
            }
    med = cases["server"]["sizes"][next(iter(SIZES))]["lookup_lease_median_ms"]
    look = cases["server"]["sizes"][next(iter(SIZES))]
    out["server_lookup64_median_lt_0.5ms"] = {
        "met": med < LOOKUP_TARGET_MS, "value_ms": med,
        "first100_median_ms": look["lookup_lease_first100_median_ms"],
        "last100_median_ms": look["lookup_lease_last100_median_ms"],
    }
    return out


def _target_lines(tg: dict[str, Any]) -> list[str]:
    lines = []
    for name, t in tg.items():
        if t["met"] is None:
            verdict = f"not evaluated ({t['why']})"
        else:
            verdict = "met" if t["met"] else "NOT met"
            if "ratio" in t:
                verdict += (f" ({t['value_gbps']:.2f} GB/s = {t['ratio']:.0%} of memcpy {t['memcpy_gbps']:.2f} GB/s; "
                            f"{t['ratio_to_p90']:.0%} of memcpy's p90 round {t['memcpy_p90_gbps']:.2f} GB/s)")
            else:
                verdict += (f" ({t['value_ms']:.3f} ms; first 100 lookups {t['first100_median_ms']:.3f} ms, "
                            f"last 100 {t['last100_median_ms']:.3f} ms)")
        lines.append(f"{name}: {verdict}")
    return lines


# Short names for the plot's axis (the table's LABELS are sentences).
SHORT = {"memcpy": "memcpy", "shm": "shared_memory", "local": "local", "server": "server", "redis": "redis",
         "mooncake": "mooncake (TCP)", "yuanrong": "yuanrong", "memcache": "memcache"}


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Throughput per backend (put and get GB/s for each value size, grouped bars with the min-max
    of the rounds) and the 64-key lookup per backend, from a store.json dict, at `path` (None:
    matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        return None
    cases = results["cases"]
    sizes = list(results["parameters"]["value_sizes"])
    order = [c for c in CASES if c in cases]
    fig, (ax, lk) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 1.3]})
    bars = [(op, size) for size in sizes for op in ("put", "get")]
    width = 0.8 / len(bars)
    shades = {("put", 0): "#9ecae1", ("get", 0): "#3182bd", ("put", 1): "#fdae6b", ("get", 1): "#e6550d"}
    top = max((e["sizes"][s][f"{op}_gbps_max"] for e in cases.values() if e.get("status") == "ok"
               for op, s in bars), default=1.0)
    for k, (op, size) in enumerate(bars):
        xs, ys, lo, hi = [], [], [], []
        for i, case in enumerate(order):
            e = cases[case]
            if e.get("status") != "ok":
                continue
            v = e["sizes"][size]
            xs.append(i - 0.4 + width * (k + 0.5))
            ys.append(v[f"{op}_gbps"])
            lo.append(v[f"{op}_gbps"] - v[f"{op}_gbps_min"])
            hi.append(v[f"{op}_gbps_max"] - v[f"{op}_gbps"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"{op} {size}",
               color=shades.get((op, sizes.index(size) % 2), None), error_kw={"lw": 0.8})
    for i, case in enumerate(order):
        e = cases[case]
        if e.get("status") != "ok":  # say why there is no bar, instead of a gap that reads as 0
            ax.text(i, top * 0.04, f"{e.get('status', 'not run')}" + (f":\n{e['why'][:40]}" if e.get("why") else ""),
                    ha="center", va="bottom", fontsize=7, color="grey", rotation=90)
    ws = results["parameters"]

    def tick(c: str) -> str:
        if cases[c].get("status") != "ok":
            return SHORT.get(c, c)
        procs = "1 process" if c in ("memcpy", "local") else "2 processes"
        return f"{SHORT.get(c, c)}\n{procs}\n{(cases[c].get('working_set') or ws['working_set']) // MiB} MiB/round"

    ax.set_xticks(range(len(order)), [tick(c) for c in order], fontsize=8)
    ax.set_ylabel("GB/s (1 GB = 10^9 bytes), median round; bars: min-max")
    ax.set_title(f"put and get throughput, batches of {ws['batch']} keys", fontsize=10)
    ax.set_ylim(0, top * 1.1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(bars), loc="upper right")

    first = sizes[0]
    looked = [c for c in order if cases[c].get("status") == "ok"
              and f"lookup_lease_median_ms" in cases[c]["sizes"].get(first, {})]
    for k, (mode, hatch) in enumerate((("lease", None), ("no_lease", "//"))):
        meds = [cases[c]["sizes"][first][f"lookup_{mode}_median_ms"] for c in looked]
        p99 = [cases[c]["sizes"][first][f"lookup_{mode}_p99_ms"] for c in looked]
        lk.bar([i - 0.2 + 0.4 * k for i in range(len(looked))], meds, 0.4,
               yerr=[[0] * len(meds), [max(0.0, p - m) for p, m in zip(p99, meds)]], capsize=2,
               color=[COLORS.get(c, "tab:gray") for c in looked], hatch=hatch, edgecolor="white",
               error_kw={"lw": 0.8})
    lk.axhline(LOOKUP_TARGET_MS, color="k", ls="--", lw=0.8)
    # The bars take each backend's colour; the legend shows only what the hatching means.
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lk.legend(handles=[Patch(facecolor="grey", label="with lease (as the connector looks up)"),
                       Patch(facecolor="grey", hatch="//", edgecolor="white", label="no lease"),
                       Line2D([], [], color="k", ls="--", lw=0.8, label=f"target {LOOKUP_TARGET_MS} ms (server)")],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    lk.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter, LogLocator
    lk.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # 0.02, 0.05, 0.1 rather than 2x10^-2
    lk.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    lk.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    lk.set_xticks(range(len(looked)), [SHORT.get(c, c).split(" ")[0] for c in looked], fontsize=8, rotation=30)
    lk.set_ylabel("ms, median; whisker: p99 (log)")
    lk.set_title(f"lookup: batch_exists of {results['parameters']['lookup_keys']} stored keys", fontsize=10)
    kind = "quick run" if results["parameters"].get("quick") else "full run"
    return finish(plt, fig, f"Store throughput per backend ({kind}, benchmarks/store.py)", results, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 MiB working set, 3 rounds (< 20 s)")
    ap.add_argument("--working-set", type=int, default=None, help="MiB per round (default 256, quick 64)")
    ap.add_argument("--dist-working-set", type=int, default=None,
                    help="MiB per round for redis/mooncake/yuanrong (default 64, quick 32)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, quick 3)")
    ap.add_argument("--lookups", type=int, default=None, help="64-key lookups per mode (default 1000, quick 200)")
    ap.add_argument("--cases", default=None,
                    help=f"comma-separated subset of {','.join(CASES[1:])} (default all; memcpy, the "
                         "reference, always runs; a subset never updates the docs)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    ap.add_argument("--no-docs", action="store_true", help="do not regenerate docs/benchmarks.md")
    args = ap.parse_args(argv)
    cases = choose(ap, args.cases, CASES[1:], "case") if args.cases else list(CASES[1:])
    working_set = (args.working_set or (64 if args.quick else 256)) * MiB
    dist_ws = (args.dist_working_set or (32 if args.quick else 64)) * MiB
    rounds = args.rounds or (3 if args.quick else 5)
    lookups = args.lookups or (200 if args.quick else 1000)
    out = args.out or RESULTS_DIR / ("store-quick.json" if args.quick else "store.json")
    seed = 1234

    t0 = time.monotonic()
    results: dict[str, Any] = {
        "environment": machine_info(numpy=np.__version__),
        "parameters": {"working_set": working_set, "rounds": rounds, "warmup_rounds": WARMUP_ROUNDS,
                       "batch": BATCH, "lookups": lookups, "lookup_keys": LOOKUP_KEYS,
                       "value_sizes": SIZES, "quick": args.quick,
                       "distributed_working_set": dist_ws, "distributed_backends": list(DISTRIBUTED)},
        "cases": {},
        "raw": {},
    }
    runners = {
        "shm": lambda size, look: run_shm(size, working_set, rounds, seed),
        "local": lambda size, look: run_local(size, working_set, rounds, seed, look),
        "server": lambda size, look: run_server(size, working_set, rounds, seed, look),
        "redis": lambda size, look: run_redis(size, dist_ws, rounds, seed, look),
        "mooncake": lambda size, look: run_mooncake(size, dist_ws, rounds, seed, look),
        "yuanrong": lambda size, look: yr_pool[0].run(size, dist_ws, rounds, seed, look),
    }
    yr_pool: list[YuanrongPool] = []
    failed = False
    memcpy_raw: dict[str, dict[str, list[float]]] = {
        label: {"put_gbps": [], "get_gbps": []} for label in SIZES
    }

    def memcpy_block() -> None:
        # The ceiling is sampled before and after every other case and pooled: on a shared
        # machine one block can land in someone else's burst, and every target divides by it.
        for label, size in SIZES.items():
            raw = run_memcpy(size, working_set, rounds, seed)
            for op in ("put_gbps", "get_gbps"):
                memcpy_raw[label][op] += raw[op]

    # One step per case and value size, plus the memcpy blocks between them: the steps a full run
    # spends its minutes on.
    bar = progress(len(cases) * len(SIZES) + len(cases) + 1, "store", unit="step")
    memcpy_block()
    bar.update(1)
    for case in cases:
        bar.set_postfix_str(case)
        if case == "server" and not server_available():
            results["cases"][case] = {"status": "not available"}
            say(f"{case}: not available ({SERVER_MODULE} does not exist yet)")
            bar.update(len(SIZES) + 1)
            continue
        if case == "memcache":  # see docs/backends.md: its client cannot start without an NPU
            results["cases"][case] = {"status": "not available", "why": MEMCACHE_WHY.split(": ", 1)[1]}
            say(f"{case}: {MEMCACHE_WHY}")
            bar.update(len(SIZES) + 1)
            continue
        entry: dict[str, Any] = {"status": "ok", "sizes": {},
                                 "working_set": dist_ws if case in DISTRIBUTED else working_set}
        t_case = time.monotonic()
        measured = 0
        try:
            if case == "yuanrong":
                yr_pool.append(YuanrongPool(dist_ws))
            for i, (label, size) in enumerate(SIZES.items()):
                t = time.monotonic()
                raw = runners[case](size, lookups if i == 0 else 0)
                entry["sizes"][label] = _summary(raw)
                raw.pop("lookup_ms", None)  # summarised above; thousands of samples do not belong in git
                results["raw"].setdefault(case, {})[label] = raw
                s = entry["sizes"][label]
                say(f"{case:8s} {label:7s} put {s['put_gbps']:6.2f} GB/s  get {s['get_gbps']:6.2f} GB/s"
                    f"  ({time.monotonic() - t:.1f} s)")
                bar.update(1)
                measured += 1
        except _Skip as exc:
            entry = {"status": "not available", "why": str(exc)}
            say(f"{case}: not available: {exc}")
        except Exception as exc:
            # The distributed backends are reported, not fatal: the table says why one failed.
            if case not in DISTRIBUTED:
                failed = True
            entry = {"status": "failed", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                     "error": traceback.format_exc()}
            print(f"{case}: FAILED\n{entry['error']}", file=sys.stderr, flush=True)
        finally:
            while yr_pool:
                yr_pool.pop().close()
        entry["case_s"] = time.monotonic() - t_case
        results["cases"][case] = entry
        bar.update(len(SIZES) - measured)  # the sizes a failure or a missing service skipped
        memcpy_block()
        bar.update(1)
    bar.close()
    results["raw"]["memcpy"] = memcpy_raw
    results["cases"]["memcpy"] = {"status": "ok", "sizes": {label: _summary(memcpy_raw[label]) for label in SIZES}}
    for label in SIZES:
        s = results["cases"]["memcpy"]["sizes"][label]
        print(f"memcpy  {label:7s} put {s['put_gbps']:6.2f} GB/s  get {s['get_gbps']:6.2f} GB/s"
              f"  ({len(memcpy_raw[label]['put_gbps'])} rounds across the run)", flush=True)
    results["targets"] = targets(results)
    results["runtime_s"] = time.monotonic() - t0

    text = table(results)
    lines = _target_lines(results["targets"])
    print()
    print(text)
    print()
    for line in lines:
        print(line)
    print(f"\nruntime {results['runtime_s']:.1f} s; {working_set // MiB} MiB working set "
          f"({dist_ws // MiB} MiB for {', '.join(DISTRIBUTED)}), {rounds} rounds")
    write_json(out, results)
    png = plot(results, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {png}" if png else " (no plot: matplotlib not installed)"))
    if not args.quick and not args.no_docs and not failed and not args.cases:
        print(f"updated {update_results_page()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
