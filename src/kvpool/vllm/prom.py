"""The connector's series on vLLM's own `/metrics` (``catalog.CONNECTOR``).

vLLM builds this in its front-end process (`KVPoolConnector.build_prom_metrics`) and calls
:meth:`KVPoolPromMetrics.observe` with each step's connector stats, summed over the workers and
the scheduler (``kvpool.vllm.stats``). Metric classes come from vLLM (``metric_types``), so its
multiprocess mode works; its labels (``model_name``, ``engine``) go first.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

import kvpool
from kvpool.metrics import catalog
from kvpool.metrics.prom import create

_BY_NAME = catalog.by_name("connector")

# Each counter of the stats, as (series, its label values).
_COUNTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("vllm:kvpool_lookups", ()),
    "lookups_skipped": ("vllm:kvpool_lookups_skipped", ()),
    "lookup_hit_blocks": ("vllm:kvpool_lookup_hit_blocks", ()),
    "pinned_loads": ("vllm:kvpool_pinned_loads", ()),
    "pool_tokens": ("vllm:kvpool_prompt_tokens", ("pool",)),
    "local_tokens": ("vllm:kvpool_prompt_tokens", ("local",)),
    "computed_tokens": ("vllm:kvpool_prompt_tokens", ("computed",)),
    "load_blocks": ("vllm:kvpool_blocks", ("load", "ok")),
    "load_failed_blocks": ("vllm:kvpool_blocks", ("load", "failed")),
    "save_blocks": ("vllm:kvpool_blocks", ("save", "ok")),
    "save_failed_blocks": ("vllm:kvpool_blocks", ("save", "failed")),
    "save_skipped_blocks": ("vllm:kvpool_blocks", ("save", "skipped")),
    "save_dropped_blocks": ("vllm:kvpool_blocks", ("save", "dropped")),
    "load_bytes": ("vllm:kvpool_transferred_bytes", ("load",)),
    "save_bytes": ("vllm:kvpool_transferred_bytes", ("save",)),
    "layer_loads_waited": ("vllm:kvpool_layer_transfers", ("load",)),
    "layer_saves_sent": ("vllm:kvpool_layer_transfers", ("save",)),
    "store_timeouts": ("vllm:kvpool_store_timeouts", ()),
    "store_calls_skipped": ("vllm:kvpool_store_calls_skipped", ()),
    **{catalog.remote_tier_counter(r): ("vllm:kvpool_remote_tier_blocks", (r,)) for r in catalog.REMOTE_TIER_RESULTS},
}
# Stats counters that are not series of their own: the histograms' _sum says the same.
NOT_COUNTED = ("load_time_s", "save_time_s")


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics on vLLM's own `/metrics`, one set per engine, made
    from `kvpool.metrics.catalog.CONNECTOR` and fed the `KVPoolStats` data vLLM gathers from
    the workers and the scheduler."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": metric_types[Counter], "gauge": metric_types[Gauge],
                   "histogram": metric_types[Histogram]}
        engines = list(per_engine_labelvalues.values())
        self._metrics = {s.name: create(s, classes=classes, extra_labels=labelnames, engines=engines)
                         for s in catalog.CONNECTOR}
        for engine in engines:
            self._metrics["vllm:kvpool_build_info"].labels(*engine, kvpool.__version__).set(1)

    def _child(self, name: str, engine_idx: int, *values: str) -> Any:
        return self._metrics[name].labels(*self.per_engine_labelvalues[engine_idx], *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for key, (name, values) in _COUNTED.items():
            if data.get(key):
                self._child(name, engine_idx, *values).inc(data[key])
        for op in catalog.OPS:
            for seconds in data.get(f"{op}_seconds", ()):
                self._child("vllm:kvpool_transfer_seconds", engine_idx, op).observe(seconds)
            for code, blocks in data.get(f"{op}_failures", {}).items():
                self._child("vllm:kvpool_failures", engine_idx, op, code).inc(blocks)
        if "transfer_queue_depth" in data:
            self._child("vllm:kvpool_transfer_queue_depth", engine_idx).set(data["transfer_queue_depth"])

