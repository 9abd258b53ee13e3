"""Eviction policies (store/policy.py) under random operation sequences, against a reference
model (lru, fifo, none) or their invariants (s3fifo); s3fifo's scan resistance, alone and
through a real PoolEngine next to lru on the same sequence; QuotaIndex under every SSD policy."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import FakeClock, payload
from test_properties import KEYS, MEMORY, engine_ops, run_engine_ops, sizes_st

from kvpool.errors import ConfigError, ErrorCode
from kvpool.store import EngineConfig, Lease, PoolEngine
from kvpool.store.policy import (
    DISK_POLICIES, MEMORY_POLICIES, POLICIES, EvictionPolicy, Fifo, Lru, NoEviction, S3Fifo, make_policy,
)
from kvpool.store.quota import QuotaIndex

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = [f"k{i}" for i in range(10)]


@dataclass(eq=False)
class Node:
    """A caller's object as a policy links it."""

    key: str
    size: int
    prev: object = None
    next: object = None
    mark: int = 0


def size_of(node: Node) -> int:
    return node.size


OP_NAMES = ["insert", "insert", "touch", "touch", "remove", "hold", "unhold", "victim", "victim"]
ops_st = st.lists(st.tuples(st.sampled_from(OP_NAMES), st.integers(0, len(NAMES) - 1), st.integers(1, 40)),
                  max_size=120)


class Model:
    """The caller's side: which keys are listed, held or absent, and what it asked for."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.held: set[str] = set()

    def listed(self) -> dict[str, Node]:
        return {k: n for k, n in self.nodes.items() if k not in self.held}


def apply(policy: EvictionPolicy, model: Model, op: str, key: str, size: int) -> Node | None:
    """One operation, as a caller may make it (inserts only of absent keys, holds only of live
    ones); returns the victim for ``victim``."""
    node = model.nodes.get(key)
    if op == "insert" and node is None:
        node = model.nodes[key] = Node(key, size)
        policy.insert(node)
    elif op == "touch" and node is not None:
        policy.touch(node)
    elif op == "remove" and node is not None:
        policy.remove(node)
        del model.nodes[key]
        model.held.discard(key)
    elif op == "hold" and node is not None:
        policy.hold(node)  # also of a held node: a no-op
        model.held.add(key)
    elif op == "unhold" and node is not None:
        policy.unhold(node)  # also of a listed node: a no-op
        model.held.discard(key)
    elif op == "victim":
        got = policy.victim()
        if got is None:
            assert not model.listed(), "nothing evicted while something was evictable"
            return None
        assert model.nodes.get(got.key) is got and got.key not in model.held, "a victim not listed"
        assert got.prev is None and got.next is None
        del model.nodes[got.key]
        return got
    return None


def check_totals(policy: EvictionPolicy, model: Model) -> list[str]:
    order = [n.key for n in policy]
    listed = model.listed()
    assert sorted(order) == sorted(listed), (order, listed)
    assert policy.count == len(listed)
    assert policy.bytes == sum(n.size for n in listed.values())
    for key, node in model.nodes.items():
        assert (node in policy) == (key in listed)
    return order


@SETTINGS
@given(ops=ops_st, name=st.sampled_from(["lru", "fifo", "none"]))
def test_list_policies_match_a_reference_list(ops, name: str) -> None:
    """lru (and fifo, none: lru whose touches move nothing) against a plain list, oldest first:
    insert and unhold append, a touch of a listed key moves it to the end (lru only), a touch
    of a held key moves nothing, hold and remove take it out, victim pops the front."""
    policy = make_policy(name, 1000, size_of, names=DISK_POLICIES)
    moves = name == "lru"
    model, ref, victims = Model(), [], 0
    for op, index, size in ops:
        key = NAMES[index]
        absent = key not in model.nodes
        before_listed = key in model.listed()
        before_held = key in model.held
        victim = apply(policy, model, op, key, size)
        if op == "insert" and absent:
            ref.append(key)
        elif op == "touch" and moves and before_listed:
            ref.remove(key)
            ref.append(key)
        elif op in ("remove", "hold") and before_listed:
            ref.remove(key)
        elif op == "unhold" and before_held:
            ref.append(key)
        elif op == "victim" and victim is not None:
            assert victim.key == ref.pop(0)
            victims += 1
        assert check_totals(policy, model) == ref
    assert policy.steps == victims  # one step per victim: held nodes are never met


@SETTINGS
@given(ops=ops_st, capacity=st.integers(20, 400))
def test_s3fifo_invariants(ops, capacity: int) -> None:
    policy = S3Fifo(capacity, size_of)
    model = Model()
    gone: set[str] = set()
    for op, index, size in ops:
        key = NAMES[index]
        victim = apply(policy, model, op, key, size)
        if victim is not None:
            gone.add(victim.key)
        check_totals(policy, model)
        # The small queue's running total is its nodes' sizes; each node is in one queue.
        small = [n for n in policy if not policy.in_main(n)]
        assert policy._small_bytes == sum(n.size for n in small)
        assert len({id(n) for n in policy}) == policy.count
        ghost = policy.ghost()
        assert sum(ghost.values()) == policy._ghost_bytes <= (1 - S3Fifo.small_share) * capacity
        assert not set(ghost) & set(model.nodes), "a live key is still a ghost"
        assert set(ghost) <= gone, "the ghost remembers only evicted keys"
        for node in model.nodes.values():
            assert 0 <= node.mark & 3 <= 3


def fill(policy: EvictionPolicy, nodes: dict[str, Node], key: str, size: int = 10) -> list[str]:
    """Insert ``key`` into a cache of ``policy.capacity`` bytes, evicting until it fits."""
    evicted = []
    while policy.bytes + size > policy.capacity:
        victim = policy.victim()
        assert victim is not None
        evicted.append(victim.key)
        del nodes[victim.key]
    nodes[key] = Node(key, size)
    policy.insert(nodes[key])
    return evicted


def test_s3fifo_moves_a_key_touched_in_the_small_queue_to_main() -> None:
    policy, nodes = S3Fifo(100, size_of), {}
    for i in range(10):
        fill(policy, nodes, f"a{i}")
    policy.touch(nodes["a0"])
    # The cache is full and a0 is the small queue's head: touched, it moves instead of going.
    assert fill(policy, nodes, "b0") == ["a1"]
    assert policy.in_main(nodes["a0"]) and not policy.in_main(nodes["a2"])
    assert "a1" in policy.ghost()
    # Asked for again while remembered, a1 goes straight to main.
    fill(policy, nodes, "a1")
    assert policy.in_main(nodes["a1"]) and "a1" not in policy.ghost()


def test_s3fifo_main_queue_gives_used_objects_another_lap() -> None:
    policy = S3Fifo(1000, size_of)
    nodes = {key: Node(key, 10) for key in ("m0", "m1", "x")}
    for node in nodes.values():
        policy.insert(node)
    policy.touch(nodes["m0"]), policy.touch(nodes["m1"])
    # Main is empty, so the small queue gives: m0 and m1 were used and move; x goes.
    assert policy.victim() is nodes["x"] and policy.steps == 3
    assert policy.in_main(nodes["m0"]) and policy.in_main(nodes["m1"])
    policy.touch(nodes["m0"])
    assert policy.victim() is nodes["m1"]  # m0 was used since it moved: it goes round once more
    assert policy.victim() is nodes["m0"]
    assert policy.victim() is None and policy.count == policy.bytes == 0


def test_s3fifo_a_held_node_returns_to_the_queue_it_left() -> None:
    policy, nodes = S3Fifo(100, size_of), {}
    for i in range(3):
        fill(policy, nodes, f"k{i}")
    policy.hold(nodes["k0"])
    policy.touch(nodes["k0"])
    assert nodes["k0"] not in policy and policy.count == 2 and policy.bytes == 20
    policy.unhold(nodes["k0"])
    assert [n.key for n in policy] == ["k1", "k2", "k0"] and nodes["k0"].mark == 1


def scan(name: str, capacity_objects: int, hot: int, scan_objects: int) -> set[str]:
    """A hot working set used twice, then a one-pass scan of new keys: which hot keys survive."""
    policy, nodes = POLICIES[name](capacity_objects * 10, size_of), {}
    for i in range(hot):
        fill(policy, nodes, f"hot{i}")
        policy.touch(nodes[f"hot{i}"])
    for i in range(scan_objects):
        fill(policy, nodes, f"scan{i}")
    return {k for k in nodes if k.startswith("hot")}


@pytest.mark.parametrize("hot", [1, 20, 60, 85])
def test_s3fifo_is_scan_resistant_where_lru_is_not(hot: int) -> None:
    # The hot set fits in main (90% of the cache); the scan is five caches long.
    assert scan("s3fifo", 100, hot, 500) == {f"hot{i}" for i in range(hot)}
    assert scan("lru", 100, hot, 500) == set()


@SETTINGS
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "read", "discard", "evict", "quota"]),
                              st.integers(0, len(NAMES) - 1), st.integers(1, 60)), max_size=80),
       name=st.sampled_from(DISK_POLICIES))
def test_quota_index_accounts_exactly_under_every_policy(ops, name: str) -> None:
    q = QuotaIndex(150, name)
    stored: dict[str, int] = {}
    for op, index, size in ops:
        key = NAMES[index]
        if op == "put" and not q.has(key):
            fits, victims = q.reserve(key, size)
            assert not set(victims) & {key}
            for v in victims:
                del stored[v]
            if fits:
                q.settle(key)
                stored[key] = size
            else:
                assert name == "none" or sum(stored.values()) + size > q.quota_bytes
                assert name != "none" or victims == []
        elif op == "read":
            q.touch(key)
        elif op == "discard":
            assert q.discard(key) == (stored.pop(key, None) is not None)
        elif op == "evict":
            for v in q.evict(size):
                del stored[v]
        elif op == "quota":
            q.quota_bytes = 100 + size  # as the SSD tier lowers and regrows it
            for v in q.evict(max(0, q.used - q.quota_bytes)):
                del stored[v]
        assert dict(q.items()) == stored and sorted(q.keys()) == sorted(stored)
        assert q.used == sum(stored.values()) <= max(q.quota_bytes, 150)


def test_policy_names_are_one_list() -> None:
    assert MEMORY_POLICIES == ("lru", "s3fifo")
    assert DISK_POLICIES == ("fifo", "lru", "none", "s3fifo")
    assert {Lru, S3Fifo, Fifo, NoEviction} == set(POLICIES.values())
    assert not NoEviction.makes_room and all(POLICIES[n].makes_room for n in ("fifo", "lru", "s3fifo"))
    with pytest.raises(ConfigError, match="eviction_policy"):
        make_policy("fifo", 10, size_of)  # SSD only
    with pytest.raises(ConfigError, match="eviction_policy"):
        EngineConfig(memory_size=1 << 20, eviction_policy="lfu").validate()  # type: ignore[arg-type]


# ---- through the engine -------------------------------------------------------------------------

SLOT = 64


def engine_scan(policy: str, hot: int = 20, slots: int = 100, scan_objects: int = 300) -> set[str]:
    """A pool of ``slots`` objects that evicts one at a time when full: ``hot`` prefixes are
    stored and read back (acquire + release, as a load does), then ``scan_objects`` one-off
    blocks are stored. Which hot prefixes are still in memory."""
    engine = PoolEngine(EngineConfig(memory_size=slots * SLOT, reap_interval_s=0, eviction_policy=policy,
                                     eviction_high_watermark_ratio=1.0, eviction_ratio=0.001),
                        clock=FakeClock())
    try:
        hot_keys = [f"hot{i}" for i in range(hot)]
        for key in hot_keys:
            assert engine.put("w", key, [payload(key, SLOT)]) is ErrorCode.OK
        for key in hot_keys:
            lease = engine.acquire("r", key)
            assert isinstance(lease, Lease)
            engine.release(lease)
        for i in range(scan_objects):
            assert engine.put("w", f"scan{i}", [payload(f"scan{i}", SLOT)]) is ErrorCode.OK
        stats = engine.stats()
        assert stats["evictions"] == hot + scan_objects - slots and stats["object_count"] == slots
        engine._debug_check_evictable()
        return {k for k, found in zip(hot_keys, engine.exists(hot_keys)) if found}
    finally:
        engine.close()


def test_engine_s3fifo_keeps_the_hot_set_through_a_scan_that_lru_flushes() -> None:
    assert engine_scan("lru") == set()
    assert engine_scan("s3fifo") == {f"hot{i}" for i in range(20)}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=sizes_st, ops=engine_ops)
def test_engine_invariants_under_s3fifo(sizes, ops) -> None:
    """test_properties' engine invariants (leased objects never evicted, bytes intact, the
    policy listing exactly the unheld objects with exact totals) with s3fifo."""
    clock = FakeClock()
    engine = PoolEngine(EngineConfig(memory_size=MEMORY, default_kv_lease_ttl_ms=1000, reap_interval_s=0,
                                     eviction_policy="s3fifo"), clock=clock)
    try:
        run_engine_ops(engine, clock, dict(zip(KEYS, sizes)), ops, set())
    finally:
        engine.close()
