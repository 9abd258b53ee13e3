"""`kvpool stats`: fetch a running server's numbers (socket or HTTP) and show them."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from typing import Any

from kvpool.config import DEFAULT_SERVER_SOCKET
from kvpool.errors import KVPoolError


def fetch_from_socket(socket_path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    from kvpool.server.client import PoolClient

    # The client's "no server, calls will miss" warning is for long-running users; here the
    # one error line run() prints says it.
    logging.getLogger("kvpool.server.client").setLevel(logging.ERROR)
    client = PoolClient(socket_path, "kvpool-stats", timeout_s=timeout_s, ping=False)
    try:
        stats, clients = client.server_stats()
        me = client.client_id
    finally:
        client.close()
    # Report the pool's users, not this query's own connection.
    stats["client_list"] = [c for c in clients if c.get("client_id") != me]
    stats["connected_clients"] = len(stats["client_list"])
    return stats


def fetch_from_url(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET ``url`` (a server's metrics base URL, or its /stats URL) as JSON."""
    base = url.rstrip("/")
    if not base.endswith("/stats"):
        base += "/stats"
    with urllib.request.urlopen(base, timeout=timeout_s) as resp:  # noqa: S310 (operator-given URL)
        return json.loads(resp.read())


def derive(stats: dict[str, Any]) -> dict[str, Any]:
    """Add the ratios people ask for first."""
    out = dict(stats)
    reads = stats.get("hits", 0) + stats.get("disk_hits", 0)
    total = reads + stats.get("misses", 0)
    out["hit_rate"] = reads / total if total else 0.0
    looked = stats.get("lookup_keys", 0)
    out["lookup_hit_rate"] = stats.get("lookup_hits", 0) / looked if looked else 0.0
    cap = stats.get("memory_capacity", 0)
    out["memory_used_ratio"] = stats.get("memory_used", 0) / cap if cap else 0.0
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs for the summary table."""
    out = [
        ("memory", f"{human_bytes(s.get('memory_used', 0))} / {human_bytes(s.get('memory_capacity', 0))} "
                   f"({s['memory_used_ratio']:.1%})"),
        ("objects", f"{s.get('object_count', 0)} (+{s.get('pending_allocations', 0)} being written)"),
        ("read hit rate", f"{s['hit_rate']:.1%} ({s.get('hits', 0)} memory + {s.get('disk_hits', 0)} offload hits, "
                          f"{s.get('misses', 0)} misses)"),
        ("lookup hit rate", f"{s['lookup_hit_rate']:.1%} ({s.get('lookup_hits', 0)} of {s.get('lookup_keys', 0)} keys)"),
        ("puts", f"{s.get('puts', 0)} ({s.get('allocation_failures', 0)} refused: pool full)"),
        ("evictions", f"{s.get('evictions', 0)} (promotions {s.get('promotions', 0)}, "
                      f"expired leases {s.get('lease_expired', 0)})"),
    ]
    if s.get("offload_path"):
        quota = s.get("disk_quota", 0)
        out.append(("offload tier", f"{human_bytes(s.get('disk_used', 0))} / {human_bytes(quota)} in "
                                    f"{s.get('disk_count', 0)} objects at {s['offload_path']}"))
        out.append(("offload health", f"{s.get('disk_evictions', 0)} evictions, {s.get('checksum_failures', 0)} "
                                      f"checksum failures, {s.get('disk_write_errors', 0)} write errors, "
                                      f"queue {s.get('disk_queue', 0)}"))
    else:
        out.append(("offload tier", "off"))
    out.append(("clients", f"{s.get('connected_clients', 0)} connected, {s.get('connections', 0)} connections "
                           f"since start, {s.get('reclaimed_allocations', 0)} unfinished puts reclaimed"))
    out.append(("server", f"pid {s.get('server_pid', '?')}, up {s.get('uptime_s', 0):.0f}s, {s.get('socket', '?')}"))
    return out


def render(s: dict[str, Any]) -> None:
    clients = s.get("client_list", [])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with vLLM; the server host may not have it
        width = max(len(label) for label, _ in rows(s))
        for label, value in rows(s):
            print(f"{label:<{width}}  {value}")
        for c in clients:
            print(f"  client {c.get('client_id')}  pid {c.get('pid')}  requests {c.get('requests')}")
        return
    table = Table(title="kvpool server", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows(s):
        table.add_row(label, value)
    console = Console()
    console.print(table)
    if clients:
        ct = Table(title="clients")
        for col in ("client id", "pid", "requests"):
            ct.add_column(col)
        for c in clients:
            ct.add_row(str(c.get("client_id")), str(c.get("pid")), str(c.get("requests")))
        console.print(ct)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--socket", default=DEFAULT_SERVER_SOCKET, metavar="PATH",
                     help=f"ask the server on this Unix socket (default {DEFAULT_SERVER_SOCKET})")
    src.add_argument("--metrics-url", "--metrics_url", default=None, metavar="URL",
                     help="ask the server's HTTP endpoint instead, e.g. http://127.0.0.1:9003")
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def run(args: argparse.Namespace) -> int:
    try:
        stats = fetch_from_url(args.metrics_url) if args.metrics_url else fetch_from_socket(args.socket)
    except (KVPoolError, OSError, urllib.error.URLError, ValueError) as exc:
        where = args.metrics_url or args.socket
        print(f"kvpool stats: cannot reach a kvpool server at {where}: {exc}", file=sys.stderr)
        return 1
    stats = derive(stats)
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        render(stats)
    return 0
