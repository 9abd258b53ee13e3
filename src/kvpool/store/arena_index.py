"""The pool's memory tier: which key holds which range of the arena, the allocations not yet
committed, the eviction order, and the leases on what is there.

Invariants (tests/store/test_properties.py checks them under random operation sequences):

* memory used (the allocator's reserved bytes) never exceeds capacity, and live ranges (committed
  objects and pending allocations) never overlap;
* a key is committed (``objects``) or being written (``pending_keys``) or neither; a client's put
  may overtake the engine's own promotion of the same key, never another put;
* the eviction policy lists exactly the committed objects nobody holds (no pinning lease, no
  pin), so eviction never meets a held object and never touches an uncommitted one;
* with ``keeps_spills``, an object evicted before it reached the SSD leaves a copy of its bytes
  in ``spill`` for the disk writer, so eviction moves data down a tier instead of losing it.
* with tenant budgets (``tenants``), a budgeted tenant's charge (its objects and pending
  allocations) never passes its budget: its allocation evicts its own objects first, or is
  refused (`store/tenants.py`).

Not thread-safe on its own: the engine and its disk link call every method under the engine's
one lock (store/engine.py says why there is only one).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import mmap
from collections.abc import Collection

import numpy as np

from kvpool.errors import ConfigError, ErrorCode
from kvpool.store.allocator import OffsetAllocator
from kvpool.store.buffers import as_u8
from kvpool.store.engine_config import EngineConfig
from kvpool.store.leases import LeaseBook
from kvpool.store.policy import EvictionPolicy, make_policy
from kvpool.store.prefault import Prefaulter
from kvpool.store.records import Allocation, Lease, PendingPut, PoolObject, Spilled
from kvpool.store.tenants import TenantShares

logger = logging.getLogger(__name__)

Spill = tuple[str, Spilled]  # an evicted object's key and bytes, on their way to the SSD


def private_arena(size: int) -> np.ndarray:
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


class ArenaIndex:
    """The memory tier's bookkeeping (see the module docstring for invariants).

    ``arena`` is a caller's buffer (the server's shared memory) or None for a private one of
    ``config.memory_size`` bytes; ``stats`` is the engine's counter table.
    """

    def __init__(self, config: EngineConfig, arena: memoryview | None, stats: dict[str, int]) -> None:
        self.config = config
        self.stats = stats
        # Our own arena's pages are mapped ahead of the allocations, the first look-ahead now,
        # while the process starts (see store/prefault.py); a caller's arena (the server's shared
        # memory) is its writers' to map.
        self.prefault: Prefaulter | None = None
        if arena is None:
            self.arena = private_arena(config.memory_size)
            if config.memory_size and config.prefault:
                self.prefault = Prefaulter(self.arena)
                self.prefault.note(0)
        else:
            try:
                arr = as_u8(arena, writable=True)
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
            self.arena = arr[: config.memory_size]
        # No per-range table in the allocator: the index knows every range's size (see free).
        self.alloc = OffsetAllocator(config.memory_size, config.alignment, track_live=False)
        self._high_bytes = config.eviction_high_watermark_ratio * self.alloc.capacity
        self.keeps_spills = config.disk is not None
        self.objects: dict[str, PoolObject] = {}
        # The evictable objects (committed, nobody holds them), linked through the objects
        # themselves in the policy's order: eviction takes its victims and never meets a held
        # object; its count and bytes are running totals.
        self.tenants: TenantShares | None = None
        if config.tenant_budgets:
            self.tenants = TenantShares(config.eviction_policy, self.alloc.capacity, self.object_charge,
                                        config.tenant_budgets)
        self.policy: EvictionPolicy = self.tenants or make_policy(config.eviction_policy, self.alloc.capacity,
                                                                  self.object_charge)
        # handle -> allocation, in creation order (so reap finds the timed-out ones at the front).
        self.pending: dict[int, PendingPut] = {}
        self.pending_by_client: dict[str, dict[int, PendingPut]] = {}
        self.pending_keys: dict[str, int] = {}
        # Evicted objects on their way to disk; readers are served from here meanwhile.
        self.spill: dict[str, Spilled] = {}
        # Keys dropped from memory (for any reason), while someone watches (`PoolEngine.watch_drops`,
        # which tells which of them left the pool): the newest `maxlen`.
        self.drops: collections.deque[str] | None = None
        self._handles = itertools.count(1)
        self._generations = itertools.count(1)
        self.leases = LeaseBook(config, self.alloc.capacity, self.object_charge, self.sync_held, stats)

    # ---- sizes -------------------------------------------------------------------------------

    def meta_charge(self, key: str) -> int:
        """Budget bytes for an object's metadata: its key and index entries live in the heap."""
        overhead = self.config.object_overhead_bytes
        return overhead + len(key.encode("utf-8", "surrogatepass")) if overhead else 0

    def object_charge(self, obj: PoolObject) -> int:
        """The arena bytes ``obj`` occupies, its metadata's budget included."""
        return self.alloc.reserved_size(obj.size + self.meta_charge(obj.key))

    # ---- reads -------------------------------------------------------------------------------

    def sync_held(self, obj: PoolObject) -> None:
        """Take ``obj`` out of the evictable objects when it became held, put it back when it
        stopped being held (the policy counts that as a use); call after its pins or pinning
        leases changed."""
        if obj.pins > 0 or obj.pinning > 0:
            self.policy.hold(obj)
        elif obj.prev is None and self.objects.get(obj.key) is obj:  # not dropped meanwhile
            self.policy.unhold(obj)

    def lease(self, client_id: str, key: str, now: float) -> Lease | ErrorCode | None:
        """A lease on the in-memory object ``key`` (a use for the eviction policy); None when not
        in memory, an ErrorCode when the quotas refuse it."""
        obj = self.objects.get(key)
        if obj is None:
            return None
        added = self.leases.add(obj, client_id, now)
        if isinstance(added, ErrorCode):
            return added
        lease_id, expires_at = added
        self.policy.touch(obj)
        return Lease(key, obj.offset, obj.size, obj.generation, expires_at, lease_id, checksum=obj.checksum)

    def validate(self, lease: Lease, now: float) -> ErrorCode:
        """OK when ``lease`` held: unexpired, and (an arena lease) still on the object it was
        taken on; LEASE_EXPIRED otherwise."""
        if now > lease.expires_at:
            return ErrorCode.LEASE_EXPIRED
        if lease.data is not None:  # bytes from disk or the spill buffer: a private copy
            return ErrorCode.OK
        obj = self.objects.get(lease.key)
        if (obj is None or obj.generation != lease.generation
                or (lease.lease_id != 0 and lease.lease_id not in obj.leases)):
            return ErrorCode.LEASE_EXPIRED
        return ErrorCode.OK

    # ---- allocations -------------------------------------------------------------------------

    def callers_pending(self, handle: int) -> PendingPut | None:
        """The pending allocation behind a caller's handle; None for an unknown handle and for
        the engine's own promotions (handles are sequential, so one can be guessed)."""
        pending = self.pending.get(handle)
        return None if pending is None or pending.promotion else pending

    def allocate(self, client_id: str, key: str, size: int, now: float) -> tuple[Allocation | ErrorCode, list[Spill]]:
        """Reserve ``size`` bytes for ``key``, evicting as needed; the spills that eviction left
        for the SSD (write them after unlocking). ``client_id`` "" is the engine's own
        promotion."""
        if key in self.objects:
            return ErrorCode.OBJECT_ALREADY_EXISTS, []
        overtaken = self.pending.get(self.pending_keys.get(key, -1))
        if overtaken is not None and not (overtaken.promotion and client_id):
            # Being written by a client (or promoted, for the engine's own next promotion).
            # A client's put overtakes a promotion instead of being told the key exists: the
            # promotion may find the disk copy corrupt and publish nothing, and the put's
            # bytes would then be lost to a caller that was told they were stored.
            return ErrorCode.OBJECT_ALREADY_EXISTS, []
        total = size + self.meta_charge(key)
        owner = self.leases.owner(client_id)
        charge = self.alloc.reserved_size(total)
        if owner and not self.leases.may_allocate(owner, charge):
            logger.debug("allocate(key=%r, size=%d): client %r is at its share of the pool", key, size, client_id)
            return ErrorCode.NO_AVAILABLE_HANDLE, []
        spills: list[Spill] = []
        if self.tenants is not None and not self._within_budget(key, charge, spills):
            return ErrorCode.NO_AVAILABLE_HANDLE, spills
        spills += self._make_room(total)
        offset = self.alloc.allocate(total)
        if offset is not None and self.prefault is not None:
            self.prefault.note(offset + charge)
        if offset is None:
            self.stats["allocation_failures"] += 1
            logger.debug(
                "allocate(key=%r, size=%d): no room (used %d of %d, largest free %d); "
                "raise memory_size or lease less",
                key, size, self.alloc.used, self.alloc.capacity, self.alloc.largest_free(),
            )
            return ErrorCode.NO_AVAILABLE_HANDLE, spills
        pending = PendingPut(next(self._handles), key, offset, size, client_id, now, next(self._generations))
        if self.tenants is not None:
            self.tenants.note(key, charge)
        if owner:
            pending.owner, pending.charge = owner, charge
            self.leases.charge_allocation(owner, charge)
        self.pending[pending.handle] = pending
        self.pending_keys[key] = pending.handle
        if overtaken is not None:
            overtaken.superseded = True
            pending.overtook = overtaken.handle
        self.pending_by_client.setdefault(client_id, {})[pending.handle] = pending
        return Allocation(pending.handle, key, offset, size), spills

    def _within_budget(self, key: str, charge: int, spills: list[Spill]) -> bool:
        """Whether ``key``'s tenant may take ``charge`` more bytes, after evicting its own objects
        (their spills added to ``spills``) if it would pass its budget (`store/tenants.py`)."""
        assert self.tenants is not None
        while self.tenants.over_budget(key, charge):
            obj = self.tenants.victim_of(key)
            if obj is None:
                self.stats["tenant_budget_refusals"] += 1
                logger.debug("allocate(key=%r): its tenant is at its budget and holds every object it has", key)
                return False
            spill = self.drop(obj, spill=True)
            if spill is not None:
                spills.append(spill)
            self.stats["evictions"] += 1
            self.stats["tenant_evictions"] += 1
        return True

    def _make_room(self, size: int) -> list[Spill]:
        """Evict the policy's victims so ``size`` fits; return spills to write to disk after unlocking.

        Past the high watermark, evict eviction_ratio of the objects (at least one)
        and keep going until the request fits; below it, evict only if
        fragmentation leaves no contiguous range. When even evicting every
        evictable object could not make room, evict nothing: emptying the cache
        for a put that fails anyway would only cost hits.
        """
        need = self.alloc.reserved_size(size)
        if need > self.alloc.capacity:
            return []
        over = self.alloc.used + need > self._high_bytes
        if not over and self.alloc.largest_free() >= need:
            return []
        # Held objects are not listed by the policy, so this total and the victims below cost
        # nothing per held object, and nothing per object left in memory.
        if self.alloc.used - self.policy.bytes + need > self.alloc.capacity:
            return []
        target = max(1, math.ceil(self.config.eviction_ratio * len(self.objects))) if over else 0
        spills: list[Spill] = []
        evicted = 0
        while evicted < target or self.alloc.largest_free() < need:
            obj = self.policy.victim()
            if obj is None:
                break
            spill = self.drop(obj, spill=True)
            if spill is not None:
                spills.append(spill)
            self.stats["evictions"] += 1
            evicted += 1
        return spills

    def commit(self, pending: PendingPut) -> PoolObject:
        """Publish a pending allocation as a committed object (the caller sets its checksum)."""
        self.unfile(pending)
        obj = PoolObject(pending.key, pending.offset, pending.size, pending.generation)
        self.objects[obj.key] = obj
        self.policy.insert(obj)
        self.stats["puts"] += 1
        return obj

    def reclaim(self, pending: PendingPut) -> None:
        """Free an uncommitted allocation (aborted, timed out, or its client gone)."""
        self.unfile(pending)
        promotion = self.pending.get(pending.overtook)
        if promotion is not None and promotion.superseded and pending.key not in self.pending_keys:
            promotion.superseded = False  # still reading: it publishes, as if never overtaken
            self.pending_keys[pending.key] = promotion.handle
        self.alloc.free(pending.offset, pending.size + self.meta_charge(pending.key))
        if self.tenants is not None:
            self.tenants.note(pending.key, -self.alloc.reserved_size(pending.size + self.meta_charge(pending.key)))
        self.uncharge(pending)

    def abandoned(self, now: float, timeout_s: float, clients: Collection[str]) -> list[tuple[PendingPut, bool]]:
        """The clients' allocations that are to be reclaimed: those older than ``timeout_s``
        (True beside them), and every one of ``clients`` (False)."""
        # Allocations are filed in creation order, so the timed-out ones are a prefix (an
        # allocation made a moment out of order is caught by the next reap); the dead clients'
        # come from the per-client index: neither walks every pending allocation.
        victims: dict[int, tuple[PendingPut, bool]] = {}
        for pending in self.pending.values():
            if now - pending.created_at <= timeout_s:
                break
            if not pending.promotion:
                victims[pending.handle] = (pending, True)
        for client in clients:
            for handle, pending in self.pending_by_client.get(client, {}).items():
                victims.setdefault(handle, (pending, False))
        return list(victims.values())

    def unfile(self, pending: PendingPut) -> None:
        """Take ``pending`` out of the three indexes of pending allocations."""
        del self.pending[pending.handle]
        if self.pending_keys.get(pending.key) == pending.handle:  # else a put superseded it
            del self.pending_keys[pending.key]
        mine = self.pending_by_client[pending.client_id]
        del mine[pending.handle]
        if not mine:
            del self.pending_by_client[pending.client_id]

    def uncharge(self, pending: PendingPut) -> None:
        """End ``pending``'s charge to its owner's share (once, however often called)."""
        if not pending.owner:
            return
        owner, pending.owner = pending.owner, ""
        self.leases.uncharge_allocation(owner, pending.charge)

    def drop(self, obj: PoolObject, spill: bool = False) -> Spill | None:
        """Remove ``obj`` from memory; when spilling and it is not on disk yet, keep a copy for the disk."""
        del self.objects[obj.key]  # first: dropping its leases below must not re-list it
        self.policy.remove(obj)
        self.leases.drop_object(obj)  # expired leases not pruned yet; live ones are never dropped
        out = None
        if spill and self.keeps_spills and not obj.on_disk:
            entry = Spilled(self.arena[obj.offset : obj.offset + obj.size].tobytes(), obj.checksum)
            self.spill[obj.key] = entry
            out = (obj.key, entry)
        if self.drops is not None:
            self.drops.append(obj.key)
        if self.tenants is not None:
            self.tenants.note(obj.key, -self.object_charge(obj))
        self.alloc.free(obj.offset, obj.size + self.meta_charge(obj.key))
        return out

    def gauges(self) -> dict[str, int]:
        """The memory tier's gauges for /stats and /metrics."""
        alloc, policy = self.alloc, self.policy
        return dict(memory_used=alloc.used, memory_capacity=alloc.capacity, memory_largest_free=alloc.largest_free(),
                    object_count=len(self.objects), pending_allocations=len(self.pending), spilling=len(self.spill),
                    leases=len(self.leases.index), lease_ops=self.leases.ops, evict_steps=policy.steps,
                    evictable_objects=policy.count, evictable_bytes=policy.bytes)

    def evictable_keys(self) -> list[str]:
        """The policy's keys in its order, checking its links on the way (tests)."""
        keys = []
        for obj in self.policy:
            assert obj.next is not None and obj.next.prev is obj, "evictable list broken"
            keys.append(obj.key)
        return keys
