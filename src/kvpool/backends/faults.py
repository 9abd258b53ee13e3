"""A backend wrapper that fails chosen reads of a real backend: the test suite's way to
exercise vLLM's load-failure policies (`recompute`, `fail`) against real stored data."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from kvpool.backends.base import Backend, Buffers
from kvpool.errors import ErrorCode


class FaultInjectingBackend(Backend):
    """Delegates to `inner`, but every `every`-th key read returns OBJECT_NOT_FOUND untouched."""

    def __init__(self, inner: Backend, every: int) -> None:
        self.inner = inner
        self.every = every
        self.name = f"{inner.name}+faults"
        self.shared_across_processes = inner.shared_across_processes
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        return self.inner.batch_exists(keys, lease)

    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        return self.inner.batch_put(keys, values)

    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        with self._lock:
            fail = [next(self._counter) % self.every == 0 for _ in keys]
        codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(keys)
        ok_idx = [i for i, f in enumerate(fail) if not f]
        for i, c in zip(ok_idx, self.inner.batch_get_into([keys[i] for i in ok_idx], [values[i] for i in ok_idx])):
            codes[i] = c
        return codes

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
