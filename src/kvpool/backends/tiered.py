"""The host pool in front of a distributed store: `backend: local` or `server` with a
`remote_backend` (Mooncake Store, openYuanrong, MemCache, Redis).

A block computed on one host is served to every other host through the remote tier, and, once
a host has read it, from that host's own memory:

- **Save**: into the host pool, as without a remote tier; the keys the host pool stored are
  then queued for write-through (what the host pool refuses, full or down, goes to the remote
  store at once, from the caller's buffers), and a background thread reads them back from the host pool
  and writes them to the remote store in batches. The queue is bounded (`remote_queue_blocks`):
  past it a save is not written through and is counted, and vLLM never waits for the remote
  store. A key the remote store already holds is not sent again (one batched lookup first).
- **Lookup**: the host pool first; the keys it misses are asked of the remote store, whose
  client runs under the lookup deadline behind its circuit breaker (`backends.guard`), so a
  hung store costs one deadline, then misses.
- **Load**: from the host pool; what it misses is read from the remote store straight into
  vLLM's buffers, copied once, and stored into the host pool by the background thread
  (promotion), so the next hit on this host never crosses the network. Copies waiting to be
  promoted are bounded (`PROMOTE_BYTES`); past it a block is not promoted this time.

Each tier checks its own bytes: the host pool's checksums, the remote store's seal or header
(`backends.seal`); a block read from the remote store is promoted only after its check passed.
Invariant: the background thread reads the host pool and its own copies and writes the host
pool and the remote store; it never touches a caller's buffers, so nothing it does can change
bytes vLLM reads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvpool.backends.base import Backend, Presence, gather, total_size
from kvpool.errors import EXISTS, INVALID, OK, ErrorCode, is_stored
from kvpool.metrics.catalog import REMOTE_TIER_RESULTS, remote_tier_counter

if TYPE_CHECKING:
    from kvpool.backends.registry import Capabilities

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One write-through round moves at most this many blocks or bytes.
BATCH_BLOCKS = 64
BATCH_BYTES = 64 << 20
# Bytes of copies waiting to be promoted into the host pool.
PROMOTE_BYTES = 256 << 20
# How long `close` keeps writing through what is still queued.
DRAIN_S = 10.0
# The tier's own counters (`tier_stats`), named as the connector exports them.
HIT, PROMOTED, WRITTEN, SKIPPED, DROPPED, FAILED = (remote_tier_counter(r) for r in REMOTE_TIER_RESULTS)


class TieredBackend(Backend):
    """`host` (the pool on this host) in front of `remote` (a distributed store)."""

    def __init__(self, host: Backend, remote: Backend, queue_blocks: int) -> None:
        self.host, self.remote = host, remote
        self.name = f"{host.name}+{remote.name}"
        self.queue_blocks = queue_blocks
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, int]] = collections.deque()
        self._queued: set[str] = set()
        self._promotions: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self._promote_bytes = 0
        self._busy = 0  # blocks taken off the queues and not yet settled
        self._closing = False
        self._tier = dict.fromkeys(map(remote_tier_counter, REMOTE_TIER_RESULTS), 0)
        self._queued_total = 0
        self._writer = threading.Thread(target=self._write_through_loop, name="kvpool-write-through", daemon=True)
        self._writer.start()

    @property
    def capabilities(self) -> Capabilities:
        return self.host.capabilities

    def batch_pin(self, keys: Sequence[str], ttl_s: float) -> list[int] | None:
        return self.host.batch_pin(keys, ttl_s)  # pins keep bytes in this host's memory

    # ---- hooks ------------------------------------------------------------------------------

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return self._ask_below(keys, self.host.batch_exists(keys, lease), lease, True)

    def _presence(self, keys: list[str]) -> list[Presence]:
        # The remote store's hits are never pinned here: its reads cross the network.
        return self._ask_below(keys, self.host.batch_presence(keys), True, Presence.STORED)

    def _ask_below(self, keys: list[str], found: list[T], lease: bool, stored: T) -> list[T]:
        """The host pool's answers `found`, with each key it misses that the remote store holds
        answered `stored`."""
        below = [i for i, hit in enumerate(found) if not hit]
        if below:
            for i, hit in zip(below, self.remote.batch_exists([keys[i] for i in below], lease)):
                if hit:
                    found[i] = stored
        return found

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        codes = self.host.batch_put(keys, values)
        self._enqueue([(k, total_size(v)) for k, v, c in zip(keys, values, codes) if c == OK])
        # The host pool refused them (full, or its server is down): straight to the remote
        # store, from vLLM's buffers, under its deadline, so the cluster still gets them.
        refused = [i for i, c in enumerate(codes) if not is_stored(c) and c != INVALID]
        if refused:
            for i, code in zip(refused, self.remote.batch_put([keys[i] for i in refused], [values[i] for i in refused])):
                codes[i] = code
                if is_stored(code):
                    self._count(**{WRITTEN: 1})
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        codes = self.host.batch_get_into(keys, values)
        # A miss, or a host copy that failed its check: the remote store may have good bytes.
        below = [i for i, c in enumerate(codes) if c not in (OK, INVALID)]
        if not below:
            return codes
        got = self.remote.batch_get_into([keys[i] for i in below], [values[i] for i in below])
        served = []
        for i, code in zip(below, got):
            if code != ErrorCode.OBJECT_NOT_FOUND:  # the remote's answer says more than the host's miss
                codes[i] = code
            if code == OK:
                served.append(i)
        if served:
            self._count(**{HIT: len(served)})
            self._promote([(keys[i], values[i]) for i in served])
        return codes

    def _promote(self, items: list[tuple[str, list[np.ndarray]]]) -> None:
        """Queue copies of blocks the remote tier served (checked by its seal) for the host pool,
        within `PROMOTE_BYTES`: one memcpy here, the host pool's put on the background thread."""
        with self._cond:
            room = PROMOTE_BYTES - self._promote_bytes
        take = []
        for key, bufs in items:
            size = total_size(bufs)
            if size > room or self._closing:
                continue
            room -= size
            take.append((key, gather(bufs)))
        if take:
            with self._cond:
                self._promotions.extend(take)
                self._promote_bytes += sum(data.size for _, data in take)
                self._cond.notify()

    # ---- write-through ----------------------------------------------------------------------

    def _enqueue(self, items: list[tuple[str, int]]) -> None:
        if not items:
            return
        queued = dropped = 0
        with self._cond:
            for key, size in items:
                if key in self._queued:
                    continue
                if len(self._queue) >= self.queue_blocks or self._closing:
                    dropped += 1
                    continue
                self._queue.append((key, size))
                self._queued.add(key)
                queued += 1
            self._queued_total += queued
            self._tier[DROPPED] += dropped
            if queued:
                self._cond.notify()

    def _take(self) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, int]]]:
        """The next promotions and batch to write through; both empty once closing and drained."""
        with self._cond:
            while not self._queue and not self._promotions and not self._closing:
                self._cond.wait()
            promotions = list(self._promotions)
            self._promotions.clear()
            batch: list[tuple[str, int]] = []
            nbytes = 0
            while self._queue and len(batch) < BATCH_BLOCKS and (not batch or nbytes + self._queue[0][1] <= BATCH_BYTES):
                key, size = self._queue.popleft()
                self._queued.discard(key)
                batch.append((key, size))
                nbytes += size
            self._busy = len(batch) + len(promotions)
            return promotions, batch

    def _write_through_loop(self) -> None:
        while True:
            promotions, batch = self._take()
            if not promotions and not batch:
                return
            try:
                if promotions:
                    put = self.host.batch_put([k for k, _ in promotions], [[data] for _, data in promotions])
                    self._count(**{PROMOTED: sum(is_stored(c) and c != EXISTS for c in put)})
                if batch:
                    self._write_through(batch)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad batch
                logger.exception("kvpool %s: promoting %d and writing %d blocks through failed", self.name,
                                 len(promotions), len(batch))
                self._count(**{FAILED: len(batch)})
            finally:
                with self._cond:
                    self._busy = 0
                    self._promote_bytes -= sum(data.size for _, data in promotions)
                    self._cond.notify_all()

    def _write_through(self, batch: list[tuple[str, int]]) -> None:
        keys = [k for k, _ in batch]
        there = self.remote.batch_exists(keys)
        todo = [(k, n) for (k, n), held in zip(batch, there) if not held]
        skipped = len(batch) - len(todo)
        if not todo:
            self._count(**{SKIPPED: skipped})
            return
        bufs = [[np.empty(n, dtype=np.uint8)] for _, n in todo]
        read = self.host.batch_get_into([k for k, _ in todo], bufs)
        have = [i for i, c in enumerate(read) if c == OK]  # evicted from the host meanwhile: gone
        written = failed = 0
        if have:
            for code in self.remote.batch_put([todo[i][0] for i in have], [bufs[i] for i in have]):
                if is_stored(code):
                    written += 1
                else:
                    failed += 1
        self._count(**{SKIPPED: skipped, WRITTEN: written, FAILED: failed, DROPPED: len(todo) - len(have)})

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far was promoted and written through (or dropped);
        False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._promotions or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _count(self, **deltas: int) -> None:
        with self._cond:
            for name, n in deltas.items():
                self._tier[name] += n

    # ---- stats and life cycle ---------------------------------------------------------------

    def tier_stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._tier, "remote_queued_blocks": self._queued_total,
                    "remote_queue_depth": len(self._queue) + self._busy}

    def stats(self) -> dict[str, float]:
        """The host pool's numbers, the remote store's prefixed `remote_store_`, and `tier_stats`."""
        out = dict(self.host.stats())
        out.update({f"remote_store_{k}": v for k, v in self.remote.stats().items()})
        out.update(self.tier_stats())
        return out

    def guard_stats(self) -> dict[str, int]:
        """Deadline and breaker counters of both tiers, added up."""
        host, remote = self.host.guard_stats(), self.remote.guard_stats()
        return {k: host.get(k, 0) + remote.get(k, 0) for k in host.keys() | remote.keys()}

    def _close(self) -> None:
        if not self.flush(DRAIN_S):
            logger.warning("kvpool %s: %d blocks were not written through to the remote tier before close",
                           self.name, len(self._queue) + self._busy)
        with self._cond:
            self._closing = True
            self._tier[DROPPED] += len(self._queue)
            self._queue.clear()
            self._queued.clear()
            self._promotions.clear()
            self._cond.notify_all()
        self._writer.join(DRAIN_S)
        self.remote.close()
        self.host.close()
