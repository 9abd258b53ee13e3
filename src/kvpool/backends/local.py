"""`backend: local` — the pool engine inside the vLLM worker process (memory tier + SSD tier)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from kvpool.backends.base import Backend, Buffers
from kvpool.config import LocalBackendConfig
from kvpool.store import DiskTier, EngineConfig, PoolEngine


def _default_ssd_quota(path: str) -> int:
    # As Mooncake's bucket backend with a quota of 0: 90% of what the disk can hold for us.
    return int(shutil.disk_usage(path).free * 0.9)


class LocalBackend(Backend):
    """An in-process `PoolEngine`; its SSD tier, if any, is what survives a restart."""

    name = "local"
    shared_across_processes = False

    def __init__(self, config: LocalBackendConfig, client_name: str) -> None:
        disk = None
        if config.ssd_offload_path:
            # Per-process subdirectory, as Mooncake's rank_N/: two ranks never share files.
            path = os.path.join(config.ssd_offload_path, client_name)
            os.makedirs(path, exist_ok=True)
            disk = DiskTier(path, config.ssd_quota or _default_ssd_quota(path), config.ssd_eviction_policy)
        self._client = client_name
        self.engine = PoolEngine(EngineConfig(
            memory_size=config.local_cpu_size,
            eviction_high_watermark_ratio=config.eviction_high_watermark_ratio,
            eviction_ratio=config.eviction_ratio,
            default_kv_lease_ttl_ms=config.default_kv_lease_ttl_ms,
            disk=disk,
        ))

    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        return self.engine.batch_exists(keys, self._client, lease)

    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        return [int(c) for c in self.engine.batch_put(self._client, keys, values)]

    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        return [int(c) for c in self.engine.batch_get_into(self._client, keys, values)]

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()
