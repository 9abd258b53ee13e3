"""PoolEngine additions for the server: forget_client (a connection closed) and coalesced lookup leases."""

from __future__ import annotations

import numpy as np

from kvpool.errors import ErrorCode
from kvpool.store import Allocation, EngineConfig, Lease, PoolEngine


def test_forget_client_drops_its_puts_and_leases_only():
    engine = PoolEngine(EngineConfig(memory_size=4096, reap_interval_s=0))
    try:
        assert engine.put("other", "kept", [np.ones(100, np.uint8)]) is ErrorCode.OK
        alloc = engine.allocate("dead", "half", 1000)
        assert isinstance(alloc, Allocation)
        mine = engine.acquire("dead", "kept")
        theirs = engine.acquire("other", "kept")
        assert isinstance(mine, Lease) and isinstance(theirs, Lease)
        used = engine.stats()["memory_used"]

        report = engine.forget_client("dead")
        assert (report.clients, report.leases, report.allocations) == (1, 1, 1)
        assert engine.stats()["memory_used"] < used  # the half-written range is free again
        assert engine.commit(alloc.handle) is ErrorCode.OBJECT_NOT_FOUND
        assert engine.exists(["half"]) == [False]
        assert engine.validate(mine) is ErrorCode.LEASE_EXPIRED
        assert engine.validate(theirs) is ErrorCode.OK  # another client's lease is untouched
        assert engine.remove("kept") is ErrorCode.OBJECT_HAS_LEASE
        assert engine.forget_client("dead").clients == 0  # idempotent
    finally:
        engine.close()


def test_repeated_lookups_extend_one_lease_per_client():
    now = [1000.0]
    engine = PoolEngine(EngineConfig(memory_size=4096, reap_interval_s=0, default_kv_lease_ttl_ms=1000),
                        clock=lambda: now[0])
    try:
        assert engine.put("w", "hot", [np.ones(64, np.uint8)]) is ErrorCode.OK
        for _ in range(500):  # a hot prefix, looked up over and over within one TTL
            assert engine.exists(["hot"], "scheduler-a", lease=True) == [True]
        engine.exists(["hot"], "scheduler-b", lease=True)
        leases = engine._debug_snapshot()["objects"]["hot"].leases
        assert sorted(c for c, _ in leases.values()) == ["scheduler-a", "scheduler-b"]
        now[0] += 0.9
        engine.exists(["hot"], "scheduler-a", lease=True)  # extends a's lease to 1000.9 + 1
        now[0] += 0.5  # b's lease has expired, a's has not
        assert engine.remove("hot") is ErrorCode.OBJECT_HAS_LEASE
        now[0] += 0.6
        assert engine.remove("hot") is ErrorCode.OK
    finally:
        engine.close()
