"""kvpool's KV connector stats, carried by vLLM from the workers (and the scheduler) to its
stats logger and Prometheus exporter (``kvpool.vllm.prom``).

One stats object holds one interval's observations, in four shapes (``data`` must survive
vLLM's serialisation between processes, so plain numbers, lists and dicts only):

- :data:`COUNTERS`: numbers summed over workers and over time;
- :data:`DURATIONS`: per-transfer seconds, concatenated (the latency histograms), at most
  :data:`MAX_DURATIONS` per interval (the sums in ``*_time_s`` keep counting past it);
- :data:`BY_CODE`: failed blocks per store error code name, merged;
- :data:`GAUGES`: a level read at the report, the largest of the workers' (a sum over time
  would mean nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool.metrics.catalog import REMOTE_TIER_RESULTS, remote_tier_counter

COUNTERS = (
    "lookups", "lookup_hit_blocks",
    "lookups_skipped",  # scheduler side: misses answered without asking, the lookup channel backing off
    # Scheduler side: prompt tokens of looked-up requests by where their KV came from.
    "pool_tokens", "local_tokens", "computed_tokens",
    "load_blocks", "load_bytes", "load_time_s", "load_failed_blocks",
    "save_blocks", "save_bytes", "save_time_s", "save_skipped_blocks", "save_failed_blocks",
    # Blocks computed in a step whose synchronous load failed: their KV may have attended over
    # a block that failed to load, so they are not saved then (vLLM recomputes them; saved after).
    "save_dropped_blocks",
    # Requests of a model with several KV cache groups whose load ran in the step that computes,
    # their lookup having pinned it in the worker's memory (`kvpool.vllm.lookup.Hit`).
    "pinned_loads",
    "layer_loads_waited",  # layerwise: layers the forward pass waited for (vLLM's per-layer hook ran)
    "layer_saves_sent",  # layerwise: layers sent from save_kv_layer as they were written
    # The backend's guard (stores outside the worker): calls that missed their deadline, calls
    # answered without the store while its circuit breaker was open.
    "store_timeouts", "store_calls_skipped",
    # With remote_backend (`Backend.tier_stats`): blocks the remote tier served and promoted, and
    # the write-through's outcomes.
    *(remote_tier_counter(r) for r in REMOTE_TIER_RESULTS),
)
DURATIONS = ("load_seconds", "save_seconds")
BY_CODE = ("load_failures", "save_failures")
GAUGES = ("transfer_queue_depth",)
MAX_DURATIONS = 4096


@dataclasses.dataclass
class KVPoolStats(KVConnectorStats):
    """One interval's observations (see the module docstring for the four shapes)."""

    def __post_init__(self) -> None:
        # No gauge by default: only a worker knows its queue, and a level absent from a report
        # must not read as 0.
        for k in COUNTERS:
            self.data.setdefault(k, 0)
        for k in DURATIONS:
            self.data.setdefault(k, [])
        for k in BY_CODE:
            self.data.setdefault(k, {})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def observe(self, key: str, seconds: float) -> None:
        """One transfer's duration (``key`` in DURATIONS)."""
        durations = self.data[key]
        if len(durations) < MAX_DURATIONS:
            durations.append(seconds)

    def fail(self, key: str, code: str, blocks: int) -> None:
        """``blocks`` failed with ``code`` (``key`` in BY_CODE)."""
        by_code = self.data[key]
        by_code[code] = by_code.get(code, 0) + blocks

    def aggregate(self, other: KVConnectorStats) -> "KVPoolStats":
        for k, v in other.data.items():
            if k in GAUGES:
                self.data[k] = max(self.data.get(k, 0), v)
            elif k in DURATIONS:
                self.data[k] = (self.data.get(k, []) + list(v))[:MAX_DURATIONS]
            elif k in BY_CODE:
                for code, n in v.items():
                    self.fail(k, code, n)
            elif isinstance(v, (int, float)):
                self.add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: (round(d[k], 4) if isinstance(d[k], float) else d[k])
                                       for k in COUNTERS + GAUGES if k in d}
        out["load_GBps"] = round(d["load_bytes"] / d["load_time_s"] / 1e9, 3) if d["load_time_s"] else 0.0
        out["save_GBps"] = round(d["save_bytes"] / d["save_time_s"] / 1e9, 3) if d["save_time_s"] else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS + GAUGES + DURATIONS + BY_CODE)

    def take(self) -> "KVPoolStats":
        """Return the observations so far and start a new interval."""
        snapshot = KVPoolStats(data=self.data)
        self.reset()
        return snapshot

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> "KVPoolStats":
        # Copies of the lists and dicts: aggregating into this object must not change ``data``.
        return cls(data={k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in (data or {}).items()})
