"""SSD tier: one checksummed file per object under a validated directory.

Each file is a header, the key and the payload (`store/disk_format.py`, which also holds the
restart index's format). The file name is the sha256 hex of the key, in a subdirectory named by its first
two hex characters (keeps directories small when there are millions of objects).
The key is stored in the header too so a restart can rebuild the index by reading
headers only, and so a hash collision or a misplaced file is detected.

Invariants:

* a file under its final name is complete: writes go to a temp file in the same
  directory and are renamed with ``os.replace`` (atomic on POSIX). We do not
  fsync: after a power loss a file may be short or zeroed, and the length and
  checksum checks turn that into a miss instead of data;
* ``get`` and ``read_into`` never return bytes whose checksum does not match; such a file is deleted
  and counted in ``checksum_failures``;
* ``used_bytes`` (file sizes, headers included, plus in-flight writes) never
  exceeds ``quota_bytes``.

Trust (docs/security.md): the directory must be the serving user's and writable by no one
else (``validate_offload_path``); the tier opens it once and reaches every shard and file
relative to that descriptor, checking each on its own descriptor (``tierdir.TierDir``: a swapped
path, or a shard or file another user owns, is never read). It creates its shard directories
0700 and its files 0600 (``O_CREAT | O_EXCL | O_NOFOLLOW``, then ``fchmod`` so no umask widens
them), and holds an exclusive ``flock`` on ``.kvpool.lock`` in the directory for its lifetime,
so two servers or engines never share one directory (each would keep its own index and quota).

Restart: ``close`` writes an index of every stored key and file size (``.kvpool.index``,
crc32-sealed) together with the modification times of the shard directories; the next open
takes it only if the seal holds and no shard directory changed since (any file created,
renamed or removed in a shard changes its directory's mtime), and deletes it before serving,
so a process that dies without ``close`` leaves none behind. Otherwise the tier rebuilds the
index by reading every file's header. The index only lists what should be there: ``get``
still checks every file's length, key and checksum, so a stale or forged entry reads as a miss.
Thread-safe, with two locks. The index lock guards the index, the writes in flight and the
files still to be deleted, and is never held over a system call: the engine asks ``contains``
under its own lock, so a hung device must not be able to hold the index lock (it would stall
every client of the pool, memory hits included). The name lock serialises what changes or checks
the names in the directory (a rename into place, an unlink, a reader's "is this still my file")
and is taken before the index lock, never after. File reads and writes take neither (an
unlinked file stays readable through an open descriptor). A key taken out of the index (evicted
or removed) has its file deleted after the index lock is released, and always before any later
rename into place, so a deletion never takes a newer copy with it. A put of a key another
thread is writing waits for that write (bounded), so its OK always names a file; a read that
finds its file corrupt, unreadable or gone drops the key only if no new copy was renamed into
place meanwhile.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np
import xxhash

from kvpool.errors import ConfigError, ErrorCode, StoreError
from kvpool.paths import validate_offload_path
from kvpool.store.disk_format import (
    HEADER_SIZE,
    INDEX_NAME,
    MAGIC,
    READABLE,
    checksum_problem,
    decode_index,
    encode_index,
    file_problem,
    pack_header,
    unpack_header,
)
from kvpool.store.quota import POLICIES, DiskPolicy, QuotaIndex
from kvpool.store.buffers import byte_views
from kvpool.store.tierdir import TierDir, pread_into

logger = logging.getLogger(__name__)

# Anything exporting the buffer protocol (bytes, memoryview, numpy array); Python
# 3.11 has no static type for that (collections.abc.Buffer arrived in 3.12).
Buffer = Any

_TMP_MARK = ".tmp."
LOCK_NAME = ".kvpool.lock"
# How long a put waits for another thread's write of the same key: one file write, so only a
# hung device takes this long; the put then reports failure rather than an unbacked OK.
INFLIGHT_WAIT_S = 30.0
# After a full disk lowered the quota, how often a put looks whether the disk has room again.
REGROW_CHECK_S = 5.0
_HEXDIGITS = frozenset("0123456789abcdef")
# Read errors that say nothing about the file (the process ran out of something): no deletion.
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})


class _Loc(NamedTuple):
    """Where a key's file is: its shard directory and its name there."""

    shard: str
    name: str


def _lock_dir(tier_dir: TierDir) -> int:
    """Take the directory's lock for this tier's lifetime; ConfigError naming the holder if taken."""
    path, lock_path = tier_dir.path, tier_dir.where(None, LOCK_NAME)
    fd = tier_dir.lock_file(LOCK_NAME)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            key="ssd_offload_path", value=path,
            expected=f"a directory no other kvpool server or engine uses (pid {holder} holds {lock_path}); "
                     f"give each its own directory",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd



class _FoundSize(int):
    """The size of a file found at start-up that no read has checked yet, as the index holds it
    (``DiskTier.contains_checked``). The type is the mark: one shared instance per distinct
    size, so marking a million files costs neither memory nor start-up time."""

    __slots__ = ()


class DiskTier:
    """Byte-quota'd store of immutable objects, one file each, surviving restarts.

    ``policy``: ``none`` rejects a write that would pass the quota
    (NO_AVAILABLE_HANDLE); ``fifo`` evicts the oldest-written files; ``lru`` the
    least recently read; ``s3fifo`` files written once before those read again
    (``store/policy.py``). Recency is in-memory only: after a restart the order
    starts from file modification times, i.e. write order. The quota and the
    eviction order are ``quota.QuotaIndex``'s, shared with ``kvpool plan``.

    One DiskTier per directory: two processes sharing a path would each keep
    their own index and quota.
    """

    def __init__(self, path: str, quota_bytes: int, policy: DiskPolicy = "none") -> None:
        validate_offload_path(path)
        if policy not in POLICIES:
            raise ConfigError(key="ssd_eviction_policy", value=policy, expected=f"one of {', '.join(POLICIES)}")
        if not isinstance(quota_bytes, int) or quota_bytes <= 0:
            raise ConfigError(
                key="ssd_quota_bytes", value=quota_bytes, expected="a positive int of bytes"
            )
        self.path = os.path.normpath(path)
        self._dir = TierDir(self.path)
        try:
            self._lock_fd: int | None = _lock_dir(self._dir)
        except BaseException:
            self._dir.close()  # idempotent: __del__ closes it again harmlessly
            raise
        self.policy: DiskPolicy = policy
        self._lock = threading.Lock()  # the index lock (module docstring): memory only
        self._removed: collections.deque[str] | None = None  # `watch_removals`
        self._names = threading.Lock()  # the name lock: renames, unlinks, identity checks
        # Keys out of the index whose files are not deleted yet (`_delete_doomed`).
        self._doomed: set[str] = set()
        # Notified whenever a write in flight settles or is cancelled (a put of the same key waits).
        self._landed = threading.Condition(self._lock)
        # key -> file size, in eviction order, plus the writes in flight.
        self._order = QuotaIndex(quota_bytes, policy)
        self._configured_quota = quota_bytes  # what a full disk's lowering grows back towards
        self._regrow_at = 0.0  # time.monotonic() of the next look at the disk's free space
        self._tmp_counter = itertools.count()
        self.checksum_failures = 0
        self.full_disk_events = 0  # writes that met a full disk below the quota (ENOSPC)
        self.removed_at_scan = 0
        self._shard_seen: dict[str, int] = {}
        self.loaded_index = self._load_index()  # whether the restart skipped the full scan
        if not self.loaded_index:
            self._scan()
        self._delete_doomed()  # what a shrunk quota evicted at start-up
        # Shard directory mtimes as this tier's own changes left them: a shard whose mtime
        # differs at close was changed by someone else, and the restart index is not written.
        self._shard_seen = self._shard_times()

    # ---- public API -------------------------------------------------------

    def close(self) -> None:
        """Write the restart index and release the directory's lock (another tier may then
        open it). Idempotent."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            try:
                self._save_index()
            except OSError as exc:  # only costs the next start a full scan
                logger.warning("disk tier: could not write %s: %s", os.path.join(self.path, INDEX_NAME), exc)
            os.close(fd)

    def __del__(self) -> None:
        # Not closed: treated like a crash (no restart index; the next open scans the files).
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)
        # The directory's descriptors outlive close(): a reader still finishing reads through them.
        tier_dir = getattr(self, "_dir", None)
        if tier_dir is not None:
            tier_dir.close()


    @property
    def quota_bytes(self) -> int:
        return self._order.quota_bytes

    @property
    def evictions(self) -> int:
        return self._order.evictions

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._order.used

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._order)

    @staticmethod
    def entry_size(key: str, payload_len: int) -> int:
        """Bytes a file for ``key`` with ``payload_len`` payload bytes takes (counted against the quota)."""
        return HEADER_SIZE + len(key.encode("utf-8")) + payload_len

    def contains(self, key: str) -> bool:
        """Index lookup only (no I/O); a corrupt file is still 'contained' until read."""
        with self._lock:
            return key in self._order

    def contains_checked(self, key: str) -> bool:
        """Stored, and its file written or read whole by this process (no I/O). A file found at
        start-up may have been torn by a crash (files are not fsynced) in a way the header scan
        does not see: the engine does not drop its memory copy of such a key as "already on
        disk", and a put of it writes the file again."""
        with self._lock:
            size = self._order.size_of(key)
        return size is not None and type(size) is not _FoundSize

    def keys(self) -> list[str]:
        """Stored keys in eviction order (first = next victim)."""
        with self._lock:
            return self._order.keys()

    def items(self) -> list[tuple[str, int]]:
        """(key, bytes its file takes) of the stored keys, in eviction order."""
        with self._lock:
            return self._order.items()

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> ErrorCode:
        """Store ``data`` (one buffer or a list written back-to-back) under ``key``.

        Objects are immutable: a key already stored is a no-op OK. A key being stored by
        another thread is waited for (up to ``INFLIGHT_WAIT_S``): OK only once a file of it
        landed, else this put writes it itself, so an OK is never backed by a write that failed.
        """
        views = byte_views(data)
        key_bytes = key.encode("utf-8")
        payload_len = sum(v.nbytes for v in views)
        size = HEADER_SIZE + len(key_bytes) + payload_len
        self._regrow_quota()
        if size > self.quota_bytes:
            logger.warning(
                "disk tier: key=%r needs %d bytes, more than the whole quota %d; "
                "raise the SSD quota to store objects this large",
                key, size, self.quota_bytes,
            )
            return ErrorCode.NO_AVAILABLE_HANDLE
        deadline = time.monotonic() + INFLIGHT_WAIT_S
        with self._lock:
            while True:
                if key in self._order:
                    if type(self._order.size_of(key)) is not _FoundSize:
                        return ErrorCode.OK
                    # A file from before the start that no read has checked: write it again
                    # (the rename replaces it), rather than vouch for it.
                    self._order.discard(key)
                if not self._order.has(key):
                    fits, victims = self._order.reserve(key, size)
                    self._doom_locked(victims)
                    break
                # Another thread is writing this key (the engine spills an evicted copy while
                # writing through its promoted one): its write may still fail, so wait for it.
                left = deadline - time.monotonic()
                if left <= 0:
                    fits, victims = False, None
                    break
                self._landed.wait(left)
        if victims is None:
            logger.warning("disk tier: key=%r is still being written by another thread after %.0f s; "
                           "not reporting it stored (check %s for a hung device)", key, INFLIGHT_WAIT_S, self.path)
            return ErrorCode.INTERNAL_ERROR
        if not fits:
            if victims:
                self._delete_doomed()
            return ErrorCode.NO_AVAILABLE_HANDLE

        loc = self._where(key)
        settled = False
        try:
            if victims:
                self._delete_doomed()  # their room on the device before this write takes it
            for attempt in (1, 2):
                try:
                    self._write(loc, key_bytes, views, payload_len)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and attempt == 1 and self._room_after_full_disk(size):
                        continue  # the disk filled up under the quota: evicted to make room, try again
                    logger.warning("disk tier: writing key=%r to %s failed: %s", key, self._dir.where(*loc), exc)
                    return ErrorCode.INTERNAL_ERROR
                settled = True
                return ErrorCode.OK
            raise AssertionError("unreachable")
        finally:
            # Whatever happened, the reservation ends here: a key left reserved would answer
            # every later put of it with a wait, and its bytes would count against the quota.
            with self._lock:
                if settled:
                    self._order.settle(key)
                else:
                    self._order.cancel(key)
                self._landed.notify_all()

    def _write(self, loc: _Loc, key_bytes: bytes, views: list[memoryview], payload_len: int) -> None:
        """Write one object's file next to ``loc`` and rename it into place (no temp file is
        left behind on failure)."""
        tmp = f"{loc.name}{_TMP_MARK}{os.getpid()}.{next(self._tmp_counter)}"
        created = False
        try:
            h = xxhash.xxh3_64()
            for v in views:
                h.update(v)
            self._dir.shard(loc.shard, create=True)
            fd = self._dir.create(loc.shard, tmp)
            created = True
            with open(fd, "wb") as f:
                f.write(pack_header(len(key_bytes), payload_len, h.intdigest()))
                f.write(key_bytes)
                for v in views:
                    f.write(v)
            with self._names:
                self._delete_doomed_names_locked()  # an older copy of this key may be among them
                self._dir.replace(loc.shard, tmp, loc.name)
                created = False
                self._saw_shard_names_locked(loc.shard)
        except OSError:
            if created:
                self._unlink_quietly(loc.shard, tmp)
            raise

    def _room_after_full_disk(self, size: int) -> bool:
        """The disk ran out of space below our quota (something else filled it): shrink the
        quota to what the tier holds now, so it evicts instead of failing every write from now
        on, and evict room for one more object of ``size`` bytes. False with policy ``none``."""
        with self._lock:
            self.full_disk_events += 1
            held = self._order.used - size  # this write's reservation is still counted
            self._order.quota_bytes = max(size, held)
            self._regrow_at = time.monotonic() + REGROW_CHECK_S
            if self.policy == "none":
                return False
            # The disk had no room for `size` more bytes: free that much of our own.
            before = self._order.used
            self._doom_locked(self._order.evict(size))
            freed = before - self._order.used
        logger.warning("disk tier: %s is full below its quota; quota lowered to %d bytes (what the "
                       "tier holds), evicting to make room", self.path, self.quota_bytes)
        self._delete_doomed()
        return freed >= size

    def _regrow_quota(self) -> None:
        """Give back what a full disk took from the quota (`_room_after_full_disk`) once the
        disk has room again, up to the configured quota: whatever filled it may have gone, and
        a lowered quota would otherwise shrink the tier (or, with policy ``none``, refuse every
        write) until a restart. Looks at most every ``REGROW_CHECK_S``."""
        if self._order.quota_bytes >= self._configured_quota or time.monotonic() < self._regrow_at:
            return  # the common case, without the lock: a stale read only delays the look
        with self._lock:
            now = time.monotonic()
            if self._order.quota_bytes >= self._configured_quota or now < self._regrow_at:
                return
            self._regrow_at = now + REGROW_CHECK_S
        try:
            st = self._dir.statvfs()  # outside the index lock: a system call (module docstring)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        with self._lock:
            # A tenth of the free space stays free, so the next writes do not meet ENOSPC at once.
            target = min(self._configured_quota, self._order.used + free - free // 10)
            if target > self._order.quota_bytes:
                logger.info("disk tier: %s has room again; quota raised from %d to %d bytes (configured: %d)",
                            self.path, self._order.quota_bytes, target, self._configured_quota)
                self._order.quota_bytes = target

    def payload_size(self, key: str) -> int | None:
        """Payload bytes of ``key`` as the index has them (no I/O); None when not stored."""
        with self._lock:
            size = self._order.size_of(key)
        return None if size is None else size - HEADER_SIZE - len(key.encode("utf-8"))

    def get(self, key: str) -> bytes:
        """Return the payload of ``key``.

        Raises StoreError(OBJECT_NOT_FOUND) when absent, StoreError(CHECKSUM_MISMATCH)
        when the file is corrupt, truncated or unreadable (EIO; the file is deleted: it can
        never become valid, and leaving it would fail every later read too).
        """
        self._touch(key)
        loc = self._where(key)
        fd = self._open(key, loc)
        try:
            try:
                with open(fd, "rb", closefd=False) as f:
                    # Read the parts separately so the payload is not copied a second
                    # time by slicing one big buffer (objects are often megabytes).
                    head = f.read(HEADER_SIZE)
                    parsed = unpack_header(head)
                    key_bytes = f.read(parsed[3]) if parsed else b""
                    payload = f.read(parsed[4]) if parsed else b""
                    trailing = bool(f.read(1))
            except OSError as exc:
                self._unreadable(key, loc, exc, fd)
            problem = file_problem(parsed, key_bytes, len(payload), trailing, key)
            if problem is None and parsed is not None:
                problem = checksum_problem(parsed, payload)[1]
            if problem is not None:
                self._corrupt(key, loc, problem, fd)
        finally:
            # Open until any deletion above is decided: the descriptor pins the inode, so the
            # identity check there cannot meet a new file reusing its number.
            os.close(fd)
        self._checked(key)
        return payload

    def read_into(self, key: str, dest: np.ndarray) -> int:
        """Read the payload of ``key`` into ``dest`` (a writable uint8 array of exactly
        ``payload_size(key)`` bytes) and return its XXH3-64 (``buffers.checksum``).

        The file goes straight into ``dest``, without a bytes object in between: the engine
        reads a promotion into its arena range this way. Raises as ``get`` does; on a raise,
        ``dest`` holds unspecified bytes. A file whose payload length differs from ``dest``'s
        but is otherwise whole (the key was evicted and stored again meanwhile) is a miss.
        """
        self._touch(key)
        loc = self._where(key)
        key_bytes = key.encode("utf-8")
        start = HEADER_SIZE + len(key_bytes)  # where the payload begins, if the key is the file's
        fd = self._open(key, loc)
        try:
            try:
                file_size = os.fstat(fd).st_size
                head = os.pread(fd, start, 0)
                parsed = unpack_header(head[:HEADER_SIZE])
                payload_len = parsed[4] if parsed is not None else -1
                whole = parsed is not None and parsed[3] == len(key_bytes) and file_size == start + payload_len
                if whole and payload_len != dest.nbytes:
                    raise StoreError(ErrorCode.OBJECT_NOT_FOUND,
                                     f"key={key!r} on the disk tier is {payload_len} bytes now, not {dest.nbytes}")
                got = pread_into(fd, dest, start) if payload_len == dest.nbytes else 0
            except OSError as exc:
                self._unreadable(key, loc, exc, fd)
            problem = file_problem(parsed, head[HEADER_SIZE:], got, file_size > start + got, key)
            digest = 0
            if problem is None and parsed is not None:
                digest, problem = checksum_problem(parsed, dest)
            if problem is not None:
                self._corrupt(key, loc, problem, fd)
        finally:
            os.close(fd)  # after any deletion (see get)
        self._checked(key)
        return digest

    def _open(self, key: str, loc: _Loc) -> int:
        """Open ``key``'s file for reading; raises StoreError as ``get`` does (a file or shard not
        the tier's own is unreadable: a miss, and the name is deleted)."""
        try:
            return self._dir.open(loc.shard, loc.name)
        except FileNotFoundError:
            self._gone(key)
        except OSError as exc:
            self._unreadable(key, loc, exc, None)

    def _touch(self, key: str) -> None:
        """Mark ``key`` read (its LRU place); OBJECT_NOT_FOUND when it is not stored."""
        with self._lock:
            if key not in self._order:
                raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"key={key!r} is not on the disk tier")
            self._order.touch(key)

    def _gone(self, key: str) -> NoReturn:
        """Its file vanished between the index check and the open (evicted or removed)."""
        with self._names:
            # Unless a new copy was stored meanwhile (renames hold the name lock): that one
            # is acknowledged and stays listed.
            if not self._exists(self._where(key)):
                with self._lock:
                    self._order.discard(key)
        raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"key={key!r} is not on the disk tier") from None

    def _exists(self, loc: _Loc) -> bool:
        try:
            self._dir.lstat(loc.shard, loc.name)
            return True
        except OSError:  # absent, or in a shard that is not the tier's: not a file of ours
            return False

    def _unreadable(self, key: str, loc: _Loc, exc: OSError, fd: int | None) -> NoReturn:
        """A read of ``key``'s file failed: a miss, never an OSError to the caller (through the
        server that would end the reader's connection, on every read of a bad sector)."""
        if exc.errno in _TRANSIENT:  # the process, not the file: keep it
            raise StoreError(
                ErrorCode.INTERNAL_ERROR,
                f"key={key!r}: could not read {self._dir.where(*loc)} ({exc}); the file is kept, retry later",
            ) from None
        self._corrupt(key, loc, f"unreadable: {exc}", fd)

    def remove(self, key: str) -> ErrorCode:
        """Delete ``key``'s file; OBJECT_NOT_FOUND if it is not stored."""
        with self._lock:
            if not self._order.discard(key):
                return ErrorCode.OBJECT_NOT_FOUND
            self._doom_locked([key])
        self._delete_doomed()
        return ErrorCode.OK

    # ---- internals ----------------------------------------------------------

    def file_path(self, key: str) -> str:
        """The path of ``key``'s file (for messages and tools: the tier itself opens it through
        its directory's descriptor)."""
        return self._dir.where(*self._where(key))

    @staticmethod
    def _where(key: str) -> _Loc:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return _Loc(digest[:2], digest)

    def _corrupt(self, key: str, loc: _Loc, problem: str, fd: int | None) -> NoReturn:
        """Report ``key``'s file (read through ``fd``; None: could not be opened) as corrupt and
        delete it, unless a new copy was renamed over it meanwhile: that one was acknowledged."""
        file_path = self._dir.where(*loc)
        logger.warning(
            "disk tier: key=%r file %s is corrupt (%s); deleted it and reporting a miss",
            key, file_path, problem,
        )
        with self._names:
            with self._lock:
                self.checksum_failures += 1
            if fd is None or self._is_file_names_locked(loc, fd):
                with self._lock:
                    if self._order.discard(key):
                        self._doom_locked([key])
                self._delete_doomed_names_locked()
        raise StoreError(
            ErrorCode.CHECKSUM_MISMATCH,
            f"key={key!r}: disk copy at {file_path} is corrupt ({problem}); it was deleted, "
            f"the object must be recomputed",
        )

    def _is_file_names_locked(self, loc: _Loc, fd: int) -> bool:
        """Whether ``loc`` still names the file open as ``fd`` (call under the name lock,
        which every rename and unlink in the tier holds, with ``fd`` open so its inode is not
        reused)."""
        try:
            now, read = self._dir.lstat(loc.shard, loc.name), os.fstat(fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (read.st_dev, read.st_ino)

    def _doom_locked(self, keys: list[str]) -> None:
        """Keys just taken out of the index: their files are to be deleted (`_delete_doomed`)."""
        self._doomed.update(keys)
        if self._removed is not None:
            self._removed.extend(keys)

    def watch_removals(self, limit: int) -> None:
        """From now on, note the keys the tier lets go (evicted, removed, found corrupt), the
        newest ``limit`` of them, for `take_removed`."""
        with self._lock:
            if self._removed is None:
                self._removed = collections.deque(maxlen=limit)

    def take_removed(self) -> list[str]:
        """The keys noted since the last call (`watch_removals`), oldest first."""
        with self._lock:
            if not self._removed:
                return []
            out = list(self._removed)
            self._removed.clear()
            return out

    def _checked(self, key: str) -> None:
        """A read of ``key``'s file passed every check: it is no longer a `_FoundSize`."""
        with self._lock:
            size = self._order.size_of(key)
            if type(size) is _FoundSize:
                self._order.resize(key, int(size))

    def _delete_doomed(self) -> None:
        """Delete the files of the keys taken out of the index (call with neither lock held)."""
        with self._names:
            self._delete_doomed_names_locked()

    def _delete_doomed_names_locked(self) -> None:
        """``_delete_doomed`` for a caller that holds the name lock: every rename into place
        calls this first, so no deletion decided before it can remove the file it renames."""
        with self._lock:
            if not self._doomed:
                return
            victims, self._doomed = self._doomed, set()
        for victim in victims:
            loc = self._where(victim)
            file_path = self._dir.where(*loc)
            try:
                self._dir.unlink(loc.shard, loc.name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                # E.g. EROFS: a failing SSD remounted read-only. The victim is out of the index
                # either way (never read again); raising here would fail the caller's put or
                # read with an exception and leave its reservation behind.
                logger.warning("disk tier: could not delete %s (key=%r): %s; it stays on disk, unindexed, "
                               "until a restart's scan", file_path, victim, exc)
            self._saw_shard_names_locked(loc.shard)

    def _shard_names(self) -> list[str]:
        """The directory's shard names (two hex digits); the tier's own or not (`TierDir.shard`)."""
        return [name for name in self._dir.shard_names() if len(name) == 2 and set(name) <= _HEXDIGITS]

    def _shard_times(self) -> dict[str, int]:
        times = {}
        for name in self._shard_names():
            try:
                times[name] = self._dir.lstat(None, name).st_mtime_ns
            except OSError:
                pass
        return times

    def _saw_shard_names_locked(self, shard: str) -> None:
        try:
            self._shard_seen[shard] = self._dir.lstat(None, shard).st_mtime_ns
        except OSError:
            pass

    def _save_index(self) -> None:
        """Write the restart index (see the module docstring); nothing while a write is in flight
        or when a shard was changed by someone else."""
        with self._names:
            self._delete_doomed_names_locked()
            with self._lock:
                if self._order.writing:
                    return
                entries = self._order.items()
            times = self._shard_times()
            if times != self._shard_seen:
                logger.info("disk tier: %s was changed behind this tier; the next start scans its files",
                            self.path)
                return
        tmp = f"{INDEX_NAME}{_TMP_MARK}{os.getpid()}"
        fd = self._dir.create(None, tmp, truncate=True)
        with open(fd, "wb") as f:
            f.write(encode_index(entries, times))
        self._dir.replace(None, tmp, INDEX_NAME)

    def _load_index(self) -> bool:
        """Take the index the previous close wrote, if it is intact and no shard changed since;
        delete it either way. False: the caller must scan."""
        final = self._dir.where(None, INDEX_NAME)
        try:
            fd = self._dir.open(None, INDEX_NAME)
        except OSError:
            return False
        try:
            with open(fd, "rb") as f:
                blob = f.read()
        finally:
            self._unlink_quietly(None, INDEX_NAME)  # a crash from here on must not leave a stale index behind
        try:
            return self._parse_index(blob)
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            logger.warning("disk tier: ignoring %s (%s); scanning the files instead", final, exc)
            self._order.clear()
            return False

    def _parse_index(self, blob: bytes) -> bool:
        recorded, entries = decode_index(blob)
        if recorded != self._shard_times():
            logger.info("disk tier: %s changed since its index was written; scanning the files", self.path)
            return False
        order, sizes = self._order, {}
        for key, size in entries:
            mark = sizes.get(size)
            if mark is None:  # one object per distinct size
                mark = sizes[size] = _FoundSize(size)
            order.load(key, mark)
        if len(order) != len(entries):
            raise ValueError("it lists a key twice")
        if order.used > self.quota_bytes:
            self._doom_locked(order.evict(order.used - self.quota_bytes))
        return True

    def _scan(self) -> None:
        """Rebuild the index from files a previous process left, reading headers only.

        Only names this tier creates are touched (2-hex dirs holding 64-hex files
        and their temp files); anything else in the directory is left alone.
        """
        found: list[tuple[float, str, int]] = []
        for shard in self._shard_names():
            try:
                entries = list(self._dir.files(shard))
            except OSError as exc:  # Untrusted: another user's shard is never read
                logger.warning("disk tier: skipping %s at start-up: %s", self._dir.where(None, shard), exc)
                continue
            for entry in entries:
                name = entry.name
                if _TMP_MARK in name and len(name) > 64 and set(name[:64]) <= _HEXDIGITS:
                    # A write the previous process never renamed: never complete.
                    self._unlink_quietly(shard, name)
                    continue
                if len(name) != 64 or not set(name) <= _HEXDIGITS or not name.startswith(shard):
                    continue
                key, problem = self._read_header(_Loc(shard, name))
                if key is None:
                    logger.warning("disk tier: removing %s at start-up: %s", self._dir.where(shard, name), problem)
                    self.removed_at_scan += 1
                    self._unlink_quietly(shard, name)
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        sizes: dict[int, _FoundSize] = {}
        for _, key, size in found:
            mark = sizes.get(size)
            if mark is None:
                mark = sizes[size] = _FoundSize(size)
            self._order.load(key, mark)
        if self._order.used > self.quota_bytes:
            # The quota shrank since the previous run; honour it now rather than never.
            logger.warning(
                "disk tier: %d bytes on disk exceed quota %d at start-up; evicting oldest",
                self._order.used, self.quota_bytes,
            )
            self._doom_locked(self._order.evict(self._order.used - self.quota_bytes))

    def _read_header(self, loc: _Loc) -> tuple[str | None, str]:
        try:
            fd = self._dir.open(loc.shard, loc.name)
            size = os.fstat(fd).st_size
            with open(fd, "rb") as f:
                parsed = unpack_header(f.read(HEADER_SIZE))
                if parsed is None:
                    return None, "truncated header"
                magic, version, _, key_len, payload_len, _ = parsed
                if magic != MAGIC or version not in READABLE:
                    return None, f"bad magic/version {magic!r}/{version}"
                if size != HEADER_SIZE + key_len + payload_len:
                    return None, f"size {size} != header-declared {HEADER_SIZE + key_len + payload_len}"
                key_bytes = f.read(key_len)
        except OSError as exc:
            return None, f"unreadable: {exc}"
        try:
            key = key_bytes.decode("utf-8")
        except UnicodeDecodeError:
            return None, "key is not utf-8"
        if hashlib.sha256(key_bytes).hexdigest() != loc.name:
            return None, "file name does not match the stored key"
        return key, ""

    def _unlink_quietly(self, shard: str | None, name: str) -> None:
        try:
            self._dir.unlink(shard, name)
        except OSError:
            pass
