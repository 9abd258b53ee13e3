"""One validated configuration object built from `kv_connector_extra_config` and the environment.

Every value is checked here, at start-up, so that a bad config stops vLLM before it serves a
request, with a message that names the key, the value and what is expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from kvpool.errors import ConfigError

BACKENDS = ("local", "server", "mooncake", "yuanrong", "memcache", "redis")
# Backends whose adapters ship in this release; the others are named so the error says so.
IMPLEMENTED_BACKENDS = BACKENDS
ROLES = ("kv_producer", "kv_consumer", "kv_both")
SSD_POLICIES = ("none", "fifo", "lru")

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
# Where `kvpool server` listens and `backend: server` connects unless told otherwise. Per user
# (the socket is mode 0600 by default, so another user's server could not be used anyway) and
# independent of the environment, so a server started from a shell and a vLLM started by a
# service manager agree without configuration.
DEFAULT_SERVER_SOCKET = f"/tmp/kvpool-{os.getuid()}.sock"
# sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(key: str, value: Any) -> int:
    """Parse a byte size as Mooncake does: an int, or "1GB" / "1024MB" / "1048576KB" / "1073741824B".

    Units are binary (1KB = 1024 bytes), as in mooncake.json. Fractions are allowed
    ("1.5GB") and rounded down to whole bytes.
    """
    expected = 'a non-negative byte count: an integer or a number with a unit B/KB/MB/GB/TB, e.g. "4GB"'
    if isinstance(value, bool):
        raise ConfigError(key, value, expected)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, value, expected)
        return value
    if isinstance(value, float):
        if not 0 <= value < float("inf"):  # also rejects NaN
            raise ConfigError(key, value, expected)
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(key, value, expected)


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(key, value, "true or false")


def _parse_int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise ConfigError(key, value, f"an integer >= {minimum}")
    try:
        n = int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, f"an integer >= {minimum}") from None
    if isinstance(value, float) and value != n:
        raise ConfigError(key, value, f"an integer >= {minimum}")
    if n < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")
    return n


def _parse_float(key: str, value: Any, ok: Any, expected: str) -> float:
    """A number (or numeric string) for which `ok(f)` holds; booleans are never numbers here."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, value, expected) from None
    if isinstance(value, bool) or not ok(f):
        raise ConfigError(key, value, expected)
    return f


def _parse_seconds(key: str, value: Any) -> float:
    return _parse_float(key, value, lambda f: 0.0 <= f < float("inf"), "a number of seconds >= 0")


def _parse_ratio(key: str, value: Any) -> float:
    return _parse_float(key, value, lambda f: 0.0 < f <= 1.0, "a number in (0, 1]")


def parse_socket_path(key: str, value: Any) -> str:
    """An absolute Unix socket path that fits in sun_path (107 bytes)."""
    expected = f"an absolute Unix socket path of at most {_MAX_SOCKET_PATH} bytes, e.g. {DEFAULT_SERVER_SOCKET!r}"
    if not isinstance(value, str) or not value or "\0" in value or not os.path.isabs(value):
        raise ConfigError(key, value, expected)
    if len(os.fsencode(value)) > _MAX_SOCKET_PATH:
        raise ConfigError(key, value, expected)
    return value


def parse_layer_partition(key: str, value: Any, pp_size: int) -> list[int]:
    """`prefill_pp_layer_partition` ("30,31") -> [30, 31]: one positive count per prefill stage."""
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        counts = [int(str(p).strip()) for p in parts]
    except ValueError:
        raise ConfigError(key, value, 'comma-separated layer counts, e.g. "30,31"') from None
    if len(counts) != pp_size or any(c <= 0 for c in counts):
        raise ConfigError(
            key, value, f"{pp_size} positive layer counts, one per prefill PP stage (prefill_pp_size={pp_size})"
        )
    return counts


@dataclasses.dataclass(frozen=True)
class LocalBackendConfig:
    """The embedded pool engine (`backend: local`): memory tier plus optional SSD tier."""

    local_cpu_size: int = 2 << 30
    eviction_high_watermark_ratio: float = 0.9
    eviction_ratio: float = 0.1
    default_kv_lease_ttl_ms: int = 11000
    ssd_offload_path: str | None = None
    ssd_quota: int = 0  # 0: 90% of the disk's free space when the pool starts, as Mooncake's bucket backend
    ssd_eviction_policy: str = "lru"


@dataclasses.dataclass(frozen=True)
class RedisBackendConfig:
    """`backend: redis`: a Redis (or Valkey) server the operator already runs."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_ttl_s: float = 0.0  # 0: objects never expire (Redis' maxmemory-policy evicts them)
    # Values above this are split into chunk keys; well under Redis' proto-max-bulk-len (512MB).
    redis_chunk_size: int = 64 << 20
    redis_timeout_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class KVPoolConfig:
    """Everything kvpool reads from `kv_connector_extra_config` (and `kv_role`)."""

    kv_role: str = "kv_both"
    backend: str = "local"
    lookup_rpc_port: int = 0
    load_async: bool = False
    consumer_is_to_load: bool = False
    consumer_is_to_put: bool = False
    producer_is_to_load: bool = False
    # Finish a step's saves before the step returns. On by default for producers: in PD
    # disaggregation the proxy sends the decode request the moment the prefill answers, so the
    # prefill's blocks must already be findable then.
    save_sync: bool = False
    prefill_pp_size: int | None = None
    prefill_pp_layer_partition: tuple[int, ...] | None = None
    discard_partial_chunks: bool = True
    local: LocalBackendConfig = dataclasses.field(default_factory=LocalBackendConfig)
    # `backend: server`: the Unix socket of `kvpool server` (same default as its --socket).
    server_socket: str = DEFAULT_SERVER_SOCKET
    # Test aid: fail every Nth block read (0 = never). Lets the test suite exercise the
    # load-failure paths of vLLM (recompute / fail) against a real store.
    inject_load_failure_every: int = 0
    stats_log_interval_s: float = 10.0
    redis: RedisBackendConfig = dataclasses.field(default_factory=RedisBackendConfig)
    # The distributed backends' own files; unset: the spec's environment variable names them
    # (MOONCAKE_CONFIG_PATH, YR_CONFIG_PATH, MMC_LOCAL_CONFIG_PATH). Read when the backend is built.
    mooncake_config_path: str | None = None
    yuanrong_config_path: str | None = None
    mmc_local_config_path: str | None = None

    @property
    def saves(self) -> bool:
        """Whether this instance writes KV to the pool."""
        if self.kv_role == "kv_consumer":
            return self.consumer_is_to_put
        return True

    @property
    def loads(self) -> bool:
        """Whether this instance looks up and loads KV from the pool.

        A producer (prefill node) only saves unless `producer_is_to_load` lets it reuse pooled
        prefixes too; a consumer (decode node) only loads with `consumer_is_to_load`.
        """
        if self.kv_role == "kv_both":
            return True
        if self.kv_role == "kv_producer":
            return self.producer_is_to_load
        return self.consumer_is_to_load


_LOCAL_KEYS = {f.name for f in dataclasses.fields(LocalBackendConfig)}
_REDIS_KEYS = {f.name for f in dataclasses.fields(RedisBackendConfig)}
_TOP_KEYS = {f.name for f in dataclasses.fields(KVPoolConfig)} - {"kv_role", "local", "redis"}
# Accepted for compatibility with the reference connector's configs.
_ALIASES = {"mooncake_rpc_port": "lookup_rpc_port", "default_kv_lease_ttl": "default_kv_lease_ttl_ms"}


def load_config(extra: Mapping[str, Any] | None, kv_role: str | None = "kv_both") -> KVPoolConfig:
    """Validate `kv_connector_extra_config` into a `KVPoolConfig`; raise `ConfigError` on the first bad value."""
    extra = dict(extra or {})
    role = kv_role or "kv_both"
    if role not in ROLES:
        raise ConfigError("kv_role", role, f"one of {', '.join(ROLES)}")
    for old, new in _ALIASES.items():
        if old in extra:
            if new in extra:
                raise ConfigError(old, extra[old], f"not both {old} and {new}; use {new}")
            extra[new] = extra.pop(old)
    unknown = sorted(set(extra) - _TOP_KEYS - _LOCAL_KEYS - _REDIS_KEYS)
    if unknown:
        known = ", ".join(sorted(_TOP_KEYS | _LOCAL_KEYS | _REDIS_KEYS))
        raise ConfigError(unknown[0], extra[unknown[0]], f"a known kv_connector_extra_config key ({known})")

    backend = extra.get("backend", "local")
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"one of {', '.join(BACKENDS)}")
    if backend not in IMPLEMENTED_BACKENDS:
        raise ConfigError(
            "backend", backend, f"a backend this kvpool release ships: {', '.join(IMPLEMENTED_BACKENDS)}"
        )

    pp_size = None
    if extra.get("prefill_pp_size") is not None:
        pp_size = _parse_int("prefill_pp_size", extra["prefill_pp_size"], minimum=1)
    partition = None
    if extra.get("prefill_pp_layer_partition") is not None:
        if pp_size is None:
            raise ConfigError(
                "prefill_pp_layer_partition", extra["prefill_pp_layer_partition"], "to be set with prefill_pp_size"
            )
        partition = tuple(parse_layer_partition("prefill_pp_layer_partition", extra["prefill_pp_layer_partition"], pp_size))

    discard = _parse_bool("discard_partial_chunks", extra.get("discard_partial_chunks", True))
    if not discard:
        raise ConfigError(
            "discard_partial_chunks", extra["discard_partial_chunks"],
            "true: a partial block has no stable block hash, so only full blocks can be pooled",
        )

    local = _load_local(extra)
    return KVPoolConfig(
        kv_role=role,
        backend=backend,
        lookup_rpc_port=_parse_int("lookup_rpc_port", extra.get("lookup_rpc_port", 0)),
        load_async=_parse_bool("load_async", extra.get("load_async", False)),
        consumer_is_to_load=_parse_bool("consumer_is_to_load", extra.get("consumer_is_to_load", False)),
        consumer_is_to_put=_parse_bool("consumer_is_to_put", extra.get("consumer_is_to_put", False)),
        producer_is_to_load=_parse_bool("producer_is_to_load", extra.get("producer_is_to_load", False)),
        save_sync=_parse_bool("save_sync", extra.get("save_sync", role == "kv_producer")),
        prefill_pp_size=pp_size,
        prefill_pp_layer_partition=partition,
        discard_partial_chunks=discard,
        local=local,
        server_socket=parse_socket_path("server_socket", extra.get("server_socket", DEFAULT_SERVER_SOCKET)),
        inject_load_failure_every=_parse_int(
            "inject_load_failure_every", extra.get("inject_load_failure_every", 0)
        ),
        stats_log_interval_s=_parse_seconds("stats_log_interval_s", extra.get("stats_log_interval_s", 10)),
        redis=_load_redis(extra),
        mooncake_config_path=_parse_file_path("mooncake_config_path", extra.get("mooncake_config_path")),
        yuanrong_config_path=_parse_file_path("yuanrong_config_path", extra.get("yuanrong_config_path")),
        mmc_local_config_path=_parse_file_path("mmc_local_config_path", extra.get("mmc_local_config_path")),
    )


def _load_local(extra: Mapping[str, Any]) -> LocalBackendConfig:
    d = LocalBackendConfig()
    size = parse_size("local_cpu_size", extra.get("local_cpu_size", d.local_cpu_size))
    if size < 1 << 20:
        raise ConfigError("local_cpu_size", extra.get("local_cpu_size"), "a byte size of at least 1MB, e.g. \"4GB\"")
    hw = _parse_ratio("eviction_high_watermark_ratio", extra.get("eviction_high_watermark_ratio", d.eviction_high_watermark_ratio))
    er = _parse_ratio("eviction_ratio", extra.get("eviction_ratio", d.eviction_ratio))
    ttl = _parse_int("default_kv_lease_ttl_ms", extra.get("default_kv_lease_ttl_ms", d.default_kv_lease_ttl_ms), minimum=1)
    path = extra.get("ssd_offload_path")
    if path is not None:
        path = str(path)
        from kvpool.paths import validate_offload_path

        validate_offload_path(path)
    quota = parse_size("ssd_quota", extra.get("ssd_quota", 0))
    policy = str(extra.get("ssd_eviction_policy", d.ssd_eviction_policy))
    if policy not in SSD_POLICIES:
        raise ConfigError("ssd_eviction_policy", policy, f"one of {', '.join(SSD_POLICIES)}")
    if path is None and ("ssd_quota" in extra or "ssd_eviction_policy" in extra):
        key = "ssd_quota" if "ssd_quota" in extra else "ssd_eviction_policy"
        raise ConfigError(key, extra[key], "to be used with ssd_offload_path (the SSD tier is off without it)")
    return LocalBackendConfig(
        local_cpu_size=size,
        eviction_high_watermark_ratio=hw,
        eviction_ratio=er,
        default_kv_lease_ttl_ms=ttl,
        ssd_offload_path=path,
        ssd_quota=quota,
        ssd_eviction_policy=policy,
    )


def _parse_file_path(key: str, value: Any) -> str | None:
    """An optional absolute path of an existing file (a backend's config file)."""
    if value is None:
        return None
    if not isinstance(value, str) or not os.path.isabs(value):
        raise ConfigError(key, value, "an absolute path of an existing file, e.g. /etc/kvpool/mooncake.json")
    if not os.path.isfile(value):
        raise ConfigError(key, value, "an existing file (it does not exist or is not a regular file)")
    return value


def _load_redis(extra: Mapping[str, Any]) -> RedisBackendConfig:
    d = RedisBackendConfig()
    url = extra.get("redis_url", d.redis_url)
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url", url, "a URL redis://[user:password@]host:port/db, rediss://... or unix:///path.sock")
    chunk = parse_size("redis_chunk_size", extra.get("redis_chunk_size", d.redis_chunk_size))
    if not 1 << 20 <= chunk <= 512 << 20:
        raise ConfigError("redis_chunk_size", extra.get("redis_chunk_size"),
                          "a byte size from 1MB to 512MB (Redis' proto-max-bulk-len), e.g. \"64MB\"")
    timeout = _parse_float("redis_timeout_s", extra.get("redis_timeout_s", d.redis_timeout_s),
                           lambda f: 0.0 < f < float("inf"), "a number of seconds > 0")
    return RedisBackendConfig(
        redis_url=url,
        redis_ttl_s=_parse_seconds("redis_ttl_s", extra.get("redis_ttl_s", d.redis_ttl_s)),
        redis_chunk_size=chunk,
        redis_timeout_s=timeout,
    )
