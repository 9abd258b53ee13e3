"""The metrics catalog: the reference page is generated from it, the names follow Prometheus'
conventions, and the lists the exporters map from agree with it."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from kvpool.metrics import catalog
from kvpool.server import protocol as P
from kvpool.server.daemon import _OPS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAME = re.compile(r"^(vllm:)?[a-z][a-z0-9_]*$")
UNITS = ("_bytes", "_seconds")


def test_reference_page_is_the_catalog():
    assert DOCS.read_text() == catalog.reference_markdown(), (
        "docs/metrics.md is out of date: python -m kvpool.metrics.catalog > docs/metrics.md")


def test_names_follow_the_conventions():
    for s in catalog.ALL:
        assert NAME.match(s.name), s.name
        assert not s.name.endswith("_total"), f"{s.name}: counters are named without _total"
        assert s.help and s.help[0].isupper(), s.name
        assert s.component == "connector" or s.name.startswith("kvpool_"), s.name
        assert s.component != "connector" or s.name.startswith("vllm:kvpool_"), s.name
        if s.kind == "histogram":
            assert s.name.endswith("_seconds") and s.buckets == tuple(sorted(s.buckets)), s.name
        for label, values in s.values.items():
            assert label in s.labels and values and len(set(values)) == len(values), (s.name, label)
        if s.stats:
            assert s.component == "server" and all(len(v) == len(s.labels) for v in s.stats), s.name
    for component, series in catalog.COMPONENTS.items():
        names = [s.name for s in series]
        assert len(names) == len(set(names)), component


def test_server_ops_are_the_protocol_requests():
    assert set(_OPS) == set(typing.get_args(P.Request))
    assert sorted(_OPS.values()) == sorted(catalog.SERVER_OPS)
