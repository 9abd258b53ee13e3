"""The Backend protocol's semantics, checked the same way on every backend (see conftest.BACKENDS).

Every check compares whole payloads byte for byte; values are derived from their keys, so a
read returning another object's bytes, a torn copy or a stale range fails the comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest

from conformance_helpers import empty_like_segments, joined, payload, split, workload
from kvpool.backends.base import STATS
from kvpool.errors import ErrorCode

OK = ErrorCode.OK
NOT_FOUND = ErrorCode.OBJECT_NOT_FOUND
NO_HANDLE = ErrorCode.NO_AVAILABLE_HANDLE
INVALID = ErrorCode.INVALID_PARAMS
INVALID_KEY = ErrorCode.INVALID_KEY
EXISTS = ErrorCode.OBJECT_ALREADY_EXISTS

KiB, MiB = 1 << 10, 1 << 20
SENTINEL = 0xA5


def get(backend, key: str, sizes: list[int]) -> tuple[int, np.ndarray]:
    dest = empty_like_segments(sizes, SENTINEL)
    (code,) = backend.batch_get_into([key], [dest])
    return code, joined(dest)


def assert_intact(backend, keys: list[str], size: int) -> None:
    """Every key exists and reads back exactly its payload."""
    assert backend.batch_exists(keys) == [True] * len(keys)
    dests = [empty_like_segments([size]) for _ in keys]
    assert backend.batch_get_into(keys, dests) == [OK] * len(keys)
    for key, dest in zip(keys, dests):
        assert np.array_equal(dest[0], payload(key, size)), f"{key}: bytes differ"


def untouched(buffers: list[np.ndarray]) -> bool:
    return all(bool((b == SENTINEL).all()) for b in buffers)


def already(backend) -> int:
    """What a put of a stored key answers: OBJECT_ALREADY_EXISTS, or OK where the store's client
    cannot tell (`Capabilities.put_reports_existing`: Mooncake answers 0 for a key it skipped)."""
    return EXISTS if backend.capabilities.put_reports_existing else OK


# ---- put / get / exists -------------------------------------------------------------------------


def test_put_get_exists(backend_factory):
    b = backend_factory(4 * MiB)
    data = payload("a", 10_000)
    assert b.batch_exists(["a", "b"]) == [False, False]
    assert b.batch_exists(["a", "b"], lease=True) == [False, False]
    assert b.batch_put(["a"], [[data]]) == [OK]
    assert b.batch_exists(["a", "b"]) == [True, False]
    assert b.batch_exists(["b", "a"], lease=True) == [False, True]
    for _ in range(2):  # a read does not consume the object
        code, got = get(b, "a", [10_000])
        assert code == OK and np.array_equal(got, data)
    # Exists never creates, empty batches are empty answers.
    assert b.batch_exists(["b"]) == [False]
    assert b.batch_exists([]) == []
    assert b.batch_put([], []) == []
    assert b.batch_get_into([], []) == []


def test_put_stores_buffers_back_to_back(backend_factory):
    b = backend_factory(4 * MiB)
    data = payload("segs", 3 * 4096 + 5)
    segments = split(data, [4096, 4096, 5, 4096])
    assert b.batch_put(["segs"], [segments]) == [OK]
    # Any split of the destination whose sizes add up reads the same bytes.
    for sizes in ([len(data)], [4096, 4096, 5, 4096], [1, len(data) - 2, 1], [0, len(data), 0]):
        code, got = get(b, "segs", sizes)
        assert code == OK and np.array_equal(got, data), sizes


def test_batch_mixed_hits_and_misses(backend_factory):
    cap = backend_factory.capacity(4 * MiB)
    b = backend_factory(cap)
    keys = [f"k{i}" for i in range(8)]
    stored = keys[::2]
    assert b.batch_put(stored, [[payload(k, 5000)] for k in stored]) == [OK] * 4
    assert b.batch_exists(keys) == [True, False] * 4
    assert b.batch_exists(keys, lease=True) == [True, False] * 4
    # One call: hits, misses and a wrong-size destination, each with its own code.
    ask = ["k0", "k1", "k2", "k3", "k4", "k6", "k7"]
    sizes = {"k4": [4999]}
    dests = [empty_like_segments(sizes.get(k, [2500, 2500])) for k in ask]
    codes = b.batch_get_into(ask, dests)
    assert codes == [OK, NOT_FOUND, OK, NOT_FOUND, INVALID, OK, NOT_FOUND]
    for key, code, dest in zip(ask, codes, dests):
        if code == OK:
            assert np.array_equal(joined(dest), payload(key, 5000)), key
        else:
            assert untouched(dest), key
    # A batch put with one unstorable value stores the others.
    more = ["m0", "m1", "m2"]
    values = [[payload("m0", 100)], [payload("m1", 2 * cap)], [payload("m2", 100)]]
    assert b.batch_put(more, values) == [OK, NO_HANDLE, OK]
    if backend_factory.refused_put_evicts:
        # The refusal made the store evict (see conftest): m1 is absent, what is left is intact.
        present = [k for k, f in zip(more, b.batch_exists(more)) if f]
        assert "m1" not in present
        for key in present:
            code, got = get(b, key, [100])
            assert code == OK and np.array_equal(got, payload(key, 100)), key
        return
    assert b.batch_exists(more) == [True, False, True]


def test_missing_keys_are_not_found_and_buffers_untouched(backend_factory):
    b = backend_factory(4 * MiB)
    keys = ["nope-0", "nope-1", "nope-2"]
    dests = [empty_like_segments([4096]), empty_like_segments([100, 200, 0]), empty_like_segments([])]
    assert b.batch_get_into(keys, dests) == [NOT_FOUND] * 3
    assert all(untouched(d) for d in dests)
    assert b.batch_exists(keys) == [False] * 3
    # Still missing after other keys arrive.
    assert b.batch_put(["other"], [[payload("other", 4096)]]) == [OK]
    dest = empty_like_segments([4096])
    assert b.batch_get_into(["nope-0"], [dest]) == [NOT_FOUND] and untouched(dest)


def test_put_of_a_stored_key_is_already_exists_and_keeps_the_bytes(backend_factory):
    b = backend_factory(4 * MiB)
    first, second = payload("first", 8192), payload("second", 8192)
    assert b.batch_put(["dup"], [[first]]) == [OK]
    # Put-if-absent: nothing is written, the first bytes stay, and the caller learns the key is
    # there (a success: no existence check is needed before a put).
    assert b.batch_put(["dup"], [[second]]) == [already(b)]
    assert b.batch_put(["dup"], [[payload("third", 100)]]) == [already(b)]  # even with another size
    assert b.batch_put(["fresh", "dup"], [[second], [second]]) == [OK, already(b)]  # per key
    code, got = get(b, "dup", [8192])
    assert code == OK and np.array_equal(got, first)
    code, got = get(b, "dup", [100])
    assert code == INVALID
    code, got = get(b, "fresh", [8192])
    assert code == OK and np.array_equal(got, second)
    stats = b.stats()
    assert stats["put_existing"] == (3 if b.capabilities.put_reports_existing else 0)
    assert stats["puts"] + stats["put_existing"] == 5


def test_duplicate_keys_in_one_batch(backend_factory):
    b = backend_factory(4 * MiB)
    first, second = payload("first", 8192), payload("second", 8192)
    # Written once, from the first value; every copy gets the first one's code.
    assert b.batch_put(["twice", "other", "twice"], [[first], [second], [second]]) == [OK, OK, OK]
    code, got = get(b, "twice", [4096, 4096])
    assert code == OK and np.array_equal(got, first)
    assert b.batch_put(["twice", "twice"], [[second], [first]]) == [already(b)] * 2
    e = np.empty(0, dtype=np.uint8)
    assert b.batch_put(["dup-e", "dup-e"], [[e], [first]]) == [INVALID, INVALID]  # the first is empty
    assert b.batch_exists(["dup-e"]) == [False]
    stats = b.stats()
    assert stats["puts"] + stats["put_existing"] == 3  # once per distinct key and batch
    # Lookups and reads of a key given twice answer (and fill) each copy.
    assert b.batch_exists(["twice", "nope", "twice"], lease=True) == [True, False, True]
    dests = [empty_like_segments([8192]), empty_like_segments([4096, 4096]), empty_like_segments([100])]
    assert b.batch_get_into(["twice", "twice", "twice"], dests) == [OK, OK, INVALID]
    assert np.array_equal(joined(dests[0]), first) and np.array_equal(joined(dests[1]), first)
    assert untouched(dests[2])


def test_bad_arguments(backend_factory):
    b = backend_factory(4 * MiB)
    data = payload("args", 256)
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        b.batch_put(["a", "b"], [[data]])
    with pytest.raises(ValueError, match="1 keys but 0 values"):
        b.batch_get_into(["a"], [])
    # Per key, never for the whole batch: a strided (non-contiguous) buffer and an empty key
    # are refused, the others stored.
    strided = np.arange(512, dtype=np.uint8)[::2]
    assert b.batch_put(["strided", "", "args"], [[strided], [data], [data]]) == [INVALID, INVALID_KEY, OK]
    assert b.batch_exists(["strided", "", "args"]) == [False, False, True]
    read_only = np.zeros(256, dtype=np.uint8)
    read_only.flags.writeable = False
    assert b.batch_get_into(["args", ""], [[read_only], [np.zeros(256, np.uint8)]]) == [INVALID, INVALID_KEY]


def test_stats_have_one_shape(backend_factory):
    b = backend_factory(4 * MiB)
    data = payload("s", 5000)
    assert b.batch_put(["s"], [[data]]) == [OK]
    assert b.batch_put(["s"], [[data]]) == [already(b)]
    assert b.batch_get_into(["s", "miss"], [[np.empty(5000, np.uint8)], [np.empty(5000, np.uint8)]]) == [OK, NOT_FOUND]
    assert b.batch_get_into(["s"], [[np.empty(10, np.uint8)]]) == [INVALID]
    stats = b.stats()
    # The client-side counters are the same for every backend; the store's own numbers (if
    # any) come after them, prefixed.
    assert list(stats)[: len(STATS)] == list(STATS)
    assert all(k in STATS or k.startswith("store_") for k in stats), list(stats)
    puts = 1 if b.capabilities.put_reports_existing else 2
    assert (stats["puts"], stats["put_bytes"], stats["gets"], stats["get_bytes"]) == (puts, puts * 5000, 1, 5000)
    assert (stats["misses"], stats["failures"]) == (1, 1)


@pytest.mark.parametrize("backend_factory", ["server"], indirect=True)
def test_server_save_costs_two_round_trips(backend_factory):
    """A save (PoolWorker._save_values: one batch_put, no lookup first) is Allocate + Commit;
    one round trip when every block is stored already. It used to be Exists + Allocate + Commit."""
    b = backend_factory(4 * MiB)
    keys = [f"blk{i}" for i in range(8)]
    values = [split(payload(k, 3 * 4096), [4096] * 3) for k in keys]  # a block is several segments
    assert b.batch_put(keys[:3], values[:3]) == [OK] * 3

    def round_trips(call) -> tuple[list[int], dict[str, int]]:
        before = Counter(b.client.requests)
        codes = call()
        after = Counter(b.client.requests)
        after.subtract(before)
        return codes, {k: n for k, n in after.items() if n and k != "Ping"}  # the pinger runs on its own

    codes, trips = round_trips(lambda: b.batch_put(keys, values))
    assert codes == [EXISTS] * 3 + [OK] * 5
    assert trips == {"Allocate": 1, "Commit": 1}, trips
    codes, trips = round_trips(lambda: b.batch_put(keys, values))
    assert codes == [EXISTS] * 8
    assert trips == {"Allocate": 1}, trips
    dests = [empty_like_segments([3 * 4096]) for _ in keys]
    assert b.batch_get_into(keys, dests) == [OK] * 8
    assert all(np.array_equal(d[0], payload(k, 3 * 4096)) for k, d in zip(keys, dests))


# ---- capacity, eviction, leases ------------------------------------------------------------------


def test_value_larger_than_pool_is_no_available_handle(backend_factory):
    cap = backend_factory.capacity(2 * MiB)
    b = backend_factory(cap)
    small = [f"s{i}" for i in range(4)]
    assert b.batch_put(small, [[payload(k, 64 * KiB)] for k in small]) == [OK] * 4
    big = payload("big", 2 * cap)
    assert b.batch_put(["big"], [split(big, [cap, cap])]) == [NO_HANDLE]
    assert b.batch_put(["big1"], [[payload("big1", cap + 1)]]) == [NO_HANDLE]
    assert b.batch_exists(["big", "big1"]) == [False, False]
    code, _ = get(b, "big", [2 * cap])
    assert code == NOT_FOUND
    if backend_factory.refused_put_evicts:
        # The store evicts some objects when it refuses a put (see conftest); none is damaged.
        assert_intact(b, [k for k, f in zip(small, b.batch_exists(small)) if f], 64 * KiB)
        return
    # Nothing stored was evicted or damaged for a put that could never fit.
    assert_intact(b, small, 64 * KiB)


def test_pool_full_of_leased_objects_is_no_available_handle(backend_factory):
    cap = backend_factory.capacity(2 * MiB)
    size = cap // 8
    b = backend_factory(cap)
    stored: list[str] = []
    codes = []
    for i in range(cap // size + 2):
        key = f"leased-{i}"
        (code,) = b.batch_put([key], [[payload(key, size)]])
        codes.append(code)
        if code != OK:
            break
        stored.append(key)
        assert b.batch_exists([key], lease=True) == [True]
    if not backend_factory.leases_pin:
        # A store without leases (Redis) evicts instead: every put that fits succeeds, the pool
        # never holds more than its capacity, the newest value is there and what is left is intact.
        assert codes == [OK] * len(codes), codes
        present = [k for k, f in zip(stored, b.batch_exists(stored)) if f]
        assert stored[-1] in present and len(present) <= cap // size, present
        assert_intact(b, present, size)
        return
    assert codes[-1] == NO_HANDLE, f"a pool of {cap} bytes took {len(stored)} leased values of {size}: {codes}"
    assert 1 <= len(stored) <= cap // size
    assert_intact(b, stored, size)


def test_lru_eviction_past_high_watermark(backend_factory):
    cap = backend_factory.capacity(1 * MiB)
    size, n = cap // 16, 48  # 16 values fill the pool; write three pools' worth
    b = backend_factory(cap)
    keys = [f"v{i}" for i in range(n)]
    for i, key in enumerate(keys):
        if i:
            # Keep v0 the most recently used: LRU must evict the others first.
            code, got = get(b, "v0", [size])
            if backend_factory.exact_lru or code != NOT_FOUND:  # sampled LRU may drop v0 (below)
                assert code == OK and np.array_equal(got, payload("v0", size)), f"v0 lost before put {i}"
        assert b.batch_put([key], [[payload(key, size)]]) == [OK], f"put {i} failed instead of evicting"
    present = [k for k, f in zip(keys, b.batch_exists(keys)) if f]
    if not backend_factory.exact_lru:
        # Sampled LRU (Redis: 1 s clock, a few keys sampled per eviction) cannot promise which of
        # several equally old values goes first (v0 included); it must still evict (the pool
        # stays within its capacity), keep the newest value, and keep every survivor intact.
        assert keys[-1] in present and "v1" not in present, present
        assert 2 <= len(present) < cap // size
        assert_intact(b, present, size)
        return
    assert "v0" in present and keys[-1] in present
    assert "v1" not in present, "the least recently used value survived while newer ones were written"
    # Full, not past full: Mooncake evicts on its master's background thread, so right after
    # the last put the pool may hold exactly its capacity until the next eviction pass.
    assert 2 <= len(present) <= cap // size
    # Eviction went oldest first: what is left is v0 plus a run of the newest values.
    newest = [k for k in keys[1:] if k in present]
    assert newest == keys[n - len(newest):], present
    assert_intact(b, present, size)


def test_leased_object_is_not_evicted(backend_factory):
    cap = backend_factory.capacity(1 * MiB)
    size = cap // 16
    b = backend_factory(cap)
    assert b.batch_put(["leased", "unleased"], [[payload("leased", size)], [payload("unleased", size)]]) == [OK, OK]
    assert b.batch_exists(["leased"], lease=True) == [True]
    fill = [f"fill-{i}" for i in range(3 * cap // size)]
    for key in fill:  # one at a time, as a running instance does; never touching "leased"
        assert b.batch_put([key], [[payload(key, size)]]) == [OK]
    assert b.batch_exists(["unleased"]) == [False], "the fill did not pressure the pool"
    if not backend_factory.leases_pin:
        # No leases (Redis): the leased value may be evicted like any other; if it is still
        # there it must be intact, and a read of it is a clean miss otherwise.
        code, got = get(b, "leased", [size])
        assert code == OK and np.array_equal(got, payload("leased", size)) or code == NOT_FOUND, code
        return
    assert_intact(b, ["leased"], size)


# ---- sizes ---------------------------------------------------------------------------------------


def test_large_multi_buffer_values(backend_factory):
    b = backend_factory(48 * MiB)
    layouts = {
        "large-a": [1 * MiB + 7, 2 * MiB, 3, 3 * MiB // 2],
        "large-b": [4 * MiB, 4 * MiB],
        "large-c": [5 * MiB + 1],
        "large-d": [256 * KiB] * 32 + [13],
    }
    data = {k: payload(k, sum(s)) for k, s in layouts.items()}
    keys = list(layouts)
    assert b.batch_put(keys, [split(data[k], layouts[k]) for k in keys]) == [OK] * len(keys)
    assert b.batch_exists(keys) == [True] * len(keys)
    # Read back in the original layout and in one flat buffer, in one batch each.
    dests = [empty_like_segments(layouts[k]) for k in keys]
    assert b.batch_get_into(keys, dests) == [OK] * len(keys)
    for k, d in zip(keys, dests):
        assert np.array_equal(joined(d), data[k]), k
    flat = [[np.empty(data[k].size, dtype=np.uint8)] for k in keys]
    assert b.batch_get_into(keys, flat) == [OK] * len(keys)
    for k, d in zip(keys, flat):
        assert np.array_equal(d[0], data[k]), k


def test_empty_value_is_refused(backend_factory):
    """A KV block is never empty: an empty value is INVALID_PARAMS, refused before the store."""
    b = backend_factory(4 * MiB)
    e = np.empty(0, dtype=np.uint8)
    data = payload("mixed", 1000)
    assert b.batch_put(["e-none", "e-one", "e-two", "mixed"], [[], [e], [e, e], [e, data, e]]) == [
        INVALID, INVALID, INVALID, OK]
    assert b.batch_exists(["e-none", "e-one", "e-two", "mixed"]) == [False, False, False, True]
    code, got = get(b, "mixed", [0, 1000])  # empty segments around real bytes are fine
    assert code == OK and np.array_equal(got, data)
    # An empty destination: a miss is a miss, a stored object is the wrong size.
    assert b.batch_get_into(["e-one", "mixed", "mixed"], [[e], [], [e]]) == [NOT_FOUND, INVALID, INVALID]
    assert b.stats()["puts"] == 1


def test_wrong_size_destination_is_invalid_params(backend_factory):
    b = backend_factory(4 * MiB)
    data = payload("sized", 4096)
    assert b.batch_put(["sized"], [[data]]) == [OK]
    for sizes in ([4095], [4097], [2048, 2049], [], [0], [8192]):
        dest = empty_like_segments(sizes)
        assert b.batch_get_into(["sized"], [dest]) == [INVALID], sizes
        assert untouched(dest), sizes
    # The object is unharmed and reads with the right sizes.
    code, got = get(b, "sized", [1000, 3096])
    assert code == OK and np.array_equal(got, data)


# ---- concurrency ---------------------------------------------------------------------------------


def test_concurrent_threads(backend_factory):
    b = backend_factory(16 * MiB)
    n = 4
    results: list[dict | BaseException] = [RuntimeError("did not run")] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = workload(b, i, n)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    for i, r in enumerate(results):
        assert not isinstance(r, BaseException), f"thread {i}: {r!r}"
        assert r["errors"] == [], f"thread {i}: {r['errors'][:10]}"
        assert r["verified"] > 0
    # Everything every thread wrote is there, intact.
    _assert_all_written(b, n)


def test_concurrent_processes(shared_backend_factory, tmp_path):
    make = shared_backend_factory
    b = make(16 * MiB)
    n = 3
    worker = os.path.join(os.path.dirname(__file__), "worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, json.dumps({"config": make.client_config(b), "worker": i, "workers": n})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / f"w{i}.err", "wb"), text=True,
        )
        for i in range(n)
    ]
    try:
        for i, p in enumerate(procs):
            line = p.stdout.readline()
            assert line.strip() == "ready", f"worker {i}: {line!r} {(tmp_path / f'w{i}.err').read_text()[-2000:]}"
        for p in procs:  # start together
            p.stdin.write("go\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=60)
            err = (tmp_path / f"w{i}.err").read_text()[-2000:]
            assert p.returncode == 0, f"worker {i} exited with {p.returncode}: {err}"
            r = json.loads(out.strip().splitlines()[-1])
            assert r["errors"] == [], f"worker {i}: {r['errors'][:10]}"
            assert r["verified"] > 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # This process's client sees all of it, and so does a second client here.
    _assert_all_written(b, n)
    _assert_all_written(make.connect(b), n)


def _assert_all_written(backend, n_workers: int, n_own: int = 32, n_shared: int = 16) -> None:
    from conformance_helpers import segment_sizes, value_size

    keys = [f"w{w}-{j}" for w in range(n_workers) for j in range(n_own)] + [f"shared-{j}" for j in range(n_shared)]
    assert backend.batch_exists(keys) == [True] * len(keys)
    dests = [empty_like_segments(segment_sizes(k, value_size(k))) for k in keys]
    assert backend.batch_get_into(keys, dests) == [OK] * len(keys)
    for k, d in zip(keys, dests):
        assert np.array_equal(joined(d), payload(k, value_size(k))), k
