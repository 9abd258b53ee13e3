"""A leased lookup's leases serve the load that follows it (`Lookup`): the scheduler looks up,
the worker copies under those leases without an Acquire round trip, and every way such a lease
can lapse ends in the right bytes or an honest failure, never in another value's bytes with
code 0."""

from __future__ import annotations

import time

import numpy as np

from kvpool.errors import CHECKSUM_MISMATCH, OK, ErrorCode
from kvpool.server import protocol as P


def _values(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _get(client, keys: list[str], size: int) -> tuple[list[int], list[np.ndarray]]:
    outs = [np.zeros(size, np.uint8) for _ in keys]
    return client.get_into(keys, [[o] for o in outs]), outs


def test_a_load_after_a_leased_lookup_needs_no_acquire(start_server, make_client):
    start_server()
    writer, reader = make_client(name="writer"), make_client(name="reader")
    assert writer.wait_connected(10) and reader.wait_connected(10)
    keys = [f"k{i}" for i in range(5)]
    vals = _values(5, 4096, 1)
    assert writer.put(keys, [[v] for v in vals]) == [OK] * 5
    assert reader.exists(keys + ["absent"], lease=True) == [True] * 5 + [False]
    before = dict(reader.requests)
    codes, outs = _get(reader, keys, 4096)
    assert codes == [OK] * 5 and all(np.array_equal(o, v) for o, v in zip(outs, vals))
    assert reader.requests["Acquire"] == before.get("Acquire", 0)  # no second round trip for leases
    assert reader.requests["Release"] == before.get("Release", 0) + 1
    # The lookup lease was only checked: it still protects the hits, and serves another load.
    codes, outs = _get(reader, keys[:2], 4096)
    assert codes == [OK, OK] and reader.requests["Acquire"] == before.get("Acquire", 0)
    stats, _ = reader.server_stats()
    assert stats["hits"] == 7 and stats["lease_expired"] == 0


def test_keys_without_a_lookup_lease_are_acquired_in_the_same_load(start_server, make_client):
    start_server()
    c = make_client(name="mixed")
    assert c.wait_connected(10)
    vals = _values(3, 2048, 2)
    assert c.put(["a", "b", "c"], [[v] for v in vals]) == [OK] * 3
    assert c.exists(["a"], lease=True) == [True]
    acquires = c.requests["Acquire"]
    # "a" under its lookup lease, "b" and "c" acquired, "a" asked twice (each destination filled).
    codes, outs = _get(c, ["a", "b", "c", "a"], 2048)
    assert codes == [OK] * 4
    assert [np.array_equal(o, v) for o, v in zip(outs, [vals[0], vals[1], vals[2], vals[0]])] == [True] * 4
    assert c.requests["Acquire"] == acquires + 1


def test_a_lapsed_lookup_lease_is_tried_again_and_lands_the_new_value(start_server, make_client):
    # A lease that expired on the server while the client still took it for young (clocks,
    # a stalled worker): the key was removed and stored again with other bytes meanwhile. The
    # copy under the lapsed lease fails its checksum, the release says the lease is gone, and the
    # key is read again under a fresh lease: the new bytes, code 0, no damaged object reported.
    start_server("--default_kv_lease_ttl", "200")
    writer, reader = make_client(name="writer"), make_client(name="reader")
    assert writer.wait_connected(10) and reader.wait_connected(10)
    old, new = _values(2, 8192, 3)
    assert writer.put(["k"], [[old]]) == [OK]
    assert reader.exists(["k"], lease=True) == [True]
    time.sleep(0.4)  # past the TTL: the lookup lease lapsed
    assert writer.remove(["k"]) == [OK]
    assert writer.put(["k"], [[new]]) == [OK]
    reader._held["k"].granted = time.monotonic()  # the client still takes it for young
    acquires = reader.requests["Acquire"]
    codes, outs = _get(reader, ["k"], 8192)
    assert codes == [OK] and np.array_equal(outs[0], new)
    assert reader.requests["Acquire"] == acquires + 1
    assert reader.checksum_failures == 0
    stats, _ = reader.server_stats()
    assert stats["corrupt_objects"] == 0
    assert "k" not in reader._held  # forgotten: the next load acquires


def test_an_old_lookup_lease_is_not_used(start_server, make_client):
    # Older than half the TTL: the load acquires instead of betting on the lease.
    start_server("--default_kv_lease_ttl", "200")
    c = make_client(name="old")
    assert c.wait_connected(10)
    (v,) = _values(1, 1024, 4)
    assert c.put(["k"], [[v]]) == [OK]
    assert c.exists(["k"], lease=True) == [True]
    time.sleep(0.15)
    acquires = c.requests["Acquire"]
    codes, outs = _get(c, ["k"], 1024)
    assert codes == [OK] and np.array_equal(outs[0], v) and c.requests["Acquire"] == acquires + 1


def test_damage_under_a_held_lookup_lease_is_still_a_counted_miss(start_server, make_client):
    start_server()
    writer, reader, rogue = make_client(name="writer"), make_client(name="reader"), make_client(name="rogue")
    assert writer.wait_connected(10) and reader.wait_connected(10) and rogue.wait_connected(10)
    vals = _values(2, 4096, 5)
    assert writer.put(["k", "ok"], [[v] for v in vals]) == [OK, OK]
    assert reader.exists(["k", "ok"], lease=True) == [True, True]
    reply = rogue.acquire(["k"])
    assert isinstance(reply, P.Acquired) and reply.codes == [OK]
    rogue.arena[reply.offsets[0] : reply.offsets[0] + reply.sizes[0]] ^= 0xFF
    rogue.release(reply.lease_ids)
    codes, outs = _get(reader, ["k", "ok"], 4096)
    assert codes == [CHECKSUM_MISMATCH, OK] and np.array_equal(outs[1], vals[1])
    assert reader.checksum_failures == 1
    stats, _ = reader.server_stats()
    assert stats["corrupt_objects"] == 1  # the report made the server check and drop it


def test_lookup_leases_of_a_reconnected_client_are_not_used(start_server, make_client, sock_path):
    # The new server's lease numbers start over: the old ones must never reach it.
    server = start_server()
    c = make_client(name="reconnect", retry_interval_s=0.05)
    assert c.wait_connected(10)
    (v,) = _values(1, 1024, 6)
    assert c.put(["k"], [[v]]) == [OK]
    assert c.exists(["k"], lease=True) == [True]
    server.kill()
    start_server(socket_path=sock_path)
    c.put(["k"], [[v]])  # the first call after the kill finds the connection gone
    assert c.wait_connected(10)
    assert c.put(["k"], [[v]]) in ([OK], [int(ErrorCode.OBJECT_ALREADY_EXISTS)])
    assert "k" not in c._held  # dropped with the old connection (whose numbers the new server reuses)
    acquires = c.requests["Acquire"]
    codes, outs = _get(c, ["k"], 1024)
    assert codes == [OK] and np.array_equal(outs[0], v) and c.requests["Acquire"] == acquires + 1


def _mapped(arena_name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().split("/")[-1].split(" ")[0] == arena_name for line in f)


def test_a_reconnected_client_unmaps_the_dead_servers_arena(start_server, make_client, sock_path):
    # The dead server's arena file is unlinked by its successor, but its tmpfs pages stay
    # allocated while any process maps it: a client that keeps the old mapping holds a second
    # memory tier's worth of /dev/shm, and the successor's free-space check or writes can fail.
    import gc

    server = start_server()
    c = make_client(name="remap", ping=False, retry_interval_s=0.05)  # no pinger holding the old link
    (v,) = _values(1, 4096, 7)
    assert c.put(["k"], [[v]]) == [OK]
    assert c.exists(["k"], lease=True) == [True]  # a lookup lease kept for a load that never comes
    old = c.server_info.arena_name
    assert _mapped(old)
    server.kill()
    start_server(socket_path=sock_path)
    c.put(["k"], [[v]])  # the first call after the kill finds the connection gone
    assert c.wait_connected(10)
    assert c.server_info.arena_name != old
    gc.collect()
    assert not _mapped(old)
