"""PoolScheduler: what the scheduler side offers vLLM and what it plans for the workers each step.

Requests and scheduler outputs are vLLM's own classes; only the lookup channel is faked, with a
set of pooled block hashes. BLOCK_SIZE is 4 tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from connector_fakes import (
    BLOCK_SIZE,
    Cached,
    FakeLookupClient,
    kv_blocks,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    new_req,
    scheduler_output,
)
from kvpool.config import load_config
from kvpool.errors import ConfigError
from kvpool.keys import tenant_tag
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.scheduler import PoolScheduler, check_hash_seed

BS = BLOCK_SIZE


def make_scheduler(extra: dict[str, Any] | None = None, role: str = "kv_both", hash_algo: str = "sha256",
                   groups: int = 1, cache_block_size: int = BS) -> PoolScheduler:
    return PoolScheduler(make_vllm_config(block_size=BS, hash_algo=hash_algo), load_config(extra, role),
                         make_kv_cache_config(block_size=cache_block_size, groups=groups))


def async_hit(fake: type[FakeLookupClient], n_blocks: int, block_ids: list[int]) -> tuple[PoolScheduler, Request]:
    """A scheduler with async loads and request "a", its first `n_blocks` blocks pooled and one
    token more: looked up (a hit of every pooled block) and allocated `block_ids`."""
    sched = make_scheduler({"load_async": True})
    req = make_request("a", n_blocks * BS + 1)
    pool(fake, req, n_blocks)
    assert sched.get_num_new_matched_tokens(req, 0) == (n_blocks * BS, True)
    sched.update_state_after_alloc(req, kv_blocks(block_ids), n_blocks * BS)
    return sched, req


def pool(fake: type[FakeLookupClient], request, n_blocks: int) -> None:
    """Make the first `n_blocks` blocks of `request`'s prompt pooled."""
    fake.pooled.update(request.block_hashes[:n_blocks])


def tasks(tasks: list[BlockTask]) -> list[tuple[str, list[bytes], list[int]]]:
    return [(t.req_id, t.block_hashes, t.block_ids) for t in tasks]


def empty_step(sched: PoolScheduler) -> KVPoolMetadata:
    return sched.build_connector_meta(scheduler_output())


# ---- how much is offered --------------------------------------------------------------------------


def test_nothing_pooled_offers_nothing(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 5 * BS)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, kv_blocks(range(5)), 0)
    assert empty_step(sched).loads == []


def test_leading_pooled_blocks_are_offered_and_loaded(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 5 * BS + 2)
    pool(fake_lookup, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([10, 11, 12, 13, 14, 15]), 2 * BS)
    meta = empty_step(sched)
    assert tasks(meta.loads) == [("a", req.block_hashes[:2], [10, 11])]
    assert meta.loads[0].is_async is False


def test_a_gap_ends_the_hit(fake_lookup):
    # Block hashes are chained: block 2 without block 1 is unusable, so the hit stops at the gap.
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 1)
    fake_lookup.pooled.update([req.block_hashes[0], req.block_hashes[2], req.block_hashes[3]])
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, False)


@pytest.mark.parametrize("extra_tokens", [0, 1, BS - 1])
def test_full_hit_gives_one_token_back(fake_lookup, extra_tokens):
    """A hit covering every prompt token leaves one for vLLM to compute logits from; a prompt
    with a partial last block already has tokens left to compute, so its full blocks are all offered."""
    sched = make_scheduler()
    req = make_request("a", 4 * BS + extra_tokens)
    pool(fake_lookup, req, 4)
    expected = 4 * BS - 1 if extra_tokens == 0 else 4 * BS
    assert sched.get_num_new_matched_tokens(req, 0) == (expected, False)
    sched.update_state_after_alloc(req, kv_blocks(range(5)), expected)
    # The last block is still loaded whole: vLLM recomputes its final token over identical bytes.
    assert tasks(empty_step(sched).loads) == [("a", req.block_hashes[:4], [0, 1, 2, 3])]


def test_only_whole_blocks_are_offered(fake_lookup):
    # The partial last block has no block hash, so it is never looked up nor offered.
    sched = make_scheduler()
    req = make_request("a", 2 * BS + 3)
    pool(fake_lookup, req, 2)
    offered, _ = sched.get_num_new_matched_tokens(req, 0)
    assert offered == 2 * BS
    assert offered % BS == 0
    assert fake_lookup.instances[0].calls == [req.block_hashes[:2]]


def test_locally_computed_tokens_are_not_reloaded(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 5 * BS + 1)
    pool(fake_lookup, req, 4)
    # vLLM's prefix cache already holds 2 blocks: only blocks 2 and 3 come from the pool.
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (2 * BS, False)
    assert fake_lookup.instances[0].calls == [req.block_hashes[2:]]
    sched.update_state_after_alloc(req, kv_blocks([7, 8, 9, 10, 11, 12]), 2 * BS)
    assert tasks(empty_step(sched).loads) == [("a", req.block_hashes[2:4], [9, 10])]


def test_local_hit_covering_the_pool_hit_offers_nothing(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 5 * BS + 1)
    pool(fake_lookup, req, 3)
    # Blocks 3.. are not pooled: nothing beyond the local 3 blocks.
    assert sched.get_num_new_matched_tokens(req, 3 * BS) == (0, False)
    # All block hashes computed locally: the lookup is not even asked.
    calls = len(fake_lookup.instances[0].calls)
    assert sched.get_num_new_matched_tokens(req, 5 * BS) == (0, False)
    assert len(fake_lookup.instances[0].calls) == calls


def test_load_async_is_reported_and_planned(fake_lookup):
    sched, req = async_hit(fake_lookup, 3, [4, 5, 6, 7])
    (task,) = empty_step(sched).loads
    assert task.is_async is True and task.block_ids == [4, 5, 6]


@pytest.mark.parametrize(("granted", "loaded_blocks"), [(BS, 1), (BS + 1, 2), (3 * BS, 3), (0, 0)])
def test_partial_grant_loads_only_the_granted_blocks(fake_lookup, granted, loaded_blocks):
    """vLLM (or a MultiConnector sibling) may accept fewer tokens than offered; a grant ending
    inside a block still needs that whole block, since vLLM treats its first tokens as computed."""
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 2)
    pool(fake_lookup, req, 4)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([20, 21, 22, 23, 24]), granted)
    loads = empty_step(sched).loads
    if loaded_blocks == 0:
        assert loads == []
    else:
        assert tasks(loads) == [("a", req.block_hashes[:loaded_blocks], list(range(20, 20 + loaded_blocks)))]


def test_a_plan_is_sent_to_the_workers_once(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 2 * BS + 1)
    pool(fake_lookup, req, 2)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2]), 2 * BS)
    assert len(empty_step(sched).loads) == 1
    assert empty_step(sched).loads == []
    # A second update (vLLM calls it again once an async load is done) plans nothing new.
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2]), 0)
    assert empty_step(sched).loads == []


# ---- saves ----------------------------------------------------------------------------------------


def test_chunked_prefill_saves_each_full_prompt_block_once(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 6 * BS + 1, max_tokens=8)  # 6 full prompt blocks, then a partial one
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, kv_blocks([30, 31, 32]), 0)
    h = req.block_hashes

    # Step 1: 10 tokens computed: blocks 0 and 1 are full; block 2 is half-written.
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [30, 31, 32], 0), 10)]))
    assert tasks(meta.saves) == [("a", h[0:2], [30, 31])]
    # Step 2: tokens 10..20 (blocks 3 and 4 allocated now): blocks 2..4 become full.
    meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("a", 10, [33, 34]), 10)]))
    assert tasks(meta.saves) == [("a", h[2:5], [32, 33, 34])]
    # Step 3: the prompt's last 5 tokens: block 5 is the last full prompt block.
    meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("a", 20, [35, 36]), 5)]))
    assert tasks(meta.saves) == [("a", h[5:6], [35])]
    # Decode: output tokens complete block 6 and more, but output blocks are never saved.
    req.append_output_token_ids(list(range(1000, 1000 + BS + 3)))
    assert len(req.block_hashes) > 7
    for computed in (25, 26, 27, 28, 29):
        meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("a", computed, [37] if computed == 28 else None), 1)]))
        assert meta.saves == []


def _decode_past_a_block(sched: PoolScheduler, params: dict | None = None) -> list[list[bytes]]:
    """Request "a": 2 prompt blocks and a token, then decoding fills block 2 and 2 tokens of 3,
    one token a step; the hashes of the blocks each step saved."""
    req = make_request("a", 2 * BS + 1, max_tokens=2 * BS)
    req.kv_transfer_params = params
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([10, 11, 12]), 0)
    saved = [[h for t in sched.build_connector_meta(scheduler_output(new=[(new_req(req, [10, 11, 12], 0),
                                                                            2 * BS + 1)])).saves
              for h in t.block_hashes]]
    req.append_output_token_ids(list(range(1000, 1000 + BS + 2)))
    for computed in range(2 * BS + 1, 3 * BS + 2):  # one token a step
        step = Cached("a", computed, [13] if computed == 3 * BS else None)
        saved.append([h for t in sched.build_connector_meta(scheduler_output(cached=[(step, 1)])).saves
                      for h in t.block_hashes])
    return saved


def test_decode_blocks_are_saved_when_full_with_save_decode_cache_or_on_request(fake_lookup):
    h = make_request("a", 2 * BS + 1).block_hashes
    for sched, params in ((make_scheduler({"save_decode_cache": True}), None),
                          (make_scheduler(), {"kvpool": {"save_decode": True}})):
        saved = _decode_past_a_block(sched, params)
        # The prompt's blocks at once; block 2, filled by decoding, in the step that computes its
        # last token; nothing for the half-filled block 3.
        assert saved[0] == h[:2] and [s for s in saved[1:] if s] == [[_hashes_after_decode()[2]]]
        assert saved[BS - 1] == [_hashes_after_decode()[2]]  # the step that computes token 3 * BS - 1


def _hashes_after_decode() -> list[bytes]:
    req = make_request("a", 2 * BS + 1, max_tokens=2 * BS)
    req.append_output_token_ids(list(range(1000, 1000 + BS + 2)))
    return req.block_hashes


def test_a_request_may_refuse_decode_saving_and_without_it_none_is_saved(fake_lookup):
    for sched, params in ((make_scheduler({"save_decode_cache": True}), {"kvpool": {"save_decode": False}}),
                          (make_scheduler(), None)):
        saved = _decode_past_a_block(sched, params)
        assert len(saved[0]) == 2 and not any(saved[1:])


def test_a_request_may_skip_the_pools_load_or_its_save(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 3 * BS + 1)
    req.kv_transfer_params = {"kvpool": {"skip_load": True}, "do_remote_decode": False}  # another's key beside
    pool(fake_lookup, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert _decode_past_a_block(make_scheduler(), {"kvpool": {"skip_save": True}}) == [[]] * (BS + 2)


@pytest.mark.parametrize(("allowed", "asked", "pinned"), [(600.0, 60.0, 60.0), (30.0, 60.0, 30.0), (0.0, 60.0, 0.0),
                                                          (600.0, 0.0, 0.0)])
def test_a_request_pins_its_loads_and_saves_as_long_as_the_instance_allows(fake_lookup, allowed, asked, pinned):
    sched = make_scheduler({"request_pin_max_s": allowed})
    req = make_request("a", 4 * BS + 1)
    req.kv_transfer_params = {"kvpool": {"pin_s": asked}}
    pool(fake_lookup, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([10, 11, 12, 13, 14]), 2 * BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [10, 11, 12, 13, 14], 2 * BS), 2 * BS + 1)]))
    assert [t.pin_s for t in meta.loads] == [pinned] and [t.pin_s for t in meta.saves] == [pinned]
    assert tasks(meta.saves) == [("a", req.block_hashes[2:4], [12, 13])]


def test_a_salted_request_looks_up_and_moves_its_tenants_blocks(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 1, cache_salt="tenant-a")
    pool(fake_lookup, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert fake_lookup.instances[-1].tenants == [tenant_tag("tenant-a")]
    sched.update_state_after_alloc(req, kv_blocks([10, 11, 12, 13, 14]), 2 * BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [10, 11, 12, 13, 14], 2 * BS), 2 * BS + 1)]))
    assert {t.tenant for t in meta.loads + meta.saves} == {tenant_tag("tenant-a")}
    plain = make_request("b", BS + 1, first_token=500)
    sched.get_num_new_matched_tokens(plain, 0)
    assert fake_lookup.instances[-1].tenants[-1] == ""


@pytest.mark.parametrize("params", [
    {"kvpool": {"skip_load": "yes"}}, {"kvpool": {"skip_lod": True}}, {"kvpool": [1]}, {"kvpool": None},
])
def test_switches_kvpool_cannot_read_are_ignored_not_fatal(fake_lookup, params):
    sched = make_scheduler()
    req = make_request("a", 3 * BS + 1)
    req.kv_transfer_params = params
    pool(fake_lookup, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)  # the defaults: looked up


def test_loaded_blocks_are_not_saved_again(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 1)
    pool(fake_lookup, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2, 3, 4]), 2 * BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0, 1, 2, 3, 4], 2 * BS), 2 * BS + 1)]))
    assert tasks(meta.loads) == [("a", req.block_hashes[:2], [0, 1])]
    assert tasks(meta.saves) == [("a", req.block_hashes[2:4], [2, 3])]


def test_blocks_computed_over_a_failed_load_are_offered_again_after_the_recompute(fake_lookup):
    # Step 1 loads blocks 0-2 and computes 3-4; block 1's load fails. The saves of that step
    # name the blocks they were computed over, so the worker can drop them; vLLM then reports
    # block 1 and recomputes from it, and the recomputed blocks 1-4 are offered (1-2 again:
    # the pool skips what it has).
    sched = make_scheduler()
    req = make_request("a", 5 * BS + 1)
    pool(fake_lookup, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks(range(10, 16)), 3 * BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, list(range(10, 16)), 3 * BS), 2 * BS + 1)]))
    assert tasks(meta.saves) == [("a", req.block_hashes[3:5], [13, 14])]
    assert meta.saves[0].prior_block_ids == [10, 11, 12]
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={11}))
    meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("a", BS), 4 * BS + 1)]))
    assert tasks(meta.saves) == [("a", req.block_hashes[1:5], [11, 12, 13, 14])]
    # The step after a load names its prior blocks too (with async scheduling it is planned
    # before the load's failures are reported); the recomputed failed block is not among them.
    assert meta.saves[0].prior_block_ids == [10]
    # Another request's failed block does not move this one.
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={99}))
    assert sched.build_connector_meta(scheduler_output(cached=[(Cached("a", 5 * BS + 1), 1)])).saves == []


def test_blocks_from_vllms_prefix_cache_are_not_offered_again(fake_lookup):
    # A conversation's next turn: vLLM's own cache supplies 3 blocks, the pool the 4th.
    sched = make_scheduler()
    req = make_request("a", 6 * BS + 1)
    pool(fake_lookup, req, 4)
    assert sched.get_num_new_matched_tokens(req, 3 * BS) == (BS, False)
    sched.update_state_after_alloc(req, kv_blocks(range(7)), BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, list(range(7)), 4 * BS), 2 * BS + 1)]))
    assert tasks(meta.loads) == [("a", req.block_hashes[3:4], [3])]
    assert tasks(meta.saves) == [("a", req.block_hashes[4:6], [4, 5])]
    # Only a local hit: nothing loaded, and only the computed blocks go to the pool.
    fake_lookup.pooled.clear()
    req2 = make_request("b", 4 * BS + 1)
    assert sched.get_num_new_matched_tokens(req2, 2 * BS) == (0, False)
    sched.update_state_after_alloc(req2, kv_blocks(range(10, 15)), 0)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req2, list(range(10, 15)), 2 * BS), 2 * BS + 1)]))
    assert meta.loads == [] and tasks(meta.saves) == [("b", req2.block_hashes[2:4], [12, 13])]


def test_blocks_beyond_a_partial_grant_are_saved_after_compute(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 1)
    pool(fake_lookup, req, 4)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2, 3, 4]), BS)  # vLLM took one block only
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0, 1, 2, 3, 4], BS), 3 * BS + 1)]))
    assert tasks(meta.loads) == [("a", req.block_hashes[:1], [0])]
    assert tasks(meta.saves) == [("a", req.block_hashes[1:4], [1, 2, 3])]


def test_requests_unknown_to_the_connector_are_not_saved(fake_lookup):
    # update_state_after_alloc was never called for it (e.g. it belongs to another connector's state).
    sched = make_scheduler()
    req = make_request("a", 2 * BS)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0, 1], 0), 2 * BS)]))
    assert meta.saves == []


def test_preempted_then_resumed_request_saves_into_its_new_blocks(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 5 * BS + 1)
    h = req.block_hashes
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3]), 0)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [1, 2, 3], 0), 2 * BS + 2)]))
    assert tasks(meta.saves) == [("a", h[0:2], [1, 2])]

    # Preempted: the workers are told, so they drain its saves before its blocks are reused.
    meta = sched.build_connector_meta(scheduler_output(preempted={"a"}))
    assert meta.preempted == ["a"] and meta.saves == []

    # Resumed with fresh blocks; its two saved blocks are in the pool now and are loaded back.
    pool(fake_lookup, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([7, 8, 9, 10, 11, 12]), 2 * BS)
    meta = sched.build_connector_meta(scheduler_output(
        cached=[(Cached("a", 2 * BS, [7, 8, 9, 10, 11, 12], resumed=True), 3 * BS + 1)]))
    assert tasks(meta.loads) == [("a", h[0:2], [7, 8])]
    # The block ids were replaced, not appended to [1, 2, 3]: block 2 is in vLLM block 9 now.
    assert tasks(meta.saves) == [("a", h[2:5], [9, 10, 11])]
    assert meta.preempted == []


def test_resumed_request_with_a_pool_miss_recomputes_and_saves_nothing_twice(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 4 * BS + 1)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3]), 0)
    sched.build_connector_meta(scheduler_output(new=[(new_req(req, [1, 2, 3], 0), 2 * BS)]))
    sched.build_connector_meta(scheduler_output(preempted={"a"}))
    sched.update_state_after_alloc(req, kv_blocks([5, 6, 7, 8, 9]), 0)
    meta = sched.build_connector_meta(scheduler_output(cached=[(Cached("a", 0, [5, 6, 7, 8, 9], resumed=True), 4 * BS + 1)]))
    # Blocks 0 and 1 were already queued before the preemption; only blocks 2 and 3 are new.
    assert tasks(meta.saves) == [("a", req.block_hashes[2:4], [7, 8])]


# ---- delayed free ---------------------------------------------------------------------------------


def test_request_with_io_is_freed_only_after_the_workers_report_it(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 2 * BS + 1)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2]), 0)
    sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0, 1, 2], 0), 2 * BS + 1)]))

    assert sched.request_finished(req, [0, 1, 2]) == (True, None)
    assert sched.has_pending_block_frees()
    meta = empty_step(sched)
    assert meta.finished_with_io == ["a"]
    assert empty_step(sched).finished_with_io == []  # told once
    sched.update_connector_output(KVConnectorOutput(finished_sending=None))
    assert sched.has_pending_block_frees()
    sched.update_connector_output(KVConnectorOutput(finished_sending={"other"}))
    assert sched.has_pending_block_frees()
    sched.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert not sched.has_pending_block_frees()


def test_request_with_only_a_finished_load_is_also_held(fake_lookup):
    # Its load is done (vLLM saw finished_recving): only this connector can hold its blocks now.
    sched, req = async_hit(fake_lookup, 2, [0, 1, 2])
    empty_step(sched)
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    assert sched.request_finished(req, [0, 1, 2]) == (True, None)


def test_a_request_finished_during_its_async_load_leaves_the_free_to_vllm(fake_lookup):
    """Aborted (or failed by kv_load_failure_policy=fail) while WAITING_FOR_REMOTE_KVS: vLLM
    itself keeps the blocks until the workers report finished_recving, then frees the request
    and forgets it. A delayed free on top would make the workers also report it in
    finished_sending, for a request vLLM no longer has (its scheduler asserts on that)."""
    sched, req = async_hit(fake_lookup, 2, [0, 1, 2])
    assert len(empty_step(sched).loads) == 1
    assert sched.request_finished(req, [0, 1, 2]) == (False, None)
    assert not sched.has_pending_block_frees()
    assert empty_step(sched).finished_with_io == []
    # The finish vLLM then sees frees the blocks; nothing is left waiting on the workers.
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    assert not sched.has_pending_block_frees()


def test_an_async_load_counts_its_prompt_tokens_once(fake_lookup):
    # vLLM allocates twice for an async load: with the hit, then (no lookup in between, 0
    # external tokens) when it schedules the request after the load. Only the first one says
    # where the prompt's KV came from.
    sched, req = async_hit(fake_lookup, 3, [4, 5, 6, 7])
    empty_step(sched)
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    sched.update_state_after_alloc(req, kv_blocks([4, 5, 6, 7]), 0)
    stats = sched.get_stats()
    assert stats is not None
    counted = {k: stats.data[k] for k in ("pool_tokens", "local_tokens", "computed_tokens")}
    assert counted == {"pool_tokens": 3 * BS, "local_tokens": 0, "computed_tokens": 1}


def test_an_async_load_that_failed_is_not_offered_again_to_the_same_request(fake_lookup):
    # recompute policy: vLLM cuts the request back to its first failed block; when that is block
    # 0 it frees the blocks and asks the connector again. Offering the same blocks again only
    # starts the same load: with a block the store keeps failing (every read timing out), the
    # request would cycle through WAITING_FOR_REMOTE_KVS forever instead of being recomputed.
    sched, req = async_hit(fake_lookup, 3, [4, 5, 6, 7])
    assert len(empty_step(sched).loads) == 1
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={4}))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, kv_blocks([8, 9, 10, 11]), 0)
    assert empty_step(sched).loads == []
    # Another request is offered those blocks as before.
    other = make_request("b", 3 * BS + 1)
    assert sched.get_num_new_matched_tokens(other, 0) == (3 * BS, True)


def test_request_without_io_is_freed_at_once(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", BS - 1)  # no full block: nothing to save
    sched.update_state_after_alloc(req, kv_blocks([0]), 0)
    sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0], 0), BS - 1)]))
    assert sched.request_finished(req, [0]) == (False, None)
    assert not sched.has_pending_block_frees()
    assert empty_step(sched).finished_with_io == []


def test_a_plan_dropped_by_finish_is_not_loaded(fake_lookup):
    sched = make_scheduler()
    req = make_request("a", 2 * BS + 1)
    pool(fake_lookup, req, 2)
    sched.get_num_new_matched_tokens(req, 0)
    # Aborted before vLLM allocated blocks for it.
    assert sched.request_finished(req, []) == (False, None)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2]), 2 * BS)
    assert empty_step(sched).loads == []


# ---- roles ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "extra", "loads", "saves"), [
    ("kv_both", {}, True, True),
    ("kv_producer", {}, True, True),  # as the spec's AscendStore: a prefill node reuses pooled prefixes
    ("kv_producer", {"producer_is_to_load": True}, True, True),
    ("kv_producer", {"producer_is_to_load": False}, False, True),  # the opt-out
    ("kv_consumer", {}, False, False),
    ("kv_consumer", {"consumer_is_to_load": True}, True, False),
    ("kv_consumer", {"consumer_is_to_put": True}, False, True),
    ("kv_consumer", {"consumer_is_to_load": True, "consumer_is_to_put": True}, True, True),
])
def test_roles_and_their_flags(fake_lookup, role, extra, loads, saves):
    sched = make_scheduler(extra, role)
    assert len(fake_lookup.instances) == (1 if loads else 0)  # no lookup channel when never loading
    req = make_request("a", 4 * BS + 1)
    pool(fake_lookup, req, 2)
    offered, _ = sched.get_num_new_matched_tokens(req, 0)
    assert offered == (2 * BS if loads else 0)
    sched.update_state_after_alloc(req, kv_blocks([0, 1, 2, 3, 4]), offered)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, [0, 1, 2, 3, 4], offered), 4 * BS + 1 - offered)]))
    assert len(meta.loads) == (1 if loads else 0)
    assert [t.block_ids for t in meta.saves] == ([[2, 3]] if loads and saves else [[0, 1, 2, 3]] if saves else [])
    assert sched.request_finished(req, [0, 1, 2, 3, 4]) == ((loads or saves), None)


def test_shutdown_closes_the_lookup_client(fake_lookup):
    sched = make_scheduler()
    sched.shutdown()
    assert fake_lookup.instances[0].closed


def test_lookup_client_uses_port_and_dp_rank(fake_lookup):
    PoolScheduler(make_vllm_config(dp_rank=3), load_config({"lookup_rpc_port": 17}), make_kv_cache_config())
    assert (fake_lookup.instances[0].port, fake_lookup.instances[0].dp_rank) == (17, 3)


# ---- start-up checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_pythonhashseed_is_refused(fake_lookup, monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError) as exc:
        make_scheduler(hash_algo=algo)
    assert exc.value.key == "prefix_caching_hash_algo" and exc.value.value == algo


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_with_pythonhashseed_is_accepted(fake_lookup, monkeypatch, algo):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    make_scheduler(hash_algo=algo)
    check_hash_seed(algo)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_needs_no_seed(fake_lookup, monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    check_hash_seed(algo)
    make_scheduler(hash_algo=algo)


def test_group_block_size_must_match_the_cache_block_size(fake_lookup):
    with pytest.raises(ConfigError) as exc:
        make_scheduler(cache_block_size=2 * BS)
    assert exc.value.key == "kv_cache_groups[0].block_size"


# ---- the block-hash log --------------------------------------------------------------------------


def test_block_hash_log_writes_a_trace_line_per_finished_request(fake_lookup, tmp_path):
    import json
    import stat

    from kvpool.tracefile import block_id

    path = tmp_path / "hashes.jsonl"
    sched = make_scheduler({"block_hash_log": str(path)})
    a = make_request("a", 3 * BS + 1)
    b = make_request("b", 2 * BS)  # shares its two blocks with a (same leading tokens)
    for req in (a, b):
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, kv_blocks(range(4)), 0)
    a.append_output_token_ids(list(range(900, 900 + 2 * BS)))  # output blocks are never logged
    sched.request_finished(a, [])
    sched.request_finished(b, [])
    sched.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [len(x["hash_ids"]) for x in lines] == [3, 2]
    assert lines[0]["hash_ids"][:2] == lines[1]["hash_ids"] == [block_id(h) for h in b.block_hashes]
    assert (lines[0]["input_length"], lines[0]["output_length"], lines[0]["block_size"]) == (3 * BS + 1, 2 * BS, BS)
    assert lines[0]["timestamp"] == int(a.arrival_time * 1000)
    assert all(0 <= i < 2**63 for x in lines for i in x["hash_ids"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("value", ["relative/hashes.jsonl", "/no/such/dir/hashes.jsonl", "/tmp"])
def test_block_hash_log_path_must_be_a_writable_file_path(value):
    with pytest.raises(ConfigError, match="block_hash_log"):
        load_config({"block_hash_log": value})


def test_lookups_the_channels_breaker_skipped_are_counted_once(fake_lookup):
    sched = make_scheduler()
    client = fake_lookup.instances[-1]
    client.skipped = 7
    stats = sched.get_stats()
    assert stats is not None and stats.data["lookups_skipped"] == 7
    assert sched.get_stats() is None  # nothing new: not counted again
    client.skipped = 9
    assert sched.get_stats().data["lookups_skipped"] == 2
