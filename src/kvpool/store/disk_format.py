"""The SSD tier's formats on disk: an object's file and the restart index, as bytes.

Object file (little-endian)::

    magic b"KVPL" | version u16 | reserved u16 | key_len u32 | payload_len u64 | check u32
    key (utf-8, key_len bytes)
    payload (payload_len bytes)

``check`` is the payload's checksum: in version 2 the low 32 bits of its XXH3-64, the hash the
memory tier keeps for every object, so a read that lands straight in the arena checks the file
and obtains the arena object's checksum in one pass; in version 1 (still read) its crc32.

Restart index (``.kvpool.index``)::

    magic b"KVPI" | version u16 | reserved u16 | entries u64 | shards u32
    per shard: name (2 bytes) | st_mtime_ns i64
    per entry: key_len u32 | file size u64 | key (utf-8)
    crc32 of everything before it (u32)

Pure functions of bytes: the tier (`store/disk.py`) does the I/O and decides what a bad file
or index means; here a file is only parsed and judged, an index only sealed and unsealed.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import xxhash

MAGIC = b"KVPL"
VERSION = 2  # what the tier writes
READABLE = (1, 2)
_HEADER = struct.Struct("<4sHHIQI")
HEADER_SIZE = _HEADER.size
_LOW32 = 0xFFFFFFFF

INDEX_NAME = ".kvpool.index"
_INDEX_MAGIC = b"KVPI"
_INDEX_VERSION = 1
_INDEX_HEAD = struct.Struct("<4sHHQI")  # magic, version, reserved, entries, shards
_INDEX_SHARD = struct.Struct("<2sq")  # shard name, st_mtime_ns
_INDEX_ENTRY = struct.Struct("<IQ")  # key length, file size
_SEAL = struct.Struct("<I")

# A parsed header: (magic, version, reserved, key_len, payload_len, check).
Header = tuple[bytes, int, int, int, int, int]


def pack_header(key_len: int, payload_len: int, digest: int) -> bytes:
    """The header of a file this tier writes; ``digest`` is the payload's XXH3-64."""
    return _HEADER.pack(MAGIC, VERSION, 0, key_len, payload_len, digest & _LOW32)


def unpack_header(head: bytes) -> Header | None:
    """The header's fields, or None when ``head`` is shorter than a header (a truncated file)."""
    return _HEADER.unpack(head) if len(head) == HEADER_SIZE else None


def file_problem(parsed: Header | None, key_bytes: bytes, payload_read: int, trailing: bool,
                 key: str) -> str | None:
    """Why a file read for ``key`` is invalid (its checksum aside), or None if it is valid."""
    if parsed is None:
        return "truncated header"
    magic, version, _, key_len, payload_len, _ = parsed
    if magic != MAGIC or version not in READABLE:
        return f"bad magic/version {magic!r}/{version}"
    if len(key_bytes) != key_len or payload_read != payload_len:
        return f"payload has {payload_read} of {payload_len} bytes (truncated)"
    if trailing:
        return "trailing bytes after the payload"
    if key_bytes != key.encode("utf-8"):
        return "stored key differs from the requested key"
    return None


def checksum_problem(parsed: Header, payload: Any) -> tuple[int, str | None]:
    """The payload's XXH3-64, and why it does not match the file's check (None if it does)."""
    version, check = parsed[1], parsed[5]
    digest = xxhash.xxh3_64_intdigest(payload)
    if version == 1:
        return digest, None if zlib.crc32(payload) == check else "crc32 mismatch"
    return digest, None if digest & _LOW32 == check else "checksum mismatch"


def encode_index(entries: Sequence[tuple[str, int]], shard_times: dict[str, int]) -> bytes:
    """The sealed restart index of ``entries`` (key, file size), in their order, and of the shard
    directories' modification times it is valid for."""
    parts = [_INDEX_HEAD.pack(_INDEX_MAGIC, _INDEX_VERSION, 0, len(entries), len(shard_times))]
    parts.extend(_INDEX_SHARD.pack(name.encode(), ns) for name, ns in sorted(shard_times.items()))
    for key, size in entries:
        key_bytes = key.encode("utf-8")
        parts.append(_INDEX_ENTRY.pack(len(key_bytes), size))
        parts.append(key_bytes)
    body = b"".join(parts)
    return body + _SEAL.pack(zlib.crc32(body))


def decode_index(blob: bytes) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """(shard times, entries) of a sealed index; ValueError (or struct.error, UnicodeDecodeError)
    for anything but an intact index of this version."""
    body, seal = blob[:-_SEAL.size], blob[-_SEAL.size:]
    if len(blob) < _INDEX_HEAD.size + _SEAL.size or _SEAL.unpack(seal)[0] != zlib.crc32(body):
        raise ValueError("its checksum does not match")
    magic, version, _, count, shards = _INDEX_HEAD.unpack_from(body, 0)
    if magic != _INDEX_MAGIC or version != _INDEX_VERSION:
        raise ValueError(f"bad magic/version {magic!r}/{version}")
    pos = _INDEX_HEAD.size
    times = {}
    for _ in range(shards):
        name, ns = _INDEX_SHARD.unpack_from(body, pos)
        times[name.decode()] = ns
        pos += _INDEX_SHARD.size
    entries = []
    unpack, step = _INDEX_ENTRY.unpack_from, _INDEX_ENTRY.size
    for _ in range(count):
        key_len, size = unpack(body, pos)
        pos += step
        entries.append((body[pos:pos + key_len].decode("utf-8"), size))
        pos += key_len
    if pos != len(body):
        raise ValueError("its entries do not add up")
    return times, entries
