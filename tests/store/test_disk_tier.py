"""DiskTier: quota policies, checksums, restart scan, offload-path rules."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import numpy as np
import pytest

from kvpool.errors import ConfigError, ErrorCode, StoreError
from kvpool.paths import validate_offload_path
from kvpool.store import DiskTier
from kvpool.store import disk as disk_module
from kvpool.store import disk_format
from kvpool.store.buffers import checksum

READS = ["get", "read_into"]


def file_of(disk: DiskTier, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(disk.path, digest[:2], digest)


def read(disk: DiskTier, key: str, how: str) -> bytes:
    """``key``'s payload through ``get``, or through ``read_into`` (whose digest must be the
    payload's `buffers.checksum`, as the memory tier keeps it)."""
    if how == "get":
        return disk.get(key)
    dest = np.full(disk.payload_size(key) or 0, 0xAA, dtype=np.uint8)
    assert disk.read_into(key, dest) == checksum([dest])
    return dest.tobytes()


def quota_for(n: int, key_len: int = 2, payload: int = 100) -> int:
    return n * DiskTier.entry_size("k" * key_len, payload)


def test_roundtrip_with_buffer_list_and_accounting(make_disk) -> None:
    disk = make_disk()
    parts = [np.arange(10, dtype=np.uint8), memoryview(b"xyz"), b""]
    assert disk.put("key", parts) is ErrorCode.OK
    assert disk.get("key") == bytes(range(10)) + b"xyz"
    assert disk.contains("key") and disk.count == 1
    assert disk.used_bytes == DiskTier.entry_size("key", 13) == os.path.getsize(file_of(disk, "key"))
    assert disk.put("key", b"other") is ErrorCode.OK  # immutable: no-op
    assert disk.get("key") == bytes(range(10)) + b"xyz"
    assert disk.remove("key") is ErrorCode.OK
    assert not os.path.exists(file_of(disk, "key"))
    assert disk.remove("key") is ErrorCode.OBJECT_NOT_FOUND
    assert disk.used_bytes == 0
    with pytest.raises(StoreError) as exc:
        disk.get("key")
    assert exc.value.code is ErrorCode.OBJECT_NOT_FOUND


def test_empty_payload(make_disk) -> None:
    disk = make_disk()
    assert disk.put("e", b"") is ErrorCode.OK
    assert disk.get("e") == b""


def test_policy_none_rejects_when_full(make_disk) -> None:
    disk = make_disk(quota_bytes=quota_for(3), policy="none")
    for i in range(3):
        assert disk.put(f"k{i}", bytes(100)) is ErrorCode.OK
    assert disk.put("k3", bytes(100)) is ErrorCode.NO_AVAILABLE_HANDLE
    assert disk.keys() == ["k0", "k1", "k2"]
    assert disk.evictions == 0


def test_policy_fifo_evicts_oldest_written_even_if_read(make_disk) -> None:
    disk = make_disk(quota_bytes=quota_for(3), policy="fifo")
    for i in range(3):
        disk.put(f"k{i}", bytes(100))
    disk.get("k0")
    assert disk.put("k3", bytes(100)) is ErrorCode.OK
    assert sorted(disk.keys()) == ["k1", "k2", "k3"]
    assert not os.path.exists(file_of(disk, "k0"))


def test_policy_lru_evicts_least_recently_read(make_disk) -> None:
    disk = make_disk(quota_bytes=quota_for(3), policy="lru")
    for i in range(3):
        disk.put(f"k{i}", bytes(100))
    disk.get("k0")
    disk.get("k1")
    assert disk.put("k3", bytes(100)) is ErrorCode.OK
    assert sorted(disk.keys()) == ["k0", "k1", "k3"]
    # A double-size object needs two victims: k0 then k1 are now the oldest reads.
    assert disk.put("k4", bytes(200 + DiskTier.entry_size("k4", 0))) is ErrorCode.OK
    assert sorted(disk.keys()) == ["k3", "k4"]
    assert disk.used_bytes <= disk.quota_bytes


def test_object_larger_than_quota_is_rejected_without_evicting(make_disk) -> None:
    disk = make_disk(quota_bytes=quota_for(2), policy="fifo")
    disk.put("k0", bytes(100))
    assert disk.put("big", bytes(quota_for(2))) is ErrorCode.NO_AVAILABLE_HANDLE
    assert disk.keys() == ["k0"]


@pytest.mark.parametrize("how", READS)
def test_bit_flip_is_a_checksum_mismatch_never_data(make_disk, how: str) -> None:
    disk = make_disk()
    disk.put("k", bytes(range(200)))
    assert read(disk, "k", how) == bytes(range(200))
    path = file_of(disk, "k")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 50)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(StoreError) as exc:
        read(disk, "k", how)
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH
    assert disk.checksum_failures == 1
    assert not os.path.exists(path) and not disk.contains("k") and disk.used_bytes == 0
    with pytest.raises(StoreError) as exc:
        read(disk, "k", how)
    assert exc.value.code is ErrorCode.OBJECT_NOT_FOUND


@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("keep", [10, 40, 100])  # inside header, inside key, inside payload
def test_truncated_file_is_a_checksum_mismatch(make_disk, keep: int, how: str) -> None:
    disk = make_disk()
    disk.put("some-key", bytes(500))
    path = file_of(disk, "some-key")
    os.truncate(path, keep)
    with pytest.raises(StoreError) as exc:
        read(disk, "some-key", how)
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH
    assert not disk.contains("some-key")


@pytest.mark.parametrize("how", READS)
def test_trailing_bytes_are_a_checksum_mismatch(make_disk, how: str) -> None:
    disk = make_disk()
    disk.put("k", bytes(300))
    with open(file_of(disk, "k"), "ab") as f:
        f.write(b"\0")
    with pytest.raises(StoreError) as exc:
        read(disk, "k", how)
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH and not disk.contains("k")


@pytest.mark.parametrize("how", READS)
def test_files_of_the_first_format_still_read_and_are_checked(make_disk, how: str) -> None:
    """Version 1 files (crc32 of the payload) written before version 2 are served, and checked."""
    disk = make_disk()
    value = bytes(range(256)) * 3
    disk.put("old", value)
    path = file_of(disk, "old")
    with open(path, "r+b") as f:
        f.write(struct.pack("<4sHHIQI", disk_format.MAGIC, 1, 0, 3, len(value), zlib.crc32(value)))
    assert read(disk, "old", how) == value
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    with pytest.raises(StoreError) as exc:
        read(disk, "old", how)
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH and not os.path.exists(path)


def test_read_into_asks_again_after_short_reads(make_disk, monkeypatch) -> None:
    """A read may return fewer bytes than asked for (a signal, some file systems): the rest of
    the payload is asked for again, never taken as a short file."""
    disk = make_disk()
    value = bytes(range(256)) * 4
    disk.put("key-of-some-length", value)
    disk.put("trailing", value)
    with open(file_of(disk, "trailing"), "ab") as f:
        f.write(b"\0")
    real, calls = os.preadv, []

    def at_most_7_bytes(fd: int, views: list, offset: int) -> int:
        calls.append(offset)
        first = memoryview(views[0])[:7]
        return real(fd, [first], offset)

    monkeypatch.setattr(disk_module.os, "preadv", at_most_7_bytes)
    assert read(disk, "key-of-some-length", "read_into") == value
    assert len(calls) > len(value) // 7
    with pytest.raises(StoreError) as exc:
        read(disk, "trailing", "read_into")
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH and not disk.contains("trailing")


def test_read_into_a_buffer_of_another_size_is_a_miss_and_keeps_the_file(make_disk) -> None:
    """The key was evicted and stored again with another size between the index lookup and
    the read: a miss, and the whole, valid file stays."""
    disk = make_disk()
    disk.put("k", bytes(100))
    with pytest.raises(StoreError) as exc:
        disk.read_into("k", np.zeros(99, np.uint8))
    assert exc.value.code is ErrorCode.OBJECT_NOT_FOUND
    assert disk.contains("k") and disk.checksum_failures == 0 and read(disk, "k", "read_into") == bytes(100)
    assert disk.payload_size("k") == 100 and disk.payload_size("absent") is None


def test_restart_rebuilds_index_and_removes_bad_files(make_disk, ssd_dir) -> None:
    disk = make_disk(policy="fifo")
    for i in range(3):
        disk.put(f"k{i}", bytes([i]) * 50)
        # mtime decides the fifo order after a restart; make it unambiguous.
        os.utime(file_of(disk, f"k{i}"), (1000 + i, 1000 + i))
    disk.put("trunc", bytes(300))
    os.truncate(file_of(disk, "trunc"), 60)
    stale_tmp = file_of(disk, "k0") + ".tmp.123.0"
    open(stale_tmp, "wb").write(b"partial")
    garbage = os.path.join(ssd_dir, "ab", "ab" + "0" * 62)
    os.makedirs(os.path.dirname(garbage), mode=0o700, exist_ok=True)
    with open(os.open(garbage, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:  # named and made as the tier's
        f.write(b"not a kvpool file")
    unrelated = os.path.join(ssd_dir, "README")
    open(unrelated, "w").write("keep me")

    disk.close()  # the directory's lock: one tier per directory at a time
    again = DiskTier(ssd_dir, disk.quota_bytes, "fifo")
    assert again.keys() == ["k0", "k1", "k2"]
    assert again.get("k1") == bytes([1]) * 50
    assert again.used_bytes == 3 * DiskTier.entry_size("k0", 50)
    assert again.removed_at_scan == 2
    assert not os.path.exists(stale_tmp) and not os.path.exists(garbage)
    assert os.path.exists(unrelated)


def test_restart_with_smaller_quota_evicts_oldest(make_disk, ssd_dir) -> None:
    disk = make_disk(policy="fifo")
    for i in range(3):
        disk.put(f"k{i}", bytes(100))
        os.utime(file_of(disk, f"k{i}"), (1000 + i, 1000 + i))
    disk.close()
    again = DiskTier(ssd_dir, quota_for(2), "fifo")
    assert again.keys() == ["k1", "k2"]


def test_bad_constructor_arguments(ssd_dir) -> None:
    with pytest.raises(ConfigError):
        DiskTier(ssd_dir, 100, "random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DiskTier(ssd_dir, 0, "none")


class TestOffloadPath:
    def test_accepts_a_plain_writable_directory(self, ssd_dir) -> None:
        validate_offload_path(ssd_dir)
        validate_offload_path(ssd_dir + "/")

    @pytest.mark.parametrize("path", ["relative/dir", "./x", ""])
    def test_rejects_relative(self, path: str) -> None:
        with pytest.raises(ConfigError) as exc:
            validate_offload_path(path)
        assert exc.value.key == "ssd_offload_path" and exc.value.value == path

    def test_rejects_dotdot(self, ssd_dir) -> None:
        os.mkdir(os.path.join(ssd_dir, "a"))
        with pytest.raises(ConfigError) as exc:
            validate_offload_path(os.path.join(ssd_dir, "a", "..", "a"))
        assert "'..'" in exc.value.expected

    def test_rejects_nonexistent(self, ssd_dir) -> None:
        with pytest.raises(ConfigError) as exc:
            validate_offload_path(os.path.join(ssd_dir, "missing"))
        assert "existing directory" in exc.value.expected

    def test_rejects_a_file(self, ssd_dir) -> None:
        path = os.path.join(ssd_dir, "file")
        open(path, "w").close()
        with pytest.raises(ConfigError) as exc:
            validate_offload_path(path)
        assert "directory" in exc.value.expected

    def test_rejects_symlink_itself_and_in_a_parent(self, ssd_dir) -> None:
        real = os.path.join(ssd_dir, "real")
        os.makedirs(os.path.join(real, "sub"))
        link = os.path.join(ssd_dir, "link")
        os.symlink(real, link)
        for path in (link, os.path.join(link, "sub")):
            with pytest.raises(ConfigError) as exc:
                validate_offload_path(path)
            assert "symlink" in exc.value.expected

    def test_rejects_read_only(self) -> None:
        # sysfs refuses new files even to root, unlike a chmod-ed directory.
        with pytest.raises(ConfigError) as exc:
            validate_offload_path("/sys/kernel")
        assert "writable" in exc.value.expected


def _disk_full_once(monkeypatch, disk: DiskTier, times: int = 1) -> list[int]:
    """The next `times` file writes meet a full disk (ENOSPC), as when something else on the
    device filled it below our quota."""
    import errno

    real, calls = disk._write, []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(disk, "_write", write)
    return calls


@pytest.mark.parametrize("policy", ["fifo", "lru", "s3fifo"])  # nothing read: s3fifo evicts as fifo
def test_a_full_disk_below_the_quota_evicts_and_lowers_the_quota(make_disk, monkeypatch, policy) -> None:
    disk = make_disk(quota_bytes=quota_for(10), policy=policy)
    for i in range(4):
        assert disk.put(f"k{i}", bytes(100)) is ErrorCode.OK
    calls = _disk_full_once(monkeypatch, disk)
    assert disk.put("k4", bytes(100)) is ErrorCode.OK  # evicted one, wrote on the second try
    assert len(calls) == 2 and disk.full_disk_events == 1
    assert disk.keys() == ["k1", "k2", "k3", "k4"] and disk.evictions == 1
    assert disk.quota_bytes == quota_for(4)  # from now on it evicts before the disk says no
    assert disk.put("k5", bytes(100)) is ErrorCode.OK
    assert disk.keys() == ["k2", "k3", "k4", "k5"] and len(calls) == 3


def test_a_full_disk_with_policy_none_fails_the_write_and_keeps_the_files(make_disk, monkeypatch) -> None:
    disk = make_disk(quota_bytes=quota_for(10), policy="none")
    for i in range(2):
        assert disk.put(f"k{i}", bytes(100)) is ErrorCode.OK
    _disk_full_once(monkeypatch, disk)
    assert disk.put("k2", bytes(100)) is ErrorCode.INTERNAL_ERROR
    assert disk.keys() == ["k0", "k1"] and disk.used_bytes == quota_for(2)
    assert disk.put("k3", bytes(100)) is ErrorCode.NO_AVAILABLE_HANDLE  # the lowered quota says no first


@pytest.mark.parametrize("policy", ["none", "lru"])
def test_a_quota_a_full_disk_lowered_grows_back_once_the_disk_has_room(make_disk, monkeypatch, policy) -> None:
    disk = make_disk(quota_bytes=quota_for(10), policy=policy)
    for i in range(2):
        assert disk.put(f"k{i}", bytes(100)) is ErrorCode.OK
    _disk_full_once(monkeypatch, disk)
    disk.put("k2", bytes(100))
    lowered = disk.quota_bytes
    assert lowered < quota_for(4)
    real_statvfs = os.fstatvfs
    free = {"bytes": 0}

    def statvfs(fd):
        st = real_statvfs(fd)
        return type("St", (), {"f_bavail": free["bytes"] // st.f_frsize, "f_frsize": st.f_frsize})()

    monkeypatch.setattr(disk_module.os, "fstatvfs", statvfs)  # the tier asks its directory's descriptor
    monkeypatch.setattr(disk, "_regrow_at", 0.0)
    disk.put("k3", bytes(100))  # still full: the quota stays where the disk put it
    assert disk.quota_bytes == lowered
    free["bytes"] = 1 << 30  # whatever filled the disk went away
    monkeypatch.setattr(disk, "_regrow_at", 0.0)
    for i in range(4, 10):
        assert disk.put(f"k{i}", bytes(100)) is ErrorCode.OK
    assert disk.quota_bytes == quota_for(10)
    assert all(disk.contains(f"k{i}") for i in range(4, 10))  # none of them evicted or refused


# ---- restart index ----------------------------------------------------------------------------


def test_clean_restart_takes_the_index_and_keeps_the_order(make_disk, ssd_dir) -> None:
    disk = make_disk(policy="lru")
    for i in range(5):
        disk.put(f"k{i}", bytes([i]) * 40)
    disk.get("k0")  # most recently read: last in eviction order
    disk.close()
    assert os.path.exists(os.path.join(ssd_dir, ".kvpool.index"))
    again = DiskTier(ssd_dir, disk.quota_bytes, "lru")
    assert again.loaded_index
    assert again.keys() == ["k1", "k2", "k3", "k4", "k0"]
    assert again.used_bytes == 5 * DiskTier.entry_size("k0", 40)
    assert again.get("k3") == bytes([3]) * 40
    # Taken means consumed: a crash from now on must not leave it to the next start.
    assert not os.path.exists(os.path.join(ssd_dir, ".kvpool.index"))
    again.__del__()  # no close: like a crash
    third = DiskTier(ssd_dir, disk.quota_bytes, "lru")
    assert not third.loaded_index and sorted(third.keys()) == [f"k{i}" for i in range(5)]


def test_a_file_changed_in_place_after_close_is_a_miss_never_wrong_bytes(make_disk, ssd_dir) -> None:
    disk = make_disk()
    disk.put("a", b"x" * 100)
    disk.put("b", b"y" * 100)
    disk.close()
    with open(file_of(disk, "a"), "r+b") as f:  # same length, other bytes: no directory change
        f.seek(-10, os.SEEK_END)
        f.write(b"z" * 10)
    os.truncate(file_of(disk, "b"), 50)
    again = DiskTier(ssd_dir, disk.quota_bytes)
    assert again.loaded_index and again.contains("a")
    for key in ("a", "b"):
        with pytest.raises(StoreError) as err:
            again.get(key)
        assert err.value.code is ErrorCode.CHECKSUM_MISMATCH
    assert not again.contains("a") and again.used_bytes == 0


@pytest.mark.parametrize("change", ["add", "remove", "corrupt-index"])
def test_a_changed_directory_or_index_falls_back_to_the_scan(make_disk, ssd_dir, change: str) -> None:
    disk = make_disk()
    for i in range(3):
        disk.put(f"k{i}", bytes(30))
    disk.close()
    index = os.path.join(ssd_dir, ".kvpool.index")
    if change == "add":  # another writer's file, under a name this tier would use
        stray = file_of(disk, "stray")
        os.makedirs(os.path.dirname(stray), exist_ok=True)
        open(stray, "wb").write(b"not a kvpool file")
    elif change == "remove":
        os.unlink(file_of(disk, "k1"))
    else:
        blob = bytearray(open(index, "rb").read())
        blob[-20] ^= 0xFF
        open(index, "wb").write(bytes(blob))
    again = DiskTier(ssd_dir, disk.quota_bytes)
    assert not again.loaded_index
    expected = ["k0", "k2"] if change == "remove" else ["k0", "k1", "k2"]
    assert sorted(again.keys()) == expected
    assert again.used_bytes == len(expected) * DiskTier.entry_size("k0", 30)


def test_a_directory_changed_while_open_writes_no_index(make_disk, ssd_dir) -> None:
    disk = make_disk()
    disk.put("k", bytes(30))
    os.unlink(file_of(disk, "k"))  # behind the tier's back
    disk.close()
    assert not os.path.exists(os.path.join(ssd_dir, ".kvpool.index"))
    again = DiskTier(ssd_dir, disk.quota_bytes)
    assert not again.loaded_index and again.keys() == []
