"""Launchers for the real services the distributed backends talk to, for tests and benchmarks.

Every service binds 127.0.0.1 on free ports, logs into a work directory and is stopped by
`stop()` (also at interpreter exit, should a test forget). A missing binary or package raises
`ServiceError` with the install command: the tests turn that into a failure, never a skip.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool.testing.proc import HOST, exited, free_port, free_ports, port_open, sigkill, sigstop, tail  # noqa: F401  (re-exported for tests)
_LIVE: list["Service"] = []


class ServiceError(RuntimeError):
    """A service a test or benchmark needs could not be found, started or reached; the message says how to fix it."""


def which(binary: str, install: str) -> str:
    """The path of `binary` (the virtualenv's bin first), or ServiceError saying how to install it."""
    here = Path(sys.executable).parent / binary
    if here.exists():
        return str(here)
    found = shutil.which(binary)
    if not found:
        raise ServiceError(f"{binary} not found on PATH; install it: {install}")
    return found


class Service:
    """One subprocess with a log file; `stop()` sends SIGTERM, then SIGKILL after a grace period."""

    name = "service"

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.log = self.workdir / f"{self.name}.log"

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd or self.workdir, start_new_session=True,
        )
        _LIVE.append(self)

    def _wait_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not port_open(port):
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.proc.returncode}: {self.argv}\n{tail(self.log)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"{self.name} did not listen on {HOST}:{port} within {timeout} s\n{tail(self.log)}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if self in _LIVE:
            _LIVE.remove(self)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stop()

    def pause(self) -> None:
        """SIGSTOP, as a hung store: alive, holding its sockets, answering nothing."""
        if self.proc is not None and self.proc.poll() is None:
            sigstop(self.proc.pid)

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        try:
            s.stop(grace=2.0)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


# ---- Redis ---------------------------------------------------------------------------------------


class RedisService(Service):
    """`redis-server` (Debian package redis-server) on a free loopback port, no persistence.

    `capacity` (bytes) sets `maxmemory` to Redis' start-up footprint plus `capacity`, with
    `allkeys-lru` eviction, so a pool of `capacity` bytes of values behaves like one.
    """

    name = "redis"

    def __init__(self, workdir: str | Path, capacity: int | None = None, policy: str = "allkeys-lru",
                 port: int | None = None) -> None:
        super().__init__(workdir)
        binary = which("redis-server", "apt-get install -y redis-server")
        self.port = port or free_port()
        self._spawn([
            binary, "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--protected-mode", "yes", "--maxmemory-policy", policy,
            "--maxmemory-samples", "10", "--daemonize", "no", "--loglevel", "warning",
        ])
        self._wait_port(self.port, 10)
        if capacity is not None:
            import redis

            r = redis.Redis(host=HOST, port=self.port)
            try:
                startup = int(r.info("memory")["used_memory_startup"])
                r.config_set("maxmemory", startup + capacity)
            finally:
                r.close()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"


# ---- Mooncake ------------------------------------------------------------------------------------


def mooncake_master_binary() -> str:
    """`mooncake_master`, shipped by the mooncake-transfer-engine(-non-cuda) wheel."""
    try:
        import mooncake
    except ImportError as exc:
        raise ServiceError(f"mooncake is not installed: pip install mooncake-transfer-engine-non-cuda ({exc})") from None
    pkg = Path(mooncake.__file__).parent / "mooncake_master"
    if pkg.exists():
        return str(pkg)
    return which("mooncake_master", "pip install mooncake-transfer-engine-non-cuda")


class MooncakeMaster(Service):
    """`mooncake_master` with the spec's eviction and lease flags, bound to 127.0.0.1."""

    name = "mooncake_master"

    def __init__(self, workdir: str | Path, lease_ttl_ms: int = 11000, extra: list[str] | None = None) -> None:
        super().__init__(workdir)
        self.port, self.metrics_port = free_ports(2)
        self.lease_ttl_ms = lease_ttl_ms
        self._spawn([
            mooncake_master_binary(),
            "--port", str(self.port), "--rpc_address", HOST,
            "--metrics_host", HOST, "--metrics_port", str(self.metrics_port),
            "--eviction_high_watermark_ratio", "0.9", "--eviction_ratio", "0.1",
            "--default_kv_lease_ttl", str(lease_ttl_ms),
            *(extra or []),
        ])
        self._wait_port(self.port, 20)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def evictions(self) -> int | None:
        """Objects the master has evicted so far (its `master_evicted_key_count`; None when its
        metrics page is unreachable or lacks the series)."""
        import httpx

        try:
            text = httpx.get(f"http://{HOST}:{self.metrics_port}/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "master_evicted_key_count":
                return int(float(value))
        return None

    def write_config(self, path: str | Path, global_segment_size: int | str, local_buffer_size: int | str = "16MB",
                     **fields: object) -> str:
        """A mooncake.json in the spec's format, for a client of this master over TCP."""
        cfg = {
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": self.address,
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
            "preferred_segment": False,
            "prefer_alloc_in_same_node": True,
            **fields,
        }
        Path(path).write_text(json.dumps(cfg, indent=2))
        return str(path)


# ---- MemCache ------------------------------------------------------------------------------------


class MemcacheMetaService(Service):
    """MemCache's MetaService as the spec starts it, on free loopback ports."""

    name = "mmc_meta"

    def __init__(self, workdir: str | Path) -> None:
        super().__init__(workdir)
        import importlib.util

        # Not imported here: MemCache reads MMC_LOCAL_CONFIG_PATH once, when it is first imported.
        if importlib.util.find_spec("memcache_hybrid") is None:
            raise ServiceError("memcache-hybrid is not installed: pip install memcache-hybrid memfabric-hybrid")
        self.port, self.store_port, self.http_port = free_ports(3)
        self.conf = self.workdir / "mmc-meta.conf"
        self.conf.write_text(
            f"ock.mmc.meta_service_url = tcp://{HOST}:{self.port}\n"
            f"ock.mmc.meta_service.config_store_url = tcp://{HOST}:{self.store_port}\n"
            f"ock.mmc.meta_service.metrics_url = http://{HOST}:{self.http_port}\n"
            "ock.mmc.log_level = error\n"
        )
        env = {**os.environ, "MMC_META_CONFIG_PATH": str(self.conf)}
        self._spawn([sys.executable, "-c", "from memcache_hybrid import MetaService; MetaService.main()"], env=env)
        self._wait_port(self.port, 20)

    def write_local_config(self, path: str | Path, protocol: str = "host_tcp", dram: str = "64MB") -> str:
        Path(path).write_text(
            f"ock.mmc.meta_service_url = tcp://{HOST}:{self.port}\n"
            f"ock.mmc.local_service.config_store_url = tcp://{HOST}:{self.store_port}\n"
            "ock.mmc.log_level = error\n"
            "ock.mmc.local_service.world_size = 4\n"
            f"ock.mmc.local_service.protocol = {protocol}\n"
            f"ock.mmc.local_service.dram.size = {dram}\n"
        )
        return str(path)


# ---- openYuanrong datasystem ----------------------------------------------------------------------


def dscli_binary() -> str:
    return which("dscli", "pip install openyuanrong-datasystem")


class YuanrongWorker(Service):
    """A datasystem worker with its own metastore (no etcd), started and stopped with `dscli`.

    `dscli start` runs the worker as a daemon (not our child); its pid is read from dscli's
    log (`pid`). `dscli stop` waits up to three minutes for a graceful exit; `stop` gives it
    `grace` seconds and then kills the worker, so no worker (and its shared memory) outlives
    the test that started it.
    """

    name = "yuanrong"

    def __init__(self, workdir: str | Path, shared_memory_mb: int = 512, timeout: float = 60) -> None:
        super().__init__(workdir)
        self.port, self.meta_port = free_ports(2)
        self.log_dir = self.workdir / "worker-logs"
        self.log_dir.mkdir(exist_ok=True)
        # The worker's client socket is <dir>/<8 hex>/client.sock and a Unix socket path holds at
        # most 107 bytes: under a deep workdir (pytest's tmp_path, for a longer user name) the
        # worker cannot bind it and dscli waits out its whole timeout. A short private dir.
        self.uds_dir = Path(tempfile.mkdtemp(prefix="kvpool-yr-"))
        argv = [
            dscli_binary(), "start", "-w",
            "--worker_address", self.address,
            "--metastore_address", f"{HOST}:{self.meta_port}",
            "--start_metastore_service", "true",
            "--shared_memory_size_mb", str(shared_memory_mb),
            # One arena: memory freed by eviction is reusable by any later object (with several,
            # a large object can find no room in an arena while others sit free).
            "--arena_per_tenant", "1",
            "--log_dir", str(self.log_dir),
            "--unix_domain_socket_dir", str(self.uds_dir),
        ]
        self.argv = argv
        self.start(timeout)

    def start(self, timeout: float = 60) -> None:
        """`dscli start` (again after `stop` or `kill`: same address, same metastore port)."""
        self.uds_dir.mkdir(mode=0o700, exist_ok=True)
        try:
            res = subprocess.run(self.argv, cwd=self.workdir, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, timeout=timeout)
            outcome = f"exited with {res.returncode}"
        except subprocess.TimeoutExpired:  # the worker it started may run on: killed below
            res, outcome = None, f"did not return within {timeout:g} s"
        _LIVE.append(self)
        if res is None or res.returncode != 0 or not port_open(self.port):
            self.kill()  # a worker that never served has nothing to shut down gracefully
            raise ServiceError(f"dscli start {outcome}: {self.argv}\n{tail(self.log)}\n{self.worker_log_tail()}")

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def worker_log_tail(self) -> str:
        logs = sorted(self.log_dir.rglob("*.INFO*")) + sorted(self.log_dir.rglob("*.log"))
        return "".join(f"--- {p}\n{tail(p, 1500)}" for p in logs[:3])

    @property
    def pid(self) -> int | None:
        """The pid of this object's worker while it runs (None once it exited): the last one dscli
        logged starting, if that process is still a worker on this address (pids are reused)."""
        found = re.findall(r"Starting worker service with PID: (\d+)", tail(self.log, 1 << 20))
        if not found:
            return None
        pid = int(found[-1])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if f"-worker_address={self.address}\0".encode() in cmdline and not exited(pid) else None

    def alive(self) -> bool:
        return self in _LIVE and port_open(self.port)

    def stop(self, grace: float = 30.0) -> None:
        if self not in _LIVE:
            return
        _LIVE.remove(self)
        try:
            subprocess.run([dscli_binary(), "stop", "--worker_address", self.address], cwd=self.workdir,
                           stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, timeout=grace, check=False)
        except subprocess.TimeoutExpired:
            pass  # still shutting down gracefully: killed below
        self._sigkill()

    def kill(self) -> None:
        """SIGKILL the worker, as a crash would (its metastore and shared memory go with it)."""
        if self in _LIVE:
            _LIVE.remove(self)
        self._sigkill()

    def _sigkill(self) -> None:
        pid = self.pid
        if pid is not None and not sigkill(pid):
            raise ServiceError(f"{self.name}: worker pid {pid} still runs after SIGKILL; log {self.log}")
        shutil.rmtree(self.uds_dir, ignore_errors=True)  # made again by a restart


_SHARED_YUANRONG: YuanrongWorker | None = None


def shared_yuanrong_worker(shared_memory_mb: int = 128) -> YuanrongWorker:
    """One datasystem worker for the whole test session (dscli start and stop take ~6 s each).

    Tests keep their pools apart with `key_prefix`; stopped at interpreter exit.
    """
    global _SHARED_YUANRONG
    if _SHARED_YUANRONG is None or not _SHARED_YUANRONG.alive():
        workdir = tempfile.mkdtemp(prefix="kvpool-yr-")
        try:
            _SHARED_YUANRONG = YuanrongWorker(workdir, shared_memory_mb=shared_memory_mb)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        worker = _SHARED_YUANRONG

        def cleanup() -> None:  # runs before _stop_all (atexit is last-in, first-out)
            try:
                worker.stop(grace=10.0)  # the session is over: no need to wait out a slow graceful exit
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

        atexit.register(cleanup)
    return _SHARED_YUANRONG
