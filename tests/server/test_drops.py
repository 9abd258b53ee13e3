"""The pool's drops for the clients that follow them (`kvpool.server.drops`): every follower gets
every key that left the pool from the moment it started, each from its own place; one that fell
behind further than the feed keeps is told so."""

from __future__ import annotations

import numpy as np

from kvpool.backends.pool_server import ServerBackend
from kvpool.server import drops as drops_mod
from kvpool.store import EngineConfig, PoolEngine


def _put(client, keys, size=4096):
    assert client.put(keys, [[np.zeros(size, np.uint8)]] * len(keys)) == [0] * len(keys)


def test_every_follower_gets_every_drop_from_when_it_started(start_server, make_client):
    start_server("--memory-size", "1MB")
    a, b = make_client(name="a"), make_client(name="b")
    assert a.take_drops() == ([], False)  # a follows from here
    _put(a, [f"k{i}" for i in range(4)])
    assert a.remove(["k0", "k1"]) == [0, 0]
    assert b.take_drops() == ([], False)  # b starts after those
    assert a.remove(["k2"]) == [0]
    assert sorted(a.take_drops()[0]) == ["k0", "k1", "k2"]
    assert b.take_drops() == (["k2"], False)
    assert a.take_drops() == ([], False) and b.take_drops() == ([], False)
    # Evictions are drops too: 1 MB of new keys through a 1 MB pool evicts k3.
    _put(a, [f"new{i}" for i in range(300)])
    dropped = set(b.take_drops()[0])
    assert "k3" in dropped and dropped <= {"k3", *(f"new{i}" for i in range(300))}


def test_a_backend_asks_at_most_every_tenth_of_a_second(start_server, make_client, sock_path, monkeypatch):
    start_server("--memory-size", "1MB")
    backend = ServerBackend(sock_path, "drops-backend")
    try:
        assert backend.take_removed() == []  # starts following
        writer = make_client(name="w")
        _put(writer, ["x"])
        assert writer.remove(["x"]) == [0]
        assert backend.take_removed() == []  # asked too soon: nothing lost, asked later
        monkeypatch.setattr(backend, "_drops_asked", 0.0)
        assert backend.take_removed() == ["x"]
    finally:
        backend.close()


def test_a_follower_that_fell_behind_is_told(monkeypatch):
    monkeypatch.setattr(drops_mod, "FEED_KEYS", 4)
    engine = PoolEngine(EngineConfig(memory_size=1 << 20, reap_interval_s=0))
    try:
        feed = drops_mod.DropFeed(engine)
        slow, fast = feed.start(), feed.start()
        for i in range(6):
            assert engine.put("w", f"k{i}", [np.zeros(64, np.uint8)]).name == "OK"
        for i in range(3):
            engine.remove(f"k{i}")
        keys, fast, missed = feed.take(fast)
        assert keys == ["k0", "k1", "k2"] and not missed
        for i in range(3, 6):
            engine.remove(f"k{i}")
        keys, slow, missed = feed.take(slow)
        assert missed and keys == ["k2", "k3", "k4", "k5"]  # the newest four the feed kept
        assert feed.take(fast) == (["k3", "k4", "k5"], fast + 3, False)
    finally:
        engine.close()
