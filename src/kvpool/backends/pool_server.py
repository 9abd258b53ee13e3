"""`backend: server` — the host-shared pool of `kvpool server`, reached over its Unix socket.

Every worker process of every vLLM instance on the host connects to the same server and maps
its shared-memory arena, so what one instance stored, all of them load (and TP/PP ranks of
one instance share it too). A missing or dead server is not fatal: calls report misses and
failure codes (vLLM recomputes) until a server is back on the socket.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.backends.base import Backend, Buffers
from kvpool.errors import KVPoolError
from kvpool.server.client import PoolClient


class ServerBackend(Backend):
    """A `PoolClient` behind the Backend protocol."""

    name = "server"
    shared_across_processes = True

    def __init__(self, socket_path: str, client_name: str, **client_kwargs: object) -> None:
        # Without a server this still succeeds (the client logs one warning): vLLM then runs
        # without pool hits instead of not at all, and connects once a server is on the socket.
        self.client = PoolClient(socket_path, client_name, **client_kwargs)  # type: ignore[arg-type]

    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        return self.client.exists(keys, lease)

    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        return self.client.put(keys, values)

    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        return self.client.get_into(keys, values)

    def stats(self) -> dict[str, float]:
        """The server's numeric counters (empty while it is unreachable)."""
        try:
            stats, _ = self.client.server_stats()
        except KVPoolError:
            return {}
        return {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def close(self) -> None:
        self.client.close()
