"""Client of `kvpool server`: batched metadata calls over the Unix socket, payload copies
straight into and out of the server's shared-memory arena.

Cost per batch: ``exists`` is one round trip; ``put`` two (allocate, whose per-key answer says
which keys are stored already, then commit after copying into the arena; one when every key
was there), so a save needs no ``exists`` first; ``get_into`` two (acquire leases, then release
after copying out, which is also when the server says whether each copy was stable), or one
for keys a leased ``exists`` just found: that lookup's leases are kept and the copy runs under
them (the scheduler looks up, then the worker loads, on the same client).
``requests`` counts the round trips by request type.

Failure model: the client never raises for a server problem and never blocks longer than its
timeouts. A dead, missing or hung server turns every key of a call into a failure code
(RPC_FAIL) or a miss; a background thread pings (client liveness, see ``client_ttl``) and
reconnects, remapping the new server's arena, so calls succeed again once a server is back.

Safety across reconnects: a batch is bound to the connection ("link") it started on. Commit and
release go to that same link or fail, so an allocation or lease of a dead server is never
confused with one of its successor (whose handle and lease numbers start over), and the server
only accepts handles and leases the same connection was given.

Thread-safe: calls from several threads share one connection, one round trip at a time; the
copies themselves run outside the lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpool.config import DEFAULT_SERVER_SOCKET
from kvpool.errors import CHECKSUM_MISMATCH, INTERNAL, INVALID, INVALID_KEY, OK, RPC_FAIL, RPC_TIMEOUT
from kvpool.errors import BackendUnavailable, ConfigError, ErrorCode
from kvpool.keys import valid_key
from kvpool.paths import check_socket_dir
from kvpool.server import peers
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.store.buffers import as_u8 as _u8
from kvpool.store.buffers import gather_summed
from kvpool.store.memcopy import CopyEngine, CorruptCopy

logger = logging.getLogger(__name__)



class _Down(Exception):
    """The server cannot be reached (or misbehaved) for this call."""


class _Untrusted(_Down):
    """What is on the socket is not a server of our trust domain: nothing was sent or mapped."""


@dataclass
class _Link:
    """One connection: socket, the arena it maps, the handshake reply."""

    sock: socket.socket
    arena: shm.Arena
    hello: P.HelloReply
    lock: threading.Lock
    alive: bool = True


@dataclass
class _Held:
    """A lookup lease the server handed back for one key (`Lookup`), kept for the load after."""

    link: _Link
    lease_id: int
    offset: int
    size: int
    checksum: int | None
    granted: float  # time.monotonic() when the Lookup was sent


# One key's lease for a get: code, lease id, arena offset, size, inline bytes, checksum.
_Row = tuple[int, int, int, int, bytes | None, int | None]

# Release codes of a copy under a lookup lease that lapsed: worth one more try, acquired.
_LOOKUP_LAPSED = frozenset({int(ErrorCode.LEASE_EXPIRED), int(ErrorCode.OBJECT_NOT_FOUND)})

# Lookup leases kept for the loads that follow: at most this many (past it the oldest are
# forgotten here; the server lets them expire), each used while younger than half the lease TTL.
_MAX_HELD = 1 << 16




def _prepare(keys: Sequence[str], values: Sequence[Sequence[Any]], writable: bool
             ) -> tuple[list[int], list[tuple[int, str, list[np.ndarray], int]]]:
    """Per-key codes (RPC_FAIL until a reply says otherwise; INVALID_KEY / INVALID_PARAMS for
    bad input) and the (index, key, byte views, total size) of the keys to send."""
    if len(values) != len(keys):
        return [INVALID] * len(keys), []
    codes = [RPC_FAIL] * len(keys)
    todo = []
    for i, (key, bufs) in enumerate(zip(keys, values)):
        if not valid_key(key, P.MAX_KEY_BYTES):
            codes[i] = INVALID_KEY
            continue
        try:
            views = [_u8(b, writable=writable) for b in bufs]
        except (TypeError, ValueError):
            codes[i] = INVALID
            continue
        todo.append((i, key, views, sum(v.size for v in views)))
    return codes, todo


def _chunks(items: list[Any], size_of: Any = None, max_bytes: int = P.MAX_INLINE_BYTES) -> Iterator[list[Any]]:
    """Split `(index, key, ...)` items into batches the server accepts: at most MAX_BATCH items
    and MAX_REQUEST_KEY_BYTES of keys (so the request frame stays under MAX_REQUEST_FRAME), and,
    with ``size_of``, about ``max_bytes`` of payload (so a reply with disk-served bytes inline
    stays bounded)."""
    batch: list[Any] = []
    total = key_bytes = 0
    for item in items:
        size = size_of(item) if size_of else 0
        key = len(item[1].encode())
        if batch and (len(batch) >= P.MAX_BATCH or total + size > max_bytes
                      or key_bytes + key > P.MAX_REQUEST_KEY_BYTES):
            yield batch
            batch, total, key_bytes = [], 0, 0
        batch.append(item)
        total += size
        key_bytes += key
    if batch:
        yield batch


_SERIAL = CopyEngine(1)  # copies on the calling thread

_process_id: tuple[int, str] = (0, "")


def process_id() -> str:
    """A random id of this process (`Hello.process`), drawn anew in a forked child."""
    global _process_id
    pid = os.getpid()
    if _process_id[0] != pid:
        _process_id = (pid, secrets.token_hex(8))
    return _process_id[1]

# Admits a call's copies to and from the caller's buffers: a context manager that yields False
# when the caller has stopped waiting (the backend's deadline passed), so the buffers must be
# left alone (`kvpool.backends.guard`).
BufferGate = Callable[[], AbstractContextManager[bool]]


def _always() -> AbstractContextManager[bool]:
    return nullcontext(True)


_ALWAYS: BufferGate = _always


class PoolClient:
    """A connection to `kvpool server` at ``socket_path``; see the module docstring.

    ``timeout_s`` bounds one round trip, ``connect_timeout_s`` the connect and handshake.
    With ``ping`` a daemon thread pings every client_ttl/3 and reconnects when the link is
    down (every ``retry_interval_s``); calls also reconnect themselves, at most that often.

    Trust (docs/security.md): before sending anything the client checks, with SO_PEERCRED,
    that the listening process runs as our uid (or, with ``allowed_gid``, as a member of that
    group), and before mapping the arena that the file is that uid's, mode 0600 (0660 and
    ``allowed_gid`` with group sharing). ``untrusted`` counts the servers refused.
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SERVER_SOCKET,
        name: str = "kvpool-client",
        *,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        retry_interval_s: float = 0.5,
        ping: bool = True,
        allowed_gid: int | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.allowed_gid = allowed_gid
        self.untrusted = 0
        self.name = name[: P.MAX_NAME]
        self.timeout_s = timeout_s
        self.checksum_failures = 0  # copies out of the arena refused: not what their writer committed
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self._link: _Link | None = None
        self._connect_lock = threading.Lock()
        self._retry_at = 0.0
        self._reported_down = False
        self._closed = False
        self._stop = threading.Event()
        # Round trips by request type ("Allocate", "Commit", ...): what a batch really cost.
        self.requests: Counter[str] = Counter()
        self._requests_lock = threading.Lock()
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._held_lock = threading.Lock()
        try:
            self._reconnect()
        except _Down:
            pass  # logged; calls fail until a server appears, the pinger keeps trying
        self._pinger: threading.Thread | None = None
        if ping:
            self._pinger = threading.Thread(target=self._ping_loop, name="kvpool-client-ping", daemon=True)
            self._pinger.start()

    # ---- state ----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        link = self._link
        return link is not None and link.alive

    @property
    def client_id(self) -> str | None:
        link = self._link
        return link.hello.client_id if link is not None and link.alive else None

    @property
    def server_info(self) -> P.HelloReply | None:
        """The current connection's handshake reply (arena name and size, TTLs, server pid)."""
        link = self._link
        return link.hello if link is not None and link.alive else None

    @property
    def arena(self) -> np.ndarray | None:
        """The mapped arena of the current connection (for tools and tests)."""
        link = self._link
        return link.arena.array if link is not None and link.alive else None

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected (reconnecting as needed) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._current(force=True)
                return True
            except _Down:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(min(0.05, self.retry_interval_s))

    def close(self) -> None:
        """Disconnect; the server then drops this client's leases and unfinished puts."""
        self._closed = True
        self._stop.set()
        if self._pinger is not None:
            self._pinger.join(self.connect_timeout_s + self.timeout_s)
        link = self._link
        if link is not None:
            self._drop(link, None)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- batch calls --------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        """Which keys are stored (in memory or the offload tier). Unreachable server: all False.

        ``lease`` protects in-memory hits from eviction for the server's lease TTL, and keeps
        their leases here for a ``get_into`` of the same keys soon after, which then copies
        without acquiring (``requests`` counts a Lookup instead of an Exists).
        """
        found = [False] * len(keys)
        todo = [(i, k) for i, k in enumerate(keys) if valid_key(k, P.MAX_KEY_BYTES)]
        for batch in _chunks(todo):
            try:
                if lease:
                    self._lookup(batch, found)
                    continue
                reply = self._call(P.Exists([k for _, k in batch], lease), P.Found, len(batch))
            except _Down:
                return found
            if isinstance(reply, P.Found):
                for (i, _), hit in zip(batch, reply.found):
                    found[i] = bool(hit)
        return found

    def _lookup(self, batch: list[tuple[int, str]], found: list[bool]) -> None:
        link = self._current()
        sent = time.monotonic()
        reply = self._call_on(link, P.Lookup([k for _, k in batch]), P.Looked, len(batch))
        if not isinstance(reply, P.Looked):
            return  # refused as a whole: misses
        with self._held_lock:
            held = self._held
            for (i, key), hit, lease_id, offset, size, want in zip(
                batch, reply.found, reply.lease_ids, reply.offsets, reply.sizes, reply.checksums
            ):
                found[i] = bool(hit)
                if hit and lease_id:
                    held.pop(key, None)
                    held[key] = _Held(link, lease_id, offset, size, want, sent)
            # Oldest first: drop those past the lease TTL (of no use any more), and past the bound.
            stale = sent - link.hello.lease_ttl_ms / 1000.0
            while held and (len(held) > _MAX_HELD or next(iter(held.values())).granted < stale):
                held.popitem(last=False)

    def _take_held(self, batch: list[tuple[int, str, list[np.ndarray], int]]
                   ) -> tuple[_Link | None, dict[int, _Held]]:
        """The current link and, by position in ``batch``, the lookup leases young enough to
        copy under (granted less than half the lease TTL ago) on that link; each key once."""
        link = self._link
        if link is None or not link.alive:
            return None, {}
        young = time.monotonic() - link.hello.lease_ttl_ms / 2000.0
        out: dict[int, _Held] = {}
        seen: set[str] = set()
        with self._held_lock:
            for j, (_i, key, _outs, _size) in enumerate(batch):
                h = self._held.get(key)
                if h is not None and h.link is link and h.granted > young and key not in seen:
                    out[j] = h
                    seen.add(key)
        return link, out

    def _forget_held(self, keys: Sequence[str]) -> None:
        with self._held_lock:
            for key in keys:
                self._held.pop(key, None)

    def put(self, keys: Sequence[str], values: Sequence[Sequence[Any]],
            buffers: BufferGate | None = None) -> list[int]:
        """Store each key as the concatenation of its buffers, if it is not stored yet.

        Per key: OK (written now), OBJECT_ALREADY_EXISTS (stored, or being written by another
        client: nothing written, objects are immutable) or a failure code. ``buffers`` admits the
        copy out of the caller's buffers (`BufferGate`).
        """
        codes, todo = _prepare(keys, values, writable=False)
        # A quarter of the arena per Allocate: uncommitted bytes count against this process's
        # share of the pool (the server's --client-pool-share), so a large put goes in rounds
        # that each commit before the next allocates.
        try:
            limit = max(1, self._current().hello.arena_size // 4)
        except _Down:
            limit = P.MAX_INLINE_BYTES  # every batch fails fast with RPC_FAIL anyway
        for batch in _chunks(todo, size_of=lambda item: item[3], max_bytes=min(limit, P.MAX_INLINE_BYTES)):
            self._put_batch(batch, codes, buffers or _ALWAYS)
        return codes

    def get_into(self, keys: Sequence[str], values: Sequence[Sequence[Any]],
                 copies: CopyEngine | None = None, buffers: BufferGate | None = None) -> list[int]:
        """Copy each key's bytes into its buffers (sizes must add up to the object's), on
        ``copies``' threads when given, once ``buffers`` admits it (`BufferGate`).

        A key counts as read (OK) only if the server confirms at release that its lease held
        for the whole copy; otherwise the buffers may hold garbage and the code says why
        (LEASE_EXPIRED, OBJECT_NOT_FOUND, RPC_FAIL, ...).
        """
        codes, todo = _prepare(keys, values, writable=True)
        for batch in _chunks(todo, size_of=lambda item: item[3]):
            self._get_batch(batch, codes, copies or _SERIAL, buffers or _ALWAYS)
        return codes

    def remove(self, keys: Sequence[str]) -> list[int]:
        return self._per_key(keys, P.Remove)

    def pin(self, keys: Sequence[str], ttl_s: float) -> list[int]:
        """Keep ``keys`` in the server's memory for ``ttl_s`` seconds: a code per key (OK,
        OBJECT_NOT_FOUND, NO_AVAILABLE_HANDLE past the pins' share; RPC_FAIL when unreachable)."""
        return self._per_key(keys, lambda batch: P.Pin(batch, ttl_s))

    def _per_key(self, keys: Sequence[str], request: Callable[[list[str]], P.Message]) -> list[int]:
        """A code per key of a request that answers one per key, sent in batches of valid keys."""
        codes = [RPC_FAIL] * len(keys)
        todo = [(i, k) for i, k in enumerate(keys) if valid_key(k, P.MAX_KEY_BYTES)]
        for i, k in enumerate(keys):
            if not valid_key(k, P.MAX_KEY_BYTES):
                codes[i] = int(ErrorCode.INVALID_KEY)
        for batch in _chunks(todo):
            try:
                reply = self._call(request([k for _, k in batch]), P.Codes, len(batch))
            except _Down:
                break
            for (i, _), c in zip(batch, self._codes_of(reply, len(batch))):
                codes[i] = c
        return codes

    def take_drops(self) -> tuple[list[str], bool] | None:
        """The keys that left the pool since this client last asked, and whether some were lost
        (it fell behind the server's feed); the first call starts following ([]). None when the
        server cannot be asked (down, or an older server without the feed)."""
        try:
            reply = self._call(P.TakeDrops(), P.Dropped)
        except _Down:
            return None
        if not isinstance(reply, P.Dropped):
            return None
        return list(reply.keys), reply.missed

    def ping(self) -> int:
        try:
            reply = self._call(P.Ping(), P.Codes, 1)
        except _Down:
            return RPC_FAIL
        return self._codes_of(reply, 1)[0]

    def server_stats(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The server's counters and its connected clients; BackendUnavailable if unreachable."""
        try:
            reply = self._call(P.GetStats(), P.StatsReply)
        except _Down as exc:
            raise BackendUnavailable(f"kvpool server at {self.socket_path}: {exc}") from None
        if isinstance(reply, P.Error):
            raise BackendUnavailable(f"kvpool server at {self.socket_path}: {reply.message}", ErrorCode(reply.code))
        assert isinstance(reply, P.StatsReply)
        return dict(reply.stats), [dict(c) for c in reply.clients]

    # ---- low level: two-phase put and leases (tools and tests) --------------------------------

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> P.Allocated | P.Error:
        """Reserve arena ranges; write them through ``arena`` then ``commit`` (or ``abort``)."""
        return self._call(P.Allocate(list(keys), list(sizes)), P.Allocated, len(keys))  # type: ignore[return-value]

    def commit(self, handles: Sequence[int]) -> list[int]:
        return self._codes_of(self._call(P.Commit(list(handles)), P.Codes, len(handles)), len(handles))

    def abort(self, handles: Sequence[int]) -> list[int]:
        return self._codes_of(self._call(P.Abort(list(handles)), P.Codes, len(handles)), len(handles))

    def acquire(self, keys: Sequence[str]) -> P.Acquired | P.Error:
        return self._call(P.Acquire(list(keys)), P.Acquired, len(keys))  # type: ignore[return-value]

    def release(self, lease_ids: Sequence[int]) -> list[int]:
        return self._codes_of(self._call(P.Release(list(lease_ids)), P.Codes, len(lease_ids)), len(lease_ids))

    # ---- batch internals ----------------------------------------------------------------------

    def _first_phase(self, batch: list[tuple[int, str, list[np.ndarray], int]], codes: list[int], request: Any,
                     expect: type) -> tuple[Any, Any] | None:
        """Send a batch's first request (Allocate or Acquire): (link, reply), or None when the
        server is down (codes stay RPC_FAIL) or refused the whole batch (codes say why)."""
        try:
            link = self._current()
            reply = self._call_on(link, request, expect, len(batch))
        except _Down:
            return None
        if isinstance(reply, P.Error):
            for b in batch:
                codes[b[0]] = reply.code
            return None
        return link, reply

    def _put_batch(self, batch: list[tuple[int, str, list[np.ndarray], int]], codes: list[int],
                   buffers: BufferGate) -> None:
        first = self._first_phase(batch, codes, P.Allocate([b[1] for b in batch], [b[3] for b in batch]),
                                  P.Allocated)
        if first is None:
            return
        link, reply = first
        assert isinstance(reply, P.Allocated)
        arena = link.arena.array
        link.arena.note(max((off + b[3] for b, c, off in zip(batch, reply.codes, reply.offsets) if c == OK), default=0))
        committing: list[tuple[int, int]] = []
        sums: list[int | None] = []
        aborting: list[int] = []
        with buffers() as admitted:
            for (i, _key, segs, size), code, handle, offset in zip(batch, reply.codes, reply.handles, reply.offsets):
                if code != OK:
                    codes[i] = code  # OBJECT_ALREADY_EXISTS included: the server's put-if-absent
                    continue
                if not admitted:  # the caller stopped waiting: its buffers may hold other KV now
                    aborting.append(handle)
                    continue
                if not 0 <= offset <= arena.size - size:
                    codes[i] = int(ErrorCode.INTERNAL_ERROR)
                    aborting.append(handle)
                    continue
                try:
                    # The sum is of our own bytes, not of the arena's (which any client may write).
                    sums.append(gather_summed(segs, arena[offset : offset + size]))
                except Exception:  # e.g. a buffer freed under us: never publish a partial copy
                    logger.exception("kvpool put: copying into the arena failed; aborting that key")
                    codes[i] = int(ErrorCode.INVALID_PARAMS)
                    aborting.append(handle)
                    continue
                committing.append((i, handle))
        try:
            if aborting:
                self._call_on(link, P.Abort(aborting), P.Codes, len(aborting))
            if committing:
                reply2 = self._call_on(link, P.Commit([h for _, h in committing], sums), P.Codes, len(committing))
                for (i, _), c in zip(committing, self._codes_of(reply2, len(committing))):
                    codes[i] = c
        except _Down:
            pass  # uncommitted keys stay RPC_FAIL; the server frees their ranges at disconnect

    def _leases_for(self, batch: list[tuple[int, str, list[np.ndarray], int]],
                    lookups: bool) -> tuple[_Link, list[_Row], set[int]] | None:
        """The link, and per key of ``batch`` its (code, lease id, offset, size, inline bytes,
        checksum): from a recent lookup's lease where there is one (with ``lookups``), from one
        Acquire for the other keys (none when every key has one). Also the positions served by
        lookup leases. None when the server is down (codes stay RPC_FAIL)."""
        link, held = self._take_held(batch) if lookups else (None, {})
        try:
            current = self._current()
        except _Down:
            return None
        if link is not current:
            held = {}  # reconnected: those leases were another server's
        rows: list[_Row] = [(RPC_FAIL, 0, 0, 0, None, None)] * len(batch)
        for j, h in held.items():
            rows[j] = (OK, h.lease_id, h.offset, h.size, None, h.checksum)
        rest = [j for j in range(len(batch)) if j not in held]
        if rest:
            try:
                reply = self._call_on(current, P.Acquire([batch[j][1] for j in rest]), P.Acquired, len(rest))
            except _Down:
                return None
            if isinstance(reply, P.Error):
                for j in rest:
                    rows[j] = (reply.code, 0, 0, 0, None, None)
            else:
                assert isinstance(reply, P.Acquired)
                sums = reply.checksums if len(reply.checksums) == len(rest) else [None] * len(rest)
                for j, row in zip(rest, zip(reply.codes, reply.lease_ids, reply.offsets, reply.sizes,
                                            reply.data, sums)):
                    rows[j] = row
        return current, rows, set(held)

    def _get_batch(self, batch: list[tuple[int, str, list[np.ndarray], int]], codes: list[int],
                   copies: CopyEngine, buffers: BufferGate, lookups: bool = True) -> None:
        got = self._leases_for(batch, lookups)
        if got is None:
            return
        link, rows, from_lookup = got
        lookup_keys = {batch[j][0] for j in from_lookup}
        arena = link.arena.array
        releasing: list[int] = []
        checked: list[int] = []  # index per lease in `releasing` whose code the release decides

        def give_up(i: int, code: int, lease_id: int) -> None:
            # The key's code is final; its lease (if any) is still released, with no say in it.
            codes[i] = code
            if lease_id:
                releasing.append(lease_id)
                checked.append(-1)
        jobs: list[tuple[np.ndarray, list[np.ndarray]]] = []
        copying: list[tuple[int, int]] = []  # (key index, lease id; 0 for bytes sent inline)
        expected: list[int | None] = []  # per job: the checksum its copy must have
        for (i, _key, outs, want), (code, lease_id, offset, size, data, want_sum) in zip(batch, rows):
            if code != OK:
                codes[i] = code
                continue
            if want != size:
                give_up(i, INVALID, lease_id)
                continue
            if offset == -1:
                # Served from the server's disk tier: the bytes came inline, no lease to end.
                if data is None or len(data) != size:
                    codes[i] = int(ErrorCode.INTERNAL_ERROR)
                    continue
                jobs.append((np.frombuffer(data, dtype=np.uint8), outs))
                copying.append((i, 0))
                expected.append(None)
            elif 0 <= offset <= arena.size - size:
                link.arena.note(offset + size)
                jobs.append((arena[offset : offset + size], outs))
                copying.append((i, lease_id))
                expected.append(want_sum)
            else:
                give_up(i, INTERNAL, lease_id)
        with buffers() as admitted:
            # What we copied is what the writer committed, or a miss: the arena is writable by
            # every client of this pool, our destination only by us. Checked by the copying threads.
            errors = copies.scatter_all(jobs, expected) if admitted else None
        if errors is None:  # the caller stopped waiting: its buffers may hold other KV now
            for i, lease_id in copying:
                give_up(i, RPC_TIMEOUT, lease_id)
            errors = []
        corrupt: list[int] = []  # leases whose copy failed its checksum: the server checks those objects
        mismatched: list[int] = []  # copies under lookup leases that failed it: the release says why
        for (i, lease_id), err in zip(copying, errors):
            if isinstance(err, CorruptCopy) and i in lookup_keys:
                # Under a lookup lease that lapsed, the key may hold a newer value now: that
                # is a lapse (tried again below), not a damaged object, if the release says so.
                releasing.append(lease_id)
                checked.append(i)
                corrupt.append(lease_id)
                mismatched.append(i)
            elif isinstance(err, CorruptCopy):
                self.checksum_failures += 1
                give_up(i, CHECKSUM_MISMATCH, lease_id)
                if lease_id:
                    corrupt.append(lease_id)
            elif err is not None:
                logger.error("kvpool get: copying out of the arena failed: %r", err)
                give_up(i, INVALID, lease_id)
            elif lease_id == 0:
                codes[i] = OK
            else:
                releasing.append(lease_id)
                checked.append(i)
        if not releasing:
            return
        try:
            reply2 = self._call_on(link, P.Release(releasing, corrupt), P.Codes, len(releasing))
        except _Down:
            return  # unverified copies stay RPC_FAIL: the bytes may be stale
        for i, c in zip(checked, self._codes_of(reply2, len(releasing))):
            if i >= 0:
                codes[i] = c
        for i in mismatched:
            if codes[i] == OK:  # the lease held: the bytes were damaged
                self.checksum_failures += 1
                codes[i] = CHECKSUM_MISMATCH
        # A lookup lease that did not hold (it expired, or the object was replaced or evicted
        # since the lookup) is not the reader's failure: those keys go again, acquired.
        again = [b for b in batch if b[0] in lookup_keys and codes[b[0]] in _LOOKUP_LAPSED]
        if again:
            self._forget_held([b[1] for b in again])
            self._get_batch(again, codes, copies, buffers, lookups=False)

    @staticmethod
    def _codes_of(reply: P.Message, n: int) -> list[int]:
        if isinstance(reply, P.Codes):
            return [int(c) for c in reply.codes]
        if isinstance(reply, P.Error):
            return [reply.code] * n
        return [RPC_FAIL] * n

    # ---- connection ------------------------------------------------------------------------------

    def _call(self, message: P.Message, expect: type, n: int | None = None) -> P.Message:
        return self._call_on(self._current(), message, expect, n)

    def _call_on(self, link: _Link, message: P.Message, expect: type, n: int | None = None) -> P.Message:
        """One round trip on ``link``. Returns the expected reply type or an Error; raises _Down."""
        if not link.alive:
            raise _Down("connection lost")
        if not link.lock.acquire(timeout=self.timeout_s):
            raise _Down("connection busy (server not answering)")
        try:
            if not link.alive:
                raise _Down("connection lost")
            with self._requests_lock:
                self.requests[type(message).__name__] += 1
            try:
                P.send_frame(link.sock, message)
                body = P.recv_frame(link.sock, P.MAX_REPLY_FRAME)
                if body is None:
                    raise ConnectionError("server closed the connection")
                reply = P.reply_decoder.decode(body)
            except (OSError, P.FrameError, msgspec.DecodeError) as exc:
                self._drop(link, exc)
                raise _Down(str(exc)) from None
        finally:
            link.lock.release()
        if isinstance(reply, P.Error):
            return reply
        if not isinstance(reply, expect) or (n is not None and not self._shape_ok(reply, n)):
            self._drop(link, f"unexpected reply {type(reply).__name__} to {type(message).__name__}")
            raise _Down("protocol error")
        return reply

    @staticmethod
    def _shape_ok(reply: P.Message, n: int) -> bool:
        if isinstance(reply, P.Found):
            return len(reply.found) == n
        if isinstance(reply, P.Looked):
            return (len(reply.found) == len(reply.lease_ids) == len(reply.offsets) == len(reply.sizes)
                    == len(reply.checksums) == n)
        if isinstance(reply, P.Codes):
            return len(reply.codes) == n
        if isinstance(reply, P.Allocated):
            return len(reply.codes) == len(reply.handles) == len(reply.offsets) == n
        if isinstance(reply, P.Acquired):
            return (len(reply.codes) == len(reply.lease_ids) == len(reply.offsets) == len(reply.sizes)
                    == len(reply.data) == n)
        return True

    def _current(self, force: bool = False) -> _Link:
        link = self._link
        if link is not None and link.alive:
            return link
        if self._closed:
            raise _Down("client closed")
        if not force and time.monotonic() < self._retry_at:
            raise _Down(f"no kvpool server at {self.socket_path}")
        return self._reconnect()

    def _reconnect(self) -> _Link:
        with self._connect_lock:
            link = self._link
            if link is not None and link.alive:
                return link
            try:
                link = self._open()
            except _Untrusted as exc:
                self.untrusted += 1
                self._retry_at = time.monotonic() + self.retry_interval_s * 10
                self._report_down(exc)
                raise
            except (OSError, ValueError, P.FrameError, msgspec.DecodeError, _Down) as exc:
                # A refused/missing socket fails in microseconds, so retry soon; a hung server
                # cost us a timeout, so leave retries to the pinger for a while.
                slow = isinstance(exc, (TimeoutError, socket.timeout))
                self._retry_at = time.monotonic() + self.retry_interval_s * (10 if slow else 1)
                self._report_down(exc)
                raise _Down(str(exc)) from None
            if self._closed:
                link.sock.close()
                raise _Down("client closed")
            self._link = link
            self._reported_down = False
        logger.info("kvpool: connected to kvpool server %d at %s as %s (arena %s, %d bytes)",
                    link.hello.server_pid, self.socket_path, link.hello.client_id, link.hello.arena_name,
                    link.hello.arena_size)
        return link

    def _check_path(self) -> None:
        """Refuse a socket another user could have put there (see ``check_socket_dir``)."""
        try:
            where = check_socket_dir(self.socket_path, "server_socket", self.allowed_gid)
        except ConfigError as exc:
            raise _Untrusted(str(exc)) from None
        if not where.shared:
            return
        st = os.lstat(self.socket_path)  # FileNotFoundError: no server (yet)
        ours = st.st_uid == os.getuid() or (self.allowed_gid is not None and st.st_gid == self.allowed_gid)
        if not ours:
            raise _Untrusted(f"{self.socket_path} is owned by uid {st.st_uid} in a directory anyone can write; "
                             f"not connecting (use the default socket, or a directory only you can write)")

    def _open(self) -> _Link:
        self._check_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.socket_path)
            # The kernel's word on who listens, before a single byte of ours goes out.
            server = peers.peer_of(sock)
            if not peers.trusted(sock, server, self.allowed_gid):
                raise _Untrusted(f"the process listening on {self.socket_path} ({server.describe()}) is not "
                                 f"in this client's trust domain ({peers.domain(self.allowed_gid)}); not "
                                 f"connecting. Start `kvpool server` as this user, or set allowed_gid for "
                                 f"group sharing")
            P.send_frame(sock, P.Hello(self.name, os.getpid(), process=process_id()))
            body = P.recv_frame(sock, P.MAX_REPLY_FRAME)
            if body is None:
                raise ConnectionError("server closed the connection during the handshake")
            hello = P.reply_decoder.decode(body)
            if isinstance(hello, P.Error):
                raise _Down(f"server refused the handshake: {hello.message}")
            if not isinstance(hello, P.HelloReply):
                raise _Down(f"unexpected handshake reply {type(hello).__name__}")
            try:
                arena = shm.attach(hello.arena_name, hello.arena_size, server.uid, self.allowed_gid)
            except ValueError as exc:
                raise _Untrusted(str(exc)) from None
            sock.settimeout(self.timeout_s)
        except BaseException:
            sock.close()
            raise
        return _Link(sock, arena, hello, threading.Lock())

    def _drop(self, link: _Link, reason: object) -> None:
        link.alive = False
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.sock.close()
        link.arena.close()
        # Its lookup leases can never be used again, and each keeps the link and so its arena
        # mapped: after a server restart that pins the dead server's whole memory tier in /dev/shm.
        with self._held_lock:
            for key in [key for key, h in self._held.items() if h.link is link]:
                del self._held[key]
        if self._link is link:
            self._link = None
        if reason is not None:
            self._report_down(reason)

    def _report_down(self, reason: object) -> None:
        if not self._reported_down and not self._closed:
            self._reported_down = True
            # As text: an exception's traceback holds the dropped link, and a handler that keeps
            # records (pytest's, a buffering one) would keep its arena mapped with it.
            logger.warning("kvpool: no kvpool server at %s (%s); pool calls fail (misses) until one is "
                           "back; start it with `kvpool server --socket %s`",
                           self.socket_path, str(reason), self.socket_path)

    def _ping_loop(self) -> None:
        interval = self.retry_interval_s
        while not self._stop.wait(interval):
            link = self._link
            try:
                if link is not None and link.alive:
                    self._call_on(link, P.Ping(), P.Codes, 1)
                else:
                    link = self._reconnect()
            except _Down:
                pass
            except Exception:  # the pinger must outlive any surprise
                logger.exception("kvpool client pinger")
            link = self._link
            interval = link.hello.client_ttl_s / 3 if link is not None and link.alive else self.retry_interval_s
