"""`kvpool stats`: a pool's numbers, once or as a live view with per-second rates.

Sources: a `kvpool server` (its socket or its metrics endpoint), a Mooncake master (its metrics
endpoint, ``--metrics_port``), a Redis server (``INFO``). Each :class:`Source` says which of its
numbers are counters, so ``--watch`` turns those into rates; the server's come from the metrics
catalog. ``--json`` prints one JSON object (``--watch``: one per line), safe in a pipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from kvpool.cli.inputs import InputError, http_get, loads, numbers
from kvpool.config import DEFAULT_SERVER_SOCKET
from kvpool.errors import KVPoolError
from kvpool.metrics import catalog

Rates = dict[str, float]
Rows = list[tuple[str, str]]


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
    """GET ``url`` (a server's metrics base URL, or its /stats URL) as JSON: a server's stats,
    within ``timeout_s`` and a size bound, with numbers where the server puts numbers."""
    base = url.rstrip("/")
    if not base.endswith("/stats"):
        base += "/stats"
    stats = loads(http_get(base, timeout_s), base)
    if not isinstance(stats, dict):
        raise InputError(f"{base}: a JSON {type(stats).__name__}, not a kvpool server's stats object")
    clients = stats.get("client_list", [])
    if not isinstance(clients, list) or not all(isinstance(c, dict) for c in clients):
        raise InputError(f"{base}: client_list is not a list of objects; is this a kvpool server?")
    return numbers(stats, STATS_NUMBERS, base)


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


def rows(s: dict[str, Any], rates: Rates | None = None) -> Rows:
    """(label, value) pairs for the summary table; with ``rates``, the live view's first."""
    out = _server_rates(rates) if rates is not None else []
    out += [
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


def _server_rates(r: Rates) -> Rows:
    reads = r.get("hits", 0) + r.get("disk_hits", 0)
    total = reads + r.get("misses", 0)
    looked = r.get("lookup_keys", 0)
    return [
        ("reads/s", f"{total:.1f} ({reads / total:.1%} hits: {r.get('hits', 0):.1f} memory, "
                    f"{r.get('disk_hits', 0):.1f} offload)" if total else "0"),
        ("lookup keys/s", f"{looked:.1f} ({r.get('lookup_hits', 0) / looked:.1%} found)" if looked else "0"),
        ("puts/s", f"{r.get('puts', 0):.1f} ({r.get('allocation_failures', 0):.1f} refused)"),
        ("evictions/s", f"{r.get('evictions', 0):.1f} memory, {r.get('disk_evictions', 0):.1f} offload"),
    ]


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


# ---- other stores --------------------------------------------------------------------------------


def fetch_prometheus(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """A Prometheus endpoint's unlabelled samples (labelled ones summed per name), and which
    of them are counters under ``"_counters"``."""
    from prometheus_client.parser import text_string_to_metric_families

    base = url.rstrip("/")
    if not base.endswith("/metrics"):
        base += "/metrics"
    text = http_get(base, timeout_s).decode(errors="replace")
    out: dict[str, Any] = {}
    counters = []
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's errors for text that is not the format
        raise InputError(f"{base}: not Prometheus text ({exc})") from None
    for family in families:
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if family.type == "counter":
                counters.append(sample.name)
    out["_counters"] = sorted(set(counters))
    return out


def mooncake_rows(s: dict[str, Any], rates: Rates | None = None) -> Rows:
    """A Mooncake master's numbers, from its /metrics."""
    def g(name: str) -> float:
        return s.get(name, 0)

    out: Rows = []
    if rates is not None:
        def r(*names: str) -> float:
            return sum(rates.get(n, 0) for n in names)
        out += [
            ("puts/s", f"{r('master_put_end_requests_total', 'master_batch_put_end_items_total'):.1f}"),
            ("gets/s", f"{r('master_get_replica_list_requests_total', 'master_batch_get_replica_list_items_total'):.1f}"),
            ("exists/s", f"{r('master_exist_key_requests_total', 'master_batch_exist_key_items_total'):.1f}"),
            ("evictions/s", f"{r('master_successful_evictions_total'):.1f}"),
        ]
    failures = sum(v for k, v in s.items() if k.startswith("master_") and
                   (k.endswith("_failures_total") or k.endswith("_failed_items_total")))
    out += [
        ("memory", f"{human_bytes(g('master_allocated_bytes'))} / {human_bytes(g('master_total_capacity_bytes'))} "
                   f"({_pct(g('master_allocated_bytes'), g('master_total_capacity_bytes'))})"),
        ("ssd", f"{human_bytes(g('master_allocated_file_size_bytes'))} / "
                f"{human_bytes(g('master_total_file_capacity_bytes'))}"),
        ("keys", f"{g('master_key_count'):.0f} ({g('master_soft_pin_key_count'):.0f} soft-pinned)"),
        ("clients", f"{g('master_active_clients'):.0f}"),
        ("evictions", f"{g('master_successful_evictions_total'):.0f} of {g('master_attempted_evictions_total'):.0f} "
                      f"attempts, {g('master_evicted_key_count'):.0f} keys"),
        ("failed requests", f"{failures:.0f}"),
    ]
    return out


REDIS_COUNTERS = ("keyspace_hits", "keyspace_misses", "evicted_keys", "expired_keys", "total_commands_processed")


def fetch_redis(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """A Redis server's ``INFO`` and key count."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        info = {k: v for k, v in client.info().items() if isinstance(v, (int, float, str))}
        info["keys"] = client.dbsize()
    except redis.RedisError as exc:
        raise OSError(str(exc)) from None
    finally:
        client.close()
    return info


def redis_rows(s: dict[str, Any], rates: Rates | None = None) -> Rows:
    out: Rows = []
    if rates is not None:
        reads = rates.get("keyspace_hits", 0) + rates.get("keyspace_misses", 0)
        out += [("reads/s", f"{reads:.1f} ({_pct(rates.get('keyspace_hits', 0), reads)} hits)"),
                ("commands/s", f"{rates.get('total_commands_processed', 0):.1f}"),
                ("evictions/s", f"{rates.get('evicted_keys', 0):.1f}")]
    hits, misses = s.get("keyspace_hits", 0), s.get("keyspace_misses", 0)
    maxmemory = s.get("maxmemory", 0)
    out += [
        ("memory", f"{human_bytes(s.get('used_memory', 0))} / " +
                   (f"{human_bytes(maxmemory)} ({_pct(s.get('used_memory', 0), maxmemory)})" if maxmemory
                    else "no maxmemory") + f", policy {s.get('maxmemory_policy', '?')}"),
        ("keys", str(s.get("keys", 0))),
        ("read hit rate", f"{_pct(hits, hits + misses)} ({hits} hits, {misses} misses)"),
        ("evictions", f"{s.get('evicted_keys', 0)} (expired {s.get('expired_keys', 0)})"),
        ("server", f"redis {s.get('redis_version', '?')}, up {s.get('uptime_in_seconds', 0)}s, "
                   f"{s.get('connected_clients', 0)} clients"),
    ]
    return out


# ---- sources, rates, output -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the numbers come from, which of them are counters, and how to summarise them."""

    title: str
    where: str
    fetch: Callable[[], dict[str, Any]]
    counters: Callable[[dict[str, Any]], Collection[str]]
    summary: Callable[[dict[str, Any], Rates | None], Rows]


# The server's counters: the stats entries behind the catalog's counter series.
SERVER_COUNTERS = frozenset(key for s in catalog.SERVER if s.kind == "counter" for key in s.stats.values())
# Every entry of the server's stats that is a number (a series' source, or one it does not export).
STATS_NUMBERS = frozenset(key for s in catalog.SERVER for key in s.stats.values()) | frozenset(
    catalog.SERVER_STATS_NOT_EXPORTED)


def source_from_args(args: argparse.Namespace) -> Source:
    if args.mooncake_metrics_url:
        return Source("mooncake master", args.mooncake_metrics_url, lambda: fetch_prometheus(args.mooncake_metrics_url),
                      lambda s: s.get("_counters", ()), mooncake_rows)
    if args.redis_url:
        return Source("redis", args.redis_url, lambda: fetch_redis(args.redis_url),
                      lambda s: REDIS_COUNTERS, redis_rows)
    if args.metrics_url:
        return Source("kvpool server", args.metrics_url, lambda: derive(fetch_from_url(args.metrics_url)),
                      lambda s: SERVER_COUNTERS, rows)
    return Source("kvpool server", args.socket, lambda: derive(fetch_from_socket(args.socket)),
                  lambda s: SERVER_COUNTERS, rows)


def per_second(prev: dict[str, Any], cur: dict[str, Any], counters: Collection[str], seconds: float) -> Rates:
    """Each counter's increase per second; a counter that went down (the store restarted)
    counts from zero."""
    out: Rates = {}
    for k in counters:
        now, before = cur.get(k), prev.get(k)
        if isinstance(now, (int, float)) and isinstance(before, (int, float)) and seconds > 0:
            out[k] = (now - before if now >= before else now) / seconds
    return out


def render(source: Source, s: dict[str, Any], rates: Rates | None = None) -> None:
    clients = s.get("client_list", [])
    table_rows = source.summary(s, rates)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with vLLM; the server host may not have it
        width = max(len(label) for label, _ in table_rows)
        print(f"{source.title} ({source.where})")
        for label, value in table_rows:
            print(f"{label:<{width}}  {value}")
        for c in clients:
            print(f"  client {c.get('client_id')}  pid {c.get('pid')}  requests {c.get('requests')}")
        return
    table = Table(title=f"{source.title} ({source.where})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in table_rows:
        table.add_row(label, value)
    console = Console()
    console.print(table)
    if clients:
        ct = Table(title="clients")
        # `owner`: the process its quotas count against (pid@id for a client in another PID namespace).
        for col in ("client id", "process", "requests"):
            ct.add_column(col)
        for c in clients:
            ct.add_row(str(c.get("client_id")), str(c.get("owner") or c.get("pid")), str(c.get("requests")))
        console.print(ct)


# The longest --watch interval: a day (a longer sleep overflows the platform's time_t).
MAX_WATCH_S = 86400.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--socket", default=DEFAULT_SERVER_SOCKET, metavar="PATH",
                     help=f"ask the kvpool server on this Unix socket (default {DEFAULT_SERVER_SOCKET})")
    src.add_argument("--metrics-url", "--metrics_url", default=None, metavar="URL",
                     help="ask a kvpool server's metrics endpoint instead, e.g. http://127.0.0.1:9003")
    # Both spellings of every multi-word flag, as `kvpool server` and mooncake_master take them.
    src.add_argument("--mooncake-metrics-url", "--mooncake_metrics_url", default=None, metavar="URL",
                     help="summarise a Mooncake master from its metrics endpoint (its --metrics_port), "
                          "e.g. http://127.0.0.1:9003")
    src.add_argument("--redis-url", "--redis_url", default=None, metavar="URL",
                     help="summarise a Redis server from INFO, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (for scripts); with --watch one object per line")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) with per-second rates, until Ctrl-C")
    parser.add_argument("--count", type=int, default=0, metavar="N",
                        help="with --watch: stop after N refreshes (default: never)")


def run(args: argparse.Namespace) -> int:
    source = source_from_args(args)
    if args.watch is None:
        try:
            stats = source.fetch()
        except (KVPoolError, OSError, ValueError) as exc:  # InputError among them
            print(f"kvpool stats: cannot reach the {source.title} at {source.where}: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(stats, indent=2, sort_keys=True))
        else:
            render(source, stats)
        return 0
    if not 0 < args.watch <= MAX_WATCH_S or args.count < 0:  # NaN fails the first
        print(f"kvpool stats: --watch={args.watch} --count={args.count} is invalid: --watch takes seconds in "
              f"(0, {MAX_WATCH_S}] and --count N >= 0", file=sys.stderr)
        return 2
    try:
        return _watch(source, args.watch, args.count, args.json)
    except KeyboardInterrupt:
        return 0


def _watch(source: Source, interval_s: float, count: int, as_json: bool) -> int:
    prev: dict[str, Any] | None = None
    prev_t = 0.0
    clear = not as_json and sys.stdout.isatty()
    for n in itertools.count(1):
        try:
            stats = source.fetch()
        except (KVPoolError, OSError, ValueError) as exc:  # InputError among them
            # A live view outlives a store's restart: say so and keep asking.
            print(f"kvpool stats: cannot reach the {source.title} at {source.where}: {exc}", file=sys.stderr)
            stats = None
        now = time.monotonic()
        if stats is not None:
            rates = per_second(prev, stats, source.counters(stats), now - prev_t) if prev is not None else None
            if as_json:
                print(json.dumps({"time": time.time(), "interval_s": round(now - prev_t, 6) if prev else None,
                                  "rates": rates, "stats": stats}, sort_keys=True), flush=True)
            else:
                if clear:
                    print("\033[2J\033[H", end="")
                render(source, stats, rates if rates is not None else {})
                sys.stdout.flush()
            prev, prev_t = stats, now
        if count and n >= count:
            return 0 if prev is not None else 1
        time.sleep(interval_s)
    return 0
