"""Seals: a checksum bound to its key, stored after each value in stores that any client can write.

Mooncake Store, the openYuanrong datasystem and MemCache address a value by its key only: any
client of the store can put any bytes under any key, or copy one key's object to another, and
their reads return those bytes with success. kvpool stores a 16-byte seal after every value in
such a store: a magic, and the XXH3-64 of the value seeded with the key it is stored under
(`buffers.key_seed`). A read whose seal is not there, or whose bytes do not hash to it under
the key it asked for, is CHECKSUM_MISMATCH, never OK: another key's bytes, a truncated or
rewritten object, or a value written by something other than kvpool is a miss (and a load
error for vLLM, which recomputes those blocks).

The key names the layout (`keys.py`), so the seal binds the layout too. Sealed values live
under the key with `SUFFIX` appended: objects an earlier kvpool stored unsealed under the plain
key are never read as sealed ones (they are misses, and age out of the store), and a sealed
value is never read by a kvpool that does not check seals.

Seal buffers come from a per-thread area that is reused, so the set of addresses a store may
register for RDMA (Mooncake's `register_buffer`) stays bounded.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from kvpool.store.buffers import checksum, key_seed

MAGIC = b"kvs1"
SUFFIX = "@s1"
# magic, 4 reserved bytes (zero), XXH3-64 of the value seeded with its stored key
_SEAL = struct.Struct("<4s4xQ")
SIZE = _SEAL.size

_areas = threading.local()


def stored_key(key: str) -> str:
    """The name a sealed value of `key` is stored under."""
    return key + SUFFIX


def areas(count: int) -> list[np.ndarray]:
    """`count` 16-byte buffers for seals, from this thread's reused area. Valid until the
    thread's next call: one batch at a time per thread, which is how backends are called."""
    area: np.ndarray | None = getattr(_areas, "buf", None)
    if area is None or area.size < count * SIZE:
        size = max(count, 64, 2 * (area.size // SIZE if area is not None else 0)) * SIZE
        area = _areas.buf = np.zeros(size, dtype=np.uint8)
    return [area[i * SIZE : (i + 1) * SIZE] for i in range(count)]


def write(out: np.ndarray, name: str, value: list[np.ndarray]) -> None:
    """Fill `out` with the seal of `value` stored under `name` (the stored key)."""
    _SEAL.pack_into(out, 0, MAGIC, checksum(value, key_seed(name)))


def holds(seal: np.ndarray, name: str, value: list[np.ndarray]) -> bool:
    """Whether `value`, read under `name`, is what kvpool sealed under that name."""
    magic, want = _SEAL.unpack_from(seal, 0)
    return magic == MAGIC and checksum(value, key_seed(name)) == want
