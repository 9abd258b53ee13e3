"""Prefaulter: pages mapped ahead of use, never past the look-ahead or the mapping, bytes intact."""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
import errno
import mmap

import numpy as np
import pytest

from kvpool.store import prefault
from kvpool.store.engine import PoolEngine
from kvpool.store.engine_config import EngineConfig
from kvpool.store.prefault import Prefaulter

PAGE = mmap.PAGESIZE
MiB = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident(arr: np.ndarray) -> np.ndarray:
    """Per page of ``arr``'s mapping, whether it is mapped in this process (mincore)."""
    pages = -(-arr.size // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(arr.ctypes.data, arr.size, vec) == 0, ctypes.get_errno()
    return np.frombuffer(vec.raw, dtype=np.uint8) & 1 == 1


def anonymous(size: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


def kernel_populates() -> bool:
    probe = anonymous(PAGE)
    return prefault.populate(probe.ctypes.data, PAGE) == 0


def test_pages_are_mapped_up_to_the_noted_end_plus_the_lookahead_and_no_further() -> None:
    arena = anonymous(64 * MiB)
    pf = Prefaulter(arena, lookahead=4 * MiB)
    try:
        assert not resident(arena).any()
        pf.note(8 * MiB)
        assert pf.wait(10)
        if not kernel_populates():  # before Linux 5.14: the prefaulter stops and changes nothing
            assert pf.populated == 0 and not resident(arena).any()
            return
        assert pf.populated == 12 * MiB
        mapped = resident(arena)
        assert mapped[: 12 * MiB // PAGE].all()
        assert not mapped[12 * MiB // PAGE :].any()
        assert not arena.any()  # mapped, not written: still zero
    finally:
        pf.close()


def test_population_never_passes_the_mapping_and_never_changes_bytes() -> None:
    arena = anonymous(3 * MiB + PAGE)
    arena[::PAGE] = 7  # some pages written before: their bytes must survive population
    pf = Prefaulter(arena, lookahead=64 * MiB)
    try:
        pf.note(1)
        assert pf.wait(10)
        if kernel_populates():
            assert pf.populated == arena.size
            assert resident(arena).all()
        assert (arena[::PAGE] == 7).all() and arena.sum() == 7 * (arena.size // PAGE)
    finally:
        pf.close()


def test_a_kernel_without_populate_stops_the_prefaulter_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(prefault, "populate", lambda address, length: calls.append(length) or errno.EINVAL)
    arena = anonymous(16 * MiB)
    pf = Prefaulter(arena, lookahead=MiB)
    pf.note(0)
    assert pf.wait(10)
    pf.note(8 * MiB)  # stopped: later notes are no-ops
    pf.close()
    assert calls == [MiB] and pf.populated == 0


def test_close_waits_for_the_call_in_flight_and_is_idempotent() -> None:
    arena = anonymous(64 * MiB)
    pf = Prefaulter(arena)
    pf.note(0)
    pf.close()
    pf.close()
    done = pf.populated
    pf.note(32 * MiB)
    assert pf.populated == done  # nothing runs after close


def test_a_prefaulter_never_closed_lets_its_arena_go_once_idle() -> None:
    arena = anonymous(16 * MiB)
    pf = Prefaulter(arena, lookahead=4 * MiB)
    pf.note(0)
    assert pf.wait(10)
    deadline = time.monotonic() + 10
    while pf._thread is not None:  # caught up: its thread ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gone = weakref.ref(arena)
    del arena, pf
    gc.collect()
    assert gone() is None


def test_the_engine_maps_its_own_arena_ahead_of_its_allocations() -> None:
    ahead = prefault.LOOKAHEAD_BYTES
    with PoolEngine(EngineConfig(memory_size=1 << 30, reap_interval_s=0)) as engine:
        pf = engine._index.prefault
        assert pf is not None
        assert pf.wait(10)  # the first look-ahead, mapped as the engine starts
        small = np.full(2 * MiB, 3, dtype=np.uint8)
        big = np.full(ahead // 2 + 8 * MiB, 4, dtype=np.uint8)
        assert engine.put("c", "small", [small]) == 0
        assert pf.wait(10)
        if kernel_populates():
            mapped = resident(engine._index.arena)
            assert mapped[: ahead // PAGE].all() and not mapped[ahead // PAGE :].any()
        # Within half a look-ahead of the mapped end: the next look-ahead past it is mapped.
        assert engine.put("c", "big", [big]) == 0
        assert pf.wait(10)
        if kernel_populates():
            mapped = resident(engine._index.arena)
            past = (small.size + big.size) // PAGE + ahead // PAGE
            assert mapped[:past].all()  # both objects and the look-ahead past them
            assert not mapped[past + MiB // PAGE :].any()  # not the whole gigabyte
        for key, value in (("small", small), ("big", big)):
            out = np.zeros_like(value)
            assert engine.get_into("c", key, [out]) == 0 and np.array_equal(out, value)
    assert pf._closed and pf._thread is None
