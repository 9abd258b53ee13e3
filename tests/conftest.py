"""Suite-wide rules: under CI=true nothing may be skipped, so no capability silently drops out."""

from __future__ import annotations

import os

import pytest


# Fixtures of tests/backends/ that start a store's own service (redis-server, mooncake_master,
# a Yuanrong worker): their tests are `services` tests, outside `make test-fast`.
SERVICE_FIXTURES = {"redis_service", "master", "worker"}
# Conformance parameters backed by a store's own service.
STORE_BACKENDS = ("mooncake", "yuanrong", "redis", "memcache")


def pytest_collection_modifyitems(config, items):
    if not items and not config.getoption("markexpr"):
        raise pytest.UsageError("no tests were collected")
    for item in items:
        path = item.nodeid.replace("\\", "/")
        if "tests/backends/" in path and SERVICE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.services)
        # Under pytest-xdist (`make test` runs two workers): every real-vLLM test on one worker,
        # in file order (they share one reference engine and one fork server, and two vLLM
        # suites at once would only fight for the cores); every test of a store's own service
        # on one worker (a session-wide Yuanrong worker, one Mooncake master at a time); the
        # rest spread over both.
        if path.startswith("tests/vllm/"):
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif path.startswith("tests/backends/") or (path.startswith("tests/conformance/")
                                                     and any(f"[{b}" in path for b in STORE_BACKENDS)):
            item.add_marker(pytest.mark.xdist_group("stores"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        # A skip in CI means a dependency or service is missing: that is a failure here.
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which is not allowed: {report.longrepr}"
