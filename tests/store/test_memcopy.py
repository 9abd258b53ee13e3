"""The batch copy engine and the engine's batch read on it: every byte lands where it belongs on
any number of threads, work is split by bytes, one bad job fails only its key, and leases are
released whatever happens."""

from __future__ import annotations

import os
import platform
import threading

import numpy as np
import pytest

from kvpool.errors import ErrorCode
from kvpool.store import EngineConfig, PoolEngine, streamcopy
from kvpool.store.buffers import checksum
from kvpool.store.memcopy import MIN_PARALLEL_BYTES, CopyEngine, auto_threads, process_cpus

SEG = 64 * 1024  # bytes per destination segment
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(params=["threads", "team"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Batches go to the caller's OpenMP team where it has one (vLLM's worker), and to Python
    threads otherwise: every test taking this fixture runs on each path (on x86-64; the team
    kernels are built nowhere else, so there both runs take the threads)."""
    if request.param == "threads":
        monkeypatch.setattr(streamcopy, "team_threads", lambda hashed=False: 0)
        return "threads"
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    request.addfinalizer(lambda: torch.set_num_threads(before))
    if X86:
        assert streamcopy.team_threads() >= 2 and streamcopy.team_threads(hashed=True) >= 2
    else:
        assert streamcopy.team_threads() == streamcopy.team_threads(hashed=True) == 0
    return "team"


@pytest.fixture
def threads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of the Python helper threads themselves."""
    monkeypatch.setattr(streamcopy, "team_threads", lambda hashed=False: 0)


def make_jobs(n: int, segs: int, seed: int) -> tuple[list, list[list[np.ndarray]], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, segs * SEG, dtype=np.uint8) for _ in range(n)]
    outs = [[np.zeros(SEG, dtype=np.uint8) for _ in range(segs)] for _ in range(n)]
    return list(zip(srcs, outs)), outs, srcs


@pytest.mark.parametrize("threads", [1, 2, 4, 7])
@pytest.mark.parametrize("n", [1, 3, 32])
def test_every_job_is_copied_exactly(threads: int, n: int, copy_path: str) -> None:
    jobs, outs, srcs = make_jobs(n, segs=6, seed=n * 10 + threads)
    engine = CopyEngine(threads)
    try:
        assert engine.scatter_all(jobs) == [None] * n
    finally:
        engine.close()
    for src, bufs in zip(srcs, outs):
        assert np.concatenate(bufs).tobytes() == src.tobytes()


def test_work_is_split_by_bytes_across_threads() -> None:
    engine = CopyEngine(4)
    sizes = [8 * MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES,
             MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES, MIN_PARALLEL_BYTES]
    jobs = [(np.empty(s, dtype=np.uint8), []) for s in sizes]
    groups = engine._split(jobs)
    # The big job is a group of its own; the rest share the other threads; all jobs, in order.
    assert groups[0] == range(0, 1)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert 2 <= len(groups) <= 4
    # A batch too small to be worth a thread stays on the caller.
    small = [(np.empty(1024, dtype=np.uint8), []) for _ in range(8)]
    assert engine._split(small) == [range(8)]


def test_copies_run_on_several_threads(threads_only: None) -> None:
    seen: set[str] = set()

    jobs, _, _ = make_jobs(8, segs=4, seed=3)
    engine = CopyEngine(2)
    original = engine._run

    def run(jobs_, sums, indices, results):
        seen.add(threading.current_thread().name)
        original(jobs_, sums, indices, results)

    engine._run = run  # type: ignore[method-assign]
    try:
        engine.scatter_all(jobs)
    finally:
        engine.close()
    assert len(seen) == 2 and threading.current_thread().name in seen


def test_a_bad_job_fails_alone(copy_path: str) -> None:
    jobs, outs, srcs = make_jobs(4, segs=2, seed=5)
    jobs[2] = (jobs[2][0], [np.zeros(SEG, dtype=np.uint8)])  # half the bytes' room
    engine = CopyEngine(3)
    try:
        results = engine.scatter_all(jobs)
    finally:
        engine.close()
    assert isinstance(results[2], ValueError)
    assert [r is None for r in results] == [True, True, False, True]
    for k in (0, 1, 3):
        assert np.concatenate(outs[k]).tobytes() == srcs[k].tobytes()


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_thread_count_is_checked(threads: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        CopyEngine(threads)  # type: ignore[arg-type]


def test_engine_batch_read_on_threads_is_exact_and_releases_leases(copy_path: str) -> None:
    eng = PoolEngine(EngineConfig(memory_size=64 << 20, reap_interval_s=0))
    copies = CopyEngine(3)
    try:
        _, _, srcs = make_jobs(12, segs=3, seed=9)
        keys = [f"k{i}" for i in range(12)]
        assert eng.batch_put("w", keys, [[s] for s in srcs]) == [ErrorCode.OK] * 12
        outs = [[np.zeros(SEG, dtype=np.uint8) for _ in range(3)] for _ in range(12)]
        bad = [np.zeros(SEG, dtype=np.uint8)]  # a wrong total size
        codes = eng.batch_get_into("r", [*keys, "missing", "k0"], [*outs, [np.zeros(8, np.uint8)], bad], copies)
        assert codes[:12] == [ErrorCode.OK] * 12
        assert codes[12:] == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_PARAMS]
        for src, bufs in zip(srcs, outs):
            assert np.concatenate(bufs).tobytes() == src.tobytes()
        # No read lease outlives the call: every object can be removed at once.
        assert all(eng.remove(k) is ErrorCode.OK for k in keys)
        assert eng.stats()["gets"] == 12
    finally:
        copies.close()
        eng.close()


def test_copy_helpers_run_on_every_cpu_of_the_process_not_the_callers_one():
    # vLLM-CPU pins the worker's main thread to one core and its other OpenMP threads to the
    # others; copy helpers started from the main thread must not inherit its single core.
    all_cpus = set(os.sched_getaffinity(0))
    first, others = min(all_cpus), all_cpus - {min(all_cpus)}
    pinned, release = threading.Event(), threading.Event()

    def omp_like_thread() -> None:  # stands for the OpenMP threads bound to the other cores
        os.sched_setaffinity(0, others or {first})
        pinned.set()
        release.wait(10)

    t = threading.Thread(target=omp_like_thread)
    t.start()
    assert pinned.wait(10)
    os.sched_setaffinity(0, {first})
    try:
        assert process_cpus() == all_cpus and auto_threads() == min(4, len(all_cpus))
        engine = CopyEngine(2)
        seen = engine._executor().submit(lambda: set(os.sched_getaffinity(0))).result()
        engine.close()
        assert seen == all_cpus
    finally:
        os.sched_setaffinity(0, all_cpus)
        release.set()
        t.join()


def test_copies_are_checked_against_their_checksums_on_the_copying_threads(copy_path: str) -> None:
    from kvpool.store.memcopy import CorruptCopy

    jobs, outs, srcs = make_jobs(8, segs=3, seed=7)
    sums = [checksum([src]) for src, _ in jobs]
    sums[2] ^= 1  # what the writer committed no longer matches these bytes
    sums[5] = None  # unchecked
    engine = CopyEngine(2)
    try:
        results = engine.scatter_all(jobs, sums)
    finally:
        engine.close()
    assert isinstance(results[2], CorruptCopy)
    assert all(r is None for i, r in enumerate(results) if i != 2)


@pytest.mark.parametrize("sizes", [[SEG], [SEG, 0, 3, SEG + 5], [1, 1, 1], [0, 7]])
def test_one_pass_copy_and_hash_equals_copy_then_hash(sizes: list[int]) -> None:
    """`scatter_summed` and `gather_summed` copy exactly what `scatter` and `gather` copy, and
    their sum is `checksum` of the value's buffers, whatever their sizes (empty ones too)."""
    from kvpool.store.buffers import checksum, gather, gather_summed, scatter, scatter_summed

    rng = np.random.default_rng(len(sizes) * 31 + sum(sizes))
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    summed = [np.zeros(n, dtype=np.uint8) for n in sizes]
    plain = [np.zeros(n, dtype=np.uint8) for n in sizes]
    got = scatter_summed(src, summed)
    scatter(src, plain)
    assert [b.tobytes() for b in summed] == [b.tobytes() for b in plain]
    assert got == checksum(plain) == checksum([src])
    out = np.zeros(src.size, dtype=np.uint8)
    assert gather_summed(plain, out) == checksum(plain)
    assert out.tobytes() == gather(plain).tobytes() == src.tobytes()
    with pytest.raises(ValueError):  # sizes that do not add up: nothing is hashed or published
        scatter_summed(src, [np.zeros(src.size + 1, dtype=np.uint8)])


def test_batches_go_to_the_team_kernel_of_their_kind(copy_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchecked batches to the streaming team kernel, batches with a checksum to the hashing
    one (whole: a `server` read mixes checked values with inline ones), small ones to neither."""
    calls: list[str] = []
    copy, copy_hash = streamcopy.copy_segments_team, streamcopy.copy_hash_team
    monkeypatch.setattr(streamcopy, "copy_segments_team",
                        lambda *a: (calls.append("stream"), copy(*a))[1])
    monkeypatch.setattr(streamcopy, "copy_hash_team",
                        lambda *a: (calls.append("hash"), copy_hash(*a))[1])
    jobs, outs, srcs = make_jobs(6, segs=4, seed=13)
    engine = CopyEngine(2)
    try:
        assert engine.scatter_all(jobs) == [None] * 6
        assert engine.scatter_all(jobs, [None] * 5 + [checksum([srcs[5]])]) == [None] * 6
        assert engine.scatter_all([(srcs[0][:1024], [np.zeros(1024, np.uint8)])]) == [None]
    finally:
        engine.close()
    assert calls == (["stream", "hash"] if copy_path == "team" and X86 else [])
    for src, bufs in zip(srcs, outs):
        assert np.concatenate(bufs).tobytes() == src.tobytes()
