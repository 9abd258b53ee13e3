"""`backend: redis` beyond the conformance suite: chunked values, TTL, a server that goes away,
Redis' own OOM refusal, keys that are not kvpool objects. Against a real redis-server."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool.backends import create_backend
from kvpool.config import load_config
from kvpool.errors import ErrorCode
from kvpool.testing.services import RedisService

MiB = 1 << 20
OK, NOT_FOUND, NO_HANDLE = ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.NO_AVAILABLE_HANDLE
EXISTS = ErrorCode.OBJECT_ALREADY_EXISTS


def backend(url: str, **extra):
    return create_backend(load_config({"backend": "redis", "redis_url": url, **extra}), "test-redis")


def raw(svc):
    import redis

    return redis.Redis(host="127.0.0.1", port=svc.port)


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


def test_values_above_the_chunk_size_are_chunked_and_read_back(redis_service):
    b = backend(redis_service.url, redis_chunk_size="1MB")
    big = data(2 * MiB + 12345)
    segs = [big[:100], big[100 : MiB + 7], big[MiB + 7 :]]
    assert b.batch_put(["big", "small"], [segs, [big[:10]]]) == [OK, OK]
    keys = sorted(k.decode() for k in raw(redis_service).keys("*"))
    assert len(keys) == 5, keys  # header + 3 chunks + small
    assert sum(k.startswith("big#chunk:") for k in keys) == 3
    out = [np.empty(big.size, np.uint8)]
    assert b.batch_get_into(["big"], [out]) == [OK]
    assert np.array_equal(out[0], big)
    # A second put of the key writes nothing (SET NX) and leaves no stray chunks behind.
    assert b.batch_put(["big"], [[data(3 * MiB, 1)]]) == [EXISTS]
    assert len(raw(redis_service).keys("big#chunk:*")) == 3
    out = [np.empty(MiB, np.uint8), np.empty(big.size - MiB, np.uint8)]
    assert b.batch_get_into(["big"], [out]) == [OK]
    assert np.array_equal(np.concatenate(out), big)
    b.close()


def test_concurrent_writers_of_one_chunked_key(redis_service):
    vals = [data(3 * MiB + 1, seed) for seed in range(4)]
    backends = [backend(redis_service.url, redis_chunk_size="1MB") for _ in vals]
    codes: list = [None] * len(vals)
    start = threading.Barrier(len(vals))

    def put(i: int) -> None:
        start.wait()
        codes[i] = backends[i].batch_put(["race"], [[vals[i]]])

    threads = [threading.Thread(target=put, args=(i,)) for i in range(len(vals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(codes) == [[EXISTS]] * (len(vals) - 1) + [[OK]], codes  # one writer won
    out = [np.empty(vals[0].size, np.uint8)]
    assert backends[0].batch_get_into(["race"], [out]) == [OK]
    assert any(np.array_equal(out[0], v) for v in vals), "the bytes are a mix of writers"
    assert len(raw(redis_service).keys("race#chunk:*")) == 4  # only the winner's chunks remain
    for b in backends:
        b.close()


def test_a_chunk_evicted_alone_makes_the_object_a_miss(redis_service):
    b = backend(redis_service.url, redis_chunk_size="1MB")
    assert b.batch_put(["torn"], [[data(2 * MiB + 1)]]) == [OK]
    r = raw(redis_service)
    r.delete(sorted(r.keys("torn#chunk:*"))[1])
    dest = [np.full(2 * MiB + 1, 0xA5, np.uint8)]
    assert b.batch_get_into(["torn"], [dest]) == [NOT_FOUND]
    assert (dest[0] == 0xA5).all(), "a torn object wrote into the destination"
    assert b.batch_exists(["torn"]) == [False], "the orphan header was not dropped"
    assert b.batch_put(["torn"], [[data(2 * MiB + 1)]]) == [OK]  # can be stored again
    assert b.batch_get_into(["torn"], [[np.empty(2 * MiB + 1, np.uint8)]]) == [OK]
    b.close()


def test_ttl(redis_service):
    b = backend(redis_service.url, redis_ttl_s="0.3", redis_chunk_size="1MB")
    assert b.batch_put(["t", "tc"], [[data(100)], [data(MiB + 1)]]) == [OK, OK]
    r = raw(redis_service)
    assert 0 < r.pttl("t") <= 300
    assert all(r.pttl(k) > 300 for k in r.keys("tc#chunk:*"))  # chunks outlive their header
    time.sleep(0.45)
    assert b.batch_exists(["t", "tc"]) == [False, False]
    b.close()


@pytest.mark.services
def test_server_down_is_misses_and_rpc_fail_then_recovers(tmp_path):
    svc = RedisService(tmp_path / "r1")
    port = svc.port
    b = backend(svc.url, redis_timeout_s="1")
    assert b.batch_put(["k"], [[data(1000)]]) == [OK]
    svc.stop()
    t0 = time.monotonic()
    assert b.batch_exists(["k", "j"], lease=True) == [False, False]
    assert b.batch_put(["x"], [[data(10)]]) == [ErrorCode.RPC_FAIL]
    dest = [np.full(1000, 0xA5, np.uint8)]
    assert b.batch_get_into(["k"], [dest]) == [ErrorCode.RPC_FAIL]
    assert (dest[0] == 0xA5).all()
    assert time.monotonic() - t0 < 5, "calls to a dead server must not hang"
    svc = RedisService(tmp_path / "r2", port=port)  # a fresh (empty) server on the same port
    try:
        # Calls reach the server again once the backoff is over (50 ms, doubling while it stays
        # down): until then they keep failing fast.
        deadline = time.monotonic() + 2
        while (codes := b.batch_put(["k"], [[data(1000)]])) != [OK]:
            assert codes == [ErrorCode.RPC_FAIL] and time.monotonic() < deadline, codes
            time.sleep(0.02)
        assert b.batch_exists(["k", "x"]) == [True, False]  # "x" went to the old server only
        assert b.batch_get_into(["k"], [[np.empty(1000, np.uint8)]]) == [OK]
    finally:
        b.close()
        svc.stop()


def test_unreachable_at_start_is_not_fatal(tmp_path):
    from kvpool.testing.services import free_port

    b = backend(f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s="0.5")
    assert b.batch_exists(["a"]) == [False]
    assert b.batch_put(["a"], [[data(10)]]) == [ErrorCode.RPC_FAIL]
    b.close()


@pytest.mark.services
def test_noeviction_oom_is_no_available_handle(tmp_path):
    svc = RedisService(tmp_path / "r", capacity=2 * MiB, policy="noeviction")
    try:
        b = backend(svc.url)
        codes = []
        for i in range(40):
            codes += b.batch_put([f"f{i}"], [[data(128 << 10, i)]])
            if codes[-1] != OK:
                break
        assert codes[-1] == NO_HANDLE and set(codes[:-1]) == {OK}, codes
        stored = [f"f{i}" for i in range(len(codes) - 1)]
        dests = [[np.empty(128 << 10, np.uint8)] for _ in stored]
        assert b.batch_get_into(stored, dests) == [OK] * len(stored)
        assert all(np.array_equal(d[0], data(128 << 10, i)) for i, d in enumerate(dests))
        b.close()
    finally:
        svc.stop()


def test_foreign_key_is_an_error_not_data(redis_service):
    raw(redis_service).set("foreign", b"not a kvpool object at all")
    b = backend(redis_service.url)
    dest = [np.full(10, 0xA5, np.uint8)]
    assert b.batch_get_into(["foreign"], [dest]) == [ErrorCode.INTERNAL_ERROR]
    assert (dest[0] == 0xA5).all()
    b.close()


@pytest.mark.parametrize("size", [4096, 3 * MiB])  # inline, and chunked (1 MiB chunks)
def test_same_length_overwrite_is_a_counted_miss(redis_service, size):
    b = backend(redis_service.url, redis_chunk_size="1MB")
    value = data(size, seed=5)
    assert b.batch_put(["k"], [[value]]) == [OK]
    r = raw(redis_service)
    target = "k" if size <= MiB else next(k for k in r.keys("k#chunk:*"))
    blob = bytearray(r.get(target))
    blob[-1] ^= 0xFF  # another client rewrites the stored bytes, same length
    r.set(target, bytes(blob))
    dest = [np.zeros(size, np.uint8)]
    assert b.batch_get_into(["k"], [dest]) == [ErrorCode.CHECKSUM_MISMATCH]
    assert not dest[0].any()  # nothing delivered
    assert b.stats()["corrupt_reads"] == 1
    b.close()


@pytest.mark.parametrize("size", [4096, 3 * MiB])  # inline, and chunked (1 MiB chunks)
def test_another_keys_object_copied_here_is_a_miss_not_its_bytes(redis_service, size):
    """Any Redis client may `SET D <SRC's object>` (chunk keys too: a chunked header names them
    by nonce, not by key): the checksum is seeded with the key, so D never serves SRC's KV."""
    b = backend(redis_service.url, redis_chunk_size="1MB")
    assert b.batch_put(["src"], [[data(size, seed=6)]]) == [OK]
    r = raw(redis_service)
    for k in [b"src", *r.keys("src#chunk:*")]:  # the header, and the chunks under dst's names
        r.set(b"dst" + k[3:], r.get(k))
    dest = [np.zeros(size, np.uint8)]
    assert b.batch_get_into(["dst"], [dest]) == [ErrorCode.CHECKSUM_MISMATCH]
    assert not dest[0].any()
    assert b.batch_get_into(["src"], [dest]) == [OK]  # the original still reads under its own key
    b.close()


@pytest.mark.parametrize("magic", [b"kvp1", b"kvp2"])
def test_objects_of_the_old_layouts_are_misses(redis_service, magic):
    raw(redis_service).set("old", magic + bytes(20) + b"payload")
    b = backend(redis_service.url)
    assert b.batch_get_into(["old"], [[np.zeros(7, np.uint8)]]) == [NOT_FOUND]
    b.close()


def test_kvpool_stats_summarises_redis(redis_service):
    import json
    import subprocess
    import sys

    b = backend(redis_service.url)
    assert b.batch_put(["s"], [[data(1000)]]) == [OK]
    assert b.batch_get_into(["s", "absent"], [[np.empty(1000, np.uint8)], [np.empty(10, np.uint8)]])[0] == OK
    b.close()
    run = [sys.executable, "-m", "kvpool.cli", "stats", "--redis-url", redis_service.url]
    once = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    info = json.loads(once.stdout)
    assert info["keys"] >= 1 and info["keyspace_hits"] >= 1 and "used_memory" in info
    live = subprocess.run([*run, "--watch", "0.2", "--count", "2"], capture_output=True, text=True, timeout=60)
    assert live.returncode == 0 and live.stdout.count("reads/s") == 2 and "read hit rate" in live.stdout


# ---- a store that answers badly or hangs: a fake client, no redis-server ---------------------------


class _FakePipe:
    def __init__(self, store: "_FakeRedis") -> None:
        self.store, self.cmds = store, []

    def set(self, key, value, nx=False, px=None):
        self.cmds.append(("set", key, bytes(value), nx))

    def get(self, key):
        self.cmds.append(("get", key))

    def exists(self, key):
        self.cmds.append(("exists", key))

    touch = exists

    def execute(self, raise_on_error=True):
        self.store.executing.set()
        assert self.store.answer.wait(10), "the test never let the store answer"
        out = []
        for cmd in self.cmds:
            if cmd[0] == "set":
                stored = cmd[3] and cmd[1] in self.store.data
                if not stored:
                    self.store.data[cmd[1]] = cmd[2]
                out.append(None if stored else True)
            elif cmd[0] == "get":
                self.store.gets += 1
                out.append(self.store.data.get(cmd[1]))
            else:
                out.append(int(cmd[1] in self.store.data))
        return out


class _FakeRedis:
    """Just enough of redis-py's client for the adapter: a dict, and a switch (`answer`) that
    freezes every pipeline before it answers."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.gets = 0
        self.answer = threading.Event()
        self.answer.set()
        self.executing = threading.Event()

    def pipeline(self, transaction=False):
        return _FakePipe(self)

    def info(self, section):
        return {}

    def unlink(self, *keys):
        for k in keys:
            self.data.pop(k, None)

    def eval(self, script, n, key, head):
        return 0

    def close(self):
        pass


def fake_backend():
    from kvpool.backends.guard import GuardSettings
    from kvpool.testing.services import free_port

    b = backend(f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s="0.5")
    b.use_guard(GuardSettings(lookup_timeout_s=0.1, transfer_timeout_s=0.2, cooldown_s=60))
    b.r = _FakeRedis()
    return b


def test_a_corrupt_chunked_header_fails_its_key_only_and_asks_for_nothing():
    # A header that says CHUNKED but is cut short (struct.error) failed every key of the batch
    # with RPC_FAIL, and a chunk count the size cannot need (any client can SET the key) made
    # the reader build and ask for that many chunk keys: 4 billion of them took the worker down.
    from kvpool.backends.redis import _CHUNKS, _HEAD, CHUNKED, MAGIC

    b = fake_backend()
    try:
        assert b.batch_put(["good"], [[data(100)]]) == [OK]
        b.r.data["short"] = _HEAD.pack(MAGIC, CHUNKED, 100, 0)
        b.r.data["many"] = _HEAD.pack(MAGIC, CHUNKED, 100, 0) + _CHUNKS.pack(100_000, MiB, bytes(16))
        b.r.data["nosize"] = _HEAD.pack(MAGIC, CHUNKED, 100, 0) + _CHUNKS.pack(1, 0, bytes(16))
        dests = [[np.full(100, 0xA5, np.uint8)] for _ in range(4)]
        gets = b.r.gets
        codes = b.batch_get_into(["good", "short", "many", "nosize"], dests)
        assert codes == [OK] + [ErrorCode.INTERNAL_ERROR] * 3, codes
        assert np.array_equal(dests[0][0], data(100))
        assert all((d[0] == 0xA5).all() for d in dests[1:])  # nothing delivered
        assert b.r.gets - gets == 4  # the headers only: no chunk was asked for
    finally:
        b.close()


def test_a_hung_redis_costs_a_put_its_deadline_not_the_socket_timeout():
    # The put's whole round trip ran inside `_buffers()`, where the caller must wait past its
    # deadline: a frozen Redis held vLLM's save for redis_timeout_s (5 s by default) on top of
    # transfer_timeout_s. Only the copy out of the caller's buffers needs to be waited for.
    b = fake_backend()
    b.r.answer.clear()  # Redis freezes
    src = data(4096)
    out: list = []
    t = threading.Thread(target=lambda: out.append(b.batch_put(["k"], [[src]])))
    try:
        t.start()
        assert b.r.executing.wait(10)
        t.join(3)
        assert out == [[ErrorCode.RPC_TIMEOUT]]  # answered at the deadline, Redis still frozen
        assert not b.r.answer.is_set()
    finally:
        b.r.answer.set()
        t.join(10)
        b.close()
