"""Daemon worker threads for calls that may block in the kernel (reads from a failing SSD).

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one
thread stuck in a read on a hung device keeps the whole process from exiting, whatever deadline
its owner gave up at. These threads are daemons: a process that has given up on the device
exits, and the stuck call goes with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_Job = tuple[Callable[[object], object], object, "Future[object]"]


class DaemonWorkers:
    """`size` daemon threads running the items of `map` side by side.

    Invariant: every item handed to `map` before `close` gets its result or its exception; items
    handed after `close` run on the caller's thread (no work is ever dropped silently).
    """

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # a job is queued before the threads' stop marks or not at all
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[fn(x) for x in items]`, computed on the workers; re-raises the exception of the first
        item (in order) that raised."""
        items = list(items)
        futures: list[Future[object]] = [Future() for _ in items]
        with self._lock:
            queued = not self._closed
            if queued:
                for x, fut in zip(items, futures):
                    self._jobs.put((fn, x, fut))  # type: ignore[arg-type]
        if not queued:
            return [fn(x) for x in items]
        return [f.result() for f in futures]  # type: ignore[misc]

    def close(self) -> None:
        """Let each thread exit once the jobs queued before this are done; returns at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, x, fut = job
            try:
                fut.set_result(fn(x))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of map
                fut.set_exception(exc)
