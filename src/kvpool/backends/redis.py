"""`backend: redis` — a Redis (or Valkey) server the operator already runs.

Layout of one pooled object under its key `K`:

- values up to `redis_chunk_size` (64MB by default): one string `K` = 24-byte header + bytes;
- larger values: chunk strings `K#chunk:{nonce}:{i}` written first, then `K` = header naming the
  chunk count, chunk size and nonce. The header is written last with `SET NX`, so a reader never
  sees a partly written object, the first writer of a key wins (a put of an existing key
  answers OBJECT_ALREADY_EXISTS) and two writers of one key never share chunk keys (each has its own nonce); the loser deletes
  its chunks. A chunk evicted or expired on its own makes the object a miss, and its header is
  then removed. The header carries the value's checksum, seeded with the key (and so with the
  model and layout the key names): a read whose bytes do not match (another client overwrote
  them, even with the same length, or copied another key's object here) is CHECKSUM_MISMATCH, a
  miss.

Every call is one pipeline (one round trip) per phase: `EXISTS` (or `TOUCH` for a lease, which
refreshes the key's LRU clock), `SET NX [EX ttl]`, `GET` (plus one pipeline for chunks). A put
asks nothing first: `SET NX` is the store's put-if-absent, and a key it refuses is
OBJECT_ALREADY_EXISTS.

Capacity: Redis' `maxmemory` (minus `used_memory_startup`) is read from `INFO memory` on connect.
Redis needs a value's size twice while writing it (query buffer, then object), so a value above
half of that could never be stored and would make Redis evict everything before failing with
OOM: it is refused up front with NO_AVAILABLE_HANDLE. What Redis refuses (`OOM ... maxmemory`,
with `maxmemory-policy noeviction`) is NO_AVAILABLE_HANDLE too. Redis has no leases: a lease
here only refreshes LRU recency; eviction follows Redis' own (approximate) LRU policy.

A server that is down or slow never raises: lookups are misses, puts and gets fail with
RPC_FAIL / RPC_TIMEOUT (vLLM recomputes) at once, and after a short backoff (`base.Reconnect`,
growing while it stays down) the next call tries again (redis-py reconnects by itself).
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
import time
from typing import Any

import numpy as np

from kvpool.backends.base import Backend, gather, scatter, total_size
from kvpool.backends.diagnosis import Report
from kvpool.store.buffers import checksum, key_seed
from kvpool.config import KVPoolConfig, RedisSettings
from kvpool.errors import ConfigError, ErrorCode
from kvpool.errors import CHECKSUM_MISMATCH, EXISTS, INTERNAL, INVALID, NOT_FOUND, NO_HANDLE, OK  # the codes as ints
from kvpool.errors import RPC_FAIL, RPC_TIMEOUT

logger = logging.getLogger(__name__)


MAGIC = b"kvp3"
# Objects of earlier layouts: misses, never trusted (kvp1: no checksum; kvp2: a checksum that
# did not cover the key, so another key's object copied here checked).
OLD_MAGICS = (b"kvp1", b"kvp2")
INLINE, CHUNKED = 0, 1
# magic, kind, 3 pad bytes, total size, checksum of the value seeded with its key
# (`buffers.checksum`, `key_seed`): Redis accepts any client's SET, so neither a same-length
# overwrite nor a copy of another key's object may come back as a hit.
_HEAD = struct.Struct("<4sB3xQQ")
# chunk count, chunk size, nonce
_CHUNKS = struct.Struct("<IQ16s")
HEADER_SIZE = _HEAD.size  # 24
# Capacity (INFO memory) is re-read this often, so a CONFIG SET maxmemory is noticed.
_INFO_REFRESH_S = 30.0


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "backend", "redis", f"the redis client library installed (pip install 'kvpool[redis]' or pip install redis): {exc}"
        ) from exc
    return redis


def chunk_key(key: str, nonce: bytes, i: int) -> str:
    return f"{key}#chunk:{nonce.hex()}:{i}"


class RedisBackend(Backend):
    """A redis-py client behind the Backend protocol (thread-safe: redis-py pools connections)."""

    name = "redis"
    # A refused connection costs microseconds: try again soon (the backoff still grows to the
    # cap while the server stays away, which matters when each try costs a connect timeout).
    retry_first_s = 0.05

    def __init__(self, config: RedisSettings, client_name: str) -> None:
        redis = _import_redis()
        self._redis = redis
        self.config = config
        self.client_name = client_name
        self.r = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=min(config.redis_timeout_s, 2.0),
            client_name=client_name.replace(" ", "_")[:64] or None,
            health_check_interval=30,
        )
        self._ttl_ms = int(config.redis_ttl_s * 1000) or None
        self._capacity: int | None = None  # largest value Redis can take (None: no maxmemory)
        self._round_bytes = config.redis_chunk_size  # payload bytes per pipeline (see _rounds)
        self._capacity_at = 0.0
        try:
            self.r.ping()
            self._refresh_capacity(force=True)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Not fatal: vLLM runs without hits until the server is back, as with `server`.
            logger.warning("kvpool redis: %s is not reachable yet (%s); lookups miss until it is", config.redis_url, exc)

    # ---- helpers ------------------------------------------------------------------------------

    def _refresh_capacity(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._capacity_at < _INFO_REFRESH_S:
            return
        self._capacity_at = now
        try:
            info = self.r.info("memory")
        except self._redis.ResponseError:  # INFO disabled (some managed services): no client-side check
            self._capacity = None
            self._round_bytes = self.config.redis_chunk_size
            return
        maxmemory = int(info.get("maxmemory", 0) or 0)
        startup = int(info.get("used_memory_startup", 0) or 0)
        # Redis holds a value twice while it is written (the client's query buffer, then the
        # object), and both count against maxmemory: a value above half of the memory left after
        # start-up makes Redis evict everything and then fail with OOM (seen with Redis 7.0).
        memory = max(maxmemory - startup, 0)
        self._capacity = memory // 2 if maxmemory else None
        # Query and reply buffers count against maxmemory too: a pipeline carrying more than a
        # small share of it makes Redis evict stored objects to buffer the batch.
        self._round_bytes = min(self.config.redis_chunk_size, max(memory // 16, 64 << 10)) if maxmemory else (
            self.config.redis_chunk_size)

    def _rounds(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Split a batch into [start, end) runs of at most `_round_bytes` payload (one key at least)."""
        runs, start, acc = [], 0, 0
        for i, n in enumerate(sizes):
            if i > start and acc + n > self._round_bytes:
                runs.append((start, i))
                start, acc = i, 0
            acc += n
        if start < len(sizes):
            runs.append((start, len(sizes)))
        return runs

    def _code_of(self, exc: BaseException) -> int:
        redis = self._redis
        if isinstance(exc, redis.TimeoutError):
            return RPC_TIMEOUT
        if isinstance(exc, redis.ConnectionError):
            return RPC_FAIL
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or (
            isinstance(exc, redis.ResponseError) and "maxmemory" in str(exc)
        ):
            return NO_HANDLE
        return INTERNAL

    def _failed(self, exc: BaseException, what: str) -> int:
        code = self._code_of(exc)
        if code in (RPC_FAIL, RPC_TIMEOUT):
            self._link.down()  # fail fast until the backoff is over
        logger.warning("kvpool redis: %s failed on %s: [%s] %s", what, self.config.redis_url, ErrorCode(code).name, exc)
        return code

    # ---- protocol hooks (input checked and deduplicated by Backend) ----------------------------

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        try:
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                # TOUCH answers like EXISTS and refreshes the key's LRU clock (EXISTS does not).
                pipe.touch(k) if lease else pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        except self._redis.RedisError as exc:
            self._failed(exc, "exists")
            self._bump("failures", len(keys))
            return [False] * len(keys)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        try:
            self._refresh_capacity()
        except self._redis.RedisError as exc:
            return [self._failed(exc, "put")] * len(keys)
        codes: list[int] = []
        for a, z in self._rounds([total_size(v) for v in values]):
            if not self._link.up:  # an earlier round found the server gone
                codes.extend([RPC_FAIL] * (z - a))
                continue
            codes.extend(self._put_round(keys[a:z], values[a:z]))
        return codes

    def _put_round(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        # Only the copies into the pipeline (private bytes) run while the caller must wait: the
        # round trip runs after, so a frozen Redis costs the caller its deadline, not the socket
        # timeout on top of it.
        with self._buffers() as admitted:
            if not admitted:  # the caller stopped waiting: its buffers may hold other KV now
                return [RPC_TIMEOUT] * len(keys)
            codes = [OK] * len(keys)
            pipe, plan = self._put_pipeline(keys, values, codes)
        return self._put_send(pipe, plan, codes)

    def _put_pipeline(self, keys: list[str], values: list[list[np.ndarray]],
                      codes: list[int]) -> tuple[Any, list[tuple[int, int, list[str]]]]:
        """A pipeline holding copies of the values (it never refers to the caller's buffers),
        and its plan; keys refused up front get their code in `codes`."""
        chunk = self.config.redis_chunk_size
        px = self._ttl_ms
        # Chunks expire a little after their header, so a header never outlives its chunks' TTL
        # by design (eviction can still take a chunk alone: that read is then a miss).
        chunk_px = px + 60_000 if px else None
        pipe = self.r.pipeline(transaction=False)
        plan: list[tuple[int, int, list[str]]] = []  # (key index, header command index, chunk keys)
        ncmd = 0
        for i, (key, bufs) in enumerate(zip(keys, values)):
            size = total_size(bufs)
            if self._capacity is not None and size + HEADER_SIZE > self._capacity:
                codes[i] = NO_HANDLE
                continue
            if size <= chunk:
                blob = bytearray(HEADER_SIZE + size)
                payload = np.frombuffer(blob, dtype=np.uint8)[HEADER_SIZE:]
                gather(bufs, payload)
                _HEAD.pack_into(blob, 0, MAGIC, INLINE, size, checksum([payload], key_seed(key)))
                pipe.set(key, blob, nx=True, px=px)
                plan.append((i, ncmd, []))
                ncmd += 1
                continue
            nonce = os.urandom(16)
            mv = memoryview(gather(bufs))
            nchunks = (size + chunk - 1) // chunk
            ckeys = [chunk_key(key, nonce, c) for c in range(nchunks)]
            for c, ck in enumerate(ckeys):
                pipe.set(ck, mv[c * chunk : (c + 1) * chunk], px=chunk_px)
            ncmd += nchunks
            head = _HEAD.pack(MAGIC, CHUNKED, size, checksum([mv], key_seed(key))) + _CHUNKS.pack(nchunks, chunk, nonce)
            pipe.set(key, head, nx=True, px=px)
            plan.append((i, ncmd, ckeys))
            ncmd += 1
        return pipe, plan

    def _put_send(self, pipe: Any, plan: list[tuple[int, int, list[str]]], codes: list[int]) -> list[int]:
        if not plan:
            return codes
        try:
            results = pipe.execute(raise_on_error=False)
        except self._redis.RedisError as exc:
            code = self._failed(exc, "put")
            for i, _, _ in plan:
                codes[i] = code
            return codes
        losers: list[str] = []
        for i, at, ckeys in plan:
            res = results[at]
            failed_chunk = next((r for r in results[at - len(ckeys) : at] if isinstance(r, Exception)), None)
            if isinstance(res, Exception) or failed_chunk is not None:
                codes[i] = self._failed(res if isinstance(res, Exception) else failed_chunk, "put")
                losers.extend(ckeys)
            elif res is None:  # SET NX refused: the key is stored already, our chunks are not needed
                codes[i] = EXISTS
                losers.extend(ckeys)
        if losers:
            try:
                self.r.unlink(*losers)
            except self._redis.RedisError:
                pass  # they expire (TTL) or are evicted like any key
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        codes: list[int] = []
        for a, z in self._rounds([total_size(v) for v in values]):
            if not self._link.up:  # an earlier round found the server gone
                codes.extend([RPC_FAIL] * (z - a))
                continue
            codes.extend(self._get_round(keys[a:z], values[a:z]))
        return codes

    def _get_round(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        try:
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            blobs = pipe.execute(raise_on_error=False)
        except self._redis.RedisError as exc:
            return [self._failed(exc, "get")] * len(keys)
        codes = [OK] * len(keys)
        chunked: list[tuple[int, int, list[str], bytes]] = []
        for i, (key, blob, dests) in enumerate(zip(keys, blobs, values)):
            if isinstance(blob, Exception):
                codes[i] = self._failed(blob, "get")
                continue
            if blob is None:
                codes[i] = NOT_FOUND
                continue
            if bytes(blob[:4]) in OLD_MAGICS:
                codes[i] = NOT_FOUND
                continue
            if len(blob) < HEADER_SIZE:
                codes[i] = INTERNAL
                logger.error("kvpool redis: key %r holds %d bytes, not a kvpool object", key, len(blob))
                continue
            magic, kind, size, want_sum = _HEAD.unpack_from(blob, 0)
            if magic != MAGIC or kind not in (INLINE, CHUNKED):
                codes[i] = INTERNAL
                logger.error("kvpool redis: key %r is not a kvpool object (another application's key?)", key)
                continue
            if total_size(dests) != size:
                codes[i] = INVALID
                continue
            if kind == INLINE:
                if len(blob) != HEADER_SIZE + size:
                    codes[i] = INTERNAL
                    continue
                codes[i] = self._deliver(key, memoryview(blob)[HEADER_SIZE:], dests, want_sum)
            else:
                # Any client can SET this key: a header cut short, or one whose chunk count its
                # size cannot need (4 billion chunk keys would take the worker down), is not ours.
                nchunks, csize, nonce = _CHUNKS.unpack_from(blob, HEADER_SIZE) if (
                    len(blob) == HEADER_SIZE + _CHUNKS.size) else (0, 0, b"")
                if csize <= 0 or nchunks != (size + csize - 1) // csize:
                    codes[i] = INTERNAL
                    logger.error("kvpool redis: key %r holds a chunked header of %d bytes that does not describe "
                                 "%d bytes (another application's key?); it is treated as an error, never as data",
                                 key, len(blob), size)
                    continue
                chunked.append((i, size, [chunk_key(key, nonce, c) for c in range(nchunks)], bytes(blob)))
        if chunked:
            self._get_chunks(keys, values, codes, chunked)
        return codes

    def _get_chunks(self, keys: list[str], values: list[list[np.ndarray]], codes: list[int],
                    chunked: list[tuple[int, int, list[str], bytes]]) -> None:
        try:
            pipe = self.r.pipeline(transaction=False)
            for _, _, ckeys, _ in chunked:
                for ck in ckeys:
                    pipe.get(ck)
            parts = pipe.execute(raise_on_error=False)
        except self._redis.RedisError as exc:
            code = self._failed(exc, "get")
            for i, _, _, _ in chunked:
                codes[i] = code
            return
        pos = 0
        for i, size, ckeys, head in chunked:
            mine = parts[pos : pos + len(ckeys)]
            pos += len(ckeys)
            err = next((p for p in mine if isinstance(p, Exception)), None)
            if err is not None:
                codes[i] = self._failed(err, "get")
                continue
            if any(p is None for p in mine) or sum(len(p) for p in mine) != size:
                # A chunk was evicted or expired alone: the object is gone. Drop its header
                # (only if it is still this object) so lookups stop finding it.
                codes[i] = NOT_FOUND
                self._drop_header(keys[i], head)
                continue
            codes[i] = self._deliver(keys[i], gather(mine), values[i], _HEAD.unpack_from(head, 0)[3])

    def _deliver(self, key: str, payload: memoryview | np.ndarray, dests: list[np.ndarray], want_sum: int) -> int:
        """Copy one object's payload into its destination if it is what its writer stored under
        `key` (our private copy is checked, then copied) and the caller still waits for it."""
        if checksum([payload], key_seed(key)) != want_sum:
            return CHECKSUM_MISMATCH
        with self._buffers() as admitted:
            if not admitted:
                return RPC_TIMEOUT
            scatter(payload, dests)
            return OK

    _DROP = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

    def _drop_header(self, key: str, head: bytes) -> None:
        try:
            self.r.eval(self._DROP, 1, key, head)
        except self._redis.RedisError as exc:  # EVAL may be disabled; the key then ages out
            logger.debug("kvpool redis: could not drop orphan header %r: %s", key, exc)

    def _close(self) -> None:
        try:
            self.r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass


# ---- `kvpool doctor` ---------------------------------------------------------------------------


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: redis`: it answers, and its memory limit and eviction policy."""
    try:
        import redis
    except ImportError:
        report.error("the redis client library is not installed", "pip install 'kvpool[redis]'")
        return
    settings = cfg.backend_settings
    assert isinstance(settings, RedisSettings)
    r = redis.Redis.from_url(settings.redis_url, socket_timeout=args.timeout, socket_connect_timeout=args.timeout)
    try:
        r.ping()
        info = r.info("memory")
    except redis.RedisError as exc:
        report.error(f"Redis at {settings.redis_url} does not answer ({exc})",
                     "start it (redis-server --port ... --maxmemory 8gb --maxmemory-policy allkeys-lru) or fix redis_url")
        return
    finally:
        r.close()
    report.ok(f"Redis answers at {settings.redis_url}")
    maxmemory, policy = int(info.get("maxmemory", 0) or 0), info.get("maxmemory_policy", "?")
    if not maxmemory:
        report.warn("Redis has no maxmemory: the pool grows until the host runs out of memory",
                    "set maxmemory (e.g. CONFIG SET maxmemory 8gb) with maxmemory-policy allkeys-lru")
    if policy not in ("allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu", "allkeys-random", "volatile-ttl",
                      "volatile-random"):
        report.warn(f"Redis maxmemory-policy is {policy}: once full, every save fails (NO_AVAILABLE_HANDLE)",
                    "CONFIG SET maxmemory-policy allkeys-lru")
    elif policy.startswith("volatile") and not settings.redis_ttl_s:
        report.warn(f"Redis maxmemory-policy {policy} evicts only keys with a TTL, and redis_ttl_s is 0",
                    "use allkeys-lru, or set redis_ttl_s")
