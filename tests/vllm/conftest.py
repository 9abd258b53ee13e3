"""Fixtures for end-to-end tests on real vLLM: a small random model and engine processes.

Engines are what costs time here, so they are few and shared (harness.py forks each engine
from a process that imported vLLM once: ~2 s to start instead of ~12 s on 2 cores):
- `reference`: one vLLM engine with its own prefix cache and no connector, for the whole
  session. Every module asks it about its own prompts (random tokens from a seed of its own),
  so no module ever hits another's blocks: a module's first request for a prompt is cold, a
  repeat is a prefix-cache hit.
- each module starts the kvpool engines it needs once (module-scoped fixtures) and runs
  several tests on them, again each on prompts of its own.

Exactness rule (see README.md): logprobs are compared bit for bit only between two runs that
took the same tokens from a cache and computed the same tokens, in the same chunks (a pool hit
against a prefix-cache hit of the same length, a cold run against a cold run). Across
different splits only token ids are compared: a float sum in other chunks may round
differently on another CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import Engine, record_matrix

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Every test here starts vLLM: marked `vllm` even if a module forgets its pytestmark, so
    # `-m "not vllm"` (make test-fast) never starts an engine.
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)


def pytest_runtest_logreport(report):
    # Each test's outcome, for the model matrix (a no-op unless the run asked for one).
    if report.when == "call" or report.outcome != "passed":
        record_matrix({"outcome": report.outcome, "test": report.nodeid, "when": report.when})


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("model") / "tiny", SPECS["tiny"]))


@pytest.fixture(scope="session")
def bf16_model_dir(tmp_path_factory) -> str:
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("model") / "tiny-bf16", SPECS["tiny-bf16"]))


@pytest.fixture(scope="session")
def reference(model_dir):
    """vLLM alone (fp32 tiny model, prefix caching on, no connector), shared by every module."""
    with Engine(model_dir, prefix_caching=True) as e:
        yield e


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
