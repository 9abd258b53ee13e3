"""Helpers for the `kvpool server` tests: run the real daemon as a subprocess, build payloads.

(Not named conftest: tests/store/conftest.py is imported by name elsewhere.)
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpool.server import shm

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "srvworker.py")


def socket_dir(tmp_path: Path) -> str:
    """A directory for the socket: tmp_path when short enough for sun_path (107 bytes)."""
    path = os.path.realpath(tmp_path)
    if len(path) + len("/kvpool.sock.lock") <= 100:
        return path
    return tempfile.mkdtemp(prefix="kvp", dir="/tmp")


class ServerProc:
    """One `python -m kvpool.server.daemon` process, its flags and its log file."""

    def __init__(self, socket_path: str, log_path: str, flags: list[str],
                 entry: tuple[str, ...] = ("-m", "kvpool.server.daemon")) -> None:
        self.entry = entry
        self.socket_path = socket_path
        self.log_path = log_path
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def cmd(self) -> list[str]:
        return [sys.executable, *self.entry, "--socket", self.socket_path, *self.flags]

    def start(self, expect_ready: bool = True, timeout_s: float = 15.0) -> ServerProc:
        t0 = time.monotonic()
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if not expect_ready:
            return self
        mark = f"kvpool server {self.proc.pid} listening on"
        while time.monotonic() - t0 < timeout_s:
            if mark in self.log():
                self.startup_s = time.monotonic() - t0
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.01)
        raise AssertionError(f"server not ready after {timeout_s}s:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()
        except FileNotFoundError:
            return ""

    def wait(self, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait: the clean shutdown path."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
            self.proc.kill()
        self.proc.wait(15)


def arena_files(socket_path: str) -> list[str]:
    tag = shm.socket_tag(socket_path)
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"kvpool-{tag}-"))


def payload(key: str, size: int) -> np.ndarray:
    """``size`` bytes (>= 16) derived from ``key``; the last 16 are a hash of key and body."""
    assert size >= 16
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    out = np.empty(size, dtype=np.uint8)
    out[:-16] = np.random.default_rng(seed).integers(0, 256, size - 16, dtype=np.uint8)
    out[-16:] = np.frombuffer(hashlib.blake2b(key.encode() + out[:-16].tobytes(), digest_size=16).digest(), np.uint8)
    return out


def payload_ok(key: str, data: np.ndarray) -> bool:
    """Whether ``data`` is exactly the payload of ``key`` (checked by its embedded hash)."""
    if data.size < 16:
        return False
    digest = hashlib.blake2b(key.encode() + data[:-16].tobytes(), digest_size=16).digest()
    return digest == data[-16:].tobytes()


def size_of(key_index: int) -> int:
    """Varied sizes (4..36 KiB) so eviction fragments the arena."""
    return 4096 + (key_index * 7919) % (32 << 10)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread is stopped.

    Linux stops a process's threads asynchronously (one thread takes the signal, then stops
    the others), so a thread can still answer a request just after kill() returned.
    """
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            except FileNotFoundError:
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        return all(s in ("T", "t") for s in states)

    assert wait_for(all_stopped, timeout_s, 0.005), f"process {pid} did not stop"
