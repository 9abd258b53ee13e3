"""`backend: server` — the host-shared pool of `kvpool server`, reached over its Unix socket.

Every worker process of every vLLM instance on the host connects to the same server and maps
its shared-memory arena, so what one instance stored, all of them load (and TP/PP ranks of
one instance share it too). A missing or dead server is not fatal: calls report misses and
failure codes (vLLM recomputes) until a server is back on the socket.
"""

from __future__ import annotations

import argparse
import logging
import socket
import time

import numpy as np

from kvpool.backends.base import Backend
from kvpool.backends.diagnosis import Report, human
from kvpool.config import KVPoolConfig, ServerClientSettings
from kvpool.errors import ConfigError, KVPoolError
from kvpool.paths import check_socket_dir
from kvpool.server import peers, shm
from kvpool.server.client import PoolClient

logger = logging.getLogger(__name__)

DROPS_EVERY_S = 0.1  # how often take_removed asks the server for the pool's drops


class ServerBackend(Backend):
    """A `PoolClient` behind the Backend protocol."""

    name = "server"
    can_pin = True

    def __init__(self, socket_path: str, client_name: str, **client_kwargs: object) -> None:
        # Without a server this still succeeds (the client logs one warning): vLLM then runs
        # without pool hits instead of not at all, and connects once a server is on the socket.
        self.client = PoolClient(socket_path, client_name, **client_kwargs)  # type: ignore[arg-type]
        self._drops_asked = -DROPS_EVERY_S
        self._warned_missed = False

    @classmethod
    def from_settings(cls, settings: ServerClientSettings, client_name: str) -> "ServerBackend":
        return cls(settings.server_socket, client_name, allowed_gid=settings.allowed_gid)

    # The client reconnects by itself (its pinger, and calls at most every retry_interval_s),
    # so the base class's reconnect state stays up and the client answers misses meanwhile.

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return self.client.exists(keys, lease)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        # Two round trips: Allocate (whose per-key answer includes "already exists") and Commit.
        return self.client.put(keys, values, self._buffers)

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return self.client.get_into(keys, values, self._copies, self._buffers)

    def _pin(self, keys: list[str], ttl_s: float) -> list[int]:
        return self.client.pin(keys, ttl_s)

    def take_removed(self) -> list[str]:
        # At most one round trip per DROPS_EVERY_S (the worker asks every step): the server keeps
        # each client's place in its feed, so nothing is lost in between.
        now = time.monotonic()
        if now - self._drops_asked < DROPS_EVERY_S:
            return []
        self._drops_asked = now
        got = self.client.take_drops()
        if got is None:
            return []
        keys, missed = got
        if missed and not self._warned_missed:
            self._warned_missed = True
            logger.warning("kvpool server at %s: some of the pool's drops were lost before this instance asked "
                           "for them; its KV events may announce blocks the pool no longer holds",
                           self.client.socket_path)
        return keys

    def _store_stats(self) -> dict[str, float]:
        """The server's numeric counters (none while it is unreachable)."""
        try:
            stats, _ = self.client.server_stats()
        except KVPoolError:
            return {}
        return {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def _close(self) -> None:
        self.client.close()


# ---- `kvpool doctor` ---------------------------------------------------------------------------


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: server`: the socket is trusted and answers; dead servers' arenas."""
    assert isinstance(cfg.backend_settings, ServerClientSettings)
    path = cfg.backend_settings.server_socket
    allowed_gid = cfg.backend_settings.allowed_gid
    try:
        check_socket_dir(path, "server_socket", allowed_gid)
    except ConfigError as exc:
        report.error(f"the workers would not trust {path}: {exc.expected}", "see docs/security.md")
        return
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(args.timeout)
            s.connect(path)
            server = peers.peer_of(s)
            trusted = peers.trusted(s, server, allowed_gid)
        if trusted:
            report.ok(f"kvpool server answers on {path}")
        else:
            report.error(f"the process on {path} ({server.describe()}) is not {peers.domain(allowed_gid)}: the "
                         "workers will refuse it", "run kvpool server as this user, or set allowed_gid on both "
                         "(docs/security.md)")
    except OSError as exc:
        report.error(f"no kvpool server answers on {path} ({exc.strerror or exc})",
                     f"start it first: kvpool server --socket {path} --memory-size 8GB (see docs/server.md)")
    check_leftover_arenas(report)


def check_leftover_arenas(report: Report) -> None:
    """Arenas of this user's dead servers still in /dev/shm (`shm.leftovers`)."""
    dead = shm.leftovers()
    if dead:
        names = ", ".join(f"{d.name} ({human(d.resident)})" for d in dead)
        report.warn(f"{len(dead)} arena(s) of dead kvpool servers hold {human(sum(d.resident for d in dead))} of "
                    f"memory in {shm.SHM_DIR}: {names}",
                    f"the next kvpool server to start removes them; or remove them now: rm {shm.SHM_DIR}/NAME")
