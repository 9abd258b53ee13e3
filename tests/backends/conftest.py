"""Fixtures of the backend tests that start a store's own service."""

from __future__ import annotations

import pytest

from kvpool.testing.services import RedisService, ServiceError


@pytest.fixture
def redis_service(tmp_path):
    """A real `redis-server` on a free 127.0.0.1 port, stopped after the test."""
    try:
        svc = RedisService(tmp_path / "redis")
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield svc
    svc.stop()
