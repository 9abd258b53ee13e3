"""PoolEngine: two-phase put, leases, eviction, clients, SSD tier, restart."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading

import numpy as np
import pytest
from store_helpers import payload

from kvpool.errors import ConfigError, ErrorCode
from kvpool.store import Allocation, DiskTier, EngineConfig, Lease, LookupLease, PoolEngine
from kvpool.store.records import Presence

C = "client-a"


def read(engine: PoolEngine, key: str, size: int) -> np.ndarray | ErrorCode:
    out = np.zeros(size, dtype=np.uint8)
    rc = engine.get_into(C, key, [out])
    return out if rc is ErrorCode.OK else rc


def in_memory(engine: PoolEngine) -> set[str]:
    return set(engine._debug_snapshot()["objects"])


# ---- basics -------------------------------------------------------------------


def test_put_get_roundtrip_across_buffers(make_engine) -> None:
    engine = make_engine()
    data = payload("k", 300)
    assert engine.put(C, "k", [data[:100], memoryview(data[100:250]), data[250:].tobytes()]) is ErrorCode.OK
    a, b = np.zeros(120, np.uint8), np.zeros(180, np.uint8)
    assert engine.get_into(C, "k", [a, b]) is ErrorCode.OK
    assert np.array_equal(np.concatenate([a, b]), data)
    assert engine.exists(["k", "nope"]) == [True, False]


def test_duplicate_put_is_a_noop_and_keeps_the_first_bytes(make_engine) -> None:
    engine = make_engine()
    assert engine.put(C, "k", [payload("k", 64)]) is ErrorCode.OK
    used = engine.stats()["memory_used"]
    assert engine.put(C, "k", [np.ones(64, np.uint8)]) is ErrorCode.OK
    assert engine.allocate(C, "k", 64) is ErrorCode.OBJECT_ALREADY_EXISTS
    assert engine.stats()["memory_used"] == used
    assert np.array_equal(read(engine, "k", 64), payload("k", 64))


def test_empty_value(make_engine) -> None:
    engine = make_engine()
    assert engine.put(C, "empty", []) is ErrorCode.OK
    assert engine.put(C, "empty2", [np.zeros(0, np.uint8)]) is ErrorCode.OK
    assert engine.get_into(C, "empty", []) is ErrorCode.OK
    assert engine.exists(["empty", "empty2"]) == [True, True]
    assert engine.stats()["memory_used"] == 2 * 64  # one alignment unit each


def test_value_larger_than_capacity_fails_and_evicts_nothing(make_engine) -> None:
    engine = make_engine(memory_size=1024)
    fill(engine, 14)
    assert engine.put(C, "huge", [np.zeros(2048, np.uint8)]) is ErrorCode.NO_AVAILABLE_HANDLE
    assert engine.allocate(C, "huge", 1025) is ErrorCode.NO_AVAILABLE_HANDLE
    assert in_memory(engine) == {f"k{i}" for i in range(14)}
    assert engine.stats()["evictions"] == 0


def test_invalid_arguments(make_engine) -> None:
    engine = make_engine()
    assert engine.allocate(C, "", 10) is ErrorCode.INVALID_KEY
    assert engine.allocate(C, "k", -1) is ErrorCode.INVALID_PARAMS
    assert engine.acquire(C, "") is ErrorCode.INVALID_KEY
    engine.put(C, "k", [payload("k", 100)])
    assert engine.get_into(C, "k", [np.zeros(99, np.uint8)]) is ErrorCode.INVALID_PARAMS
    assert engine.get_into(C, "k", [np.zeros(100, np.uint8)[::2]]) is ErrorCode.INVALID_PARAMS
    assert engine.get_into(C, "k", [b"\0" * 100]) is ErrorCode.INVALID_PARAMS  # read-only
    assert engine.get_into(C, "missing", [np.zeros(1, np.uint8)]) is ErrorCode.OBJECT_NOT_FOUND
    assert engine.commit(12345) is ErrorCode.OBJECT_NOT_FOUND
    assert engine.abort(12345) is ErrorCode.OBJECT_NOT_FOUND
    assert engine.ping("") is ErrorCode.INVALID_PARAMS


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_size", 0),
        ("eviction_high_watermark_ratio", 1.5),
        ("eviction_ratio", 0),
        ("default_kv_lease_ttl_ms", -5),
        ("client_ttl_s", 0),
        ("alignment", 0),
        ("reap_interval_s", -1),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    kwargs = {"memory_size": 1024, field: value}
    with pytest.raises(ConfigError) as exc:
        PoolEngine(EngineConfig(**kwargs))
    assert exc.value.value == value


def test_external_arena_is_used_in_place(clock) -> None:
    backing = bytearray(2048)
    engine = PoolEngine(EngineConfig(memory_size=1024, reap_interval_s=0), arena=memoryview(backing), clock=clock)
    alloc = engine.allocate(C, "k", 4)
    assert isinstance(alloc, Allocation)
    backing[alloc.offset : alloc.offset + 4] = b"abcd"  # a shm client writes by offset
    assert engine.commit(alloc.handle) is ErrorCode.OK
    assert bytes(read(engine, "k", 4)) == b"abcd"
    engine.close()
    with pytest.raises(ConfigError):
        PoolEngine(EngineConfig(memory_size=4096, reap_interval_s=0), arena=memoryview(backing))
    with pytest.raises(ConfigError):
        PoolEngine(EngineConfig(memory_size=1024, reap_interval_s=0), arena=memoryview(bytes(2048)))


def test_own_arena_is_a_private_mapping_of_plain_pages(clock) -> None:
    """The engine's own arena is an anonymous private mapping (zeroed, mapped lazily), not a
    numpy allocation, which numpy would advise for huge pages (first writes then wait for the
    kernel's compaction where THP defrag is `madvise`)."""
    engine = PoolEngine(EngineConfig(memory_size=8 << 20, reap_interval_s=0), clock=clock)
    arena = engine._index.arena
    assert isinstance(arena.base.obj, mmap.mmap) and arena.size == 8 << 20 and arena.flags.writeable
    assert not arena[:: 1 << 16].any()
    assert engine.put(C, "k", [np.full(4096, 7, dtype=np.uint8)]) is ErrorCode.OK
    assert bytes(read(engine, "k", 4096)) == bytes([7]) * 4096
    engine.close()


# ---- two-phase put --------------------------------------------------------------


def test_uncommitted_objects_are_invisible(make_engine) -> None:
    engine = make_engine()
    alloc = engine.allocate(C, "k", 10)
    assert isinstance(alloc, Allocation)
    assert engine.exists(["k"]) == [False]
    assert engine.acquire(C, "k") is ErrorCode.OBJECT_NOT_FOUND
    assert engine.allocate("client-b", "k", 10) is ErrorCode.OBJECT_ALREADY_EXISTS
    assert engine.put("client-b", "k", [np.zeros(10, np.uint8)]) is ErrorCode.OK  # somebody is writing it
    assert engine.exists(["k"]) == [False]
    assert engine.commit(alloc.handle) is ErrorCode.OK
    assert engine.exists(["k"]) == [True]
    assert engine.commit(alloc.handle) is ErrorCode.OBJECT_NOT_FOUND


def test_abort_gives_space_back(make_engine) -> None:
    engine = make_engine()
    alloc = engine.allocate(C, "k", 500)
    assert engine.stats()["memory_used"] == 512
    assert engine.abort(alloc.handle) is ErrorCode.OK
    assert engine.stats()["memory_used"] == 0
    assert engine.exists(["k"]) == [False]
    assert engine.put(C, "k", [payload("k", 8)]) is ErrorCode.OK


def test_client_killed_mid_put_space_returns_after_reap(make_engine, clock) -> None:
    engine = make_engine(memory_size=1024, client_ttl_s=10.0)
    dead = engine.allocate("dead-client", "k", 900)
    assert isinstance(dead, Allocation)
    assert engine.put(C, "other", [payload("other", 200)]) is ErrorCode.NO_AVAILABLE_HANDLE
    clock.advance(5)
    engine.ping(C)
    assert engine.reap().allocations == 0  # not silent long enough yet
    clock.advance(6)
    engine.ping(C)
    report = engine.reap()
    assert (report.clients, report.allocations) == (1, 1)
    assert engine.stats()["memory_used"] == 0
    assert engine.commit(dead.handle) is ErrorCode.OBJECT_NOT_FOUND  # too late: not stored
    assert engine.exists(["k"]) == [False]
    assert engine.put(C, "other", [payload("other", 200)]) is ErrorCode.OK


def test_put_timeout_reclaims_even_a_pinging_client(make_engine, clock) -> None:
    engine = make_engine(put_timeout_s=30.0, client_ttl_s=10.0)
    alloc = engine.allocate(C, "k", 100)
    for _ in range(4):
        clock.advance(8)
        engine.ping(C)
        engine.reap()
    assert engine.stats()["pending_allocations"] == 0
    assert engine.commit(alloc.handle) is ErrorCode.OBJECT_NOT_FOUND


# ---- leases ---------------------------------------------------------------------


def test_lease_expiry_reports_lease_expired(make_engine, clock) -> None:
    engine = make_engine(default_kv_lease_ttl_ms=5000)
    engine.put(C, "k", [payload("k", 64)])
    lease = engine.acquire(C, "k")
    assert isinstance(lease, Lease)
    assert lease.expires_at == clock.now + 5.0
    assert engine.validate(lease) is ErrorCode.OK
    clock.advance(5.0)
    assert engine.validate(lease) is ErrorCode.OK  # the boundary is still inside
    clock.advance(0.001)
    assert engine.validate(lease) is ErrorCode.LEASE_EXPIRED
    assert engine.stats()["lease_expired"] == 1


def test_replaced_object_invalidates_an_old_lease(make_engine, clock) -> None:
    engine = make_engine()
    engine.put(C, "k", [payload("k", 64)])
    lease = engine.acquire(C, "k")
    assert engine.remove("k") is ErrorCode.OBJECT_HAS_LEASE
    engine.release(lease)
    assert engine.remove("k") is ErrorCode.OK
    engine.put(C, "k", [payload("k", 64)])
    assert engine.validate(lease) is ErrorCode.LEASE_EXPIRED  # same key, new generation
    assert engine.remove("k") is ErrorCode.OK
    assert engine.remove("k") is ErrorCode.OBJECT_NOT_FOUND


def fill(engine: PoolEngine, n: int, size: int = 64) -> None:
    for i in range(n):
        assert engine.put(C, f"k{i}", [payload(f"k{i}", size)]) is ErrorCode.OK


def test_eviction_at_watermark_is_lru_and_exact(make_engine) -> None:
    # 1024 bytes = 16 slots of 64; high watermark 0.9 -> 921.6 bytes = 14 slots.
    engine = make_engine(memory_size=1024, eviction_high_watermark_ratio=0.9, eviction_ratio=0.1)
    fill(engine, 14)
    assert engine.stats()["evictions"] == 0
    for key in ("k0", "k1", "k3"):  # touched: now most recently used
        assert isinstance(read(engine, key, 64), np.ndarray)
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.OK
    # 15th slot would pass 921.6 -> evict ceil(0.1 * 14) = 2 least recently used.
    assert in_memory(engine) == {f"k{i}" for i in range(14)} - {"k2", "k4"} | {"new"}
    assert engine.stats()["evictions"] == 2
    for i in (0, 1, 3, 5, 13):
        assert np.array_equal(read(engine, f"k{i}", 64), payload(f"k{i}", 64))


def test_no_eviction_below_watermark(make_engine) -> None:
    engine = make_engine(memory_size=1024, eviction_high_watermark_ratio=0.9)
    fill(engine, 14)
    assert engine.stats()["memory_used"] == 896
    assert in_memory(engine) == {f"k{i}" for i in range(14)}


def test_eviction_frees_enough_for_a_large_object(make_engine) -> None:
    engine = make_engine(memory_size=1024, eviction_ratio=0.1)
    fill(engine, 14)
    assert engine.put(C, "big", [payload("big", 512)]) is ErrorCode.OK
    # Needed 8 contiguous slots: the oldest 8 go (more than ceil(0.1*14)=2).
    assert in_memory(engine) == {f"k{i}" for i in range(8, 14)} | {"big"}


def test_leased_objects_are_never_evicted(make_engine) -> None:
    engine = make_engine(memory_size=1024)
    fill(engine, 14)
    leases = [engine.acquire(C, f"k{i}") for i in range(4)]  # the 4 oldest, now leased
    for i in range(4):
        engine.put(C, f"extra{i}", [payload(f"extra{i}", 64)])
    assert {f"k{i}" for i in range(4)} <= in_memory(engine)
    for lease in leases:
        assert engine.validate(lease) is ErrorCode.OK


def test_everything_leased_gives_no_available_handle_and_keeps_data(make_engine) -> None:
    engine = make_engine(memory_size=1024, eviction_high_watermark_ratio=1.0)
    fill(engine, 16)
    leases = [engine.acquire(C, f"k{i}") for i in range(16)]
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.NO_AVAILABLE_HANDLE
    assert engine.stats()["evictions"] == 0
    for i in range(16):
        assert np.array_equal(read(engine, f"k{i}", 64), payload(f"k{i}", 64))
    engine.release(leases[5])
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.OK
    assert "k5" not in in_memory(engine)


def test_lookup_lease_protects_until_ttl(make_engine, clock) -> None:
    engine = make_engine(memory_size=1024, eviction_high_watermark_ratio=1.0, default_kv_lease_ttl_ms=1000)
    fill(engine, 16)
    assert engine.exists([f"k{i}" for i in range(16)], client_id=C, lease=True) == [True] * 16
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.NO_AVAILABLE_HANDLE
    clock.advance(1.5)
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.OK


def test_presence_says_pinned_only_for_memory_a_whole_ttl_protects(make_engine, make_disk, clock) -> None:
    # PINNED lets vLLM load a hit where it could not be told of a failure: only an object in
    # memory under a lookup lease that protects it a whole TTL from now qualifies.
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk, disk_write_through=False, default_kv_lease_ttl_ms=1000)
    fill(engine, 14)
    engine.put(C, "new", [payload("new", 64)])  # k0 and k1 spill to disk
    P = Presence
    assert engine.presence(["k0", "k5", "absent", "k5"], C) == [P.STORED, P.PINNED, P.ABSENT, P.PINNED]
    assert engine.exists(["k0", "k5", "absent"], C, lease=True) == [True, True, False]
    # Pinned: nothing evicts it before the TTL, whatever is put meanwhile.
    for i in range(20):
        engine.put(C, f"more{i}", [payload(f"more{i}", 64)])
    assert "k5" in in_memory(engine)


def test_presence_is_stored_not_pinned_past_an_owners_share(clock) -> None:
    engine = PoolEngine(EngineConfig(memory_size=64 * 1024, default_kv_lease_ttl_ms=1000, reap_interval_s=0,
                                     client_ttl_s=1e6, client_pool_share=0.5), clock=clock)
    try:
        keys = [f"k{i}" for i in range(14)]
        for k in keys:
            assert engine.put("w", k, [payload(k, 4 * 1024 - 64)]) is ErrorCode.OK
        found = engine.presence(keys, "reader")
        assert set(found) == {Presence.PINNED, Presence.STORED}  # half of the pool is its share
    finally:
        engine.close()


def test_a_handed_out_lookup_lease_is_extended_checked_and_kept(make_engine, clock) -> None:
    engine = make_engine(memory_size=1024, eviction_high_watermark_ratio=1.0, default_kv_lease_ttl_ms=1000)
    fill(engine, 16)
    keys = [f"k{i}" for i in range(16)]
    first = engine.lookup_leases(keys + ["absent", ""], C)
    assert first[-2:] == [False, False]
    leases = first[:-2]
    assert all(isinstance(x, LookupLease) for x in leases)
    ids = [x.lease_id for x in leases]
    clock.advance(0.6)
    # The same lease, extended: no new one per lookup.
    assert [x.lease_id for x in engine.lookup_leases(keys, C)] == ids
    clock.advance(0.6)  # past the first expiry, within the extended one
    assert engine.check_lookup_leases(C, ids) == [ErrorCode.OK] * 16
    assert engine.check_lookup_leases("client-b", ids[:1]) == [ErrorCode.OBJECT_NOT_FOUND]  # not its lease
    # Checked, not ended: every hit is still protected, nothing can be evicted for a new object.
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.NO_AVAILABLE_HANDLE
    assert engine.stats()["hits"] == 16  # counted at the copies, not at the lookups
    clock.advance(1.5)
    assert engine.check_lookup_leases(C, ids[:1]) in ([ErrorCode.LEASE_EXPIRED], [ErrorCode.OBJECT_NOT_FOUND])
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.OK
    assert engine.check_lookup_leases(C, ids) == [ErrorCode.OBJECT_NOT_FOUND] * 16  # pruned


def test_dead_clients_leases_are_dropped_by_reap(make_engine, clock) -> None:
    engine = make_engine(
        memory_size=1024, eviction_high_watermark_ratio=1.0, client_ttl_s=2.0, default_kv_lease_ttl_ms=60_000
    )
    fill(engine, 16)
    lease = engine.acquire("reader", "k0")
    for i in range(1, 16):
        engine.acquire(C, f"k{i}")
    clock.advance(3)
    engine.ping(C)
    engine.reap()
    assert engine.validate(lease) is ErrorCode.LEASE_EXPIRED
    assert engine.put(C, "new", [payload("new", 64)]) is ErrorCode.OK
    assert "k0" not in in_memory(engine)


def test_batch_calls_and_stats(make_engine) -> None:
    engine = make_engine(memory_size=1024)
    keys = ["a", "b", "huge"]
    values = [[payload("a", 10)], [payload("b", 20)], [np.zeros(4096, np.uint8)]]
    assert engine.batch_put(C, keys, values) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.NO_AVAILABLE_HANDLE]
    assert engine.batch_exists(keys) == [True, True, False]
    outs = [[np.zeros(10, np.uint8)], [np.zeros(20, np.uint8)], [np.zeros(1, np.uint8)]]
    assert engine.batch_get_into(C, keys, outs) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    assert np.array_equal(outs[1][0], payload("b", 20))
    assert engine.batch_put(C, ["x"], []) == [ErrorCode.INVALID_PARAMS]
    stats = engine.stats()
    assert (stats["puts"], stats["gets"], stats["hits"], stats["misses"]) == (2, 2, 2, 1)
    assert (stats["object_count"], stats["memory_used"], stats["memory_capacity"]) == (2, 128, 1024)


def test_concurrent_puts_and_gets_stay_consistent(clock) -> None:
    engine = PoolEngine(EngineConfig(memory_size=64 * 1024, reap_interval_s=0))
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(150):
            key = f"t{t}-{i % 40}"
            data = payload(key, 500)
            engine.put(f"c{t}", key, [data])
            out = np.zeros(500, np.uint8)
            rc = engine.get_into(f"c{t}", key, [out])
            if rc is ErrorCode.OK and not np.array_equal(out, data):
                errors.append(key)
            if rc not in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND):
                errors.append(f"{key}: {rc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    engine.close()
    assert errors == []
    assert engine.stats()["memory_used"] <= engine.capacity


def test_concurrent_reads_promoting_from_disk_stay_exact(make_disk, clock) -> None:
    """Readers that promote from the SSD tier (copying unlocked) beside writers whose puts evict
    and spill: every read returns its key's bytes, and the engine's books balance after."""
    disk = make_disk(1 << 24)
    engine = PoolEngine(EngineConfig(memory_size=16 * 1024, reap_interval_s=0, disk=disk,
                                     disk_write_through=False))
    keys = [f"k{i}" for i in range(60)]  # 60 x 700 B: several times the memory tier
    for key in keys:
        assert engine.put("w", key, [payload(key, 700)]) is ErrorCode.OK
    errors: list[str] = []

    def reader(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(60):
            batch = [keys[i] for i in rng.choice(len(keys), 6, replace=False)]
            outs = [np.zeros(700, np.uint8) for _ in batch]
            for key, out, rc in zip(batch, outs, engine.batch_get_into(f"r{t}", batch, [[o] for o in outs])):
                if rc is not ErrorCode.OK:
                    errors.append(f"{key}: {rc!r}")
                elif not np.array_equal(out, payload(key, 700)):
                    errors.append(f"{key}: wrong bytes")

    def writer() -> None:
        for i in range(120):  # fresh keys: each put evicts, and the evicted spill to disk
            key = f"n{i}"
            if engine.put("w", key, [payload(key, 700)]) is not ErrorCode.OK:
                errors.append(f"put {key}")

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(3)] + [threading.Thread(target=writer)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert engine.stats()["promotions"] > 0
    snap = engine._debug_snapshot()
    assert not snap["pending"] and snap["used"] == sum(engine.reserved_size(o.size) for o in snap["objects"].values())
    engine._debug_check_evictable()
    engine.close()
    for key in keys:
        out = np.zeros(700, np.uint8)
        assert engine.get_into(C, key, [out]) is ErrorCode.OK and np.array_equal(out, payload(key, 700)), key


# ---- SSD tier -------------------------------------------------------------------


def disk_file(disk: DiskTier, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(disk.path, digest[:2], digest)


def test_evicted_objects_spill_to_disk_and_are_promoted_back(make_engine, make_disk) -> None:
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk, disk_write_through=False)
    fill(engine, 14)
    assert disk.count == 0
    engine.put(C, "new", [payload("new", 64)])
    assert sorted(disk.keys()) == ["k0", "k1"]  # ceil(0.1*14) = 2 spilled
    assert engine.exists(["k0", "k1"]) == [True, True]
    assert np.array_equal(read(engine, "k0", 64), payload("k0", 64))
    stats = engine.stats()
    assert (stats["disk_hits"], stats["promotions"]) == (1, 1)
    assert "k0" in in_memory(engine)


def test_a_batch_of_disk_only_keys_is_read_side_by_side_and_each_lease_has_its_own_bytes(
        make_engine, make_disk) -> None:
    # 12 values of 256 bytes through a 1 KiB memory tier: most live only on disk. One batch
    # read gets each its own bytes (promoted, or inline where there was no room), and misses stay
    # misses wherever they fall in the batch.
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    keys = [f"d{i}" for i in range(12)]
    for k in keys:
        assert engine.put(C, k, [payload(k, 256)]) is ErrorCode.OK
    wanted = keys[::-1] + ["absent"]
    results = engine.batch_acquire(C, wanted)
    assert results[-1] is ErrorCode.OBJECT_NOT_FOUND
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    for key, lease in zip(wanted, results[:-1]):
        assert isinstance(lease, Lease), (key, lease)
        got = np.frombuffer(lease.data, np.uint8) if lease.data is not None else arena[lease.offset:lease.offset + 256]
        assert np.array_equal(got, payload(key, 256)), key
    assert engine.stats()["disk_hits"] >= 8


def test_write_through_and_restart_recovery(clock, make_disk, ssd_dir) -> None:
    disk = make_disk()
    engine = PoolEngine(EngineConfig(memory_size=4096, disk=disk, reap_interval_s=0), clock=clock)
    keys = [f"obj{i}" for i in range(20)]
    for i, key in enumerate(keys):
        assert engine.put(C, key, [payload(key, 37 * i)]) is ErrorCode.OK
    engine.close()
    assert sorted(disk.keys()) == sorted(keys)

    restarted = PoolEngine(
        EngineConfig(memory_size=4096, disk=DiskTier(ssd_dir, 1 << 20, "none"), reap_interval_s=0), clock=clock
    )
    assert restarted.exists(keys) == [True] * 20
    for i, key in enumerate(keys):
        assert np.array_equal(read(restarted, key, 37 * i), payload(key, 37 * i))
    restarted.close()


def test_write_through_queue_overflow_is_still_persisted(clock, make_disk) -> None:
    disk = make_disk()
    engine = PoolEngine(
        EngineConfig(memory_size=64 * 1024, disk=disk, disk_queue_size=1, reap_interval_s=0), clock=clock
    )
    for i in range(50):
        engine.put(C, f"k{i}", [payload(f"k{i}", 100)])
    engine.close()
    assert disk.count == 50


@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
def test_corrupt_disk_copy_is_a_miss_never_data(make_engine, make_disk, damage: str) -> None:
    disk = make_disk()
    disk.put("k", payload("k", 256))
    path = disk_file(disk, "k")
    if damage == "bitflip":
        raw = bytearray(open(path, "rb").read())
        raw[-7] ^= 0x40
        open(path, "wb").write(raw)
    else:
        os.truncate(path, os.path.getsize(path) - 1)
    engine = make_engine(disk=disk)
    out = np.zeros(256, np.uint8)
    assert engine.get_into(C, "k", [out]) is ErrorCode.CHECKSUM_MISMATCH
    assert not out.any()  # nothing was copied into the caller's buffer
    assert engine.stats()["checksum_failures"] == 1
    assert engine.get_into(C, "k", [out]) is ErrorCode.OBJECT_NOT_FOUND
    assert engine.exists(["k"]) == [False]


def test_disk_object_too_big_for_memory_is_served_from_lease_data(make_engine, make_disk) -> None:
    disk = make_disk()
    disk.put("big", payload("big", 2000))  # written by a predecessor with a larger arena
    engine = make_engine(memory_size=1024, disk=disk)
    fill(engine, 3)
    lease = engine.acquire(C, "big")
    assert isinstance(lease, Lease) and lease.offset == -1 and lease.data is not None
    assert engine.validate(lease) is ErrorCode.OK
    assert np.array_equal(read(engine, "big", 2000), payload("big", 2000))
    assert in_memory(engine) == {"k0", "k1", "k2"}  # nothing evicted for a hopeless promotion


def test_a_reader_at_its_lease_limit_still_gets_a_promoted_objects_bytes(make_engine, make_disk) -> None:
    """The promotion commits the object, but the reader holds all the leases it may: it gets the
    verified bytes in ``Lease.data`` (as when nothing could be promoted), and the object stays
    in memory for the next reader."""
    disk = make_disk()
    disk.put("big", payload("big", 300))
    engine = make_engine(memory_size=4096, disk=disk, client_max_leases=1, disk_write_through=False)
    engine.put(C, "k", [payload("k", 64)])
    held = engine.acquire(C, "k")
    assert isinstance(held, Lease)
    lease = engine.acquire(C, "big")
    assert isinstance(lease, Lease) and lease.offset == -1
    assert np.array_equal(np.frombuffer(lease.data, np.uint8), payload("big", 300))
    assert engine.stats()["promotions"] == 1 and "big" in in_memory(engine)
    engine.release(held)
    other = engine.acquire("other", "big")
    assert isinstance(other, Lease) and other.offset >= 0 and other.data is None
    assert np.array_equal(engine.arena[other.offset : other.offset + 300], payload("big", 300))


def test_remove_deletes_the_disk_copy_too(make_engine, make_disk) -> None:
    disk = make_disk()
    engine = make_engine(disk=disk)
    engine.put(C, "k", [payload("k", 64)])
    engine.close()  # drain write-through
    assert disk.contains("k")
    assert engine.remove("k") is ErrorCode.OK
    assert not disk.contains("k") and engine.exists(["k"]) == [False]


def test_remove_waits_for_a_hung_disk_write_only_so_long(make_engine, make_disk, monkeypatch) -> None:
    from kvpool.store import engine as engine_mod

    monkeypatch.setattr(engine_mod, "REMOVE_PIN_WAIT_S", 0.3)
    disk = make_disk()
    writing, go = threading.Event(), threading.Event()
    real_put = disk.put

    def hung_put(key, data):
        writing.set()
        assert go.wait(10)
        return real_put(key, data)

    monkeypatch.setattr(disk, "put", hung_put)
    engine = make_engine(disk=disk)
    engine.put(C, "k", [payload("k", 64)])
    assert writing.wait(10)  # the write-through holds its pin on "k"
    assert engine.remove("k") is ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
    assert engine.exists(["k"]) == [True]  # not half-removed
    go.set()
    assert engine.remove("k") is ErrorCode.OK  # once the write is done, the pin goes
    assert engine.exists(["k"]) == [False]


def test_acquire_during_pending_reput_of_a_disk_key_serves_disk_without_promoting(
    make_engine, make_disk, clock
) -> None:
    """Regression (test_with_disk_tier_nothing_stored_is_ever_lost): key5 spilled to disk,
    re-put (allocate pending), then acquired. Promoting would give key5 two arena
    copies, so the commit would replace a leased object; the read is served from disk."""
    sizes = {"key0": 0, "key1": 193, "key5": 129, "key11": 385}
    engine = make_engine(
        memory_size=1024, default_kv_lease_ttl_ms=1000, disk=make_disk(1 << 22), disk_write_through=False
    )
    for key in ["key0"] * 4 + ["key5", "key1", "key11", "key0"]:
        assert engine.put("c", key, [payload(key, sizes[key])]) is ErrorCode.OK
    assert "key5" not in in_memory(engine) and engine.exists(["key5"]) == [True]  # spilled to disk

    alloc = engine.allocate("c", "key5", sizes["key5"])
    assert isinstance(alloc, Allocation)
    engine.arena[alloc.offset : alloc.offset + alloc.size] = payload("key5", sizes["key5"]).tobytes()
    used = engine.stats()["memory_used"]

    lease = engine.acquire("c", "key5")
    assert isinstance(lease, Lease)
    assert (lease.offset, lease.generation, lease.lease_id) == (-1, 0, 0)
    assert np.array_equal(np.frombuffer(lease.data, np.uint8), payload("key5", sizes["key5"]))
    assert engine.validate(lease) is ErrorCode.OK
    snap = engine._debug_snapshot()
    assert "key5" not in snap["objects"] and list(snap["pending"]) == [alloc.handle]  # nothing promoted
    assert engine.stats()["memory_used"] == used  # no second arena copy
    assert np.array_equal(read(engine, "key5", sizes["key5"]), payload("key5", sizes["key5"]))

    assert engine.commit(alloc.handle) is ErrorCode.OK  # the re-put still publishes
    snap = engine._debug_snapshot()
    obj = snap["objects"]["key5"]
    assert (obj.offset, obj.on_disk) == (alloc.offset, True)
    assert snap["used"] == sum(engine.reserved_size(o.size) for o in snap["objects"].values())  # no leak
    assert engine.validate(lease) is ErrorCode.OK  # the disk-served lease is unaffected
    engine.release(lease)
    assert np.array_equal(read(engine, "key5", sizes["key5"]), payload("key5", sizes["key5"]))
    clock.advance(1.001)
    assert engine.validate(lease) is ErrorCode.LEASE_EXPIRED


def test_acquire_during_pending_reput_then_abort_promotes_normally(make_engine, make_disk) -> None:
    disk = make_disk()
    disk.put("k", payload("k", 100))
    engine = make_engine(disk=disk, disk_write_through=False)
    alloc = engine.allocate(C, "k", 100)
    assert isinstance(alloc, Allocation)
    assert engine.acquire(C, "k").offset == -1
    assert engine.abort(alloc.handle) is ErrorCode.OK
    assert engine.stats()["memory_used"] == 0
    lease = engine.acquire(C, "k")
    assert isinstance(lease, Lease) and lease.offset >= 0 and lease.data is None  # promoted now
    assert in_memory(engine) == {"k"}
    assert engine.allocate(C, "k", 100) is ErrorCode.OBJECT_ALREADY_EXISTS


class _Gated:
    """Stands in for one of the engine's bulk steps (a hash, a disk read): the first call on
    ``size`` bytes (as ``nbytes`` counts its arguments) blocks until released, so a test can
    act while the engine is inside it."""

    def __init__(self, real, size: int, nbytes=lambda bufs: sum(np.asarray(b).nbytes for b in bufs)) -> None:
        self.real, self.size, self.nbytes = real, size, nbytes
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, *args):
        if not self.entered.is_set() and self.nbytes(*args) == self.size:
            self.entered.set()
            assert self.go.wait(10), "the test never released the gate"
        return self.real(*args)


def _call_meanwhile(fn):
    """Run ``fn`` on another thread; its result, or an AssertionError if it blocks (on the lock)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(5)
    assert out, "blocked: the engine lock was held across a bulk copy or hash"
    return out[0]


def test_a_promotion_reads_and_hashes_outside_the_engine_lock(make_engine, make_disk, monkeypatch) -> None:
    """A disk-tier object is read into the arena and hashed unlocked, as a client's put is
    copied: other clients' calls proceed meanwhile, and its pending range is the engine's alone."""
    disk = make_disk(1 << 22)
    disk.put("big", payload("big", 1000))
    engine = make_engine(memory_size=4096, disk=disk, disk_write_through=False)
    assert engine.put(C, "small", [payload("small", 64)]) is ErrorCode.OK
    gate = _Gated(disk.read_into, 1000, lambda key, dest: dest.nbytes)
    monkeypatch.setattr(disk, "read_into", gate)
    got: list = []
    promoter = threading.Thread(target=lambda: got.append(engine.acquire("reader", "big")))
    promoter.start()
    assert gate.entered.wait(5)
    try:
        assert _call_meanwhile(lambda: engine.exists(["small", "big"])) == [True, True]
        assert isinstance(_call_meanwhile(lambda: engine.acquire(C, "small")), Lease)
        (handle,) = engine._debug_snapshot()["pending"]
        # Its range cannot be freed or published by anyone else while the copy writes it.
        assert engine.abort(handle) is ErrorCode.OBJECT_NOT_FOUND
        assert engine.batch_abort([handle]) == [ErrorCode.OBJECT_NOT_FOUND]
        assert engine.commit(handle) is ErrorCode.OBJECT_NOT_FOUND
        assert engine.reap(now=1e9).allocations == 0  # past put_timeout_s and client_ttl_s
        assert list(engine._debug_snapshot()["pending"]) == [handle]
        # (A client's put of "big" now would overtake the promotion: tests/store/test_disk_faults.py.)
        second = _call_meanwhile(lambda: engine.acquire(C, "big"))  # served the verified disk bytes
        assert isinstance(second, Lease) and second.offset == -1
        assert np.array_equal(np.frombuffer(second.data, np.uint8), payload("big", 1000))
    finally:
        gate.go.set()
        promoter.join(10)
    lease = got[0]
    assert isinstance(lease, Lease) and lease.offset >= 0 and lease.data is None
    assert np.array_equal(engine.arena[lease.offset : lease.offset + 1000], payload("big", 1000))
    assert engine.validate(lease) is ErrorCode.OK
    assert engine.stats()["promotions"] == 1 and not engine._debug_snapshot()["pending"]
    engine._debug_check_evictable()


def test_a_reported_object_is_hashed_outside_the_engine_lock(make_engine, monkeypatch) -> None:
    import kvpool.store.engine as engine_module
    from kvpool.store.buffers import checksum

    engine = make_engine(memory_size=4096)
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    a = engine.allocate(C, "bad", 512)
    arena[a.offset : a.offset + 512] = payload("bad", 512)
    assert engine.commit(a.handle, checksum([payload("bad", 512)])) is ErrorCode.OK
    assert engine.put(C, "other", [payload("other", 64)]) is ErrorCode.OK
    bad = engine.acquire(C, "bad")
    arena[bad.offset] ^= 0xFF
    engine.release(bad)  # as the server does before it checks a report
    gate = _Gated(engine_module.checksum, 512)
    monkeypatch.setattr(engine_module, "checksum", gate)
    got: list = []
    checker = threading.Thread(target=lambda: got.append(engine.check_reported(bad)))
    checker.start()
    assert gate.entered.wait(5)
    try:
        assert _call_meanwhile(lambda: engine.exists(["other", "bad"])) == [True, True]
        # Pinned while hashed: room for a put is not made by evicting it (unpinned, it would be).
        assert _call_meanwhile(lambda: engine.put(C, "fill", [payload("fill", 4032)])) is not ErrorCode.OK
        assert "bad" in in_memory(engine)
    finally:
        gate.go.set()
        checker.join(10)
    assert got == [True] and engine.exists(["bad"]) == [False]
    assert engine.stats()["corrupt_objects"] == 1
    engine._debug_check_evictable()


def test_a_spilled_copy_overwritten_before_eviction_is_neither_read_nor_written(
    make_engine, ssd_dir, clock
) -> None:
    """Evicted objects not on disk yet are copied out under the lock and hashed after: a copy
    that no longer matches its writer's checksum is dropped by whichever check meets it first
    (a reader's, here, while the disk writer is busy with the object evicted before it)."""
    from kvpool.store.buffers import checksum

    class SlowDisk(DiskTier):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.entered, self.go = threading.Event(), threading.Event()

        def put(self, key, data):
            if key == "good":
                self.entered.set()
                assert self.go.wait(10)
            return super().put(key, data)

    disk = SlowDisk(ssd_dir, 1 << 20, "none")
    engine = make_engine(memory_size=4096, disk=disk, disk_write_through=False)
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    for k in ("good", "bad"):  # "good" is the older: evicted, and written, first
        a = engine.allocate(C, k, 256)
        arena[a.offset : a.offset + 256] = payload(k, 256)
        assert engine.commit(a.handle, checksum([payload(k, 256)])) is ErrorCode.OK
    lease = engine.acquire(C, "bad")
    arena[lease.offset + 7] ^= 0xFF  # a rogue client's write into the shared arena
    engine.release(lease)
    filler = threading.Thread(target=lambda: engine.put(C, "fill", [payload("fill", 4032)]))
    filler.start()
    assert disk.entered.wait(5)
    try:
        assert engine.stats()["spilling"] == 2 and not in_memory(engine)  # both evicted for "fill"
        assert engine.acquire(C, "bad") is ErrorCode.OBJECT_NOT_FOUND  # checked, dropped, a miss
        assert engine.stats()["corrupt_objects"] == 1 and engine.stats()["spilling"] == 1
    finally:
        disk.go.set()
        filler.join(10)
    assert engine.stats()["corrupt_objects"] == 1  # counted once: the writer found it gone
    assert disk.contains("good") and not disk.contains("bad")
    assert engine.stats()["spilling"] == 0
    got = engine.acquire(C, "good")
    assert isinstance(got, Lease)
    data = got.data if got.data is not None else engine.arena[got.offset : got.offset + 256]
    assert np.array_equal(np.frombuffer(data, np.uint8), payload("good", 256))


def test_a_reported_corruption_drops_only_a_damaged_object(make_engine) -> None:
    from kvpool.store.buffers import checksum

    engine = make_engine(memory_size=4096)
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    for k in ("good", "bad"):
        a = engine.allocate(C, k, 256)
        arena[a.offset : a.offset + 256] = payload(k, 256)
        assert engine.commit(a.handle, checksum([payload(k, 256)])) is ErrorCode.OK
    good, bad = engine.acquire(C, "good"), engine.acquire(C, "bad")
    arena[bad.offset] ^= 0xFF  # a rogue client's write
    # A report is only a reason to look: an intact object stays, a damaged one goes.
    assert engine.check_reported(good) is False and engine.exists(["good"]) == [True]
    assert engine.check_reported(bad) is True and engine.exists(["bad"]) == [False]
    assert engine.validate(bad) is ErrorCode.LEASE_EXPIRED  # its readers' copies are not trusted
    assert engine.validate(good) is ErrorCode.OK
    assert engine.stats()["corrupt_objects"] == 1
    engine.release(bad)  # idempotent on a dropped object
    assert engine.put(C, "bad", [payload("bad", 256)]) is ErrorCode.OK  # not put-if-absent any more


def test_the_engine_notes_what_leaves_the_pool_once_watched(make_engine) -> None:
    # What the `local` backend tells the connector's KV events (`take_removed`).
    engine = make_engine(memory_size=4096, eviction_high_watermark_ratio=1.0)
    value = [np.zeros(1024, dtype=np.uint8)]
    assert engine.put("c", "before", value) is ErrorCode.OK
    engine.remove("before")
    assert engine.take_drops() == []  # not watched yet: nothing kept
    engine.watch_drops()
    for i in range(5):  # four fit: the fifth evicts the oldest
        assert engine.put("c", f"k{i}", value) is ErrorCode.OK
    assert engine.remove("k4") is ErrorCode.OK
    assert engine.take_drops() == ["k0", "k4"] and engine.take_drops() == []


def test_an_eviction_to_the_ssd_tier_keeps_the_block_in_the_pool_and_one_from_it_does_not(make_engine, make_disk) -> None:
    disk = make_disk(quota_bytes=3 * DiskTier.entry_size("k0", 1024), policy="fifo")
    engine = make_engine(memory_size=4096, disk=disk, eviction_high_watermark_ratio=1.0, disk_write_through=False)
    engine.watch_drops()
    value = [np.zeros(1024, dtype=np.uint8)]
    for i in range(5):  # memory holds four: the fifth spills k0 to the SSD
        assert engine.put("c", f"k{i}", value) is ErrorCode.OK
    assert engine.take_drops() == [] and engine.exists(["k0"]) == [True]
    for i in range(5, 9):  # four more spills: the SSD's three files make room, oldest first
        assert engine.put("c", f"k{i}", value) is ErrorCode.OK
    assert sorted(engine.take_drops()) == ["k0", "k1"]
    assert engine.exists(["k0", "k1", "k2"]) == [False, False, True]
