"""The server's HTTP endpoint: Prometheus `/metrics`, JSON `/stats`, `/healthz`, and the
controller's `/v1/*` routes (`server/control.py`).

It binds ``--metrics-host`` (127.0.0.1 unless told otherwise, for a scraper on another host):
the numbers reveal what a host caches, and there is no auth for them. The controller's routes
change the pool, so they need ``Authorization: Bearer <token>`` with the token the server was
started with in :data:`ADMIN_TOKEN_ENV`, and are off (403) without one. The series are the catalog's
(``kvpool.metrics.catalog.SERVER``): those read from the stats at scrape time, the request
duration histogram the daemon observes, the build info and prometheus_client's process series.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.config import bearer_matches
from kvpool.metrics import catalog
from kvpool.server.control import REQUESTS, Controller, RequestError
from kvpool.metrics.prom import Histogram, StatsCollector, build_info, create, new_registry

logger = logging.getLogger(__name__)

_BY_NAME = catalog.by_name("server")

# Seconds a metrics connection may take to send its request or read its answer. Without it a
# peer that sends nothing (any local user may connect) or a scraper that vanished mid-request
# keeps a thread and an fd of the server forever. A scrape takes milliseconds.
REQUEST_TIMEOUT_S = 30.0
# The environment variable holding the controller's admin token.
ADMIN_TOKEN_ENV = "KVPOOL_SERVER_ADMIN_TOKEN"
MAX_BODY_BYTES = 8 << 20  # a controller call's JSON: 65536 block hashes take about 4.6 MB


class _TenantCollector(Collector):
    """The tenants' memory and budgets (``tenants_fn``: name -> (bytes, budget)), one sample per
    tenant of the server's tenants file: the label's values are those names, a bounded set."""

    def __init__(self, tenants_fn: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._fetch = tenants_fn

    def collect(self) -> Iterator[Metric]:
        usage = self._fetch()
        for name, index in (("kvpool_tenant_memory_bytes", 0), ("kvpool_tenant_budget_bytes", 1)):
            family = GaugeMetricFamily(name, _BY_NAME[name].help, labels=["tenant"])
            for tenant, values in sorted(usage.items()):
                family.add_metric([tenant], values[index])
            yield family


class ServerMetrics:
    """The server's registry: stats read at scrape time, plus what the daemon observes."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]],
                 tenants_fn: Callable[[], Mapping[str, tuple[int, int]]] = dict) -> None:
        self.registry: CollectorRegistry = new_registry()
        build_info(_BY_NAME["kvpool_build_info"], self.registry, "server")
        self.registry.register(StatsCollector(stats_fn, catalog.SERVER))
        self.registry.register(_TenantCollector(tenants_fn))
        durations: Histogram = create(_BY_NAME["kvpool_request_duration_seconds"], self.registry)
        # One child per op, looked up by the request path without a label lookup.
        self.request_seconds = {op: durations.labels(op) for op in catalog.SERVER_OPS}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_POST_ROUTES = tuple(name for name, kind in REQUESTS.items() if kind is not None)


def _denied(controller: Controller | None, token: str | None, authorization: str) -> tuple[int, str] | None:
    """None when a controller call with this Authorization header may go on, else the status
    and message it gets."""
    if controller is None or token is None:
        return 403, (f"the controller is off; start kvpool server with {ADMIN_TOKEN_ENV} set to a secret token "
                     "(16+ characters) and send it as 'Authorization: Bearer <token>'")
    if bearer_matches(authorization, token):
        return None
    return 401, (f"the controller needs 'Authorization: Bearer <token>' with the token in the server's "
                 f"{ADMIN_TOKEN_ENV}; this request has none or a wrong one")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        # IPv6 literals need an AF_INET6 socket.
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), handler)


class MetricsServer:
    """Serves ``metrics`` and ``stats_fn()`` on ``host``:``port`` from a daemon thread (port 0:
    any free port)."""

    def __init__(self, host: str, port: int, stats_fn: Callable[[], Mapping[str, Any]],
                 metrics: ServerMetrics, controller: Controller | None = None,
                 admin_token: str | None = None) -> None:
        fetch = stats_fn

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, metrics.exposition())
                elif path == "/stats":
                    self._send(200, "application/json", json.dumps(fetch(), sort_keys=True).encode())
                elif path == "/v1/usage":
                    self._control("usage", "GET")
                else:
                    self._send(404, "text/plain; charset=utf-8",
                               b"not found: try /metrics, /stats, /healthz or the controller's /v1/* routes\n")

            def do_POST(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                name = path.removeprefix("/v1/")
                if path.startswith("/v1/") and name in _POST_ROUTES:
                    self._control(name, "POST")
                else:
                    self._error(404, f"no route POST {path[:100]}; the controller's are "
                                     f"{', '.join('/v1/' + r for r in _POST_ROUTES)} and GET /v1/usage")

            def _control(self, name: str, method: str) -> None:
                # The token is checked before the body is read: a stranger cannot make us read it.
                denied = _denied(controller, admin_token, self.headers.get("Authorization", ""))
                if denied is not None:
                    if controller is not None:
                        controller.note_refused()
                    self._error(*denied)
                    return
                assert controller is not None
                body = b""
                if method == "POST":
                    length = self.headers.get("Content-Length", "")
                    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                        self._error(413 if length.isdigit() else 411,
                                    f"a JSON body with a Content-Length of at most {MAX_BODY_BYTES} bytes is needed")
                        return
                    body = self.rfile.read(int(length))
                try:
                    answer = controller.call(name, body)
                except RequestError as exc:
                    self._error(400, str(exc))
                    return
                self._send(200, "application/json", json.dumps(answer, sort_keys=True).encode())

            def _error(self, status: int, message: str) -> None:
                self._send(status, "application/json", json.dumps({"error": message}).encode())

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if status == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
                logger.debug("metrics: " + format, *args)

        self.host = host
        self._httpd = _Server(host, port, Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvpool-metrics", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
