"""The one background thread that moves blocks between vLLM's KV cache and the pool.

Loads and saves share it; loads jump the queue because a request is waiting on them, while a
save only has to finish before its blocks are freed. Per-request pending counts let the worker
say when a finished request's blocks may be freed (delayed free).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

LOAD, SAVE = 0, 1  # queue priorities: lower runs first


class TransferThread:
    """Runs submitted jobs in priority order and tracks which requests still have jobs pending."""

    def __init__(self, name: str = "kvpool-transfer") -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._pending: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, req_id: str, job: Callable[[], None]) -> None:
        with self._cond:
            self._pending[req_id] += 1
        self._queue.put((priority, next(self._seq), req_id, job))

    def _run(self) -> None:
        while True:
            _, _, req_id, job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this only keeps the thread alive
                logger.exception("kvpool transfer job for request %s failed", req_id)
            finally:
                with self._cond:
                    self._pending[req_id] -= 1
                    if self._pending[req_id] <= 0:
                        del self._pending[req_id]
                    self._cond.notify_all()

    def depth(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return sum(self._pending.values())

    def is_pending(self, req_id: str) -> bool:
        with self._cond:
            return req_id in self._pending

    def wait(self, req_ids: set[str] | None = None, timeout: float | None = None) -> bool:
        """Block until the given requests (or all) have no pending jobs; False on timeout."""
        def done() -> bool:
            return not self._pending if req_ids is None else not (req_ids & self._pending.keys())

        with self._cond:
            return self._cond.wait_for(done, timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued jobs (saves the pool was promised), then stop."""
        self.wait(timeout=timeout)
        self._queue.put((SAVE + 1, next(self._seq), "", None))
        self._thread.join(timeout=5)
