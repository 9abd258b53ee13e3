"""KV events for the pool's blocks (`kvpool.vllm.events`): what the scheduler publishes from the
workers' reports, what a worker reports of its saves and of its pool's drops, and the engine's
drop log behind `backend: local`. vLLM's own event classes; a fake lookup and backend."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext
from vllm.v1.outputs import KVConnectorOutput

from connector_fakes import BLOCK_SIZE, kv_blocks, make_kv_cache_config, make_request, make_vllm_config, new_req, \
    scheduler_output
from kvpool.config import load_config
from kvpool.keys import KeyScheme, block_of
from kvpool.vllm.events import DROPPED, STORED, PoolEventLog, PoolEventReport, dropped_markers
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.scheduler import PoolScheduler

BS = BLOCK_SIZE


def events_config(tp: int = 1, pp: int = 1) -> SimpleNamespace:
    cfg = make_vllm_config(block_size=BS)
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    cfg.parallel_config = SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return cfg


def report(*markers, workers: int = 1) -> KVConnectorOutput:
    return KVConnectorOutput(kv_cache_events=PoolEventReport(markers, workers))


def test_a_block_is_published_once_every_worker_stored_its_part(fake_lookup):
    sched = PoolScheduler(events_config(tp=2), load_config({}, "kv_both"), make_kv_cache_config())
    req = make_request("a", 3 * BS + 1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([5, 6, 7, 8]), 0)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [5, 6, 7, 8], 0), 3 * BS + 1)]))
    h = req.block_hashes
    assert [t.block_hashes for t in meta.saves] == [h[:3]]

    sched.update_connector_output(report(*[(STORED, 0, x) for x in h[:3]]))  # TP rank 0's parts
    assert sched.take_events() == []
    sched.update_connector_output(report((STORED, 0, h[0]), (STORED, 0, h[1])))  # rank 1's, block 2 not yet
    stored = sched.take_events()
    assert [e.block_hashes for e in stored] == [[ext(h[0])], [ext(h[1])]]  # as vLLM's own events carry them
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" and e.block_size == BS and e.group_idx == 0
               for e in stored)
    tokens = list(req.all_token_ids)
    assert [e.token_ids for e in stored] == [tokens[:BS], tokens[BS : 2 * BS]]
    assert [e.parent_block_hash for e in stored] == [None, ext(h[0])]

    # One worker's pool dropped its part of block 1: the block is no longer whole in the pool.
    sched.update_connector_output(report((DROPPED, 0, h[1])))
    removed = sched.take_events()
    assert len(removed) == 1 and isinstance(removed[0], BlockRemoved) and removed[0].block_hashes == [ext(h[1])]
    assert sched.take_events() == []


def test_without_kv_events_the_scheduler_publishes_nothing(fake_lookup):
    sched = PoolScheduler(make_vllm_config(block_size=BS), load_config({}, "kv_both"), make_kv_cache_config())
    sched.update_connector_output(report((STORED, 0, b"x")))
    assert sched.take_events() == []


def test_a_distributed_store_is_the_storage_medium_and_unplanned_blocks_still_count():
    log = PoolEventLog(workers=1, block_size=BS, medium="STORAGE")
    log.reported(PoolEventReport([(STORED, 1, b"\x01" * 8)]))
    (event,) = log.take()
    assert event.medium == "STORAGE" and event.group_idx == 1 and event.token_ids == []
    log.reported(None)  # a step without a report (another connector's, or none)
    assert log.take() == []


def test_a_worker_reports_the_blocks_it_stored_and_not_those_that_failed(make_worker):
    worker, _, _ = make_worker()
    assert worker.get_kv_events() is None  # vLLM publishes no events: nothing is collected
    worker, _, backend = make_worker({"lookup_rpc_port": 1}, vllm_config=events_config())
    task = BlockTask(req_id="r", block_hashes=[b"a" * 8, b"b" * 8], block_ids=[1, 2], save_now=True)
    backend.fail_put = {worker.scheme.keys([b"b" * 8])[0]}
    worker.wait_for_save(KVPoolMetadata(saves=[task]))
    got = worker.get_kv_events()
    assert got.get_all_events() == [(STORED, 0, b"a" * 8)] and got.get_number_of_workers() == 1
    assert worker.get_kv_events().get_all_events() == []  # drained; an empty report still counts


def test_keys_name_their_group_and_block_in_every_mode():
    h = bytes(range(8))
    for scheme in (KeyScheme("m", "L", group=2), KeyScheme("m", "L", tp_rank=1, tp_size=2, kv_shards=2, group=2),
                   KeyScheme("m", "L", group=2, layers=4), KeyScheme("m", "L", group=2, heads=4)):
        for key in scheme.keys([h], 3 if scheme.layers else None):
            assert block_of(key) == (2, h), key
    assert block_of("not-a-pool-key") is None and block_of("a@b@gX@zz") is None
    keys = KeyScheme("m", "L", layers=2).keys([h], 0) + KeyScheme("m", "L", layers=2).keys([h], 1)
    assert dropped_markers(keys) == [(DROPPED, 0, h)]  # a block once, whatever left
