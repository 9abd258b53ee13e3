"""The operator's hand on one pool engine: pins with a time to live, and a listing of what the
pool holds (for `kvpool server`'s controller API, `server/control.py`).

A pin is a pinning lease of the operator's own client, :data:`OPERATOR`, that lasts the pin's
TTL instead of a reader's lease TTL: the engine's eviction already skips an object under a
pinning lease, the reaper already ends expired leases, and `remove` already refuses a leased
object, so a pin needs no rule of its own anywhere else. Invariants:

* an object has at most one operator pin; pinning it again moves the expiry (either way);
* the operator's pins hold at most :data:`PIN_SHARE` of the memory tier, so pinning can never
  leave a put no room (the fair-share quotas of `store/leases.py` bound the clients; this bounds
  the operator, whose leases count against no client's quota);
* a key the SSD tier holds and memory does not is promoted first (a pin keeps memory bytes).

Not a separate lock: every method takes the engine's, as the engine's own calls do.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.errors import ErrorCode
from kvpool.store.arena_index import ArenaIndex
from kvpool.store.disk_link import DiskLink
from kvpool.store.records import Lease

if TYPE_CHECKING:
    from kvpool.store.engine import PoolEngine

OPERATOR = "kvpool:operator"  # the client id of the operator's pins
_PROMOTER = "kvpool:operator-promote"  # reads an SSD-only key into memory before it is pinned
PIN_SHARE = 0.5  # of the memory tier's capacity, at most, under operator pins
MAX_PIN_S = 7 * 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class Contents:
    """What the pool holds, key by key: the bytes each takes in memory and on the SSD (its file,
    header included), and the expiry (engine clock) of each operator pin."""

    memory: dict[str, int]
    ssd: dict[str, int]
    pinned: dict[str, float]


class Controls:
    """Pins and listings over one engine (see the module docstring for the invariants)."""

    def __init__(self, engine: PoolEngine, index: ArenaIndex, below: DiskLink, lock: threading.Lock,
                 clock: Callable[[], float]) -> None:
        self._engine = engine
        self._index = index
        self._below = below
        self._lock = lock
        self._clock = clock
        self._pins: dict[str, Lease] = {}  # key -> the lease that pins it (possibly expired since)

    def pin(self, keys: Sequence[str], ttl_s: float) -> list[ErrorCode]:
        """Keep each key in memory for ``ttl_s`` seconds: OK; OBJECT_NOT_FOUND where the pool does
        not hold it; NO_AVAILABLE_HANDLE once the pins would pass their share of memory."""
        if not 0 < ttl_s <= MAX_PIN_S:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        out = self._pin_in_memory(keys, ttl_s)
        missing = [k for k, rc in zip(keys, out) if rc is ErrorCode.OBJECT_NOT_FOUND]
        if missing and self._below.disk is not None:
            # Promote the SSD's copies through the engine's own read path, then pin what landed.
            leases = [got for got in self._engine.batch_acquire(_PROMOTER, missing) if isinstance(got, Lease)]
            self._engine.batch_release(leases)
            self._engine.forget_client(_PROMOTER)
            again = dict(zip(missing, self._pin_in_memory(missing, ttl_s)))
            out = [again.get(k, rc) if rc is ErrorCode.OBJECT_NOT_FOUND else rc for k, rc in zip(keys, out)]
        return out

    def _pin_in_memory(self, keys: Sequence[str], ttl_s: float) -> list[ErrorCode]:
        index = self._index
        leases = index.leases
        out: list[ErrorCode] = []
        with self._lock:
            now = self._clock()
            leases.prune(now)
            pinned = self._live_pins_locked()
            budget = int(PIN_SHARE * index.alloc.capacity) - sum(
                index.object_charge(obj) for k in pinned if (obj := index.objects.get(k)) is not None)
            for key in keys:
                obj = index.objects.get(key)
                if obj is None:
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                old = pinned.get(key)
                charge = 0 if old is not None else index.object_charge(obj)
                if charge > budget:
                    out.append(ErrorCode.NO_AVAILABLE_HANDLE)
                    continue
                added = leases.add(obj, OPERATOR, now, ttl_s=ttl_s, accounted=False)
                assert not isinstance(added, ErrorCode)  # unaccounted leases are never refused
                if old is not None:
                    leases.drop(old.lease_id)  # after the new one pins, so it never becomes evictable
                budget -= charge
                pinned[key] = Lease(key, obj.offset, obj.size, obj.generation, added[1], added[0])
                out.append(ErrorCode.OK)
        return out

    def unpin(self, keys: Sequence[str]) -> list[ErrorCode]:
        """End the operator's pins of ``keys``: OK, or OBJECT_NOT_FOUND for a key not pinned."""
        out = []
        with self._lock:
            pinned = self._live_pins_locked()
            for key in keys:
                lease = pinned.pop(key, None)
                if lease is None:
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                self._index.leases.drop(lease.lease_id)
                out.append(ErrorCode.OK)
        return out

    def _live_pins_locked(self) -> dict[str, Lease]:
        """The pins whose lease still holds (expired and dropped ones forgotten)."""
        index = self._index.leases.index
        for key in [k for k, lease in self._pins.items() if lease.lease_id not in index]:
            del self._pins[key]
        return self._pins

    def pinned_count(self) -> int:
        """How many objects the operator's pins hold now."""
        with self._lock:
            return len(self._live_pins_locked())

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """Per budgeted tenant tag: (memory bytes its objects and allocations take, its budget)."""
        with self._lock:
            shares = self._index.tenants
            if shares is None:
                return {}
            return {tag: (shares.used[tag], budget) for tag, budget in shares.budgets.items()}

    def contents(self) -> Contents:
        """A snapshot of every key the pool holds (an operator's listing: O(objects), of which
        only a copy of the index is made under the engine's lock)."""
        index = self._index
        with self._lock:
            objects = list(index.objects.values())
            pinned = {key: lease.expires_at for key, lease in self._live_pins_locked().items()}
        # An object's key and size never change, so its charge is computed unlocked.
        memory = {obj.key: index.object_charge(obj) for obj in objects}
        disk = self._below.disk
        ssd = dict(disk.items()) if disk is not None else {}
        return Contents(memory, ssd, pinned)
