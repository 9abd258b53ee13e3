"""The lookup channel between vLLM's scheduler process and worker rank 0.

The scheduler asks "how many leading blocks of these hashes are pooled?"; worker rank 0 owns
a backend client and answers. The channel is a ZMQ REQ/REP pair over an IPC socket whose name
contains `lookup_rpc_port`, so two instances on one host need different values. A flock on a
file beside the socket detects a clash at start-up (ZMQ would silently steal the socket) and is
released by the kernel if the owner dies, so a crashed instance never blocks its successor.

Socket and lock live in the per-user runtime directory (mode 0700, kvpool.paths), so no other
user can connect, plant a socket there first or hold the lock; `VLLM_RPC_BASE_PATH`, when set,
replaces that directory and must pass the same check as an explicit `kvpool server` socket path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable, Sequence

import msgspec
import zmq

from kvpool.errors import ConfigError
from kvpool.paths import check_socket_dir, open_private_lock, runtime_dir

logger = logging.getLogger(__name__)

# A lookup that does not answer in time is a miss: a stuck worker must never stall scheduling.
LOOKUP_TIMEOUT_MS = 2000
# How often the server thread wakes to see whether close() was called (bounds close()'s wait).
POLL_INTERVAL_MS = 200


def lookup_socket_path(lookup_rpc_port: int, dp_rank: int = 0) -> str:
    """The channel's socket path; its directory is created (runtime dir) or checked first."""
    name = f"kvpool_lookup_{lookup_rpc_port}_dp{dp_rank}.sock"
    base = os.environ.get("VLLM_RPC_BASE_PATH")
    if not base:
        return os.path.join(runtime_dir(), name)
    path = os.path.join(base, name)
    if check_socket_dir(path, "VLLM_RPC_BASE_PATH").shared:
        # A sticky directory anyone can write (like /tmp): others could bind our name first.
        raise ConfigError("VLLM_RPC_BASE_PATH", base, "a directory only this user can write; unset it to "
                                                      "use kvpool's private runtime directory")
    return path


class LookupServer:
    """Answers lookups on a daemon thread in worker rank 0."""

    def __init__(self, lookup_rpc_port: int, dp_rank: int, count_hits: Callable[[Sequence[bytes]], int]) -> None:
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
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{self.path}")
        os.chmod(self.path, 0o600)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpool-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_INTERVAL_MS):
                continue
            try:
                hashes = msgspec.msgpack.decode(self._sock.recv(), type=list[bytes])
                hits = self._count_hits(hashes)
            except Exception:  # a bad request or a backend error is a miss, never a dead server
                logger.exception("kvpool lookup failed; answering 0 hits")
                hits = 0
            self._sock.send(msgspec.msgpack.encode(hits))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)


class LookupClient:
    """Scheduler-side client. Any failure (timeout, no server yet) is reported as 0 hits."""

    def __init__(self, lookup_rpc_port: int, dp_rank: int = 0) -> None:
        self.path = lookup_socket_path(lookup_rpc_port, dp_rank)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, LOOKUP_TIMEOUT_MS)
            s.setsockopt(zmq.SNDTIMEO, LOOKUP_TIMEOUT_MS)
            s.connect(f"ipc://{self.path}")
            self._sock = s
        return self._sock

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Number of leading blocks pooled for every rank; 0 on any error."""
        if not block_hashes:
            return 0
        try:
            sock = self._socket()
            sock.send(msgspec.msgpack.encode(list(block_hashes)))
            hits = msgspec.msgpack.decode(sock.recv(), type=int)
        except msgspec.DecodeError as e:
            logger.warning("kvpool lookup on %s: a malformed reply (%s); treating as a miss", self.path, e)
            return 0
        except zmq.ZMQError as e:
            # A REQ socket that missed its reply is stuck in the wrong state: start a new one.
            logger.warning("kvpool lookup on %s failed (%s); treating as a miss", self.path, e)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            return 0
        # More hits than blocks asked about would have vLLM load blocks nobody stored.
        return hits if 0 <= hits <= len(block_hashes) else 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
