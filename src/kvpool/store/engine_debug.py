"""The pool engine's invariant checks and state snapshots, for the tests.

Each function takes the engine's `ArenaIndex` and expects the caller to hold the engine's lock
(`PoolEngine._debug_*` do). Nothing here runs in production: the engine's own calls pay nothing
for it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from kvpool.store.arena_index import ArenaIndex
from kvpool.store.policy import EvictionPolicy
from kvpool.store.records import ObjectView, PoolObject


class RecordedUses:
    """An eviction policy that records each object's last use as ``lru`` defines it (an insert,
    a touch, an unhold that lists it again) for `check_evictable`."""

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


def track_lru(index: ArenaIndex) -> None:
    """Record every object's last use from now on, for `check_evictable`."""
    if not isinstance(index.policy, RecordedUses):
        index.policy = RecordedUses(index.policy)  # type: ignore[assignment]
    for key in index.evictable_keys():  # their order so far is taken as given
        index.policy.used(key)  # type: ignore[attr-defined]


def check_evictable(index: ArenaIndex) -> list[str]:
    """Check that the policy lists exactly the committed objects that are neither leased with
    pinning nor pinned, that its running totals agree with it, and (under ``lru``, tracked) that
    they are least recently used first; return its keys in its order."""
    keys = index.evictable_keys()
    objects = index.objects
    unheld = {k for k, o in objects.items() if not o.pins and not o.pinning}
    assert set(keys) == unheld and len(keys) == len(unheld), (keys, unheld)
    for key, obj in objects.items():
        assert (obj.prev is None) == (key not in unheld), key
    policy = index.policy
    assert policy.count == len(keys)
    assert policy.bytes == sum(index.object_charge(objects[k]) for k in keys)
    if isinstance(policy, RecordedUses) and index.config.eviction_policy == "lru":
        last = policy.last_use
        # With tenant budgets, each tenant's order (and the shared one) is LRU on its own.
        tenant = index.tenants.tenant if index.tenants is not None else (lambda key: "")
        for group in {tenant(k) for k in keys}:
            mine = [k for k in keys if tenant(k) == group]
            order = sorted(mine, key=lambda k: last.get(k, -1))
            assert mine == order, ("not in LRU order", mine, order)
    shares = index.tenants
    if shares is not None:  # each budgeted tenant's charge: its objects and pending allocations, within budget
        used: dict[str, int] = dict.fromkeys(shares.budgets, 0)
        for obj in objects.values():
            if (tenant := shares.tenant(obj.key)) in used:
                used[tenant] += index.object_charge(obj)
        for p in index.pending.values():
            if (tenant := shares.tenant(p.key)) in used:
                used[tenant] += index.alloc.reserved_size(p.size + index.meta_charge(p.key))
        assert used == {t: shares.used[t] for t in shares.budgets}, (used, shares.used)
        assert all(used[t] <= budget for t, budget in shares.budgets.items()), (used, shares.budgets)
    for client, mine in index.pending_by_client.items():
        assert all(index.pending[h] is p and p.client_id == client for h, p in mine.items())
    assert sum(map(len, index.pending_by_client.values())) == len(index.pending)
    return keys


def snapshot(index: ArenaIndex) -> dict[str, Any]:
    """A consistent copy of the index for invariant checks."""
    return {
        "objects": {
            k: ObjectView(o.key, o.offset, o.size, o.generation, dict(o.leases), o.pins, o.on_disk,
                          o.pinning, dict(o.lease_state.lookup) if o.lease_state else {}, o.checksum)
            for k, o in index.objects.items()
        },
        "pending": {h: dataclasses.replace(p) for h, p in index.pending.items()},
        "live_ranges": sorted(
            [(o.offset, index.object_charge(o)) for o in index.objects.values()]
            + [(p.offset, index.alloc.reserved_size(p.size + index.meta_charge(p.key)))
               for p in index.pending.values()]),
        "used": index.alloc.used,
        "capacity": index.alloc.capacity,
        "lru": index.evictable_keys(),
    }
