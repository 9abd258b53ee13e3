"""`backend: local` — the pool engine inside the vLLM worker process (memory tier + SSD tier)."""

from __future__ import annotations

import argparse

import numpy as np

from kvpool.backends.base import Backend, Presence, gather, total_size
from kvpool.backends.diagnosis import Report, check_lease, check_ssd_quota, human, mem_available
from kvpool.config import KVPoolConfig, LocalSettings
from kvpool.errors import ErrorCode
from kvpool.store import PoolEngine


class LocalBackend(Backend):
    """An in-process `PoolEngine`; its SSD tier, if any, is what survives a restart."""

    name = "local"
    can_pin = True

    def __init__(self, settings: LocalSettings, client_name: str) -> None:
        self._client = client_name
        # Per-process subdirectory of the SSD tier, as Mooncake's rank_N/: two ranks never share files.
        self.engine = PoolEngine(settings.engine_config(offload_subdir=client_name))

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return self.engine.batch_exists(keys, self._client, lease)

    def _presence(self, keys: list[str]) -> list[Presence]:
        # A lookup lease pins the object in this process's arena: nothing evicts it before the
        # TTL, and a read of it is a copy from memory this process owns.
        return self.engine.presence(keys, self._client)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return [self._put_one(k, v) for k, v in zip(keys, values)]

    def _put_one(self, key: str, bufs: list[np.ndarray]) -> int:
        # The engine's two-phase put, so that "already stored" (its allocate's answer) reaches
        # the caller as OBJECT_ALREADY_EXISTS; `engine.put` folds it into OK.
        result = self.engine.allocate(self._client, key, total_size(bufs))
        if isinstance(result, ErrorCode):
            return int(result)
        try:
            gather(bufs, self.engine.arena[result.offset : result.offset + result.size])
        except BaseException:
            self.engine.abort(result.handle)  # never publish a partial copy
            raise
        return int(self.engine.commit(result.handle))

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return [int(c) for c in self.engine.batch_get_into(self._client, keys, values, self._copies)]

    def _pin(self, keys: list[str], ttl_s: float) -> list[int]:
        return [int(c) for c in self.engine.controls.pin(keys, ttl_s)]

    def _store_stats(self) -> dict[str, float]:
        return self.engine.stats()

    def take_removed(self) -> list[str]:
        # The engine notes drops only once asked: nothing is kept for a pool nobody watches.
        self.engine.watch_drops()
        return self.engine.take_drops()

    def _close(self) -> None:
        self.engine.close()


# ---- `kvpool doctor` ---------------------------------------------------------------------------


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: local`: its memory and SSD tier against this host."""
    local = cfg.backend_settings
    assert isinstance(local, LocalSettings)
    avail = mem_available()
    per_host = local.memory_size * args.ranks_per_host
    if avail is not None and per_host > avail:
        report.warn(f"local_cpu_size={human(local.memory_size)} x {args.ranks_per_host} worker(s) exceeds the "
                    f"memory available on this host ({human(avail)})", "lower local_cpu_size")
    if local.offload_path:
        quota = local.offload_quota
        if quota:
            check_ssd_quota(local.offload_path, quota, "ssd_quota", args.ranks_per_host, report,
                            "lower ssd_quota (per worker), or use 0 for 90% of the free space")
        else:
            report.ok(f"ssd_quota 0: each worker takes 90% of the free space of {local.offload_path} when it "
                      "starts (several workers on one disk would overcommit it: set ssd_quota)")
    check_lease(local.default_kv_lease_ttl_ms, "default_kv_lease_ttl_ms", args.env, report)
