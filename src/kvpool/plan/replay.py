"""Replaying a trace through one shared pool, and the hit counts a replay produces.

Hit accounting is vLLM's: a request's hits are the leading run of its blocks found, tier by
tier in the order a load looks (an instance's local prefix cache, then pool memory, then pool
SSD, then the remote tier behind the host pool); the first block found nowhere ends the run, and it and every block after it are
recomputed (and then stored), even those a tier happens to hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.plan.pool import PoolModel
from kvpool.tracefile import Trace

TIERS = ("local", "memory", "ssd", "remote", "recomputed")


@dataclass
class HitCounts:
    """Block references by where they were found; ``recomputed`` is what no tier had."""

    blocks: int = 0
    local: int = 0
    memory: int = 0
    ssd: int = 0
    remote: int = 0

    @property
    def recomputed(self) -> int:
        return self.blocks - self.local - self.memory - self.ssd - self.remote

    def add(self, blocks: int, local: int = 0, memory: int = 0, ssd: int = 0, remote: int = 0) -> None:
        self.blocks += blocks
        self.local += local
        self.memory += memory
        self.ssd += ssd
        self.remote += remote

    def rates(self) -> dict[str, float]:
        """Each tier's share of all block references (they sum to 1)."""
        total = self.blocks or 1
        return {tier: getattr(self, tier) / total for tier in TIERS}

    def as_dict(self) -> dict[str, object]:
        return {"blocks": self.blocks, **{t: getattr(self, t) for t in TIERS}, "rates": self.rates()}


@dataclass
class Point:
    """One replay: its settings (memory/SSD bytes per host pool, the remote tier's bytes, and
    for a cluster the policy, instances and hosts), its counts, and how long it took."""

    memory_bytes: int
    ssd_bytes: int
    counts: HitCounts
    seconds: float
    policy: str | None = None
    instances: int | None = None
    extra: dict[str, object] = field(default_factory=dict)
    remote_bytes: int = 0
    hosts: int = 1

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"memory_bytes": self.memory_bytes, "ssd_bytes": self.ssd_bytes,
                                  "remote_bytes": self.remote_bytes}
        if self.policy is not None:
            out.update(policy=self.policy, instances=self.instances, hosts=self.hosts)
        out.update(self.counts.as_dict())
        out.update(seconds=round(self.seconds, 3), **self.extra)
        return out


def request_keys(trace: Trace, copy: int = 0) -> list[list[str]]:
    """Pool keys per request: the hash ids as strings (copy ``c`` of a replicated trace gets
    keys of its own, ``c/id``, so copies share nothing)."""
    if copy:
        return [[f"{copy}/{h}" for h in r.hash_ids] for r in trace.requests]
    return [[str(h) for h in r.hash_ids] for r in trace.requests]


def answer_keys(trace: Trace, copy: int = 0) -> list[list[str]]:
    """Per request, the pool keys of the blocks its answer fills, as decode-cache saving
    (`save_decode_cache`) would store them when it finishes; [] where the trace cannot say.

    A trace names a prompt's blocks only, so an answer's blocks are read off the conversation's
    next turn: the first later request that holds this request's whole prompt blocks as its own
    leading blocks (a chat's next prompt is the last prompt, its answer and a new message), at
    the positions the answer's tokens fill there, up to the last whole block of prompt + answer
    (the last token's KV is never computed). That assumes the next turn carries the answer
    verbatim, as chat templates do.
    """
    block = trace.block_size
    reqs = trace.requests
    # (length, id at length - 1) -> requests whose first `length` ids end in that id. Equal ids
    # are equal prefixes (an id stands for its whole prefix), so the pair names one prefix.
    continuing: dict[tuple[int, int], list[int]] = {}
    for q, r in enumerate(reqs):
        for j, h in enumerate(r.hash_ids):
            continuing.setdefault((j + 1, h), []).append(q)
    prefix = (lambda h: f"{copy}/{h}") if copy else str
    out: list[list[str]] = []
    for i, r in enumerate(reqs):
        whole = r.input_length // block
        end = (r.input_length + r.output_length - 1) // block
        nxt = next((q for q in continuing.get((whole, r.hash_ids[whole - 1]), ()) if q > i), None) \
            if 0 < whole <= len(r.hash_ids) and end > whole else None
        out.append([prefix(h) for h in reqs[nxt].hash_ids[whole:end]] if nxt is not None else [])
    return out


def replay_pool(keys: Sequence[Sequence[str]], pool: PoolModel,
                answers: Sequence[Sequence[str]] | None = None) -> tuple[HitCounts, float]:
    """Every request straight to the pool (no local cache): counts and seconds taken. With
    ``answers`` (`answer_keys`), each request also stores its answer's blocks when it is done."""
    counts = HitCounts()
    began = time.perf_counter()
    for i, req in enumerate(keys):
        mem, ssd, remote = pool.serve(req)
        counts.add(len(req), memory=mem, ssd=ssd, remote=remote)
        if answers is not None and answers[i]:
            pool.serve(answers[i])  # a store: these are not references of a prompt
    return counts, time.perf_counter() - began
