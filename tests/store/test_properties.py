"""Property-based tests: allocator and engine invariants under random operation sequences."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from store_helpers import FakeClock, payload
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpool.errors import ErrorCode
from kvpool.store import Allocation, DiskTier, EngineConfig, Lease, OffsetAllocator, PoolEngine

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- allocator ------------------------------------------------------------------

alloc_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 300)),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
    ),
    max_size=120,
)


def check_allocator(alloc: OffsetAllocator, live: dict[int, int]) -> None:
    ranges = alloc.live_ranges()
    assert ranges == sorted(live.items())
    end = 0
    for offset, length in ranges:
        assert offset >= end, "live ranges overlap"
        assert offset % alloc.alignment == 0
        end = offset + length
    assert end <= alloc.capacity
    assert alloc.used == sum(live.values())
    free = alloc.free_ranges()
    for (a, la), (b, _) in zip(free, free[1:]):
        assert a + la < b, "free ranges overlap or touch (missed coalescing)"
    assert alloc.used + sum(length for _, length in free) == alloc.capacity


@SETTINGS
@given(capacity=st.integers(0, 4096), alignment=st.sampled_from([1, 8, 64]), ops=alloc_ops)
def test_allocator_never_overlaps_and_coalesces_fully(capacity: int, alignment: int, ops) -> None:
    alloc = OffsetAllocator(capacity, alignment)
    live: dict[int, int] = {}
    for op, arg in ops:
        if op == "alloc":
            offset = alloc.allocate(arg)
            if offset is None:
                assert alloc.largest_free() < alloc.reserved_size(arg)
            else:
                assert offset not in live
                live[offset] = alloc.reserved_size(arg)
        elif live:
            offset = sorted(live)[arg % len(live)]
            alloc.free(offset)
            del live[offset]
        check_allocator(alloc, live)
    for offset in list(live):
        alloc.free(offset)
        del live[offset]
    check_allocator(alloc, live)
    assert alloc.free_ranges() == ([(0, alloc.capacity)] if alloc.capacity else [])


# ---- engine -----------------------------------------------------------------------

KEYS = [f"key{i}" for i in range(12)]
# Puts and reads are over-represented and the arena (1024 bytes) is small next to
# 12 keys of up to 400 bytes, so most sequences reach the watermark and evict.
OPS = ["put"] * 4 + ["get"] * 3 + ["hold", "release", "remove", "alloc", "commit", "abort", "tick", "reap",
                                     "lookup"]
engine_ops = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, len(KEYS) - 1)), min_size=10, max_size=80
)
sizes_st = st.lists(st.integers(0, 400), min_size=len(KEYS), max_size=len(KEYS))
MEMORY = 1024


def check_engine(engine: PoolEngine, sizes: dict[str, int], held: list[Lease], clock: FakeClock) -> None:
    snap = engine._debug_snapshot()
    assert snap["used"] <= snap["capacity"]
    # The evictable list is exactly the committed objects nobody pins, least recently used first
    # (checked under the engine lock: the disk writer pins and unpins concurrently).
    engine._debug_check_evictable()
    end = 0
    for offset, length in snap["live_ranges"]:
        assert offset >= end, "live ranges overlap"
        end = offset + length
    owners = [(o.offset, o.size) for o in snap["objects"].values()] + [
        (p.offset, p.size) for p in snap["pending"].values()
    ]
    assert snap["used"] == sum(engine.reserved_size(size) for _, size in owners)
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    for key, obj in snap["objects"].items():
        # Every committed object's bytes are exactly what was put: nothing overwrote them.
        assert np.array_equal(arena[obj.offset : obj.offset + obj.size], payload(key, sizes[key]))
    for lease in held:
        if lease.data is not None:
            # A disk-served lease (no room to promote, or a put of the key pending)
            # owns its bytes and names no arena object; it only has to stay valid.
            assert lease.offset == -1 and lease.generation == 0
            assert np.array_equal(np.frombuffer(lease.data, np.uint8), payload(lease.key, sizes[lease.key]))
            if clock.now <= lease.expires_at:
                assert engine.validate(lease) is ErrorCode.OK
        elif clock.now <= lease.expires_at:
            obj = snap["objects"].get(lease.key)
            assert obj is not None and obj.generation == lease.generation, "leased object was evicted"
            assert engine.validate(lease) is ErrorCode.OK


def run_engine_ops(engine: PoolEngine, clock: FakeClock, sizes: dict[str, int], ops, stored: set[str]) -> None:
    engine._debug_track_lru()
    looked_up: dict[str, float] = {}
    held: list[Lease] = []
    pending: list[Allocation] = []
    for op, index in ops:
        key = list(sizes)[index]
        if op == "put":
            rc = engine.put("c", key, [payload(key, sizes[key])])
            assert rc in (ErrorCode.OK, ErrorCode.NO_AVAILABLE_HANDLE)
            if rc is ErrorCode.OK and all(a.key != key for a in pending):
                stored.add(key)
        elif op == "get":
            out = np.zeros(sizes[key], np.uint8)
            rc = engine.get_into("c", key, [out])
            if rc is ErrorCode.OK:
                assert np.array_equal(out, payload(key, sizes[key]))
            else:
                assert rc is ErrorCode.OBJECT_NOT_FOUND
        elif op == "hold":
            lease = engine.acquire("c", key)
            if isinstance(lease, Lease):
                held.append(lease)
        elif op == "release" and held:
            engine.release(held.pop(index % len(held)))
        elif op == "remove":
            rc = engine.remove(key)
            if rc is ErrorCode.OK:
                stored.discard(key)
            assert rc in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_HAS_LEASE)
            if rc is ErrorCode.OBJECT_HAS_LEASE:
                assert any(l.key == key and clock.now <= l.expires_at for l in held) \
                    or looked_up.get(key, -1.0) >= clock.now
        elif op == "alloc":
            result = engine.allocate("c", key, sizes[key])
            if isinstance(result, Allocation):
                engine.arena[result.offset : result.offset + result.size] = payload(key, sizes[key]).tobytes()
                pending.append(result)
        elif op in ("commit", "abort") and pending:
            alloc = pending.pop(index % len(pending))
            rc = engine.commit(alloc.handle) if op == "commit" else engine.abort(alloc.handle)
            assert rc is ErrorCode.OK
            if op == "commit":
                stored.add(alloc.key)
        elif op == "tick":
            clock.advance(0.4)
            engine.ping("c")
        elif op == "reap":
            engine.reap()
        elif op == "lookup":
            pair = [key, list(sizes)[(index + 1) % len(sizes)]]
            for k, found in zip(pair, engine.exists(pair, "scheduler", lease=True)):
                if found:
                    looked_up[k] = clock.now + 1.0  # a lookup lease of default_kv_lease_ttl_ms
        check_engine(engine, sizes, held, clock)
    for alloc in pending:
        engine.abort(alloc.handle)


@SETTINGS
@given(sizes=sizes_st, ops=engine_ops)
def test_engine_invariants_under_random_ops(sizes, ops) -> None:
    clock = FakeClock()
    engine = PoolEngine(
        EngineConfig(memory_size=MEMORY, default_kv_lease_ttl_ms=1000, reap_interval_s=0), clock=clock
    )
    try:
        run_engine_ops(engine, clock, dict(zip(KEYS, sizes)), ops, set())
    finally:
        engine.close()


# Keys of two tenants with budgets (a third, "c", has none) and of requests without a salt.
TENANT_KEYS = [f"m~{t * 12}@key{i}" for i, t in enumerate("aaaabbbbcc")] + ["key10", "key11"]


@SETTINGS
@given(sizes=sizes_st, ops=engine_ops)
def test_tenant_budgets_hold_under_random_ops(sizes, ops) -> None:
    """The invariants above, and each budgeted tenant's charge within its budget (`check_evictable`)."""
    clock = FakeClock()
    engine = PoolEngine(EngineConfig(memory_size=MEMORY, default_kv_lease_ttl_ms=1000, reap_interval_s=0,
                                     tenant_budgets={"a" * 12: MEMORY // 3, "b" * 12: MEMORY // 4}), clock=clock)
    try:
        run_engine_ops(engine, clock, dict(zip(TENANT_KEYS, sizes)), ops, set())
    finally:
        engine.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=sizes_st, ops=engine_ops, write_through=st.booleans())
@example(  # a hold while a re-put of a disk-only key is pending gets a disk-served lease
    sizes=[0, 193, 0, 0, 0, 129, 0, 0, 0, 0, 0, 385],
    ops=[("put", 0)] * 4 + [("put", 5), ("put", 1), ("put", 11), ("put", 0), ("alloc", 5), ("hold", 5)],
    write_through=False,
)
def test_with_disk_tier_nothing_stored_is_ever_lost(sizes, ops, write_through: bool) -> None:
    """With a roomy disk tier, every stored and not removed key stays readable, bytes intact."""
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.realpath(tmp)
        disk = DiskTier(path, 1 << 22, "none")
        engine = PoolEngine(
            EngineConfig(
                memory_size=MEMORY, default_kv_lease_ttl_ms=1000, reap_interval_s=0,
                disk=disk, disk_write_through=write_through,
            ),
            clock=clock,
        )
        size_of = dict(zip(KEYS, sizes))
        stored: set[str] = set()
        try:
            run_engine_ops(engine, clock, size_of, ops, stored)
            assert engine.exists(sorted(stored)) == [True] * len(stored)
            for key in stored:
                out = np.zeros(size_of[key], np.uint8)
                assert engine.get_into("c", key, [out]) is ErrorCode.OK
                assert np.array_equal(out, payload(key, size_of[key]))
        finally:
            engine.close()
        restarted = PoolEngine(
            EngineConfig(memory_size=MEMORY, reap_interval_s=0, disk=DiskTier(path, 1 << 22, "none")), clock=clock
        )
        try:
            if write_through:
                assert restarted.exists(sorted(stored)) == [True] * len(stored)
        finally:
            restarted.close()
