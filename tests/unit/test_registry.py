"""The backend registry is the one list of backends: everything else derives from it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvpool.backends.base import Backend
from kvpool.backends.registry import REGISTRY, _resolve, capability_table, create_backend
from kvpool.config import BACKENDS, backend_schemas, load_config

REPO = Path(__file__).resolve().parents[2]


def test_registry_and_config_name_the_same_backends():
    assert list(REGISTRY) == list(BACKENDS) == list(backend_schemas())
    for name, spec in REGISTRY.items():
        assert spec.name == name and spec.schema.backend == name


@pytest.mark.parametrize("name", list(REGISTRY))
def test_factory_and_doctor_check_resolve(name):
    factory = _resolve(REGISTRY[name].factory)
    assert callable(factory)
    target = factory.__self__ if inspect.ismethod(factory) else factory
    assert issubclass(target, Backend), f"{name}'s factory does not build a Backend"
    check = _resolve(REGISTRY[name].doctor)
    assert list(inspect.signature(check).parameters) == ["cfg", "args", "report"]


def test_create_backend_builds_the_chosen_backend_from_its_own_settings(tmp_path):
    backend = create_backend(load_config({"backend": "local", "local_cpu_size": "8MB"}), "registry-test")
    try:
        assert backend.name == "local"
        assert backend.engine.capacity == 8 << 20
    finally:
        backend.close()


def test_docs_capability_table_is_the_registry():
    doc = (REPO / "docs" / "backends.md").read_text()
    start, end = "<!-- capability-table -->\n", "\n<!-- /capability-table -->"
    assert doc[doc.index(start) + len(start):doc.index(end)] == capability_table(), (
        "docs/backends.md's capability table is stale: paste kvpool.backends.registry.capability_table()")


def test_every_backend_has_a_docs_section():
    doc = (REPO / "docs" / "backends.md").read_text() + (REPO / "docs" / "configuration.md").read_text()
    for name in REGISTRY:
        assert f"`{name}`" in doc, f"backend {name} is not documented"
