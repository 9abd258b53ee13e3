"""Zero-copy byte views of the buffers callers hand the pool (numpy arrays, memoryviews, bytes)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvpool.errors import ErrorCode, StoreError
from kvpool.store import streamcopy


_U8 = np.dtype(np.uint8)


def as_u8(buf: Any, writable: bool = False) -> np.ndarray:
    """View ``buf`` as a 1-D uint8 array without copying; raises ValueError/TypeError if impossible."""
    # The usual case first, in as few attribute lookups as possible: a hit's load validates each
    # block segment's view (hundreds per request) on the way through the backend and the engine.
    if type(buf) is np.ndarray and buf.dtype is _U8 and buf.ndim == 1:
        flags = buf.flags
        if flags.c_contiguous and (flags.writeable or not writable):
            return buf
    if isinstance(buf, np.ndarray) and buf.ndim == 1 and buf.dtype == np.uint8:
        arr = buf
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("buffer is not contiguous")
        arr = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer is not contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("buffer is read-only")
    return arr


# ---- one value as a list of buffers ---------------------------------------------------------------
#
# A KV block reaches the pool as several buffers (one per layer segment) that together are one
# value. These helpers are the only places that walk such a list: the zero-copy stores take
# pointer lists (`spans`), the copying ones fill or read one contiguous region (`gather`,
# `scatter`). Buffers are anything `as_u8` accepts.


def checksum(bufs: Sequence[Any], seed: int = 0) -> int:
    """XXH3-64 of one value (its buffers back to back): what a reader checks the bytes it
    copied against (`scatter_summed` copies and hashes in one pass). The binding releases the
    GIL while it hashes, so copy threads hash in parallel. `seed` binds something else into the
    sum (`key_seed`: the key a value was stored under)."""
    if len(bufs) == 1:
        return xxhash.xxh3_64_intdigest(as_u8(bufs[0]), seed)
    h = xxhash.xxh3_64(seed=seed)
    for b in bufs:
        h.update(as_u8(b))
    return h.intdigest()


def key_seed(key: str) -> int:
    """A checksum seed of `key`: a value summed with it checks only under that key, so a store
    that lets anyone copy one key's bytes to another (Redis) cannot serve them as the other's."""
    return xxhash.xxh3_64_intdigest(key.encode())


def total_size(bufs: Sequence[Any]) -> int:
    """Bytes in one value: the sum of its buffers' sizes."""
    return sum(int(as_u8(b).nbytes) for b in bufs)


def spans(bufs: Sequence[Any]) -> tuple[list[int], list[int], int]:
    """(pointers, sizes, total) of the non-empty buffers of one value, for calls that copy from
    or into a list of addresses (Mooncake, MemCache). Empty buffers are left out: those stores
    refuse zero-length spans."""
    ptrs: list[int] = []
    sizes: list[int] = []
    for b in bufs:
        arr = as_u8(b)
        if arr.size:
            ptrs.append(int(arr.ctypes.data))
            sizes.append(int(arr.size))
    return ptrs, sizes, sum(sizes)


def gather(bufs: Sequence[Any], out: Any = None) -> np.ndarray:
    """The buffers back to back in one contiguous uint8 array: ``out`` (writable, exactly the
    total size: e.g. a range of a shared-memory arena) or, without it, a new array."""
    return _gather(bufs, out, None)


def gather_summed(bufs: Sequence[Any], out: Any) -> int:
    """`gather` into ``out``, and the value's `checksum`, of the buffers (not of ``out``, which
    others may write), each hashed right after its copy, while its bytes are still in cache."""
    h = xxhash.xxh3_64()
    _gather(bufs, out, h)
    return h.intdigest()


def _gather(bufs: Sequence[Any], out: Any, h: Any) -> np.ndarray:
    segs = [as_u8(b) for b in bufs]
    total = sum(s.size for s in segs)
    dst = np.empty(total, dtype=np.uint8) if out is None else as_u8(out, writable=True)
    if dst.size != total:
        raise ValueError(f"gather: the buffers hold {total} bytes, the destination {dst.size}")
    if h is None and _streamed(dst, segs, into_segments=False):
        return dst
    pos = 0
    for s in segs:
        if s.size:
            dst[pos : pos + s.size] = s
            pos += s.size
            if h is not None:
                h.update(s)
    return dst


def _streamed(value: np.ndarray, segs: list[np.ndarray], into_segments: bool) -> bool:
    """Copy between one contiguous value and its segments (sizes already checked) with the
    non-temporal kernel, in one call; False, having copied nothing, where that does not apply
    (a small value, or no kernel on this machine). Only for unhashed copies: a hashed copy
    reads each segment right back, so its bytes should stay in the caches."""
    if value.size < streamcopy.MIN_BYTES or streamcopy.kernel() is None:
        return False
    streamcopy.copy_segments(*_table(value, segs, into_segments))
    return True


def _table(value: np.ndarray, segs: list[np.ndarray], into_segments: bool
           ) -> tuple[list[int], list[int], list[int]]:
    """(destination addresses, source addresses, sizes) of the copies between one contiguous
    value and its non-empty segments, in either direction."""
    used = [s for s in segs if s.size]
    sizes = [int(s.size) for s in used]
    runs = list(itertools.accumulate(sizes[:-1], initial=streamcopy.address(value)))
    parts = [streamcopy.address(s) for s in used]
    return (parts, runs, sizes) if into_segments else (runs, parts, sizes)


def scatter_table(src: Any, bufs: Sequence[Any]) -> tuple[list[int], list[int], list[int]]:
    """The copies `scatter` would make, as (destination addresses, source addresses, sizes), for a
    caller that copies many values in one call (`streamcopy.copy_segments_team`); checked as
    `scatter` checks them. The addresses are valid as long as ``src`` and ``bufs`` are alive."""
    data, outs = _scatter_args(src, bufs)
    return _table(data, outs, into_segments=True)


def scatter(src: Any, bufs: Sequence[Any]) -> None:
    """Copy ``src`` (one contiguous value) into the buffers, back to back; their sizes must add up
    to its size, checked before a byte is written."""
    _scatter(src, bufs, None)


def scatter_summed(src: Any, bufs: Sequence[Any]) -> int:
    """`scatter`, and the `checksum` of what the buffers now hold (the reader's own copy, not
    ``src``, which others may write), each buffer hashed right after its copy, while its bytes
    are still in cache: 20% faster than copying and hashing in two passes (measured on a
    4K-token hit's 1.5 MiB values)."""
    h = xxhash.xxh3_64()
    _scatter(src, bufs, h)
    return h.intdigest()


def _scatter_args(src: Any, bufs: Sequence[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    data = as_u8(src)
    outs = [as_u8(b, writable=True) for b in bufs]
    total = sum(o.size for o in outs)
    if total != data.size:
        raise ValueError(f"scatter: the value has {data.size} bytes, the buffers {total}")
    return data, outs


def _scatter(src: Any, bufs: Sequence[Any], h: Any) -> None:
    data, outs = _scatter_args(src, bufs)
    if h is None and _streamed(data, outs, into_segments=True):
        return
    pos = 0
    for o in outs:
        if o.size:
            o[:] = data[pos : pos + o.size]
            pos += o.size
            if h is not None:
                h.update(o)


def byte_views(data: Any) -> list[memoryview]:
    """One buffer or a list of buffers as flat byte-format memoryviews (no copy); StoreError
    INVALID_PARAMS for one that is not contiguous."""
    views = []
    for item in data if isinstance(data, (list, tuple)) else (data,):
        view = memoryview(item)
        if not view.c_contiguous:
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             "disk put got a non-contiguous buffer: pass contiguous arrays/bytes")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return views
