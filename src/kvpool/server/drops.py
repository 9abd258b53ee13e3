"""The keys that left the host pool, numbered, for the clients that follow them (a vLLM worker's
KV events: `BlockRemoved` for a block no instance can load from the pool any more).

The engine notes drops once watched (`PoolEngine.watch_drops`); the feed takes them from it and
keeps the newest :data:`FEED_KEYS` with a sequence number each, so every client that follows
gets every drop, each from its own cursor. A client that fell further behind than the feed holds
is told it missed some (its subscribers' view may then hold blocks the pool lost). Thread-safe:
connections ask from their own threads.
"""

from __future__ import annotations

import collections
import itertools
import threading

from kvpool.store.engine import PoolEngine

FEED_KEYS = 1 << 16  # drops kept for clients that have not asked since
MAX_REPLY_KEYS = 1 << 14  # per answer; a client behind by more asks again


class DropFeed:
    """Every key that left ``engine``'s pool since the first client asked (module docstring)."""

    def __init__(self, engine: PoolEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._keys: collections.deque[tuple[int, str]] = collections.deque(maxlen=FEED_KEYS)
        self._next = 1  # the number of the next drop

    def start(self) -> int:
        """A new follower's cursor: it gets the drops from now on."""
        with self._lock:
            self._engine.watch_drops(FEED_KEYS)
            self._pull_locked()
            return self._next

    def take(self, cursor: int) -> tuple[list[str], int, bool]:
        """The drops from ``cursor`` on (at most MAX_REPLY_KEYS), the cursor after them, and
        whether some between ``cursor`` and the oldest kept were lost."""
        with self._lock:
            self._pull_locked()
            oldest = self._keys[0][0] if self._keys else self._next
            start = max(cursor, oldest)  # the numbers are consecutive: a drop's place is its number less the oldest's
            keys = [key for _, key in itertools.islice(self._keys, start - oldest, start - oldest + MAX_REPLY_KEYS)]
            return keys, start + len(keys), cursor < oldest

    def _pull_locked(self) -> None:
        for key in self._engine.take_drops():
            self._keys.append((self._next, key))
            self._next += 1
