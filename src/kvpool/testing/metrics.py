"""Checking a live scrape against the metrics catalog (the tests of all three components use it)."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvpool.metrics.catalog import Series, exposed_labels


def families(text: str) -> dict[str, tuple[str, list[Sample]]]:
    """Family name -> (type, samples) of a Prometheus text exposition."""
    return {f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(text)}


def scrape_problems(text: str, series: Sequence[Series]) -> list[str]:
    """What in ``text`` disagrees with ``series``: a family missing, of another type, with other
    labels, or without samples although all its label values are known in advance."""
    found = families(text)
    problems = []
    for s in series:
        if s.name not in found:
            problems.append(f"{s.exposed}: missing")
            continue
        kind, samples = found[s.name]
        if kind != s.kind:
            problems.append(f"{s.exposed}: type {kind}, the catalog says {s.kind}")
        want = set(exposed_labels(s))
        for sample in samples:
            got = set(sample.labels) - {"le"}
            if got != want:
                problems.append(f"{s.exposed}: labels {sorted(got)}, the catalog says {sorted(want)}")
                break
        if not samples and all(label in s.values for label in s.labels):
            problems.append(f"{s.exposed}: no samples, though every label value is known in advance")
    return problems


def value(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` (as exposed: ``_total``, ``_count``...) with these labels
    (others ignored), summed over the samples that match."""
    total, seen = 0.0, False
    for _, samples in families(text).values():
        for sample in samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                seen = True
    if not seen:
        raise KeyError(f"no sample {name}{labels or ''} in the scrape")
    return total


# ---- the Grafana dashboard ----------------------------------------------------------------------

_METRIC = re.compile(r"(?<![\w:])(vllm:[a-z0-9_:]+|kvpool_[a-z0-9_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Labels Prometheus itself adds to every scraped sample, and the histogram bucket bound.
TARGET_LABELS = frozenset({"instance", "job", "le"})


def samples_of(series: Series) -> tuple[str, ...]:
    """The sample names a scrape shows for ``series``."""
    if series.kind == "histogram":
        return tuple(f"{series.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return (series.exposed,)


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a Grafana dashboard's panels (rows' nested panels included)."""
    out = []
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
    return out


def dashboard_problems(dashboard: dict[str, Any], series: Sequence[Series],
                       external: Collection[str] = ()) -> tuple[list[str], set[str]]:
    """(what in the dashboard's queries names no exported series, label or label value; the
    ``vllm:`` sample names it uses that are vLLM's own rather than the catalog's)."""
    by_sample = {sample: s for s in series for sample in samples_of(s)}
    problems: list[str] = []
    foreign: set[str] = set()
    for expr in dashboard_exprs(dashboard):
        used: list[Series] = []
        vllms_own = False
        for name, matchers in _METRIC.findall(expr):
            s = by_sample.get(name)
            if s is None:
                if name.startswith("vllm:") and not name.startswith("vllm:kvpool_"):
                    foreign.add(name)
                    vllms_own = True  # its labels are vLLM's business: not checked here
                else:
                    problems.append(f"{expr!r}: {name} is not an exported sample")
                continue
            used.append(s)
            for label, _, wanted in _MATCHER.findall(matchers):
                if label not in exposed_labels(s) and label not in TARGET_LABELS:
                    problems.append(f"{expr!r}: {s.name} has no label {label}")
                elif label in s.values and wanted not in s.values[label]:
                    problems.append(f"{expr!r}: {s.name}'s {label} is never {wanted!r}")
        known = set(TARGET_LABELS).union(*(exposed_labels(s) for s in used)) if used else set(TARGET_LABELS)
        for group in [] if vllms_own else _BY.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                if label not in known:
                    problems.append(f"{expr!r}: no series in it has the label {label}")
    return problems, foreign - set(external)
