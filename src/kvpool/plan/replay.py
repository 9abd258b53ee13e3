"""Replaying a trace through one shared pool, and the hit counts a replay produces.

Hit accounting is vLLM's: a request's hits are the leading run of its blocks found, tier by
tier in the order a load looks (an instance's local prefix cache, then pool memory, then pool
SSD); the first block found nowhere ends the run, and it and every block after it are
recomputed (and then stored), even those a tier happens to hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.plan.pool import PoolModel
from kvpool.tracefile import Trace

TIERS = ("local", "memory", "ssd", "recomputed")


@dataclass
class HitCounts:
    """Block references by where they were found; ``recomputed`` is what no tier had."""

    blocks: int = 0
    local: int = 0
    memory: int = 0
    ssd: int = 0

    @property
    def recomputed(self) -> int:
        return self.blocks - self.local - self.memory - self.ssd

    def add(self, blocks: int, local: int = 0, memory: int = 0, ssd: int = 0) -> None:
        self.blocks += blocks
        self.local += local
        self.memory += memory
        self.ssd += ssd

    def rates(self) -> dict[str, float]:
        """Each tier's share of all block references (they sum to 1)."""
        total = self.blocks or 1
        return {tier: getattr(self, tier) / total for tier in TIERS}

    def as_dict(self) -> dict[str, object]:
        return {"blocks": self.blocks, **{t: getattr(self, t) for t in TIERS}, "rates": self.rates()}


@dataclass
class Point:
    """One replay: its settings (memory/SSD bytes, and for a cluster the policy and instances),
    its counts, and how long it took."""

    memory_bytes: int
    ssd_bytes: int
    counts: HitCounts
    seconds: float
    policy: str | None = None
    instances: int | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"memory_bytes": self.memory_bytes, "ssd_bytes": self.ssd_bytes}
        if self.policy is not None:
            out.update(policy=self.policy, instances=self.instances)
        out.update(self.counts.as_dict())
        out.update(seconds=round(self.seconds, 3), **self.extra)
        return out


def request_keys(trace: Trace, copy: int = 0) -> list[list[str]]:
    """Pool keys per request: the hash ids as strings (copy ``c`` of a replicated trace gets
    keys of its own, ``c/id``, so copies share nothing)."""
    if copy:
        return [[f"{copy}/{h}" for h in r.hash_ids] for r in trace.requests]
    return [[str(h) for h in r.hash_ids] for r in trace.requests]


def replay_pool(keys: Sequence[Sequence[str]], pool: PoolModel) -> tuple[HitCounts, float]:
    """Every request straight to the pool (no local cache): counts and seconds taken."""
    counts = HitCounts()
    began = time.perf_counter()
    for req in keys:
        mem, ssd = pool.serve(req)
        counts.add(len(req), memory=mem, ssd=ssd)
    return counts, time.perf_counter() - began
