"""PoolEngine at scale: eviction costs nothing per held object, batch calls lock once, and the
per-client index drops a client's allocations without walking everyone's."""

from __future__ import annotations

import threading

import numpy as np
from store_helpers import FakeClock, payload

from kvpool.errors import ErrorCode
from kvpool.store import Allocation, EngineConfig, Lease, PoolEngine

SLOT = 64


def make(clock: FakeClock, slots: int, **kwargs) -> PoolEngine:
    kwargs.setdefault("eviction_high_watermark_ratio", 1.0)
    return PoolEngine(EngineConfig(memory_size=slots * SLOT, reap_interval_s=0, **kwargs), clock=clock)


def evict_steps_with_held(held: int, puts: int = 200) -> tuple[int, int]:
    """(eviction steps, evictions) for ``puts`` puts into a full pool whose ``held`` oldest
    objects are leased: the held ones sit at the LRU head, where a scan would meet them first."""
    engine = make(FakeClock(), held + 300, eviction_ratio=0.001)
    try:
        for i in range(held + 300):
            assert engine.put("w", f"k{i}", [payload(f"k{i}", SLOT)]) is ErrorCode.OK
        leases = [engine.acquire("r", f"k{i}") for i in range(held)]
        assert all(isinstance(lease, Lease) for lease in leases)
        before = engine.stats()
        for i in range(puts):
            assert engine.put("w", f"new{i}", [payload(f"new{i}", SLOT)]) is ErrorCode.OK
        after = engine.stats()
        assert all(engine.validate(lease) is ErrorCode.OK for lease in leases)  # none evicted
        engine._debug_check_evictable()
        return after["evict_steps"] - before["evict_steps"], after["evictions"] - before["evictions"]
    finally:
        engine.close()


def test_eviction_never_looks_at_held_objects() -> None:
    for held in (10, 2000):
        steps, evictions = evict_steps_with_held(held)
        # One step per victim, whatever is held (a batch of ceil(0.001 * objects) may overshoot).
        assert steps == evictions and 200 <= evictions <= 203, (held, steps, evictions)


def test_eviction_work_grows_linearly_with_puts() -> None:
    small, large = (evict_steps_with_held(500, puts)[0] for puts in (100, 400))
    assert 100 <= small <= 101 and 400 <= large <= 401


def test_evictable_index_follows_holds_and_releases() -> None:
    clock = FakeClock()
    engine = make(clock, 64, default_kv_lease_ttl_ms=1000)
    try:
        engine._debug_track_lru()
        for key in ("a", "b", "c", "d"):
            assert engine.put("w", key, [payload(key, SLOT)]) is ErrorCode.OK
        lease = engine.acquire("r", "b")
        assert isinstance(lease, Lease)
        assert engine._debug_check_evictable() == ["a", "c", "d"]
        assert engine.exists(["a"], "scheduler", lease=True) == [True]  # a lookup lease pins too
        assert engine._debug_check_evictable() == ["c", "d"]
        engine.release(lease)
        assert engine._debug_check_evictable() == ["c", "d", "b"]  # back, as just used
        clock.advance(1.5)
        engine.reap()  # the lookup lease expired
        assert engine._debug_check_evictable() == ["c", "d", "b", "a"]
        stats = engine.stats()
        assert stats["evictable_objects"] == 4 and stats["evictable_bytes"] == 4 * SLOT
        assert engine.remove("d") is ErrorCode.OK
        assert engine._debug_check_evictable() == ["c", "b", "a"]
    finally:
        engine.close()


class CountingLock:
    """Stands in for the engine lock, counting acquisitions."""

    def __init__(self, inner: threading.Lock) -> None:
        self.inner, self.count = inner, 0

    def __enter__(self) -> CountingLock:
        self.inner.acquire()
        self.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


def lock_counts(n: int) -> dict[str, int]:
    engine = make(FakeClock(), 4 * n + 16)
    lock = CountingLock(engine._lock)
    engine._lock = lock  # type: ignore[assignment]
    counts: dict[str, int] = {}

    def count(name: str, call) -> object:
        before = lock.count
        out = call()
        counts[name] = lock.count - before
        return out

    try:
        keys = [f"k{i}" for i in range(n)]
        count("batch_put", lambda: engine.batch_put("w", keys, [[payload(k, SLOT)] for k in keys]))
        count("batch_exists", lambda: engine.batch_exists(keys, "r", lease=True))
        outs = [[np.zeros(SLOT, np.uint8)] for _ in keys]
        count("batch_get_into", lambda: engine.batch_get_into("r", keys, outs))
        more = [f"m{i}" for i in range(n)]
        allocs = count("batch_allocate", lambda: engine.batch_allocate("w", more, [SLOT] * n))
        handles = [a.handle for a in allocs if isinstance(a, Allocation)]  # type: ignore[union-attr]
        count("batch_commit", lambda: engine.batch_commit(handles))
        leases = count("batch_acquire", lambda: engine.batch_acquire("r", more))
        codes = count("batch_release", lambda: engine.batch_release(leases))  # type: ignore[arg-type]
        assert codes == [ErrorCode.OK] * n
        assert all(np.array_equal(o[0], payload(k, SLOT)) for k, o in zip(keys, outs))
        return counts
    finally:
        engine.close()


def test_batch_calls_take_the_engine_lock_a_fixed_number_of_times() -> None:
    one, many = lock_counts(1), lock_counts(64)
    assert one == many, (one, many)  # not per key
    assert all(v <= 3 for v in many.values()), many


def test_forgetting_a_client_drops_only_its_allocations() -> None:
    engine = make(FakeClock(), 4096)
    try:
        for client in ("a", "b", "c"):
            for i in range(100):
                assert isinstance(engine.allocate(client, f"{client}{i}", SLOT), Allocation)
        report = engine.forget_client("b")
        assert report.allocations == 100
        assert engine.stats()["pending_allocations"] == 200
        engine._debug_check_evictable()
    finally:
        engine.close()
