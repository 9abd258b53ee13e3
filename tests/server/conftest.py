"""Fixtures for the `kvpool server` tests: real server subprocesses and clients, cleaned up."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator

import pytest
from srvutil import ServerProc, arena_files, socket_dir

from kvpool.server import shm
from kvpool.server.client import PoolClient


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
def start_server(sock_path: str, sock_dir: str) -> Iterator[Callable[..., ServerProc]]:
    procs: list[ServerProc] = []

    def factory(*flags: str, expect_ready: bool = True, socket_path: str | None = None,
                entry: tuple[str, ...] = ("-m", "kvpool.server.daemon")) -> ServerProc:
        args = list(flags)
        if not any(a.startswith(("--memory", "--global")) for a in args):
            args += ["--memory-size", "16MB"]
        path = socket_path or sock_path
        proc = ServerProc(path, os.path.join(sock_dir, f"server{len(procs)}.log"), args, entry)
        procs.append(proc)
        return proc.start(expect_ready=expect_ready)

    yield factory
    for proc in procs:
        if proc.proc is not None and proc.alive():
            proc.kill()
    for proc in procs:  # arenas of SIGKILLed servers
        for name in arena_files(proc.socket_path):
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
