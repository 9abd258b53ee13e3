"""Replaying a trace over N vLLM instances that share a pool, routed by a ``routing`` policy.

The instances share one pool, or run on several hosts (instance ``i`` on host ``i mod hosts``),
each host with a pool of its own (memory, SSD) and all of them with one remote tier behind
their pools (``PoolModel``, ``RemoteTier``).

Each instance has a local prefix cache (vLLM's GPU prefix cache) of ``local_blocks`` blocks,
modelled as an LRU over cached blocks: when a request is admitted its blocks become the most
recent, its first block the very most recent (vLLM frees a finished request's blocks tail
first, so a prompt's tail is evicted before its shared head). A request's hits are its leading
run in the chosen instance's local cache, then, from the first block it lacks, the leading run
its host's pool holds (``PoolModel.serve``: memory, then SSD, then the remote tier), as the
connector asks the pool only for the blocks vLLM did not find itself. Caches are updated when a
request arrives: the next arrival sees them.

The router (``routing.Router``, the one ``kvpool proxy`` runs) is given each instance's load,
its requests in flight, from a service-time model: a request occupies its instance from its
arrival for ``recomputed prompt tokens / prefill_tokens_per_s + output tokens * decode_ms_per_token``
(continuous batching: in-flight requests do not queue behind each other, they only count as load).

``traffic="replicate"`` gives each instance its own copy of the trace (copy ``c`` with keys of
its own, arriving at the same times, ties between copies in a seeded random order), so ``n``
instances bring ``n`` times the traffic: that is the sweep that shows how many instances one
pool serves before its hit rate drops.
"""

from __future__ import annotations

import collections
import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.routing import POLICIES, Router, id_chain

from kvpool.plan.pool import PoolModel
from kvpool.plan.replay import HitCounts, request_keys
from kvpool.tracefile import Trace, TraceRequest

Traffic = Literal["split", "replicate"]
TRAFFIC: tuple[Traffic, ...] = ("split", "replicate")


@dataclass(frozen=True)
class ServiceModel:
    """How long a request keeps its instance busy (the router's load signal)."""

    prefill_tokens_per_s: float = 20_000.0
    decode_ms_per_token: float = 30.0

    def seconds(self, prefill_tokens: int, output_tokens: int) -> float:
        return prefill_tokens / self.prefill_tokens_per_s + output_tokens * self.decode_ms_per_token / 1000.0


class LocalCache:
    """An instance's prefix cache: an LRU over at most ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: collections.OrderedDict[str, None] = collections.OrderedDict()

    def prefix(self, keys: Sequence[str]) -> int:
        """How many leading blocks of ``keys`` it holds."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[str]) -> None:
        """The request's blocks are cached now; its head is the most recent."""
        if not self.capacity:
            return
        blocks = self._blocks
        for key in reversed(keys[: self.capacity]):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


@dataclass(frozen=True)
class Workload:
    """A trace prepared for cluster replays: requests in arrival order, their pool keys and
    their routing chains (computed once, shared by every replay)."""

    requests: list[TraceRequest]
    keys: list[list[str]]
    chains: list[list[int]]
    block_size: int


def workload(trace: Trace, copies: int = 1) -> Workload:
    """``trace`` as one workload; with ``copies`` > 1, that many copies interleaved by arrival."""
    # (timestamp, tie-break, copy, index). Copies arrive at the same times; were their ties
    # broken by copy number, round_robin over n instances would send copy c to instance c every
    # time, a perfect affinity no real router gets. A seeded shuffle of ties keeps runs repeatable.
    rng = random.Random(0)
    rows: list[tuple[int, float, int, int]] = []
    keys_by_copy = [request_keys(trace, c) for c in range(copies)]
    for c in range(copies):
        rows.extend((r.timestamp, rng.random() if copies > 1 else 0.0, c, i) for i, r in enumerate(trace.requests))
    rows.sort()
    span = max((h for r in trace.requests for h in r.hash_ids), default=0) + 1
    requests, keys, chains = [], [], []
    for _, _, c, i in rows:
        req = trace.requests[i]
        requests.append(req)
        keys.append(keys_by_copy[c][i])
        chains.append(id_chain([h + c * span for h in req.hash_ids]))
    return Workload(requests, keys, chains, trace.block_size)


def replay_cluster(work: Workload, pool: PoolModel | Sequence[PoolModel], instances: int, policy: str,
                   local_blocks: int, service: ServiceModel = ServiceModel(), load_factor: float = 1.25
                   ) -> tuple[HitCounts, float, list[int]]:
    """Route every request of ``work`` to one of ``instances``; counts, seconds taken, and how
    many requests each instance served. ``pool``: the one pool every instance shares, or one
    per host (instance ``i`` uses ``pool[i % len(pool)]``)."""
    pools = [pool] if isinstance(pool, PoolModel) else list(pool)
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is invalid: expected one of {', '.join(POLICIES)}")
    router = Router(policy, capacity_blocks=max(1, local_blocks), load_factor=load_factor)
    caches = [LocalCache(local_blocks) for _ in range(instances)]
    busy: list[list[float]] = [[] for _ in range(instances)]  # finish times in flight, per instance
    served = [0] * instances
    ids = list(range(instances))
    counts = HitCounts()
    block = work.block_size
    began = time.perf_counter()
    for req, keys, chain in zip(work.requests, work.keys, work.chains):
        now = req.timestamp / 1000.0
        for heap in busy:
            while heap and heap[0] <= now:
                heapq.heappop(heap)
        pick = router.choose(ids, [len(h) for h in busy], chain).instance
        cache = caches[pick]
        local = cache.prefix(keys)
        mem, ssd, remote = pools[pick % len(pools)].serve(keys, local)
        cache.admit(keys)
        hit_tokens = min(req.input_length, (local + mem + ssd + remote) * block)
        heapq.heappush(busy[pick], now + service.seconds(req.input_length - hit_tokens, req.output_length))
        served[pick] += 1
        counts.add(len(keys), local=local, memory=mem, ssd=ssd, remote=remote)
    return counts, time.perf_counter() - began, served
