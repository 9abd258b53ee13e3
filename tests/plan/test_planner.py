"""The planner against hit rates computed by hand on small traces (one pool, pools per host, a
remote tier behind them), and its scaling argument checked against an engine running at the
real sizes."""

from __future__ import annotations

import json
import random

import pytest

from kvpool.errors import ConfigError
from kvpool.plan.cluster import ServiceModel, replay_cluster, workload
from kvpool.plan.pool import PoolModel, RemoteTier
from kvpool.plan.replay import answer_keys, replay_pool, request_keys
from kvpool.plan.scale import ScaledMemory, scale_memory
from kvpool.tracefile import parse_lines, read_trace
from kvpool.store import EngineConfig
from kvpool.store.disk import HEADER_SIZE
from kvpool.store.quota import QuotaIndex

BLOCK = 4  # tokens per block in the hand-written traces
BLOCK_BYTES = 64  # one alignment unit: R = 64, nothing rounds


def _trace(*requests: list[int], gap_ms: int = 1000):
    lines = [json.dumps({"timestamp": i * gap_ms, "input_length": BLOCK * len(ids), "output_length": 1,
                         "hash_ids": ids}) for i, ids in enumerate(requests)]
    return parse_lines(lines, BLOCK)


def _lru_pool(blocks: int, ssd_entries: int = 0, policy: str = "lru") -> PoolModel:
    """A pool whose memory tier is a plain LRU of ``blocks`` blocks: at a high watermark of 1 it
    evicts only when full, and then max(1, ceil(0.01 * count)) = 1 object, the least recent."""
    scaled = scale_memory(blocks * BLOCK_BYTES, BLOCK_BYTES, high_watermark=1.0, eviction_ratio=0.01)
    assert scaled.capacity_objects == blocks
    entry = HEADER_SIZE + 1 + BLOCK_BYTES  # one-character keys
    return PoolModel(scaled, BLOCK_BYTES, ssd_entries * entry, policy)  # type: ignore[arg-type]


TRACE = ([1, 2, 3], [1, 2, 4], [1, 3], [1, 2, 4])


def test_memory_only_lru_by_hand() -> None:
    # memory LRU of 3 (oldest first):
    # [1,2,3]: 3 misses                       -> 1 2 3
    # [1,2,4]: 1, 2 hit; 4 evicts 3           -> 1 2 4
    # [1,3]:   1 hit; 3 evicts 2              -> 4 1 3
    # [1,2,4]: 1 hit; 2 evicts 4, then 4 (found at lookup, gone by its turn: after the first
    #          miss it is stored again anyway) evicts 3                    -> 1 2 4
    pool = _lru_pool(3)
    counts, _ = replay_pool(request_keys(_trace(*TRACE)), pool)
    assert (counts.blocks, counts.memory, counts.ssd, counts.recomputed) == (11, 4, 0, 7)
    assert pool.engine.stats()["object_count"] == 3


def test_memory_and_ssd_by_hand() -> None:
    # memory LRU of 2, SSD of 3 entries (lru), every stored block written through to SSD:
    # [1,2,3]: misses; memory 2 3; SSD 1 2 3
    # [1,2,4]: 1 from SSD (promoted, evicts 2: memory 3 1); 2 was in memory at lookup but is
    #          gone, so from SSD too (memory 1 2); SSD order 3 1 2; 4 misses: memory 2 4, SSD 1 2 4
    # [1,3]:   1 from SSD (memory 4 1, SSD 2 4 1); 3 misses: memory 1 3, SSD 4 1 3
    # [1,2,4]: 1 from memory; 2 misses (SSD evicted it): memory 2 4, SSD 3 2 4
    pool = _lru_pool(2, ssd_entries=3)
    counts, _ = replay_pool(request_keys(_trace(*TRACE)), pool)
    assert (counts.blocks, counts.memory, counts.ssd, counts.recomputed) == (11, 1, 3, 7)


def test_ssd_fifo_keeps_write_order() -> None:
    # As above, but under fifo a read does not save a block:
    # [1,2,3]: memory 2 3; SSD 1 2 3
    # [1,2,4]: 1 and 2 from SSD as before (memory 1 2), SSD order stays 1 2 3; 4 misses:
    #          memory 2 4, SSD evicts 1 (lru evicted 3, read least recently) -> 2 3 4
    # [1,3]:   1 is nowhere: 2 misses; memory 1 3, SSD 3 4 1 (3 already there)
    # [1,2,4]: 1 from memory; 2 misses
    pool = _lru_pool(2, ssd_entries=3, policy="fifo")
    counts, _ = replay_pool(request_keys(_trace(*TRACE)), pool)
    assert (counts.memory, counts.ssd, counts.recomputed) == (1, 2, 8)


def _cluster(policy: str, pool_blocks: int):
    # Two instances, local caches of 4 blocks, requests 1 s apart with (almost) no service time,
    # so every instance is idle at each arrival.
    work = workload(_trace([1, 2], [3, 4], [3, 4, 6], [1, 2, 5]))
    pool = _lru_pool(pool_blocks)
    counts, _, served = replay_cluster(work, pool, 2, policy, local_blocks=4,
                                       service=ServiceModel(1e12, 0.0))
    return counts, served


def test_cluster_round_robin_vs_prefix_aware_by_hand() -> None:
    # round_robin: [1,2]->0, [3,4]->1, [3,4,6]->0, [1,2,5]->1: no instance holds what it gets.
    #   With a 1-block pool nothing survives there either: 0 hits of 10.
    #   With a 10-block pool the pool has 3,4 and then 1,2: 4 memory hits.
    # prefix_aware: [1,2]->0, [3,4]->1 (least loaded, rotating), [3,4,6]->1 and [1,2,5]->0 by
    #   their prefixes: 2 + 2 local hits, and the pool is asked only for 6 and 5 (misses).
    counts, served = _cluster("round_robin", 1)
    assert (counts.blocks, counts.local, counts.memory, counts.recomputed, served) == (10, 0, 0, 10, [2, 2])
    counts, _ = _cluster("round_robin", 10)
    assert (counts.local, counts.memory, counts.recomputed) == (0, 4, 6)
    for pool_blocks in (1, 10):
        counts, served = _cluster("prefix_aware", pool_blocks)
        assert (counts.local, counts.memory, counts.recomputed, served) == (4, 0, 6, [2, 2])


def test_replicated_workload_copies_share_nothing() -> None:
    trace = _trace([1, 2], [1, 2])
    work = workload(trace, copies=2)
    assert len(work.requests) == 4
    assert sorted(map(tuple, work.keys)) == [("1", "2"), ("1", "2"), ("1/1", "1/2"), ("1/1", "1/2")]
    assert [r.timestamp for r in work.requests] == [0, 0, 1000, 1000]
    by_key = {tuple(k): c for k, c in zip(work.keys, work.chains)}
    assert by_key[("1", "2")] != by_key[("1/1", "1/2")]
    counts, _ = replay_pool(work.keys, _lru_pool(8))
    assert (counts.memory, counts.recomputed) == (4, 4)


def _real_size_pool(memory: int, block_bytes: int, high: float, ratio: float) -> PoolModel:
    """The same pool at its real sizes: objects of block_bytes rounded up, the whole arena."""
    cfg = EngineConfig(memory_size=memory, eviction_high_watermark_ratio=high, eviction_ratio=ratio,
                       reap_interval_s=0)
    r = -(-block_bytes // 64) * 64
    real = ScaledMemory(memory, r, 0, 0, r // 64, cfg)
    return PoolModel(real, block_bytes)


@pytest.mark.parametrize("seed", range(12))
def test_scaled_engine_decides_as_the_real_sized_one(seed: int) -> None:
    rng = random.Random(seed)
    block_bytes = rng.choice([1000, 4096, 5000, 64 * 37 + 5])
    memory = rng.randrange(5, 60) * block_bytes + rng.randrange(0, block_bytes)
    high, ratio = rng.choice([0.9, 0.75, 1.0]), rng.choice([0.1, 0.3, 0.05])
    # Requests sharing prefixes of a few roots, so there is reuse and eviction both.
    reqs = []
    for _ in range(300):
        root = rng.randrange(12)
        reqs.append([root * 1000 + i for i in range(rng.randrange(1, 12))])
    keys = request_keys(_trace(*reqs))
    scaled = scale_memory(memory, block_bytes, high_watermark=high, eviction_ratio=ratio)
    a = PoolModel(scaled, block_bytes)
    b = _real_size_pool(memory, block_bytes, high, ratio)
    for req in keys:
        assert a.serve(req) == b.serve(req)
    assert a.engine.stats()["evictions"] == b.engine.stats()["evictions"] > 0
    assert a.engine._debug_snapshot()["lru"] == b.engine._debug_snapshot()["lru"]


def test_quota_index_is_the_disk_tiers_policy() -> None:
    q = QuotaIndex(30, "lru")
    for key in "abc":
        assert q.reserve(key, 10) == (True, [])
        q.settle(key)
    q.touch("a")
    assert q.reserve("d", 10) == (True, ["b"])
    q.settle("d")
    assert q.keys() == ["c", "a", "d"] and q.used == 30 and q.evictions == 1
    none = QuotaIndex(10, "none")
    assert none.reserve("x", 10) == (True, [])
    assert none.reserve("y", 1) == (False, [])
    with pytest.raises(ConfigError, match="ssd_eviction_policy"):
        QuotaIndex(10, "random")  # type: ignore[arg-type]


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, "x"]}', "hash_ids"),
    ('{"timestamp": -5, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 8, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2, 3]}', "hash_ids"),
])
def test_bad_line_names_line_and_field(line: str, field: str) -> None:
    good = '{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}'
    with pytest.raises(ConfigError) as info:
        parse_lines([good, line], BLOCK, source="t.jsonl")
    assert info.value.key == f"t.jsonl:2 {field}"
    assert "line 2" in info.value.expected


def test_malformed_json_names_the_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_lines(['{"timestamp": 0,', ""], BLOCK, source="t.jsonl")
    assert info.value.key == "t.jsonl:1"


def test_trace_is_replayed_in_arrival_order() -> None:
    lines = [json.dumps({"timestamp": t, "input_length": 4, "output_length": 0, "hash_ids": [t]})
             for t in (5, 1, 5, 0)]
    trace = parse_lines(lines, BLOCK)
    assert [r.timestamp for r in trace.requests] == [0, 1, 5, 5]
    assert trace.block_refs == 4 and trace.unique_blocks == 3


def test_the_connectors_block_hash_log_is_a_trace(tmp_path):
    # What `block_hash_log` writes: epoch-ms arrivals, whole blocks only, the block size per line.
    from kvpool.tracefile import BlockHashLog

    path = tmp_path / "log.jsonl"
    log = BlockHashLog(str(path), block_size=16)
    log.record(1_700_000_000.0, 16 * 3 + 5, 4, [b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32])
    log.record(1_700_000_000.5, 16 * 2, 4, [b"a" * 32, b"b" * 32])
    log.close()
    trace = read_trace(str(path), None)
    assert trace.block_size == 16
    assert [r.timestamp for r in trace.requests] == [0, 500]
    assert [len(r.hash_ids) for r in trace.requests] == [3, 2]
    assert trace.requests[0].hash_ids[:2] == trace.requests[1].hash_ids
    with pytest.raises(ConfigError, match="block_size"):
        parse_lines(['{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2], "block_size": 16}',
                     '{"timestamp": 1, "input_length": 32, "output_length": 1, "hash_ids": [1], "block_size": 32}'],
                    None)


def _policy_pool(blocks: int, policy: str) -> PoolModel:
    """As ``_lru_pool``, with the memory tier's eviction policy chosen."""
    scaled = scale_memory(blocks * BLOCK_BYTES, BLOCK_BYTES, high_watermark=1.0, eviction_ratio=0.01,
                          eviction_policy=policy)  # type: ignore[arg-type]
    return PoolModel(scaled, BLOCK_BYTES)


def test_memory_policy_is_the_engines_and_s3fifo_keeps_a_reused_prefix_through_a_scan() -> None:
    # A 10-block pool: the prefix [1,2] is stored, then read back, then 30 one-off blocks pass
    # (three pools' worth), then [1,2] comes again. lru: the scan pushed it out (2 hits, from the
    # second request); s3fifo: it was read, so it moved to the main queue and the scan went
    # through the small queue alone (4 hits).
    requests = [[1, 2], [1, 2], *([100 + i] for i in range(30)), [1, 2]]
    hits = {}
    for policy in ("lru", "s3fifo"):
        pool = _policy_pool(10, policy)
        assert pool.engine.config.eviction_policy == policy
        counts, _ = replay_pool(request_keys(_trace(*requests)), pool)
        hits[policy] = counts.memory
        pool.close()
    assert hits == {"lru": 2, "s3fifo": 4}


def test_an_answer_is_read_off_the_conversations_next_turn_and_stored_with_save_decode() -> None:
    # A: 2 whole blocks and 2 tokens (ids 1 2 3, the last partial), then a 7-token answer: the
    # blocks of A's prompt and answer reach token 2 * 4 + 2 + 7 - 1 = 16, so the answer fills
    # blocks 2 and 3 (ids 5 6 in B, A's next turn: A's prompt, its answer and a question). C
    # shares A's first block only; D continues nothing.
    lines = [json.dumps(r) for r in (
        {"timestamp": 0, "input_length": 10, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": [1, 2, 5, 6, 7]},
        {"timestamp": 2, "input_length": 8, "output_length": 9, "hash_ids": [1, 8]},
        {"timestamp": 3, "input_length": 4, "output_length": 1, "hash_ids": [9]},
    )]
    trace = parse_lines(lines, BLOCK)
    assert answer_keys(trace) == [["5", "6"], [], [], []]
    without, _ = replay_pool(request_keys(trace), _lru_pool(64))
    with_answers, _ = replay_pool(request_keys(trace), _lru_pool(64), answer_keys(trace))
    # B hits 1 2 either way, and 5 6 only when A saved its answer; C hits 1.
    assert (without.memory, with_answers.memory) == (3, 5)


def test_save_decode_is_refused_in_cluster_mode(tmp_path) -> None:
    from kvpool.cli.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--save-decode", "--instances", "2"]) == 2


def test_a_remote_tier_behind_a_small_host_pool_by_hand() -> None:
    # memory LRU of 2, no SSD, a remote tier with room for everything; every stored block is
    # written through to it, and what it serves is promoted into memory:
    # [1,2,3]: misses; memory 2 3; remote 1 2 3
    # [1,2,4]: 1 from the remote tier (memory 3 1); 2 was in memory at lookup but is gone, so
    #          from the remote tier too (memory 1 2); 4 misses: memory 2 4, remote 1 2 3 4
    # [1,3]:   both from the remote tier: memory 1 3
    # [1,2,4]: 1 from memory; 2 and 4 from the remote tier
    # So with a remote tier that keeps everything, only each block's first sight is recomputed.
    scaled = scale_memory(2 * BLOCK_BYTES, BLOCK_BYTES, high_watermark=1.0, eviction_ratio=0.01)
    pool = PoolModel(scaled, BLOCK_BYTES, remote=RemoteTier(100 * BLOCK_BYTES, BLOCK_BYTES))
    counts, _ = replay_pool(request_keys(_trace(*TRACE)), pool)
    assert (counts.blocks, counts.memory, counts.ssd, counts.remote, counts.recomputed) == (11, 1, 0, 6, 4)


def test_a_remote_tier_evicts_its_least_recently_used_block() -> None:
    remote = RemoteTier(2 * BLOCK_BYTES, BLOCK_BYTES)
    remote.write("a")
    remote.write("b")
    assert remote.read("a")  # a use: b is now the least recent
    remote.write("c")
    assert remote.read("a") and remote.read("c") and not remote.read("b")


def _hosts(hosts: int, remote_blocks: int):
    # Three identical requests over two instances, round robin (0, 1, 0), no local caches.
    work = workload(_trace([1, 2], [1, 2], [1, 2]))
    remote = RemoteTier(remote_blocks * BLOCK_BYTES, BLOCK_BYTES) if remote_blocks else None
    pools = [_lru_pool(10) if remote is None else
             PoolModel(scale_memory(10 * BLOCK_BYTES, BLOCK_BYTES, high_watermark=1.0, eviction_ratio=0.01),
                       BLOCK_BYTES, remote=remote) for _ in range(hosts)]
    counts, _, served = replay_cluster(work, pools, 2, "round_robin", local_blocks=0,
                                       service=ServiceModel(1e12, 0.0))
    assert served == [2, 1]
    return counts.memory, counts.remote, counts.recomputed


def test_hosts_each_with_a_pool_share_the_remote_tier_by_hand() -> None:
    # One pool for both instances: the second and third requests hit it.
    assert _hosts(1, 0) == (4, 0, 2)
    # A pool per host, nothing behind them: host 1 recomputes what host 0 computed; host 0's
    # second request hits its own pool.
    assert _hosts(2, 0) == (2, 0, 4)
    # A remote tier behind them: host 1's request is served by it (and promoted into host 1's
    # pool); host 0's second request by host 0's memory.
    assert _hosts(2, 10) == (2, 2, 2)
