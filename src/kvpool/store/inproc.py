"""Puts and gets in the engine's own process: the two-phase protocol a remote client follows
(allocate, copy, commit; lease, copy, validate), made over the engine's public calls.

`backend: local` stores and loads through these; a client of `kvpool server` does the same
steps in its own process with its own pointers into the shared arena.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.errors import ErrorCode
from kvpool.store.buffers import as_u8
from kvpool.store.memcopy import CopyEngine
from kvpool.store.records import Allocation, Lease

if TYPE_CHECKING:  # the engine calls in here; only its type is needed
    from kvpool.store.engine import PoolEngine

logger = logging.getLogger(__name__)

# Anything exporting the buffer protocol as contiguous bytes: 1-D uint8 numpy
# arrays, memoryviews, bytes/bytearray. Python 3.11 has no static type for it.
Buffer = Any

_SERIAL = CopyEngine(1)  # copies on the calling thread


def _views(keys: Sequence[str], buffers: Sequence[Sequence[Buffer]],
           writable: bool) -> tuple[list[ErrorCode], list[list[np.ndarray]], list[int]]:
    """Each key's buffers as uint8 views: (codes, INVALID_PARAMS where a buffer is unusable;
    the views; the indices of the keys whose buffers all are)."""
    codes: list[ErrorCode] = [ErrorCode.OK] * len(keys)
    views: list[list[np.ndarray]] = [[] for _ in keys]
    wanted: list[int] = []
    for i, (key, bufs) in enumerate(zip(keys, buffers)):
        try:
            views[i] = [as_u8(b, writable=writable) for b in bufs]
            wanted.append(i)
        except (TypeError, ValueError) as exc:
            logger.warning("%s(key=%r): bad buffer (%s); pass %scontiguous uint8 arrays",
                           "get_into" if writable else "put", key, exc, "writable " if writable else "")
            codes[i] = ErrorCode.INVALID_PARAMS
    return codes, views, wanted


def batch_put(engine: PoolEngine, client_id: str, keys: Sequence[str],
              values: Sequence[Sequence[Buffer]]) -> list[ErrorCode]:
    """Store the concatenation of each value's buffers under its key. A key already stored or
    being written is OK: objects are immutable, so the other copy has the same bytes. One
    failing key does not stop the others."""
    if len(keys) != len(values):
        return [ErrorCode.INVALID_PARAMS] * len(keys)
    codes, sources, wanted = _views(keys, values, writable=False)
    results = engine.batch_allocate(client_id, [keys[i] for i in wanted],
                                    [sum(s.size for s in sources[i]) for i in wanted])
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    handles: list[int] = []
    try:
        for i, result in zip(wanted, results):
            if isinstance(result, ErrorCode):
                codes[i] = ErrorCode.OK if result is ErrorCode.OBJECT_ALREADY_EXISTS else result
                continue
            pos = result.offset
            for src in sources[i]:
                arena[pos : pos + src.size] = src
                pos += src.size
            handles.append(result.handle)
    except BaseException:
        engine.batch_abort([r.handle for r in results if isinstance(r, Allocation)])
        raise
    committed = iter(engine.batch_commit(handles))
    for i, result in zip(wanted, results):
        if isinstance(result, Allocation):
            codes[i] = next(committed)
    return codes


def batch_get_into(engine: PoolEngine, client_id: str, keys: Sequence[str],
                   buffers: Sequence[Sequence[Buffer]], copies: CopyEngine | None = None) -> list[ErrorCode]:
    """Copy each key's bytes back-to-back into its buffers (writable, sizes summing to the
    object's size), as one batch: leased in one engine call, copied (on ``copies``' threads when
    given), validated and released in one more. INVALID_PARAMS when the sizes do not add up;
    LEASE_EXPIRED when a copy may be torn (its buffers then hold garbage: a miss). One failing
    key does not stop the others."""
    if len(keys) != len(buffers):
        return [ErrorCode.INVALID_PARAMS] * len(keys)
    codes, outs, wanted = _views(keys, buffers, writable=True)
    leases: dict[int, Lease] = {}
    for i, got in zip(wanted, engine.batch_acquire(client_id, [keys[i] for i in wanted])):
        if isinstance(got, ErrorCode):
            codes[i] = got
        else:
            leases[i] = got
    arena = np.frombuffer(engine.arena, dtype=np.uint8)
    jobs: list[tuple[np.ndarray, list[np.ndarray]]] = []
    copied: list[int] = []
    done: list[int] = []
    try:
        for i, lease in leases.items():
            total = sum(o.size for o in outs[i])
            if total != lease.size:
                logger.warning(
                    "get_into(key=%r): buffers hold %d bytes but the object has %d; "
                    "pass buffers whose sizes add up to the stored size",
                    keys[i], total, lease.size,
                )
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            src = (np.frombuffer(lease.data, dtype=np.uint8) if lease.data is not None
                   else arena[lease.offset : lease.offset + lease.size])
            jobs.append((src, outs[i]))
            copied.append(i)
        for i, err in zip(copied, (copies or _SERIAL).scatter_all(jobs)):
            if err is not None:
                logger.warning("get_into(key=%r): copy failed (%s)", keys[i], err)
                codes[i] = ErrorCode.INVALID_PARAMS
        done = [i for i in copied if codes[i] is ErrorCode.OK]
        for i, rc in zip(done, engine.batch_release([leases[i] for i in done], copied=True)):
            codes[i] = rc
    finally:
        released = set(done)
        for i, lease in leases.items():
            if i not in released:
                engine.release(lease)
    return codes
