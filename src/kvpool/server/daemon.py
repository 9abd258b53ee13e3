"""`kvpool server`: one pool engine per host, shared by every vLLM instance on it.

The engine's arena lives in POSIX shared memory (`shm.py`) that clients map, so payloads are
copied by the clients themselves, straight between their KV cache and the arena. Only metadata
(allocate, commit, lookup, lease, ping) crosses the Unix socket, as msgpack frames
(`protocol.py`).

One thread per connection: a handful of vLLM workers connect, each keeps one connection, and a
silent or misbehaving peer blocks only its own thread. All shared state is in the thread-safe
engine; what a connection holds (its allocations and read leases) is tracked per connection
too, so a client can only commit or release what it was given, and everything it held is
dropped the moment its connection closes (a SIGKILLed writer's half-written range is freed and
never published).

Fair sharing (docs/security.md (fair sharing)): a connection that has not said Hello yet may send
one small frame (`protocol.MAX_HELLO_FRAME`) within one deadline from accept; at most
`max_handshakes` such strangers are kept (a new one closes the oldest), and they do not count
toward `max_connections`, which only handshaken clients use up, at most
`max_connections_per_client` per client process. Each client process is one owner for the
engine's quotas (`client_pool_share`, `client_max_leases`, `client_max_hold_s`), however many
connections it opens.

Start-up exclusivity: a `flock` on `<socket>.lock` is held for the server's lifetime. The
kernel drops it when the process dies however it dies, so a server that gets the lock knows any
socket file (and `/dev/shm` arena of that socket) is a dead server's leftover and takes over;
one that does not get it exits, naming the live server's pid.

Trust (docs/security.md): the socket, its lock and the arena are this user's (mode 0600, or
0660 and `--allowed-gid`'s group with group sharing), the default socket is in the per-user
runtime directory, and every accepted connection's SO_PEERCRED must be our uid or a member of
`--allowed-gid`; anyone else gets an error reply saying so and is closed before a request.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import logging
import os
import re
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpool.config import ServerSettings, add_flags, admin_token_from, flag_name, from_flags, load_tenants
from kvpool.errors import ConfigError, ErrorCode, KVPoolError
from kvpool.paths import check_socket_dir, open_private_lock
from kvpool.server import peers
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.server.pidwatch import PidWatch
from kvpool.store.engine import PoolEngine
from kvpool.store.records import Allocation, Lease, LookupLease
from kvpool.server.control import Controller
from kvpool.server.drops import DropFeed
from kvpool.server.metrics import ADMIN_TOKEN_ENV, MetricsServer, ServerMetrics

logger = logging.getLogger("kvpool.server")

# A connection may hold this many unreleased read leases; past it the oldest are released
# (a client that never releases must not grow the server without bound).
_MAX_LEASES_PER_CONN = 1 << 16
# A connection's map of its uncommitted allocations is pruned of those the engine reclaimed once
# it holds more than this many (or twice what the last prune kept).
PENDING_PRUNE_AT = 4096
# Heap bytes an object costs the server besides its key, charged to the memory budget with the
# key's bytes, so a flood of tiny objects with long keys fills the pool instead of the server's
# heap. An object alone takes ~170 B (benchmarks/scale.py measures it); while it carries a lookup
# lease its lease tables take ~0.6 KiB more, which is what the rest of this charge covers.
_OBJECT_OVERHEAD_BYTES = 1024

# Each request type's `op` label of kvpool_request_duration_seconds (catalog.SERVER_OPS).
_OPS = {cls: re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower() for cls in typing.get_args(P.Request)}


class ServerRunning(KVPoolError):
    """Another live server owns the socket."""

    code = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS


# ---- the socket lock ----------------------------------------------------------------------


def _acquire_socket_lock(socket_path: str) -> int:
    """flock ``<socket>.lock``; raise ServerRunning if a live server holds it."""
    lock_path = socket_path + ".lock"
    for _ in range(5):
        fd = open_private_lock(lock_path, "socket")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise ServerRunning(
                f"another kvpool server (pid {pid}) is serving on {socket_path}; stop it first "
                f"or give this one another --socket"
            ) from None
        # A server shutting down unlinks the lock file; if we locked an unlinked inode, retry
        # on the fresh file, or two servers could each hold "the" lock.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise ServerRunning(f"could not lock {lock_path}: it keeps being replaced")


def _bind(socket_path: str, mode: int, allowed_gid: int | None) -> socket.socket:
    """Bind the listening socket, replacing a dead server's socket file (we hold the lock)."""
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError("socket", socket_path, "a path that is free or a stale socket; it is another kind of file")
        os.unlink(socket_path)
        logger.info("took over stale socket %s (its server is gone)", socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Created 0600 (no window where another user could connect), then set to the asked mode.
    old = os.umask(0o177)
    try:
        sock.bind(socket_path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    if allowed_gid is not None:
        os.chown(socket_path, -1, allowed_gid)
        mode |= 0o060  # the group must be able to connect; --socket-mode may widen further
    os.chmod(socket_path, mode)
    sock.listen(128)
    return sock


def _peer_ids(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the peer, as SO_PEERCRED recorded them at connect; pid 0 if unknown."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        return pid, uid
    except (OSError, AttributeError):
        return 0, os.getuid()


# ---- connections --------------------------------------------------------------------------


def _owner(peer_pid: int, peer_uid: int, hello: P.Hello) -> str:
    """Who a connection's quotas count against: another user as a whole, or a process of ours.

    A user other than the server's own (group sharing, --allowed-gid) is one owner, ``uid:N``,
    whatever processes it runs: its pool share, leases, hold time and connections are its own
    and no more, however many processes it starts. The server's own uid is the pool's owner
    (its processes may read and overwrite everything anyway); its processes are kept apart as
    follows.

    The kernel's pid (SO_PEERCRED) when it gives one: a client cannot pick it, so opening more
    connections, or claiming another pid, buys no more quota. It gives 0 for a peer in a PID
    namespace the server cannot see (another pod or container than the server's), and there
    the only ids are the client's own words: its pid inside its container, which identical pods
    share (every one's first worker is the same pid), and the random id its process drew
    (`Hello.process`), which tells them apart. A client that lies there could have claimed
    another pid before; quotas keep honest neighbours apart, and the trust domain (one uid)
    is what keeps out the rest.
    """
    if peer_uid != os.getuid():
        return f"uid:{peer_uid}"
    if peer_pid > 0:
        return f"pid:{peer_pid}"
    return f"pid:{hello.pid}@{hello.process}" if hello.process else f"pid:{hello.pid}"


@dataclasses.dataclass
class _Conn:
    sock: socket.socket
    seq: int
    peer_pid: int
    peer_uid: int
    client_id: str = ""
    name: str = ""
    owner: str = ""  # the client process this connection counts against, once handshaken (`_owner`)
    connected_at: float = dataclasses.field(default_factory=time.time)
    accepted_at: float = dataclasses.field(default_factory=time.monotonic)  # the handshake deadline's start
    evicted: bool = False  # closed by the server to admit a newer stranger
    warned_quota: bool = False
    requests: int = 0
    pending: dict[int, Allocation] = dataclasses.field(default_factory=dict)
    prune_at: int = 0  # len(pending) past which the handles the engine reclaimed are dropped from it
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    drop_cursor: int | None = None  # where this connection is in the drop feed, once it asked


class Server:
    """The daemon. ``start()`` binds and maps everything; ``serve_forever()`` accepts until ``stop()``."""

    def __init__(self, config: ServerSettings) -> None:
        self.config = config
        self.engine: PoolEngine | None = None
        self.arena: shm.Arena | None = None
        self.metrics: MetricsServer | None = None
        self.controller: Controller | None = None
        self.drops: DropFeed | None = None
        self.prom = ServerMetrics(self.stats, lambda: self.controller.tenant_usage() if self.controller else {})
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._frame_budget = P.FrameBudget(config.frame_budget)  # partly received request frames
        self._pids: PidWatch | None = None  # the processes that opened connections (start())
        # Connections that have not finished their Hello, oldest first (seq order).
        self._strangers: dict[int, _Conn] = {}
        self._per_owner: dict[str, int] = {}  # handshaken connections per client process (`_owner`)
        self._handshaken = 0
        self._threads: set[threading.Thread] = set()
        self._state = threading.Lock()
        self._seq = 0
        self._counters = {"lookup_keys": 0, "lookup_hits": 0, "connections": 0, "protocol_errors": 0,
                          "refused_peers": 0, "refused_connections": 0, "evicted_handshakes": 0,
                          "handshake_timeouts": 0, "frame_budget_refusals": 0, "request_timeouts": 0,
                          "orphaned_connections": 0}
        self._started = time.monotonic()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        # Before anything is created: a bad tenants file is a configuration error, said at once.
        tenants = load_tenants(cfg.tenants_file) if cfg.tenants_file else ()
        # The default socket's directory is created here; another must not let others plant files.
        check_socket_dir(cfg.socket_path, "socket", cfg.allowed_gid)
        self._lock_fd = _acquire_socket_lock(cfg.socket_path)
        try:
            removed = shm.remove_stale(cfg.socket_path)
            if removed:
                logger.info("removed arena(s) left by a dead server: %s", ", ".join(removed))
            dead = shm.remove_leftovers()
            if dead:
                logger.info("removed %d arena(s) of dead servers of other sockets, %d bytes in memory: %s",
                            len(dead), sum(d.resident for d in dead), ", ".join(d.name for d in dead))
            self._listener = _bind(cfg.socket_path, cfg.socket_mode, cfg.allowed_gid)
            self.arena = shm.create(shm.arena_name(cfg.socket_path, os.getpid()), cfg.memory_size,
                                    cfg.allowed_gid)
            self._pids = PidWatch(self._opener_exited)
            engine_config = cfg.engine_config(client_ttl_s=cfg.client_ttl_s, put_timeout_s=cfg.put_timeout_s,
                                              reap_interval_s=min(1.0, cfg.client_ttl_s / 4),
                                              client_pool_share=cfg.client_pool_share,
                                              client_max_leases=cfg.client_max_leases,
                                              client_max_hold_s=cfg.client_max_hold_s,
                                              object_overhead_bytes=_OBJECT_OVERHEAD_BYTES,
                                              max_key_bytes=P.MAX_KEY_BYTES,
                                              tenant_budgets={t.tag: t.budget for t in tenants})
            self.engine = PoolEngine(engine_config, arena=memoryview(self.arena.array))
            self.controller = Controller(self.engine, tenants)
            self.drops = DropFeed(self.engine)
            if cfg.metrics_port is not None:
                try:
                    self.metrics = MetricsServer(cfg.metrics_host, cfg.metrics_port, self.stats, self.prom,
                                                 self.controller, admin_token_from(os.environ, ADMIN_TOKEN_ENV))
                except OSError as exc:
                    raise ConfigError("metrics_port", cfg.metrics_port,
                                      f"a free TCP port on {cfg.metrics_host} ({exc.strerror})") from None
                self.metrics.start()
        except BaseException:
            self._cleanup()
            raise
        logger.info(
            "kvpool server %d listening on %s (mode %o): arena %s/%s of %d bytes, lease ttl %d ms, "
            "client ttl %ss, offload %s, metrics %s",
            os.getpid(), cfg.socket_path, cfg.socket_mode, shm.SHM_DIR, self.arena.name, cfg.memory_size,
            cfg.default_kv_lease_ttl_ms, cfg.client_ttl_s,
            f"{cfg.offload_path} ({cfg.offload_eviction_policy})" if cfg.offload_path else "off",
            self.metrics.url if self.metrics else "off",
        )

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler or another thread)."""
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def serve_forever(self) -> None:
        assert self._listener is not None
        self._listener.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        # Python runs signal handlers on the main thread, but the kernel hands a process-directed
        # signal to any thread that does not block it: taken by a connection's thread, SIGTERM
        # would leave this select() asleep for good. With the wake pipe as the wakeup fd, the
        # C-level handler wakes it from whichever thread took the signal.
        on_main = threading.current_thread() is threading.main_thread()
        previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False) if on_main else -1
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    else:  # a stop() or a signal's byte: drained, so select() blocks again
                        os.read(self._wake_r, 4096)
        finally:
            if on_main:
                signal.set_wakeup_fd(previous_wakeup)
            sel.close()
            self._shutdown()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. EMFILE: keep serving the connections we have
            logger.warning("accept failed: %s", exc)
            time.sleep(0.05)
            return
        sock.setblocking(True)
        if not self._peer_trusted(sock):
            return
        evict: _Conn | None = None
        with self._state:
            # Strangers are capped on their own and the oldest makes way, so idle connections
            # that never say Hello cannot keep clients out; max_connections counts handshakes.
            if len(self._strangers) >= self.config.max_handshakes:
                evict = self._strangers.pop(next(iter(self._strangers)))
                evict.evicted = True
                self._counters["evicted_handshakes"] += 1
            self._seq += 1
            conn = _Conn(sock, self._seq, *_peer_ids(sock))
            self._conns[conn.seq] = conn
            self._strangers[conn.seq] = conn
            self._counters["connections"] += 1
        if evict is not None:
            self._evict(evict)
        t = threading.Thread(target=self._serve_conn, args=(conn,), name=f"kvpool-conn-{conn.seq}", daemon=True)
        with self._state:
            self._threads.add(t)
        try:
            t.start()
        except RuntimeError as exc:
            # Out of threads (a container's pids limit, RLIMIT_NPROC): as with EMFILE above, this
            # connection goes and the others are still served; serve_forever must not end over it.
            with self._state:
                self._threads.discard(t)
            logger.warning("cannot start a thread for connection %d (pid %d): %s; closing it",
                           conn.seq, conn.peer_pid, exc)
            try:  # from the accept thread: never block on a peer that does not read
                conn.sock.send(P.encode_frame(P.Error(
                    int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS),
                    f"the server cannot start a thread for this connection ({exc}); retry later, or "
                    f"raise the server's thread limit (pids cgroup, ulimit -u)")), socket.MSG_DONTWAIT)
            except OSError:
                pass
            self._close_conn(conn, f"no thread for it: {exc}")

    def _peer_trusted(self, sock: socket.socket) -> bool:
        """Refuse (with an error reply that says why) a peer outside this pool's trust domain."""
        try:
            peer = peers.peer_of(sock)
            ok = peers.trusted(sock, peer, self.config.allowed_gid)
        except OSError as exc:
            peer, ok = None, False
            logger.warning("refusing a connection: cannot tell who it is from (%s)", exc)
        if ok:
            return True
        with self._state:
            self._counters["refused_peers"] += 1
        who = peer.describe() if peer is not None else "unknown peer"
        logger.warning("refusing a connection from %s: not %s", who, peers.domain(self.config.allowed_gid))
        self._reply_and_close(sock, P.Error(int(ErrorCode.INVALID_PARAMS), (
            f"permission denied: this kvpool server serves {peers.domain(self.config.allowed_gid)}, "
            f"not {who}; start your own server, or ask its owner for --allowed-gid group sharing")))
        return False

    def _evict(self, conn: _Conn) -> None:
        """Tell a connection still without a handshake why it goes, and wake its thread to close it."""
        msg = P.Error(int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS),
                      f"closed before its Hello: {self.config.max_handshakes} connections were waiting "
                      f"to say Hello (--max-handshakes); connect and say Hello at once")
        try:  # from the accept thread: never block on a peer that does not read
            conn.sock.send(P.encode_frame(msg), socket.MSG_DONTWAIT)
        except OSError:
            pass
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _shutdown(self) -> None:
        logger.info("shutting down: closing %d connection(s), flushing the offload queue", len(self._conns))
        if self._listener is not None:
            self._listener.close()
        with self._state:
            conns = list(self._conns.values())
            threads = list(self._threads)
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._cleanup()
        logger.info("kvpool server stopped")

    def _cleanup(self) -> None:
        """Release everything start() took; each step tolerates a partial start."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._pids is not None:
            self._pids.close()
            self._pids = None
        if self.engine is not None:
            self.engine.close()  # flushes the disk write-through queue
        if self.arena is not None:
            shm.unlink(self.arena.name)
        if self._listener is not None:
            self._listener.close()
            try:
                if stat.S_ISSOCK(os.lstat(self.config.socket_path).st_mode):
                    os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            # Unlink before unlocking: a server starting meanwhile then retries on a fresh file.
            try:
                os.unlink(self.config.socket_path + ".lock")
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- one connection ---------------------------------------------------------------------

    def _serve_conn(self, conn: _Conn) -> None:
        reason = "closed by client"
        try:
            reason = self._conn_loop(conn)
        except (TimeoutError, socket.timeout) as exc:
            if conn.client_id and str(exc).startswith(P.FRAME_DEADLINE):
                reason = f"request frame not whole within --request-timeout={self.config.request_timeout_s}s"
                with self._state:
                    self._counters["request_timeouts"] += 1
                self._reply_and_close(conn.sock, P.Error(int(ErrorCode.RPC_TIMEOUT), f"{reason}: {exc}"))
            elif conn.client_id:
                reason = "timed out"
            else:
                reason = f"no Hello within {self.config.hello_timeout_s}s"
                with self._state:
                    self._counters["handshake_timeouts"] += 1
                self._reply_and_close(conn.sock, P.Error(
                    int(ErrorCode.RPC_TIMEOUT), f"no complete Hello within --hello-timeout="
                    f"{self.config.hello_timeout_s}s of connecting"))
        except P.FrameError as exc:
            if isinstance(exc, P.FrameBudgetSpent):
                with self._state:
                    self._counters["frame_budget_refusals"] += 1
            else:
                self._protocol_error()
            reason = f"bad frame: {exc}"
            self._reply_and_close(conn.sock, P.Error(int(ErrorCode.INVALID_PARAMS), str(exc)))
        except OSError as exc:
            reason = f"socket error: {exc}"
        except Exception:  # a bug must not take the server down with it
            logger.exception("connection %d (%s): internal error", conn.seq, conn.name or "no handshake")
            reason = "internal error"
        finally:
            self._close_conn(conn, reason)

    def _conn_loop(self, conn: _Conn) -> str:
        sock = conn.sock
        # One deadline for the whole handshake, from accept: bytes trickling in do not extend it.
        hello_deadline = conn.accepted_at + self.config.hello_timeout_s
        while not self._stopping.is_set():
            if conn.client_id:
                body = P.recv_frame(sock, P.MAX_REQUEST_FRAME, frame_timeout_s=self.config.request_timeout_s,
                                    budget=self._frame_budget)
            else:
                body = P.recv_frame(sock, P.MAX_HELLO_FRAME, deadline=hello_deadline)
            if body is None:
                return "evicted before its Hello" if conn.evicted else "closed by client"
            try:
                request = P.request_decoder.decode(body)
            except msgspec.DecodeError as exc:
                # The frame boundary is intact, so the connection can go on after saying why.
                self._protocol_error()
                P.send_frame(sock, P.Error(int(ErrorCode.INVALID_PARAMS), f"malformed request: {exc}"))
                if not conn.client_id:
                    return f"malformed handshake: {exc}"
                continue
            conn.requests += 1
            if not conn.client_id:
                if not isinstance(request, P.Hello):
                    self._protocol_error()
                    P.send_frame(sock, P.Error(int(ErrorCode.INVALID_PARAMS), "expected Hello first"))
                    return "no handshake"
                reply = self._hello(conn, request)
                P.send_frame(sock, reply)
                if not conn.client_id:
                    return f"handshake refused: {reply.message}" if isinstance(reply, P.Error) \
                        else "handshake refused"
                sock.settimeout(self.config.idle_timeout_s)
                continue
            started = time.perf_counter()
            P.send_frame(sock, self._dispatch(conn, request))
            self.prom.request_seconds[_OPS[type(request)]].observe(time.perf_counter() - started)
        return "server shutting down"

    def _hello(self, conn: _Conn, hello: P.Hello) -> P.Message:
        assert self.engine is not None and self.arena is not None
        if hello.version not in P.SUPPORTED_VERSIONS:
            return P.Error(int(ErrorCode.INVALID_PARAMS),
                           f"protocol version {hello.version} unsupported; server speaks "
                           f"{', '.join(map(str, sorted(P.SUPPORTED_VERSIONS)))}: upgrade the older of the two")
        cfg = self.config
        owner = _owner(conn.peer_pid, conn.peer_uid, hello)
        per_owner = cfg.max_connections_per_uid if owner.startswith("uid:") else cfg.max_connections_per_client
        with self._state:
            if conn.evicted:
                return P.Error(int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS), "closed before its Hello")
            refusal = ""
            if self._handshaken >= cfg.max_connections:
                refusal = (f"server at --max-connections={cfg.max_connections} connected clients; "
                           f"retry later or raise it")
            elif self._per_owner.get(owner, 0) >= per_owner:
                flag = flag_name("max_connections_per_uid" if owner.startswith("uid:") else "max_connections_per_client")
                refusal = f"{owner} already has {flag}={per_owner} connections; close some or raise it"
            self._strangers.pop(conn.seq, None)
            if refusal:
                self._counters["refused_connections"] += 1
            else:
                conn.name = hello.client_name or "client"
                conn.client_id = f"{conn.name}:{conn.peer_pid or hello.pid}:{conn.seq}"
                conn.owner = owner
                self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
                self._handshaken += 1
            connected = self._handshaken
        if refusal:
            logger.warning("refusing a client (%s): %s", owner, refusal)
            return P.Error(int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS), refusal)
        # Quotas are per owner, not per connection: opening more connections buys none, and
        # neither does opening them in processes that then exit (their connections end with them).
        assert self._pids is not None
        if owner.startswith("pid:") and conn.peer_pid > 0 and not self._pids.watch(conn.peer_pid):
            if self._pids.available:  # gone already: the connection is someone else's by now
                with self._state:
                    self._handshaken -= 1
                    self._drop_owner_conn_locked(owner)
                    conn.client_id = ""
                return P.Error(int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS),
                               f"the process that opened this connection ({conn.peer_pid}) has exited; "
                               "a connection serves only the process that opened it: connect from this one")
        self.engine.bind_client(conn.client_id, owner)
        self.engine.ping(conn.client_id)
        logger.info("client connected: %s (%s, %d connected)", conn.client_id, owner, connected)
        return P.HelloReply(conn.client_id, self.arena.name, cfg.memory_size, cfg.default_kv_lease_ttl_ms,
                            cfg.client_ttl_s, os.getpid())

    def _drop_owner_conn_locked(self, owner: str) -> None:
        left = self._per_owner.get(owner, 1) - 1
        if left > 0:
            self._per_owner[owner] = left
        else:
            self._per_owner.pop(owner, None)

    def _opener_exited(self, pid: int) -> None:
        """`PidWatch`: process ``pid`` exited; close the connections it opened, whoever holds them."""
        with self._state:
            conns = [c for c in self._conns.values() if c.peer_pid == pid and c.owner.startswith("pid:")]
            self._counters["orphaned_connections"] += len(conns)
        for conn in conns:
            logger.info("connection %s outlived the process that opened it (%d): closing it", conn.client_id, pid)
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and closes it
            except OSError:
                pass

    def _close_conn(self, conn: _Conn, reason: str) -> None:
        with self._state:
            self._conns.pop(conn.seq, None)
            self._strangers.pop(conn.seq, None)
            self._threads.discard(threading.current_thread())
            if conn.client_id:
                self._handshaken -= 1
                self._drop_owner_conn_locked(conn.owner)
            left = self._handshaken
        try:
            conn.sock.close()
        except OSError:
            pass
        if not conn.client_id:
            logger.info("connection %d (pid %d) closed before its handshake: %s", conn.seq, conn.peer_pid, reason)
            return
        assert self.engine is not None
        dropped = self.engine.forget_client(conn.client_id)
        logger.info("client disconnected: %s (%s; dropped %d lease(s), %d unfinished put(s); %d connected)",
                    conn.client_id, reason, dropped.leases, dropped.allocations, left)

    def _reply_and_close(self, sock: socket.socket, message: P.Message) -> None:
        try:
            sock.settimeout(0.5)
            P.send_frame(sock, message)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass

    def _protocol_error(self) -> None:
        with self._state:
            self._counters["protocol_errors"] += 1

    # ---- requests -----------------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, req: P.Message) -> P.Message:
        engine = self.engine
        assert engine is not None
        cid = conn.client_id
        if isinstance(req, P.Exists):
            found = engine.exists(req.keys, cid, req.lease)
            with self._state:
                self._counters["lookup_keys"] += len(found)
                self._counters["lookup_hits"] += sum(found)
            return P.Found(found)
        if isinstance(req, P.Lookup):
            return self._lookup(conn, req.keys)
        if isinstance(req, P.Allocate):
            if len(req.sizes) != len(req.keys):
                return P.Error(int(ErrorCode.INVALID_PARAMS), "keys and sizes differ in length")
            codes, handles, offsets = [], [], []
            for result in engine.batch_allocate(cid, req.keys, req.sizes):  # one engine lock per batch
                if isinstance(result, Allocation):
                    conn.pending[result.handle] = result
                    codes.append(0)
                    handles.append(result.handle)
                    offsets.append(result.offset)
                else:
                    codes.append(int(result))
                    handles.append(0)
                    offsets.append(0)
            self._note_refusals(conn, codes)
            if len(conn.pending) > max(conn.prune_at, PENDING_PRUNE_AT):
                # The engine reclaims what a client leaves uncommitted (put_timeout_s) without
                # telling this map: a client that never commits would grow it without bound.
                live = engine.pending_handles(cid)
                conn.pending = {h: a for h, a in conn.pending.items() if h in live}
                conn.prune_at = 2 * len(conn.pending)  # amortised: a prune per as many allocations
            return P.Allocated(codes, handles, offsets)
        if isinstance(req, (P.Commit, P.Abort)):
            sums = req.checksums if isinstance(req, P.Commit) else []
            if sums and len(sums) != len(req.handles):
                return P.Error(int(ErrorCode.INVALID_PARAMS),
                               f"{len(sums)} checksums for {len(req.handles)} handles: one per handle, or none")
            # Only this connection's own allocations: a handle is not a capability to publish
            # someone else's half-written range.
            mine = [i for i, handle in enumerate(req.handles) if conn.pending.pop(handle, None) is not None]
            handles = [req.handles[i] for i in mine]
            done = (engine.batch_commit(handles, [sums[i] for i in mine] if sums else None)
                    if isinstance(req, P.Commit) else engine.batch_abort(handles))
            codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(req.handles)
            for i, rc in zip(mine, done):
                codes[i] = int(rc)
            return P.Codes(codes)
        if isinstance(req, P.Acquire):
            return self._acquire(conn, req.keys)
        if isinstance(req, P.Release):
            return self._release(conn, req)
        if isinstance(req, P.Ping):
            return P.Codes([int(engine.ping(cid))])
        if isinstance(req, P.Remove):
            return P.Codes([int(engine.remove(k)) for k in req.keys])
        if isinstance(req, P.Pin):
            return P.Codes([int(c) for c in engine.controls.pin(req.keys, req.ttl_s)])
        if isinstance(req, P.TakeDrops):
            assert self.drops is not None  # made with the engine
            if conn.drop_cursor is None:
                conn.drop_cursor = self.drops.start()
                return P.Dropped([])
            keys, conn.drop_cursor, missed = self.drops.take(conn.drop_cursor)
            return P.Dropped(keys, missed)
        if isinstance(req, P.GetStats):
            return P.StatsReply(self.stats(), self.client_list())
        if isinstance(req, P.Hello):
            return P.Error(int(ErrorCode.INVALID_PARAMS), "already said Hello")
        return P.Error(int(ErrorCode.INVALID_PARAMS), f"unsupported request {type(req).__name__}")

    def _hold(self, conn: _Conn, lease: Lease) -> None:
        """File a read lease under the connection, the only one that may release it."""
        assert self.engine is not None
        if len(conn.leases) >= _MAX_LEASES_PER_CONN:
            oldest = next(iter(conn.leases))
            self.engine.release(conn.leases.pop(oldest))
        conn.leases[lease.lease_id] = lease

    def _release(self, conn: _Conn, req: P.Release) -> P.Codes:
        """This connection's acquired leases end; its lookup leases are only checked (they
        protect their hits until their TTL). Each code says whether the lease held during the
        copy: it is decided before the corruption reports are acted on (a report may drop the
        object)."""
        engine = self.engine
        assert engine is not None
        codes = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(req.lease_ids)
        reported = set(req.corrupt)
        acquired = [(i, conn.leases.pop(lease_id)) for i, lease_id in enumerate(req.lease_ids)
                    if lease_id in conn.leases]
        for (i, _), rc in zip(acquired, engine.batch_release([lease for _, lease in acquired])):
            codes[i] = int(rc)
        for _, lease in acquired:
            if lease.lease_id in reported:
                engine.check_reported(lease)
        taken = {i for i, _ in acquired}
        looked_up = [(i, lease_id) for i, lease_id in enumerate(req.lease_ids) if i not in taken]
        if looked_up:
            checked = engine.check_lookup_leases(conn.client_id, [lease_id for _, lease_id in looked_up], reported)
            for (i, _), rc in zip(looked_up, checked):
                codes[i] = int(rc)
        return P.Codes(codes)

    def _lookup(self, conn: _Conn, keys: Sequence[str]) -> P.Looked:
        engine = self.engine
        assert engine is not None
        # Per key (found, lease id, offset, size, checksum): a LookupLease is the last four.
        rows = [(True, *r) if isinstance(r, LookupLease) else (r, 0, 0, 0, None)
                for r in engine.lookup_leases(keys, conn.client_id)]
        found, lease_ids, offsets, sizes, sums = (list(col) for col in zip(*rows)) if rows else ([],) * 5
        with self._state:
            self._counters["lookup_keys"] += len(found)
            self._counters["lookup_hits"] += sum(found)
        return P.Looked(found, lease_ids, offsets, sizes, sums)

    def _acquire(self, conn: _Conn, keys: Sequence[str]) -> P.Acquired:
        engine = self.engine
        assert engine is not None
        rows: list[tuple[int, int, int, int, bytes | None, int | None]] = []  # one Acquired row per key
        inline = 0
        for result in engine.batch_acquire(conn.client_id, keys):  # one engine lock for the memory hits
            if isinstance(result, ErrorCode):
                rows.append((int(result), 0, 0, 0, None, None))
            elif result.data is not None:
                # Served from disk without room to promote: the bytes go inline, within a budget
                # so one reply stays bounded (the client sizes its batches to fit it). They never
                # sat in the shared arena, so they need no checksum.
                if inline + result.size > P.MAX_INLINE_BYTES:
                    rows.append((int(ErrorCode.BUFFER_OVERFLOW), 0, 0, result.size, None, None))
                else:
                    inline += result.size
                    rows.append((0, 0, -1, result.size, result.data, None))
            else:
                self._hold(conn, result)
                rows.append((0, result.lease_id, result.offset, result.size, None, result.checksum))
        codes, lease_ids, offsets, sizes, data, sums = (list(col) for col in zip(*rows)) if rows else ([],) * 6
        self._note_refusals(conn, codes)
        return P.Acquired(codes, lease_ids, offsets, sizes, data, sums)

    def _note_refusals(self, conn: _Conn, codes: list[int]) -> None:
        """Say once per connection why its leases or allocations are being refused by quota."""
        if conn.warned_quota or int(ErrorCode.NO_AVAILABLE_HANDLE) not in codes:
            return
        assert self.engine is not None
        held, holds = self.engine.holding(conn.owner)
        cfg = self.config
        share = int(cfg.client_pool_share * cfg.memory_size)
        if held + (1 << 20) < share and (not cfg.client_max_leases or holds < cfg.client_max_leases):
            return  # the pool itself is full, not this client's quota
        conn.warned_quota = True
        logger.warning(
            "client %s (%s) is at its quota: it holds %d bytes in %d leases/allocations "
            "(--client-pool-share=%s: %d bytes, --client-max-leases=%d); allocations past them are "
            "refused with NO_AVAILABLE_HANDLE until it commits or aborts, and leases past the share "
            "are granted without pinning",
            conn.client_id, conn.owner, held, holds, cfg.client_pool_share, share, cfg.client_max_leases)

    # ---- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters plus the server's own, for GetStats, /stats and /metrics."""
        assert self.engine is not None and self.arena is not None
        out: dict[str, Any] = dict(self.engine.stats())
        if self.controller is not None:
            out.update(self.controller.stats())
        with self._state:
            out.update(self._counters)
            out["connected_clients"] = self._handshaken
            out["pending_handshakes"] = len(self._strangers)
        out["partial_frame_bytes"] = self._frame_budget.used
        out.update(
            uptime_s=round(time.monotonic() - self._started, 3),
            server_pid=os.getpid(),
            socket=self.config.socket_path,
            arena=self.arena.name,
            offload_path=self.config.offload_path or "",
            lease_ttl_ms=self.config.default_kv_lease_ttl_ms,
            client_ttl_s=self.config.client_ttl_s,
        )
        return out

    def client_list(self) -> list[dict[str, Any]]:
        """Handshaken connections; ``held_bytes``/``holds`` are their process's quota usage."""
        assert self.engine is not None
        with self._state:
            conns = [c for c in self._conns.values() if c.client_id]
        out = []
        for c in conns:
            held, holds = self.engine.holding(c.owner)
            out.append({"client_id": c.client_id, "name": c.name, "pid": c.peer_pid, "owner": c.owner,
                        "connected_at": c.connected_at, "requests": c.requests,
                        "held_bytes": held, "holds": holds})
        return out


# ---- command line -----------------------------------------------------------------------------


# mooncake_master flags that mean nothing for a host-local server, with what to do instead.
_MASTER_ONLY = {
    "--port": "kvpool server serves this host over a Unix socket: use --socket PATH (a TCP port is "
              "mooncake_master's, for a pool across hosts: backend mooncake)",
    "--rpc_address": "kvpool server listens on a Unix socket only (--socket PATH), never on an address",
    "--rpc_port": "kvpool server listens on a Unix socket only (--socket PATH), never on a port",
    "--enable_http_metadata_server": "kvpool server needs no metadata server: its clients share one host",
}


class _MasterOnly(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        parser.error(f"{option_string}: {_MASTER_ONLY[option_string]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvpool server`'s flags: one per field of `ServerSettings`, in both spellings; the
    mooncake_master flags of the Ascend Store guide that mean nothing here are refused with what
    to use instead."""
    add_flags(parser, ServerSettings)
    for flag, why in _MASTER_ONLY.items():
        parser.add_argument(flag, nargs="?", action=_MasterOnly, metavar="VALUE",
                            help=f"refused (mooncake_master's): {why}")


def config_from_args(args: argparse.Namespace) -> ServerSettings:
    """Validate parsed flags; ConfigError names the flag, the value and what is expected."""
    if isinstance(args.socket, str):  # anything else is refused, by name, by the parser
        args.socket = os.path.abspath(args.socket)
    settings: ServerSettings = from_flags(args, ServerSettings)
    check_socket_dir(settings.socket_path, "--socket", settings.allowed_gid)
    if settings.enable_offload and not settings.offload_path:
        raise ConfigError("--enable-offload", True, "to be used with --offload-path DIR")
    for flag in ("offload_path", "offload_quota", "offload_eviction_policy"):
        if getattr(args, flag, None) is not None and not settings.enable_offload:
            raise ConfigError(flag_name(flag), getattr(args, flag), "to be used with --enable-offload")
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; the exit status for the shell."""
    logging.basicConfig(level=getattr(logging, args.log_level or "INFO"),
                        format="%(asctime)s %(levelname)s kvpool-server: %(message)s")
    try:
        server = Server(config_from_args(args))
    except ConfigError as exc:
        print(f"kvpool server: error: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: object) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        server.stop()

    # Before start(): a SIGTERM that arrives as soon as the "listening" line is out must still
    # take the clean path (serve_forever then returns at once and cleans up).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
    except ServerRunning as exc:
        print(f"kvpool server: error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, OSError) as exc:
        print(f"kvpool server: error: {exc}", file=sys.stderr)
        return 2
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool server", description="host-shared KV-cache pool daemon")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
