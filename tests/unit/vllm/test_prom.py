"""The connector's series on vLLM's /metrics: what a worker and the scheduler observe reaches
the catalog's series through vLLM's stats path (stats objects, their aggregation and
`KVPoolPromMetrics.observe`), scraped from a registry of its own."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import kvpool
from connector_fakes import block_hash, kv_blocks, make_request
from kvpool.metrics import catalog
from kvpool.testing.metrics import scrape_problems, value
from kvpool.vllm.connector import KVPoolConnector
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.prom import _COUNTED, NOT_COUNTED
from kvpool.vllm.stats import COUNTERS, MAX_DURATIONS, KVPoolStats
from test_scheduler import BS, make_scheduler, pool

H = [block_hash(i) for i in range(8)]
LABELS = {"model_name": "m", "engine": "0"}


def prom_metrics() -> tuple[object, CollectorRegistry]:
    """The connector's metrics built as vLLM builds them, into a registry of this test's own."""
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(self, *a, registry=registry, **kw)})

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads
    metrics = KVPoolConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
    return metrics, registry


def test_every_stats_counter_is_a_series_or_said_why():
    assert set(_COUNTED) | set(NOT_COUNTED) == set(COUNTERS)
    assert {name for name, _ in _COUNTED.values()} <= {s.name for s in catalog.CONNECTOR}


def test_series_exist_before_any_event():
    _, registry = prom_metrics()
    text = generate_latest(registry).decode()
    assert scrape_problems(text, catalog.CONNECTOR) == []
    assert value(text, "vllm:kvpool_build_info", version=kvpool.__version__, **LABELS) == 1
    assert value(text, "vllm:kvpool_blocks_total", op="load", result="ok", **LABELS) == 0


def test_worker_and_scheduler_observations_reach_the_series(make_worker, fake_lookup):
    worker, _, _ = make_worker()
    worker.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", H[:3], [1, 2, 3])]))
    assert worker._transfer.wait(None, timeout=10)
    worker.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", H[:4], [5, 6, 7, 8])]))  # H[3] is not pooled
    worker_stats = worker.get_stats()

    sched = make_scheduler()
    req = make_request("r", 5 * BS + 2)
    pool(fake_lookup, req, 2)
    sched.get_num_new_matched_tokens(req, BS)  # one block from vLLM's own prefix cache, one from the pool
    sched.update_state_after_alloc(req, kv_blocks(range(6)), BS)
    # As vLLM does: the workers' stats, rebuilt on the scheduler side, plus the scheduler's own.
    data = KVPoolConnector.build_kv_connector_stats(worker_stats.data).aggregate(sched.get_stats()).data

    metrics, registry = prom_metrics()
    metrics.observe(data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert scrape_problems(text, catalog.CONNECTOR) == []
    assert value(text, "vllm:kvpool_blocks_total", op="save", result="ok", **LABELS) == 3
    assert value(text, "vllm:kvpool_blocks_total", op="load", result="ok", **LABELS) == 3
    assert value(text, "vllm:kvpool_blocks_total", op="load", result="failed", **LABELS) == 1
    assert value(text, "vllm:kvpool_failures_total", op="load", code="OBJECT_NOT_FOUND", **LABELS) == 1
    assert value(text, "vllm:kvpool_transfer_seconds_count", op="load", **LABELS) == 1
    assert value(text, "vllm:kvpool_transfer_seconds_count", op="save", **LABELS) == 1
    assert value(text, "vllm:kvpool_transferred_bytes_total", op="save", **LABELS) == data["save_bytes"] > 0
    assert value(text, "vllm:kvpool_prompt_tokens_total", source="local", **LABELS) == BS
    assert value(text, "vllm:kvpool_prompt_tokens_total", source="pool", **LABELS) == BS
    assert value(text, "vllm:kvpool_prompt_tokens_total", source="computed", **LABELS) == 3 * BS + 2
    assert value(text, "vllm:kvpool_transfer_queue_depth", **LABELS) == 0


def test_stats_aggregate_by_shape():
    a = KVPoolStats(data={"save_blocks": 2, "load_seconds": [0.1], "load_failures": {"RPC_FAIL": 1},
                          "transfer_queue_depth": 3})
    b = KVPoolStats.from_data({"save_blocks": 5, "load_seconds": [0.2] * MAX_DURATIONS,
                               "load_failures": {"RPC_FAIL": 2, "RPC_TIMEOUT": 1}, "transfer_queue_depth": 1})
    source = dict(b.data["load_failures"])
    merged = b.aggregate(a).data
    assert merged["save_blocks"] == 7
    assert merged["transfer_queue_depth"] == 3  # a level: the deepest worker's, never a sum
    assert len(merged["load_seconds"]) == MAX_DURATIONS  # bounded per interval
    assert merged["load_failures"] == {"RPC_FAIL": 3, "RPC_TIMEOUT": 1}
    assert a.data["load_failures"] == {"RPC_FAIL": 1} and source == {"RPC_FAIL": 2, "RPC_TIMEOUT": 1}
    assert "transfer_queue_depth" not in KVPoolStats().data  # absent unless a worker reports it


def test_a_queue_that_empties_is_reported_once(make_worker):
    worker, _, _ = make_worker()
    worker._reported_depth = 2  # as if the last report saw two transfers waiting
    assert worker.get_stats().data["transfer_queue_depth"] == 0
    assert worker.get_stats() is None
