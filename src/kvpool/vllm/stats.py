"""kvpool's KV connector stats, carried by vLLM from the workers to its stats logger."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups", "lookup_hit_blocks",
    "load_blocks", "load_bytes", "load_time_s", "load_failed_blocks",
    "save_blocks", "save_bytes", "save_time_s", "save_skipped_blocks", "save_failed_blocks",
    # Blocks computed in a step whose synchronous load failed: their KV may have attended over
    # a block that failed to load, so they are not saved then (vLLM recomputes them; saved after).
    "save_dropped_blocks",
    "layer_loads_waited",  # layerwise: layers the forward pass waited for (vLLM's per-layer hook ran)
    "layer_saves_sent",  # layerwise: layers sent from save_kv_layer as they were written
    # The backend's guard (stores outside the worker): calls that missed their deadline, calls
    # answered without the store while its circuit breaker was open.
    "store_timeouts", "store_calls_skipped",
)


@dataclasses.dataclass
class KVPoolStats(KVConnectorStats):
    """Counters summed over workers and over the logging interval."""

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> "KVPoolStats":
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
        out["load_GBps"] = round(d["load_bytes"] / d["load_time_s"] / 1e9, 3) if d["load_time_s"] else 0.0
        out["save_GBps"] = round(d["save_bytes"] / d["save_time_s"] / 1e9, 3) if d["save_time_s"] else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)

    def take(self) -> "KVPoolStats":
        """Return the counters so far and start a new interval."""
        snapshot = KVPoolStats(data=dict(self.data))
        self.reset()
        return snapshot

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> "KVPoolStats":
        return cls(data=dict(data or {}))
