"""Helpers for the `kvpool server` tests: socket directories, arena files, payloads. The daemon
itself runs under `kvpool.testing.launch.PoolServer` (fixture `start_server` in conftest.py).

(Not named conftest: tests/store/conftest.py is imported by name elsewhere.)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from kvpool.server import shm

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "srvworker.py")


def socket_dir(tmp_path: Path) -> str:
    """A directory for the socket: tmp_path when short enough for sun_path (107 bytes)."""
    path = os.path.realpath(tmp_path)
    if len(path) + len("/kvpool.sock.lock") <= 100:
        return path
    return tempfile.mkdtemp(prefix="kvp", dir="/tmp")


def arena_files(socket_path: str) -> list[str]:
    """The shared-memory arenas in /dev/shm of servers on `socket_path`: none after a clean stop."""
    return shm.arena_names(socket_path)


def payload(key: str, size: int) -> np.ndarray:
    """``size`` bytes (>= 16) derived from ``key``; the last 16 are a hash of key and body."""
    assert size >= 16
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    out = np.empty(size, dtype=np.uint8)
    out[:-16] = np.random.default_rng(seed).integers(0, 256, size - 16, dtype=np.uint8)
    out[-16:] = np.frombuffer(hashlib.blake2b(key.encode() + out[:-16].tobytes(), digest_size=16).digest(), np.uint8)
    return out


def payload_ok(key: str, data: np.ndarray) -> bool:
    """Whether ``data`` is exactly the payload of ``key`` (checked by its embedded hash)."""
    if data.size < 16:
        return False
    digest = hashlib.blake2b(key.encode() + data[:-16].tobytes(), digest_size=16).digest()
    return digest == data[-16:].tobytes()


def size_of(key_index: int) -> int:
    """Varied sizes (4..36 KiB) so eviction fragments the arena."""
    return 4096 + (key_index * 7919) % (32 << 10)
