"""Per-tenant byte budgets in the memory tier: whose blocks eviction takes.

A tenant is the `cache_salt` of its requests, named in its keys by a tag (`kvpool.keys.tenant_tag`,
`owner_of`). A tenant given a budget has its own eviction order; everybody else (requests
without a salt, tenants without a budget) shares one. `TenantShares` is one eviction policy over
those orders, so the memory tier uses it as it uses any policy:

* a budgeted tenant's allocation that would take it past its budget evicts that tenant's own
  objects first (`victim_of`), and is refused if they cannot make room: one tenant's burst never
  takes another's blocks;
* when the pool itself is full, ``victim`` takes the shared order's objects first, then those of
  the budgeted tenant using the largest share of its budget: a tenant within its budget loses
  blocks only once nothing unbudgeted is left to evict.

Invariants (tests/store/test_tenants.py): ``count``/``bytes`` are the sums of the sub-policies'
(each lists exactly the evictable objects of its tenants); ``used[t]`` is the charge of tenant
``t``'s committed objects and pending allocations, whatever their state, and never exceeds its
budget through an allocation (`ArenaIndex.allocate` checks it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping

from kvpool.keys import owner_of
from kvpool.store.policy import EvictionPolicy, Node, make_policy

SHARED = ""  # the sub-policy of every object whose tenant has no budget


class TenantShares(EvictionPolicy):
    """One ``name`` policy per budgeted tenant (``budgets``: tag -> bytes) and one shared
    (module docstring). ``used`` is kept by the memory tier (`note`)."""

    def __init__(self, name: str, capacity: int, size_of: Callable[[Node], int], budgets: Mapping[str, int]) -> None:
        self.capacity = capacity
        self.steps = 0
        self.budgets = dict(budgets)
        self._subs = {tenant: make_policy(name, budget, size_of) for tenant, budget in self.budgets.items()}
        self._shared = make_policy(name, capacity, size_of)
        self.used: collections.Counter[str] = collections.Counter()

    # ---- accounting -------------------------------------------------------------------------

    def tenant(self, key: str) -> str:
        """The budgeted tenant ``key`` counts against; SHARED for any other."""
        tenant = owner_of(key)[1]
        return tenant if tenant in self.budgets else SHARED

    def note(self, key: str, charge: int) -> None:
        """A charge of ``key``'s tenant (an allocation, +) or its end (a drop or reclaim, -)."""
        tenant = self.tenant(key)
        if tenant != SHARED:
            self.used[tenant] += charge

    def over_budget(self, key: str, charge: int) -> int:
        """Bytes ``key``'s tenant would be past its budget with ``charge`` more (0: within it)."""
        tenant = self.tenant(key)
        if tenant == SHARED:
            return 0
        return max(0, self.used[tenant] + charge - self.budgets[tenant])

    def victim_of(self, key: str) -> Node | None:
        """The next evictable object of ``key``'s (budgeted) tenant, taken out of its order."""
        tenant = self.tenant(key)
        if tenant == SHARED:
            return None
        node = self._subs[tenant].victim()
        self.steps += node is not None
        return node

    # ---- the policy -------------------------------------------------------------------------

    @property
    def count(self) -> int:  # type: ignore[override]
        return self._shared.count + sum(p.count for p in self._subs.values())

    @property
    def bytes(self) -> int:  # type: ignore[override]
        return self._shared.bytes + sum(p.bytes for p in self._subs.values())

    def _sub(self, node: Node) -> EvictionPolicy:
        tenant = owner_of(node.key)[1]
        return self._subs.get(tenant, self._shared) if tenant else self._shared

    def insert(self, node: Node) -> None:
        self._sub(node).insert(node)

    def touch(self, node: Node) -> None:
        self._sub(node).touch(node)

    def remove(self, node: Node) -> None:
        self._sub(node).remove(node)

    def hold(self, node: Node) -> None:
        self._sub(node).hold(node)

    def unhold(self, node: Node) -> None:
        self._sub(node).unhold(node)

    def victim(self) -> Node | None:
        fullest = sorted(self._subs, key=lambda t: self.used[t] / max(1, self.budgets[t]), reverse=True)
        for policy in (self._shared, *(self._subs[t] for t in fullest)):
            node = policy.victim()
            if node is not None:
                self.steps += 1
                return node
        return None

    def __iter__(self) -> Iterator[Node]:
        yield from self._shared
        for policy in self._subs.values():
            yield from policy
