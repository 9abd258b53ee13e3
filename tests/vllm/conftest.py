"""Fixtures for end-to-end tests on real vLLM: a small random model and engine processes."""

from __future__ import annotations

import pytest

from harness import Engine


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("model") / "tiny", SPECS["tiny"]))


@pytest.fixture(scope="session")
def bf16_model_dir(tmp_path_factory) -> str:
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("model") / "tiny-bf16", SPECS["tiny-bf16"]))


@pytest.fixture
def engine_factory():
    engines: list[Engine] = []

    def make(*args, **kwargs) -> Engine:
        e = Engine(*args, **kwargs)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()
