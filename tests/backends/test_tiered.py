"""The host pool in front of a distributed store (`remote_backend`): write-through, lookups that
fall through to the remote tier, promotion into the host pool, and what a hung or lying remote
store costs. Two "hosts" are two host pools sharing one remote store; the stores are real
(`local` engines, a real `redis-server`, a real `mooncake_master` behind `kvpool server`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool.backends import create_backend
from kvpool.backends.base import Presence
from kvpool.backends.tiered import TieredBackend
from kvpool.config import load_config
from kvpool.errors import ConfigError, ErrorCode
from kvpool.testing.launch import PoolServer
from kvpool.testing.services import MooncakeMaster, ServiceError

OK, NOT_FOUND = ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND
KiB = 1 << 10
SIZE = 64 * KiB


def block(key: str, size: int = SIZE) -> np.ndarray:
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def read(b, key: str, size: int = SIZE) -> tuple[int, np.ndarray]:
    out = np.zeros(size, np.uint8)
    (code,) = b.batch_get_into([key], [[out]])
    return code, out


@pytest.fixture
def host(redis_service):
    """`host(name, **extra)`: a `local` host pool with the test's Redis behind it; each host is
    closed (the Redis running again) after the test."""
    made: list[TieredBackend] = []

    def make(name: str, **extra) -> TieredBackend:
        b = create_backend(load_config({"backend": "local", "local_cpu_size": "16MB", "remote_backend": "redis",
                                        "redis_url": redis_service.url, **extra}), name)
        assert isinstance(b, TieredBackend)
        made.append(b)
        return b

    yield make
    redis_service.resume()
    for b in made:
        b.close()


def test_a_block_saved_on_one_host_is_served_on_another_then_from_that_hosts_memory(host):
    a, b = host("a"), host("b")
    assert a.batch_put(["k1", "k2"], [[block("k1")], [block("k2")]]) == [OK, OK]
    assert a.flush(10)
    assert a.stats()["remote_written_blocks"] == 2
    assert b.host.batch_exists(["k1", "k2"]) == [False, False]
    assert b.batch_exists(["k1", "k2", "k3"]) == [True, True, False]  # through the remote tier
    code, got = read(b, "k1")
    assert code == OK and np.array_equal(got, block("k1"))
    assert b.flush(10)  # the promotion into b's host pool runs in the background
    remote_gets = b.stats()["remote_store_gets"]
    assert b.stats()["remote_hit_blocks"] == 1 and b.stats()["remote_promoted_blocks"] == 1
    assert b.host.batch_exists(["k1"]) == [True]  # promoted
    code, got = read(b, "k1")  # from b's own memory: the remote store is not asked
    assert code == OK and np.array_equal(got, block("k1"))
    assert b.stats()["remote_store_gets"] == remote_gets and b.stats()["remote_hit_blocks"] == 1
    assert b.stats()["remote_queued_blocks"] == 0  # a promoted block is not written back


def test_only_a_block_in_this_hosts_memory_is_pinned(host):
    # A pinned hit is loaded where vLLM could not be told of a failure: only bytes in this
    # process's own memory, under the lookup lease, qualify, never the remote store's.
    a, b = host("a"), host("b")
    assert a.batch_put(["k1", "k2"], [[block("k1")], [block("k2")]]) == [OK, OK]
    assert a.flush(10)
    assert a.batch_presence(["k1", "nope", "k1"]) == [Presence.PINNED, Presence.ABSENT, Presence.PINNED]
    assert b.batch_presence(["k1", "nope"]) == [Presence.STORED, Presence.ABSENT]
    assert read(b, "k1")[0] == OK and b.flush(10)  # promoted into b's memory
    assert b.batch_presence(["k1", "k2"]) == [Presence.PINNED, Presence.STORED]
    redis_down = create_backend(load_config({"backend": "redis", "redis_url": "redis://127.0.0.1:1"}), "c")
    try:
        assert redis_down.batch_presence(["k1"]) == [Presence.ABSENT]  # a store that is down: a miss
    finally:
        redis_down.close()


def test_a_block_the_remote_store_holds_is_not_sent_again(host):
    a, b = host("a"), host("b")
    assert a.batch_put(["k"], [[block("k")]]) == [OK]
    assert a.flush(10)
    assert b.batch_put(["k"], [[block("k")]]) == [OK]  # computed again on b
    assert b.flush(10)
    assert b.stats()["remote_skipped_blocks"] == 1 and b.stats()["remote_written_blocks"] == 0
    assert b.stats()["remote_store_puts"] == 0


def test_a_full_write_through_queue_drops_and_counts_and_never_blocks_a_save(host, redis_service):
    a = host("a", remote_queue_blocks=2, lookup_timeout_s=30)
    redis_service.pause()  # the write-through thread hangs on its first batch
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        assert a.batch_put([key], [[block(key)]]) == [OK]  # into the host pool: never waits
    st = a.stats()
    assert st["remote_queued_blocks"] + st["remote_dropped_blocks"] == 8, st
    # Two queued, and at most one batch taken by the hung thread: what the queue held when it woke
    # (one block, or both if the puts outran it).
    assert st["remote_dropped_blocks"] >= 8 - 2 - 2, st


def test_a_hung_remote_store_costs_one_lookup_its_deadline_then_misses_and_host_hits_go_on(host, redis_service):
    a = host("a", lookup_timeout_s=0.2, breaker_cooldown_s=60)
    assert a.batch_put(["here"], [[block("here")]]) == [OK]
    assert a.flush(10)
    redis_service.pause()
    assert a.batch_exists(["elsewhere"]) == [False]  # the deadline
    assert a.guard_stats()["timeouts"] == 1
    assert a.batch_exists(["elsewhere", "here"]) == [False, True]  # the breaker answers: no wait
    assert a.guard_stats()["timeouts"] == 1 and a.guard_stats()["breaker_rejected"] >= 1
    code, got = read(a, "here")
    assert code == OK and np.array_equal(got, block("here"))


def test_bytes_the_remote_store_serves_that_fail_its_check_are_neither_served_nor_promoted(host, redis_service):
    import redis

    a, b = host("a"), host("b")
    assert a.batch_put(["src", "dst"], [[block("src")], [block("dst")]]) == [OK, OK]
    assert a.flush(10)
    raw = redis.Redis.from_url(redis_service.url)
    raw.set("dst", raw.get("src"))  # another client of the store copies an object
    code, _ = read(b, "dst")
    assert code == ErrorCode.CHECKSUM_MISMATCH
    assert b.host.batch_exists(["dst"]) == [False] and b.stats()["remote_promoted_blocks"] == 0


def test_the_config_names_a_remote_tier_only_behind_a_host_pool():
    with pytest.raises(ConfigError, match="remote_backend"):
        load_config({"backend": "redis", "remote_backend": "mooncake"})
    with pytest.raises(ConfigError, match="remote_backend"):
        load_config({"backend": "local", "remote_backend": "server"})
    cfg = load_config({"backend": "server", "remote_backend": "redis", "redis_url": "redis://10.0.0.1:6379/0"})
    assert cfg.remote_settings is not None and cfg.remote_settings.redis_url == "redis://10.0.0.1:6379/0"


@pytest.mark.services
def test_host_pools_of_two_servers_share_blocks_through_mooncake_and_outlive_the_writers_server(tmp_path):
    """`kvpool server` on two "hosts" (two sockets) with Mooncake behind them: host A saves, host
    B's first read comes through Mooncake, its second from its own server; A's server killed,
    a third host still reads what A saved."""
    try:
        master = MooncakeMaster(tmp_path / "master")
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    servers, pools = [], []
    try:
        def pool(name: str, segment: str) -> TieredBackend:
            sock = os.path.join(tmp_path, f"{name}.sock")
            server = PoolServer(sock, memory_size="16MB", log_path=os.path.join(tmp_path, f"{name}.log"),
                                startup_timeout_s=15.0)
            servers.append(server)
            server.start()
            conf = master.write_config(tmp_path / f"{name}.json", segment)
            b = create_backend(load_config({"backend": "server", "server_socket": sock, "remote_backend": "mooncake",
                                            "mooncake_config_path": conf}), f"tiered-{name}")
            assert isinstance(b, TieredBackend)
            pools.append(b)
            return b

        a, b = pool("a", "32MB"), pool("b", 0)
        keys = [f"blk{i}" for i in range(4)]
        assert a.batch_put(keys, [[block(k)] for k in keys]) == [OK] * 4
        assert a.flush(20) and a.stats()["remote_written_blocks"] == 4
        assert b.batch_exists(keys) == [True] * 4
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        assert b.batch_get_into(keys, [[o] for o in outs]) == [OK] * 4
        assert all(np.array_equal(o, block(k)) for o, k in zip(outs, keys))
        assert b.flush(20)
        assert b.stats()["remote_hit_blocks"] == 4 and b.stats()["remote_promoted_blocks"] == 4
        gets = b.stats()["remote_store_gets"]
        assert b.batch_get_into(keys[:1], [[outs[0]]]) == [OK]
        assert b.stats()["remote_store_gets"] == gets  # from b's own server
        servers[0].kill()  # host A's server: its blocks live on in Mooncake (A's segment)
        c = pool("c", 0)
        code, got = read(c, keys[3])
        assert code == OK and np.array_equal(got, block(keys[3]))
    finally:
        for p in pools:
            p.close()
        for s in servers:
            s.kill()
        master.stop()


def test_what_the_host_pool_refuses_goes_to_the_remote_store_at_once(host):
    a, b = host("a", local_cpu_size="1MB"), host("b")
    big = block("big", 2 << 20)  # larger than a's whole host pool
    assert a.batch_put(["big"], [[big]]) == [OK]
    assert a.host.batch_exists(["big"]) == [False]
    assert a.stats()["remote_written_blocks"] == 1 and a.stats()["remote_queued_blocks"] == 0
    code, got = read(b, "big", 2 << 20)
    assert code == OK and np.array_equal(got, big)
