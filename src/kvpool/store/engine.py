"""The pool engine: Mooncake-master semantics over a caller-supplied byte arena.

Everything the engine hands out is an offset into the arena, never a Python
object, because the daemon's clients map the same arena from POSIX shared memory
and copy with their own pointers. The in-process ``put``/``get_into`` helpers
are the same two-phase protocol a remote client follows, done locally.

Invariants (tests/store/test_properties.py checks them under random operation
sequences):

* memory used (allocator reserved bytes) never exceeds capacity, and live
  ranges never overlap;
* readers never see an uncommitted object: ``acquire``/``exists`` only look at
  committed objects, the spill buffer and the disk tier;
* an object holding an unexpired lease (or pinned by the disk writer) is never
  evicted or removed, so its bytes do not change under a reader;
* a read whose lease expired, or whose object was replaced (different
  generation), is reported LEASE_EXPIRED by ``validate`` rather than trusted;
* with a disk tier, an object evicted from memory is already on disk or is
  spilled there (readers find it in the spill buffer meanwhile), so eviction
  moves data down a tier instead of losing it (unless the disk refuses it);
* fair sharing (when configured): one owner (a client process; see
  ``bind_client``) never pins more than ``client_pool_share`` of the capacity
  in leased objects plus uncommitted allocations, never holds more than
  ``client_max_leases`` leases and allocations, and never pins one object for
  more than ``client_max_hold_s`` plus two lease TTLs. Past its share or hold
  time its leases are still granted and still verified, but do not pin: a
  lone client reads as before, and an object someone else needs room for can
  be evicted under it (its read then reports LEASE_EXPIRED, never wrong bytes).

The engine keeps the index, the arena's allocations and the orchestration of the
memory and disk tiers; leases and the fair-share accounting are `store/leases.py`
(O(log n) per lease), the records they file `store/records.py`, eviction order
`store/policy.py`, and its settings `store/engine_config.py`.

Concurrency: one ``threading.Lock`` guards all metadata. Bulk byte copies, hashes
and disk I/O happen outside it; leases/pins/pending allocations are what keep the
copied ranges stable meanwhile (a promotion from disk is a pending allocation only
the engine itself can finish). The one exception is evicting an object that is not
on disk yet: its bytes are copied to the spill buffer before its range is freed
for the allocation that needed the room (their hash is checked after, unlocked).
Lock order is engine lock -> the disk tier's index lock, which the tier never holds over a
system call (store/disk.py), so a hung SSD stalls the threads doing disk I/O, never a
memory hit; the disk tier never calls back into the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import mmap
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from kvpool.errors import ConfigError, ErrorCode, StoreError
from kvpool.keys import valid_key
from kvpool.store.allocator import OffsetAllocator
from kvpool.store.buffers import as_u8 as _as_u8
from kvpool.store.buffers import checksum
from kvpool.store.engine_config import EngineConfig
from kvpool.store.leases import LeaseBook
from kvpool.store.memcopy import CopyEngine
from kvpool.store.policy import EvictionPolicy, make_policy
from kvpool.store.prefault import Prefaulter
from kvpool.store.records import (
    Allocation,
    Lease,
    LookupLease,
    ObjectView,
    PendingPut,
    PoolObject,
    Presence,
    ReapReport,
    Spilled,
)
from kvpool.store.workers import DaemonWorkers

logger = logging.getLogger(__name__)

# Anything exporting the buffer protocol as contiguous bytes: 1-D uint8 numpy
# arrays, memoryviews, bytes/bytearray. Python 3.11 has no static type for it.
Buffer = Any

_STAT_NAMES = (
    "puts",
    "gets",
    "hits",
    "disk_hits",
    "misses",
    "evictions",
    "promotions",
    "allocation_failures",
    "lease_expired",
    "disk_write_errors",
    "reclaimed_allocations",
    "reaped_clients",
    "corrupt_objects",  # arena bytes that no longer matched their writer's checksum: never spilled; dropped once a reader reports them
    "quota_refusals",
    "unpinned_leases",
    "hold_limit_hits",
)




def _copy_in(data: bytes, dest: np.ndarray) -> int:
    """Copy ``data`` into ``dest`` (a promotion's arena range); their checksum."""
    dest[:] = np.frombuffer(data, dtype=np.uint8)
    return checksum([data])


_SERIAL = CopyEngine(1)  # copies on the calling thread

# Disk-tier reads one batch keeps in flight: an SSD serves several requests at once far faster
# than one after another (queue depth), and past a handful the device, not the queue, limits.
# Measured through `kvpool server` on a 2-vCPU VM (1 MiB values, batches of 16, cold page cache,
# runs alternating): 4 readers 838-1025 MB/s, 8 readers 950-1060, 16 readers 761-822 (their
# promotions and the client's copies then crowd the two cores).
DISK_READERS = 8
# How long `remove` waits for the disk writer to unpin its object (one file write) before it
# answers that it could not: a hung SSD must not hold the caller's thread forever.
REMOVE_PIN_WAIT_S = 30.0
# How long `close` waits for a disk write to complete before it gives the SSD up: it waits as long
# as files keep completing, so only a device that stopped answering is given up.
CLOSE_STALL_S = 30.0


def _private_arena(size: int) -> np.ndarray:
    """`size` zero bytes of this process's own memory, mapped lazily: a large pool costs only
    what is written and the prefaulter's look-ahead past it.

    An anonymous private mapping, not `np.zeros`: numpy advises huge pages for an allocation
    this large, and where the kernel compacts memory for them on the faulting thread (THP
    `defrag` = madvise, a common default) the first write to each page waits for it. Measured
    on a 2-vCPU Xeon VM, where compaction found no huge pages: writing 24 MiB (one prefill
    chunk's blocks) into untouched arena took 58 ms that way and 12 ms on plain pages (3 ms
    once touched), and the saves of a cold prefill ran that long beside its forward pass.
    """
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


class _RecordedUses:
    """The engine's policy, recording each object's last use as ``lru`` defines it (an insert,
    a touch, an unhold that lists it again) for ``_debug_check_evictable``. Only the tests put
    it in place (``_debug_track_lru``): the engine's own calls pay nothing for it."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self._inner = inner
        self.last_use: dict[str, int] = {}
        self._seq = itertools.count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __iter__(self) -> Any:
        return iter(self._inner)

    def used(self, key: str) -> None:
        self.last_use[key] = next(self._seq)

    def insert(self, node: PoolObject) -> None:
        self._inner.insert(node)
        self.used(node.key)

    def touch(self, node: PoolObject) -> None:
        self._inner.touch(node)
        self.used(node.key)

    def unhold(self, node: PoolObject) -> None:
        if node.prev is None:
            self.used(node.key)
        self._inner.unhold(node)


class PoolEngine:
    """Mooncake-master-like object pool over one arena (see the module docstring for invariants).

    Thread-safe. ``clock`` (monotonic seconds) is injectable so tests can move
    time for lease expiry, client TTLs and put timeouts.
    """

    def __init__(
        self,
        config: EngineConfig,
        arena: memoryview | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self._clock = clock
        # Our own arena's pages are mapped ahead of the allocations, the first look-ahead now,
        # while the process starts (see store/prefault.py); a caller's arena (the server's shared
        # memory) is its writers' to map.
        self._prefault: Prefaulter | None = None
        if arena is None:
            self._arena = _private_arena(config.memory_size)
            if config.memory_size and config.prefault:
                self._prefault = Prefaulter(self._arena)
                self._prefault.note(0)
        else:
            try:
                arr = _as_u8(arena, writable=True)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    key="arena", value=type(arena).__name__,
                    expected=f"a writable contiguous byte buffer ({exc})",
                ) from None
            if arr.size < config.memory_size:
                raise ConfigError(
                    key="memory_size", value=config.memory_size,
                    expected=f"at most the arena's {arr.size} bytes; map a larger arena or lower it",
                )
            self._arena = arr[: config.memory_size]
        # No per-range table in the allocator: the engine knows every range's size (see free).
        self._alloc = OffsetAllocator(config.memory_size, config.alignment, track_live=False)
        self._high_bytes = config.eviction_high_watermark_ratio * self._alloc.capacity
        self._disk = config.disk

        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # signalled when the disk writer unpins
        self._objects: dict[str, PoolObject] = {}
        # The evictable objects (committed, nobody holds them), linked through the objects
        # themselves in the policy's order: eviction takes its victims and never meets a held
        # object; its count and bytes are running totals.
        self._policy: EvictionPolicy = make_policy(config.eviction_policy, self._alloc.capacity,
                                                   self._object_charge)
        # handle -> allocation, in creation order (so reap finds the timed-out ones at the front).
        self._pending: dict[int, PendingPut] = {}
        self._pending_by_client: dict[str, dict[int, PendingPut]] = {}
        self._pending_keys: dict[str, int] = {}
        # Evicted objects on their way to disk; readers are served from here meanwhile.
        self._spill: dict[str, Spilled] = {}
        self._clients: dict[str, float] = {}
        self._handles = itertools.count(1)
        self._generations = itertools.count(1)
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._leases = LeaseBook(config, self._alloc.capacity, self._object_charge, self._sync_held_locked,
                                 self._stats)
        self._closed = False
        self._readers: DaemonWorkers | None = None  # made at the first batch read from disk
        self._disk_writes = 0  # files the write-through has finished (either way): close's progress mark

        self._stop = threading.Event()
        self._queue: queue.Queue[str | None] | None = None
        self._writer: threading.Thread | None = None
        if self._disk is not None and config.disk_write_through:
            self._queue = queue.Queue(maxsize=config.disk_queue_size)
            self._writer = threading.Thread(target=self._writer_loop, name="kvpool-disk-writer", daemon=True)
            self._writer.start()
        self._reaper: threading.Thread | None = None
        if config.reap_interval_s > 0:
            self._reaper = threading.Thread(target=self._reaper_loop, name="kvpool-reaper", daemon=True)
            self._reaper.start()

    # ---- arena ----------------------------------------------------------------

    @property
    def arena(self) -> memoryview:
        """The managed arena (``memory_size`` bytes) that offsets refer to."""
        return memoryview(self._arena)

    @property
    def capacity(self) -> int:
        """Usable bytes (memory_size rounded down to the alignment)."""
        return self._alloc.capacity

    def reserved_size(self, size: int) -> int:
        """Arena bytes an object of ``size`` occupies (rounded up to the alignment, min one unit)."""
        return self._alloc.reserved_size(size)

    # ---- two-phase put --------------------------------------------------------

    def allocate(self, client_id: str, key: str, size: int) -> Allocation | ErrorCode:
        """Reserve ``size`` bytes for ``key``; the caller writes them, then commits.

        OBJECT_ALREADY_EXISTS when ``key`` is committed in memory or a client is writing it
        (a key that is only on disk may be put again: that re-promotes it; a put of a key the
        engine is promoting from disk overtakes the promotion, whose read may still fail).
        NO_AVAILABLE_HANDLE when it cannot fit even after eviction (eviction never
        touches leased, pinned or uncommitted objects) or when the client's owner
        would go over its pool share or hold count (``quota_refusals`` counts those).
        INVALID_KEY for a key that is empty or longer than max_key_bytes in UTF-8.
        """
        if not self._storable_key(key):
            return ErrorCode.INVALID_KEY
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return ErrorCode.INVALID_PARAMS
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            result, spills = self._allocate_locked(client_id, key, size, now)
        self._write_spills(spills)
        return result

    def batch_allocate(
        self, client_id: str, keys: Sequence[str], sizes: Sequence[int]
    ) -> list[Allocation | ErrorCode]:
        """``allocate`` per key under one lock acquisition; one failing key does not stop the others."""
        if len(keys) != len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        out: list[Allocation | ErrorCode] = []
        spills: list[tuple[str, Spilled]] = []
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for key, size in zip(keys, sizes):
                if not self._storable_key(key):
                    out.append(ErrorCode.INVALID_KEY)
                elif isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    out.append(ErrorCode.INVALID_PARAMS)
                else:
                    result, more = self._allocate_locked(client_id, key, size, now)
                    out.append(result)
                    spills.extend(more)
        self._write_spills(spills)
        return out

    def batch_commit(self, handles: Sequence[int], checksums: Sequence[int | None] | None = None) -> list[ErrorCode]:
        """``commit`` per handle under one lock acquisition (``checksums``: one per handle, or None)."""
        if checksums is not None and len(checksums) != len(handles):
            return [ErrorCode.INVALID_PARAMS] * len(handles)
        now = self._clock()
        codes: list[ErrorCode] = []
        with self._lock:
            for i, handle in enumerate(handles):
                codes.append(self._commit_handle_locked(handle, checksums[i] if checksums else None, now))
        return codes

    def batch_abort(self, handles: Sequence[int]) -> list[ErrorCode]:
        """``abort`` per handle under one lock acquisition."""
        codes: list[ErrorCode] = []
        with self._lock:
            for handle in handles:
                pending = self._callers_pending_locked(handle)
                if pending is None:
                    codes.append(ErrorCode.OBJECT_NOT_FOUND)
                else:
                    self._reclaim_locked(pending)
                    codes.append(ErrorCode.OK)
        return codes

    def commit(self, handle: int, checksum: int | None = None) -> ErrorCode:
        """Make an allocation visible to readers, with the checksum of the bytes its writer
        copied in (readers of the shared arena check their copies against it).

        OBJECT_NOT_FOUND when the handle is unknown: never issued, already
        committed/aborted, or reclaimed by ``reap`` (writer silent past
        client_ttl_s, or not committed within put_timeout_s) - the bytes were
        not stored and the put must be retried.
        """
        now = self._clock()
        with self._lock:
            return self._commit_handle_locked(handle, checksum, now)

    def _commit_handle_locked(self, handle: int, checksum: int | None, now: float) -> ErrorCode:
        pending = self._callers_pending_locked(handle)
        if pending is None:
            logger.warning(
                "commit(handle=%r): unknown handle (already committed/aborted, or reclaimed "
                "after put_timeout_s=%s / client_ttl_s=%s); retry the put",
                handle, self.config.put_timeout_s, self.config.client_ttl_s,
            )
            return ErrorCode.OBJECT_NOT_FOUND
        self._touch_client(pending.client_id, now)
        self._uncharge_pending_locked(pending)
        self._commit_locked(pending).checksum = checksum
        return ErrorCode.OK

    def abort(self, handle: int) -> ErrorCode:
        """Give back an allocation without publishing it (OBJECT_NOT_FOUND if the handle is unknown)."""
        return self.batch_abort([handle])[0]

    def _callers_pending_locked(self, handle: int) -> PendingPut | None:
        """The pending allocation behind a caller's handle; None for an unknown handle and for
        the engine's own promotions (handles are sequential, so one can be guessed)."""
        pending = self._pending.get(handle)
        return None if pending is None or pending.promotion else pending

    # ---- reads ------------------------------------------------------------------

    def acquire(self, client_id: str, key: str) -> Lease | ErrorCode:
        """Grant a read lease on ``key`` (a use for the eviction policy: under ``lru`` it becomes
        the most recently used).

        Falls back to the spill buffer and then the disk tier; a disk hit is
        checksum-verified and promoted into memory when it fits (possibly
        evicting colder objects) and no put of ``key`` is pending, else returned
        in ``Lease.data``.
        OBJECT_NOT_FOUND when absent everywhere, CHECKSUM_MISMATCH when the disk
        copy is corrupt (the disk tier deletes it). NO_AVAILABLE_HANDLE when the
        client's owner holds client_max_leases leases and allocations already.
        Past its pool share or hold time the lease is granted without pinning.
        """
        if not isinstance(key, str) or not key:
            return ErrorCode.INVALID_KEY
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            lease = self._lease_locked(client_id, key, now)
            if isinstance(lease, ErrorCode):
                return lease
            if lease is not None:
                self._stats["hits"] += 1
                return lease
            spilled = self._spill.get(key)
        if spilled is not None and self._spilled_intact(key, spilled):
            data = spilled.data
            return self._promote(client_id, key, len(data), lambda dest: _copy_in(data, dest), lambda: data)
        disk = self._disk
        size = disk.payload_size(key) if disk is not None else None
        if disk is None or size is None:
            with self._lock:
                self._stats["misses"] += 1
            return ErrorCode.OBJECT_NOT_FOUND
        return self._promote(client_id, key, size, lambda dest: disk.read_into(key, dest), lambda: disk.get(key))

    def batch_acquire(self, client_id: str, keys: Sequence[str]) -> list[Lease | ErrorCode]:
        """``acquire`` per key: the in-memory hits under one lock acquisition; keys found only
        in the spill buffer or on disk follow one at a time (that is disk I/O, done unlocked)."""
        out: list[Lease | ErrorCode | None] = [None] * len(keys)
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for i, key in enumerate(keys):
                if not isinstance(key, str) or not key:
                    out[i] = ErrorCode.INVALID_KEY
                    continue
                lease = self._lease_locked(client_id, key, now)
                if lease is not None:
                    if isinstance(lease, Lease):
                        self._stats["hits"] += 1
                    out[i] = lease
        below = [i for i, got in enumerate(out) if got is None]
        for i, got in zip(below, self._acquire_below(client_id, [keys[i] for i in below])):
            out[i] = got
        return out  # type: ignore[return-value]

    def _acquire_below(self, client_id: str, keys: Sequence[str]) -> list[Lease | ErrorCode]:
        """``acquire`` per key of a batch that missed memory. With a disk tier their file reads
        (and the hashes, which release the GIL) run side by side, so a batch keeps several
        reads in flight on the disk instead of one; promotions still take the lock one at a time."""
        if len(keys) > 1 and self._disk is not None and not self._closed:
            return list(self._disk_readers().map(lambda key: self.acquire(client_id, key), keys))
        return [self.acquire(client_id, key) for key in keys]

    def _disk_readers(self) -> DaemonWorkers:
        with self._lock:
            if self._readers is None:
                self._readers = DaemonWorkers(DISK_READERS, "kvpool-disk-read")
            return self._readers

    def batch_release(self, leases: Sequence[Lease]) -> list[ErrorCode]:
        """``validate`` then ``release`` per lease, under one lock acquisition: the codes tell
        whether each copy made under the lease is to be trusted."""
        now = self._clock()
        codes: list[ErrorCode] = []
        with self._lock:
            for lease in leases:
                rc = self._validate_locked(lease, now)
                if rc is not ErrorCode.OK:
                    self._stats["lease_expired"] += 1
                codes.append(rc)
                self._leases.release(lease)
        return codes

    def check_reported(self, lease: Lease) -> bool:
        """A reader's copy under ``lease`` did not match its writer's checksum: hash the object
        here and drop it if its arena bytes no longer match (counted in ``corrupt_objects``), so
        the key misses and its next put stores good bytes instead of meeting put-if-absent.
        The report only triggers the engine's own check: a client cannot drop an intact object.
        Whether the object was dropped."""
        with self._lock:
            obj = self._objects.get(lease.key)
            if obj is None or obj.generation != lease.generation or obj.checksum is None or obj.pins:
                return False
            # Hashed unlocked, pinned so that it stays where it is: a report may name a block of
            # tens of MiB, and a client could send one after every read.
            obj.pins += 1
            self._sync_held_locked(obj)
        intact = True  # if hashing fails, the object stays
        try:
            intact = checksum([self._arena[obj.offset : obj.offset + obj.size]]) == obj.checksum
        finally:
            with self._lock:
                obj.pins -= 1
                # Someone else may have leased, pinned or removed it meanwhile: then it stays
                # (or is gone) as it would have been had the check run first.
                drop = not intact and not obj.pins and self._objects.get(obj.key) is obj
                if drop:
                    self._stats["corrupt_objects"] += 1
                    # Its readers' leases end with it: their copies fail validation, never pass as good.
                    self._drop_locked(obj)
                elif not obj.pins:
                    self._sync_held_locked(obj)
                if not obj.pins:
                    self._unpinned.notify_all()
        return drop

    def release(self, lease: Lease) -> None:
        """End a read lease early so the object becomes evictable again. Idempotent."""
        if not lease.lease_id:
            return
        with self._lock:
            self._leases.release(lease)

    def validate(self, lease: Lease) -> ErrorCode:
        """After copying out, tell whether the copied bytes were stable (OK) or not (LEASE_EXPIRED).

        LEASE_EXPIRED when now > expires_at, when the object was evicted/removed
        or replaced by a newer generation, or when ``reap`` dropped the lease.
        """
        now = self._clock()
        with self._lock:
            rc = self._validate_locked(lease, now)
            if rc is not ErrorCode.OK:
                self._stats["lease_expired"] += 1
        return rc

    def exists(self, keys: Sequence[str], client_id: str | None = None, lease: bool = False) -> list[bool]:
        """Per key: is it in memory, the spill buffer or on disk.

        ``lease=True`` grants each in-memory hit a lookup lease of
        default_kv_lease_ttl_ms so it is not evicted before the reader comes
        (disk-only hits need none: nothing evicts them from memory). A lookup lease
        refused by the fair-sharing quotas still reports the key as found: it is
        only unprotected.
        """
        if lease:
            return [p is not Presence.ABSENT for p in self.presence(keys, client_id or "")]
        now = self._clock()
        found: list[bool] = []
        with self._lock:
            if client_id:
                self._touch_client(client_id, now)
            for key in keys:
                found.append(key in self._objects or key in self._spill
                             or (self._disk is not None and self._disk.contains(key)))
        return found

    def presence(self, keys: Sequence[str], client_id: str) -> list[Presence]:
        """``exists(lease=True)``, per key a `Presence`: PINNED when its lookup lease pins the
        in-memory object for a whole TTL from now, STORED when found otherwise (the spill
        buffer, the disk, or a lease the quotas refused or did not extend), ABSENT."""
        now = self._clock()
        pinned_until = now + self._leases.ttl_s
        out: list[Presence] = []
        with self._lock:
            if client_id:
                self._touch_client(client_id, now)
            self._leases.prune(now)
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None:
                    held = self._leases.lookup_lease(obj, client_id, now)
                    out.append(Presence.PINNED if held is not None and held[1] >= pinned_until else Presence.STORED)
                elif key in self._spill or (self._disk is not None and self._disk.contains(key)):
                    out.append(Presence.STORED)
                else:
                    out.append(Presence.ABSENT)
        return out

    def lookup_leases(self, keys: Sequence[str], client_id: str) -> list[LookupLease | bool]:
        """``exists(lease=True)`` that hands each in-memory hit's lookup lease back, so that a
        reader can copy under it without acquiring again (the server's `Lookup`): per key the
        `LookupLease`, True when found but not leased (only in the spill buffer or on
        disk, or a lease the quotas refused: found but unprotected, as ``exists`` reports it),
        False when absent.

        It is the same lookup lease ``exists`` grants (one per object and client, extended by
        each lookup), so handing it out adds no lease. A reader does not end it, it only has its
        copy checked (`check_lookup_leases`): the lease protects the hit for every request that
        looked it up, until its TTL.
        """
        now = self._clock()
        out: list[LookupLease | bool] = []
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for key in keys:
                obj = self._objects.get(key) if isinstance(key, str) and key else None
                if obj is None:
                    out.append(isinstance(key, str) and bool(key) and (
                        key in self._spill or (self._disk is not None and self._disk.contains(key))))
                    continue
                held = self._leases.lookup_lease(obj, client_id, now)
                if held is None:
                    out.append(True)
                    continue
                out.append(LookupLease(held[0], obj.offset, obj.size, obj.checksum))
        return out

    def check_lookup_leases(self, client_id: str, lease_ids: Sequence[int],
                            corrupt: Collection[int] = ()) -> list[ErrorCode]:
        """After copies made under lookup leases ``client_id`` was handed (`lookup_leases`): per
        lease OK when it held for the copy (unexpired, on the object it was taken on, which is
        still the key's), LEASE_EXPIRED when it did not, OBJECT_NOT_FOUND for an id that is not
        one of this client's lookup leases. The leases stay until their TTL. A hit is counted
        here, at the copy, not at the lookup (lookups repeat). ``corrupt``: ids whose copy did
        not match its checksum, checked after the codes are set, as ``check_reported`` does."""
        now = self._clock()
        codes: list[ErrorCode] = []
        reported: list[Lease] = []
        with self._lock:
            for lease_id in lease_ids:
                entry = self._leases.index.get(lease_id)
                obj = entry[0] if entry is not None and entry[1] == client_id else None
                state = obj.lease_state if obj is not None else None
                if obj is None or state is None or state.lookup.get(client_id) != lease_id:
                    codes.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                if self._objects.get(obj.key) is not obj or now > state.table[lease_id][1]:
                    self._stats["lease_expired"] += 1
                    codes.append(ErrorCode.LEASE_EXPIRED)
                    continue
                self._stats["hits"] += 1
                codes.append(ErrorCode.OK)
                if lease_id in corrupt:
                    reported.append(Lease(obj.key, obj.offset, obj.size, obj.generation, 0.0))
        for lease in reported:
            self.check_reported(lease)
        return codes

    # ---- in-process convenience (the `local` backend) -------------------------

    def put(self, client_id: str, key: str, buffers: Sequence[Buffer]) -> ErrorCode:
        """Store the concatenation of ``buffers`` under ``key`` (allocate, copy, commit).

        A key already stored or being written is a no-op OK: objects are
        immutable, so the other copy has the same bytes.
        """
        try:
            sources = [_as_u8(b) for b in buffers]
        except (TypeError, ValueError) as exc:
            logger.warning("put(key=%r): bad buffer (%s); pass contiguous uint8 arrays", key, exc)
            return ErrorCode.INVALID_PARAMS
        result = self.allocate(client_id, key, sum(s.size for s in sources))
        if result is ErrorCode.OBJECT_ALREADY_EXISTS:
            return ErrorCode.OK
        if isinstance(result, ErrorCode):
            return result
        try:
            pos = result.offset
            for src in sources:
                self._arena[pos : pos + src.size] = src
                pos += src.size
        except BaseException:
            self.abort(result.handle)
            raise
        return self.commit(result.handle)

    def get_into(self, client_id: str, key: str, buffers: Sequence[Buffer]) -> ErrorCode:
        """Copy ``key``'s bytes back-to-back into ``buffers`` (writable, sizes summing to the object size).

        INVALID_PARAMS when the sizes do not add up; LEASE_EXPIRED when the copy
        may be torn (the buffers then hold garbage and must be treated as a miss).
        """
        return self.batch_get_into(client_id, [key], [buffers])[0]

    def batch_put(
        self, client_id: str, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> list[ErrorCode]:
        """``put`` per key; one failing key does not stop the others."""
        n = len(keys)
        if n != len(values):
            return [ErrorCode.INVALID_PARAMS] * n
        codes: list[ErrorCode] = [ErrorCode.OK] * n
        sources: list[list[np.ndarray]] = [[] for _ in range(n)]
        wanted: list[int] = []
        for i, (key, bufs) in enumerate(zip(keys, values)):
            try:
                sources[i] = [_as_u8(b) for b in bufs]
                wanted.append(i)
            except (TypeError, ValueError) as exc:
                logger.warning("put(key=%r): bad buffer (%s); pass contiguous uint8 arrays", key, exc)
                codes[i] = ErrorCode.INVALID_PARAMS
        results = self.batch_allocate(client_id, [keys[i] for i in wanted],
                                      [sum(s.size for s in sources[i]) for i in wanted])
        handles: list[int] = []
        try:
            for i, result in zip(wanted, results):
                if isinstance(result, ErrorCode):
                    # Already stored or being written: objects are immutable, so that copy is this one.
                    codes[i] = ErrorCode.OK if result is ErrorCode.OBJECT_ALREADY_EXISTS else result
                    continue
                pos = result.offset
                for src in sources[i]:
                    self._arena[pos : pos + src.size] = src
                    pos += src.size
                handles.append(result.handle)
        except BaseException:
            self.batch_abort([r.handle for r in results if isinstance(r, Allocation)])
            raise
        committed = iter(self.batch_commit(handles))
        for i, result in zip(wanted, results):
            if isinstance(result, Allocation):
                codes[i] = next(committed)
        return codes

    def batch_get_into(
        self, client_id: str, keys: Sequence[str], buffers: Sequence[Sequence[Buffer]],
        copies: CopyEngine | None = None,
    ) -> list[ErrorCode]:
        """``get_into`` per key, as one batch: the in-memory hits are leased under one lock
        acquisition, copied (on ``copies``' threads when given), then validated and released
        under one acquisition each; keys below memory are read as in ``batch_acquire``. One
        failing key does not stop the others."""
        n = len(keys)
        if n != len(buffers):
            return [ErrorCode.INVALID_PARAMS] * n
        codes: list[ErrorCode] = [ErrorCode.OK] * n
        outs: list[list[np.ndarray]] = [[] for _ in range(n)]
        wanted: list[int] = []
        for i, (key, bufs) in enumerate(zip(keys, buffers)):
            try:
                outs[i] = [_as_u8(b, writable=True) for b in bufs]
            except (TypeError, ValueError) as exc:
                logger.warning("get_into(key=%r): bad buffer (%s); pass writable contiguous uint8 arrays", key, exc)
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            if not isinstance(key, str) or not key:
                codes[i] = ErrorCode.INVALID_KEY
                continue
            wanted.append(i)
        leases: dict[int, Lease] = {}
        now = self._clock()
        refused: set[int] = set()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for i in wanted:
                lease = self._lease_locked(client_id, keys[i], now)
                if isinstance(lease, ErrorCode):
                    codes[i] = lease
                    refused.add(i)
                elif lease is not None:
                    self._stats["hits"] += 1
                    leases[i] = lease
        below = [i for i in wanted if i not in leases and i not in refused]  # the spill buffer, the disk
        for i, got in zip(below, self._acquire_below(client_id, [keys[i] for i in below])):
            if isinstance(got, ErrorCode):
                codes[i] = got
            else:
                leases[i] = got
        jobs: list[tuple[np.ndarray, list[np.ndarray]]] = []
        copied: list[int] = []
        for i, lease in leases.items():
            total = sum(o.size for o in outs[i])
            if total != lease.size:
                logger.warning(
                    "get_into(key=%r): buffers hold %d bytes but the object has %d; "
                    "pass buffers whose sizes add up to the stored size",
                    keys[i], total, lease.size,
                )
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            src = (np.frombuffer(lease.data, dtype=np.uint8) if lease.data is not None
                   else self._arena[lease.offset : lease.offset + lease.size])
            jobs.append((src, outs[i]))
            copied.append(i)
        try:
            errors = (copies or _SERIAL).scatter_all(jobs)
            for i, err in zip(copied, errors):
                if err is not None:
                    logger.warning("get_into(key=%r): copy failed (%s)", keys[i], err)
                    codes[i] = ErrorCode.INVALID_PARAMS
            now = self._clock()
            with self._lock:
                for i in copied:
                    if codes[i] is ErrorCode.OK:
                        codes[i] = self._validate_locked(leases[i], now)
                        self._stats["gets" if codes[i] is ErrorCode.OK else "lease_expired"] += 1
        finally:
            with self._lock:
                for lease in leases.values():
                    self._leases.release(lease)
        return codes

    def batch_exists(
        self, keys: Sequence[str], client_id: str | None = None, lease: bool = False
    ) -> list[bool]:
        """Same as ``exists`` (named for symmetry with the other batch calls)."""
        return self.exists(keys, client_id, lease)

    # ---- management -------------------------------------------------------------

    def remove(self, key: str) -> ErrorCode:
        """Delete ``key`` from memory and disk; OBJECT_HAS_LEASE if a reader holds an unexpired lease.

        The disk writer's pin is not a lease the caller can see or wait out, so
        remove waits for it (one file write) instead of failing spuriously; for at most
        ``REMOVE_PIN_WAIT_S`` (a hung disk), then UNAVAILABLE_IN_CURRENT_STATUS.
        """
        now = self._clock()
        found = False
        deadline = time.monotonic() + REMOVE_PIN_WAIT_S
        with self._lock:
            self._leases.prune(now)
            while True:
                obj = self._objects.get(key)
                if obj is None:
                    break
                if obj.pinning > 0:  # exact: leases expired before now were pruned
                    return ErrorCode.OBJECT_HAS_LEASE
                if obj.pins:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        logger.warning("remove of key=%r: its disk write has not finished in %.0f s (a hung "
                                       "SSD tier?); not removed, retry later", key, REMOVE_PIN_WAIT_S)
                        return ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
                    self._unpinned.wait(left)
                    continue  # re-check: the object may have changed meanwhile
                self._drop_locked(obj)
                found = True
                break
            if self._spill.pop(key, None) is not None:
                found = True
        # A spill of this key already being written may still land on disk after
        # this; objects are immutable so that only resurrects identical bytes.
        if self._disk is not None and self._disk.remove(key) is ErrorCode.OK:
            found = True
        return ErrorCode.OK if found else ErrorCode.OBJECT_NOT_FOUND

    def ping(self, client_id: str) -> ErrorCode:
        """Heartbeat; every other call with a client_id counts as one too."""
        if not client_id:
            return ErrorCode.INVALID_PARAMS
        with self._lock:
            self._touch_client(client_id, self._clock())
        return ErrorCode.OK

    def reap(self, now: float | None = None) -> ReapReport:
        """Drop clients silent for client_ttl_s (their leases and unfinished allocations),
        allocations older than put_timeout_s, and expired leases."""
        if now is None:
            now = self._clock()
        cfg = self.config
        with self._lock:
            dead = {c for c, seen in self._clients.items() if now - seen > cfg.client_ttl_s}
            for client in dead:
                del self._clients[client]
                logger.warning("client %r silent for > client_ttl_s=%ss; dropping its leases and puts",
                               client, cfg.client_ttl_s)
            dropped_leases = self._leases.prune(now)
            for client in dead:
                dropped_leases += self._leases.drop_client(client)
                # Its binding stays: a stalled process's connection may talk again, and what it
                # then holds must count against its process, not as a quota of its own.
                # forget_client, on the connection's close, unbinds it.
            # Allocations are filed in creation order, so the timed-out ones are a prefix (an
            # allocation made a moment out of order is caught by the next reap); the dead
            # clients' come from the per-client index: neither walks every pending allocation.
            victims: dict[int, tuple[PendingPut, bool]] = {}
            for pending in self._pending.values():
                if now - pending.created_at <= cfg.put_timeout_s:
                    break
                if not pending.promotion:
                    victims[pending.handle] = (pending, True)
            for client in dead:
                for handle, pending in self._pending_by_client.get(client, {}).items():
                    victims.setdefault(handle, (pending, False))
            for pending, too_old in victims.values():
                logger.warning(
                    "reclaiming uncommitted allocation of key=%r (%d bytes, client %r): %s",
                    pending.key, pending.size, pending.client_id,
                    f"not committed within put_timeout_s={cfg.put_timeout_s}" if too_old
                    else "its client stopped pinging",
                )
                self._reclaim_locked(pending)
            reclaimed = len(victims)
            self._stats["reclaimed_allocations"] += reclaimed
            self._stats["reaped_clients"] += len(dead)
        return ReapReport(clients=len(dead), leases=dropped_leases, allocations=reclaimed)

    def forget_client(self, client_id: str) -> ReapReport:
        """Drop a client that is known to be gone (its connection closed) right away.

        Its leases and unfinished allocations go at once instead of after
        client_ttl_s: a SIGKILLed writer's half-written range is freed and never
        published; a dead reader's leases stop pinning objects.
        """
        with self._lock:
            known = self._clients.pop(client_id, None) is not None
            dropped_leases = self._leases.drop_client(client_id)
            mine = list(self._pending_by_client.get(client_id, {}).values())
            for pending in mine:
                self._reclaim_locked(pending)
            reclaimed = len(mine)
            self._leases.unbind(client_id)
            self._stats["reclaimed_allocations"] += reclaimed
        return ReapReport(clients=int(known), leases=dropped_leases, allocations=reclaimed)

    def pending_handles(self, client_id: str) -> set[int]:
        """Handles of ``client_id``'s allocations not yet committed, aborted or reclaimed."""
        with self._lock:
            return set(self._pending_by_client.get(client_id, ()))

    def bind_client(self, client_id: str, owner: str) -> None:
        """Count ``client_id``'s leases and allocations against ``owner`` (e.g. its process), so a
        client with several connections shares one quota. Unbound clients are their own owner. The
        binding outlives a reap (the client may talk again) and ends with :meth:`forget_client`."""
        with self._lock:
            self._leases.bind(client_id, owner)

    def holding(self, owner: str) -> tuple[int, int]:
        """(bytes, count) that ``owner`` holds in leased objects and uncommitted allocations."""
        with self._lock:
            self._leases.prune(self._clock())
            return self._leases.holding(owner)

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges for /stats and /metrics."""
        with self._lock:
            out: dict[str, int | float] = dict(self._stats)
            out.update(
                memory_used=self._alloc.used,
                memory_capacity=self._alloc.capacity,
                memory_largest_free=self._alloc.largest_free(),
                object_count=len(self._objects),
                pending_allocations=len(self._pending),
                spilling=len(self._spill),
                clients=len(self._clients),
                leases=len(self._leases.index),
                lease_ops=self._leases.ops,
                evict_steps=self._policy.steps,
                evictable_objects=self._policy.count,
                evictable_bytes=self._policy.bytes,
            )
        disk = self._disk
        out.update(
            disk_used=disk.used_bytes if disk else 0,
            disk_count=disk.count if disk else 0,
            disk_quota=disk.quota_bytes if disk else 0,
            disk_evictions=disk.evictions if disk else 0,
            checksum_failures=disk.checksum_failures if disk else 0,
            disk_full_events=disk.full_disk_events if disk else 0,
            disk_queue=self._queue.qsize() if self._queue else 0,
        )
        return out

    def close(self) -> None:
        """Stop background threads and flush the disk write-through queue. Idempotent.

        With write-through, objects the bounded queue had no room for are written now too, so a
        restarted engine on the same path finds every committed object. The flush runs as long
        as it makes progress: a healthy flush of any size finishes, but when no file completes
        for `CLOSE_STALL_S` (a hung SSD), close gives the device up, logs how many objects it
        left unwritten, and returns, leaving the tier's directory locked and without a restart
        index (the next start scans the files, as after a crash). Every thread that may still be
        stuck in the kernel is a daemon, so the process can exit.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._prefault is not None:
            self._prefault.close()
        if self._readers is not None:
            self._readers.close()
        flushed = True
        if self._writer is not None:
            flusher = threading.Thread(target=self._flush_disk, name="kvpool-disk-flush", daemon=True)
            flusher.start()
            flushed = self._wait_making_progress(flusher)
        if self._reaper is not None:
            self._reaper.join(CLOSE_STALL_S)  # a reap may delete files: bounded like the flush
            flushed = flushed and not self._reaper.is_alive()
        if self._disk is not None:
            if flushed:
                self._disk.close()  # its restart index, then its directory's lock
            else:
                with self._lock:
                    left = sum(1 for o in self._objects.values() if not o.on_disk)
                logger.error("closing the pool with the SSD tier at %s unresponsive for %.0f s: gave it up "
                             "with %d object(s) not written to it; the next start scans the directory",
                             self._disk.path, CLOSE_STALL_S, left)

    def _flush_disk(self) -> None:
        """Everything committed onto disk: the queue (FIFO, so all queued before the stop mark is
        written first), then whatever the bounded queue had no room for."""
        assert self._writer is not None and self._queue is not None
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            unsaved = [k for k, o in self._objects.items() if not o.on_disk]
        for key in unsaved:
            self._persist(key)

    def _wait_making_progress(self, thread: threading.Thread) -> bool:
        """Wait for `thread` while the disk writes keep completing; False once none has for
        `CLOSE_STALL_S` (the thread is then left to its fate)."""
        seen = self._disk_writes
        while True:
            thread.join(CLOSE_STALL_S)
            if not thread.is_alive():
                return True
            if self._disk_writes == seen:
                return False
            seen = self._disk_writes

    def __enter__(self) -> PoolEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (callers hold self._lock unless the name says otherwise) -----

    def _touch_client(self, client_id: str, now: float) -> None:
        if client_id:
            self._clients[client_id] = now

    def _sync_held_locked(self, obj: PoolObject) -> None:
        """Take ``obj`` out of the evictable objects when it became held, put it back when it
        stopped being held (the policy counts that as a use); call after its pins or pinning
        leases changed."""
        if obj.pins > 0 or obj.pinning > 0:
            self._policy.hold(obj)
        elif obj.prev is None and self._objects.get(obj.key) is obj:  # not dropped meanwhile
            self._policy.unhold(obj)

    def _object_charge(self, obj: PoolObject) -> int:
        return self._alloc.reserved_size(obj.size + self._meta_charge(obj.key))

    def _validate_locked(self, lease: Lease, now: float) -> ErrorCode:
        if now > lease.expires_at:
            return ErrorCode.LEASE_EXPIRED
        if lease.data is not None:  # bytes from disk or the spill buffer: a private copy
            return ErrorCode.OK
        obj = self._objects.get(lease.key)
        if (obj is None or obj.generation != lease.generation
                or (lease.lease_id != 0 and lease.lease_id not in obj.leases)):
            return ErrorCode.LEASE_EXPIRED
        return ErrorCode.OK

    def _lease_locked(self, client_id: str, key: str, now: float) -> Lease | ErrorCode | None:
        """A lease on the in-memory object ``key``; None when not in memory, an ErrorCode when refused."""
        obj = self._objects.get(key)
        if obj is None:
            return None
        added = self._leases.add(obj, client_id, now)
        if isinstance(added, ErrorCode):
            return added
        lease_id, expires_at = added
        self._policy.touch(obj)
        return Lease(key, obj.offset, obj.size, obj.generation, expires_at, lease_id, checksum=obj.checksum)

    def _storable_key(self, key: object) -> bool:
        return valid_key(key, self.config.max_key_bytes)

    def _meta_charge(self, key: str) -> int:
        """Budget bytes for an object's metadata: its key and index entries live in the heap."""
        overhead = self.config.object_overhead_bytes
        return overhead + len(key.encode("utf-8", "surrogatepass")) if overhead else 0

    def _unfile_pending_locked(self, pending: PendingPut) -> None:
        del self._pending[pending.handle]
        if self._pending_keys.get(pending.key) == pending.handle:  # else a put superseded it
            del self._pending_keys[pending.key]
        mine = self._pending_by_client[pending.client_id]
        del mine[pending.handle]
        if not mine:
            del self._pending_by_client[pending.client_id]

    def _reclaim_locked(self, pending: PendingPut) -> None:
        """Free an uncommitted allocation (aborted, timed out, or its client gone)."""
        self._unfile_pending_locked(pending)
        promotion = self._pending.get(pending.overtook)
        if promotion is not None and promotion.superseded and pending.key not in self._pending_keys:
            promotion.superseded = False  # still reading: it publishes, as if never overtaken
            self._pending_keys[pending.key] = promotion.handle
        self._alloc.free(pending.offset, pending.size + self._meta_charge(pending.key))
        self._uncharge_pending_locked(pending)

    def _uncharge_pending_locked(self, pending: PendingPut) -> None:
        if not pending.owner:
            return
        owner, pending.owner = pending.owner, ""
        self._leases.uncharge_allocation(owner, pending.charge)

    def _allocate_locked(
        self, client_id: str, key: str, size: int, now: float
    ) -> tuple[Allocation | ErrorCode, list[tuple[str, Spilled]]]:
        if key in self._objects:
            return ErrorCode.OBJECT_ALREADY_EXISTS, []
        overtaken = self._pending.get(self._pending_keys.get(key, -1))
        if overtaken is not None and not (overtaken.promotion and client_id):
            # Being written by a client (or promoted, for the engine's own next promotion).
            # A client's put overtakes a promotion instead of being told the key exists: the
            # promotion may find the disk copy corrupt and publish nothing, and the put's
            # bytes would then be lost to a caller that was told they were stored.
            return ErrorCode.OBJECT_ALREADY_EXISTS, []
        total = size + self._meta_charge(key)
        owner = self._leases.owner(client_id)
        charge = self._alloc.reserved_size(total)
        if owner and not self._leases.may_allocate(owner, charge):
            logger.debug("allocate(key=%r, size=%d): client %r is at its share of the pool", key, size, client_id)
            return ErrorCode.NO_AVAILABLE_HANDLE, []
        spills = self._make_room_locked(total, now)
        offset = self._alloc.allocate(total)
        if offset is not None and self._prefault is not None:
            self._prefault.note(offset + charge)
        if offset is None:
            self._stats["allocation_failures"] += 1
            logger.debug(
                "allocate(key=%r, size=%d): no room (used %d of %d, largest free %d); "
                "raise memory_size or lease less",
                key, size, self._alloc.used, self._alloc.capacity, self._alloc.largest_free(),
            )
            return ErrorCode.NO_AVAILABLE_HANDLE, spills
        pending = PendingPut(next(self._handles), key, offset, size, client_id, now, next(self._generations))
        if owner:
            pending.owner, pending.charge = owner, charge
            self._leases.charge_allocation(owner, charge)
        self._pending[pending.handle] = pending
        self._pending_keys[key] = pending.handle
        if overtaken is not None:
            overtaken.superseded = True
            pending.overtook = overtaken.handle
        self._pending_by_client.setdefault(client_id, {})[pending.handle] = pending
        return Allocation(pending.handle, key, offset, size), spills

    def _make_room_locked(self, size: int, now: float) -> list[tuple[str, Spilled]]:
        """Evict the policy's victims so ``size`` fits; return spills to write to disk after unlocking.

        Past the high watermark, evict eviction_ratio of the objects (at least one)
        and keep going until the request fits; below it, evict only if
        fragmentation leaves no contiguous range. When even evicting every
        evictable object could not make room, evict nothing: emptying the cache
        for a put that fails anyway would only cost hits.
        """
        need = self._alloc.reserved_size(size)
        if need > self._alloc.capacity:
            return []
        over = self._alloc.used + need > self._high_bytes
        if not over and self._alloc.largest_free() >= need:
            return []
        # Held objects are not listed by the policy, so this total and the victims below cost
        # nothing per held object, and nothing per object left in memory.
        if self._alloc.used - self._policy.bytes + need > self._alloc.capacity:
            return []
        target = max(1, math.ceil(self.config.eviction_ratio * len(self._objects))) if over else 0
        spills: list[tuple[str, Spilled]] = []
        evicted = 0
        while evicted < target or self._alloc.largest_free() < need:
            obj = self._policy.victim()
            if obj is None:
                break
            spill = self._drop_locked(obj, spill=True)
            if spill is not None:
                spills.append(spill)
            self._stats["evictions"] += 1
            evicted += 1
        return spills

    def _drop_locked(self, obj: PoolObject, spill: bool = False) -> tuple[str, Spilled] | None:
        """Remove ``obj`` from memory; when spilling and it is not on disk yet, keep a copy for the disk."""
        del self._objects[obj.key]  # first: dropping its leases below must not re-list it
        self._policy.remove(obj)
        self._leases.drop_object(obj)  # expired leases not pruned yet; live ones are never dropped
        out = None
        if spill and self._disk is not None and not obj.on_disk:
            entry = Spilled(self._arena[obj.offset : obj.offset + obj.size].tobytes(), obj.checksum)
            self._spill[obj.key] = entry
            out = (obj.key, entry)
        self._alloc.free(obj.offset, obj.size + self._meta_charge(obj.key))
        return out

    def _commit_locked(self, pending: PendingPut) -> PoolObject:
        self._unfile_pending_locked(pending)
        obj = PoolObject(pending.key, pending.offset, pending.size, pending.generation)
        self._objects[obj.key] = obj
        self._policy.insert(obj)
        self._stats["puts"] += 1
        if self._disk is not None:
            # Checked: a file found at start-up may be torn, and an object marked on disk is
            # evicted without a spill.
            obj.on_disk = self._disk.contains_checked(obj.key)
            if not obj.on_disk and self._queue is not None and not self._closed:
                try:
                    self._queue.put_nowait(obj.key)
                except queue.Full:
                    # Not lost: an object not on disk is spilled when evicted, and
                    # close() writes the rest.
                    pass
        return obj

    def _promote(
        self, client_id: str, key: str, size: int, fill: Callable[[np.ndarray], int], read: Callable[[], bytes],
    ) -> Lease | ErrorCode:
        """Lease a value of ``size`` bytes found below memory (call unlocked): ``fill(dest)``
        writes its verified bytes into an arena range and returns their checksum; where no
        range can be had, ``read()`` returns them for ``Lease.data``. Either raises StoreError
        (a miss: the code is returned) when the bytes are gone or corrupt.

        The fill runs outside the engine lock, as a client's put does: the range is a pending
        allocation, invisible to readers and marked ``promotion`` so that neither an abort nor
        the put timeout frees it while the fill writes it. Under the lock, a block of tens of
        MiB would stall every other client's calls for the milliseconds it takes. A disk read
        lands in the range directly, with no copy in between, and is hashed there: a client
        that scribbles on the shared arena meanwhile makes the file read as corrupt (a miss,
        the file dropped), never makes wrong bytes pass the check.
        """
        now = self._clock()
        spills: list[tuple[str, Spilled]] = []
        pending: PendingPut | None = None
        with self._lock:
            self._leases.prune(now)
            lease = self._lease_locked(client_id, key, now)  # another reader may have promoted it
            if isinstance(lease, ErrorCode):
                return lease
            if lease is not None:
                self._stats["hits"] += 1
                return lease
            # A key with a put (or another reader's promotion) in flight is not promoted: a
            # second arena copy would make the pending commit replace the leased promoted object
            # (new generation under the reader) or be dropped. The reader gets the verified
            # bytes instead; the commit later publishes the same immutable bytes.
            if key not in self._pending_keys:
                result, spills = self._allocate_locked("", key, size, now)
                pending = self._pending[result.handle] if isinstance(result, Allocation) else None
                if pending is not None:
                    pending.promotion = True
        try:
            if pending is None:
                data = read()
                lease = Lease(key, -1, len(data), 0, now + self._leases.ttl_s, 0, data)
            else:
                digest = fill(self._arena[pending.offset : pending.offset + size])
        except BaseException as exc:
            with self._lock:
                if pending is not None:
                    self._reclaim_locked(pending)
                if isinstance(exc, StoreError):
                    self._stats["misses"] += 1
            self._write_spills(spills)
            if isinstance(exc, StoreError):
                return exc.code
            raise
        if pending is not None:
            now = self._clock()
            promoted: Lease | ErrorCode | None = None
            with self._lock:
                if not pending.superseded:
                    self._commit_locked(pending).checksum = digest
                    self._stats["promotions"] += 1
                    promoted = self._lease_locked(client_id, key, now)
            if isinstance(promoted, Lease):
                lease = promoted
            else:
                # Over its quota (or overtaken by a put) the reader still gets the bytes, just not
                # an arena lease. Copied unleased (a committed range may be evicted and reused
                # meanwhile, and any client can write the shared arena): the hash decides.
                data = bytes(self._arena[pending.offset : pending.offset + size])
                if pending.superseded:
                    with self._lock:
                        self._reclaim_locked(pending)
                if checksum([data]) != digest:
                    self._write_spills(spills)
                    return promoted if isinstance(promoted, ErrorCode) else ErrorCode.OBJECT_NOT_FOUND
                lease = Lease(key, -1, size, 0, now + self._leases.ttl_s, 0, data)
        with self._lock:
            self._stats["disk_hits"] += 1
        self._write_spills(spills)
        return lease

    def _write_spills(self, spills: list[tuple[str, Spilled]]) -> None:
        """Write evicted objects to the disk tier (call unlocked: this is disk I/O)."""
        if not spills or self._disk is None:
            return
        for key, entry in spills:
            if not self._spilled_intact(key, entry):
                continue
            try:
                rc = self._disk.put(key, entry.data)
            except Exception:  # raising here would strand this spill and the later ones in the
                # spill buffer, their bytes held in memory for good
                logger.exception("spilling key=%r to the disk tier raised", key)
                rc = ErrorCode.INTERNAL_ERROR
            with self._lock:
                if rc is not ErrorCode.OK:
                    self._stats["disk_write_errors"] += 1
                    logger.warning("evicted key=%r could not be written to the disk tier (%s); it is lost",
                                   key, rc.name)
                if self._spill.get(key) is entry:
                    del self._spill[key]

    def _spilled_intact(self, key: str, entry: Spilled) -> bool:
        """Whether a spilled copy matches its writer's checksum (call unlocked). One that does
        not was overwritten in the shared arena before its eviction: it is dropped, counted in
        ``corrupt_objects`` once (by whichever check takes it out), and never written or read."""
        if entry.checksum is None or checksum([entry.data]) == entry.checksum:
            return True
        with self._lock:
            if self._spill.get(key) is entry:
                del self._spill[key]
                self._stats["corrupt_objects"] += 1
        return False

    def _persist(self, key: str) -> None:
        """Write one committed object to disk while pinned (call unlocked)."""
        assert self._disk is not None
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or obj.on_disk:
                return
            obj.pins += 1
            self._sync_held_locked(obj)
            view = self._arena[obj.offset : obj.offset + obj.size]
        rc = ErrorCode.INTERNAL_ERROR
        try:
            if obj.checksum is not None:
                # A private copy, checked, is what goes to disk: the arena is writable by every
                # client, and the disk tier's own CRC would bless whatever it was handed.
                view = view.tobytes()
                if checksum([view]) != obj.checksum:
                    with self._lock:
                        self._stats["corrupt_objects"] += 1
                    rc = ErrorCode.CHECKSUM_MISMATCH
                    return
            rc = self._disk.put(key, view)
        finally:
            with self._lock:
                self._disk_writes += 1
                obj.pins -= 1
                if rc is ErrorCode.OK:
                    obj.on_disk = True
                elif rc is not ErrorCode.CHECKSUM_MISMATCH:  # that one is counted as corrupt_objects
                    self._stats["disk_write_errors"] += 1
                if not obj.pins:
                    self._sync_held_locked(obj)
                    self._unpinned.notify_all()

    def _writer_loop(self) -> None:
        assert self._queue is not None
        while True:
            key = self._queue.get()
            if key is None:
                return
            try:
                self._persist(key)
            except Exception:  # the writer must survive one bad object
                logger.exception("disk writer: persisting key=%r failed", key)

    def _reaper_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.reap()
            except Exception:
                logger.exception("reaper: reap() failed")

    # ---- test/introspection hooks ----------------------------------------------

    def _debug_accounting(self) -> dict[str, tuple[int, int]]:
        """Per owner (charge, holds) recomputed from the leases and allocations themselves, after
        checking that every index agrees with the objects' own lease tables (tests)."""
        with self._lock:
            return self._leases.check(self._objects, self._pending.values())

    def _evictable_keys_locked(self) -> list[str]:
        keys = []
        for obj in self._policy:
            assert obj.next is not None and obj.next.prev is obj, "evictable list broken"
            keys.append(obj.key)
        return keys

    def _debug_track_lru(self) -> None:
        """Record every object's last use from now on, for ``_debug_check_evictable`` (tests)."""
        with self._lock:
            if not isinstance(self._policy, _RecordedUses):
                self._policy = _RecordedUses(self._policy)
            for key in self._evictable_keys_locked():  # their order so far is taken as given
                self._policy.used(key)

    def _debug_check_evictable(self) -> list[str]:
        """Check that the policy lists exactly the committed objects that are neither leased
        with pinning nor pinned, that its running totals agree with it, and (under ``lru``,
        tracked) that they are least recently used first; return its keys in its order (tests)."""
        with self._lock:
            keys = self._evictable_keys_locked()
            unheld = {k for k, o in self._objects.items() if not o.pins and not o.pinning}
            assert set(keys) == unheld and len(keys) == len(unheld), (keys, unheld)
            for key, obj in self._objects.items():
                assert (obj.prev is None) == (key not in unheld), key
            assert self._policy.count == len(keys)
            assert self._policy.bytes == sum(self._object_charge(self._objects[k]) for k in keys)
            if isinstance(self._policy, _RecordedUses) and self.config.eviction_policy == "lru":
                last = self._policy.last_use
                order = sorted(keys, key=lambda k: last.get(k, -1))
                assert keys == order, ("not in LRU order", keys, order)
            for client, mine in self._pending_by_client.items():
                assert all(self._pending[h] is p and p.client_id == client for h, p in mine.items())
            assert sum(map(len, self._pending_by_client.values())) == len(self._pending)
            return keys

    def _debug_snapshot(self) -> dict[str, Any]:
        """Consistent copy of internal state for invariant checks in tests."""
        with self._lock:
            return {
                "objects": {
                    k: ObjectView(o.key, o.offset, o.size, o.generation, dict(o.leases), o.pins, o.on_disk,
                                  o.pinning, dict(o.lease_state.lookup) if o.lease_state else {}, o.checksum)
                    for k, o in self._objects.items()
                },
                "pending": {h: dataclasses.replace(p) for h, p in self._pending.items()},
                "live_ranges": sorted(
                    [(o.offset, self._object_charge(o)) for o in self._objects.values()]
                    + [(p.offset, self._alloc.reserved_size(p.size + self._meta_charge(p.key)))
                       for p in self._pending.values()]),
                "used": self._alloc.used,
                "capacity": self._alloc.capacity,
                "lru": self._evictable_keys_locked(),
            }
