"""Every Prometheus series kvpool exports, written once: name, type, labels, help, and (for the
server) the stats entry each sample is read from.

Three components export series:

- ``server``: `kvpool server`'s `/metrics` (``--metrics-port``), read from its stats at scrape time;
- ``proxy``: `kvpool proxy`'s `/metrics`, on the proxy's own address;
- ``connector``: the connector's series on each vLLM instance's own `/metrics`, through vLLM's
  connector Prometheus hook (vLLM adds its ``model_name`` and ``engine`` labels and unregisters
  ``vllm:`` series when it rebuilds its loggers, hence the prefix).

Everything else derives from these tuples: the exporters create exactly these families, the
reference page (docs/metrics.md, :func:`reference_markdown`) lists them, and the tests check a
live scrape of each component and the Grafana dashboard against them. Counter names are given
without ``_total`` (prometheus_client adds it on the wire, :attr:`Series.exposed`).

Names follow Prometheus conventions: base units in the name (``_bytes``, ``_seconds``), counters
``_total``, one series per quantity with labels for its parts (``tier``, ``result``, ``op``,
``role``, ``instance``) so a sum over a label means something. Configuration values and PIDs are
not exported as gauges (they are in the server's JSON ``/stats``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Component = Literal["server", "proxy", "connector"]

# Latency buckets for store round trips and block transfers: 100 us (a few blocks from shared
# memory) to 30 s (the guard's longest deadline).
TRANSFER_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
# Proxy response times: a prefill of a long prompt on a CPU takes seconds.
RESPONSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


# What happens to blocks at the remote tier (`backends.tiered`), one counter each.
REMOTE_TIER_RESULTS = ("hit", "promoted", "written", "skipped", "dropped", "failed")


def remote_tier_counter(result: str) -> str:
    """The connector's stats counter (and the tiered backend's) of one remote-tier result."""
    return f"remote_{result}_blocks"


@dataclasses.dataclass(frozen=True)
class Series:
    """One metric family.

    ``values``: the label values known in advance, per label (their children are created at
    start-up, so the series exist before the first event); a label not listed takes values
    only known at run time (an instance, an error code).
    ``stats``: server only — the stats entry of each child, by its label values in ``labels``
    order.
    """

    name: str
    kind: Kind
    help: str
    component: Component
    labels: tuple[str, ...] = ()
    values: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    stats: Mapping[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> str:
        """The sample name a scrape shows (histograms add ``_bucket``/``_sum``/``_count``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name



def _server(name: str, kind: Kind, help: str, stats: str | Mapping[tuple[str, ...], str] = "",
            labels: tuple[str, ...] = (), **kw: object) -> Series:
    mapping = {(): stats} if isinstance(stats, str) and stats else (stats or {})
    values = {label: tuple(dict.fromkeys(vals[i] for vals in mapping)) for i, label in enumerate(labels)}
    return Series(name, kind, help, "server", labels, values, mapping, **kw)  # type: ignore[arg-type]


TIERS = ("memory", "disk")

# The server's protocol requests, as the ``op`` of kvpool_request_duration_seconds.
SERVER_OPS = ("hello", "ping", "exists", "lookup", "allocate", "commit", "abort", "acquire", "release", "remove", "pin", "take_drops",
              "get_stats")

# The controller's calls (`kvpool.server.control.REQUESTS`), as the ``op`` of kvpool_controller_calls.
CONTROL_OPS = ("usage", "lookup", "pin", "unpin", "clear")

SERVER: tuple[Series, ...] = (
    Series("kvpool_build_info", "gauge", "Always 1: kvpool's version and the component serving this endpoint",
           "server", ("version", "component")),
    _server("kvpool_memory_used_bytes", "gauge", "Arena bytes reserved by stored objects and puts in progress",
            "memory_used"),
    _server("kvpool_memory_capacity_bytes", "gauge", "Usable arena bytes (the memory tier's size less its "
            "allocator's headers)", "memory_capacity"),
    _server("kvpool_memory_largest_free_bytes", "gauge", "Largest free extent of the arena: the biggest value a "
            "put can take without evicting", "memory_largest_free"),
    _server("kvpool_disk_used_bytes", "gauge", "Bytes the SSD tier's files take (0 without --enable-offload)",
            "disk_used"),
    _server("kvpool_disk_quota_bytes", "gauge", "The SSD tier's quota: --offload-quota, or what the disk can "
            "hold (lowered when the disk fills up below it, raised again when it has room)", "disk_quota"),
    _server("kvpool_objects", "gauge", "Objects stored, per tier (an object on both tiers counts in each)",
            {("memory",): "object_count", ("disk",): "disk_count"}, ("tier",)),
    _server("kvpool_evictable_objects", "gauge", "Objects in the memory tier that no client holds: what eviction "
            "may take", "evictable_objects"),
    _server("kvpool_evictable_bytes", "gauge", "Arena bytes of the evictable objects", "evictable_bytes"),
    _server("kvpool_pending_allocations", "gauge", "Puts allocated and not yet committed or aborted",
            "pending_allocations"),
    _server("kvpool_leases", "gauge", "Read leases held by clients (a held object is never evicted)", "leases"),
    _server("kvpool_spill_queue_objects", "gauge", "Objects evicted from memory, waiting for their write to the "
            "SSD tier", "spilling"),
    _server("kvpool_disk_write_queue_objects", "gauge", "Objects queued for the SSD tier's write-through",
            "disk_queue"),
    _server("kvpool_clients", "gauge", "Clients the pool considers alive (they pinged within --client-ttl)",
            "clients"),
    _server("kvpool_connections", "gauge", "Open client connections: handshaken, or waiting for their Hello",
            {("open",): "connected_clients", ("handshaking",): "pending_handshakes"}, ("state",)),
    _server("kvpool_partial_frame_bytes", "gauge", "Memory held by request frames still arriving, all "
            "connections together (bounded by --frame-budget)", "partial_frame_bytes"),
    _server("kvpool_puts", "counter", "Objects committed to the pool", "puts"),
    _server("kvpool_read_hits", "counter", "Reads served, per tier they were found in (a disk hit is promoted "
            "to memory)", {("memory",): "hits", ("disk",): "disk_hits"}, ("tier",)),
    _server("kvpool_read_misses", "counter", "Reads of keys the pool does not hold", "misses"),
    _server("kvpool_lookup_keys", "counter", "Keys asked about by existence lookups (a vLLM scheduler's "
            "prefix lookup asks about each block)", "lookup_keys"),
    _server("kvpool_lookup_hits", "counter", "Keys existence lookups found", "lookup_hits"),
    _server("kvpool_evictions", "counter", "Objects evicted, per tier (memory: LRU at the high watermark; disk: "
            "the SSD tier's policy at its quota)", {("memory",): "evictions", ("disk",): "disk_evictions"},
            ("tier",)),
    _server("kvpool_promotions", "counter", "Objects read back from the SSD tier into memory", "promotions"),
    _server("kvpool_allocation_failures", "counter", "Puts refused because memory stayed full after eviction "
            "(everything left is held)", "allocation_failures"),
    _server("kvpool_lease_expirations", "counter", "Reads whose lease expired before the copy was checked: the "
            "reader gets an error, never the bytes", "lease_expired"),
    _server("kvpool_corrupt_objects", "counter", "Objects dropped because their bytes no longer matched their "
            "checksum (memory: a reader reported it and the server confirmed; disk: found at read)",
            {("memory",): "corrupt_objects", ("disk",): "checksum_failures"}, ("tier",)),
    _server("kvpool_disk_write_errors", "counter", "Writes to the SSD tier that failed (the object stays in "
            "memory only)", "disk_write_errors"),
    _server("kvpool_disk_full_events", "counter", "Times the disk filled up below the SSD tier's quota (the "
            "quota is lowered and the tier evicts)", "disk_full_events"),
    _server("kvpool_reclaimed_allocations", "counter", "Puts reclaimed unfinished: their client died or "
            "exceeded --put-timeout", "reclaimed_allocations"),
    _server("kvpool_reaped_clients", "counter", "Clients dropped for not pinging within --client-ttl (their "
            "leases and puts are released)", "reaped_clients"),
    _server("kvpool_accepted_connections", "counter", "Client connections accepted", "connections"),
    _server("kvpool_refused_connections", "counter", "Connections refused or closed before serving, by reason",
            {("peer_credentials",): "refused_peers", ("connection_limit",): "refused_connections",
             ("handshake_evicted",): "evicted_handshakes", ("handshake_timeout",): "handshake_timeouts",
             ("frame_budget",): "frame_budget_refusals", ("request_timeout",): "request_timeouts",
             ("opener_exited",): "orphaned_connections"},
            ("reason",)),
    _server("kvpool_protocol_errors", "counter", "Malformed or out-of-order requests (answered with an error; "
            "the connection survives unless it had not said Hello)", "protocol_errors"),
    _server("kvpool_quota_refusals", "counter", "Leases and allocations refused because a client process was "
            "at --client-max-leases or its pool share", "quota_refusals"),
    _server("kvpool_unpinned_leases", "counter", "Leases granted without pinning: the client was past its pool "
            "share or hold time", "unpinned_leases"),
    _server("kvpool_hold_limit_hits", "counter", "Objects a client process held for --client-max-hold, then had "
            "to let go", "hold_limit_hits"),
    _server("kvpool_lease_bookkeeping_steps", "counter", "Steps of lease bookkeeping (adds, drops, expiry-heap "
            "pops): grows with requests, not with the pool's size", "lease_ops"),
    _server("kvpool_eviction_steps", "counter", "Objects eviction looked at: one per victim with lru (held objects "
            "are never in its list); with s3fifo also each object it moved from one queue to another", "evict_steps"),
    _server("kvpool_tenant_evictions", "counter", "Objects a tenant evicted of its own to stay within its budget "
            "(--tenants-file)", "tenant_evictions"),
    _server("kvpool_tenant_budget_refusals", "counter", "Allocations refused: the tenant was at its budget and "
            "every object of it was held", "tenant_budget_refusals"),
    Series("kvpool_tenant_memory_bytes", "gauge", "Memory a tenant of the tenants file takes (objects and puts "
           "in progress)", "server", ("tenant",)),
    Series("kvpool_tenant_budget_bytes", "gauge", "A tenant's memory budget (the tenants file)", "server", ("tenant",)),
    _server("kvpool_pinned_objects", "gauge", "Objects the operator pinned in memory through the controller "
            "(until their TTL)", "pinned_objects"),
    _server("kvpool_controller_calls", "counter", "Controller calls answered, by call (each that changes the pool "
            "is logged too)", {(op,): f"control_{op}" for op in CONTROL_OPS}, ("op",)),
    _server("kvpool_controller_refusals", "counter", "Controller calls refused: no admin token configured, or a "
            "missing or wrong one", "control_refused"),
    Series("kvpool_request_duration_seconds", "histogram", "Time the server took to answer a request, by "
           "protocol operation (from the request read to the reply written)", "server", ("op",),
           {"op": SERVER_OPS}, buckets=TRANSFER_BUCKETS),
)

# Entries of the server's stats that are not metrics, and why; a test checks that every other
# numeric entry is some series' source.
SERVER_STATS_NOT_EXPORTED = {
    "uptime_s": "process_start_time_seconds (prometheus_client's process collector) says it",
    "server_pid": "a PID is not a measurement",
    "lease_ttl_ms": "a configuration value",
    "client_ttl_s": "a configuration value",
    "gets": "copies out of the arena happen in the clients' processes; only the embedded engine counts them",
}

ROLES = ("prefill", "decode", "mixed")
PROXY_ENDPOINTS = ("completions", "chat_completions")
ROUTING_OUTCOMES = ("decided", "answered", "reported", "hit", "predicted_hit", "predicted_and_hit")

PROXY: tuple[Series, ...] = (
    Series("kvpool_build_info", "gauge", "Always 1: kvpool's version and the component serving this endpoint",
           "proxy", ("version", "component")),
    Series("kvpool_proxy_requests", "counter", "Client requests answered, by endpoint and HTTP status code",
           "proxy", ("endpoint", "code"), {"endpoint": PROXY_ENDPOINTS}),
    Series("kvpool_proxy_response_seconds", "histogram", "Time from a client request's arrival to the start of "
           "its response: for a PD request the prefill plus the decode's first byte (a stream's later tokens "
           "are not included)", "proxy", ("endpoint",), {"endpoint": PROXY_ENDPOINTS}, buckets=RESPONSE_BUCKETS),
    Series("kvpool_proxy_upstream_requests", "counter", "Requests sent to an instance (a retry on another "
           "instance counts there too)", "proxy", ("role", "instance")),
    Series("kvpool_proxy_upstream_failures", "counter", "Requests to an instance that failed: connection error, "
           "timeout or 5xx (the proxy retries on another instance)", "proxy", ("role", "instance")),
    Series("kvpool_proxy_instance_healthy", "gauge", "One while the instance is in rotation (its health probe or a "
           "request succeeded since its last failure), else zero", "proxy", ("role", "instance")),
    Series("kvpool_proxy_instance_in_flight", "gauge", "Requests in flight on the instance (the load the routing "
           "policies balance)", "proxy", ("role", "instance")),
    Series("kvpool_proxy_routing_decisions", "counter", "PD-mixed routing: decisions and their outcomes by "
           "reason (decided; answered 200; reported cached tokens; hit: cached > 0; predicted_hit: the policy "
           "matched a prefix; predicted_and_hit: both)", "proxy", ("reason", "outcome"),
           {"outcome": ROUTING_OUTCOMES}),
    Series("kvpool_proxy_routed_requests", "counter", "PD-mixed routing: decisions and their outcomes by "
           "instance (outcomes as in kvpool_proxy_routing_decisions_total)", "proxy", ("instance", "outcome"),
           {"outcome": ROUTING_OUTCOMES}),
    Series("kvpool_proxy_routed_tokens", "counter", "PD-mixed routing: prompt tokens and the cached tokens the "
           "instances reported for them, by instance", "proxy", ("instance", "kind"),
           {"kind": ("prompt", "cached")}),
)

OPS = ("load", "save")

CONNECTOR: tuple[Series, ...] = (
    Series("vllm:kvpool_build_info", "gauge", "Always 1: the kvpool version this instance runs", "connector",
           ("version",)),
    Series("vllm:kvpool_lookups", "counter", "Prefix lookups in the pool (one per request the scheduler looks "
           "up)", "connector"),
    Series("vllm:kvpool_lookups_skipped", "counter", "Lookups answered as misses without asking worker rank "
           "0, while the lookup channel backs off after a lookup that timed out (a worker stuck on a hung "
           "store)", "connector"),
    Series("vllm:kvpool_lookup_hit_blocks", "counter", "Blocks the pool's lookups found, after those vLLM's "
           "own prefix cache had", "connector"),
    Series("vllm:kvpool_pinned_loads", "counter", "Pool hits of a model with several KV cache groups loaded "
           "in the step that computes, their lookup having pinned them in this instance's memory (`local`); "
           "other such hits wait one engine step, so that a failed load can be recomputed", "connector"),
    Series("vllm:kvpool_prompt_tokens", "counter", "Prompt tokens of the requests the pool was asked about, by "
           "where their KV came from: pool (loaded), local (vLLM's own prefix cache), computed (neither had "
           "it)", "connector", ("source",), {"source": ("pool", "local", "computed")}),
    Series("vllm:kvpool_blocks", "counter", "Blocks moved between vLLM and the pool, by operation and result "
           "(ok; failed; skipped: already pooled; dropped: computed over a block whose load failed)",
           "connector", ("op", "result"), {"op": OPS, "result": ("ok", "failed", "skipped", "dropped")}),
    Series("vllm:kvpool_transferred_bytes", "counter", "KV bytes moved, by operation", "connector", ("op",),
           {"op": OPS}),
    Series("vllm:kvpool_transfer_seconds", "histogram", "Time of one batch transfer (a request's blocks, all "
           "layers or one in layerwise mode), by operation", "connector", ("op",), {"op": OPS},
           buckets=TRANSFER_BUCKETS),
    Series("vllm:kvpool_failures", "counter", "Blocks that failed to load or save, by operation and the "
           "store's error code (docs/backends.md lists the codes)", "connector", ("op", "code"), {"op": OPS}),
    Series("vllm:kvpool_transfer_queue_depth", "gauge", "Transfers waiting for or on the transfer threads "
           "(async loads and background saves), the deepest of the workers at their last report",
           "connector"),
    Series("vllm:kvpool_layer_transfers", "counter", "Layerwise mode: layers the forward pass waited for (load) "
           "and layers sent as they were written (save)", "connector", ("op",), {"op": OPS}),
    Series("vllm:kvpool_store_timeouts", "counter", "Store calls that missed their deadline "
           "(lookup_timeout_s / transfer_timeout_s): counted as misses", "connector"),
    Series("vllm:kvpool_store_calls_skipped", "counter", "Store calls answered without the store while its "
           "circuit breaker was open (breaker_failures / breaker_cooldown_s)", "connector"),
    Series("vllm:kvpool_remote_tier_blocks", "counter", "With remote_backend: blocks served by the remote tier "
           "(hit), copied from it into the host pool (promoted), and the write-through of saved blocks: "
           "written, skipped (the remote store had them), dropped (the queue was full, or the host pool "
           "evicted them first), failed", "connector", ("result",),
           {"result": REMOTE_TIER_RESULTS}),
)

ALL: tuple[Series, ...] = SERVER + PROXY + CONNECTOR
COMPONENTS: dict[Component, tuple[Series, ...]] = {"server": SERVER, "proxy": PROXY, "connector": CONNECTOR}
# Labels vLLM puts on every connector series.
VLLM_LABELS = ("model_name", "engine")


def exposed_labels(series: Series) -> tuple[str, ...]:
    """The labels a scrape shows on ``series``' samples."""
    return (VLLM_LABELS + series.labels) if series.component == "connector" else series.labels


def by_name(component: Component) -> dict[str, Series]:
    return {s.name: s for s in COMPONENTS[component]}


def reference_markdown() -> str:
    """docs/metrics.md: every series, per component (a test keeps the file equal to this)."""
    out = [
        "# Metrics reference",
        "",
        "Every Prometheus series kvpool exports. Generated from `src/kvpool/metrics/catalog.py` "
        "(`python -m kvpool.metrics.catalog > docs/metrics.md`); a test keeps this page equal to it and "
        "checks a live scrape of each component against it.",
        "",
        "- **server**: `kvpool server --metrics-port PORT` serves `/metrics` (and JSON `/stats`, `/healthz`) "
        "on `--metrics-host` (default 127.0.0.1). It also exports prometheus_client's standard `process_*` "
        "series (CPU, memory, open files, start time).",
        "- **proxy**: `kvpool proxy` serves `/metrics` on its own `--host`/`--port`, with the same `process_*` "
        "series.",
        "- **connector**: each vLLM instance's own `/metrics` (`vllm serve`), through vLLM's connector "
        "Prometheus hook; vLLM adds the labels `model_name` and `engine`. The counters arrive with vLLM's "
        "scheduler stats, so they need stats logging on (vLLM's default for `vllm serve`).",
        "",
        "Labels in *italics* take values known only at run time; the others' values are listed and exist "
        "from start-up (at 0).",
        "",
    ]
    for component, series in COMPONENTS.items():
        out += [f"## {component}", "", "| series | type | labels | meaning |", "|---|---|---|---|"]
        for s in series:
            labels = ", ".join(
                f"`{label}` ({'/'.join(s.values[label])})" if label in s.values else f"*`{label}`*"
                for label in s.labels)
            shown = f"`{s.exposed}`" + (" (`_bucket`, `_sum`, `_count`)" if s.kind == "histogram" else "")
            out.append(f"| {shown} | {s.kind} | {labels} | {s.help} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
