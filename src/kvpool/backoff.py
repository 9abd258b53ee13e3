"""The one rule for leaving a failing thing alone a while: a delay that doubles from `first_s`
up to `cap_s` while the failures continue, and starts over after a success. A store client's
reconnects (`backends.base.Reconnect`), the circuit breaker's cooldown (`backends.guard`) and the
scheduler's lookup channel (`vllm.lookup`) each keep one."""

from __future__ import annotations


class Backoff:
    """Not thread-safe: its owner calls it under its own lock."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self._next = first_s
        self.failing = False  # failures since the last `reset`

    def failed(self) -> float:
        """A failure: how long to wait before the next try (twice the last wait, up to the cap)."""
        delay, self._next = self._next, min(self._next * 2, self.cap_s)
        self.failing = True
        return delay

    def reset(self) -> None:
        """A success: the next failure waits the shortest delay again."""
        self._next, self.failing = self.first_s, False
