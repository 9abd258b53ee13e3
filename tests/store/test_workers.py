"""DaemonWorkers: the engine's disk readers, which must never keep a process from exiting."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from kvpool.store.workers import DaemonWorkers


def test_map_keeps_order_and_raises_the_items_exception() -> None:
    workers = DaemonWorkers(3, "t")
    seen: set[str] = set()

    def f(x: int) -> int:
        seen.add(threading.current_thread().name)
        if x == 5:
            raise ValueError("five")
        return x * x

    assert workers.map(f, range(5)) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="five"):
        workers.map(f, range(8))
    assert seen <= {"t-0", "t-1", "t-2"}
    workers.close()
    assert workers.map(f, [2]) == [4]  # after close: on the caller's thread, never dropped


def test_a_stuck_worker_does_not_keep_the_process_from_exiting() -> None:
    # A ThreadPoolExecutor's threads are joined at interpreter exit: one stuck in the kernel on a
    # hung SSD would keep the process alive forever.
    code = (
        "import threading, time\n"
        "from kvpool.store.workers import DaemonWorkers\n"
        "w = DaemonWorkers(2, 'r')\n"
        "threading.Thread(target=w.map, args=(lambda x: time.sleep(3600), [1]), daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "w.close()\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
