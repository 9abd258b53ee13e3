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

The engine answers the calls and keeps the clients; the memory tier's bookkeeping (which key
holds which arena range, the pending allocations, eviction) is `store/arena_index.py`; moving
objects to and from the SSD tier (write-through, spills, promotions) `store/disk_link.py`;
in-process puts and gets `store/inproc.py`; leases and the fair-share accounting
`store/leases.py` (O(log n) per lease), the records they file `store/records.py`, eviction
order `store/policy.py`, its settings `store/engine_config.py`, and its test hooks
`store/engine_debug.py`.

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

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvpool.errors import ErrorCode
from kvpool.keys import valid_key
from kvpool.store import engine_debug, inproc
from kvpool.store.arena_index import ArenaIndex, Spill
from kvpool.store.buffers import checksum
from kvpool.store.controls import Controls
from kvpool.store.disk_link import CLOSE_STALL_S, DiskLink
from kvpool.store.engine_config import EngineConfig
from kvpool.store.inproc import Buffer
from kvpool.store.memcopy import CopyEngine
from kvpool.store.records import (
    Allocation,
    Lease,
    LookupLease,
    Presence,
    ReapReport,
)

logger = logging.getLogger(__name__)

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
    "tenant_evictions",  # objects a tenant's allocation evicted of its own, at its budget
    "tenant_budget_refusals",  # allocations refused: the tenant at its budget, every object of it held
)

# How long `remove` waits for the disk writer to unpin its object (one file write) before it
# answers that it could not: a hung SSD must not hold the caller's thread forever.
REMOVE_PIN_WAIT_S = 30.0


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
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._index = ArenaIndex(config, arena, self._stats)
        self._leases = self._index.leases
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # signalled when the disk writer unpins
        self._below = DiskLink(self._index, config.disk, self._lock, self._unpinned, clock)
        self.controls = Controls(self, self._index, self._below, self._lock, clock)  # the operator's pins
        self._clients: dict[str, float] = {}
        self._closed = False
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if config.reap_interval_s > 0:
            self._reaper = threading.Thread(target=self._reaper_loop, name="kvpool-reaper", daemon=True)
            self._reaper.start()

    # ---- arena ----------------------------------------------------------------

    @property
    def arena(self) -> memoryview:
        """The managed arena (``memory_size`` bytes) that offsets refer to."""
        return memoryview(self._index.arena)

    @property
    def capacity(self) -> int:
        """Usable bytes (memory_size rounded down to the alignment)."""
        return self._index.alloc.capacity

    def reserved_size(self, size: int) -> int:
        """Arena bytes an object of ``size`` occupies (rounded up to the alignment, min one unit)."""
        return self._index.alloc.reserved_size(size)

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
        return self.batch_allocate(client_id, [key], [size])[0]

    def batch_allocate(
        self, client_id: str, keys: Sequence[str], sizes: Sequence[int]
    ) -> list[Allocation | ErrorCode]:
        """``allocate`` per key under one lock acquisition; one failing key does not stop the others."""
        if len(keys) != len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        out: list[Allocation | ErrorCode] = []
        spills: list[Spill] = []
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for key, size in zip(keys, sizes):
                if not valid_key(key, self.config.max_key_bytes):
                    out.append(ErrorCode.INVALID_KEY)
                elif isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    out.append(ErrorCode.INVALID_PARAMS)
                else:
                    result, more = self._index.allocate(client_id, key, size, now)
                    out.append(result)
                    spills.extend(more)
        self._below.write_spills(spills)
        return out

    def commit(self, handle: int, checksum: int | None = None) -> ErrorCode:
        """Make an allocation visible to readers, with the checksum of the bytes its writer
        copied in (readers of the shared arena check their copies against it).

        OBJECT_NOT_FOUND when the handle is unknown: never issued, already
        committed/aborted, or reclaimed by ``reap`` (writer silent past
        client_ttl_s, or not committed within put_timeout_s) - the bytes were
        not stored and the put must be retried.
        """
        return self.batch_commit([handle], [checksum])[0]

    def batch_commit(self, handles: Sequence[int], checksums: Sequence[int | None] | None = None) -> list[ErrorCode]:
        """``commit`` per handle under one lock acquisition (``checksums``: one per handle, or None)."""
        if checksums is not None and len(checksums) != len(handles):
            return [ErrorCode.INVALID_PARAMS] * len(handles)
        now = self._clock()
        codes: list[ErrorCode] = []
        with self._lock:
            for i, handle in enumerate(handles):
                pending = self._index.callers_pending(handle)
                if pending is None:
                    logger.warning(
                        "commit(handle=%r): unknown handle (already committed/aborted, or reclaimed "
                        "after put_timeout_s=%s / client_ttl_s=%s); retry the put",
                        handle, self.config.put_timeout_s, self.config.client_ttl_s,
                    )
                    codes.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                self._touch_client(pending.client_id, now)
                self._index.uncharge(pending)
                obj = self._index.commit(pending)
                obj.checksum = checksums[i] if checksums else None
                self._below.committed(obj)
                codes.append(ErrorCode.OK)
        return codes

    def abort(self, handle: int) -> ErrorCode:
        """Give back an allocation without publishing it (OBJECT_NOT_FOUND if the handle is unknown)."""
        return self.batch_abort([handle])[0]

    def batch_abort(self, handles: Sequence[int]) -> list[ErrorCode]:
        """``abort`` per handle under one lock acquisition."""
        codes: list[ErrorCode] = []
        with self._lock:
            for handle in handles:
                pending = self._index.callers_pending(handle)
                if pending is None:
                    codes.append(ErrorCode.OBJECT_NOT_FOUND)
                else:
                    self._index.reclaim(pending)
                    codes.append(ErrorCode.OK)
        return codes

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
            lease = self._index.lease(client_id, key, now)
            if isinstance(lease, ErrorCode):
                return lease
            if lease is not None:
                self._stats["hits"] += 1
                return lease
            spilled = self._index.spill.get(key)
        return self._below.acquire(client_id, key, spilled)

    def batch_acquire(self, client_id: str, keys: Sequence[str]) -> list[Lease | ErrorCode]:
        """``acquire`` per key: the in-memory hits under one lock acquisition; keys found only
        in the spill buffer or on disk follow, their disk reads side by side (that is disk I/O,
        done unlocked)."""
        out: list[Lease | ErrorCode | None] = [None] * len(keys)
        now = self._clock()
        with self._lock:
            self._touch_client(client_id, now)
            self._leases.prune(now)
            for i, key in enumerate(keys):
                if not isinstance(key, str) or not key:
                    out[i] = ErrorCode.INVALID_KEY
                    continue
                lease = self._index.lease(client_id, key, now)
                if lease is not None:
                    if isinstance(lease, Lease):
                        self._stats["hits"] += 1
                    out[i] = lease
        below = [i for i, got in enumerate(out) if got is None]
        found = self._below.acquire_many([keys[i] for i in below], lambda key: self.acquire(client_id, key))
        for i, got in zip(below, found):
            out[i] = got
        return out  # type: ignore[return-value]

    def batch_release(self, leases: Sequence[Lease], copied: bool = False) -> list[ErrorCode]:
        """``validate`` then ``release`` per lease, under one lock acquisition: the codes tell
        whether each copy made under the lease is to be trusted. ``copied``: this process made
        the copies (those that held are counted in ``gets``)."""
        now = self._clock()
        codes: list[ErrorCode] = []
        with self._lock:
            for lease in leases:
                rc = self._index.validate(lease, now)
                if rc is not ErrorCode.OK:
                    self._stats["lease_expired"] += 1
                elif copied:
                    self._stats["gets"] += 1
                codes.append(rc)
                self._leases.release(lease)
        return codes

    def check_reported(self, lease: Lease) -> bool:
        """A reader's copy under ``lease`` did not match its writer's checksum: hash the object
        here and drop it if its arena bytes no longer match (counted in ``corrupt_objects``), so
        the key misses and its next put stores good bytes instead of meeting put-if-absent.
        The report only triggers the engine's own check: a client cannot drop an intact object.
        Whether the object was dropped."""
        index = self._index
        with self._lock:
            obj = index.objects.get(lease.key)
            if obj is None or obj.generation != lease.generation or obj.checksum is None or obj.pins:
                return False
            # Hashed unlocked, pinned so that it stays where it is: a report may name a block of
            # tens of MiB, and a client could send one after every read.
            obj.pins += 1
            index.sync_held(obj)
        intact = True  # if hashing fails, the object stays
        try:
            intact = checksum([index.arena[obj.offset : obj.offset + obj.size]]) == obj.checksum
        finally:
            with self._lock:
                obj.pins -= 1
                # Someone else may have leased, pinned or removed it meanwhile: then it stays
                # (or is gone) as it would have been had the check run first.
                drop = not intact and not obj.pins and index.objects.get(obj.key) is obj
                if drop:
                    self._stats["corrupt_objects"] += 1
                    # Its readers' leases end with it: their copies fail validation, never pass as good.
                    index.drop(obj)
                elif not obj.pins:
                    index.sync_held(obj)
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
            rc = self._index.validate(lease, now)
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
        with self._lock:
            if client_id:
                self._touch_client(client_id, now)
            objects = self._index.objects
            return [key in objects or self._below.holds(key) for key in keys]

    def batch_exists(
        self, keys: Sequence[str], client_id: str | None = None, lease: bool = False
    ) -> list[bool]:
        """Same as ``exists`` (named for symmetry with the other batch calls)."""
        return self.exists(keys, client_id, lease)

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
                obj = self._index.objects.get(key)
                if obj is not None:
                    held = self._leases.lookup_lease(obj, client_id, now)
                    out.append(Presence.PINNED if held is not None and held[1] >= pinned_until else Presence.STORED)
                else:
                    out.append(Presence.STORED if self._below.holds(key) else Presence.ABSENT)
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
                obj = self._index.objects.get(key) if isinstance(key, str) and key else None
                if obj is None:
                    out.append(isinstance(key, str) and bool(key) and self._below.holds(key))
                    continue
                held = self._leases.lookup_lease(obj, client_id, now)
                out.append(True if held is None else LookupLease(held[0], obj.offset, obj.size, obj.checksum))
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
                if self._index.objects.get(obj.key) is not obj or now > state.table[lease_id][1]:
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

    # ---- in-process copies (the `local` backend; store/inproc.py) ----------------

    def put(self, client_id: str, key: str, buffers: Sequence[Buffer]) -> ErrorCode:
        """Store the concatenation of ``buffers`` under ``key`` (allocate, copy, commit).

        A key already stored or being written is a no-op OK: objects are
        immutable, so the other copy has the same bytes.
        """
        return inproc.batch_put(self, client_id, [key], [buffers])[0]

    def batch_put(self, client_id: str, keys: Sequence[str], values: Sequence[Sequence[Buffer]]) -> list[ErrorCode]:
        """``put`` per key; one failing key does not stop the others."""
        return inproc.batch_put(self, client_id, keys, values)

    def get_into(self, client_id: str, key: str, buffers: Sequence[Buffer]) -> ErrorCode:
        """Copy ``key``'s bytes back-to-back into ``buffers`` (writable, sizes summing to the object size).

        INVALID_PARAMS when the sizes do not add up; LEASE_EXPIRED when the copy
        may be torn (the buffers then hold garbage and must be treated as a miss).
        """
        return inproc.batch_get_into(self, client_id, [key], [buffers])[0]

    def batch_get_into(self, client_id: str, keys: Sequence[str], buffers: Sequence[Sequence[Buffer]],
                       copies: CopyEngine | None = None) -> list[ErrorCode]:
        """``get_into`` per key, as one batch, copying on ``copies``' threads when given."""
        return inproc.batch_get_into(self, client_id, keys, buffers, copies)

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
                obj = self._index.objects.get(key)
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
                self._index.drop(obj)
                found = True
                break
            if self._index.spill.pop(key, None) is not None:
                found = True
        # A spill of this key already being written may still land on disk after
        # this; objects are immutable so that only resurrects identical bytes.
        if self._below.remove(key):
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
        index = self._index
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
            victims = index.abandoned(now, cfg.put_timeout_s, dead)
            for pending, too_old in victims:
                logger.warning(
                    "reclaiming uncommitted allocation of key=%r (%d bytes, client %r): %s",
                    pending.key, pending.size, pending.client_id,
                    f"not committed within put_timeout_s={cfg.put_timeout_s}" if too_old
                    else "its client stopped pinging",
                )
                index.reclaim(pending)
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
            mine = list(self._index.pending_by_client.get(client_id, {}).values())
            for pending in mine:
                self._index.reclaim(pending)
            self._leases.unbind(client_id)
            self._stats["reclaimed_allocations"] += len(mine)
        return ReapReport(clients=int(known), leases=dropped_leases, allocations=len(mine))

    def pending_handles(self, client_id: str) -> set[int]:
        """Handles of ``client_id``'s allocations not yet committed, aborted or reclaimed."""
        with self._lock:
            return set(self._index.pending_by_client.get(client_id, ()))

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

    def watch_drops(self, limit: int = 1 << 16) -> None:
        """From now on, note the keys that leave the pool (evicted from the last tier that held
        them, removed, dropped as corrupt), the newest ``limit`` between two `take_drops`."""
        with self._lock:
            if self._index.drops is None:
                self._index.drops = collections.deque(maxlen=limit)
                self._below.watch_removals(limit)

    def take_drops(self) -> list[str]:
        """The keys that left the pool since the last call (`watch_drops`): of the keys that left
        memory or the SSD tier meanwhile, those found in neither now (an eviction from memory to
        the SSD keeps a key in the pool; one stored again is back)."""
        with self._lock:
            drops = self._index.drops
            if drops is None:
                return []
            left = list(dict.fromkeys([*drops, *self._below.take_removed()]))
            drops.clear()
            objects = self._index.objects
            return [k for k in left if k not in objects and not self._below.holds(k)]

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges for /stats and /metrics."""
        with self._lock:
            out: dict[str, int | float] = dict(self._stats)
            out.update(self._index.gauges(), clients=len(self._clients))
        out.update(self._below.stats())
        return out

    def close(self) -> None:
        """Stop background threads and flush the disk write-through queue. Idempotent.

        With write-through, objects the bounded queue had no room for are written now too, so a
        restarted engine on the same path finds every committed object. The flush runs as long
        as it makes progress: a healthy flush of any size finishes, but when no file completes
        for a stall limit (a hung SSD; store/disk_link.py), close gives the device up, logs how
        many objects it left unwritten, and returns, leaving the tier's directory locked and
        without a restart index (the next start scans the files, as after a crash). Every thread
        that may still be stuck in the kernel is a daemon, so the process can exit.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._index.prefault is not None:
            self._index.prefault.close()
        flushed = self._below.flush()
        if self._reaper is not None:
            self._reaper.join(CLOSE_STALL_S)  # a reap may delete files: bounded like the flush
            flushed = flushed and not self._reaper.is_alive()
        self._below.close(flushed)

    def __enter__(self) -> PoolEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _touch_client(self, client_id: str, now: float) -> None:
        if client_id:
            self._clients[client_id] = now

    def _reaper_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.reap()
            except Exception:
                logger.exception("reaper: reap() failed")

    # ---- test/introspection hooks (store/engine_debug.py) -----------------------

    def _debug_accounting(self) -> dict[str, tuple[int, int]]:
        """Per owner (charge, holds) recomputed from the leases and allocations themselves, after
        checking that every index agrees with the objects' own lease tables (tests)."""
        with self._lock:
            return self._leases.check(self._index.objects, self._index.pending.values())

    def _debug_track_lru(self) -> None:
        """Record every object's last use from now on, for ``_debug_check_evictable`` (tests)."""
        with self._lock:
            engine_debug.track_lru(self._index)

    def _debug_check_evictable(self) -> list[str]:
        """The policy lists exactly the unheld committed objects, in LRU order where tracked (tests)."""
        with self._lock:
            return engine_debug.check_evictable(self._index)

    def _debug_snapshot(self) -> dict[str, Any]:
        """Consistent copy of internal state for invariant checks in tests."""
        with self._lock:
            return engine_debug.snapshot(self._index)
