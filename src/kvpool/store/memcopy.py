"""Copying one batch of pooled values into their destination buffers on several threads.

A hit's load is bound by memory bandwidth, and one thread copying reaches only part of it:
on the machines measured here two threads moved a 4K-token hit's 48 MiB 1.4-1.9x faster than one.
During a synchronous load the forward pass is waiting, so the cores vLLM computes on are idle;
`CopyEngine` spreads a batch's copies over them. The engine (`local`) and the `server` client
both copy through it, so the two backends share one copy path.

Two ways to spread a batch. Where the calling thread has an OpenMP team (vLLM's CPU worker: the
threads it computes with, one pinned to each core), the whole batch goes to that team in one
call: `streamcopy.copy_segments_team` for unchecked copies (`local`), `copy_hash_team` where
a copy is checked against its writer's checksum (`server`). vLLM's OpenMP threads busy-wait
for their next parallel region, so a thread of our own scheduled on one of their cores gets
half of it: inside vLLM two Python copy threads loaded a 4K hit no faster than one (6.4 ms
each way), the team in 3.3 ms. Otherwise the jobs are split over the calling thread and
`threads - 1` helpers. A store call that runs on a guard thread (`backends/guard.py`) hands
its batch back to the thread waiting for it (``on_caller``), which has the team.

Invariant: every job is copied exactly once, and `scatter_all` returns only when every job has
finished or failed, so the caller may validate leases and release them right after it returns.
A hashed job (one with an expected checksum) is copied and hashed by one thread, front to back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from kvpool.store import streamcopy
from kvpool.store.buffers import scatter, scatter_summed, scatter_table

# Below this many bytes a batch is copied on the calling thread: handing work to a thread costs
# tens of microseconds, as much as copying a few hundred KiB.
MIN_PARALLEL_BYTES = 1 << 20

# `copy_threads: 0` takes one thread per CPU this process may run on, up to this many: past a few
# threads a copy is bound by the memory bus, not by the cores.
MAX_AUTO_THREADS = 4

class CorruptCopy(ValueError):
    """A copy whose bytes do not hash to the checksum its writer committed."""

    def __init__(self) -> None:
        super().__init__("checksum mismatch")


T = TypeVar("T")

# One job: a value's bytes and the buffers they are copied into, back to back.
Job = tuple[np.ndarray, Sequence[np.ndarray]]


def process_cpus() -> set[int]:
    """The CPUs this process computes on: the union of its threads' affinities.

    Not the calling thread's own: vLLM-CPU pins each OpenMP thread to one core
    (`VLLM_CPU_OMP_THREADS_BIND`), the worker's main thread included, and a thread started from
    it inherits that single core. Copy helpers confined there would share one core with the
    thread they are meant to relieve while the others, idle during a synchronous load, wait.
    """
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):
            pass  # a thread that just ended
    if not cpus:
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
    return cpus


def auto_threads() -> int:
    """Copy threads for `copy_threads: 0`: the CPUs this process computes on, at most 4."""
    return max(1, min(MAX_AUTO_THREADS, len(process_cpus())))


def _spread(cpus: set[int]) -> None:
    """A copy helper's start: free to run on every CPU of the process (`process_cpus`)."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):
        pass  # not on Linux, or a CPU set we may not use: keep the inherited one


# Runs a function on the thread the copy is for and returns its result (`Guard.on_caller`).
OnCaller = Callable[[Callable[[], T]], T]


def _here(fn: Callable[[], T]) -> T:
    return fn()


class CopyEngine:
    """Runs `scatter` for a batch of jobs on the calling thread plus `threads - 1` helpers.

    ``on_caller`` moves a batch to the thread that is waiting for it, where a store call runs
    on a thread of its own (`Guard`) while vLLM's main thread, with its OpenMP team, waits."""

    def __init__(self, threads: int = 1, on_caller: OnCaller = _here) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"copy threads={threads!r}: a positive integer")
        self.threads = threads
        self._on_caller = on_caller
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def scatter_all(self, jobs: Sequence[Job], expect: Sequence[int | None] | None = None
                    ) -> list[BaseException | None]:
        """Copy every job; per job, None or the exception its copy raised (its buffers may then
        hold part of the value: the caller reports that key as failed). With ``expect``, each
        job's copy is also checked against that checksum (`buffers.checksum` of what the
        buffers now hold; None: unchecked): a mismatch is `CorruptCopy`."""
        return self._on_caller(lambda: self._scatter_all(jobs, expect))

    def _scatter_all(self, jobs: Sequence[Job], expect: Sequence[int | None] | None
                     ) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(jobs)
        sums = list(expect) if expect is not None else [None] * len(jobs)
        team = self._team_size(jobs, sums)
        if team > 1:
            self._scatter_on_team(jobs, sums, results, team)
            return results
        groups = self._split(jobs)
        if len(groups) <= 1:
            self._run(jobs, sums, range(len(jobs)), results)
            return results
        pool = self._executor()
        futures = [pool.submit(self._run, jobs, sums, g, results) for g in groups[1:]]
        self._run(jobs, sums, groups[0], results)
        for f in futures:
            f.result()
        return results

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _team_size(self, jobs: Sequence[Job], sums: Sequence[int | None]) -> int:
        """Threads of the caller's OpenMP team to copy this batch on, or 0 to use our own."""
        if self.threads <= 1 or sum(int(src.size) for src, _ in jobs) < MIN_PARALLEL_BYTES:
            return 0
        return min(self.threads, streamcopy.team_threads(hashed=any(x is not None for x in sums)))

    @staticmethod
    def _scatter_on_team(jobs: Sequence[Job], sums: Sequence[int | None],
                         results: list[BaseException | None], team: int) -> None:
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        firsts = [0]  # where each job's segments start in the table, then its end
        copied: list[int] = []  # the jobs in the table
        for i, (src, outs) in enumerate(jobs):
            try:
                d, s, n = scatter_table(src, outs)
            except Exception as exc:  # noqa: BLE001 - reported per key by the caller
                results[i] = exc
                continue
            dsts += d
            srcs += s
            sizes += n
            firsts.append(len(sizes))
            copied.append(i)
        if not copied:
            return
        if all(sums[i] is None for i in copied):
            streamcopy.copy_segments_team(dsts, srcs, sizes, team)
            return
        # With one checked job the whole batch is hashed (and stored through the caches): a
        # `server` read mixes values from the arena, checked, with ones its disk tier sent inline.
        digests = streamcopy.copy_hash_team(dsts, srcs, sizes, firsts, team)
        for i, digest in zip(copied, digests.tolist()):
            if sums[i] is not None and digest != sums[i]:
                results[i] = CorruptCopy()

    def _split(self, jobs: Sequence[Job]) -> list[range]:
        """Consecutive runs of jobs with about the same number of bytes, one per thread."""
        sizes = [int(src.size) for src, _ in jobs]
        total = sum(sizes)
        n = min(self.threads, len(jobs))
        if n <= 1 or total < MIN_PARALLEL_BYTES:
            return [range(len(jobs))]
        cuts: list[int] = []  # a group ends after job i once the groups so far hold their share
        acc = 0
        for i, size in enumerate(sizes[:-1]):
            acc += size
            if len(cuts) < n - 1 and acc * n >= total * (len(cuts) + 1):
                cuts.append(i + 1)
        edges = [0, *cuts, len(jobs)]
        return [range(a, b) for a, b in zip(edges, edges[1:])]

    @staticmethod
    def _run(jobs: Sequence[Job], sums: Sequence[int | None], indices: range,
             results: list[BaseException | None]) -> None:
        for i in indices:
            src, outs = jobs[i]
            try:
                if sums[i] is None:
                    scatter(src, outs)
                elif scatter_summed(src, outs) != sums[i]:
                    results[i] = CorruptCopy()
            except Exception as exc:  # noqa: BLE001 - reported per key by the caller
                results[i] = exc

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvpool-copy",
                                                initializer=_spread, initargs=(process_cpus(),))
            return self._pool
