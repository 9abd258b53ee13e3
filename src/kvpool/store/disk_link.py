"""The pool's memory tier joined to its SSD tier: write-through, spills, promotions.

Every committed object is queued for the SSD (write-through, when configured) and written by one
background thread; an object evicted before it got there is copied out under the engine's lock
and written from the spill buffer, which serves readers meanwhile; a read that misses memory is
served from the spill buffer or the SSD and promoted back into the arena when a range can be had.

Invariants:

* what goes to the SSD is a private copy whose bytes match the checksum its writer committed
  (the arena is writable by every client of the shared pool, and the SSD tier's own CRC would
  bless whatever it was handed); a copy that does not match is dropped, counted once in
  ``corrupt_objects``, and never written or read;
* an object is pinned while the writer copies it, so it is neither evicted nor removed under
  the copy; ``remove`` waits for the pin (`store/engine.py`);
* a promotion fills a pending allocation marked ``promotion`` outside the lock: neither an abort
  nor the put timeout frees it meanwhile, and a client's put of the same key overtakes it;
* no method holds the engine's lock over disk I/O or a hash, so a hung SSD stalls the threads
  doing disk I/O, never a memory hit. Lock order: engine lock -> the SSD tier's index lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.errors import ErrorCode, StoreError
from kvpool.store.arena_index import ArenaIndex, Spill
from kvpool.store.buffers import checksum
from kvpool.store.disk import DiskTier
from kvpool.store.records import Allocation, Lease, PendingPut, PoolObject, Spilled
from kvpool.store.workers import DaemonWorkers

logger = logging.getLogger(__name__)

# Disk-tier reads one batch keeps in flight: an SSD serves several requests at once far faster
# than one after another (queue depth), and past a handful the device, not the queue, limits.
# Measured through `kvpool server` on a 2-vCPU VM (1 MiB values, batches of 16, cold page cache,
# runs alternating): 4 readers 838-1025 MB/s, 8 readers 950-1060, 16 readers 761-822 (their
# promotions and the client's copies then crowd the two cores).
DISK_READERS = 8
# How long `close` waits for a disk write to complete before it gives the SSD up: it waits as long
# as files keep completing, so only a device that stopped answering is given up.
CLOSE_STALL_S = 30.0


def _copy_in(data: bytes, dest: np.ndarray) -> int:
    """Copy ``data`` into ``dest`` (a promotion's arena range); their checksum."""
    dest[:] = np.frombuffer(data, dtype=np.uint8)
    return checksum([data])


class DiskLink:
    """Moves objects between the arena (``index``) and the SSD tier ``disk`` (None: no SSD tier,
    and every read below memory is a miss). ``lock`` is the engine's, ``unpinned`` its condition
    signalled when an object's last pin goes."""

    def __init__(self, index: ArenaIndex, disk: DiskTier | None, lock: threading.Lock,
                 unpinned: threading.Condition, clock: Callable[[], float]) -> None:
        self._index = index
        self.disk = disk
        self._lock = lock
        self._unpinned = unpinned
        self._clock = clock
        self._stats = index.stats
        self._closed = False
        self._readers: DaemonWorkers | None = None  # made at the first batch read from disk
        self._writes = 0  # files the write-through has finished (either way): close's progress mark
        self._queue: queue.Queue[str | None] | None = None
        self._writer: threading.Thread | None = None
        if disk is not None and index.config.disk_write_through:
            self._queue = queue.Queue(maxsize=index.config.disk_queue_size)
            self._writer = threading.Thread(target=self._writer_loop, name="kvpool-disk-writer", daemon=True)
            self._writer.start()

    # ---- under the engine's lock -------------------------------------------------------------

    def holds(self, key: str) -> bool:
        """Whether ``key`` is below memory: in the spill buffer or on the SSD (call locked)."""
        return key in self._index.spill or (self.disk is not None and self.disk.contains(key))

    def committed(self, obj: PoolObject) -> None:
        """Note a newly committed object: whether the SSD has it already, else queue it for the
        write-through (call locked)."""
        if self.disk is None:
            return
        # Checked: a file found at start-up may be torn, and an object marked on disk is
        # evicted without a spill.
        obj.on_disk = self.disk.contains_checked(obj.key)
        if not obj.on_disk and self._queue is not None and not self._closed:
            try:
                self._queue.put_nowait(obj.key)
            except queue.Full:
                # Not lost: an object not on disk is spilled when evicted, and close() writes the rest.
                pass

    # ---- reads below memory (call unlocked) --------------------------------------------------

    def acquire(self, client_id: str, key: str, spilled: Spilled | None) -> Lease | ErrorCode:
        """A lease on ``key``, which memory did not hold: from its spilled copy (``spilled``, as
        the caller found it under the lock) or the SSD, promoted when a range can be had."""
        if spilled is not None and self._spilled_intact(key, spilled):
            data = spilled.data
            return self._promote(client_id, key, len(data), lambda dest: _copy_in(data, dest), lambda: data)
        disk = self.disk
        size = disk.payload_size(key) if disk is not None else None
        if disk is None or size is None:
            with self._lock:
                self._stats["misses"] += 1
            return ErrorCode.OBJECT_NOT_FOUND
        return self._promote(client_id, key, size, lambda dest: disk.read_into(key, dest), lambda: disk.get(key))

    def acquire_many(self, keys: Sequence[str], acquire: Callable[[str], Lease | ErrorCode]) -> list[Lease | ErrorCode]:
        """``acquire`` (the engine's) per key of a batch that missed memory. With an SSD tier their
        file reads (and the hashes, which release the GIL) run side by side, so a batch keeps
        several reads in flight on the disk instead of one; promotions still take the lock one
        at a time."""
        if len(keys) > 1 and self.disk is not None and not self._closed:
            with self._lock:
                if self._readers is None:
                    self._readers = DaemonWorkers(DISK_READERS, "kvpool-disk-read")
                readers = self._readers
            return list(readers.map(acquire, keys))
        return [acquire(key) for key in keys]

    def _promote(
        self, client_id: str, key: str, size: int, fill: Callable[[np.ndarray], int], read: Callable[[], bytes],
    ) -> Lease | ErrorCode:
        """Lease a value of ``size`` bytes found below memory: ``fill(dest)`` writes its verified
        bytes into an arena range and returns their checksum; where no range can be had,
        ``read()`` returns them for ``Lease.data``. Either raises StoreError (a miss: the code
        is returned) when the bytes are gone or corrupt.

        The fill runs outside the engine lock, as a client's put does: the range is a pending
        allocation, invisible to readers and marked ``promotion`` so that neither an abort nor
        the put timeout frees it while the fill writes it. Under the lock, a block of tens of
        MiB would stall every other client's calls for the milliseconds it takes. A disk read
        lands in the range directly, with no copy in between, and is hashed there: a client
        that scribbles on the shared arena meanwhile makes the file read as corrupt (a miss,
        the file dropped), never makes wrong bytes pass the check.
        """
        index = self._index
        now = self._clock()
        spills: list[Spill] = []
        pending: PendingPut | None = None
        with self._lock:
            index.leases.prune(now)
            lease = index.lease(client_id, key, now)  # another reader may have promoted it
            if isinstance(lease, ErrorCode):
                return lease
            if lease is not None:
                self._stats["hits"] += 1
                return lease
            # A key with a put (or another reader's promotion) in flight is not promoted: a
            # second arena copy would make the pending commit replace the leased promoted object
            # (new generation under the reader) or be dropped. The reader gets the verified
            # bytes instead; the commit later publishes the same immutable bytes.
            if key not in index.pending_keys:
                result, spills = index.allocate("", key, size, now)
                pending = index.pending[result.handle] if isinstance(result, Allocation) else None
                if pending is not None:
                    pending.promotion = True
        try:
            if pending is None:
                data = read()
                lease = Lease(key, -1, len(data), 0, now + index.leases.ttl_s, 0, data)
            else:
                digest = fill(index.arena[pending.offset : pending.offset + size])
        except BaseException as exc:
            with self._lock:
                if pending is not None:
                    index.reclaim(pending)
                if isinstance(exc, StoreError):
                    self._stats["misses"] += 1
            self.write_spills(spills)
            if isinstance(exc, StoreError):
                return exc.code
            raise
        if pending is not None:
            now = self._clock()
            promoted: Lease | ErrorCode | None = None
            with self._lock:
                if not pending.superseded:
                    obj = index.commit(pending)
                    obj.checksum = digest
                    self.committed(obj)
                    self._stats["promotions"] += 1
                    promoted = index.lease(client_id, key, now)
            if isinstance(promoted, Lease):
                lease = promoted
            else:
                # Over its quota (or overtaken by a put) the reader still gets the bytes, just not
                # an arena lease. Copied unleased (a committed range may be evicted and reused
                # meanwhile, and any client can write the shared arena): the hash decides.
                data = bytes(index.arena[pending.offset : pending.offset + size])
                if pending.superseded:
                    with self._lock:
                        index.reclaim(pending)
                if checksum([data]) != digest:
                    self.write_spills(spills)
                    return promoted if isinstance(promoted, ErrorCode) else ErrorCode.OBJECT_NOT_FOUND
                lease = Lease(key, -1, size, 0, now + index.leases.ttl_s, 0, data)
        with self._lock:
            self._stats["disk_hits"] += 1
        self.write_spills(spills)
        return lease

    # ---- writes (call unlocked) --------------------------------------------------------------

    def write_spills(self, spills: list[Spill]) -> None:
        """Write evicted objects to the SSD tier."""
        if not spills or self.disk is None:
            return
        for key, entry in spills:
            if not self._spilled_intact(key, entry):
                continue
            try:
                rc = self.disk.put(key, entry.data)
            except Exception:  # raising here would strand this spill and the later ones in the
                # spill buffer, their bytes held in memory for good
                logger.exception("spilling key=%r to the disk tier raised", key)
                rc = ErrorCode.INTERNAL_ERROR
            with self._lock:
                if rc is not ErrorCode.OK:
                    self._stats["disk_write_errors"] += 1
                    logger.warning("evicted key=%r could not be written to the disk tier (%s); it is lost",
                                   key, rc.name)
                if self._index.spill.get(key) is entry:
                    del self._index.spill[key]

    def _spilled_intact(self, key: str, entry: Spilled) -> bool:
        """Whether a spilled copy matches its writer's checksum. One that does not was
        overwritten in the shared arena before its eviction: it is dropped, counted in
        ``corrupt_objects`` once (by whichever check takes it out), and never written or read."""
        if entry.checksum is None or checksum([entry.data]) == entry.checksum:
            return True
        with self._lock:
            if self._index.spill.get(key) is entry:
                del self._index.spill[key]
                self._stats["corrupt_objects"] += 1
        return False

    def _persist(self, key: str) -> None:
        """Write one committed object to disk while pinned."""
        assert self.disk is not None
        index = self._index
        with self._lock:
            obj = index.objects.get(key)
            if obj is None or obj.on_disk:
                return
            obj.pins += 1
            index.sync_held(obj)
            view = index.arena[obj.offset : obj.offset + obj.size]
        rc = ErrorCode.INTERNAL_ERROR
        try:
            if obj.checksum is not None:
                # A private copy, checked, is what goes to disk (the module docstring says why).
                view = view.tobytes()
                if checksum([view]) != obj.checksum:
                    with self._lock:
                        self._stats["corrupt_objects"] += 1
                    rc = ErrorCode.CHECKSUM_MISMATCH
                    return
            rc = self.disk.put(key, view)
        finally:
            with self._lock:
                self._writes += 1
                obj.pins -= 1
                if rc is ErrorCode.OK:
                    obj.on_disk = True
                elif rc is not ErrorCode.CHECKSUM_MISMATCH:  # that one is counted as corrupt_objects
                    self._stats["disk_write_errors"] += 1
                if not obj.pins:
                    index.sync_held(obj)
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

    # ---- removal, stats, shutdown ------------------------------------------------------------

    def watch_removals(self, limit: int) -> None:
        if self.disk is not None:
            self.disk.watch_removals(limit)

    def take_removed(self) -> list[str]:
        """Keys the SSD tier let go since the last call (`DiskTier.take_removed`)."""
        return self.disk.take_removed() if self.disk is not None else []

    def remove(self, key: str) -> bool:
        """Delete ``key``'s SSD copy (call unlocked); whether there was one."""
        return self.disk is not None and self.disk.remove(key) is ErrorCode.OK

    def stats(self) -> dict[str, int]:
        """The SSD tier's gauges and counters (zero without one)."""
        disk = self.disk
        return dict(
            disk_used=disk.used_bytes if disk else 0,
            disk_count=disk.count if disk else 0,
            disk_quota=disk.quota_bytes if disk else 0,
            disk_evictions=disk.evictions if disk else 0,
            checksum_failures=disk.checksum_failures if disk else 0,
            disk_full_events=disk.full_disk_events if disk else 0,
            disk_queue=self._queue.qsize() if self._queue else 0,
        )

    def flush(self) -> bool:
        """Stop the readers and write everything committed to the SSD: the queue (FIFO, so all
        queued before the stop mark is written first), then whatever the bounded queue had no
        room for. Runs as long as files keep completing; False once none has for
        `CLOSE_STALL_S` (a hung SSD, left to its fate on a daemon thread)."""
        with self._lock:
            self._closed = True
        if self._readers is not None:
            self._readers.close()
        if self._writer is None:
            return True
        flusher = threading.Thread(target=self._flush, name="kvpool-disk-flush", daemon=True)
        flusher.start()
        seen = self._writes
        while True:
            flusher.join(CLOSE_STALL_S)
            if not flusher.is_alive():
                return True
            if self._writes == seen:
                return False
            seen = self._writes

    def _flush(self) -> None:
        assert self._writer is not None and self._queue is not None
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            unsaved = [k for k, o in self._index.objects.items() if not o.on_disk]
        for key in unsaved:
            self._persist(key)

    def close(self, flushed: bool) -> None:
        """Close the SSD tier after `flush` (and anything else that may write it) finished:
        its restart index, then its directory's lock; when the flush gave up, leave the
        directory locked and without a restart index (the next start scans the files)."""
        if self.disk is None:
            return
        if flushed:
            self.disk.close()
            return
        with self._lock:
            left = sum(1 for o in self._index.objects.values() if not o.on_disk)
        logger.error("closing the pool with the SSD tier at %s unresponsive for %.0f s: gave it up "
                     "with %d object(s) not written to it; the next start scans the directory",
                     self.disk.path, CLOSE_STALL_S, left)

