"""One shared pool (memory tier + SSD tier) replayed without bytes, through the engine's own code.

Memory is a real ``PoolEngine`` on a scaled arena (``scale.py``), driven only by its public
calls: ``exists`` to look up, ``acquire`` + ``release`` to load a memory hit (a use for its
eviction policy, ``lru`` or ``s3fifo`` as configured, as a real read is), ``allocate`` + ``commit`` to store a block (nothing is
written into the arena; the engine never looks at the bytes). The SSD tier is the disk tier's
own quota and eviction order (``store.quota.QuotaIndex``, which ``DiskTier`` runs on), fed as
the engine feeds it with ``disk_write_through`` (the default): every stored block is written to
SSD as well, an SSD read is a use for its policy (``touch``), and an SSD hit is promoted into memory
(allocate + commit, possibly evicting colder blocks there; with write-through they are on SSD
already). Files are not written: the SSD tier's decisions depend only on sizes and order.

A remote tier (``remote_backend``: a distributed store behind the host pool) is a `RemoteTier`
that several host pools may share, as hosts share one Mooncake Store: every block a host stores
is written through to it (its write-through queue is assumed to keep up), a lookup that misses
the host's memory and SSD asks it, and a block it serves is promoted into that host's pool (and
written to the host's SSD, as any stored block is). Its eviction order is an LRU over whole
blocks, as a store that evicts its least recently used objects at a high watermark keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.store import Allocation, DiskTier, PoolEngine
from kvpool.store.quota import DiskPolicy, QuotaIndex

from kvpool.plan.scale import ScaledMemory

_CLIENT = "plan"


def _frozen_clock() -> float:
    # Every lease the replay takes is released at once, so time never has to pass.
    return 0.0


class RemoteTier:
    """A distributed store of ``capacity_bytes`` behind one or more host pools (blocks of
    ``block_bytes``, least recently used evicted first)."""

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self._blocks = QuotaIndex(capacity_bytes, "lru")
        self._block_bytes = block_bytes

    def read(self, key: str) -> bool:
        """Whether the store holds ``key``; a hit is a use."""
        if key not in self._blocks:
            return False
        self._blocks.touch(key)
        return True

    def write(self, key: str) -> None:
        """A host wrote ``key`` through (a key the store holds is not sent again)."""
        if not self._blocks.has(key):
            fits, _ = self._blocks.reserve(key, self._block_bytes)
            if fits:
                self._blocks.settle(key)


class PoolModel:
    """One host's pool in a replay (with the remote tier it may share with other hosts).
    ``serve`` is one request's pool traffic."""

    def __init__(self, memory: ScaledMemory, block_bytes: int, ssd_bytes: int = 0,
                 ssd_policy: DiskPolicy = "lru", remote: RemoteTier | None = None) -> None:
        self.memory = memory
        self.engine = PoolEngine(memory.config, clock=_frozen_clock)
        self._size = memory.object_size
        self._ssd = QuotaIndex(ssd_bytes, ssd_policy) if ssd_bytes > 0 else None
        self._remote = remote
        self._block_bytes = block_bytes

    def close(self) -> None:
        self.engine.close()

    def serve(self, keys: Sequence[str], start: int = 0) -> tuple[int, int, int]:
        """Look up ``keys[start:]`` (the blocks an instance does not hold), load their leading
        run of hits, then store every block after it. Returns (memory hits, SSD hits, remote
        tier hits)."""
        eng, ssd, remote = self.engine, self._ssd, self._remote
        tail = keys[start:]
        found = eng.exists(tail)
        mem_hits = ssd_hits = remote_hits = 0
        i = 0
        for key, in_memory in zip(tail, found):
            if in_memory:
                lease = eng.acquire(_CLIENT, key)
                if not isinstance(lease, int):  # an ErrorCode is an int: evicted by a promotion just now
                    eng.release(lease)
                    mem_hits += 1
                    i += 1
                    continue
            if ssd is not None and key in ssd:
                ssd.touch(key)
                self._store(key)  # the promotion
                ssd_hits += 1
                i += 1
                continue
            if remote is not None and remote.read(key):
                self._store(key)  # the promotion into the host pool
                self._write_ssd(key)
                remote_hits += 1
                i += 1
                continue
            break
        for key in tail[i:]:
            self._store(key)
            self._write_ssd(key)
            if remote is not None:
                remote.write(key)
        return mem_hits, ssd_hits, remote_hits

    def _write_ssd(self, key: str) -> None:
        ssd = self._ssd
        if ssd is not None and not ssd.has(key):
            fits, _ = ssd.reserve(key, DiskTier.entry_size(key, self._block_bytes))
            if fits:
                ssd.settle(key)

    def _store(self, key: str) -> None:
        got = self.engine.allocate(_CLIENT, key, self._size)
        if isinstance(got, Allocation):
            self.engine.commit(got.handle)
