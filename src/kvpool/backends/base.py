"""The protocol every backend implements, and the part of it every store shares.

Values are passed as lists of 1-D uint8 numpy views (one per layer segment of a block), so a
backend copies straight between vLLM's KV cache and its store with no intermediate buffer.
Every call is a batch and returns one Mooncake-compatible code per key: a failure of one key
never hides the others, and the caller turns failed keys into vLLM load errors.

`Backend` does, once for every store, what does not depend on the store: it checks the
arguments, answers empty batches, refuses empty values, folds duplicate keys, answers fast
while the store is down (`Reconnect`), turns an adapter's exception into per-key codes and
keeps the client-side counters. An adapter implements the hooks `_exists`, `_put` and
`_get_into` on input that is already checked, free of duplicates and non-empty, and, if it
holds a connection, `_connect` and `_close`.

Values in stores that any client can write under any key carry a seal (`seal_values`,
`backends.seal`): the base class writes it after the value and checks it on every read, so an
adapter moves the sealed value like any other.

Put contract: per key OK (written by this call), OBJECT_ALREADY_EXISTS (the key was stored
already; nothing was written, the stored bytes stay) or a failure code. Both of the first two
mean the pool has the key (`errors.is_stored`), so a caller needs no existence check before a
put: adapters use the store's own put-if-absent.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvpool.backends import seal
from kvpool.backends.guard import GUARD_COUNTERS, Guard, GuardSettings, Timeout
from kvpool.backoff import Backoff
from kvpool.errors import ErrorCode, KVPoolError
from kvpool.errors import CHECKSUM_MISMATCH, EXISTS, INTERNAL, INVALID, INVALID_KEY, NOT_FOUND, OK  # the codes as ints
from kvpool.errors import RPC_FAIL, RPC_TIMEOUT
from kvpool.keys import valid_key
from kvpool.store.buffers import as_u8, gather, scatter, spans, total_size
from kvpool.store.memcopy import CopyEngine
from kvpool.store.records import Presence

if TYPE_CHECKING:
    from kvpool.backends.registry import Capabilities

__all__ = ["Backend", "Buffers", "Presence", "Reconnect", "gather", "scatter", "spans", "total_size"]

logger = logging.getLogger(__name__)

Buffers = Sequence[np.ndarray]
T = TypeVar("T")

# A key no store holds: the breaker's probe asks for it (`Backend._probe`).
PROBE_KEY = "kvpool-probe"

# The client-side counters every backend keeps, and what `Backend.stats` reports, in this order
# (the guard's counters are 0 for a backend without one).
# `corrupt_reads`: reads refused because the bytes did not match the checksum written with them.
COUNTERS = ("puts", "put_bytes", "put_existing", "gets", "get_bytes", "misses", "failures", "corrupt_reads",
            "connect_failures")
STATS = COUNTERS + GUARD_COUNTERS


class Reconnect:
    """The connection state of one store client.

    While the store is down, `ready()` answers False at once (calls fail fast instead of each
    waiting for a timeout), and connecting is retried at most once per backoff, which doubles
    from `first_s` up to `cap_s` while tries keep failing. One caller tries; the others keep
    failing fast meanwhile rather than queue behind a slow connect.

    `connect` sets the client up and says whether it worked; it must return True at once when
    the client is already there. A store whose client reconnects by itself passes a `connect`
    that always succeeds: after the backoff the next call is let through as the try, and the
    adapter calls `down()` again if it fails.
    """

    def __init__(self, connect: Callable[[], bool], first_s: float = 0.5, cap_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self._clock = clock  # injectable so tests can move time
        self._lock = threading.Lock()
        self._up = False
        self._closed = False
        self._next_try = 0.0
        self._backoff = Backoff(first_s, cap_s)
        self.failures = 0  # connects that failed, for stats

    @property
    def up(self) -> bool:
        return self._up

    def connect(self) -> bool:
        """Connect now (start-up: waits for the lock, and lets the connect's exceptions out)."""
        with self._lock:
            return self._try_locked(raise_errors=True)

    def ready(self) -> bool:
        """Whether calls may go to the store now; tries to connect when the backoff is over."""
        if self._up:
            return True
        if self._closed or self._clock() < self._next_try:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another caller is connecting
        try:
            return self._up or self._try_locked(raise_errors=False)
        finally:
            self._lock.release()

    def down(self) -> None:
        """The store stopped answering: fail fast until the backoff is over, then try again."""
        with self._lock:
            if self._up:
                self._up = False
                self._backoff_locked()

    def confirm(self) -> None:
        """A call went through: the next outage starts from the shortest backoff again."""
        if self._backoff.failing and self._up:
            with self._lock:
                if self._up:
                    self._backoff.reset()

    def close(self) -> None:
        """Never connect again (the backend is closed)."""
        with self._lock:
            self._closed, self._up = True, False

    def _try_locked(self, raise_errors: bool) -> bool:
        if self._closed:
            return False
        try:
            ok = bool(self._connect())
        except Exception as exc:
            if raise_errors:
                self._backoff_locked()
                raise
            # Text only: the same failure repeats every backoff while the store stays away.
            logger.warning("kvpool: connecting to the store failed: %s", str(exc))
            ok = False
        if ok:
            self._up = True
        else:
            self.failures += 1
            self._backoff_locked()
        return ok

    def _backoff_locked(self) -> None:
        self._next_try = self._clock() + self._backoff.failed()


class _State:
    """What the base class keeps per backend: counters and the connection state."""

    def __init__(self, backend: Backend) -> None:
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.link = Reconnect(backend._connect, backend.retry_first_s, backend.retry_cap_s)
        self.copies = CopyEngine(1, backend._on_caller)
        self.guard: Guard | None = None  # set by `use_guard` for stores outside this process


class Backend(abc.ABC):
    """A pooled key -> bytes store reachable from a vLLM worker process.

    Subclasses implement `_exists`, `_put` and `_get_into` (and `_connect`, `_close`,
    `_store_stats` where they have something to do); the public batch calls are this class's.
    """

    name: str = "base"
    can_pin: bool = False  # whether `batch_pin` keeps keys in memory (host pools: `_pin`)
    # Reconnect backoff (`Reconnect`): the first retry of a store that is down, and the cap.
    retry_first_s: float = 0.5
    retry_cap_s: float = 5.0
    # Whether values carry a seal (`backends.seal`): stores that address values by key alone and
    # let any of their clients write any key. Stores kvpool's own code runs (`local`, `server`)
    # and Redis (whose adapter binds its checksum into its own header) do not need one.
    seal_values: bool = False

    @property
    def capabilities(self) -> Capabilities:
        """What this store promises (its registry entry)."""
        from kvpool.backends.registry import REGISTRY  # the registry imports this module

        return REGISTRY[self.name].capabilities

    # ---- public protocol ------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        """Which keys are stored. With `lease`, hits are protected from eviction for the lease TTL."""
        return [bool(p) for p in self._per_key(keys, lambda todo: self._exists(todo, lease), False)]

    def batch_presence(self, keys: Sequence[str]) -> list[Presence]:
        """A leasing lookup (`batch_exists(keys, lease=True)`) that also says which hits a read
        from this process cannot fail to serve before the lease's TTL (`Presence.PINNED`)."""
        return self._per_key(keys, self._presence, Presence.ABSENT)

    def _per_key(self, keys: Sequence[str], hook: Callable[[list[str]], list[T]], missing: T) -> list[T]:
        """A lookup hook's answer per key, asked once per valid distinct key; `missing` for an
        invalid key, and for every key when the store is down or the hook failed."""
        out = [missing] * len(keys)
        todo = list(dict.fromkeys(k for k in keys if valid_key(k)))
        if todo:
            hits = self._call("exists", hook, self._stored_names(todo))
            if hits is not None:
                by_key = dict(zip(todo, hits))  # an invalid key is in no answer
                out = [by_key.get(k, missing) if isinstance(k, str) else missing for k in keys]
        return out

    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        """Store each key's buffers back to back, if the key is not stored yet.

        Per key: OK (written now), OBJECT_ALREADY_EXISTS (stored already, nothing written; a
        success for the caller, see `errors.is_stored`) or a failure code. An empty value is
        INVALID_PARAMS (a KV block is never empty); a key given twice is written once, from its
        first value, and every copy gets the first one's code.
        """
        _check_lengths(keys, values)
        codes = [INVALID] * len(keys)
        first: dict[str, int] = {}
        todo: list[int] = []
        views: dict[int, list[np.ndarray]] = {}
        for i, (key, bufs) in enumerate(zip(keys, values)):
            if not valid_key(key):
                codes[i] = INVALID_KEY
                continue
            if key in first:
                continue
            first[key] = i
            try:
                segs = [as_u8(b) for b in bufs]
            except (TypeError, ValueError):
                continue  # INVALID_PARAMS: not a contiguous byte buffer
            if not any(s.size for s in segs):
                continue  # INVALID_PARAMS: an empty value
            views[i] = segs
            todo.append(i)
        if todo:
            names = self._stored_names([keys[i] for i in todo])
            out = [views[i] for i in todo]
            if self.seal_values:
                seals = seal.areas(len(todo))
                for name, value, buf in zip(names, out, seals):
                    seal.write(buf, name, value)
                out = [value + [buf] for value, buf in zip(out, seals)]
            results = self._run("put", self._put, todo, names, out)
            for i, code in zip(todo, results):
                codes[i] = code
        primary: list[int] = []  # one index per distinct key (and each invalid one): what is counted
        for i, key in enumerate(keys):
            j = first.get(key) if valid_key(key) else None
            if j is not None and j != i:
                codes[i] = codes[j]
            else:
                primary.append(i)
        self._tally(primary, codes, views, ("puts", "put_bytes"), EXISTS, "put_existing")
        return codes

    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        """Copy each key's bytes into its buffers, whose sizes must add up to the object's
        (INVALID_PARAMS otherwise, with the buffers untouched); OBJECT_NOT_FOUND for a miss."""
        _check_lengths(keys, values)
        codes = [INVALID] * len(keys)
        views: dict[int, list[np.ndarray]] = {}
        # A key asked for twice fills both destinations: each round holds a key at most once.
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, (key, bufs) in enumerate(zip(keys, values)):
            if not valid_key(key):
                codes[i] = INVALID_KEY
                continue
            try:
                views[i] = [as_u8(b, writable=True) for b in bufs]
            except (TypeError, ValueError):
                continue  # INVALID_PARAMS: not a writable contiguous byte buffer
            r = seen.get(key, 0)
            seen[key] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for todo in rounds:
            names = self._stored_names([keys[i] for i in todo])
            out = [views[i] for i in todo]
            if self.seal_values:
                seals = seal.areas(len(todo))
                out = [value + [buf] for value, buf in zip(out, seals)]
            results = self._run("get", self._get_into, todo, names, out)
            for j, (i, code) in enumerate(zip(todo, results)):
                if code == OK and self.seal_values and not seal.holds(seals[j], names[j], views[i]):
                    code = CHECKSUM_MISMATCH
                    logger.warning("kvpool %s: %r holds bytes not sealed under that key: a miss", self.name, keys[i])
                codes[i] = code
        self._tally(range(len(codes)), codes, views, ("gets", "get_bytes"), NOT_FOUND, "misses")
        return codes

    def stats(self) -> dict[str, float]:
        """The client-side counters (`STATS`, the same for every backend), then the store's
        own numbers, if it has any, prefixed with `store_`."""
        st = self._state
        with st.lock:
            out: dict[str, float] = dict(st.counters)
        out["connect_failures"] = st.link.failures
        out.update(self.guard_stats())
        for k, v in self._store_stats().items():
            out[f"store_{k}"] = v
        return out

    def guard_stats(self) -> dict[str, int]:
        """The guard's counters (`GUARD_COUNTERS`; zeros without a guard): cheap, no store call."""
        guard = self._state.guard
        return dict(guard.counters) if guard is not None else dict.fromkeys(GUARD_COUNTERS, 0)

    def tier_stats(self) -> dict[str, int]:
        """Counters of a remote tier behind this pool (`backends.tiered`); none without one."""
        return {}

    def use_copy_threads(self, threads: int) -> None:
        """Copy a batch's values on this many threads where the adapter copies them itself
        (`copy_threads`; `local` and `server`, whose bytes kvpool's own code moves)."""
        old, self._state.copies = self._state.copies, CopyEngine(threads, self._on_caller)
        old.close()

    def use_guard(self, settings: GuardSettings) -> None:
        """Bound every call into the store by a deadline, behind a circuit breaker (`guard`):
        for stores outside this process, whose calls can hang."""
        old, self._state.guard = self._state.guard, Guard(self.name, settings, self._probe)
        if old is not None:
            old.close()

    def batch_pin(self, keys: Sequence[str], ttl_s: float) -> list[int] | None:
        """Keep ``keys`` in the store's memory for ``ttl_s`` seconds (a request's ``pin_s``): a
        code per key, RPC_FAIL for each while the store is down; None from a store that cannot
        pin (the distributed stores: their memory is their own)."""
        if not self.can_pin:
            return None
        codes = self._call("pin", self._pin, [k for k in keys], ttl_s)
        return codes if codes is not None else [RPC_FAIL] * len(keys)

    def take_removed(self) -> list[str] | None:
        """Keys that left the store since the last call (eviction, removal), for stores that can
        tell (the first call starts the watch); None for a store that cannot."""
        return None

    def close(self) -> None:
        """Release the backend's resources; flushes what its tiers promise to keep."""
        if self._state.guard is not None:
            self._state.guard.close()
        self._state.link.close()
        self._close()
        self._state.copies.close()

    # ---- hooks ------------------------------------------------------------------------------

    def _pin(self, keys: list[str], ttl_s: float) -> list[int]:
        raise NotImplementedError  # only where can_pin

    @abc.abstractmethod
    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        """Which of `keys` (valid, distinct, at least one) are stored."""

    def _presence(self, keys: list[str]) -> list[Presence]:
        """`batch_presence`'s hook (keys as `_exists` gets them): a store that cannot pin in this
        process answers STORED at most."""
        return [Presence.STORED if hit else Presence.ABSENT for hit in self._exists(keys, True)]

    @abc.abstractmethod
    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        """Store each key if absent: OK, OBJECT_ALREADY_EXISTS or a failure code per key.
        Keys are valid and distinct; each value is contiguous uint8 views, not all empty."""

    @abc.abstractmethod
    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        """Copy each key's bytes into its (writable, contiguous uint8) views; keys are distinct."""

    def _connect(self) -> bool:
        """Set the store's client up if it is not (True at once when it is); False to retry
        after the backoff. The default: nothing to set up."""
        return True

    def _available(self) -> bool:
        """Whether calls may go to the store now. Adapters with a cheap local health flag
        (Mooncake) add it; the default is the reconnect state."""
        return self._state.link.ready()

    def _probe(self) -> object:
        """One cheap call that only a store that answers can complete: the breaker's probe.
        While the breaker is open no user call reaches `_available`, so the probe is what
        reconnects a store whose client went away (on the guard's thread, under its deadline)."""
        if not self._available():
            raise KVPoolError(f"kvpool {self.name}: the store is not connected", ErrorCode.RPC_FAIL)
        return self._exists([PROBE_KEY], False)

    def _close(self) -> None:
        """Close the store's client."""

    def _store_stats(self) -> dict[str, float]:
        """Numbers only the store knows (engine or server counters)."""
        return {}

    # ---- helpers for adapters -----------------------------------------------------------------

    def _stored_names(self, keys: list[str]) -> list[str]:
        """What the adapter stores `keys` under (`seal.stored_key` for sealed values)."""
        return [seal.stored_key(k) for k in keys] if self.seal_values else keys

    @property
    def _link(self) -> Reconnect:
        return self._state.link

    @property
    def _copies(self) -> CopyEngine:
        return self._state.copies

    def _on_caller(self, fn: Callable[[], T]) -> T:
        """`fn()` on the thread that called the backend, where a guard runs the call on one of
        its own (`Guard.on_caller`): copies use that thread's OpenMP team (`CopyEngine`)."""
        guard = self._state.guard
        return guard.on_caller(fn) if guard is not None else fn()

    def _buffers(self) -> AbstractContextManager[bool]:
        """Enter before an adapter reads or writes the caller's buffers; False means the
        caller gave up waiting and the buffers must be left alone (`guard` explains why)."""
        guard = self._state.guard
        return guard.buffers() if guard is not None else nullcontext(True)

    @property
    def _state(self) -> _State:
        # Created on first use, not in __init__, so adapters need not call super().__init__()
        # (their constructors belong to the configuration code).
        st = self.__dict__.get("_kvpool_state")
        if st is None:
            st = self.__dict__.setdefault("_kvpool_state", _State(self))
        return st

    def _call(self, what: str, hook: Callable[..., list], keys: list[str], *args: object) -> list | None:
        """Run a hook; None (and a log line, and a failure counted) if the store is down, the
        hook raised, missed its deadline or answered with the wrong number of results."""
        guard = self._state.guard
        try:
            if guard is None:
                if not self._available():
                    return None
                out = list(hook(keys, *args))
            else:
                if not guard.allows():
                    return None
                # `_available` may reconnect (a port probe, a client's set-up: seconds against a
                # store that went away): on the guard's thread, under the deadline, like the call.
                got = guard.call(lambda: hook(keys, *args) if self._available() else None,
                                 guard.settings.lookup_timeout_s)
                if got is None:
                    return None
                out = list(got)
                guard.succeeded()
        except Timeout:
            self._bump("failures", len(keys))
            return None
        except Exception as exc:  # noqa: BLE001 - a store's error must never take vLLM down
            self._hook_failed(what, exc, len(keys))
            return None
        if len(out) != len(keys):
            logger.error("kvpool %s: %s answered %d results for %d keys", self.name, what, len(out), len(keys))
            self._bump("failures", len(keys))
            return None
        self._state.link.confirm()
        return out

    def _run(self, what: str, hook: Callable[..., list[int]], todo: list[int], keys: list[str],
             values: list[list[np.ndarray]]) -> list[int]:
        """A put or get hook's codes, or one code for all keys when the store is down or the
        hook failed."""
        guard = self._state.guard
        try:
            if guard is None:
                if not self._available():
                    return [RPC_FAIL] * len(todo)
                out = [int(c) for c in hook(keys, values)]
            else:
                if not guard.allows():
                    return [RPC_FAIL] * len(todo)
                # `_available` may reconnect: on the guard's thread, under the deadline (`_call`).
                got = guard.call(lambda: hook(keys, values) if self._available() else None,
                                 guard.settings.transfer_timeout_s)
                if got is None:
                    return [RPC_FAIL] * len(todo)  # down: the reconnect backoff answers, not a failure
                out = [int(c) for c in got]
                if out and all(c in (RPC_FAIL, RPC_TIMEOUT) for c in out):
                    guard.failed(f"every key of a {what} answered {out[0]}")
                else:
                    guard.succeeded()
        except Timeout:
            return [RPC_TIMEOUT] * len(todo)
        except Exception as exc:  # noqa: BLE001 - a store's error must never take vLLM down
            return [self._hook_failed(what, exc, 0)] * len(todo)
        if len(out) != len(todo):
            logger.error("kvpool %s: %s answered %d codes for %d keys", self.name, what, len(out), len(todo))
            return [INTERNAL] * len(todo)
        self._state.link.confirm()
        return out

    def _hook_failed(self, what: str, exc: Exception, count: int) -> int:
        # Logged as text: a log record that kept the exception would keep its traceback's frames
        # (and the store client in them) alive. An unexpected exception is an adapter bug: its
        # traceback is logged.
        code = int(exc.code) if isinstance(exc, KVPoolError) else RPC_FAIL
        if self._state.guard is not None:
            self._state.guard.failed(type(exc).__name__)
        if isinstance(exc, KVPoolError):
            logger.warning("kvpool %s: %s failed: %s", self.name, what, str(exc))
        else:
            logger.warning("kvpool %s: %s failed: %s", self.name, what, repr(exc), exc_info=True)
        self._bump("failures", count)
        return code

    def _bump(self, counter: str, n: int = 1) -> None:
        st = self._state
        with st.lock:
            st.counters[counter] += n

    def _tally(self, indices: Sequence[int], codes: list[int], views: dict[int, list[np.ndarray]],
               done: tuple[str, str], other_code: int, other: str) -> None:
        """Count a batch's outcome: `done` = (count, bytes) counters for OK keys, `other` for keys
        answered `other_code` (a miss, an existing key: not failures), `corrupt_reads` for
        CHECKSUM_MISMATCH (a miss too, and an event), `failures` for the rest."""
        n_done = n_bytes = n_other = n_corrupt = n_failed = 0
        for i in indices:
            c = codes[i]
            if c == OK:
                n_done += 1
                n_bytes += sum(v.size for v in views[i])
            elif c == other_code:
                n_other += 1
            elif c == CHECKSUM_MISMATCH:
                n_corrupt += 1
            else:
                n_failed += 1
        st = self._state
        with st.lock:
            cnt = st.counters
            cnt[done[0]] += n_done
            cnt[done[1]] += n_bytes
            cnt[other] += n_other
            cnt["corrupt_reads"] += n_corrupt
            cnt["failures"] += n_failed


def _check_lengths(keys: Sequence[str], values: Sequence[Buffers]) -> None:
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values: one buffer list per key")
