"""The server's HTTP endpoint: Prometheus `/metrics`, JSON `/stats`, `/healthz`.

It binds ``--metrics-host`` (127.0.0.1 unless told otherwise, for a scraper on another host):
the numbers reveal what a host caches, and there is no auth. The series are the catalog's
(``kvpool.metrics.catalog.SERVER``): those read from the stats at scrape time, the request
duration histogram the daemon observes, the build info and prometheus_client's process series.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpool.metrics import catalog
from kvpool.metrics.prom import Histogram, StatsCollector, build_info, create, new_registry

logger = logging.getLogger(__name__)

_BY_NAME = catalog.by_name("server")

# Seconds a metrics connection may take to send its request or read its answer. Without it a
# peer that sends nothing (any local user may connect) or a scraper that vanished mid-request
# keeps a thread and an fd of the server forever. A scrape takes milliseconds.
REQUEST_TIMEOUT_S = 30.0


class ServerMetrics:
    """The server's registry: stats read at scrape time, plus what the daemon observes."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self.registry: CollectorRegistry = new_registry()
        build_info(_BY_NAME["kvpool_build_info"], self.registry, "server")
        self.registry.register(StatsCollector(stats_fn, catalog.SERVER))
        durations: Histogram = create(_BY_NAME["kvpool_request_duration_seconds"], self.registry)
        # One child per op, looked up by the request path without a label lookup.
        self.request_seconds = {op: durations.labels(op) for op in catalog.SERVER_OPS}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


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
                 metrics: ServerMetrics) -> None:
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
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics, /stats, /healthz\n")

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
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
