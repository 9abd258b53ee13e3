"""Integrity at read for the shared arena: every client maps the arena read-write (puts copy
into it), so a client of the pool can overwrite an object another one committed. The writer's
checksum, kept in the server's memory, turns such bytes into a miss (CHECKSUM_MISMATCH,
counted) instead of a hit with code 0."""

from __future__ import annotations

import numpy as np

from kvpool.backends.pool_server import ServerBackend
from kvpool.errors import CHECKSUM_MISMATCH, OK
from kvpool.server import protocol as P


def _tamper(client, key: str) -> None:
    """Overwrite `key`'s bytes in the arena through `client`'s own mapping, as a rogue client could."""
    reply = client.acquire([key])
    assert isinstance(reply, P.Acquired) and reply.codes == [OK]
    off, size = reply.offsets[0], reply.sizes[0]
    client.arena[off : off + size] ^= 0xFF
    client.release(reply.lease_ids)


def test_overwritten_object_is_a_counted_miss(start_server, sock_path, make_client):
    start_server()
    writer = ServerBackend(sock_path, "writer")
    reader = ServerBackend(sock_path, "reader")
    rogue = make_client(name="rogue")
    try:
        value = np.arange(8192, dtype=np.uint32).view(np.uint8)
        assert writer.batch_put(["k", "untouched"], [[value[:16384]], [value[16384:]]]) == [OK, OK]
        assert rogue.wait_connected(10)
        _tamper(rogue, "k")
        dest = [np.zeros(16384, np.uint8)]
        other = [np.zeros(16384, np.uint8)]
        assert reader.batch_get_into(["k", "untouched"], [dest, other]) == [CHECKSUM_MISMATCH, OK]
        assert np.array_equal(other[0], value[16384:])
        st = reader.stats()
        assert st["corrupt_reads"] == 1 and st["gets"] == 1
        # The reader's report made the server check "k" itself: damaged, so dropped. The key
        # misses, and the next put stores good bytes instead of meeting put-if-absent.
        assert reader.batch_exists(["k", "untouched"]) == [False, True]
        assert writer.batch_put(["k"], [[value[:16384]]]) == [OK]
        assert reader.batch_get_into(["k"], [dest]) == [OK] and np.array_equal(dest[0], value[:16384])
    finally:
        writer.close()
        reader.close()


def test_segments_are_checked_as_one_value(start_server, sock_path):
    # A KV block arrives as one buffer per layer segment: the checksum covers them back to back.
    start_server()
    b = ServerBackend(sock_path, "segments")
    try:
        segs = [np.full(4096, i, np.uint8) for i in range(6)]
        assert b.batch_put(["blk"], [segs]) == [OK]
        out = [np.zeros(4096, np.uint8) for _ in range(3)] + [np.zeros(3 * 4096, np.uint8)]
        assert b.batch_get_into(["blk"], [out]) == [OK]
        assert np.array_equal(np.concatenate(out), np.concatenate(segs))
    finally:
        b.close()


def test_commit_with_wrong_number_of_checksums_is_refused(start_server, make_client):
    start_server()
    c = make_client(name="odd")
    assert c.wait_connected(10)
    alloc = c.allocate(["x", "y"], [64, 64])
    assert isinstance(alloc, P.Allocated) and alloc.codes == [OK, OK]
    reply = c._call(P.Commit(alloc.handles, [1]), P.Codes, 2)
    assert isinstance(reply, P.Error)


def test_a_guarded_read_on_the_openmp_team_is_checked_too(start_server, sock_path, make_client, monkeypatch):
    """As in vLLM's worker: the backend behind its guard (as `create_backend` builds it), copy
    threads > 1, called from the main thread with torch's OpenMP runtime loaded. The read is
    handed back to this thread and copied and hashed on its team (on x86-64), and a tampered
    value is still a counted miss while the rest of the batch lands exactly."""
    import platform

    import torch

    from kvpool.backends.guard import GuardSettings
    from kvpool.store import streamcopy

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    calls: list[int] = []
    real = streamcopy.copy_hash_team
    monkeypatch.setattr(streamcopy, "copy_hash_team", lambda *a: (calls.append(a[-1]), real(*a))[1])
    start_server()
    writer = ServerBackend(sock_path, "writer")
    reader = ServerBackend(sock_path, "reader")
    reader.use_guard(GuardSettings())
    reader.use_copy_threads(2)
    rogue = make_client(name="rogue")
    try:
        rng = np.random.default_rng(5)
        values = [[rng.integers(0, 256, 128 << 10, dtype=np.uint8) for _ in range(4)] for _ in range(6)]
        keys = [f"blk{i}" for i in range(6)]  # 6 x 512 KiB: a batch worth the team
        assert writer.batch_put(keys, values) == [OK] * 6
        assert rogue.wait_connected(10)
        _tamper(rogue, "blk3")
        dests = [[np.zeros(128 << 10, np.uint8) for _ in range(4)] for _ in range(6)]
        codes = reader.batch_get_into(keys, dests)
        assert codes == [OK, OK, OK, CHECKSUM_MISMATCH, OK, OK]
        for i in (0, 1, 2, 4, 5):
            assert np.concatenate(dests[i]).tobytes() == np.concatenate(values[i]).tobytes()
        assert reader.stats()["corrupt_reads"] == 1
        on_x86 = platform.machine().lower() in ("x86_64", "amd64")
        assert calls == ([2] if on_x86 else [])
    finally:
        torch.set_num_threads(before)
        writer.close()
        reader.close()
