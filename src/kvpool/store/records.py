"""What the pool engine keeps per object, lease and allocation, and what it hands out.

Plain records, no behaviour beyond packing: the engine (`store/engine.py` and the modules it
delegates to) owns every rule about when they change. They are small on purpose: at millions
of objects the metadata, not the values, runs out first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from kvpool.errors import ErrorCode, StoreError


class Presence(enum.IntEnum):
    """What a leasing lookup found of one key (`PoolEngine.presence`, `Backend.batch_presence`)."""

    ABSENT = 0
    # Stored (and leased, where the store leases): a read may still fail (the store goes away,
    # a lease runs out, a check fails), so a load from it must be able to report a failure.
    STORED = 1
    # In this process's memory under a lookup lease that keeps it from eviction for a whole TTL
    # from now: a read made before then copies memory this process owns and cannot fail.
    PINNED = 2


@dataclass(frozen=True)
class Allocation:
    """A reserved, not yet visible range: write ``size`` bytes at ``offset`` then ``commit(handle)``."""

    handle: int
    key: str
    offset: int
    size: int


@dataclass(frozen=True)
class Lease:
    """A read lease on ``key``: its bytes at ``arena[offset:offset+size]`` stay put until ``expires_at``.

    When an object was found only on disk and could not be promoted into memory
    (no room even after eviction, or a put of the same key is pending), the
    engine returns the bytes themselves in ``data`` with ``offset == -1`` and
    ``generation == 0``: the reader still gets its hit, and nothing in the arena
    had to be disturbed for it. Such a lease refers to no arena object, so no
    eviction, removal or later commit of the key can invalidate it before
    ``expires_at``.
    """

    key: str
    offset: int
    size: int
    generation: int
    expires_at: float
    lease_id: int = 0
    data: bytes | None = None
    # The value's checksum (`buffers.checksum`) as its writer committed it, or as the engine
    # computed it when it copied the bytes in itself; None if the writer sent none.
    checksum: int | None = None


class LookupLease(NamedTuple):
    """A hit's lookup lease as `lookup_leases` hands it out: what a reader copies under, then
    has checked by id (`check_lookup_leases`). A tuple: lookups are many and must stay cheap."""

    lease_id: int
    offset: int
    size: int
    checksum: int | None


@dataclass(frozen=True)
class ReapReport:
    """What one ``reap`` call dropped."""

    clients: int
    leases: int
    allocations: int


class LeaseTable:
    """An object's lease tables, made on its first lease (most objects are never leased, and
    two empty dicts per object would cost more than the rest of its metadata)."""

    __slots__ = ("table", "lookup", "pinning")

    def __init__(self) -> None:
        # lease id -> (client id, expires_at); lookup leases have ids too (`lookup_leases`
        # hands them out).
        self.table: dict[int, tuple[str, float]] = {}
        # client id -> its lookup lease id in ``table``. A repeated lookup extends that lease
        # instead of adding one: a hot prefix looked up many times per TTL would otherwise pile
        # up thousands of never-released leases per object, each scanned by later lookups.
        self.lookup: dict[str, int] = {}
        self.pinning = 0  # leases in ``table`` that keep it from eviction (the rest only verify)


NO_LEASES: dict[int, tuple[str, float]] = {}  # read-only stand-in for an object never leased


_U64 = (1 << 64) - 1
_U48 = (1 << 48) - 1
_SIZE_AT, _SUM_AT, _HAS_SUM_AT, _GEN_AT = 48, 96, 160, 161


class PoolObject:
    """A committed object. ``__slots__``, a lazily made lease table and packed fields keep it
    near 150 bytes with its index entry: at millions of objects the metadata, not the values,
    runs out first.

    ``prev``/``next``/``mark`` are the eviction policy's (``store/policy.py``): they list it
    among the evictable objects (committed, neither leased with pinning nor pinned by the disk
    writer); the links are None while it is held. ``_packed`` holds offset and size (48 bits
    each), the optional 64-bit checksum and the generation in one int (one int object instead
    of four); ``_flags`` the disk writer's pins and ``on_disk``."""

    __slots__ = ("key", "_packed", "lease_state", "_flags", "prev", "next", "mark")

    def __init__(self, key: str, offset: int, size: int, generation: int) -> None:
        if not (0 <= offset <= _U48 and 0 <= size <= _U48):
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"key={key!r}: offset {offset} / size {size} past 2**48 bytes; use a smaller pool")
        self.key = key
        self._packed = (generation << _GEN_AT) | (size << _SIZE_AT) | offset
        self.lease_state: LeaseTable | None = None
        self._flags = 0
        self.prev: PoolObject | None = None
        self.next: PoolObject | None = None
        self.mark = 0

    @property
    def offset(self) -> int:
        return self._packed & _U48

    @property
    def size(self) -> int:
        return (self._packed >> _SIZE_AT) & _U48

    @property
    def generation(self) -> int:
        return self._packed >> _GEN_AT

    @property
    def checksum(self) -> int | None:
        """The writer's checksum; kept in the server's memory, out of every client's reach."""
        packed = self._packed
        return (packed >> _SUM_AT) & _U64 if (packed >> _HAS_SUM_AT) & 1 else None

    @checksum.setter
    def checksum(self, value: int | None) -> None:
        packed = self._packed & ~(((1 << 65) - 1) << _SUM_AT)
        self._packed = packed if value is None else packed | (((value & _U64) | (1 << 64)) << _SUM_AT)

    @property
    def pins(self) -> int:
        """The disk writer's internal leases; they never expire."""
        return self._flags >> 1

    @pins.setter
    def pins(self, value: int) -> None:
        self._flags = (value << 1) | (self._flags & 1)

    @property
    def on_disk(self) -> bool:
        return bool(self._flags & 1)

    @on_disk.setter
    def on_disk(self, value: bool) -> None:
        self._flags = (self._flags & ~1) | int(value)

    @property
    def leases(self) -> dict[int, tuple[str, float]]:
        state = self.lease_state
        return state.table if state is not None else NO_LEASES

    @property
    def pinning(self) -> int:
        state = self.lease_state
        return state.pinning if state is not None else 0


@dataclass(frozen=True)
class ObjectView:
    """A copy of one object's metadata (``_debug_snapshot``, for tests)."""

    key: str
    offset: int
    size: int
    generation: int
    leases: dict[int, tuple[str, float]]
    pins: int
    on_disk: bool
    pinning: int
    lookup_leases: dict[str, int]
    checksum: int | None


class Spilled(NamedTuple):
    """An evicted object's bytes on their way to the disk tier, with the checksum its writer
    gave (None: none). The copy is made under the engine lock, before the range is reused; the
    hash is checked outside it (``_spilled_intact``), before the bytes are written or read."""

    data: bytes
    checksum: int | None


@dataclass(slots=True)
class PendingPut:
    handle: int
    key: str
    offset: int
    size: int
    client_id: str
    created_at: float
    generation: int
    charge: int = 0  # bytes counted against its owner's share (0 for internal promotions)
    owner: str = ""
    # The engine's own copy of a disk-tier object into the arena, running unlocked in this
    # process: no abort or timeout may free its range while that copy is still writing it.
    promotion: bool = False
    # A promotion that a client's put of the same key overtook: the put's copy is the one to
    # publish (the disk's may yet read as corrupt), so this range is given back, not committed.
    superseded: bool = False
    # The promotion this client put overtook (``superseded``): if the put is given up, that
    # promotion publishes its copy after all.
    overtook: int = -1


@dataclass(slots=True)
class Hold:
    """One owner's leases on one object: counted once against its share however many there are."""

    count: int
    charge: int
    since: float  # when this continuous hold began (for client_max_hold_s)
    cooldown_until: float = 0.0  # after hitting the hold limit: no new lease before this


@dataclass(slots=True)
class Owner:
    """What one owner (client process) holds, for the fair-sharing quotas."""

    charge: int = 0  # bytes: leased objects (once each) + uncommitted allocations
    holds: int = 0  # leases + uncommitted allocations
