"""Faults on the SSD tier: I/O errors, races between writers, readers and removers of one key."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

from kvpool.errors import ErrorCode, StoreError
from kvpool.store import disk as disk_mod


def _block_first_write(monkeypatch, disk, fail: bool) -> tuple[threading.Event, threading.Event]:
    """Make the tier's first file write wait for ``go`` (signalling ``started``), then fail with
    EIO when ``fail``; later writes run normally."""
    started, go = threading.Event(), threading.Event()
    real = disk._write
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            started.set()
            assert go.wait(10)
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(disk, "_write", write)
    return started, go


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_put_of_a_key_being_written_is_ok_only_once_a_write_of_it_landed(make_disk, monkeypatch,
                                                                          first_fails) -> None:
    # Two writers of one key (the engine's spill of an evicted object and the write-through of
    # its promoted copy): the second must not report OK while the first may still fail, or the
    # engine marks its object on disk and later evicts it without spilling: lost. When the first
    # lands, the second writes nothing more.
    disk = make_disk()
    started, go = _block_first_write(monkeypatch, disk, fail=first_fails)
    first: list[ErrorCode] = []
    writer = threading.Thread(target=lambda: first.append(disk.put("k", b"v" * 100)))
    writer.start()
    assert started.wait(10)
    second: list[ErrorCode] = []
    other = threading.Thread(target=lambda: second.append(disk.put("k", b"v" * 100)))
    other.start()
    other.join(0.3)
    assert other.is_alive()  # waiting for the first write, not answering yet
    go.set()
    writer.join(10)
    other.join(10)
    assert first == [ErrorCode.INTERNAL_ERROR if first_fails else ErrorCode.OK]
    assert second == [ErrorCode.OK]
    assert disk.contains("k") and disk.get("k") == b"v" * 100  # the OK is backed by a file
    assert disk.count == 1 and disk.used_bytes == disk.entry_size("k", 100)


@pytest.mark.parametrize("how", ["get", "read_into"])
def test_an_io_error_reading_a_file_is_a_store_error_naming_the_key(make_disk, monkeypatch, how) -> None:
    # A bad sector must read as a miss (StoreError, which the engine turns into a code), not
    # as an OSError: through the server that ends the reader's connection, on every read.
    disk = make_disk()
    assert disk.put("k", b"v" * 100) is ErrorCode.OK

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_mod.os, "preadv", eio)
    monkeypatch.setattr(disk_mod.os, "pread", eio)
    monkeypatch.setattr(disk_mod, "open", eio, raising=False)
    with pytest.raises(StoreError) as info:
        if how == "get":
            disk.get("k")
        else:
            disk.read_into("k", np.empty(100, dtype=np.uint8))
    assert "'k'" in str(info.value)
    monkeypatch.undo()
    assert not disk.contains("k") and disk.used_bytes == 0  # unreadable: dropped, not retried forever


def test_an_io_error_promoting_from_disk_is_a_miss_for_the_reader(make_engine, make_disk, monkeypatch) -> None:
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    assert disk.put("k", b"v" * 100) is ErrorCode.OK

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_mod.os, "preadv", eio)
    monkeypatch.setattr(disk_mod.os, "pread", eio)
    assert engine.acquire("c", "k") is not ErrorCode.OK
    assert isinstance(engine.batch_acquire("c", ["k", "absent"])[0], ErrorCode)
    assert engine.stats()["pending_allocations"] == 0


def _pause_after_read(monkeypatch, disk) -> tuple[threading.Event, threading.Event]:
    """Make the next checksum check wait (after the file was read) until ``go``."""
    paused, go = threading.Event(), threading.Event()
    real = disk_mod.checksum_problem
    calls = []

    def check(parsed, payload):
        calls.append(1)
        if len(calls) == 1:
            paused.set()
            assert go.wait(10)
        return real(parsed, payload)

    monkeypatch.setattr(disk_mod, "checksum_problem", check)
    return paused, go


@pytest.mark.parametrize("how", ["get", "read_into"])
def test_a_corrupt_read_does_not_delete_a_good_copy_stored_meanwhile(make_disk, monkeypatch, how) -> None:
    disk = make_disk()
    assert disk.put("k", b"v" * 100) is ErrorCode.OK
    path = disk.file_path("k")
    with open(path, "r+b") as f:  # damage the payload's last byte
        f.seek(-1, os.SEEK_END)
        f.write(b"x")
    paused, go = _pause_after_read(monkeypatch, disk)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            disk.get("k") if how == "get" else disk.read_into("k", np.empty(100, dtype=np.uint8))
        except StoreError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert paused.wait(10)
    # Meanwhile the damaged copy is removed and a good one stored (acknowledged with OK).
    assert disk.remove("k") is ErrorCode.OK
    assert disk.put("k", b"v" * 100) is ErrorCode.OK
    go.set()
    reader.join(10)
    assert len(errors) == 1  # the damaged copy it read is never passed off as data
    assert disk.contains("k") and disk.get("k") == b"v" * 100  # the acknowledged one survives


def test_a_vanished_file_does_not_unlist_a_copy_stored_meanwhile(make_disk, monkeypatch) -> None:
    disk = make_disk()
    assert disk.put("k", b"v" * 100) is ErrorCode.OK
    real_open = os.open
    swapped = []

    def racing_open(path, *args, **kwargs):
        if path == os.path.basename(disk.file_path("k")) and not swapped:  # opened relative to its shard
            swapped.append(1)
            # Between the reader's index check and its open: removed, then stored again.
            assert disk.remove("k") is ErrorCode.OK
            monkeypatch.setattr(disk_mod.os, "open", real_open)
            assert disk.put("k", b"v" * 100) is ErrorCode.OK
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(disk_mod.os, "open", racing_open)
    with pytest.raises(StoreError):
        disk.read_into("k", np.empty(100, dtype=np.uint8))
    assert disk.contains("k") and disk.get("k") == b"v" * 100
    assert disk.used_bytes == disk.entry_size("k", 100)


def test_a_disk_that_refuses_unlinks_fails_puts_with_a_code_and_leaks_no_reservation(make_disk, monkeypatch) -> None:
    # A failing SSD is often remounted read-only: unlinking an evicted file then fails with
    # EROFS. A put must answer with a code (the engine writes spills on its callers' threads),
    # and must not leave its key reserved: that would answer every later put of it OK unwritten.
    disk = make_disk(quota_bytes=2 * disk_mod.DiskTier.entry_size("k0", 100), policy="fifo")
    for key in ("k0", "k1"):
        assert disk.put(key, b"v" * 100) is ErrorCode.OK

    def erofs(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(disk_mod.os, "unlink", erofs)
    monkeypatch.setattr(disk, "_write", lambda *a, **k: erofs(a[0]))
    assert disk.put("k2", b"v" * 100) is ErrorCode.INTERNAL_ERROR
    assert disk.used_bytes == disk.entry_size("k1", 100) and disk._order.writing == 0
    monkeypatch.undo()
    assert disk.put("k2", b"v" * 100) is ErrorCode.OK and disk.get("k2") == b"v" * 100


def test_a_spill_the_disk_raises_on_leaves_no_copy_in_the_spill_buffer(make_engine, make_disk, monkeypatch) -> None:
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk, disk_write_through=False)

    def broken(key, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk, "put", broken)
    for i in range(20):  # each eviction spills; none of them can be written
        assert engine.put("c", f"k{i}", [np.full(200, i, dtype=np.uint8)]) is ErrorCode.OK
    assert engine.stats()["spilling"] == 0  # no evicted copy kept in memory forever
    assert engine.stats()["disk_write_errors"] > 0


def test_an_object_whose_spill_fails_while_its_promoted_copy_is_written_through_is_not_lost(
    make_engine, make_disk, monkeypatch
) -> None:
    # k is evicted before the write-through reached it, so its spill writes it (and fails, EIO);
    # meanwhile a reader promotes it from the spill buffer and the write-through writes that
    # copy. Before the fix the second write answered OK at once, so the engine marked k on disk,
    # evicted it without a spill, and k was gone.
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    real = disk._write
    gates = {name: (threading.Event(), threading.Event()) for name in ("block", "k")}
    (block_started, block_go), (k_started, k_go) = gates["block"], gates["k"]

    def write(final, key_bytes, views, payload_len):
        gate = gates.pop(key_bytes.decode(), None)
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(10)
            if key_bytes == b"k":
                raise OSError(errno.EIO, "Input/output error")
        return real(final, key_bytes, views, payload_len)

    monkeypatch.setattr(disk, "_write", write)
    real_put, writer_at_k = disk.put, threading.Event()

    def put(key, data):
        if key == "k" and threading.current_thread().name == "kvpool-disk-writer":
            writer_at_k.set()
        return real_put(key, data)

    monkeypatch.setattr(disk, "put", put)
    value = np.arange(200, dtype=np.uint8)
    assert engine.put("c", "block", [value]) is ErrorCode.OK  # holds the write-through thread
    assert block_started.wait(10)
    assert engine.put("c", "k", [value]) is ErrorCode.OK  # queued behind it
    spiller = threading.Thread(
        target=lambda: [engine.put("c", f"f{i}", [value]) for i in range(3)])  # evicts k: spill
    spiller.start()
    assert k_started.wait(10)
    lease = engine.acquire("c", "k")  # from the spill buffer, promoted into memory
    assert not isinstance(lease, ErrorCode)
    engine.release(lease)
    block_go.set()  # the write-through now reaches the promoted k, while its spill is in flight
    assert writer_at_k.wait(10)
    time.sleep(0.2)  # let it answer (before the fix: OK at once) or wait (after)
    k_go.set()  # the spill fails
    spiller.join(10)
    deadline = time.monotonic() + 10
    while not disk.contains("k") and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(3, 8):  # evict k again
        assert engine.put("c", f"f{i}", [value]) is ErrorCode.OK
    out = np.zeros(200, dtype=np.uint8)
    assert engine.get_into("c", "k", [out]) is ErrorCode.OK and (out == value).all()


@pytest.mark.parametrize("call", ["unlink", "replace"])
def test_a_hung_device_does_not_stall_the_engine(make_engine, make_disk, monkeypatch, call) -> None:
    # Every commit asks the tier `contains` under the engine lock. An unlink or a rename that
    # hangs in the kernel (a failing SSD) used to hang while holding the lock that answers it,
    # and with it the engine lock: every client of the pool stalled, memory hits included.
    entry = disk_mod.DiskTier.entry_size("k0", 200)
    disk = make_disk(quota_bytes=2 * entry, policy="fifo")
    engine = make_engine(memory_size=1 << 16, disk=disk)
    value = np.arange(200, dtype=np.uint8)
    for key in ("k0", "k1"):
        assert engine.put("c", key, [value]) is ErrorCode.OK
    deadline = time.monotonic() + 10
    while disk.count < 2 and time.monotonic() < deadline:  # the write-through wrote both
        time.sleep(0.01)
    assert disk.count == 2
    hung, release = threading.Event(), threading.Event()
    real = getattr(disk_mod.os, call)

    def hanging(path, *args, **kwargs):
        if call == "replace" or disk_mod._TMP_MARK not in str(path):
            hung.set()
            release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk_mod.os, call, hanging)
    try:
        # Its write-through evicts k0 from the tier: the unlink (or the rename) hangs.
        assert engine.put("c", "k2", [value]) is ErrorCode.OK
        assert hung.wait(10)
        results: list[object] = []

        def serve() -> None:
            out = np.zeros(200, dtype=np.uint8)
            results.append(engine.get_into("c", "k1", [out]))  # a memory hit
            results.append(engine.put("c", "k3", [value]))  # a commit: asks the tier
            results.append(engine.exists(["k0", "k1", "k3"]))
            results.append((out == value).all())

        client = threading.Thread(target=serve)
        client.start()
        client.join(10)
        assert not client.is_alive(), "the engine stalled behind the hung device"
        assert results == [ErrorCode.OK, ErrorCode.OK, [True, True, True], True]
    finally:
        release.set()


def test_a_deletion_decided_before_a_new_copy_is_renamed_never_takes_it(make_disk) -> None:
    # An evicted or removed key's file is deleted after the index lock is released, so a put of
    # the same key can store a new copy before that deletion runs: the deletion must happen
    # before the rename (whichever thread gets there first), never after it.
    disk = make_disk()
    assert disk.put("k", b"a" * 100) is ErrorCode.OK
    with disk._lock:  # what an eviction leaves between deciding and deleting
        assert disk._order.discard("k")
        disk._doomed.add("k")
    assert disk.put("k", b"b" * 100) is ErrorCode.OK
    disk._delete_doomed()  # the evicting thread's deletion, late
    assert disk.contains("k") and disk.get("k") == b"b" * 100


@pytest.mark.parametrize("restart_index", [True, False])
def test_a_torn_file_from_before_a_restart_does_not_cost_the_memory_copy(make_engine, make_disk,
                                                                         restart_index) -> None:
    # Files are not fsynced, so a crash can leave one whose header and size are right and whose
    # payload is not: the start-up scan reads headers only. A put of that key used to be taken
    # as "already on disk": its memory copy was later evicted without a spill, and the key lost
    # on the next read. Such a file is now written again; one a read has checked is trusted.
    value = np.arange(200, dtype=np.uint8)
    first = make_disk()
    for key in ("torn", "whole"):
        assert first.put(key, value.tobytes()) is ErrorCode.OK
    if restart_index:
        first.close()  # a clean stop writes the restart index
    else:
        os.close(first._lock_fd)  # a crash: no index, the next start scans the headers
        first._lock_fd = None
    with open(first.file_path("torn"), "r+b") as f:  # the tearing: the payload's end is zeros
        f.seek(-50, os.SEEK_END)
        f.write(bytes(50))
    disk = make_disk()
    assert disk.loaded_index is restart_index and disk.contains("torn")
    out = np.zeros(200, dtype=np.uint8)
    assert disk.read_into("whole", out) == disk_mod.xxhash.xxh3_64_intdigest(value)  # checked now
    assert disk.contains_checked("whole") and not disk.contains_checked("torn")
    assert disk.used_bytes == disk.entry_size("torn", 200) + disk.entry_size("whole", 200)
    engine = make_engine(memory_size=1024, disk=disk)
    for key in ("torn", "whole"):  # e.g. another instance computed them again
        assert engine.put("c", key, [value]) is ErrorCode.OK
    deadline = time.monotonic() + 10
    while (engine.stats()["disk_queue"] or any(o.pins for o in list(engine._index.objects.values()))) \
            and time.monotonic() < deadline:  # the write-through has done what it will
        time.sleep(0.01)
    for i in range(8):  # evict both from memory
        assert engine.put("c", f"f{i}", [np.full(200, i, dtype=np.uint8)]) is ErrorCode.OK
    for key in ("torn", "whole"):
        out[:] = 0
        assert engine.get_into("c", key, [out]) is ErrorCode.OK and (out == value).all(), key


def test_a_put_that_meets_a_failing_promotion_of_its_key_is_stored(make_engine, make_disk, monkeypatch) -> None:
    # A reader promotes k from disk while a client puts k. The put used to be answered "already
    # exists" (OK to the client); when the promotion then found the file corrupt it published
    # nothing, and the client's bytes were lost. The put now overtakes the promotion.
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    value = np.arange(200, dtype=np.uint8)
    assert engine.put("c", "k", [value]) is ErrorCode.OK
    for i in range(8):  # evict k: it is on disk only
        assert engine.put("c", f"f{i}", [np.full(200, i, dtype=np.uint8)]) is ErrorCode.OK
    deadline = time.monotonic() + 10
    while not disk.contains("k") and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(disk.file_path("k"), "r+b") as f:  # the disk copy goes bad
        f.seek(-1, os.SEEK_END)
        f.write(b"x")
    started, go = _pause_after_read(monkeypatch, disk)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(engine.acquire("r", "k")))
    reader.start()
    assert started.wait(10)
    assert engine.put("c", "k", [value]) is ErrorCode.OK  # while the promotion reads
    go.set()
    reader.join(10)
    assert got == [ErrorCode.CHECKSUM_MISMATCH]  # the reader's miss, never wrong bytes
    assert engine.stats()["pending_allocations"] == 0
    monkeypatch.undo()
    out = np.zeros(200, dtype=np.uint8)
    assert engine.get_into("c", "k", [out]) is ErrorCode.OK and (out == value).all()


def test_a_promotion_a_put_overtook_still_serves_its_reader(make_engine, make_disk, monkeypatch) -> None:
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    value = np.arange(200, dtype=np.uint8)
    assert engine.put("c", "k", [value]) is ErrorCode.OK
    for i in range(8):
        assert engine.put("c", f"f{i}", [np.full(200, i, dtype=np.uint8)]) is ErrorCode.OK
    deadline = time.monotonic() + 10
    while not disk.contains("k") and time.monotonic() < deadline:
        time.sleep(0.01)
    started, go, real = threading.Event(), threading.Event(), disk.read_into

    def slow_read(key, dest):
        started.set()
        assert go.wait(10)
        return real(key, dest)

    monkeypatch.setattr(disk, "read_into", slow_read)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(engine.acquire("r", "k")))
    reader.start()
    assert started.wait(10)
    assert engine.put("c", "k", [value]) is ErrorCode.OK
    go.set()
    reader.join(10)
    lease = got[0]
    assert not isinstance(lease, ErrorCode)
    served = lease.data if lease.data is not None else engine.arena[lease.offset : lease.offset + lease.size]
    assert bytes(served) == value.tobytes()
    engine.release(lease)
    stats = engine.stats()
    assert stats["pending_allocations"] == 0 and stats["object_count"] <= 5  # its range went back
    out = np.zeros(200, dtype=np.uint8)
    assert engine.get_into("c", "k", [out]) is ErrorCode.OK and (out == value).all()


def test_a_promotion_whose_overtaking_put_is_aborted_publishes_after_all(make_engine, make_disk,
                                                                         monkeypatch) -> None:
    disk = make_disk()
    engine = make_engine(memory_size=1024, disk=disk)
    value = np.arange(200, dtype=np.uint8)
    assert engine.put("c", "k", [value]) is ErrorCode.OK
    for i in range(8):
        assert engine.put("c", f"f{i}", [np.full(200, i, dtype=np.uint8)]) is ErrorCode.OK
    deadline = time.monotonic() + 10
    while not disk.contains("k") and time.monotonic() < deadline:
        time.sleep(0.01)
    started, go, real = threading.Event(), threading.Event(), disk.read_into

    def slow_read(key, dest):
        started.set()
        assert go.wait(10)
        return real(key, dest)

    monkeypatch.setattr(disk, "read_into", slow_read)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(engine.acquire("r", "k")))
    reader.start()
    assert started.wait(10)
    overtaking = engine.allocate("c", "k", 200)
    assert not isinstance(overtaking, ErrorCode)
    assert engine.abort(overtaking.handle) is ErrorCode.OK  # e.g. the client's copy failed
    go.set()
    reader.join(10)
    lease = got[0]
    assert not isinstance(lease, ErrorCode) and lease.data is None  # published in the arena
    assert bytes(engine.arena[lease.offset : lease.offset + lease.size]) == value.tobytes()
    engine.release(lease)
    assert engine.stats()["promotions"] == 1 and engine.stats()["pending_allocations"] == 0


def test_close_waits_for_a_slow_ssd_and_gives_a_hung_one_up(make_engine, make_disk, monkeypatch) -> None:
    # close flushes the write-through queue as long as files keep completing: a slow device is
    # waited for however long the whole flush takes, a device that stopped answering is given up
    # (a stopped server must not wait for it forever), its directory left locked.
    from kvpool.errors import ConfigError
    from kvpool.store import disk_link

    monkeypatch.setattr(disk_link, "CLOSE_STALL_S", 0.5)
    value = np.arange(200, dtype=np.uint8)
    slow_disk = make_disk()
    real_put = slow_disk.put

    def slow_put(key, data):
        time.sleep(0.2)
        return real_put(key, data)

    monkeypatch.setattr(slow_disk, "put", slow_put)
    engine = make_engine(memory_size=1 << 16, disk=slow_disk)
    for i in range(6):  # 1.2 s of writes in all, over twice the stall limit
        assert engine.put("c", f"s{i}", [value]) is ErrorCode.OK
    engine.close()
    assert all(slow_disk.contains(f"s{i}") for i in range(6))
    path = slow_disk.path

    hung_disk = make_disk()  # the same directory, its lock released by the first close
    hung, release = threading.Event(), threading.Event()

    def hung_put(key, data):
        hung.set()
        release.wait(30)
        return ErrorCode.OK

    monkeypatch.setattr(hung_disk, "put", hung_put)
    engine = make_engine(memory_size=1 << 16, disk=hung_disk)
    try:
        assert engine.put("c", "h", [value]) is ErrorCode.OK
        assert hung.wait(10)
        closer = threading.Thread(target=engine.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close waited for a hung SSD"
        with pytest.raises(ConfigError):  # given up, not released: the stuck writer may still write
            disk_mod.DiskTier(path, 1 << 20, "none")
    finally:
        release.set()
