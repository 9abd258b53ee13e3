"""Test helpers for the pool engine: a hand-moved clock and key-derived payloads."""

from __future__ import annotations

import numpy as np


class FakeClock:
    """Monotonic clock the test moves by hand, so TTLs are exact and never flaky."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic, key-specific bytes, so a mixed-up or overwritten range is visible."""
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
