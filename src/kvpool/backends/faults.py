"""A backend wrapper that fails chosen reads of a real backend: the test suite's way to
exercise vLLM's load-failure policies (`recompute`, `fail`) against real stored data."""

from __future__ import annotations

import itertools
import threading

import numpy as np

from kvpool.backends.base import Backend
from kvpool.backends.registry import Capabilities
from kvpool.errors import ErrorCode


class FaultInjectingBackend(Backend):
    """Delegates to `inner`, but every `every`-th key read fails: OBJECT_NOT_FOUND, with the
    destination filled with 0xFF bytes (NaN in every float format), as a copy that failed its
    checksum leaves it. Whatever vLLM does with a failed block, it must never use its bytes."""

    def __init__(self, inner: Backend, every: int) -> None:
        self.inner = inner
        self.every = every
        self.name = f"{inner.name}+faults"
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return self.inner.batch_exists(keys, lease)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return self.inner.batch_put(keys, values)

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        with self._lock:
            fail = [next(self._counter) % self.every == 0 for _ in keys]
        codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(keys)
        for i, f in enumerate(fail):
            if f:
                for buf in values[i]:
                    buf.view(np.uint8).fill(0xFF)
        ok_idx = [i for i, f in enumerate(fail) if not f]
        if ok_idx:
            for i, c in zip(ok_idx, self.inner.batch_get_into([keys[i] for i in ok_idx], [values[i] for i in ok_idx])):
                codes[i] = c
        return codes

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def stats(self) -> dict[str, float]:
        """The wrapped backend's numbers (what the store saw, not the injected misses)."""
        return self.inner.stats()

    def guard_stats(self) -> dict[str, int]:
        """The wrapped backend's deadline and breaker counters: the wrapper has no guard."""
        return self.inner.guard_stats()

    def tier_stats(self) -> dict[str, int]:
        return self.inner.tier_stats()

    def _close(self) -> None:
        self.inner.close()
