"""Fixtures for the `kvpool server` tests: real server subprocesses and clients, cleaned up."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator

import pytest
from srvutil import arena_files, socket_dir

from kvpool.server import shm
from kvpool.server.client import PoolClient
from kvpool.testing.launch import PoolServer


@pytest.fixture
def sock_dir(tmp_path) -> Iterator[str]:
    path = socket_dir(tmp_path)
    yield path
    if not path.startswith(os.path.realpath(tmp_path)):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sock_path(sock_dir: str) -> str:
    return os.path.join(sock_dir, "kvpool.sock")


@pytest.fixture
def start_server(sock_path: str, sock_dir: str) -> Iterator[Callable[..., PoolServer]]:
    """`start_server(*flags, expect_ready=True, socket_path=None, entry=..., env=None)`: a `kvpool
    server` with these flags (16MB unless they size it) and these variables added to the
    environment, its log in sock_dir; killed at teardown."""
    servers: list[PoolServer] = []

    def factory(*flags: str, expect_ready: bool = True, socket_path: str | None = None,
                entry: tuple[str, ...] = ("-m", "kvpool.server.daemon"),
                env: dict[str, str] | None = None) -> PoolServer:
        sized = any(a.startswith(("--memory", "--global")) for a in flags)
        server = PoolServer(socket_path or sock_path, memory_size=None if sized else "16MB", extra_args=flags,
                            log_path=os.path.join(sock_dir, f"server{len(servers)}.log"), entry=entry,
                            startup_timeout_s=15.0, env={**os.environ, **env} if env else None)
        servers.append(server)
        return server.start(wait=expect_ready)

    yield factory
    for server in servers:
        server.kill()
    for server in servers:  # arenas of SIGKILLed servers
        for name in arena_files(server.socket_path):
            shm.unlink(name)


@pytest.fixture
def make_client(sock_path: str) -> Iterator[Callable[..., PoolClient]]:
    clients: list[PoolClient] = []

    def factory(path: str | None = None, name: str = "test", **kwargs) -> PoolClient:
        client = PoolClient(path or sock_path, name, **kwargs)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.close()
