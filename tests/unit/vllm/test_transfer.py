"""TransferThread: loads before queued saves, per-request pending counts, bounded waits, draining close.

Every test holds the thread on a gate job, so what is queued behind it is known exactly; no
test depends on how fast the thread runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from kvpool.vllm.transfer import LOAD, SAVE, TransferThread


@pytest.fixture
def transfer() -> Iterator[TransferThread]:
    t = TransferThread()
    yield t
    t.close(timeout=5)


def gate_job(started: threading.Event, gate: threading.Event) -> Callable[[], None]:
    def job() -> None:
        started.set()
        assert gate.wait(10), "test never opened the gate"
    return job


def block(transfer: TransferThread, req_id: str = "gate") -> threading.Event:
    """Occupy the thread with one job until the returned event is set."""
    started, gate = threading.Event(), threading.Event()
    transfer.submit(SAVE, req_id, gate_job(started, gate))
    assert started.wait(10)
    return gate


def test_loads_run_before_queued_saves_and_each_kind_in_order(transfer):
    ran: list[str] = []
    gate = block(transfer)
    for name, prio in [("save1", SAVE), ("load1", LOAD), ("save2", SAVE), ("load2", LOAD)]:
        transfer.submit(prio, name, lambda n=name: ran.append(n))
    gate.set()
    assert transfer.wait(timeout=10)
    assert ran == ["load1", "load2", "save1", "save2"]


def test_pending_is_tracked_per_request(transfer):
    ran: list[str] = []
    gate = block(transfer)
    transfer.submit(SAVE, "a", lambda: ran.append("a1"))
    transfer.submit(SAVE, "a", lambda: ran.append("a2"))
    transfer.submit(SAVE, "b", lambda: ran.append("b"))
    assert transfer.is_pending("a") and transfer.is_pending("b") and transfer.is_pending("gate")
    assert not transfer.is_pending("c")
    gate.set()
    assert transfer.wait({"a"}, timeout=10)
    assert ran[:2] == ["a1", "a2"]  # both of a's jobs, not just the first
    assert not transfer.is_pending("a")


def test_wait_times_out_only_on_the_requests_it_waits_for(transfer):
    gate = block(transfer, "a")
    assert transfer.wait({"a"}, timeout=0.05) is False
    assert transfer.wait(timeout=0.05) is False
    assert transfer.wait({"b"}, timeout=0.05) is True  # nothing pending for b
    assert transfer.wait(set(), timeout=0.05) is True
    gate.set()
    assert transfer.wait({"a"}, timeout=10) is True
    assert transfer.wait(timeout=10) is True


def test_a_failing_job_neither_kills_the_thread_nor_stays_pending(transfer):
    def boom() -> None:
        raise RuntimeError("store exploded")

    transfer.submit(LOAD, "a", boom)
    assert transfer.wait({"a"}, timeout=10)
    assert not transfer.is_pending("a")
    ran = threading.Event()
    transfer.submit(SAVE, "b", ran.set)
    assert transfer.wait({"b"}, timeout=10) and ran.is_set()


def test_close_runs_every_queued_job_then_stops():
    transfer = TransferThread()
    ran: list[str] = []
    gate = block(transfer)
    for i in range(3):
        transfer.submit(SAVE, f"r{i}", lambda i=i: ran.append(f"r{i}"))
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (transfer.close(timeout=10), closed.set()))
    closer.start()
    # The gate job still runs, so close cannot have finished; one that dropped the queue would have.
    assert not closed.wait(0.1)
    gate.set()
    closer.join(10)
    assert closed.is_set()
    assert ran == ["r0", "r1", "r2"]
    assert not transfer._thread.is_alive()
