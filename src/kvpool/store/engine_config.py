"""The pool engine's settings, and the one check of them every engine runs at start."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.store.disk import DiskTier
from kvpool.store.policy import MEMORY_POLICIES, MemoryPolicy


@dataclass
class EngineConfig:
    """Engine settings; names follow the spec's mooncake_master flags.

    ``disk_write_through``: every committed object is also queued for the disk
    tier, so eviction is a cheap drop and a restart finds everything; without it
    the disk tier only receives objects at eviction (spill) time.
    ``reap_interval_s``: how often a background thread calls ``reap``; 0 turns
    the thread off (tests with an injected clock call ``reap`` themselves).

    Fair sharing between clients (``kvpool server`` sets these; the defaults
    turn them off for the single-client ``local`` backend), per owner:
    ``client_pool_share`` caps the bytes of pinned (leased) objects plus
    uncommitted allocations as a fraction of the capacity (1.0: no cap; leases
    past it are granted without pinning, allocations refused);
    ``client_max_leases`` caps the number of leases plus allocations (0: none);
    ``client_max_hold_s`` caps how long one object may stay continuously leased
    (0: no cap). ``object_overhead_bytes`` is charged to the memory budget per
    object on top of its key's UTF-8 bytes, so metadata is not free;
    ``max_key_bytes`` bounds a stored key.
    ``prefault``: with the engine's own arena (none passed in), map its pages on a background
    thread from the start to a look-ahead past the highest allocation (store/prefault.py), so
    writes into the pool do not take page faults; the planner, which writes no bytes, turns it off.
    ``eviction_policy``: which evictable object goes first (``store/policy.py``): ``lru``, or
    ``s3fifo``, which keeps objects used twice from being flushed by a scan of one-off ones.
    ``tenant_budgets``: tenant tag (``kvpool.keys.tenant_tag`` of a cache_salt) -> the bytes of
    memory its objects may take; its own objects are evicted first past it (``store/tenants.py``).
    """

    memory_size: int
    eviction_high_watermark_ratio: float = 0.9
    eviction_ratio: float = 0.1
    default_kv_lease_ttl_ms: int = 5000
    client_ttl_s: float = 10.0
    put_timeout_s: float = 30.0
    disk: DiskTier | None = None
    disk_write_through: bool = True
    alignment: int = 64
    reap_interval_s: float = 1.0
    disk_queue_size: int = 1024
    client_pool_share: float = 1.0
    client_max_leases: int = 0
    client_max_hold_s: float = 0.0
    object_overhead_bytes: int = 0
    max_key_bytes: int = 4096
    prefault: bool = True
    eviction_policy: MemoryPolicy = "lru"
    tenant_budgets: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field, its value and what is expected."""

        def positive(name: str, value: object, kind: type | tuple[type, ...], expected: str) -> None:
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:  # type: ignore[operator]
                raise ConfigError(key=name, value=value, expected=expected)

        positive("memory_size", self.memory_size, int, "a positive int of bytes, e.g. 4294967296 (4 GiB)")
        positive("alignment", self.alignment, int, "a positive int of bytes, e.g. 64")
        if self.memory_size < self.alignment:
            raise ConfigError(
                key="memory_size",
                value=self.memory_size,
                expected=f"at least alignment={self.alignment} bytes (e.g. 4GB)",
            )
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(key=name, value=value, expected="a ratio in (0, 1], e.g. 0.9 / 0.1")
        positive("default_kv_lease_ttl", self.default_kv_lease_ttl_ms, int,
                 "a positive int of milliseconds, e.g. 5000")
        positive("client_ttl", self.client_ttl_s, (int, float), "positive seconds, e.g. 10")
        positive("put_timeout_s", self.put_timeout_s, (int, float), "positive seconds, e.g. 30")
        positive("disk_queue_size", self.disk_queue_size, int, "a positive int, e.g. 1024")
        positive("max_key_bytes", self.max_key_bytes, int, "a positive int of bytes, e.g. 4096")
        share = self.client_pool_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(key="client_pool_share", value=share, expected="a ratio in (0, 1], e.g. 0.5")
        for name in ("client_max_leases", "object_overhead_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key=name, value=value, expected="an int >= 0 (0: off)")
        hold = self.client_max_hold_s
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or hold < 0:
            raise ConfigError(key="client_max_hold_s", value=hold, expected="seconds >= 0 (0: no cap)")
        if isinstance(self.reap_interval_s, bool) or not isinstance(self.reap_interval_s, (int, float)) \
                or self.reap_interval_s < 0:
            raise ConfigError(
                key="reap_interval_s", value=self.reap_interval_s, expected="seconds >= 0 (0 disables)"
            )
        if self.eviction_policy not in MEMORY_POLICIES:
            raise ConfigError(key="eviction_policy", value=self.eviction_policy,
                              expected=f"one of {', '.join(sorted(MEMORY_POLICIES))}")
        for tenant, budget in self.tenant_budgets.items():
            if isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= self.memory_size:
                raise ConfigError(key=f"tenant_budgets[{tenant}]", value=budget,
                                  expected=f"a positive int of bytes, at most memory_size={self.memory_size}")
        if self.disk is not None and not isinstance(self.disk, DiskTier):
            raise ConfigError(key="disk", value=self.disk, expected="a DiskTier or None")
