"""Helpers shared by the conformance tests and their worker processes (no pytest import here)."""

from __future__ import annotations

import hashlib

import numpy as np

from kvpool.errors import is_stored


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic bytes derived from the key (and size): a mixed-up or torn object is visible."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{size}".encode(), digest_size=8).digest(), "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def split(data: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Cut `data` into consecutive 1-D uint8 views of the given sizes (which must add up)."""
    assert sum(sizes) == data.size, (sizes, data.size)
    out, pos = [], 0
    for n in sizes:
        out.append(data[pos : pos + n])
        pos += n
    return out


def empty_like_segments(sizes: list[int], fill: int = 0xA5) -> list[np.ndarray]:
    """Writable destination buffers pre-filled with a sentinel, so untouched buffers can be checked."""
    return [np.full(n, fill, dtype=np.uint8) for n in sizes]


def joined(buffers: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(buffers) if buffers else np.empty(0, dtype=np.uint8)


OK = 0
OBJECT_NOT_FOUND = -704


def value_size(key: str) -> int:
    """4 KiB .. 68 KiB, derived from the key, so any process knows the size of any key."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return 4096 + h % 65536


def segment_sizes(key: str, size: int) -> list[int]:
    """Split a value into 1-3 segments (one may be empty), derived from the key."""
    h = int.from_bytes(hashlib.blake2b(b"seg" + key.encode(), digest_size=4).digest(), "little")
    parts = 1 + h % 3
    if parts == 1:
        return [size]
    a = (h >> 4) % (size + 1)
    if parts == 2:
        return [a, size - a]
    b = (h >> 12) % (size - a + 1)
    return [a, b, size - a - b]


def value_of(key: str) -> list[np.ndarray]:
    size = value_size(key)
    return split(payload(key, size), segment_sizes(key, size))


def workload(backend, worker: int, n_workers: int, n_own: int = 32, n_shared: int = 16, chunk: int = 8) -> dict:
    """Write and read distinct (`w{worker}-j`) and shared (`shared-j`) keys concurrently with peers.

    Every value is derived from its key. Capacity must hold everything (no eviction): this
    worker's own keys must be found and read back OK right after its put. Another worker's key
    may be a miss (not written yet), and so may a shared key: a put of a key that a peer stored
    or is still writing is OBJECT_ALREADY_EXISTS (nothing written), and the key becomes visible
    when the peer commits. A read that
    says OK must return exactly that key's bytes. The caller checks, after every worker is done,
    that all keys are there. Returns counts and a list of errors.
    """
    own = [f"w{worker}-{j}" for j in range(n_own)]
    # Each worker walks the shared keys from a different start, so puts of one key collide.
    shift = worker * n_shared // max(n_workers, 1)
    shared = [f"shared-{(j + shift) % n_shared}" for j in range(n_shared)]
    errors: list[str] = []
    verified = misses = 0

    def read(keys: list[str], must_hit: set[str]) -> None:
        nonlocal verified, misses
        dests = [empty_like_segments(segment_sizes(k, value_size(k))) for k in keys]
        codes = backend.batch_get_into(keys, dests)
        if len(codes) != len(keys):
            errors.append(f"batch_get_into returned {len(codes)} codes for {len(keys)} keys")
            return
        for key, code, dest in zip(keys, codes, dests):
            if code == OK:
                if not np.array_equal(joined(dest), payload(key, value_size(key))):
                    errors.append(f"{key}: OK but wrong bytes")
                else:
                    verified += 1
            elif code == OBJECT_NOT_FOUND and key not in must_hit:
                misses += 1
            else:
                errors.append(f"{key}: get returned {code}")

    rounds = max(len(own), len(shared)) // chunk + 1
    for r in range(rounds):
        batch = own[r * chunk : (r + 1) * chunk] + shared[r * chunk : (r + 1) * chunk]
        if not batch:
            continue
        codes = backend.batch_put(batch, [value_of(k) for k in batch])
        errors.extend(f"{k}: put returned {c}" for k, c in zip(batch, codes) if not is_stored(c))
        mine = set(own[r * chunk : (r + 1) * chunk])
        found = backend.batch_exists(batch)
        errors.extend(f"{k}: not found right after put" for k, f in zip(batch, found) if k in mine and not f)
        peers = [f"w{p}-{j}" for p in range(n_workers) if p != worker for j in range(r * chunk, (r + 1) * chunk)][:chunk]
        read(batch + peers, must_hit=mine)
    read(own + shared, must_hit=set(own))
    return {"verified": verified, "misses": misses, "errors": errors}
