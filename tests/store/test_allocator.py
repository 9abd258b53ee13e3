"""OffsetAllocator: alignment, first fit, coalescing, misuse."""

from __future__ import annotations

import pytest

from kvpool.errors import ErrorCode, StoreError
from kvpool.store import OffsetAllocator


def test_offsets_are_aligned_and_used_counts_reserved_bytes() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    a = alloc.allocate(10)
    b = alloc.allocate(64)
    c = alloc.allocate(65)
    assert (a, b, c) == (0, 64, 128)
    assert alloc.used == 64 + 64 + 128
    assert alloc.size_of(c) == 128
    assert alloc.largest_free() == 1024 - 256


def test_zero_size_objects_get_distinct_slots() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    first, second = alloc.allocate(0), alloc.allocate(0)
    assert first is not None and second is not None and first != second
    assert alloc.used == 128
    alloc.free(first)
    alloc.free(second)
    assert alloc.free_ranges() == [(0, 256)]


def test_full_and_oversized_requests_return_none() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    assert alloc.allocate(257) is None
    assert alloc.allocate(256) == 0
    assert alloc.allocate(1) is None
    assert alloc.largest_free() == 0


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = OffsetAllocator(512, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(8)]
    alloc.free(offsets[1])
    alloc.free(offsets[3])
    assert alloc.free_ranges() == [(64, 64), (192, 64)]
    alloc.free(offsets[2])  # touches both holes: one merged range
    assert alloc.free_ranges() == [(64, 192)]
    alloc.free(offsets[0])  # merges with the next range only
    assert alloc.free_ranges() == [(0, 256)]
    for off in offsets[4:]:
        alloc.free(off)
    assert alloc.free_ranges() == [(0, 512)]
    assert alloc.used == 0


def test_first_fit_reuses_the_lowest_hole_that_fits() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(6)]
    alloc.free(offsets[1])  # 64-byte hole at 64
    alloc.free(offsets[3])
    alloc.free(offsets[4])  # 128-byte hole at 192
    assert alloc.allocate(100) == 192  # skips the too-small hole
    assert alloc.allocate(1) == 64


def test_fragmentation_blocks_a_large_request_even_with_enough_total_free() -> None:
    alloc = OffsetAllocator(256, alignment=64)
    offsets = [alloc.allocate(64) for _ in range(4)]
    alloc.free(offsets[0])
    alloc.free(offsets[2])
    assert alloc.capacity - alloc.used == 128
    assert alloc.allocate(128) is None


def test_capacity_is_rounded_down_to_alignment() -> None:
    alloc = OffsetAllocator(1000, alignment=64)
    assert alloc.capacity == 960
    assert alloc.allocate(960) == 0


@pytest.mark.parametrize("bad", [5, 999])
def test_double_free_and_unknown_offset_raise_invalid_params(bad: int) -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    off = alloc.allocate(8)
    alloc.free(off)
    with pytest.raises(StoreError) as exc:
        alloc.free(off)
    assert exc.value.code is ErrorCode.INVALID_PARAMS
    with pytest.raises(StoreError) as exc:
        alloc.free(bad)
    assert exc.value.code is ErrorCode.INVALID_PARAMS
    assert "offset=" in str(exc.value)


def test_invalid_constructor_and_size_arguments() -> None:
    with pytest.raises(StoreError):
        OffsetAllocator(1024, alignment=0)
    with pytest.raises(StoreError):
        OffsetAllocator(-1)
    with pytest.raises(StoreError):
        OffsetAllocator(1024).allocate(-1)
