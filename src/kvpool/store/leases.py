"""Every lease the pool engine granted, and what each owner holds under the fair-share quotas.

A lease keeps an object's bytes put while a reader copies them; a pinning lease also keeps the
object from eviction. `LeaseBook` files each lease three ways (by id, by expiry, by client) so
that granting, releasing, expiring and dropping a client's leases cost O(log n) per lease,
whatever other clients hold; and, with quotas on (`kvpool server`), it charges each owner (a
client process, see `bind`) for the objects its leases pin and the allocations it has not
committed yet.

Invariants (`check` recomputes them from the objects' own tables; the engine's property tests
call it after random operation sequences):

* every lease in an object's table is in the index, under that object and client, and in the
  client's set; an object's ``pinning`` count is the number of its pinning leases;
* an owner's charge is the sum of its holds' charges (each object once, however many of its
  leases pin it) plus its uncommitted allocations' charges, and its count the number of its
  leases plus allocations; an owner with neither is forgotten;
* past its share, or past ``client_max_hold_s`` of continuous pinning on one object, an owner's
  new leases are still granted and verified but do not pin (a lookup lease that could not pin
  is refused: it would protect nothing).

Not thread-safe on its own: every call is made under the engine's lock, as every call into
`store/arena_index.py` is.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable

from kvpool.errors import ErrorCode
from kvpool.store.engine_config import EngineConfig
from kvpool.store.records import Hold, Lease, LeaseTable, Owner, PendingPut, PoolObject

logger = logging.getLogger(__name__)


class LeaseBook:
    """The engine's leases and owners' holdings (see the module docstring for invariants).

    ``charge(obj)`` is what pinning ``obj`` costs its owner (its reserved bytes); ``on_pinning``
    is called when an object's pinning count went to or from zero (the engine lists it among
    or takes it out of the evictable objects); ``stats`` is the engine's counter table, where
    quota refusals, unpinned leases and hold-limit hits are counted."""

    def __init__(self, config: EngineConfig, capacity: int, charge: Callable[[PoolObject], int],
                 on_pinning: Callable[[PoolObject], None], stats: dict[str, int]) -> None:
        self._config = config
        self.ttl_s = config.default_kv_lease_ttl_ms / 1000.0
        self._charge = charge
        self._on_pinning = on_pinning
        self._stats = stats
        self._ids = itertools.count(1)
        # lease id -> (object, client id, owner, whether it pins the object): O(1) release and
        # per-client drops, whatever else the object is leased by.
        self.index: dict[int, tuple[PoolObject, str, str, bool]] = {}
        # (expires_at, lease id); entries of released or extended leases are skipped lazily.
        self._expiry: list[tuple[float, int]] = []
        self._by_client: dict[str, set[int]] = {}
        self._owner_of: dict[str, str] = {}
        self.owners: dict[str, Owner] = {}
        self._holds: dict[tuple[str, str], Hold] = {}  # (owner, key) -> hold
        self._cooling: set[tuple[str, str]] = set()  # holds with count 0 kept for their cooldown
        self._warned_hold: set[str] = set()
        self._share_bytes = int(config.client_pool_share * capacity)
        self._quotas_on = (config.client_pool_share < 1 or config.client_max_leases > 0
                           or config.client_max_hold_s > 0)
        self.ops = 0  # lease-structure steps (adds, heap pops, drops), a complexity probe

    # ---- owners --------------------------------------------------------------------------------

    def owner(self, client_id: str) -> str:
        """Whom a client's holdings count against; "" (no accounting) when quotas are off or for
        the engine's own internal calls."""
        if not self._quotas_on:
            return ""
        return self._owner_of.get(client_id, client_id)

    def bind(self, client_id: str, owner: str) -> None:
        self._owner_of[client_id] = owner

    def unbind(self, client_id: str) -> None:
        self._owner_of.pop(client_id, None)

    def holding(self, owner: str) -> tuple[int, int]:
        """(bytes, count) that ``owner`` holds in leased objects and uncommitted allocations."""
        usage = self.owners.get(owner)
        return (usage.charge, usage.holds) if usage else (0, 0)

    def may_allocate(self, owner: str, charge: int) -> bool:
        """Whether ``owner`` may make one more uncommitted allocation of ``charge`` bytes (within
        its share and lease count); a refusal is counted."""
        usage = self.owners.get(owner)
        cfg = self._config
        if (usage is not None and cfg.client_max_leases and usage.holds >= cfg.client_max_leases) or \
                (usage.charge if usage else 0) + charge > self._share_bytes:
            self._stats["quota_refusals"] += 1
            return False
        return True

    def charge_allocation(self, owner: str, charge: int) -> None:
        """An allocation `may_allocate` let through was made: charge it to ``owner``."""
        usage = self.owners.setdefault(owner, Owner())
        usage.charge += charge
        usage.holds += 1

    def uncharge_allocation(self, owner: str, charge: int) -> None:
        """An allocation charged by `charge_allocation` was committed, aborted or reclaimed."""
        usage = self.owners[owner]
        usage.charge -= charge
        usage.holds -= 1
        self._forget_if_idle(owner, usage)

    def _forget_if_idle(self, owner: str, usage: Owner) -> None:
        if not usage.holds and not usage.charge:
            del self.owners[owner]
            self._warned_hold.discard(owner)

    # ---- leases --------------------------------------------------------------------------------

    def add(self, obj: PoolObject, client_id: str, now: float, lookup: bool = False,
            ttl_s: float | None = None, accounted: bool = True) -> tuple[int, float] | ErrorCode:
        """A new lease: (lease id, expires_at); NO_AVAILABLE_HANDLE when the owner holds
        client_max_leases already. A lookup lease that could not pin would protect nothing, so
        it is not made (also NO_AVAILABLE_HANDLE). ``ttl_s`` replaces the lease TTL, and an
        unaccounted lease counts against no owner's quota (the operator's pins,
        `store/controls.py`, which keep their own bound)."""
        owner = self.owner(client_id) if accounted else ""
        pins = True
        if owner:
            usage = self.owners.get(owner)
            if self._config.client_max_leases and usage is not None and usage.holds >= self._config.client_max_leases:
                self._stats["quota_refusals"] += 1
                return ErrorCode.NO_AVAILABLE_HANDLE
            pins = self._may_pin(owner, obj, now)
            if not pins:
                self._stats["unpinned_leases"] += 1
                if lookup:
                    return ErrorCode.NO_AVAILABLE_HANDLE
        lease_id = next(self._ids)
        expires_at = now + (self.ttl_s if ttl_s is None else ttl_s)
        state = obj.lease_state
        if state is None:
            state = obj.lease_state = LeaseTable()
        state.table[lease_id] = (client_id, expires_at)
        if pins:
            state.pinning += 1
            if state.pinning == 1:
                self._on_pinning(obj)
        self.index[lease_id] = (obj, client_id, owner, pins)
        self._by_client.setdefault(client_id, set()).add(lease_id)
        heapq.heappush(self._expiry, (expires_at, lease_id))
        self.ops += 1
        if owner:
            usage = self.owners.setdefault(owner, Owner())
            usage.holds += 1
            if pins:
                hold = self._holds.get((owner, obj.key))
                if hold is None:
                    hold = self._holds[(owner, obj.key)] = Hold(0, 0, now)
                if hold.count == 0:  # a new continuous hold: charge the object once
                    self._cooling.discard((owner, obj.key))
                    hold.charge = self._charge(obj)
                    hold.since = now
                    hold.cooldown_until = 0.0
                    usage.charge += hold.charge
                hold.count += 1
        return lease_id, expires_at

    def lookup_lease(self, obj: PoolObject, client_id: str, now: float) -> tuple[int, float] | None:
        """The client's lookup lease on ``obj``, extended or made: (lease id, expires_at), or
        None when the quotas refused it (a lookup lease that cannot pin protects nothing)."""
        state = obj.lease_state
        lease_id = state.lookup.get(client_id) if state is not None else None
        if state is not None and lease_id is not None and lease_id in state.table:
            # Moving the expiry later is safe for a lease already handed out: a reader's copy is
            # checked against the table's expiry (`check_lookup_leases`), which only grew. The
            # heap entry is re-filed when it comes up.
            owner = self.owner(client_id)
            if not owner or self._may_pin(owner, obj, now):
                state.table[lease_id] = (client_id, now + self.ttl_s)
            return lease_id, state.table[lease_id][1]
        added = self.add(obj, client_id, now, lookup=True)
        if isinstance(added, ErrorCode):
            return None
        assert obj.lease_state is not None
        obj.lease_state.lookup[client_id] = added[0]
        return added

    def release(self, lease: Lease) -> None:
        """End ``lease`` if it is still on the object it was granted on."""
        if not lease.lease_id:
            return
        entry = self.index.get(lease.lease_id)
        if entry is not None and entry[0].generation == lease.generation:
            self.drop(lease.lease_id)

    def prune(self, now: float) -> int:
        """Drop leases that expired before ``now``; O(log n) per expired lease. Returns how many."""
        heap = self._expiry
        dropped = 0
        while heap and heap[0][0] < now:
            _, lease_id = heapq.heappop(heap)
            self.ops += 1
            entry = self.index.get(lease_id)
            if entry is None:
                continue  # released, or dropped with its client or object
            expires_at = entry[0].leases[lease_id][1]
            if expires_at >= now:  # an extended lookup lease: one entry per lease, re-filed
                heapq.heappush(heap, (expires_at, lease_id))
                continue
            self.drop(lease_id)
            dropped += 1
        if len(heap) > 2 * len(self.index) + 1024:
            # Released leases leave their entries behind; rebuild so the heap stays O(live leases).
            self._expiry = [(e[0].leases[lid][1], lid) for lid, e in self.index.items()]
            heapq.heapify(self._expiry)
            self.ops += len(self._expiry)
        if self._cooling:
            for hold_key in [h for h in self._cooling if self._holds[h].cooldown_until < now]:
                self._cooling.discard(hold_key)
                del self._holds[hold_key]
        return dropped

    def drop(self, lease_id: int) -> None:
        """End a lease, whoever holds it (expired, released, its client or object gone)."""
        entry = self.index.pop(lease_id, None)
        if entry is None:
            return
        obj, client_id, owner, pins = entry
        self.ops += 1
        state = obj.lease_state
        assert state is not None
        del state.table[lease_id]
        if state.lookup.get(client_id) == lease_id:
            del state.lookup[client_id]
        if not state.table:
            obj.lease_state = None
        if pins:
            state.pinning -= 1
            if not state.pinning:
                self._on_pinning(obj)
        ids = self._by_client.get(client_id)
        if ids is not None:
            ids.discard(lease_id)
            if not ids:
                del self._by_client[client_id]
        if not owner:
            return
        usage = self.owners[owner]
        usage.holds -= 1
        if pins:
            hold = self._holds[(owner, obj.key)]
            hold.count -= 1
            if hold.count == 0:
                usage.charge -= hold.charge
                if hold.cooldown_until:
                    self._cooling.add((owner, obj.key))
                else:
                    del self._holds[(owner, obj.key)]
        self._forget_if_idle(owner, usage)

    def drop_object(self, obj: PoolObject) -> None:
        """End every lease on ``obj`` (it is being removed)."""
        for lease_id in list(obj.leases):
            self.drop(lease_id)

    def drop_client(self, client_id: str) -> int:
        """End every lease of ``client_id``; how many there were."""
        ids = self._by_client.get(client_id)
        if not ids:
            return 0
        mine = list(ids)
        for lease_id in mine:
            self.drop(lease_id)
        return len(mine)

    def _may_pin(self, owner: str, obj: PoolObject, now: float) -> bool:
        """Whether one more lease of ``owner`` on ``obj`` may pin it: within its pool share, and
        not past client_max_hold_s of continuous pinning (nor in the cooldown after that)."""
        hold = self._holds.get((owner, obj.key))
        if hold is not None and hold.cooldown_until >= now:
            return False
        cfg = self._config
        if hold is not None and hold.count:
            if cfg.client_max_hold_s and now - hold.since >= cfg.client_max_hold_s:
                # Its pins lapse within one TTL (no renewal); after that the object stays
                # unpinned by this owner for another TTL, so eviction can reach it.
                hold.cooldown_until = now + 2 * self.ttl_s
                self._stats["hold_limit_hits"] += 1
                if owner not in self._warned_hold:  # once per owner: an attacker may hold many keys
                    self._warned_hold.add(owner)
                    logger.warning("client %r pinned key=%r for %.1fs (client_max_hold_s=%s); its leases on it "
                                   "(and any other past the limit) stop pinning for %.1fs", owner, obj.key,
                                   now - hold.since, cfg.client_max_hold_s, 2 * self.ttl_s)
                return False
            return True  # the object is charged once, however many leases pin it
        usage = self.owners.get(owner)
        return (usage.charge if usage else 0) + self._charge(obj) <= self._share_bytes

    # ---- tests -----------------------------------------------------------------------------------

    def holds(self) -> Iterable[Hold]:
        """Every owner's hold on an object (tests check their ages against the hold limit)."""
        return self._holds.values()

    def check(self, objects: dict[str, PoolObject], pending: Iterable[PendingPut]) -> dict[str, tuple[int, int]]:
        """Per owner (charge, holds) recomputed from the objects' lease tables and the
        uncommitted allocations, after checking that every index agrees with those tables."""
        owners: dict[str, list[int]] = {}
        seen_holds: dict[tuple[str, str], int] = {}
        for key, obj in objects.items():
            pinning = 0
            for lease_id, (client, _) in obj.leases.items():
                o, c, owner, pins = self.index[lease_id]
                assert o is obj and c == client and lease_id in self._by_client[c]
                pinning += pins
                if owner:
                    owners.setdefault(owner, [0, 0])[1] += 1
                    if pins:
                        seen_holds[(owner, key)] = seen_holds.get((owner, key), 0) + 1
            assert pinning == obj.pinning, (key, pinning, obj.pinning)
        assert sum(len(o.leases) for o in objects.values()) == len(self.index)
        for (owner, key), count in seen_holds.items():
            hold = self._holds[(owner, key)]
            assert hold.count == count
            owners[owner][0] += hold.charge
        for (owner, key), hold in self._holds.items():
            assert hold.count == seen_holds.get((owner, key), 0)
            assert hold.count or (owner, key) in self._cooling
        for p in pending:
            if p.owner:
                usage = owners.setdefault(p.owner, [0, 0])
                usage[0] += p.charge
                usage[1] += 1
        mine = {o: (u.charge, u.holds) for o, u in self.owners.items()}
        assert mine == {o: (c, h) for o, (c, h) in owners.items()}, (mine, owners)
        return mine
