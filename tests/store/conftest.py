"""Fixtures for the pool-engine tests: a manual clock and engine/disk factories."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.store import DiskTier, EngineConfig, PoolEngine


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


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ssd_dir(tmp_path) -> str:
    # Resolved so a symlinked /tmp on some hosts does not trip the no-symlink rule.
    path = os.path.realpath(tmp_path / "ssd")
    os.mkdir(path)
    return path


@pytest.fixture
def make_engine(clock: FakeClock) -> Iterator[Callable[..., PoolEngine]]:
    engines: list[PoolEngine] = []

    def factory(memory_size: int = 1024, **kwargs) -> PoolEngine:
        kwargs.setdefault("reap_interval_s", 0)
        engine = PoolEngine(EngineConfig(memory_size=memory_size, **kwargs), clock=clock)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


@pytest.fixture
def make_disk(ssd_dir: str) -> Callable[..., DiskTier]:
    def factory(quota_bytes: int = 1 << 20, policy: str = "none") -> DiskTier:
        return DiskTier(ssd_dir, quota_bytes, policy)  # type: ignore[arg-type]

    return factory
