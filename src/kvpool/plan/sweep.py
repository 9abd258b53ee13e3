"""Which replays a plan runs (capacity grid, policies, instance counts), run on ``jobs`` processes.

Each replay is independent (its own engine), so a sweep's points run in parallel; a point's
result does not depend on which process ran it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.store.policy import DiskPolicy, MemoryPolicy

from kvpool.plan.cluster import ServiceModel, Traffic, Workload, replay_cluster, workload
from kvpool.plan.pool import PoolModel, RemoteTier
from kvpool.plan.replay import Point, answer_keys, replay_pool, request_keys
from kvpool.plan.scale import scale_memory
from kvpool.tracefile import Trace


@dataclass(frozen=True)
class PoolSpec:
    """The pool every point shares but for its capacities."""

    block_bytes: int
    ssd_policy: DiskPolicy = "lru"
    object_overhead: int = 0
    high_watermark: float = 0.9
    eviction_ratio: float = 0.1
    eviction_policy: MemoryPolicy = "lru"
    save_decode: bool = False  # requests also store their answers' blocks (`replay.answer_keys`)

    def build(self, memory_bytes: int, ssd_bytes: int, remote: RemoteTier | None = None) -> PoolModel:
        scaled = scale_memory(memory_bytes, self.block_bytes, object_overhead=self.object_overhead,
                              high_watermark=self.high_watermark, eviction_ratio=self.eviction_ratio,
                              eviction_policy=self.eviction_policy)
        return PoolModel(scaled, self.block_bytes, ssd_bytes, self.ssd_policy, remote)

    def remote(self, remote_bytes: int) -> RemoteTier | None:
        return RemoteTier(remote_bytes, self.block_bytes) if remote_bytes > 0 else None


@dataclass(frozen=True)
class ClusterSpec:
    """Cluster-mode settings (``instances`` is the largest count a sweep reaches)."""

    instances: int
    policies: tuple[str, ...]
    local_blocks: int
    service: ServiceModel = ServiceModel()
    load_factor: float = 1.25
    sweep: bool = False
    traffic: Traffic = "split"
    hosts: int = 1  # each with a pool of its own; instance i runs on host i mod hosts

    def counts(self) -> list[int]:
        return list(range(1, self.instances + 1)) if self.sweep else [self.instances]


# Set in each worker (inherited on fork, or by the initializer): the trace is parsed once.
_TRACE: Trace | None = None
_WORK: dict[int, Workload] = {}


def _init(trace: Trace) -> None:
    global _TRACE
    _TRACE = trace
    _WORK.clear()


def _pool_point(spec: PoolSpec, memory: int, ssd: int, remote: int) -> Point:
    assert _TRACE is not None
    pool = spec.build(memory, ssd, spec.remote(remote))
    try:
        counts, seconds = replay_pool(request_keys(_TRACE), pool,
                                      answer_keys(_TRACE) if spec.save_decode else None)
    finally:
        pool.close()
    return Point(memory, ssd, counts, seconds, remote_bytes=remote,
                 extra={"capacity_blocks": pool.memory.capacity_objects})


def _cluster_point(spec: PoolSpec, cluster: ClusterSpec, memory: int, ssd: int, remote: int, policy: str,
                   n: int) -> Point:
    assert _TRACE is not None
    copies = n if cluster.traffic == "replicate" else 1
    if copies not in _WORK:
        _WORK[copies] = workload(_TRACE, copies)
    shared = spec.remote(remote)
    hosts = min(cluster.hosts, n)  # a sweep's first points have fewer instances than hosts
    pools = [spec.build(memory, ssd, shared) for _ in range(hosts)]
    try:
        counts, seconds, served = replay_cluster(_WORK[copies], pools, n, policy, cluster.local_blocks,
                                                 cluster.service, cluster.load_factor)
    finally:
        for pool in pools:
            pool.close()
    return Point(memory, ssd, counts, seconds, policy=policy, instances=n, remote_bytes=remote, hosts=hosts,
                 extra={"capacity_blocks": pools[0].memory.capacity_objects, "served": served})


def run_plan(trace: Trace, spec: PoolSpec, memories: Sequence[int], ssds: Sequence[int],
             cluster: ClusterSpec | None = None, jobs: int = 1, remotes: Sequence[int] = (0,)) -> list[Point]:
    """Every point of the grid (memory x SSD x remote tier, and per policy and instance count
    in cluster mode), in a stable order whatever ``jobs`` is."""
    tasks: list[tuple] = []
    for memory in memories:
        for ssd in ssds:
            for remote in remotes:
                if cluster is None:
                    tasks.append((_pool_point, spec, memory, ssd, remote))
                    continue
                for policy in cluster.policies:
                    for n in cluster.counts():
                        tasks.append((_cluster_point, spec, cluster, memory, ssd, remote, policy, n))
    if jobs <= 1 or len(tasks) == 1:
        _init(trace)
        return [fn(*args) for fn, *args in tasks]
    # fork: workers inherit the parsed trace instead of unpickling it once per point.
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx,
                                                initializer=_init, initargs=(trace,)) as ex:
        futures = [ex.submit(fn, *args) for fn, *args in tasks]
        return [f.result() for f in futures]
