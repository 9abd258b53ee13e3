"""Fixtures for the pool-engine tests: a manual clock and engine/disk factories."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.store import DiskTier, EngineConfig, PoolEngine
from store_helpers import FakeClock


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
