"""A byte quota over stored objects and the order they are evicted in: the SSD tier's policy.

Kept apart from the files so that two users share one implementation: ``DiskTier`` (which
writes, reads and unlinks the files around these decisions) and ``kvpool plan`` (which replays
a trace through the same decisions without writing anything).

Policies (``POLICIES``): ``none`` refuses a write that would pass the quota; ``fifo`` evicts
the oldest-written objects; ``lru`` the least recently read (``touch`` on every read).

Invariants: ``used`` is the sum of the sizes of stored objects plus those being written
(reserved, not settled) and never exceeds ``quota_bytes`` after a successful ``reserve``;
objects being written are never evicted. Not thread-safe: callers hold their own lock.
"""

from __future__ import annotations

import collections
from typing import Literal

from kvpool.errors import ConfigError

DiskPolicy = Literal["none", "fifo", "lru"]
POLICIES: tuple[DiskPolicy, ...] = ("none", "fifo", "lru")


class QuotaIndex:
    """Stored keys with their sizes, in eviction order (first = next victim), under a byte quota."""

    def __init__(self, quota_bytes: int, policy: DiskPolicy = "none") -> None:
        if policy not in POLICIES:
            raise ConfigError(key="ssd_eviction_policy", value=policy, expected="one of none, fifo, lru")
        if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes <= 0:
            raise ConfigError(key="ssd_quota_bytes", value=quota_bytes, expected="a positive int of bytes")
        self.quota_bytes = quota_bytes
        self.policy: DiskPolicy = policy
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._inflight: dict[str, int] = {}  # key -> reserved bytes while it is being written
        self._used = 0
        self.evictions = 0

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
        return list(self._index.items())

    def clear(self) -> None:
        """Forget every stored object (not the writes in flight)."""
        for size in self._index.values():
            self._used -= size
        self._index.clear()

    def has(self, key: str) -> bool:
        """Stored or being written: a second write of it is a no-op."""
        return key in self._index or key in self._inflight

    def size_of(self, key: str) -> int | None:
        """The stored size of ``key``; None when it is not stored (or still being written)."""
        return self._index.get(key)

    def keys(self) -> list[str]:
        """Stored keys in eviction order (first = next victim)."""
        return list(self._index)

    def reserve(self, key: str, size: int) -> tuple[bool, list[str]]:
        """Reserve ``size`` bytes for writing ``key`` (not yet stored: ``has`` is false).

        Returns whether it fits, and the keys evicted to make room: they are gone from the
        index either way, so the caller deletes their data even when the reservation failed.
        """
        victims: list[str] = []
        if self._used + size > self.quota_bytes:
            if self.policy == "none":
                return False, victims
            victims = self.evict(self._used + size - self.quota_bytes)
            if self._used + size > self.quota_bytes:
                return False, victims  # only objects being written are left, and they stay
        self._inflight[key] = size
        self._used += size
        return True, victims

    def settle(self, key: str) -> None:
        """The reserved ``key`` was written: it is stored, newest in the eviction order."""
        self._index[key] = self._inflight.pop(key)

    def cancel(self, key: str) -> None:
        """The reserved ``key`` was not written: give its bytes back."""
        size = self._inflight.pop(key, None)
        if size is not None:
            self._used -= size

    def resize(self, key: str, size: int) -> None:
        """Replace the stored ``key``'s size by an equal value (a caller's marks live in the
        value's type), keeping its place in the order and ``used``."""
        if key in self._index and self._index[key] == size:
            self._index[key] = size

    def touch(self, key: str) -> None:
        """``key`` was read: under ``lru`` it becomes the last to be evicted."""
        if self.policy == "lru" and key in self._index:
            self._index.move_to_end(key)

    def load(self, key: str, size: int) -> None:
        """Add an object found already stored (a restart's scan), newest last."""
        self._index[key] = size
        self._used += size

    def discard(self, key: str) -> bool:
        """Forget a stored ``key``; whether it was stored."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        return True

    def evict(self, need: int) -> list[str]:
        """Evict from the front of the order until ``need`` bytes are freed (or nothing is left)."""
        victims: list[str] = []
        freed = 0
        index = self._index
        while freed < need and index:
            victim, size = index.popitem(last=False)
            freed += size
            self._used -= size
            victims.append(victim)
        self.evictions += len(victims)
        return victims
