"""Every backend, declared once: its name and config schema (a `BackendSettings` subclass in
`kvpool.config`), its factory, its `kvpool doctor` check and its capabilities.

The config's list of backend names, `create_backend`, `kvpool doctor`, the conformance suite
and docs/backends.md's table all derive from `REGISTRY`. Factories and checks are named by
"module:attribute" and imported on use, so a store's client library is loaded only by the
process that chose that store.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvpool.backends.base import Backend
from kvpool.backends.guard import GuardSettings
from kvpool.backends.tiered import TieredBackend
from kvpool.store.memcopy import auto_threads
from kvpool.config import (
    BackendSettings,
    KVPoolConfig,
    LocalSettings,
    MemcacheSettings,
    MooncakeSettings,
    RedisSettings,
    ServerClientSettings,
    YuanrongSettings,
    backend_schemas,
)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Where a store's semantics differ (the conformance suite adapts its assertions to these).

    - `leases`: a lookup with `lease=True` protects a hit from eviction for the lease TTL.
    - `exact_lru`: eviction takes the least recently used object first (others approximate it).
    - `evicts_on_refused_put`: a put that does not fit may evict other objects and still fail.
    - `shared_across_processes`: every process of an instance sees the same pool (TP/PP > 1).
    - `put_reports_existing`: a put of a stored key answers OBJECT_ALREADY_EXISTS. Stores whose
      client answers 0 for a key it skipped (Mooncake 0.3.13 measured, Memcache 1.3 in its
      source; both put-if-absent) say OK for both; either way nothing is overwritten.
    - `remote`: calls leave this process and can hang, so they run under deadlines behind a
      circuit breaker (`backends.guard`); `local` answers from this process's memory.
    """

    leases: bool
    exact_lru: bool
    evicts_on_refused_put: bool
    shared_across_processes: bool
    put_reports_existing: bool = True
    remote: bool = True


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """One backend. `factory(settings, client_name) -> Backend`; `doctor(config, args, report)`."""

    schema: type[BackendSettings]
    factory: str
    doctor: str
    capabilities: Capabilities
    summary: str

    @property
    def name(self) -> str:
        return self.schema.backend


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


REGISTRY: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec(
        LocalSettings, "kvpool.backends.local:LocalBackend", "kvpool.backends.local:doctor",
        Capabilities(leases=True, exact_lru=True, evicts_on_refused_put=False, shared_across_processes=False,
                     remote=False),
        "the pool engine inside the vLLM worker: memory tier + optional SSD tier",
    ),
    BackendSpec(
        ServerClientSettings, "kvpool.backends.pool_server:ServerBackend.from_settings",
        "kvpool.backends.pool_server:doctor",
        Capabilities(leases=True, exact_lru=True, evicts_on_refused_put=False, shared_across_processes=True),
        "`kvpool server`: one pool per host in shared memory, every instance maps it",
    ),
    BackendSpec(
        MooncakeSettings, "kvpool.backends.mooncake:MooncakeBackend.from_settings", "kvpool.backends.mooncake:doctor",
        Capabilities(leases=True, exact_lru=True, evicts_on_refused_put=True, shared_across_processes=True,
                     put_reports_existing=False),
        "Mooncake Store (mooncake_master + per-process segments), over TCP here",
    ),
    BackendSpec(
        YuanrongSettings, "kvpool.backends.yuanrong:YuanrongBackend.from_settings", "kvpool.backends.yuanrong:doctor",
        Capabilities(leases=False, exact_lru=False, evicts_on_refused_put=True, shared_across_processes=True),
        "openYuanrong datasystem (a worker per host, KVClient)",
    ),
    BackendSpec(
        MemcacheSettings, "kvpool.backends.memcache:MemcacheBackend.from_settings", "kvpool.backends.memcache:doctor",
        Capabilities(leases=True, exact_lru=False, evicts_on_refused_put=True, shared_across_processes=True,
                     put_reports_existing=False),
        "Memcache (memcache-hybrid); its local service needs the Ascend driver",
    ),
    BackendSpec(
        RedisSettings, "kvpool.backends.redis:RedisBackend", "kvpool.backends.redis:doctor",
        Capabilities(leases=False, exact_lru=False, evicts_on_refused_put=False, shared_across_processes=True),
        "Redis or Valkey (maxmemory-policy evicts)",
    ),
)}

assert set(REGISTRY) == set(backend_schemas()), "every BackendSettings subclass needs a registry entry"


def create_backend(config: KVPoolConfig, client_name: str) -> Backend:
    """Build the backend `config.backend` names, from its own settings; with `remote_backend`,
    that host pool in front of the remote store (`backends.tiered`)."""
    backend = _create(config, config.backend, config.backend_settings, client_name)
    if config.remote_backend is None:
        return backend
    assert config.remote_settings is not None
    try:
        remote = _create(config, config.remote_backend, config.remote_settings, client_name)
    except BaseException:
        backend.close()
        raise
    return TieredBackend(backend, remote, config.remote_queue_blocks)


def _create(config: KVPoolConfig, name: str, settings: BackendSettings, client_name: str) -> Backend:
    spec = REGISTRY[name]
    backend: Backend = _resolve(spec.factory)(settings, client_name)
    backend.use_copy_threads(config.copy_threads or auto_threads())
    if spec.capabilities.remote:
        backend.use_guard(GuardSettings(
            lookup_timeout_s=config.lookup_timeout_s, transfer_timeout_s=config.transfer_timeout_s,
            failures=config.breaker_failures, cooldown_s=config.breaker_cooldown_s,
            cooldown_max_s=max(30.0, config.breaker_cooldown_s)))
    return backend


def doctor_check(name: str) -> Any:
    """The `kvpool doctor` check of backend `name`."""
    return _resolve(REGISTRY[name].doctor)


def capability_table() -> str:
    """docs/backends.md's capability table, from the registry (a test keeps the doc equal to it)."""
    names = list(REGISTRY)
    yes_no = {True: "yes", False: "no"}
    rows = [
        ("`leases`: a leased object is never evicted; a pool full of leased objects refuses puts", "leases"),
        ("`exact_lru`: eviction takes the least recently used first, strictly", "exact_lru"),
        ("`evicts_on_refused_put`: a put refused for room may have evicted others first", "evicts_on_refused_put"),
        ("`shared_across_processes`: every worker process sees one pool (TP/PP > 1)", "shared_across_processes"),
        ("`put_reports_existing`: a put of a stored key answers OBJECT_ALREADY_EXISTS (else OK)",
         "put_reports_existing"),
        ("`remote`: calls leave the process: deadlines and a circuit breaker bound them", "remote"),
    ]
    lines = ["| capability | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for text, attr in rows:
        lines.append(f"| {text} | " + " | ".join(yes_no[getattr(REGISTRY[n].capabilities, attr)] for n in names) + " |")
    return "\n".join(lines)
