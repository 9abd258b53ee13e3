"""The server's loopback HTTP endpoint: Prometheus `/metrics`, JSON `/stats`, `/healthz`.

Standard library only (the server must run without vLLM and its dependencies). It binds
127.0.0.1 and nothing else: the numbers reveal what a host caches, and there is no auth.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

# Monotonic counters (exported with a `_total` suffix); every other number is a gauge.
COUNTERS = frozenset({
    "puts", "gets", "hits", "disk_hits", "misses", "evictions", "promotions",
    "allocation_failures", "lease_expired", "disk_write_errors", "reclaimed_allocations",
    "reaped_clients", "disk_evictions", "checksum_failures", "lookup_keys", "lookup_hits",
    "connections", "protocol_errors", "corrupt_objects", "disk_full_events", "refused_peers", "quota_refusals", "unpinned_leases",
    "hold_limit_hits", "lease_ops", "evict_steps", "refused_connections", "evicted_handshakes", "handshake_timeouts",
})

HELP = {
    "memory_used": "Arena bytes reserved by stored and pending objects",
    "memory_capacity": "Usable arena bytes",
    "object_count": "Objects in the memory tier",
    "disk_used": "Bytes used by the offload tier",
    "disk_count": "Objects in the offload tier",
    "clients": "Clients the engine considers alive",
    "connected_clients": "Open client connections",
    "hits": "Reads served from memory",
    "disk_hits": "Reads served from the offload tier",
    "misses": "Reads of absent keys",
    "evictions": "Objects evicted from memory",
    "lookup_keys": "Keys asked about by exists lookups",
    "lookup_hits": "Keys found by exists lookups",
    "refused_peers": "Connections refused because the peer's uid/gid is outside the pool's trust domain",
    "quota_refusals": "Leases and allocations refused because a client process was at its quota",
    "unpinned_leases": "Leases granted without pinning: past the client's pool share or hold time",
    "hold_limit_hits": "Objects a client process pinned for client_max_hold_s, then had to let go",
    "lease_ops": "Steps of lease bookkeeping (adds, drops, expiry-heap pops)",
    "evict_steps": "Objects eviction looked at (one per victim: held objects are never in its list)",
    "evictable_objects": "Objects in the memory tier that nobody holds (eviction candidates)",
    "evictable_bytes": "Arena bytes of the evictable objects",
    "refused_connections": "Handshakes refused at max_connections or max_connections_per_client",
    "evicted_handshakes": "Connections closed before their Hello to admit newer ones (max_handshakes)",
    "pending_handshakes": "Connections that have not said Hello yet",
}


def render_prometheus(stats: Mapping[str, Any]) -> str:
    """Prometheus text exposition (format 0.0.4) of the numeric entries of ``stats``."""
    lines = []
    for name in sorted(stats):
        value = stats[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        counter = name in COUNTERS
        metric = f"kvpool_{name}_total" if counter else f"kvpool_{name}"
        lines.append(f"# HELP {metric} {HELP.get(name, name.replace('_', ' '))}")
        lines.append(f"# TYPE {metric} {'counter' if counter else 'gauge'}")
        lines.append(f"{metric} {value}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``stats_fn()`` on 127.0.0.1:``port`` from a daemon thread (port 0: any free port)."""

    def __init__(self, port: int, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        fetch = stats_fn

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                elif path == "/metrics":
                    body = render_prometheus(fetch()).encode()
                    self._send(200, "text/plain; version=0.0.4; charset=utf-8", body)
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

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvpool-metrics", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
