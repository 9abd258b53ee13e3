"""The peer connectors vLLM registers that pool KV on the host, as the benchmarks run them beside
kvpool, and what their logs say when one cannot work on this machine.

A peer is configured once here; `ttft.py` and `trace.py` take its `kv_transfer_config`, the
environment its server needs, and whatever it needs started beside it (`Peer.start_beside`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvpool.testing.launch import ChildProcess, free_port

# LMCache (the `lmcache` package, installed by `make bench` into LMCACHE_SITE without its CUDA-only
# dependencies, since its wheel requires cupy and cuFile), with a 4 GB CPU tier.
LMCACHE_SITE = Path(__file__).resolve().parents[1] / ".venv" / "lmcache-site"
LMCACHE_ENV = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "4",
               "LMCACHE_USE_EXPERIMENTAL": "True"}


def lmcache_env() -> dict[str, str]:
    return {**LMCACHE_ENV, "PYTHONPATH": os.pathsep.join(
        p for p in (str(LMCACHE_SITE), os.environ.get("PYTHONPATH", "")) if p)}


class LMCacheServer(ChildProcess):
    """LMCache's standalone cache server (its multi-process mode), 4 GB of CPU memory, on loopback."""

    name = "lmcache server"

    def __init__(self, port: int, log_path: Path) -> None:
        super().__init__([sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
                          "--port", str(port), "--l1-size-gb", "4", "--eviction-policy", "LRU"],
                         env={**os.environ, **lmcache_env()}, log_path=log_path, startup_timeout_s=120)

    def _ready(self) -> bool:
        return "cache server is running" in self.log()


@dataclasses.dataclass
class Peer:
    """One peer connector as the benchmarks run it (a 4 GB host pool, like kvpool's server)."""

    name: str
    connector: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # It works only beside vLLM's prefix cache (SimpleCPUOffloadConnector turns itself off without
    # it): run with it, emptied before each hit where a benchmark can (`/reset_prefix_cache`).
    needs_prefix_cache: bool = False
    # What it needs started beside vLLM (LMCache's server): given a log directory, it starts that
    # and returns its stop and its log's path.
    beside: Callable[[Path], tuple[Callable[[], None], str]] | None = None

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": self.connector, "kv_role": "kv_both", "kv_connector_extra_config": dict(self.extra)}


def _lmcache_mp() -> Peer:
    port = free_port()
    peer = Peer("lmcache_mp", "LMCacheMPConnector", {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
                lmcache_env())
    starts = [0]

    def beside(logs: Path) -> tuple[Callable[[], None], str]:
        starts[0] += 1
        server = LMCacheServer(port, logs / f"lmcache-server-{starts[0]}.log")
        return server.start().stop, str(server.log_path)

    peer.beside = beside
    return peer


def peers() -> dict[str, Peer]:
    """Every peer, by the configuration name the benchmarks give it (fresh ports each call)."""
    return {p.name: p for p in (
        Peer("offloading", "OffloadingConnector", {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 4 << 30}),
        Peer("simple_offload", "SimpleCPUOffloadConnector", {"cpu_bytes_to_use": 4 << 30},
             {"VLLM_SERVER_DEV_MODE": "1"}, needs_prefix_cache=True),
        Peer("lmcache", "LMCacheConnectorV1", {}, lmcache_env()),
        _lmcache_mp(),
    )}


PEER_NAMES = tuple(peers())

# A server log's line that says why a connector could not work: vLLM's report of a worker's
# error, an exception's message, or a connector's own notice that it turned itself off or works
# without its store.
_REASONS = (
    ("worker", re.compile(r"Worker failed with error '(.+)', please check")),
    ("exception", re.compile(r"\b((?:[A-Z][A-Za-z]*)(?:Error|Exception): .+)")),
    ("notice", re.compile(r"((?:Detected|No handler registered for operation|System will operate)[^\x1b]*)")),
)


def log_reason(paths: Iterable[str]) -> str | None:
    """What the logs say about why a connector failed or did nothing: a worker's error if vLLM
    reported one, else the first exception's message, else a connector's notice."""
    found: dict[str, str] = {}
    for path in paths:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if "ulimit" in line or "Engine core initialization failed" in line:
                continue  # vLLM's start-up advice, and the wrapper of the real error
            for kind, pattern in _REASONS:
                if kind not in found and (match := pattern.search(line)):
                    found[kind] = match.group(1).strip()[:300]
    return found.get("worker") or found.get("exception") or found.get("notice")
