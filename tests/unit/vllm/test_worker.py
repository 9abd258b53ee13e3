"""PoolWorker: copies between real CPU KV tensors and an in-memory pool, load-error reports,
delayed free, preemption drain and stats counters.

The KV caches are real `[num_blocks, 2, block_size, heads*head_dim]` tensors viewed by the real
`KVLayout`; only the store (`DictBackend`) and vLLM's TP/PP groups are faked.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import kvpool.vllm.worker as worker_mod
from connector_fakes import LAYER_NAMES, NUM_BLOCKS, DictBackend, block_hash
from kvpool.errors import ConfigError
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.worker import PoolWorker

H = [block_hash(i) for i in range(8)]


@pytest.fixture(autouse=True)
def short_drain(monkeypatch) -> None:
    # A regression that never finishes a drain fails in seconds instead of after a minute.
    monkeypatch.setattr(worker_mod, "DRAIN_TIMEOUT_S", 10.0)


def block_bytes(caches: dict[str, torch.Tensor]) -> int:
    """One block's bytes over all layers, computed from the tensors, not from the layout."""
    return sum(t[0].numel() * t.element_size() for t in caches.values())


def save(worker: PoolWorker, req_id: str, hashes: list[bytes], block_ids: list[int]) -> None:
    worker.wait_for_save(KVPoolMetadata(saves=[BlockTask(req_id, hashes, block_ids)]))


def load(worker: PoolWorker, req_id: str, hashes: list[bytes], block_ids: list[int], is_async: bool = False) -> None:
    worker.start_load_kv(KVPoolMetadata(loads=[BlockTask(req_id, hashes, block_ids, is_async=is_async)]))


def drain(worker: PoolWorker, req_ids: set[str] | None = None) -> None:
    """Wait for the worker's background transfers (the test's only reach into its internals)."""
    assert worker._transfer.wait(req_ids, timeout=10)


def counters(worker: PoolWorker) -> dict[str, float]:
    stats = worker.get_stats()
    return dict(stats.data) if stats is not None else {}


def same_block(a: dict[str, torch.Tensor], a_id: int, b: dict[str, torch.Tensor], b_id: int) -> bool:
    return all(torch.equal(a[n][a_id], b[n][b_id]) for n in LAYER_NAMES)


def snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in caches.items()}


def failing_load_beside_saves() -> KVPoolMetadata:
    """A step where b loads H[0] (saved into block 1 first) and H[5] (never saved: block 6
    fails) and saves blocks 7-8, computed over both; c saves block 3, computed over 1-2."""
    return KVPoolMetadata(
        loads=[BlockTask("b", [H[0], H[5]], [5, 6])],
        saves=[BlockTask("b", H[6:8], [7, 8], prior_block_ids=[5, 6]),
               BlockTask("c", H[2:3], [3], prior_block_ids=[1, 2])])


# ---- copies -----------------------------------------------------------------------------------------


def test_save_then_load_into_other_blocks_is_byte_exact(make_worker):
    writer, w_kv, pool = make_worker(seed=1)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1}, backend=pool, seed=2)
    assert not same_block(w_kv, 1, r_kv, 5)  # so a copy that did nothing would fail
    before = snapshot(r_kv)

    save(writer, "a", H[:2], [1, 2])
    drain(writer)
    load(reader, "b", H[:2], [5, 6])

    assert same_block(r_kv, 5, w_kv, 1) and same_block(r_kv, 6, w_kv, 2)
    for b in set(range(NUM_BLOCKS)) - {5, 6}:
        assert same_block(r_kv, b, before, b)  # no other block was touched
    assert reader.get_block_ids_with_load_errors() == set()
    n = block_bytes(w_kv)
    w, r = counters(writer), counters(reader)
    assert (w["save_blocks"], w["save_bytes"], w["save_failed_blocks"], w["save_skipped_blocks"]) == (2, 2 * n, 0, 0)
    assert (r["load_blocks"], r["load_bytes"], r["load_failed_blocks"]) == (2, 2 * n, 0)
    assert len(pool.data) == 2 and all(len(v) == n for v in pool.data.values())


def test_a_tenants_blocks_are_stored_under_its_tag_and_found_only_with_it(make_worker):
    writer, _, pool = make_worker()
    writer.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", H[:2], [1, 2], tenant="0123456789ab")]))
    drain(writer)
    assert sorted(pool.data) == sorted(writer.scheme.keys(H[:2], tenant="0123456789ab"))
    assert all("~0123456789ab@" in k for k in pool.data)
    assert writer._lookup_hit(H[:2], 0, "0123456789ab").blocks == 2
    assert writer._lookup_hit(H[:2]).blocks == 0  # another tenant's (or no salt's) lookup misses


def test_a_requests_pin_holds_what_it_saved_and_what_it_loaded(make_worker):
    writer, _, pool = make_worker()
    reader, _, _ = make_worker({"lookup_rpc_port": 1}, backend=pool)
    writer.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", H[:2], [1, 2], pin_s=60.0), BlockTask("b", H[2:3], [3])]))
    drain(writer)
    assert sorted(pool.pins) == sorted(writer.scheme.keys(H[:2])) and set(pool.pins.values()) == {60.0}
    # A load pins what it loaded; a block the pool lacks is not loaded, so not pinned.
    pool.pins.clear()
    reader.start_load_kv(KVPoolMetadata(loads=[BlockTask("c", [H[2], H[5]], [5, 6], pin_s=30.0)]))
    drain(reader)
    assert pool.pins == {reader.scheme.key(H[2]): 30.0}
    assert reader.get_block_ids_with_load_errors() == {6}


@pytest.mark.parametrize("field,value", [("revision", "v2"), ("quantization", "fp8"), ("dtype", torch.float16),
                                         ("cache_dtype", "fp8_e5m2"),  # an fp8 KV cache is bytes either way
                                         ("hf_text_config", SimpleNamespace(rope_theta=10000.0,
                                                                            rope_scaling={"factor": 4.0}))])
def test_other_weights_of_the_same_model_name_miss_instead_of_loading(make_worker, field, value):
    # Same name, same KV layout, other values per token: loading would change the answers.
    writer, w_kv, pool = make_worker(seed=1)
    twin, _, _ = make_worker({"lookup_rpc_port": 1}, backend=pool, seed=2)
    other, o_kv, _ = make_worker({"lookup_rpc_port": 2}, backend=pool, seed=3, model={field: value})
    assert twin.scheme.key(H[0]) == writer.scheme.key(H[0])
    assert other.scheme.key(H[0]) != writer.scheme.key(H[0])
    before = snapshot(o_kv)

    save(writer, "a", H[:1], [1])
    drain(writer)
    load(other, "b", H[:1], [5])

    assert other.get_block_ids_with_load_errors() == {5}
    assert not same_block(o_kv, 5, w_kv, 1) and same_block(o_kv, 4, before, 4)


def test_sync_load_errors_are_reported_in_the_same_step(make_worker):
    worker, kv, pool = make_worker()
    save(worker, "a", H[:1], [1])
    drain(worker)
    counters(worker)  # start the counters from here

    load(worker, "b", [H[0], H[5]], [5, 6])  # H[5] was never saved

    assert worker.get_block_ids_with_load_errors() == {6}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert same_block(kv, 5, kv, 1)
    assert not any(kv[n][6].any() for n in LAYER_NAMES)  # zeroed: a failed copy's bytes never stay
    assert worker.get_finished(None) == (None, None)  # a sync load is never "finished receiving"
    c = counters(worker)
    assert (c["load_blocks"], c["load_failed_blocks"]) == (1, 1)


def test_a_store_error_fails_every_block_of_the_load(make_worker):
    worker, _, pool = make_worker()
    save(worker, "a", H[:2], [1, 2])
    drain(worker)
    pool.raise_on_get = True
    load(worker, "b", H[:2], [5, 6])
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    c = counters(worker)
    assert (c["load_blocks"], c["load_failed_blocks"]) == (0, 2)


def test_injected_load_failures_are_reported_per_block(make_worker):
    # inject_load_failure_every=2 wraps the store in FaultInjectingBackend: every 2nd key read fails.
    worker, kv, _ = make_worker({"inject_load_failure_every": 2})
    save(worker, "a", H[:4], [0, 1, 2, 3])
    drain(worker)
    load(worker, "b", H[:4], [4, 5, 6, 7])
    assert worker.get_block_ids_with_load_errors() == {5, 7}
    assert same_block(kv, 4, kv, 0) and same_block(kv, 6, kv, 2)


def test_blocks_computed_over_a_failed_sync_load_are_not_saved(make_worker):
    # One step: request "b" loads H[0] (pooled) and H[5] (not) into blocks 5, 6 and computes
    # blocks 7, 8 over them; "c" computes block 3 over blocks 1, 2 of its own. The forward pass
    # ran before the failure was known, so b's blocks 7, 8 may hold KV derived from block 6's
    # stale bytes: they must not reach the pool. c's block holds nothing that failed: saved.
    worker, kv, pool = make_worker()
    save(worker, "a", H[:1], [1])
    drain(worker)
    counters(worker)
    meta = failing_load_beside_saves()
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    drain(worker)
    assert worker.get_block_ids_with_load_errors() == {6}
    stored = {k for k in pool.data}
    assert not any(worker.scheme.key(h) in stored for h in H[6:8])
    assert worker.scheme.key(H[2]) in stored
    c = counters(worker)
    assert (c["save_blocks"], c["save_dropped_blocks"]) == (1, 2)
    # The next step (vLLM recomputes b) has no failed load: b's blocks are saved then.
    save(worker, "b", H[6:8], [7, 8])
    drain(worker)
    assert all(worker.scheme.key(h) in pool.data for h in H[6:8])


def test_a_failed_sync_load_still_drops_saves_when_vllm_finalizes_the_step_late(make_worker):
    # With speculative decoding vLLM defers wait_for_save until after the draft model, so this
    # step's load errors are collected (get_block_ids_with_load_errors) before it runs. The
    # blocks b computed over its failed block 6 must still not reach the pool.
    worker, kv, pool = make_worker()
    save(worker, "a", H[:1], [1])
    drain(worker)
    meta = failing_load_beside_saves()
    worker.start_load_kv(meta)
    assert worker.get_finished(meta) == (None, None)
    assert worker.get_block_ids_with_load_errors() == {6}
    worker.wait_for_save(meta)
    drain(worker)
    assert not any(worker.scheme.key(h) in pool.data for h in H[6:8])
    assert worker.scheme.key(H[2]) in pool.data
    # The next step loads nothing: its saves are not held against the last step's failure.
    save(worker, "b", H[6:8], [7, 8])
    drain(worker)
    assert all(worker.scheme.key(h) in pool.data for h in H[6:8])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_chunk_planned_before_a_failed_sync_load_was_reported_is_not_saved(make_worker, fake_lookup,
                                                                             async_scheduling):
    # With async scheduling (vLLM's default on accelerators) step N+1 is planned before step N's
    # output arrives: the scheduler sends request b's next prefill chunk before it learns that
    # b's load in step N failed. That chunk attended over the failed block, so its blocks must
    # not reach the pool under the prompt's hashes. What vLLM recomputes afterwards is saved.
    from vllm.v1.outputs import KVConnectorOutput

    from connector_fakes import (Cached, kv_blocks, make_kv_cache_config, make_request, make_vllm_config,
                                 new_req, scheduler_output)
    from kvpool.config import load_config
    from kvpool.vllm.scheduler import PoolScheduler

    bs = 4
    worker, kv, pool = make_worker()
    sched = PoolScheduler(make_vllm_config(block_size=bs), load_config(None, "kv_both"),
                          make_kv_cache_config(block_size=bs))
    req = make_request("b", 5 * bs + 1, block_size=bs)
    h = req.block_hashes

    def step(meta: KVPoolMetadata) -> set[int]:
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.get_finished(meta)
        errors = worker.get_block_ids_with_load_errors()
        drain(worker)
        return errors

    # The lookup finds blocks 0-2; block 1 is gone (evicted) by the time it is read.
    fake_lookup.pooled.update(h[:3])
    save(worker, "a", [h[0], h[2]], [0, 2])
    drain(worker)
    ids = [4, 5, 6, 7, 8, 9]
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * bs, False)
    sched.update_state_after_alloc(req, kv_blocks(ids), 3 * bs)
    # Step N: load blocks 0-2 (block 1 into vLLM block 5 fails), compute block 3.
    failed = step(sched.build_connector_meta(scheduler_output(new=[(new_req(req, ids, 3 * bs), bs)])))
    assert failed == {5}
    if async_scheduling:
        # Step N+1, planned before step N's output: block 4, computed over vLLM block 5.
        meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("b", 4 * bs), bs + 1)]))
        assert [t.block_hashes for t in meta.saves] == [h[4:5]]
        assert step(meta) == set()
        assert worker.scheme.key(h[4]) not in pool.data
    # vLLM reports block 5 and recomputes b from block 1: blocks 1-4 are saved now.
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=failed))
    step(sched.build_connector_meta(scheduler_output(cached=[(Cached("b", bs), 4 * bs + 1)])))
    assert all(worker.scheme.key(x) in pool.data for x in h[1:5])


def test_layerwise_saves_stop_at_a_failed_layer_load(make_worker):
    worker, kv, pool = make_worker({"use_layerwise": True})
    save(worker, "a", H[:1], [1])
    drain(worker)
    meta = KVPoolMetadata(loads=[BlockTask("b", [H[0], H[5]], [5, 6])],
                          saves=[BlockTask("b", H[6:7], [7], prior_block_ids=[5, 6])])
    worker.start_load_kv(meta)
    for name in LAYER_NAMES:  # the forward pass: wait for each layer, compute it, send it
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)
    drain(worker)
    assert worker.get_block_ids_with_load_errors() == {6}
    # Layer 0 of H[5] failed before any layer was computed: no layer of block 7 was sent.
    assert not any(worker.scheme.key(H[6], layer=i) in pool.data for i in range(len(LAYER_NAMES)))


def test_async_load_errors_arrive_with_the_finish_not_before(make_worker):
    worker, kv, pool = make_worker()
    save(worker, "a", [H[0], H[2]], [1, 3])
    drain(worker)
    pool.get_gate = threading.Event()

    load(worker, "b", H[:3], [5, 6, 7], is_async=True)  # H[1] is missing: block 6 fails
    assert pool.get_started.wait(10)
    # In flight: neither the finish nor its errors may be reported yet.
    assert worker.get_finished(None) == (None, None)
    assert worker.get_block_ids_with_load_errors() == set()

    pool.get_gate.set()
    drain(worker, {"b"})
    # Done, but this step's get_finished has not run yet: vLLM must not see the errors before
    # it sees the request finish receiving.
    assert worker.get_block_ids_with_load_errors() == set()
    done_sending, done_recving = worker.get_finished(None)
    assert done_recving == {"b"} and done_sending is None
    assert worker.get_block_ids_with_load_errors() == {6}
    assert worker.get_finished(None) == (None, None)
    assert worker.get_block_ids_with_load_errors() == set()
    assert same_block(kv, 5, kv, 1) and same_block(kv, 7, kv, 3)
    c = counters(worker)
    assert (c["load_blocks"], c["load_failed_blocks"]) == (2, 1)


def test_async_load_without_errors_is_reported_finished_once(make_worker):
    worker, kv, _ = make_worker()
    save(worker, "a", H[:2], [1, 2])
    drain(worker)
    load(worker, "b", H[:2], [5, 6], is_async=True)
    drain(worker, {"b"})
    assert worker.get_finished(None) == (None, {"b"})
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.get_finished(None) == (None, None)
    assert same_block(kv, 5, kv, 1) and same_block(kv, 6, kv, 2)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_load_that_raises_is_reported_failed_not_lost(make_worker, monkeypatch, is_async):
    # A bug past the copy (here in the timing histogram): a sync load must not end vLLM's step,
    # and an async one must still be reported, or its request waits for it forever.
    worker, kv, _ = make_worker()
    save(worker, "a", H[:2], [1, 2])
    drain(worker)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug after the copy")

    monkeypatch.setattr(worker, "_observe", broken)
    load(worker, "b", H[:2], [5, 6], is_async=is_async)
    if is_async:
        drain(worker, {"b"})
        assert worker.get_finished(None) == (None, {"b"})
    assert worker.get_block_ids_with_load_errors() == {5, 6}


@pytest.mark.parametrize("is_async", [False, True])
def test_a_store_code_kvpool_does_not_know_is_still_a_reported_load_failure(make_worker, is_async):
    # A store may answer codes outside ErrorCode (Mooncake's -703 REPLICA_IS_NOT_READY, a newer
    # kvpool server's): the block failed like any other. Unreported, an async load's request
    # would wait in WAITING_FOR_REMOTE_KVS forever.
    class OddCodes(DictBackend):
        def batch_get_into(self, keys, values):
            return [c if c == 0 else -703 for c in super().batch_get_into(keys, values)]

    worker, kv, _ = make_worker(backend=OddCodes())
    save(worker, "a", H[:1], [1])
    drain(worker)
    load(worker, "b", [H[0], H[5]], [5, 6], is_async=is_async)  # H[5] was never saved
    drain(worker, {"b"})
    assert worker.get_finished(None) == (None, {"b"} if is_async else None)
    assert worker.get_block_ids_with_load_errors() == {6}
    assert same_block(kv, 5, kv, 1)
    assert counters(worker)["load_failures"] == {"-703": 1}


# ---- saves ------------------------------------------------------------------------------------------


def test_blocks_already_pooled_are_skipped_not_rewritten(make_worker):
    worker, kv, pool = make_worker()
    save(worker, "a", H[:2], [1, 2])
    drain(worker)
    stored = dict(pool.data)
    counters(worker)

    kv[LAYER_NAMES[0]][1].zero_()  # other bytes under the same key: a rewrite would show
    save(worker, "b", H[:3], [1, 2, 3])
    drain(worker)

    c = counters(worker)
    assert (c["save_skipped_blocks"], c["save_blocks"], c["save_failed_blocks"]) == (2, 1, 0)
    assert c["save_bytes"] == block_bytes(kv)
    assert len(pool.data) == 3
    assert all(pool.data[k] == v for k, v in stored.items())


def test_a_failed_put_is_counted_and_stores_nothing(make_worker):
    worker, _, pool = make_worker()
    pool.raise_on_put = True
    save(worker, "a", H[:2], [1, 2])
    drain(worker)
    c = counters(worker)
    assert (c["save_failed_blocks"], c["save_blocks"]) == (2, 0)
    assert pool.data == {}


def test_save_sync_returns_only_once_the_blocks_are_pooled(make_worker):
    # A producer (prefill node) saves synchronously by default, so a decode node finds the blocks
    # as soon as the prefill answers.
    worker, _, pool = make_worker(role="kv_producer")
    assert worker.config.save_sync
    save(worker, "a", H[:2], [1, 2])
    assert len(pool.data) == 2


def test_preemption_waits_for_the_preempted_requests_saves(make_worker):
    worker, kv, pool = make_worker()
    original = snapshot(kv)
    pool.put_gate = threading.Event()
    save(worker, "a", H[:2], [1, 2])
    assert pool.put_started.wait(10)

    # Another request's preemption does not wait for "a".
    worker.handle_preemptions(KVPoolMetadata(preempted=["other"]))

    drained = threading.Event()
    t = threading.Thread(target=lambda: (worker.handle_preemptions(KVPoolMetadata(preempted=["a"])), drained.set()))
    t.start()
    # The put is held, so a correct drain cannot have returned; a drain that does not wait would have.
    assert not drained.wait(0.2)
    pool.put_gate.set()
    t.join(10)
    assert drained.is_set()
    # vLLM may now hand blocks 1 and 2 to another request: the pool keeps what "a" computed.
    for t_ in kv.values():
        t_[1:3].fill_(7.0)
    load(worker, "b", H[:2], [5, 6])
    assert same_block(kv, 5, original, 1) and same_block(kv, 6, original, 2)


def test_delayed_free_reports_done_sending_only_after_the_save_ran(make_worker):
    worker, _, pool = make_worker()
    pool.put_gate = threading.Event()
    save(worker, "a", H[:2], [1, 2])
    assert pool.put_started.wait(10)

    # Finished while its save is in flight: its blocks must stay allocated.
    assert worker.get_finished(KVPoolMetadata(finished_with_io=["a", "idle"])) == ({"idle"}, None)
    assert worker.get_finished(None) == (None, None)
    pool.put_gate.set()
    drain(worker, {"a"})
    assert worker.get_finished(None) == ({"a"}, None)
    assert worker.get_finished(None) == (None, None)
    assert len(pool.data) == 2


def test_shutdown_finishes_queued_saves(make_worker):
    worker, _, pool = make_worker()
    save(worker, "a", H[:3], [1, 2, 3])
    worker.shutdown()
    assert len(pool.data) == 3 and pool.closed


# ---- ranks ------------------------------------------------------------------------------------------


def test_only_the_first_rank_of_a_shared_kv_shard_writes(make_worker):
    # One KV head over TP=2: both ranks hold the same bytes, so rank 1 leaves the write to rank 0.
    extra = {"backend": "server"}
    pool = DictBackend(shared=True)
    rank1, _, _ = make_worker(extra, tp=(1, 2), kv_heads=1, backend=pool)
    save(rank1, "a", H[:2], [1, 2])
    drain(rank1)
    assert pool.data == {}
    rank0, _, _ = make_worker(extra, tp=(0, 2), kv_heads=1, backend=pool)
    save(rank0, "a", H[:2], [1, 2])
    drain(rank0)
    assert len(pool.data) == 2


def test_tp_ranks_with_their_own_heads_write_their_own_keys(make_worker):
    extra = {"backend": "server"}
    pool = DictBackend(shared=True)
    for rank in (1, 0):
        worker, _, _ = make_worker(extra, tp=(rank, 2), backend=pool)
        save(worker, "a", H[:1], [1])
        drain(worker)
    assert len(pool.data) == 2
    assert {k.split("@")[2] for k in pool.data} == {"tp0/2", "tp1/2"}


def test_tp_needs_a_backend_shared_across_processes(make_worker):
    with pytest.raises(ConfigError) as exc:
        make_worker(tp=(0, 2), backend=DictBackend(shared=False))
    assert exc.value.key == "backend"


# ---- stats ------------------------------------------------------------------------------------------


def test_stats_are_taken_per_interval(make_worker):
    worker, kv, _ = make_worker()
    assert worker.get_stats() is None  # nothing happened: nothing to send
    save(worker, "a", H[:3], [1, 2, 3])
    drain(worker)
    load(worker, "b", H[:4], [5, 6, 7, 8])
    first = counters(worker)
    assert (first["save_blocks"], first["load_blocks"], first["load_failed_blocks"]) == (3, 3, 1)
    assert first["save_time_s"] > 0 and first["load_time_s"] > 0
    assert worker.get_stats() is None  # taken: the next interval starts at zero
    load(worker, "c", H[:1], [9])
    assert counters(worker)["load_blocks"] == 1
