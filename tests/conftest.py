"""Suite-wide rules: under CI=true nothing may be skipped, so no capability silently drops out."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Mooncake's native library segfaults while it loads into a process where openYuanrong's
# datasystem client was loaded first (both bundle native libraries that clash at load time). A
# serving process loads one backend's library; this test process loads both, in whichever order
# its tests run: Mooncake's first, always.
if importlib.util.find_spec("mooncake") is not None:
    import mooncake.store  # noqa: F401


@pytest.fixture
def redis_service(tmp_path):
    """A real `redis-server` on a free 127.0.0.1 port, stopped after the test."""
    from kvpool.testing.services import RedisService, ServiceError

    try:
        svc = RedisService(tmp_path / "redis")
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield svc
    svc.stop()


# Fixtures of tests/backends/ that start a store's own service (redis-server, mooncake_master,
# a Yuanrong worker): their tests are `services` tests, outside `make test-fast`.
SERVICE_FIXTURES = {"redis_service", "master", "worker"}


def pytest_collection_modifyitems(config, items):
    if not items and not config.getoption("markexpr"):
        raise pytest.UsageError("no tests were collected")
    for item in items:
        if "tests/backends/" in item.nodeid.replace("\\", "/") and SERVICE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.services)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        # A skip in CI means a dependency or service is missing: that is a failure here.
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which is not allowed: {report.longrepr}"
