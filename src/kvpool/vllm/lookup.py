"""The lookup channel between vLLM's scheduler process and worker rank 0.

The scheduler asks "how many blocks of these hashes, after the first `start` blocks of the
prompt that vLLM already holds, can the pool serve?"; worker rank 0 owns a backend client and
answers (for a model with several KV cache groups, by the rule of `kvpool.vllm.groups`, which
needs the absolute position). The channel is a Unix stream socket whose name contains
`lookup_rpc_port`, so two instances on one host need different values, carrying the frames of
`kvpool server`'s protocol (a length, then msgpack): `[start, block hashes]` out, the hit
(`[blocks, pinned]`) back.
A flock on a file beside the socket detects a clash at start-up (a second bind would replace
the socket's name silently) and is released by the kernel if the owner dies, so a crashed
instance never blocks its successor.

Every prompt is looked up before it is scheduled, so the round trip is on every request's time
to first token. A plain socket read by a thread blocked in `select` wakes that thread straight
from the kernel; a ZMQ REQ/REP pair passes each message through an I/O thread on both sides.
Measured on a 2-vCPU Xeon with 64 block hashes, median round trip: 15 µs against 154 µs
between two unpinned processes, 38 against 81 µs with each pinned to a core that other threads
keep busy. (Inside vLLM on that machine each direction takes ~0.2 ms with either
transport, so there something other than the transport sets that figure.)

Where worker rank 0 runs in the scheduler's own process (vLLM's single-process executor: the
default for one GPU or NPU, and vLLM-CPU with `VLLM_ENABLE_V1_MULTIPROCESSING=0`), the client
calls the server's hit count directly, on the scheduler's thread: no socket, no frame and no
hand-over to the server's thread and back, which is where the round trip's time goes inside a
busy vLLM process (above). The call is bounded as the socket's is not: by the backend, whose
stores outside the process answer a lookup within their guard's deadline (backends/guard.py),
while `local`'s lookup is a walk of the engine's index under a lock never held over I/O. The
server still listens, for schedulers in other processes.

Socket and lock live in the per-user runtime directory (mode 0700, kvpool.paths), so no other
user can connect, plant a socket there first or hold the lock; `VLLM_RPC_BASE_PATH`, when set,
replaces that directory and must pass the same check as an explicit `kvpool server` socket path.
Paths can still be swapped after they were checked (a directory whose parent another user may
write), so both ends also ask the kernel who is at the other end (SO_PEERCRED) before either
says anything: a peer of another uid is dropped, and to the scheduler that is a miss. Nobody
else learns a prompt's block hashes, and nobody else's hit counts are believed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from kvpool.backoff import Backoff
from kvpool.config import MAX_SOCKET_PATH
from kvpool.errors import ConfigError
from kvpool.keys import TENANT_TAG_HEX
from kvpool.paths import check_socket_dir, open_private_lock, runtime_dir
from kvpool.server.peers import peer_of, trusted
from kvpool.server.protocol import MAX_REQUEST_FRAME, FrameError, encode_frame, recv_frame

logger = logging.getLogger(__name__)

# A lookup that does not answer in time is a miss: a stuck worker must never stall scheduling.
LOOKUP_TIMEOUT_MS = 2000
# After a lookup timed out, the next ones are misses without asking, for this long, doubling on
# each timeout up to the maximum: a worker stuck on a hung store would otherwise cost every
# waiting request the whole timeout, on every step.
LOOKUP_BACKOFF_S = 1.0
LOOKUP_BACKOFF_MAX_S = 30.0
# How often the server thread wakes to see whether close() was called (bounds close()'s wait).
POLL_INTERVAL_MS = 200
# A reply is a small integer and a flag.
MAX_REPLY_FRAME = 64


class Hit(NamedTuple):
    """A lookup's answer: how many of the blocks asked about the pool serves, and whether their
    load cannot fail (each block the hit needs is pinned in worker rank 0's own memory for the
    lookup lease's TTL: `Presence.PINNED`), so that the load may run synchronously even where
    vLLM could not be told of a failed one."""

    blocks: int
    pinned: bool = False


MISS = Hit(0)

# (block hashes after the prompt's first `start` blocks, start, tenant tag) -> the hit (a bare
# count is a hit nobody pinned).
CountHits = Callable[[Sequence[bytes], int, str], Hit | int]
_TENANT = re.compile(f"(?:[0-9a-f]{{{TENANT_TAG_HEX}}})?")  # a tag, or "" (no cache_salt)

# The hit counts of the servers in this process, by socket path: a client with the same path is
# in worker rank 0's process and asks it directly (see the module docstring).
_IN_PROCESS: dict[str, CountHits] = {}


def _count_or_miss(count: Callable[[], Hit | int]) -> Hit:
    """`count()`; a bad request or a backend error is a miss, never a dead server or a failed schedule."""
    try:
        hit = count()
        return Hit(hit) if isinstance(hit, int) else Hit(int(hit.blocks), bool(hit.pinned))
    except Exception:
        logger.exception("kvpool lookup failed; answering 0 hits")
        return MISS


class UntrustedPeer(OSError):
    """The other end of the lookup channel is a process of another user."""


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise UntrustedPeer unless the kernel says `sock`'s peer runs as our uid."""
    peer = peer_of(sock)
    if not trusted(sock, peer, None):
        raise UntrustedPeer(f"the lookup channel {path} is held by another user ({peer.describe()}; we are uid "
                            f"{os.getuid()}): refusing it. Someone may have replaced its directory; keep "
                            f"VLLM_RPC_BASE_PATH in a directory whose parents only this user can write")


def lookup_socket_path(lookup_rpc_port: int, dp_rank: int = 0) -> str:
    """The channel's socket path; its directory is created (runtime dir) or checked first."""
    name = f"kvpool_lookup_{lookup_rpc_port}_dp{dp_rank}.sock"
    base = os.environ.get("VLLM_RPC_BASE_PATH")
    if not base:
        return os.path.join(runtime_dir(), name)
    path = os.path.join(base, name)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError("VLLM_RPC_BASE_PATH", base, f"a directory whose path leaves room for {name!r} "
                                                      f"in a Unix socket path of at most {MAX_SOCKET_PATH} bytes")
    if check_socket_dir(path, "VLLM_RPC_BASE_PATH").shared:
        # A sticky directory anyone can write (like /tmp): others could bind our name first.
        raise ConfigError("VLLM_RPC_BASE_PATH", base, "a directory only this user can write; unset it to "
                                                      "use kvpool's private runtime directory")
    return path


class LookupServer:
    """Answers lookups on a daemon thread in worker rank 0."""

    def __init__(self, lookup_rpc_port: int, dp_rank: int, count_hits: CountHits) -> None:
        self.path = lookup_socket_path(lookup_rpc_port, dp_rank)
        self._lock_fd = open_private_lock(self.path + ".lock", "lookup_rpc_port")
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ConfigError(
                "lookup_rpc_port", lookup_rpc_port,
                f"a value no other running vLLM instance on this host uses ({self.path} is taken); "
                "give each instance its own lookup_rpc_port",
            ) from None
        self._count_hits = count_hits
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(self.path):  # left by a process that died holding the lock we now hold
            os.unlink(self.path)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpool-lookup", daemon=True)
        self._thread.start()
        _IN_PROCESS[self.path] = count_hits

    def _serve(self) -> None:
        # One thread answers every connection in turn (normally there is one: the scheduler's).
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(POLL_INTERVAL_MS / 1000):
                    if key.fileobj is self._listener:
                        try:
                            conn, _ = self._listener.accept()
                        except OSError:
                            continue
                        try:
                            check_peer(conn, self.path)  # before it hears or tells anything
                        except OSError as e:
                            logger.error("kvpool lookup channel: dropping a connection: %s", e)
                            conn.close()
                            continue
                        sel.register(conn, selectors.EVENT_READ)
                    elif not self._answer(key.fileobj):
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
            for key in list(sel.get_map().values()):
                if key.fileobj is not self._listener:
                    key.fileobj.close()

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request on `conn`; False when the connection is closed or unusable."""
        try:
            body = recv_frame(conn, MAX_REQUEST_FRAME, deadline=time.monotonic() + LOOKUP_TIMEOUT_MS / 1000)
        except (OSError, FrameError) as e:
            logger.warning("kvpool lookup channel: dropping a connection (%s)", e)
            return False
        if body is None:
            return False
        def count() -> Hit | int:
            start, hashes, tenant = msgspec.msgpack.decode(body, type=tuple[int, list[bytes], str])
            if start < 0 or not _TENANT.fullmatch(tenant):
                raise ValueError(f"a lookup from block {start} of tenant {tenant[:40]!r}")
            return self._count_hits(hashes, start, tenant)

        hits = _count_or_miss(count)
        try:
            conn.settimeout(LOOKUP_TIMEOUT_MS / 1000)
            conn.sendall(encode_frame(list(hits)))
        except OSError:  # the client gave up waiting (its timeout) and closed
            return False
        return True

    def close(self) -> None:
        if _IN_PROCESS.get(self.path) is self._count_hits:
            del _IN_PROCESS[self.path]
        self._stop.set()
        self._thread.join(timeout=2)
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)


class LookupClient:
    """Scheduler-side client. Any failure (timeout, no server yet) is reported as 0 hits.

    A timeout opens a breaker: lookups are misses without asking until its back-off has passed,
    then one lookup tries again (a success closes it, a timeout doubles the back-off). Failures
    that cost no time (no server yet, a closed connection) do not open it.

    With `direct` (the default), a server in this process is asked by a plain call instead.
    """

    def __init__(self, lookup_rpc_port: int, dp_rank: int = 0, direct: bool = True) -> None:
        self.path = lookup_socket_path(lookup_rpc_port, dp_rank)
        self._direct = direct
        self._sock: socket.socket | None = None
        self._skip_until = 0.0  # time.monotonic(): lookups before it are misses without asking
        self._backoff = Backoff(LOOKUP_BACKOFF_S, LOOKUP_BACKOFF_MAX_S)
        self.skipped = 0  # lookups answered as misses by the open breaker

    def _socket(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(LOOKUP_TIMEOUT_MS / 1000)
                s.connect(self.path)
                check_peer(s, self.path)  # before a single hash goes out
            except BaseException:
                s.close()
                raise
            self._sock = s
        return self._sock

    def _drop(self) -> None:
        # A connection that missed a reply could deliver it as the next lookup's answer: start over.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> Hit:
        """How many of `block_hashes` (the prompt's blocks after its first `start`, of `tenant`:
        `kvpool.keys.tenant_tag`) the pool serves for every rank and group, and whether their
        load cannot fail; a miss on any error."""
        if not block_hashes:
            return MISS
        count_hits = _IN_PROCESS.get(self.path) if self._direct else None
        if count_hits is not None:
            hit = _count_or_miss(lambda: count_hits(block_hashes, start, tenant))
        else:
            hit = self._ask_over_socket(block_hashes, start, tenant)
        # More hits than blocks asked about would have vLLM load blocks nobody stored.
        return hit if 0 <= hit.blocks <= len(block_hashes) else MISS

    def _ask_over_socket(self, block_hashes: Sequence[bytes], start: int, tenant: str) -> Hit:
        now = time.monotonic()
        if now < self._skip_until:
            self.skipped += 1
            return MISS
        deadline = now + LOOKUP_TIMEOUT_MS / 1000
        try:
            sock = self._socket()
            sock.settimeout(LOOKUP_TIMEOUT_MS / 1000)
            sock.sendall(encode_frame([start, list(block_hashes), tenant]))
            body = recv_frame(sock, MAX_REPLY_FRAME, deadline=deadline)
            if body is None:
                raise ConnectionResetError("the worker closed the lookup channel")
            hit = Hit(*msgspec.msgpack.decode(body, type=tuple[int, bool]))
        except (msgspec.DecodeError, FrameError) as e:
            logger.warning("kvpool lookup on %s: a malformed reply (%s); treating as a miss", self.path, e)
            self._drop()
            return MISS
        except TimeoutError:
            wait = self._backoff.failed()
            self._skip_until = time.monotonic() + wait
            logger.warning("kvpool lookup on %s: no answer in %d ms (worker rank 0 stuck, e.g. on a hung "
                           "store); the next %.0f s of lookups are misses without asking",
                           self.path, LOOKUP_TIMEOUT_MS, wait)
            self._drop()
            return MISS
        except UntrustedPeer as e:
            logger.error("kvpool lookup: %s; treating as a miss", e)
            self._drop()
            return MISS
        except OSError as e:  # no server yet, a closed connection
            logger.warning("kvpool lookup on %s failed (%s); treating as a miss", self.path, e)
            self._drop()
            return MISS
        if self._backoff.failing:
            logger.info("kvpool lookup on %s answers again; %d lookups were misses meanwhile",
                        self.path, self.skipped)
            self._backoff.reset()
        return hit

    def close(self) -> None:
        self._drop()
