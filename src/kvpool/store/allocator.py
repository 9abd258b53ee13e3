"""Offset allocator for the pool arena.

The allocator never touches memory: it hands out byte offsets into an arena that
someone else owns (a numpy array in-process, POSIX shared memory in the daemon),
which is why everything here is plain integers.

Invariants (checked by tests/store/test_properties.py):

* live ranges never overlap and lie inside ``[0, capacity)``;
* ``used`` equals the sum of the reserved sizes of live ranges;
* the free list is sorted by offset and no two free ranges touch (they are
  coalesced on free), so freeing everything leaves exactly one range.
"""

from __future__ import annotations

import bisect

from kvpool.errors import ErrorCode, StoreError


class OffsetAllocator:
    """First-fit allocator over a sorted free list, coalescing neighbours on free.

    Sizes are rounded up to ``alignment`` so that every offset stays aligned
    (callers copy tensors into these ranges; aligned starts keep those copies on
    the fast path). A size-0 request still reserves one ``alignment`` unit: an
    empty object must have a distinct offset, otherwise two empty objects would
    share an offset and ``free`` could not tell them apart.

    ``capacity`` is the given capacity rounded down to ``alignment``: a tail
    smaller than one unit could never satisfy a request, so it is not managed.

    ``track_live=False`` keeps no per-range table (the pool engine, which knows every range it
    holds, passes the size to ``free``): at millions of objects that table would cost more than
    the rest of an object's metadata. ``size_of`` and ``live_ranges`` then know nothing, and a
    ``free`` is checked only against its free neighbours (an overlap is refused).

    Not thread-safe: the pool engine serialises calls under its single lock.
    """

    def __init__(self, capacity: int, alignment: int = 64, track_live: bool = True) -> None:
        if not isinstance(alignment, int) or alignment <= 0:
            raise StoreError(
                ErrorCode.INVALID_PARAMS,
                f"alignment={alignment!r} is invalid: expected a positive int (e.g. 64)",
            )
        if not isinstance(capacity, int) or capacity < 0:
            raise StoreError(
                ErrorCode.INVALID_PARAMS,
                f"capacity={capacity!r} is invalid: expected a non-negative int of bytes",
            )
        self._alignment = alignment
        self._capacity = capacity - capacity % alignment
        # Parallel lists rather than a list of tuples so bisect works on starts directly.
        self._free_starts: list[int] = [0] if self._capacity else []
        self._free_lengths: list[int] = [self._capacity] if self._capacity else []
        self._live: dict[int, int] | None = {} if track_live else None
        self._used = 0

    @property
    def capacity(self) -> int:
        """Managed bytes (the constructor's capacity rounded down to ``alignment``)."""
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes reserved by live allocations (sizes rounded up to ``alignment``)."""
        return self._used

    def reserved_size(self, size: int) -> int:
        """Bytes a request of ``size`` reserves: rounded up to ``alignment``, at least one unit."""
        units = max(1, -(-size // self._alignment))
        return units * self._alignment

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes; return the offset, or None when no free range is big enough."""
        if not isinstance(size, int) or size < 0:
            raise StoreError(
                ErrorCode.INVALID_PARAMS,
                f"size={size!r} is invalid: expected a non-negative int of bytes",
            )
        need = self.reserved_size(size)
        for i, length in enumerate(self._free_lengths):
            if length < need:
                continue
            offset = self._free_starts[i]
            if length == need:
                del self._free_starts[i]
                del self._free_lengths[i]
            else:
                # Shrinking from the front keeps the list sorted: the new start is
                # still below the next range's start.
                self._free_starts[i] = offset + need
                self._free_lengths[i] = length - need
            if self._live is not None:
                self._live[offset] = need
            self._used += need
            return offset
        return None

    def free(self, offset: int, size: int | None = None) -> None:
        """Return a live range to the free list, merging it with touching free neighbours.

        ``size`` (the size given to ``allocate``) is required with ``track_live=False``."""
        if self._live is not None:
            need = self._live.pop(offset, None)
        else:
            need = None if size is None else self.reserved_size(size)
        if need is None:
            raise StoreError(
                ErrorCode.INVALID_PARAMS,
                f"offset={offset!r} is not a live allocation (double free or never "
                f"allocated): free each offset returned by allocate() exactly once",
            )
        starts, lengths = self._free_starts, self._free_lengths
        i = bisect.bisect_left(starts, offset)
        if (i > 0 and starts[i - 1] + lengths[i - 1] > offset) or (i < len(starts) and offset + need > starts[i]) \
                or offset < 0 or offset + need > self._capacity:
            if self._live is not None:
                self._live[offset] = need
            raise StoreError(
                ErrorCode.INVALID_PARAMS,
                f"free(offset={offset!r}, {need} bytes) overlaps free space (double free or wrong size): "
                f"free each range returned by allocate() exactly once, with its size",
            )
        self._used -= need
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == offset
        merge_next = i < len(starts) and offset + need == starts[i]
        if merge_prev and merge_next:
            lengths[i - 1] += need + lengths[i]
            del starts[i]
            del lengths[i]
        elif merge_prev:
            lengths[i - 1] += need
        elif merge_next:
            starts[i] = offset
            lengths[i] += need
        else:
            starts.insert(i, offset)
            lengths.insert(i, need)

    def size_of(self, offset: int) -> int | None:
        """Reserved size of the live range at ``offset``, or None if it is not live (or untracked)."""
        return self._live.get(offset) if self._live is not None else None

    def largest_free(self) -> int:
        """Length of the largest contiguous free range (0 when full)."""
        return max(self._free_lengths, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ranges as ``(offset, length)``, sorted by offset (for tests and stats)."""
        return list(zip(self._free_starts, self._free_lengths))

    def live_ranges(self) -> list[tuple[int, int]]:
        """Live ranges as ``(offset, reserved length)``, sorted by offset (empty when untracked)."""
        return sorted(self._live.items()) if self._live is not None else []
