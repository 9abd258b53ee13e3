"""The non-temporal copy kernel: present where it is meant to be, and byte-exact through
`scatter` and `gather` for any sizes, alignments and empty buffers, from any thread."""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.store import buffers, streamcopy

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_kernel_is_built_on_x86_64() -> None:
    """On x86-64 (every CI machine) the kernel must exist: a silent fall-back to numpy would
    leave the fast path untested and unmeasured."""
    if not X86:
        assert streamcopy.kernel() is None
        assert "not measured" in streamcopy.describe()
        return
    assert streamcopy.kernel() is not None, streamcopy.describe()
    assert "non-temporal" in streamcopy.describe()


def _placed(rng: np.random.Generator, sizes: list[int], offsets: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Zeroed buffers with guard bytes around each view; the views start `offsets` bytes in,
    so they cover every alignment against a 64-byte line."""
    homes = [np.zeros(n + off + 80, dtype=np.uint8) for n, off in zip(sizes, offsets)]
    return homes, [h[off:off + n] for h, off, n in zip(homes, offsets, sizes)]


def _check(homes: list[np.ndarray], views_at: list[int], sizes: list[int], value: np.ndarray) -> None:
    pos = 0
    for home, off, n in zip(homes, views_at, sizes):
        assert home[off:off + n].tobytes() == value[pos:pos + n].tobytes()
        assert not home[:off].any() and not home[off + n:].any(), "a byte outside the buffer was written"
        pos += n


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 200), st.integers(16 << 10, 150_000)), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_scatter_and_gather_are_exact_at_any_size_and_alignment(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    offsets = [int(o) for o in rng.integers(0, 130, len(sizes))]
    start = int(rng.integers(0, 100))
    value = rng.integers(0, 256, sum(sizes) + start, dtype=np.uint8)[start:]

    homes, views = _placed(rng, sizes, offsets)
    buffers.scatter(value, views)
    _check(homes, offsets, sizes, value)

    out_home = np.zeros(value.size + 200, dtype=np.uint8)
    at = int(rng.integers(0, 100))
    buffers.gather(views, out_home[at:at + value.size])
    assert out_home[at:at + value.size].tobytes() == value.tobytes()
    assert not out_home[:at].any() and not out_home[at + value.size:].any()
    assert buffers.gather(views).tobytes() == value.tobytes()


def test_a_read_only_source_is_copied_exactly() -> None:
    """Values from some stores arrive as read-only bytes: their address comes another way."""
    rng = np.random.default_rng(7)
    value = rng.integers(0, 256, 300_000, dtype=np.uint8)
    frozen = np.frombuffer(value.tobytes(), dtype=np.uint8)
    assert not frozen.flags.writeable
    outs = [np.zeros(n, dtype=np.uint8) for n in (100_000, 0, 200_000)]
    buffers.scatter(frozen, outs)
    assert np.concatenate(outs).tobytes() == value.tobytes()


def test_copies_on_other_threads_are_seen_by_this_one() -> None:
    """The kernel ends with a fence: what a copy thread wrote with non-temporal stores is what
    the thread that waited for it reads."""
    rng = np.random.default_rng(11)
    values = [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(8)]
    outs = [[np.zeros(1 << 18, dtype=np.uint8) for _ in range(4)] for _ in values]
    threads = [threading.Thread(target=buffers.scatter, args=(v, o)) for v, o in zip(values, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v, o in zip(values, outs):
        assert np.concatenate(o).tobytes() == v.tobytes()


def test_the_kernel_copies_segment_tables_exactly() -> None:
    """`copy_segments` itself, on segments of every length around a line and misaligned both ways."""
    if not X86:
        assert streamcopy.kernel() is None  # scatter and gather copy with numpy there
        return
    rng = np.random.default_rng(3)
    sizes = [0, 1, 63, 64, 65, 127, 128, 129, 4096, 70_001]
    src_home = rng.integers(0, 256, sum(sizes) + 64, dtype=np.uint8)
    src = src_home[5:5 + sum(sizes)]
    homes, views = _placed(rng, sizes, [int(o) for o in rng.integers(0, 64, len(sizes))])
    base = streamcopy.address(src)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    streamcopy.copy_segments([streamcopy.address(v) if v.size else 0 for v in views],
                             [base + int(s) for s in starts], sizes)
    for v, s, n in zip(views, starts, sizes):
        assert v.tobytes() == src[s:s + n].tobytes()
    for home, v in zip(homes, views):
        assert home.sum() == v.sum()  # nothing written around the views


# ---- the same copies on the caller's OpenMP team ------------------------------------------------


def test_the_team_kernel_is_there_once_torch_has_loaded_its_openmp_runtime() -> None:
    """vLLM's CPU worker copies a hit on the OpenMP threads it computes with: on x86-64 (every CI
    machine) the team kernel must be built once torch is loaded, sized as torch's team, and
    only for the main thread (another thread would start a team of its own)."""
    import torch

    if not X86:
        assert streamcopy.team_threads() == 0
        return
    assert streamcopy.team_threads() == torch.get_num_threads() >= 1
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(streamcopy.team_threads()))
    t.start()
    t.join()
    assert seen == [0]
    assert "OpenMP team" in streamcopy.describe() or torch.get_num_threads() == 1


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 200), st.integers(16 << 10, 100_000)), min_size=1, max_size=12),
       threads=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_the_team_copies_every_segment_exactly_once(sizes: list[int], threads: int, seed: int) -> None:
    """Any number of threads (more than the team has, or than there are segments), any sizes
    and alignments: every segment lands whole and nothing around it is written."""
    import torch  # noqa: F401 - loads the OpenMP runtime the team runs on

    if not X86:
        return
    assert streamcopy.team_threads() >= 1
    rng = np.random.default_rng(seed)
    src_home = rng.integers(0, 256, sum(sizes) + 64, dtype=np.uint8)
    at = int(rng.integers(0, 64))
    src = src_home[at:at + sum(sizes)]
    homes, views = _placed(rng, sizes, [int(o) for o in rng.integers(0, 130, len(sizes))])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    base = streamcopy.address(src_home) + at
    streamcopy.copy_segments_team([streamcopy.address(v) if v.size else 0 for v in views],
                                  [base + int(s) for s in starts], sizes, threads)
    for v, s, n in zip(views, starts, sizes):
        assert v.tobytes() == src[s:s + n].tobytes()
    for home, v in zip(homes, views):
        assert home.sum() == v.sum()


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.lists(st.one_of(st.integers(0, 200), st.integers(16 << 10, 100_000)), max_size=5),
                       min_size=1, max_size=8),
       threads=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_the_team_copies_and_hashes_every_value_exactly_once(values: list[list[int]], threads: int, seed: int) -> None:
    """The hashing team kernel (`server` reads): values of any number of segments (none too),
    any sizes, alignments and thread counts; every segment lands whole, nothing around it is
    written, and each value's digest is `buffers.checksum` of its destination buffers."""
    import torch  # noqa: F401 - loads the OpenMP runtime the team runs on

    if not X86:
        assert streamcopy.team_threads(hashed=True) == 0
        return
    assert streamcopy.team_threads(hashed=True) >= 1
    rng = np.random.default_rng(seed)
    sizes = [n for v in values for n in v]
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    homes, views = _placed(rng, sizes, [int(o) for o in rng.integers(0, 130, len(sizes))])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int) if sizes else []
    firsts = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(int).tolist()
    digests = streamcopy.copy_hash_team([streamcopy.address(v) if v.size else 0 for v in views],
                                        [streamcopy.address(src) + int(s) if n else 0 for s, n in zip(starts, sizes)],
                                        sizes, firsts, threads)
    for v, s, n in zip(views, starts, sizes):
        assert v.tobytes() == src[s:s + n].tobytes()
    for home, v in zip(homes, views):
        assert home.sum() == v.sum()
    assert digests.tolist() == [buffers.checksum(views[a:b]) for a, b in zip(firsts, firsts[1:])]


@pytest.mark.parametrize("sizes, parts, want", [
    ([10, 10, 10, 10], 2, [0, 2, 4]),
    ([40, 1, 1, 1, 1], 2, [0, 1, 5]),   # the big segment is a part of its own
    ([1, 1, 1, 40], 2, [0, 3, 4]),      # the cut nearest half the bytes
    ([5, 5, 5], 3, [0, 1, 2, 3]),
    ([40, 1], 3, [0, 0, 1, 2]),         # more parts than the bytes can fill: an empty run
    ([7], 1, [0, 1]),
])
def test_the_team_splits_by_bytes_into_runs_of_whole_segments(sizes: list[int], parts: int, want: list[int]) -> None:
    assert streamcopy.split_bounds(sizes, parts).tolist() == want
