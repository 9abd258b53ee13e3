"""`backends.guard`: deadlines and the circuit breaker, on an adapter whose store can be frozen
at any point of a call (before it answers, or while it copies); tests/server/test_frozen_server.py
freezes a real `kvpool server`. Outcomes are asserted (codes, the buffers' bytes, counters, whether the
store was asked), never durations."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool.backends.base import Backend
from kvpool.backends.guard import CLOSED, OPEN, Guard, GuardSettings
from kvpool.errors import NOT_FOUND, OK, RPC_FAIL, RPC_TIMEOUT
from kvpool.testing.proc import wait_for

# Short deadlines: every test that waits for one waits a fraction of a second.
FAST = GuardSettings(lookup_timeout_s=0.05, transfer_timeout_s=0.1, failures=3, cooldown_s=0.05,
                     cooldown_max_s=0.2)


class Freezable(Backend):
    """A dict store whose calls can be held at two points: `answer` (before the store replies:
    a frozen master) and `copying` (while bytes move into or out of the caller's buffers)."""

    name = "freezable"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {"k": bytes(range(256)) * 4}
        self.answer = threading.Event()
        self.answer.set()
        self.copying = threading.Event()
        self.copying.set()
        self.asked = 0
        self.fail = False
        self.copied_after_abandon = 0
        self.finished = threading.Event()

    def _store(self) -> None:
        self.asked += 1
        self.answer.wait()
        if self.fail:
            raise ConnectionError("store said no")

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        self._store()
        return [k in self.data for k in keys]

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self._store()
        codes = []
        with self._buffers() as admitted:
            for k, v in zip(keys, values):
                if not admitted:
                    codes.append(RPC_TIMEOUT)
                    continue
                self.copying.wait()
                self.data[k] = b"".join(x.tobytes() for x in v)
                codes.append(OK)
        self.finished.set()
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self._store()
        codes = []
        with self._buffers() as admitted:
            for k, v in zip(keys, values):
                if k not in self.data:
                    codes.append(NOT_FOUND)
                    continue
                if not admitted:
                    codes.append(RPC_TIMEOUT)
                    continue
                src = np.frombuffer(self.data[k], dtype=np.uint8)
                half = src.size // 2
                v[0][:half] = src[:half]
                self.copying.wait()  # frozen halfway through the copy
                v[0][half:] = src[half:]
                codes.append(OK)
        self.finished.set()
        return codes


@pytest.fixture
def store():
    b = Freezable()
    b.use_guard(FAST)
    yield b
    b.answer.set()
    b.copying.set()
    b.close()


def test_frozen_lookup_is_a_miss_and_opens_the_breaker(store):
    store.answer.clear()  # the store stops answering
    assert store.batch_exists(["k"]) == [False]
    assert not store.answer.is_set()  # answered while the store was still frozen: the deadline did it
    s = store.stats()
    assert s["timeouts"] == 1 and s["breaker_opened"] == 1
    asked = store.asked
    # Open: nothing more is sent; lookups miss, loads fail fast, saves are dropped.
    assert store.batch_exists(["k"]) == [False]
    assert store.batch_get_into(["k"], [[np.zeros(1024, np.uint8)]]) == [RPC_FAIL]
    assert store.batch_put(["n"], [[np.ones(8, np.uint8)]]) == [RPC_FAIL]
    assert store.asked == asked
    assert store.stats()["breaker_rejected"] >= 3


def test_breaker_closes_by_itself_once_the_store_answers(store):
    store.answer.clear()
    assert store.batch_exists(["k"]) == [False]
    guard = store._state.guard
    assert guard.state == OPEN
    store.answer.set()  # the store thaws
    # Callers are answered at once while open; a probe on the guard's own thread closes it.
    assert wait_for(lambda: store.batch_exists(["k"]) == [True], 10)
    assert guard.state == CLOSED and store.stats()["probes"] >= 1


def test_probes_back_off_while_the_store_stays_frozen():
    clock = [0.0]
    calls = []

    def probe():
        calls.append(clock[0])
        raise ConnectionError("still down")

    g = Guard("t", FAST, probe, clock=lambda: clock[0])
    g.failed("x"), g.failed("x"), g.failed("x")
    assert g.state == OPEN
    for _ in range(40):
        clock[0] += 0.01
        g.allows()
        wait_for(lambda: not g._probing, 10)
    # cooldowns 0.05, 0.1, 0.2, 0.2 ...: far fewer probes than calls
    assert 2 <= len(calls) <= 4
    g.close()


def test_a_hung_probe_is_a_probe_not_a_callers_timeout():
    # Nobody waits for a probe: however long a store stays frozen, `timeouts` counts only the
    # callers that waited out a deadline (the engine's stalls), not the breaker's background probes.
    release = threading.Event()
    g = Guard("t", FAST, lambda: release.wait(10))
    g.failed("x"), g.failed("x"), g.failed("x")
    time.sleep(FAST.cooldown_s * 2)
    assert g.allows() is False  # the cooldown is over: a probe starts, the caller is answered at once
    wait_for(lambda: g.counters["probes"] == 1 and not g._probing, 10)
    assert g.state == OPEN and g.counters["timeouts"] == 0
    release.set()
    g.close()


def test_a_timed_out_get_never_writes_the_callers_buffer_later(store):
    store.answer.clear()
    dest = np.zeros(1024, np.uint8)
    assert store.batch_get_into(["k"], [[dest]]) == [RPC_TIMEOUT]
    store.finished.clear()
    store.answer.set()  # the store answers after the caller gave up
    assert store.finished.wait(10)
    assert not dest.any()  # vLLM may have reused this block: not one byte landed in it


def test_a_timed_out_put_never_reads_the_callers_buffer_later(store):
    store.answer.clear()
    src = np.full(64, 7, np.uint8)
    assert store.batch_put(["new"], [[src]]) == [RPC_TIMEOUT]
    store.finished.clear()
    store.answer.set()
    assert store.finished.wait(10)
    assert "new" not in store.data  # nothing was read from a block vLLM may have refilled


def test_a_copy_under_way_is_let_finish_past_the_deadline(store):
    store.copying.clear()  # the store freezes halfway through copying into our buffer
    dest = np.zeros(1024, np.uint8)
    out: list = []
    t = threading.Thread(target=lambda: out.append(store.batch_get_into(["k"], [[dest]])))
    t.start()
    time.sleep(0.3)  # well past the 0.1 s deadline
    assert not out  # the caller still waits: its buffer is being written
    store.copying.set()
    t.join(10)
    assert out == [[OK]] and dest.tobytes() == store.data["k"]


def test_failures_in_a_row_open_the_breaker(store):
    store.fail = True
    for _ in range(3):
        assert store.batch_exists(["k"]) == [False]
    assert store._state.guard.state == OPEN
    asked = store.asked
    assert store.batch_exists(["k"]) == [False] and store.asked == asked


def test_success_resets_the_run_of_failures(store):
    for _ in range(5):
        store.fail = True
        store.batch_exists(["k"])
        store.batch_exists(["k"])
        store.fail = False
        assert store.batch_exists(["k"]) == [True]
    assert store._state.guard.state == CLOSED


def test_local_has_no_guard():
    from kvpool.backends.registry import REGISTRY

    assert not REGISTRY["local"].capabilities.remote
    assert all(spec.capabilities.remote for name, spec in REGISTRY.items() if name != "local")


# ---- work handed back to the caller's thread ------------------------------------------------------


def test_on_caller_runs_on_the_waiting_callers_thread_inside_buffers():
    g = Guard("t", FAST, lambda: None)
    ran: list[int] = []

    def call() -> int:
        with g.buffers() as admitted:
            assert admitted
            return g.on_caller(lambda: (ran.append(threading.get_ident()), 41)[1]) + 1

    try:
        assert g.call(call, 5) == 42
        assert ran == [threading.get_ident()]  # this test's thread, not the guard's
        # Outside `buffers()` and outside any call, the function runs where it was called.
        assert g.call(lambda: g.on_caller(threading.get_ident), 5) != threading.get_ident()
        assert g.on_caller(threading.get_ident) == threading.get_ident()
    finally:
        g.close()


def test_on_caller_hands_an_exception_back_to_the_call():
    g = Guard("t", FAST, lambda: None)

    def boom() -> None:
        raise KeyError("from the caller's thread")

    def call() -> str:
        with g.buffers():
            try:
                g.on_caller(boom)
            except KeyError as exc:
                return f"caught {exc.args[0]}"
        return "not raised"

    try:
        assert g.call(call, 5) == "caught from the caller's thread"
    finally:
        g.close()


def test_a_handed_job_past_the_deadline_still_runs_and_is_waited_for():
    # The job is the copy into the caller's buffers: once it started, the caller may not leave.
    g = Guard("t", FAST, lambda: None)
    go = threading.Event()
    dest = np.zeros(16, np.uint8)

    def job() -> None:
        go.wait(10)
        dest[:] = 9

    def call() -> str:
        with g.buffers():
            g.on_caller(job)
        return "done"

    out: list = []
    t = threading.Thread(target=lambda: out.append(g.call(call, FAST.transfer_timeout_s)))
    t.start()
    time.sleep(0.3)  # well past the deadline
    assert not out
    go.set()
    t.join(10)
    assert out == ["done"] and (dest == 9).all()
    g.close()


def test_a_guarded_backends_copies_run_on_the_callers_thread(monkeypatch):
    """Through the backend: a guarded get's `CopyEngine` batch starts on the thread that called
    the backend (vLLM's main thread, with its OpenMP team), not on the guard's."""
    from kvpool.store import streamcopy

    asked_from: list[int] = []
    monkeypatch.setattr(streamcopy, "team_threads",
                        lambda hashed=False: (asked_from.append(threading.get_ident()), 0)[1])

    class Copying(Freezable):
        def _get_into(self, keys, values):
            self._store()
            with self._buffers() as admitted:
                assert admitted
                src = np.frombuffer(self.data[keys[0]], dtype=np.uint8)
                return [OK if e is None else RPC_FAIL for e in self._copies.scatter_all([(src, values[0])])]

    b = Copying()
    b.data["big"] = bytes(range(256)) * (8 << 10)  # 2 MiB: worth a second thread
    b.use_guard(FAST)
    b.use_copy_threads(2)
    try:
        dest = np.zeros(2 << 20, np.uint8)
        assert b.batch_get_into(["big"], [[dest]]) == [OK]
        assert dest.tobytes() == b.data["big"]
        assert asked_from == [threading.get_ident()]
    finally:
        b.close()


# ---- found by the fault audit -------------------------------------------------------------------


class _LateWake(threading.Condition):
    """The guard's work condition, whose woken thread takes `delay` to get the lock back (a busy
    host): `woken` is set when a notified worker starts reacquiring it."""

    def __init__(self, lock: threading.Lock, delay: float) -> None:
        super().__init__(lock)
        self.delay = delay
        self.armed = False
        self.woken = threading.Event()

    def _acquire_restore(self, state: object) -> None:  # called by wait() to take the lock back
        if self.armed:
            self.armed = False
            self.woken.set()
            time.sleep(self.delay)
        super()._acquire_restore(state)  # type: ignore[misc]


def test_a_call_is_never_queued_behind_another_for_an_idle_thread_that_wakes_late():
    # A worker notified for call A but not yet awake still counted as idle, so call B, a moment
    # later, only "notified" it too and waited in the queue behind A (a 5 s save): B's lookup
    # deadline passed with free threads to spare, and the breaker opened on a healthy store.
    g = Guard("t", GuardSettings(lookup_timeout_s=1.0, transfer_timeout_s=5.0, cooldown_s=60), lambda: None)
    g._work = late = _LateWake(g._lock, delay=0.05)
    release = threading.Event()
    try:
        assert g.call(lambda: "warm", 5) == "warm"  # one guard thread, now idle
        assert wait_for(lambda: g._idle == 1, 10)
        late.armed = True
        slow = threading.Thread(target=lambda: g.call(lambda: release.wait(10), 5.0))
        slow.start()  # A: a long save wakes the idle thread, which takes a while to get going
        assert late.woken.wait(10)
        assert g.call(lambda: "hit", 1.0) == "hit"  # B: a lookup, not queued behind A
        assert g.state == CLOSED and g.counters["timeouts"] == 0
    finally:
        release.set()
        g.close()


class _SlowReconnect(Freezable):
    """A store that went away: reconnecting (a port probe, a client's init) hangs until `reachable`."""

    def __init__(self) -> None:
        super().__init__()
        self.reachable = threading.Event()
        self.connect_threads: list[int] = []

    def _connect(self) -> bool:
        self.connect_threads.append(threading.get_ident())
        return self.reachable.wait(10)


def test_reconnecting_runs_under_the_deadline_not_on_the_callers_time():
    # The reconnect after a store's outage (Yuanrong's probe and KVClient init: up to
    # connect_timeout_ms, 9 s) ran on the caller's thread, before the deadline and the breaker
    # were consulted: a lookup or a load stalled for as long as connecting took.
    b = _SlowReconnect()
    b.use_guard(FAST)
    b._link._up = False  # the store went away; the backoff is over, the next call reconnects
    out: list = []
    t = threading.Thread(target=lambda: out.append(b.batch_exists(["k"])))
    try:
        t.start()
        t.join(5)
        assert out == [[False]]  # a miss at the deadline, while connecting still hangs
        assert b.connect_threads and threading.get_ident() not in b.connect_threads
        assert t.ident not in b.connect_threads
        # The breaker's probe reconnects too (no user call goes through while it is open).
        b.reachable.set()
        assert wait_for(lambda: b.batch_exists(["k"]) == [True], 10)
        assert b._state.guard.state == CLOSED and b._link.up
    finally:
        b.reachable.set()
        t.join(10)
        b.close()


def test_a_fault_injecting_wrapper_reports_the_stores_guard(store):
    # The worker reads `guard_stats()` for vLLM's store_timeouts / store_calls_skipped: the
    # wrapper (inject_load_failure_every) has no guard of its own and reported zeros.
    from kvpool.backends.faults import FaultInjectingBackend

    wrapped = FaultInjectingBackend(store, every=2)
    store.answer.clear()
    assert wrapped.batch_exists(["k"]) == [False]
    assert wrapped.guard_stats()["timeouts"] == 1 and wrapped.guard_stats()["breaker_opened"] == 1
