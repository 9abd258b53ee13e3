"""A byte quota over stored objects and the order they are evicted in: the SSD tier's policy.

Kept apart from the files so that two users share one implementation: ``DiskTier`` (which
writes, reads and unlinks the files around these decisions) and ``kvpool plan`` (which replays
a trace through the same decisions without writing anything).

Policies (``store.policy.DISK_POLICIES``): ``none`` refuses a write that would pass the quota;
``fifo`` evicts the oldest-written objects; ``lru`` the least recently read (``touch`` on every
read); ``s3fifo`` keeps objects read again apart from those written once (``store/policy.py``).

Invariants: ``used`` is the sum of the sizes of stored objects plus those being written
(reserved, not settled) and never exceeds ``quota_bytes`` after a successful ``reserve``;
objects being written are never evicted (the policy lists only stored ones). Not thread-safe:
callers hold their own lock.
"""

from __future__ import annotations

from kvpool.errors import ConfigError
from kvpool.store.policy import DISK_POLICIES, DiskPolicy, EvictionPolicy, make_policy

POLICIES = DISK_POLICIES


class _Entry:
    """A stored object as the policy lists it; ``size`` is the caller's value, kept as given
    (``DiskTier`` marks sizes found at start-up by their type)."""

    __slots__ = ("key", "size", "prev", "next", "mark")

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self.prev: _Entry | None = None
        self.next: _Entry | None = None
        self.mark = 0


def _entry_size(entry: _Entry) -> int:
    return entry.size


class QuotaIndex:
    """Stored keys with their sizes, in eviction order (first = next victim), under a byte quota."""

    def __init__(self, quota_bytes: int, policy: DiskPolicy = "none") -> None:
        if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes <= 0:
            raise ConfigError(key="ssd_quota_bytes", value=quota_bytes, expected="a positive int of bytes")
        self.policy: DiskPolicy = policy
        self._order: EvictionPolicy = make_policy(policy, quota_bytes, _entry_size, key="ssd_eviction_policy",
                                                  names=DISK_POLICIES)
        self._index: dict[str, _Entry] = {}
        self._inflight: dict[str, int] = {}  # key -> reserved bytes while it is being written
        self._used = 0
        self.evictions = 0

    @property
    def quota_bytes(self) -> int:
        return self._order.capacity

    @quota_bytes.setter
    def quota_bytes(self, value: int) -> None:
        self._order.capacity = value  # s3fifo's queue shares follow a lowered (or regrown) quota

    def __contains__(self, key: str) -> bool:
        """Stored (settled); an object still being written is not readable yet."""
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used(self) -> int:
        return self._used

    @property
    def writing(self) -> int:
        """Objects reserved and not yet settled or cancelled."""
        return len(self._inflight)

    def items(self) -> list[tuple[str, int]]:
        """(key, size) of the stored objects in eviction order (first = next victim)."""
        return [(e.key, e.size) for e in self._order]

    def clear(self) -> None:
        """Forget every stored object (not the writes in flight)."""
        for entry in self._index.values():
            self._order.remove(entry)
            self._used -= entry.size
        self._index.clear()

    def has(self, key: str) -> bool:
        """Stored or being written: a second write of it is a no-op."""
        return key in self._index or key in self._inflight

    def size_of(self, key: str) -> int | None:
        """The stored size of ``key``; None when it is not stored (or still being written)."""
        entry = self._index.get(key)
        return None if entry is None else entry.size

    def keys(self) -> list[str]:
        """Stored keys in eviction order (first = next victim)."""
        return [e.key for e in self._order]

    def reserve(self, key: str, size: int) -> tuple[bool, list[str]]:
        """Reserve ``size`` bytes for writing ``key`` (not yet stored: ``has`` is false).

        Returns whether it fits, and the keys evicted to make room: they are gone from the
        index either way, so the caller deletes their data even when the reservation failed.
        """
        victims: list[str] = []
        if self._used + size > self.quota_bytes:
            if not self._order.makes_room:
                return False, victims
            victims = self.evict(self._used + size - self.quota_bytes)
            if self._used + size > self.quota_bytes:
                return False, victims  # only objects being written are left, and they stay
        self._inflight[key] = size
        self._used += size
        return True, victims

    def settle(self, key: str) -> None:
        """The reserved ``key`` was written: it is stored, the policy's newest."""
        self._add(key, self._inflight.pop(key))

    def cancel(self, key: str) -> None:
        """The reserved ``key`` was not written: give its bytes back."""
        size = self._inflight.pop(key, None)
        if size is not None:
            self._used -= size

    def resize(self, key: str, size: int) -> None:
        """Replace the stored ``key``'s size by an equal value (a caller's marks live in the
        value's type), keeping its place in the order and ``used``."""
        entry = self._index.get(key)
        if entry is not None and entry.size == size:
            entry.size = size

    def touch(self, key: str) -> None:
        """``key`` was read: the policy's use (``lru``: the last to be evicted; ``fifo``,
        ``none``: nothing)."""
        entry = self._index.get(key)
        if entry is not None:
            self._order.touch(entry)

    def load(self, key: str, size: int) -> None:
        """Add an object found already stored (a restart's scan), newest last."""
        self._add(key, size)
        self._used += size

    def _add(self, key: str, size: int) -> None:
        entry = self._index[key] = _Entry(key, size)
        self._order.insert(entry)

    def discard(self, key: str) -> bool:
        """Forget a stored ``key``; whether it was stored."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._order.remove(entry)
        self._used -= entry.size
        return True

    def evict(self, need: int) -> list[str]:
        """Evict the policy's victims until ``need`` bytes are freed (or nothing is left)."""
        victims: list[str] = []
        freed = 0
        while freed < need:
            entry = self._order.victim()
            if entry is None:
                break
            del self._index[entry.key]
            freed += entry.size
            self._used -= entry.size
            victims.append(entry.key)
        self.evictions += len(victims)
        return victims
