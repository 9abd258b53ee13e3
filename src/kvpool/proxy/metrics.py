"""The proxy's Prometheus series (``catalog.PROXY``): client requests as they are answered, the
instances' health and load and the routing counters read from the proxy's state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.metrics import catalog
from kvpool.metrics.prom import build_info, create, new_registry
from kvpool.proxy.registry import Registry
from kvpool.proxy.route import MixedRouter

_BY_NAME = catalog.by_name("proxy")
# The router's counters (route.COUNTERS) that are routing outcomes, by outcome label.
_OUTCOMES = dict(zip(catalog.ROUTING_OUTCOMES,
                     ("decisions", "answered", "reported", "hits", "predicted_hits", "predicted_and_hit")))


def _family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    s = _BY_NAME[name]
    cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
    return cls(s.name, s.help, labels=list(s.labels))


class _StateCollector(Collector):
    def __init__(self, registry: Registry, router: MixedRouter | None) -> None:
        self._registry = registry
        self._router = router

    def collect(self) -> Iterator[Metric]:
        sent, failed = _family("kvpool_proxy_upstream_requests"), _family("kvpool_proxy_upstream_failures")
        healthy, in_flight = _family("kvpool_proxy_instance_healthy"), _family("kvpool_proxy_instance_in_flight")
        for inst in self._registry.all():
            labels = [inst.role.value, inst.key]
            sent.add_metric(labels, inst.requests)
            failed.add_metric(labels, inst.failures)
            healthy.add_metric(labels, 1 if inst.healthy else 0)
            in_flight.add_metric(labels, inst.in_flight)
        yield from (sent, failed, healthy, in_flight)
        decisions, routed = _family("kvpool_proxy_routing_decisions"), _family("kvpool_proxy_routed_requests")
        tokens = _family("kvpool_proxy_routed_tokens")
        router = self._router
        if router is not None:
            for reason, counts in router.by_reason.items():
                for outcome, key in _OUTCOMES.items():
                    decisions.add_metric([reason, outcome], counts[key])
            for instance, counts in router.by_instance.items():
                for outcome, key in _OUTCOMES.items():
                    routed.add_metric([instance, outcome], counts[key])
                tokens.add_metric([instance, "prompt"], counts["prompt_tokens"])
                tokens.add_metric([instance, "cached"], counts["cached_tokens"])
        yield from (decisions, routed, tokens)


class ProxyMetrics:
    """The proxy's registry; ``observe`` is called once per answered client request."""

    def __init__(self, registry: Registry, router: MixedRouter | None) -> None:
        self.registry = new_registry()
        build_info(_BY_NAME["kvpool_build_info"], self.registry, "proxy")
        self._requests = create(_BY_NAME["kvpool_proxy_requests"], self.registry)
        self._response_seconds = create(_BY_NAME["kvpool_proxy_response_seconds"], self.registry)
        self.registry.register(_StateCollector(registry, router))

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self._requests.labels(endpoint, str(status)).inc()
        self._response_seconds.labels(endpoint).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
