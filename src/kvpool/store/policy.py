"""Eviction policies: which evictable object goes first, as small objects that the memory tier
(``PoolEngine``), the SSD tier (``QuotaIndex``, under ``DiskTier``) and ``kvpool plan`` share.

A policy orders the *caller's own* node objects: a node has ``key`` (str), ``prev``, ``next``
(links, None while the policy does not list it) and ``mark`` (an int only the policy uses)
attributes, and ``size_of(node)`` gives the bytes it is charged. Linking the caller's objects
keeps every operation O(1) (amortized for ``s3fifo``'s ``victim``) and allocation-free (but for
``s3fifo``'s ghost entries): the engine has a million objects and a dict of its own already; a
second key -> node dict would double the lookups on every read. What the caller tells a policy:

* ``insert(node)``: a new object, evictable;
* ``touch(node)``: it was used (held or not);
* ``hold(node)`` / ``unhold(node)``: it stops / starts being evictable (the engine holds an
  object while it is leased or pinned by the disk writer); both are no-ops when already so;
* ``remove(node)``: it is gone (a no-op when not listed);
* ``victim()``: take the next object to evict out of the policy and return it (None when
  nothing is evictable); the caller then deletes it.

Every policy keeps ``count``/``bytes`` equal to the number and total ``size_of`` of the nodes it
lists (the evictable ones), never lists a held or removed node, and returns from ``victim`` only
nodes it lists. ``size_of(node)`` must not change while a node is listed. Not thread-safe: the
callers hold their own locks.

The names (``POLICIES``) are the only list of them: the config schema and its errors, the
server's flags and ``kvpool plan``'s choices derive theirs from it (tests/store/test_policy.py
pins the list, so that a new name meets the docs that spell them out).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from kvpool.errors import ConfigError

Node = Any  # anything with key / prev / next / mark attributes (module docstring)


class _Sentinel:
    """Closes a ring: ``next`` is its oldest node, ``prev`` its newest."""

    __slots__ = ("prev", "next")

    def __init__(self) -> None:
        self.prev: Any = self
        self.next: Any = self


def _append(ring: _Sentinel, node: Node) -> None:
    tail = ring.prev
    node.prev, node.next = tail, ring
    tail.next = ring.prev = node


def _unlink(node: Node) -> None:
    prev, nxt = node.prev, node.next
    prev.next, nxt.prev = nxt, prev
    node.prev = node.next = None


def _walk(ring: _Sentinel) -> Iterator[Node]:
    node = ring.next
    while node is not ring:
        nxt = node.next  # read first: the caller may take ``node`` out
        yield node
        node = nxt


class EvictionPolicy:
    """What every policy offers (module docstring); subclasses set ``name`` and the methods.

    ``capacity``: the bytes of the tier (the arena, the SSD quota); the caller may change it
    (the SSD tier lowers its quota on a full disk). ``steps``: nodes ``victim`` looked at, a
    complexity probe (the engine's ``evict_steps``)."""

    name: ClassVar[str] = ""
    # False: the tier refuses a write instead of evicting for it (the SSD tier's ``none``); a
    # caller still takes ``victim``s when it must shrink (a quota lowered at restart).
    makes_room: ClassVar[bool] = True
    # Whether the memory tier offers it (``none`` and ``fifo`` are the SSD tier's only).
    memory_tier: ClassVar[bool] = False

    def __init__(self, capacity: int, size_of: Callable[[Node], int]) -> None:
        self.capacity = capacity
        self._size = size_of
        self.count = 0
        self.bytes = 0
        self.steps = 0

    def insert(self, node: Node) -> None:
        raise NotImplementedError

    def touch(self, node: Node) -> None:
        raise NotImplementedError

    def remove(self, node: Node) -> None:
        raise NotImplementedError

    def hold(self, node: Node) -> None:
        raise NotImplementedError

    def unhold(self, node: Node) -> None:
        raise NotImplementedError

    def victim(self) -> Node | None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Node]:
        """The listed nodes, next victim first (for a policy whose victims depend on more than
        order, such as ``s3fifo``, the order it would look at them in)."""
        raise NotImplementedError

    def __contains__(self, node: Node) -> bool:
        return node.prev is not None


class Lru(EvictionPolicy):
    """Least recently used first: one ring, oldest use at the head.

    Invariants: the ring holds exactly the inserted nodes that are neither held nor removed, in
    the order of their last use, where an insert, a touch and an unhold each count as a use (an
    object a reader let go of was just used: it goes to the tail). A touch of a held node moves
    nothing: the unhold that lists it again places it. ``victim`` is the ring's head, so it never
    meets a held node and costs one step per victim.
    """

    name = "lru"
    memory_tier = True

    def __init__(self, capacity: int, size_of: Callable[[Node], int]) -> None:
        super().__init__(capacity, size_of)
        self._ring = _Sentinel()

    # The links are written out in place, not through _append/_unlink: these run on every
    # commit and read of the engine, whose per-operation cost must not grow with the policy.
    def insert(self, node: Node) -> None:
        ring = self._ring
        tail = ring.prev
        node.prev, node.next = tail, ring
        tail.next = ring.prev = node
        self.count += 1
        self.bytes += self._size(node)

    def touch(self, node: Node) -> None:
        prev = node.prev
        if prev is not None:
            nxt = node.next
            prev.next, nxt.prev = nxt, prev
            ring = self._ring
            tail = ring.prev
            node.prev, node.next = tail, ring
            tail.next = ring.prev = node

    def remove(self, node: Node) -> None:
        prev = node.prev
        if prev is not None:
            nxt = node.next
            prev.next, nxt.prev = nxt, prev
            node.prev = node.next = None
            self.count -= 1
            self.bytes -= self._size(node)

    hold = remove

    def unhold(self, node: Node) -> None:
        if node.prev is None:
            self.insert(node)

    def victim(self) -> Node | None:
        node = self._ring.next
        if node is self._ring:
            return None
        self.steps += 1
        self.remove(node)
        return node

    def __iter__(self) -> Iterator[Node]:
        return _walk(self._ring)


class Fifo(Lru):
    """Oldest inserted first: an LRU whose touches move nothing (the SSD tier's ``fifo``; it
    never holds a node). An unhold still lists the node as newest."""

    name = "fifo"
    memory_tier = False

    def touch(self, node: Node) -> None:
        pass


class NoEviction(Fifo):
    """The SSD tier's ``none``: a full tier refuses writes (``makes_room`` is False). Victims,
    taken only when the tier must shrink below what it holds, go oldest first."""

    name = "none"
    makes_room = False


_FREQ = 3  # the mark's low bits: uses since the node entered its queue, capped at 3
_MAIN = 4  # the mark's bit for "in the main queue" (else the small one)


class S3Fifo(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new objects (``small_share`` of the
    capacity, by bytes), a main FIFO with reinsertion, and a ghost FIFO of keys evicted from the
    small queue. Most objects of a scan are used once; they pass through the small queue and out
    without pushing anything from the main queue, where objects used twice live.

    Invariants: each listed node is in exactly one queue (the ``_MAIN`` bit of its ``mark``);
    ``_small_bytes`` is the total size of the small queue; a node's frequency (the mark's low
    bits) counts its touches since it entered its queue, capped at 3. ``victim`` takes:

    * from the small queue when it holds at least ``small_share`` of the capacity (or the main
      queue is empty): its first node not touched since insert; the touched ones before it move
      to the main queue's tail (frequency reset: each must be used again to survive a lap of
      main). An evicted small-queue key is remembered in the ghost;
    * else (or when every small-queue node moved) from the main queue: its first node whose
      frequency is 0; those before it go to the tail with their frequency lowered by one.

    So it ends after at most one move per small-queue node plus three laps of main: amortized
    O(1). An inserted key found in the ghost (evicted from the small queue not long ago, asked
    for again) goes straight to the main queue. The ghost holds at most the main queue's share
    of the capacity in bytes of the keys' objects, oldest dropped first.

    Holding: a held node leaves its queue, keeping its mark; an unhold puts it back at the tail
    of the queue it left (as ``lru`` lists an unheld object as just used).
    """

    name = "s3fifo"
    memory_tier = True
    small_share = 0.1

    def __init__(self, capacity: int, size_of: Callable[[Node], int]) -> None:
        super().__init__(capacity, size_of)
        self._small = _Sentinel()
        self._main = _Sentinel()
        self._small_bytes = 0
        self._ghost: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._ghost_bytes = 0

    def _list(self, node: Node, size: int) -> None:
        if node.mark & _MAIN:
            _append(self._main, node)
        else:
            _append(self._small, node)
            self._small_bytes += size
        self.count += 1
        self.bytes += size

    def insert(self, node: Node) -> None:
        size = self._size(node)
        seen = self._ghost.pop(node.key, None)
        if seen is not None:
            self._ghost_bytes -= seen
        node.mark = 0 if seen is None else _MAIN
        self._list(node, size)

    def touch(self, node: Node) -> None:
        if node.mark & _FREQ != _FREQ:
            node.mark += 1

    def remove(self, node: Node) -> None:
        if node.prev is not None:
            _unlink(node)
            size = self._size(node)
            if not node.mark & _MAIN:
                self._small_bytes -= size
            self.count -= 1
            self.bytes -= size

    hold = remove

    def unhold(self, node: Node) -> None:
        if node.prev is None:
            self._list(node, self._size(node))

    def victim(self) -> Node | None:
        small, main = self._small, self._main
        if small.next is not small and (self._small_bytes >= self.small_share * self.capacity or main.next is main):
            # Once the small queue is chosen it gives the victim, as the paper's evictS does:
            # the nodes it moves to main meanwhile are not candidates this time.
            while small.next is not small:
                node = small.next
                self.steps += 1
                size = self._size(node)
                _unlink(node)
                self._small_bytes -= size
                if node.mark & _FREQ:
                    node.mark = _MAIN
                    _append(main, node)
                    continue
                self.count -= 1
                self.bytes -= size
                self._remember(node.key, size)
                return node
        while main.next is not main:
            node = main.next
            self.steps += 1
            _unlink(node)
            if node.mark & _FREQ:
                node.mark -= 1
                _append(main, node)
                continue
            self.count -= 1
            self.bytes -= self._size(node)
            return node
        return None

    def _remember(self, key: str, size: int) -> None:
        ghost = self._ghost
        ghost[key] = size
        self._ghost_bytes += size
        limit = (1 - self.small_share) * self.capacity
        while self._ghost_bytes > limit and ghost:
            self._ghost_bytes -= ghost.popitem(last=False)[1]

    def in_main(self, node: Node) -> bool:
        """Whether ``node`` is (or, held, was last) in the main queue."""
        return bool(node.mark & _MAIN)

    def ghost(self) -> dict[str, int]:
        """The ghost's keys with their sizes, oldest first (a copy)."""
        return dict(self._ghost)

    def __iter__(self) -> Iterator[Node]:
        yield from _walk(self._small)
        yield from _walk(self._main)


POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (Lru, S3Fifo, Fifo, NoEviction)}
MEMORY_POLICIES: tuple[str, ...] = tuple(name for name, cls in POLICIES.items() if cls.memory_tier)
DISK_POLICIES: tuple[str, ...] = tuple(sorted(POLICIES))
# The names as types, for the config schema and signatures (built from the tuples above, so a
# policy added to POLICIES is accepted everywhere at once).
MemoryPolicy = Literal[MEMORY_POLICIES]  # type: ignore[valid-type]
DiskPolicy = Literal[DISK_POLICIES]  # type: ignore[valid-type]


def make_policy(name: str, capacity: int, size_of: Callable[[Node], int], *, key: str = "eviction_policy",
                names: tuple[str, ...] = MEMORY_POLICIES) -> EvictionPolicy:
    """The policy called ``name`` (one of ``names``); ConfigError naming ``key`` otherwise."""
    if name not in names:
        raise ConfigError(key=key, value=name, expected=f"one of {', '.join(sorted(names))}")
    return POLICIES[name](capacity, size_of)
