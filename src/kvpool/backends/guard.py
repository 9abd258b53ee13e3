"""Deadlines and a circuit breaker for every call into a store that lives outside this process.

A store that is slow or frozen (a SIGSTOPped master, a black-holed port) must cost vLLM at
most one deadline, once, and never a wrong byte. `Guard` runs each call on a small pool of
threads and waits at most the call's deadline for it; a call that misses it is abandoned (its
keys answer RPC_TIMEOUT, a lookup answers "miss") and opens the breaker. While the breaker is
open nothing is sent to the store: lookups miss, loads fail fast (vLLM recomputes), saves are
dropped. A probe on the guard's own thread, never a user's request, checks the store after a
cooldown that doubles while probes keep failing; the first probe that answers closes the
breaker. Repeated fast failures (`failures` in a row) open it too.

Invariant that makes abandoning safe: a call may touch the caller's buffers (vLLM's KV cache:
reading it for a put, writing it for a get) only inside `Guard.buffers()`, which admits it only
if its caller still waits, and the caller, at the deadline, waits for a call already inside to
leave. So once a caller has its answer, no abandoned call reads or writes its buffers again:
vLLM may reuse those blocks at once. The part of a call inside `buffers()` is a copy (local
memory or the store's data plane) and is bounded by the copy, not by the deadline. Because the
caller waits for that part, a call may hand it to the caller's own thread (`on_caller`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvpool.backoff import Backoff

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a guard counts (a backend's `stats` reports them): calls that missed their deadline,
# times the breaker opened, calls answered at once because it was open, probes sent.
GUARD_COUNTERS = ("timeouts", "breaker_opened", "breaker_rejected", "probes")

# The breaker's states.
CLOSED, OPEN = "closed", "open"

# A call's states, as its caller and the thread running it agree on them (`_Call`).
_WAITING, _INSIDE, _ABANDONED = range(3)


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    """How long a call may take and how the breaker reacts (the connector's config keys)."""

    lookup_timeout_s: float = 0.3
    transfer_timeout_s: float = 5.0
    failures: int = 3  # consecutive failed calls that open the breaker (a timeout opens it at once)
    cooldown_s: float = 1.0  # first wait before a probe; doubles while probes fail
    cooldown_max_s: float = 30.0
    threads: int = 8  # calls in flight at once, abandoned ones included


class Timeout(Exception):
    """The call missed its deadline, or the breaker is open (`reason` says which)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Call:
    """One call's handshake between its caller and the thread running it."""

    __slots__ = ("cond", "state", "result", "error", "finished", "job", "job_out")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.state = _WAITING
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.job: Callable[[], Any] | None = None  # handed to the caller by `Guard.on_caller`
        self.job_out: tuple[Any, BaseException | None] | None = None  # its result, or its error

    def run_job(self) -> None:
        """The caller runs the job it was handed (with `cond` held on entry and exit)."""
        job, self.job = self.job, None
        assert job is not None
        self.cond.release()  # the job may take milliseconds: the other side only waits for it
        try:
            out: tuple[Any, BaseException | None] = (job(), None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the thread that asked
            out = (None, exc)
        finally:
            self.cond.acquire()
        self.job_out = out
        self.cond.notify_all()


class Guard:
    """Runs a backend's store calls under deadlines, behind a circuit breaker."""

    def __init__(self, name: str, settings: GuardSettings, probe: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.settings = settings
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: list[tuple[_Call, Callable[[], Any]]] = []
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._busy = 0  # calls running now, abandoned ones included
        self._closed = False
        self._state = CLOSED
        self._in_a_row = 0
        self._cooldown = Backoff(settings.cooldown_s, settings.cooldown_max_s)
        self._reopen_at = 0.0
        self._probing = False
        self._local = threading.local()
        self.counters = dict.fromkeys(GUARD_COUNTERS, 0)

    # ---- the caller's side -------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    def allows(self) -> bool:
        """Whether a call may go to the store now (the breaker is closed). Starts a probe when
        an open breaker's cooldown is over; the caller is answered at once either way."""
        if self._state == CLOSED:
            return True
        with self._lock:
            self.counters["breaker_rejected"] += 1
            if not self._probing and not self._closed and self._clock() >= self._reopen_at:
                self._probing = True
                threading.Thread(target=self._run_probe, name=f"kvpool-{self.name}-probe", daemon=True).start()
        return False

    def call(self, fn: Callable[[], T], timeout_s: float, *, _probe: bool = False) -> T:
        """`fn()` on a guard thread; its result, its exception, or `Timeout` after `timeout_s`.

        `timeouts` counts the callers that waited out a deadline; the breaker's own probes (run
        in the background, nobody waits for them) are counted as `probes` only.

        A call that raises a store error counts towards opening the breaker; use `succeeded`
        and `failed` for answers that are failures without an exception.
        """
        c = _Call()
        with self._lock:
            if self._closed:
                raise Timeout("backend closed")
            if self._busy >= self.settings.threads:
                # Every thread is held by calls the store has not answered: it is not answering.
                self._open_locked("every call thread is waiting on the store")
                raise Timeout("no free call thread")
            self._queue.append((c, fn))
            self._busy += 1
            # A worker counts as idle until it has the lock back and took a call, notified or
            # not: notify only while every queued call has an idle worker of its own. Otherwise
            # this call would wait behind another one (a long save, a hung store) with threads to
            # spare, and miss its deadline on a healthy store.
            if self._idle >= len(self._queue):
                self._work.notify()
            else:
                t = threading.Thread(target=self._worker, name=f"kvpool-{self.name}-call", daemon=True)
                self._threads.append(t)
                t.start()
        deadline = self._clock() + timeout_s
        with c.cond:
            while not c.finished:
                if c.job is not None:
                    c.run_job()
                    continue
                left = deadline - self._clock()
                if left <= 0:
                    if c.state == _INSIDE:
                        c.cond.wait()  # it is moving bytes of ours: let it leave them first
                        continue
                    c.state = _ABANDONED
                    break
                c.cond.wait(left)
            finished, error, result = c.finished, c.error, c.result
        if not finished:
            self._timed_out(timeout_s, count=not _probe)
            raise Timeout(f"no answer within {timeout_s:g} s")
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def succeeded(self) -> None:
        """The store answered a call: the run of failures ends."""
        if self._in_a_row:
            with self._lock:
                self._in_a_row = 0

    def failed(self, why: str) -> None:
        """A call failed (an exception, or every key answered RPC_FAIL)."""
        with self._lock:
            self._in_a_row += 1
            if self._in_a_row >= self.settings.failures:
                self._open_locked(f"{self._in_a_row} calls in a row failed ({why})")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._work.notify_all()

    # ---- the running call's side ------------------------------------------------------------

    @contextmanager
    def buffers(self) -> Iterator[bool]:
        """Enter before touching the caller's buffers; yields False if the caller stopped
        waiting (then the buffers must not be touched). May be entered again (e.g. once per
        key); outside a guarded call: always True."""
        c: _Call | None = getattr(self._local, "call", None)
        if c is None:
            yield True
            return
        with c.cond:
            admitted = c.state == _WAITING
            if admitted:
                c.state = _INSIDE
        try:
            yield admitted
        finally:
            if admitted:
                with c.cond:
                    c.state = _WAITING
                    c.cond.notify_all()

    def on_caller(self, fn: Callable[[], T]) -> T:
        """`fn()` on the thread that made the running call, which waits for it; its result, or
        its exception raised here. For work that belongs on the caller's thread: in vLLM's CPU
        worker a load's copy runs on the main thread's OpenMP team (`streamcopy`), which a
        guard thread does not have. Only inside an admitted `buffers()` (the caller then waits
        for the call, deadline or not, so it is there to run `fn`); elsewhere, and outside a
        guarded call, `fn()` runs on this thread."""
        c: _Call | None = getattr(self._local, "call", None)
        if c is None:
            return fn()
        with c.cond:
            if c.state != _INSIDE:
                handed = False
            else:
                handed = True
                c.job, c.job_out = fn, None
                c.cond.notify_all()
                while c.job_out is None:
                    c.cond.wait()
                result, error = c.job_out
                c.job_out = None
        if not handed:
            return fn()
        if error is not None:
            raise error
        return result  # type: ignore[no-any-return]

    # ---- internals --------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._work.wait()
                    self._idle -= 1
                if not self._queue:
                    return
                c, fn = self._queue.pop(0)
            if c.state == _ABANDONED:  # its caller gave up before it started
                result, error = None, None
            else:
                self._local.call = c
                result, error = None, None
                try:
                    result = fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    error = exc
                finally:
                    self._local.call = None
            with c.cond:
                if c.state != _ABANDONED:
                    c.result, c.error, c.finished = result, error, True
                    c.cond.notify_all()
            with self._lock:
                self._busy -= 1

    def _timed_out(self, timeout_s: float, count: bool = True) -> None:
        with self._lock:
            self.counters["timeouts"] += count
            self._open_locked(f"a call got no answer within {timeout_s:g} s")

    def _open_locked(self, why: str) -> None:
        now = self._clock()
        if self._state == OPEN:
            return
        self._state = OPEN
        cooldown = self._cooldown.failed()
        self._reopen_at = now + cooldown
        self.counters["breaker_opened"] += 1
        logger.warning("kvpool %s: %s; not asking the store for %.1f s (lookups miss, loads recompute, "
                       "saves are dropped), then probing it", self.name, why, cooldown)

    def _run_probe(self) -> None:
        self.counters["probes"] += 1
        ok = False
        try:
            self.call(self._probe, self.settings.lookup_timeout_s, _probe=True)
            ok = True
        except Exception as exc:  # noqa: BLE001 - a probe's failure only keeps the breaker open
            logger.debug("kvpool %s: probe failed: %s", self.name, exc)
        with self._lock:
            self._probing = False
            if ok:
                self._state, self._in_a_row = CLOSED, 0
                self._cooldown.reset()
                logger.warning("kvpool %s: the store answers again; using it", self.name)
            else:
                self._reopen_at = self._clock() + self._cooldown.failed()
