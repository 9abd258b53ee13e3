"""prometheus_client objects for the catalog's series: created from it, never named twice.

The server's series are read from its stats at scrape time (:class:`StatsCollector`), so a
scrape costs one stats call and the request path pays nothing for them; series observed as
events happen (a request's duration) are ordinary prometheus_client metrics
(:func:`create`). Every endpoint gets its own :class:`~prometheus_client.CollectorRegistry`, so
several servers or proxies in one process (tests) do not collide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import kvpool
from kvpool.metrics.catalog import Series

PromMetric = Counter | Gauge | Histogram
_CLASSES: dict[str, type[PromMetric]] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def new_registry() -> CollectorRegistry:
    """A registry with prometheus_client's process and platform series (CPU, memory, start time)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def create(series: Series, registry: CollectorRegistry | None = None,
           classes: Mapping[str, type[Any]] | None = None, extra_labels: Sequence[str] = (),
           engines: Sequence[Sequence[object]] = ((),)) -> Any:
    """The prometheus_client metric for ``series``, with a child (at 0) for every combination of
    its known label values, so the series exist before the first event.

    ``classes`` replaces prometheus_client's classes (vLLM passes its own); ``extra_labels`` go
    first (vLLM's ``model_name``, ``engine``), and the children are made for each of ``engines``'
    values of them.
    """
    cls = (classes or _CLASSES)[series.kind]
    kwargs: dict[str, Any] = {"name": series.name, "documentation": series.help,
                              "labelnames": [*extra_labels, *series.labels]}
    if series.kind == "histogram":
        kwargs["buckets"] = list(series.buckets)
    if registry is not None:
        kwargs["registry"] = registry
    metric = cls(**kwargs)
    labelled = bool(series.labels or extra_labels)
    if labelled and all(label in series.values for label in series.labels):
        for engine in engines:
            for combo in itertools.product(*(series.values[label] for label in series.labels)):
                metric.labels(*engine, *combo)
    return metric


def build_info(series: Series, registry: CollectorRegistry, component: str) -> None:
    """``kvpool_build_info{version, component} 1``."""
    create(series, registry).labels(kvpool.__version__, component).set(1)


class StatsCollector(Collector):
    """Families of ``series`` (those with a ``stats`` source) from ``fetch()`` at every scrape."""

    def __init__(self, fetch: Callable[[], Mapping[str, Any]], series: Sequence[Series]) -> None:
        self._fetch = fetch
        self._series = [s for s in series if s.stats]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families({}))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._fetch()))

    def _families(self, stats: Mapping[str, Any]) -> list[Metric]:
        out: list[Metric] = []
        for s in self._series:
            # prometheus_client's families take the name without `_total`, like the catalog.
            family_cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
            family = family_cls(s.name, s.help, labels=list(s.labels))
            for values, key in s.stats.items():
                value = stats.get(key, 0)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    value = 0
                family.add_metric(list(values), value)
            out.append(family)
        return out
