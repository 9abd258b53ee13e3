"""One conformance suite for every backend: the fixture `backend_factory` runs each test once per
backend of the registry that runs on this host (`BACKENDS`).

`backend_factory` is a `BackendFactory`: `make(capacity_bytes) -> Backend` builds a fresh, empty
pool of that capacity and returns a client of it. For backends whose pool is shared between
processes (`MULTIPROCESS_BACKENDS`), `make.client_config(backend)` gives the
`kv_connector_extra_config` another process passes to `load_config` + `create_backend` to reach
the same pool.

To add a backend: register it (kvpool.backends.registry), then a `BackendFactory` subclass here
that starts (and on `close` stops) what the backend needs, in `_FACTORIES`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.backends import Backend, create_backend
from kvpool.backends.registry import REGISTRY
from kvpool.config import load_config
from kvpool.testing.launch import PoolServer

# Every registered backend, but Memcache: its local service needs the Ascend driver and does not
# start on a host without one (docs/backends.md); its adapter has tests of its own.
NOT_RUNNABLE_HERE = {"memcache": "Memcache's local service needs the Ascend NPU driver"}
BACKENDS = [name for name in REGISTRY if name not in NOT_RUNNABLE_HERE]
# Backends whose pool several processes (each with its own client) share.
MULTIPROCESS_BACKENDS = [name for name in BACKENDS if REGISTRY[name].capabilities.shared_across_processes]

SERVER_MODULE = "kvpool.server.daemon"


class BackendFactory:
    """Builds pools of one backend; closes every client (then every service) at teardown.

    Capability flags: a store that genuinely cannot give one of the pool engine's guarantees
    says so here, and the tests check what it does give instead (see each test). Never turn one
    off to hide a bug.
    """

    name = "base"

    # The flags come from the backend's registry entry (kvpool.backends.registry.Capabilities).
    @property
    def leases_pin(self) -> bool:
        """A lease (`batch_exists(..., lease=True)`, a read) keeps an object from being evicted
        for the lease TTL, and a pool full of leased objects refuses puts with NO_AVAILABLE_HANDLE."""
        return REGISTRY[self.name].capabilities.leases

    @property
    def exact_lru(self) -> bool:
        """Eviction is exact LRU: the least recently used objects go first, strictly."""
        return REGISTRY[self.name].capabilities.exact_lru

    @property
    def refused_put_evicts(self) -> bool:
        """A put refused for room (NO_AVAILABLE_HANDLE), even of a value larger than the whole
        pool, may have evicted other objects first (Mooncake's master starts an eviction round on
        every refused put, and no client call tells the pool's total capacity, so the adapter
        cannot refuse a hopeless value up front). Otherwise what is stored stays in place."""
        return REGISTRY[self.name].capabilities.evicts_on_refused_put
    # The smallest pool the store can make (Mooncake: 16MB segments). Tests size their values
    # from `capacity(wanted)`, the capacity they really get.
    min_capacity = 0

    def capacity(self, wanted: int) -> int:
        return max(wanted, self.min_capacity)

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self._backends: list[Backend] = []
        self._count = 0

    def __call__(self, capacity_bytes: int) -> Backend:
        raise NotImplementedError

    def client_config(self, backend: Backend) -> dict[str, Any]:
        """Extra config another process uses to open its own client of `backend`'s pool."""
        raise NotImplementedError(f"backend {self.name!r} is not shared across processes")

    def connect(self, backend: Backend) -> Backend:
        """A second client of the same pool in this process."""
        return self._track(create_backend(load_config(self.client_config(backend)), self._client_name()))

    def _client_name(self) -> str:
        self._count += 1
        return f"conformance-{self.name}-{os.getpid()}-{self._count}"

    def _track(self, backend: Backend) -> Backend:
        self._backends.append(backend)
        return backend

    def copy_raw(self, backend: Backend, src: str, dst: str) -> None:
        """Copy the object `backend` stored for key `src` to key `dst` with the store's own client
        calls, as any other client of the store can: no kvpool code decides what is written.
        Only stores whose clients can write any key implement it (`FOREIGN_WRITABLE`)."""
        raise NotImplementedError

    def write_raw(self, backend: Backend, key: str, data: bytes) -> None:
        """Store `data` under the name `backend` reads key `key` from, with the store's own client."""
        raise NotImplementedError

    def close(self) -> None:
        errors = []
        for backend in reversed(self._backends):
            try:
                backend.close()
            except Exception as exc:  # close the rest, report after
                errors.append(f"{type(backend).__name__}.close(): {exc!r}")
        self._backends.clear()
        if errors:
            raise AssertionError("; ".join(errors))


class LocalFactory(BackendFactory):
    name = "local"

    def __call__(self, capacity_bytes: int) -> Backend:
        cfg = load_config({"backend": "local", "local_cpu_size": capacity_bytes})
        return self._track(create_backend(cfg, self._client_name()))


class ServerFactory(BackendFactory):
    """Starts a real `kvpool server` daemon per pool; stops it with SIGTERM and expects a clean exit."""

    name = "server"

    def __init__(self, workdir: str) -> None:
        if importlib.util.find_spec(SERVER_MODULE) is None:
            # Not a skip: a conformance suite that silently loses a backend proves nothing.
            pytest.fail(
                f"backend 'server' is listed in tests/conformance/conftest.py BACKENDS but "
                f"{SERVER_MODULE} does not exist yet; land the server or remove it from BACKENDS",
                pytrace=False,
            )
        super().__init__(workdir)
        self._servers: list[PoolServer] = []
        self._sockets: dict[int, str] = {}

    def __call__(self, capacity_bytes: int) -> Backend:
        n = len(self._servers)
        # AF_UNIX paths are limited to ~107 bytes, so not under pytest's (long) tmp_path.
        sock = os.path.join(self.workdir, f"s{n}.sock")
        server = PoolServer(sock, memory_size=capacity_bytes, entry=("-m", SERVER_MODULE),
                            log_path=os.path.join(self.workdir, f"server{n}.log"), startup_timeout_s=15.0)
        self._servers.append(server)
        server.start()  # ServerError (a RuntimeError) with the log's tail if it does not come up
        backend = create_backend(load_config(self._config(sock)), self._client_name())
        self._sockets[id(backend)] = sock
        return self._track(backend)

    @staticmethod
    def _config(sock: str) -> dict[str, Any]:
        return {"backend": "server", "server_socket": sock}

    def client_config(self, backend: Backend) -> dict[str, Any]:
        return self._config(self._sockets[id(backend)])

    def connect(self, backend: Backend) -> Backend:
        other = super().connect(backend)
        self._sockets[id(other)] = self._sockets[id(backend)]
        return other

    def close(self) -> None:
        errors = []
        try:
            super().close()
        except AssertionError as exc:
            errors.append(str(exc))
        for server in self._servers:
            rc = server.stop(grace_s=10)
            if rc == -signal.SIGKILL:
                errors.append(f"kvpool server ignored SIGTERM for 10 s:\n{server.log_tail(3000)}")
            elif rc != 0:
                errors.append(f"kvpool server exited with {rc} on SIGTERM:\n{server.log_tail(3000)}")
        self._servers.clear()
        if errors:
            raise AssertionError("\n".join(errors))


class RedisFactory(BackendFactory):
    """A real `redis-server` per pool (tests/services.py): maxmemory = start-up footprint + capacity,
    `allkeys-lru`. Redis has no leases (a lease refreshes LRU recency only) and its LRU is sampled
    with a 1 s clock, so `leases_pin` and `exact_lru` do not hold."""

    name = "redis"

    def __init__(self, workdir: str) -> None:
        super().__init__(workdir)
        self._services: list = []
        self._urls: dict[int, str] = {}

    def __call__(self, capacity_bytes: int) -> Backend:
        from kvpool.testing.services import RedisService, ServiceError

        try:
            svc = RedisService(os.path.join(self.workdir, f"redis{len(self._services)}"), capacity=capacity_bytes)
        except ServiceError as exc:
            pytest.fail(str(exc), pytrace=False)
        self._services.append(svc)
        backend = create_backend(load_config({"backend": "redis", "redis_url": svc.url}), self._client_name())
        self._urls[id(backend)] = svc.url
        return self._track(backend)

    def client_config(self, backend: Backend) -> dict[str, Any]:
        return {"backend": "redis", "redis_url": self._urls[id(backend)]}

    def _raw(self, backend: Backend) -> Any:
        import redis

        return redis.Redis.from_url(self._urls[id(backend)])

    def copy_raw(self, backend: Backend, src: str, dst: str) -> None:
        r = self._raw(backend)  # values under 1 MiB: one Redis key each
        assert r.set(dst, r.get(src))

    def write_raw(self, backend: Backend, key: str, data: bytes) -> None:
        assert self._raw(backend).set(key, data)

    def connect(self, backend: Backend) -> Backend:
        other = super().connect(backend)
        self._urls[id(other)] = self._urls[id(backend)]
        return other

    def close(self) -> None:
        try:
            super().close()
        finally:
            for svc in self._services:
                svc.stop()
            self._services.clear()


class MooncakeFactory(BackendFactory):
    """A real `mooncake_master` per pool, started with the spec's flags (eviction 0.9/0.1, lease
    11 s) on 127.0.0.1. The first client mounts the pool's whole capacity as its segment; every
    further client (`connect`, worker processes) mounts none, so the capacity is exact and the
    objects outlive those clients (Mooncake drops a client's segment, and what it holds, when the
    client closes)."""

    name = "mooncake"
    min_capacity = 16 << 20

    def __init__(self, workdir: str) -> None:
        super().__init__(workdir)
        self._masters: list = []
        self._clients: dict[int, str] = {}

    def __call__(self, capacity_bytes: int) -> Backend:
        from kvpool.testing.services import MooncakeMaster, ServiceError

        n = len(self._masters)
        try:
            master = MooncakeMaster(os.path.join(self.workdir, f"master{n}"))
        except ServiceError as exc:
            pytest.fail(str(exc), pytrace=False)
        self._masters.append(master)
        holder = master.write_config(os.path.join(self.workdir, f"holder{n}.json"), self.capacity(capacity_bytes))
        client = master.write_config(os.path.join(self.workdir, f"client{n}.json"), 0)
        backend = create_backend(load_config({"backend": "mooncake", "mooncake_config_path": holder}),
                                 self._client_name())
        self._clients[id(backend)] = client
        return self._track(backend)

    def client_config(self, backend: Backend) -> dict[str, Any]:
        return {"backend": "mooncake", "mooncake_config_path": self._clients[id(backend)]}

    def copy_raw(self, backend: Backend, src: str, dst: str) -> None:
        self.write_raw(backend, dst, backend.store.get(backend._stored_names([src])[0]))

    def write_raw(self, backend: Backend, key: str, data: bytes) -> None:
        assert data and backend.store.upsert(backend._stored_names([key])[0], data) == 0  # replaces any object

    def connect(self, backend: Backend) -> Backend:
        other = super().connect(backend)
        self._clients[id(other)] = self._clients[id(backend)]
        return other

    def close(self) -> None:
        # Mooncake's close() takes 1-2 s (it joins its ping thread) and the master ~1 s to exit:
        # both run on a thread; the session waits for them at its end and fails on any error
        # (`_deferred_teardown`). Only the master's exit overlaps the next test: the client's
        # close holds the GIL throughout (measured: every Python thread stalls for its 2 s).
        backends, masters = list(self._backends), list(self._masters)
        self._backends.clear()
        self._masters.clear()

        def teardown() -> None:
            try:
                _close_in_parallel(backends)
            finally:
                for master in masters:
                    master.stop()

        _defer(teardown)


class YuanrongFactory(BackendFactory):
    """One real datasystem worker for the session (`dscli start`/`stop` take ~6 s each, see
    tests/services.py), 128MB of shared memory, own metastore; each pool is a `key_prefix` of its
    own. The worker's memory is the capacity of every pool (`min_capacity`); objects of earlier
    pools are evictable and make room. The datasystem has no leases and its eviction is not
    strict LRU (`leases_pin`, `exact_lru` off), and a refused put makes it evict everything
    evictable first (`refused_put_evicts`)."""

    name = "yuanrong"
    SHM_MB = 128
    min_capacity = SHM_MB << 20
    _pools = 0

    def __init__(self, workdir: str) -> None:
        super().__init__(workdir)
        self._configs: dict[int, str] = {}

    def __call__(self, capacity_bytes: int) -> Backend:
        from kvpool.testing.services import ServiceError, shared_yuanrong_worker

        try:
            worker = shared_yuanrong_worker(self.SHM_MB)
        except ServiceError as exc:
            pytest.fail(str(exc), pytrace=False)
        YuanrongFactory._pools += 1
        path = os.path.join(self.workdir, f"yr{YuanrongFactory._pools}.json")
        with open(path, "w") as f:
            json.dump({"worker_addr": worker.address, "key_prefix": f"p{os.getpid()}x{YuanrongFactory._pools}:",
                       "connect_timeout_ms": 5000, "request_timeout_ms": 200}, f)
        backend = create_backend(load_config({"backend": "yuanrong", "yuanrong_config_path": path}),
                                 self._client_name())
        self._configs[id(backend)] = path
        return self._track(backend)

    def client_config(self, backend: Backend) -> dict[str, Any]:
        return {"backend": "yuanrong", "yuanrong_config_path": self._configs[id(backend)]}

    @staticmethod
    def _name(backend: Backend, key: str) -> str:
        return backend._name(backend._stored_names([key])[0])

    def copy_raw(self, backend: Backend, src: str, dst: str) -> None:
        data = backend._sdk().get([self._name(backend, src)])[0]
        self.write_raw(backend, dst, bytes(memoryview(data)))

    def write_raw(self, backend: Backend, key: str, data: bytes) -> None:
        client, name = backend._sdk(), self._name(backend, key)
        client.delete([name])  # an object's write mode cannot change: any client may delete it first
        client.set(name, data)

    def connect(self, backend: Backend) -> Backend:
        other = super().connect(backend)
        self._configs[id(other)] = self._configs[id(backend)]
        return other


_DEFERRED: list[tuple[threading.Thread, list[BaseException]]] = []


def _defer(fn) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by _deferred_teardown
            errors.append(exc)

    t = threading.Thread(target=run, name="conformance-teardown", daemon=True)
    t.start()
    _DEFERRED.append((t, errors))


@pytest.fixture(scope="session", autouse=True)
def _deferred_teardown():
    yield
    failures = []
    for t, errors in _DEFERRED:
        t.join(60)
        if t.is_alive():
            failures.append("a deferred teardown did not finish within 60 s")
        failures.extend(repr(e) for e in errors)
    _DEFERRED.clear()
    if failures:
        pytest.fail("deferred teardown failed: " + "; ".join(failures), pytrace=False)


def _close_in_parallel(backends: list[Backend]) -> None:
    import concurrent.futures

    if not backends:
        return
    with concurrent.futures.ThreadPoolExecutor(len(backends)) as pool:
        errors = [f.exception() for f in [pool.submit(b.close) for b in backends]]
    errors = [repr(e) for e in errors if e is not None]
    if errors:
        raise AssertionError("; ".join(errors))


_FACTORIES: dict[str, type[BackendFactory]] = {
    "local": LocalFactory, "server": ServerFactory, "redis": RedisFactory, "mooncake": MooncakeFactory,
    "yuanrong": YuanrongFactory,
}
# A backend registered without a factory here would silently drop out of the suite.
assert set(_FACTORIES) == set(BACKENDS), f"conformance factories missing for {set(BACKENDS) - set(_FACTORIES)}"
# Stores whose own clients can write any key: what kvpool reads from them must still be its own.
FOREIGN_WRITABLE = [n for n in BACKENDS if _FACTORIES[n].copy_raw is not BackendFactory.copy_raw]


def _factory(name: str) -> Iterator[BackendFactory]:
    workdir = tempfile.mkdtemp(prefix="kvpc-")
    try:
        factory = _FACTORIES[name](workdir)
        try:
            yield factory
        finally:
            factory.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _params(names: list[str]) -> list:
    """One fixture param per backend; those that start a store's own service are marked `services`."""
    return [pytest.param(n, marks=[] if n in ("local", "server") else [pytest.mark.services]) for n in names]


@pytest.fixture(params=_params(BACKENDS))
def backend_factory(request) -> Iterator[BackendFactory]:
    """`make(capacity_bytes) -> Backend` for each backend in BACKENDS."""
    yield from _factory(request.param)


@pytest.fixture(params=_params(FOREIGN_WRITABLE))
def writable_backend_factory(request) -> Iterator[BackendFactory]:
    """As `backend_factory`, for the stores any of whose clients can write any key (`copy_raw`)."""
    yield from _factory(request.param)


@pytest.fixture(params=_params(MULTIPROCESS_BACKENDS))
def shared_backend_factory(request) -> Iterator[BackendFactory]:
    """As `backend_factory`, for the backends several processes share (`client_config` works)."""
    yield from _factory(request.param)
