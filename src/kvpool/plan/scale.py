"""Real pool capacities as a small engine that makes the same eviction decisions.

A real memory tier holds hundreds of GiB; the planner never writes a byte, but the engine still
maps an arena of ``memory_size`` bytes. So each block becomes an object of ``k`` alignment units
and the arena shrinks by the same factor. Why the scaled engine evicts exactly what the real one
would, block for block, when every block has the same size (the planner's model: one pool key
per block, ``kv_bytes_per_token * block_size`` bytes each):

* what the engine charges an object is ``reserved_size(size + _meta_charge(key))``. In the
  real pool that is ``R = round_up(block_bytes + object_overhead, alignment)`` (the server
  charges 1 KiB plus the key's bytes per object, the ``local`` backend nothing; pass
  ``object_overhead`` to include it). The scaled engine runs with ``object_overhead_bytes=0``,
  which makes ``ArenaIndex.meta_charge`` 0 (key bytes included), and stores objects of exactly
  ``k * alignment`` bytes, so nothing is rounded: every object costs ``k`` units;
* eviction (``ArenaIndex._make_room``) depends on the objects' sizes through two comparisons
  only. *Over the high watermark*: ``used + R > ratio * capacity``, i.e. with ``m`` objects
  stored, ``(m + 1) * R > ratio * C``; it first holds at some count ``h``. *No room*: the
  allocator is first-fit and every object has one size, so every free range starts on an
  object boundary and is a whole number of objects long, except the one at the end, which
  also holds the ``C mod R`` bytes no object fits in; a range of ``R`` bytes is free exactly
  while ``m < n = C // R``. How many objects an eviction takes (``eviction_ratio`` of the
  object count) and which (the LRU order, held objects skipped) do not depend on sizes. Under
  ``s3fifo`` they do in two more places: its small queue's share (10% of the capacity) and its
  ghost's bound are compared in bytes, so the scaled engine's thresholds may fall one object
  off the real one's (``n + j/k`` against ``C/R``): its hit rates are close, not exact;
* so two engines whose objects differ in size make the same decisions when they have the
  same ``n`` and the same ``h``. ``scale_memory`` picks the smallest ``k`` (1, 2, 4, ...) and a
  scaled capacity ``n * k + j`` units (``0 <= j < k``, ``j/k`` near ``C/R - n``) for which both
  are equal, checked with the engine's own float comparison; the replay releases every lease
  at once, so nothing is held and the "could eviction make room at all" check always passes
  (``n >= 1``).

What this does not model: objects of several sizes in one pool (layerwise keys, other models),
and lookup leases pinning objects between a lookup and its load (loads follow lookups at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.store import EngineConfig
from kvpool.store.policy import MemoryPolicy

_MAX_UNITS = 1 << 12  # k; a match is found far below it for any ratio the config accepts
ALIGNMENT = EngineConfig.alignment  # the engine's default, as every deployment runs it


@dataclass(frozen=True)
class ScaledMemory:
    """A real memory tier and the scaled engine config that evicts as it would."""

    memory_bytes: int  # what was asked for
    object_bytes: int  # R: what one block costs the real tier
    capacity_objects: int  # n: blocks the real tier holds at most
    watermark_objects: int  # h: objects stored when the next put first passes the high watermark
    units_per_object: int  # k
    config: EngineConfig

    @property
    def object_size(self) -> int:
        """Bytes each block is allocated with in the scaled engine."""
        return self.units_per_object * self.config.alignment


def _first_over(object_bytes: int, capacity: int, ratio: float) -> int:
    """The object count ``m`` at which a put first passes the high watermark, by the engine's
    own comparison ``used + need > ratio * capacity``."""
    high = ratio * capacity
    m = max(0, int(high // object_bytes) - 1)
    while (m + 1) * object_bytes <= high:
        m += 1
    while m > 0 and m * object_bytes > high:
        m -= 1
    return m


def scale_memory(memory_bytes: int, block_bytes: int, *, object_overhead: int = 0,
                 high_watermark: float = 0.9, eviction_ratio: float = 0.1,
                 alignment: int = ALIGNMENT, eviction_policy: MemoryPolicy = "lru") -> ScaledMemory:
    """The scaled engine config for a real tier of ``memory_bytes`` holding ``block_bytes`` blocks
    (see the module docstring for why its decisions are the real tier's)."""
    if memory_bytes < alignment:
        raise ConfigError("memory", memory_bytes, f"at least {alignment} bytes, e.g. 4GB")
    if block_bytes <= 0:
        raise ConfigError("kv_bytes_per_token", block_bytes, "a positive byte count per token, e.g. 160KB")
    capacity = memory_bytes - memory_bytes % alignment
    r = max(1, -(-(block_bytes + object_overhead) // alignment)) * alignment
    n = capacity // r
    h = _first_over(r, capacity, high_watermark)
    frac = capacity / r - n
    k = 1
    while k <= _MAX_UNITS:
        for j in sorted({min(k - 1, int(frac * k)), min(k - 1, int(frac * k) + 1)}):
            units = n * k + j
            if units == 0:
                continue
            scaled = units * alignment
            if scaled // (k * alignment) == n and _first_over(k * alignment, scaled, high_watermark) == h:
                config = EngineConfig(
                    memory_size=scaled, alignment=alignment,
                    eviction_high_watermark_ratio=high_watermark, eviction_ratio=eviction_ratio,
                    eviction_policy=eviction_policy, object_overhead_bytes=0, reap_interval_s=0, disk=None,
                    client_pool_share=1.0, client_max_leases=0, client_max_hold_s=0.0, prefault=False,
                )
                return ScaledMemory(memory_bytes, r, n, h, k, config)
        k *= 2
    raise ConfigError("memory", memory_bytes,
                      f"a size the planner can scale (no k <= {_MAX_UNITS} matches n={n}, h={h}); "
                      f"try a slightly different size")
