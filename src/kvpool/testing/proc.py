"""Small process and port helpers shared by every launcher in `kvpool.testing`, the tests and
the benchmarks: one copy of each, so a fix reaches all of them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port that was free a moment ago (bind to 0, read the port, release it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct free ports (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int, host: str = HOST, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def unix_socket_accepts(path: str | os.PathLike[str]) -> bool:
    """Whether something accepts connections on the Unix socket `path` now (a socket file left
    by a killed server does not)."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.fspath(path))
        return True
    except OSError:
        return False


def tail(path: str | os.PathLike[str], max_bytes: int = 6000) -> str:
    """The last `max_bytes` of a log file, for error messages (never raises)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<no log at {Path(path)}: {e}>"


def wait_for(cond: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def expect(cond: Callable[[], bool], what: str, timeout: float = 5.0, interval: float = 0.01) -> None:
    """`wait_for`, for tests: a timeout fails with an AssertionError naming `what`."""
    if not wait_for(cond, timeout, interval):
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None if
    the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the name is parenthesized and may hold spaces


def exited(pid: int) -> bool:
    """Whether `pid` has exited: gone, or a zombie its parent has not reaped yet (a daemon
    whose parent exited is reaped by init, possibly later)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in "ZX"


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` has not exited yet (zombies count as exited)."""
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields is not None and fields[0] not in "ZX" and int(fields[2]) == pgid:
            return True
    return False


def sigkill(pid: int, timeout: float = 10.0) -> bool:
    """SIGKILL `pid` (not necessarily our child) and wait until it has exited; whether it did."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return wait_for(lambda: exited(pid), timeout)


def threads(pid: int) -> list[int]:
    """The thread ids of process `pid`, its main thread (tid == pid) first."""
    return sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda tid: (tid != pid, tid))


def signal_thread(pid: int, tid: int, sig: int) -> None:
    """Send `sig` to one thread `tid` of process `pid` (tgkill(2)).

    A signal sent to a process goes to whichever of its threads the kernel picks, usually but
    not always the main one; this makes the unusual case happen on purpose.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(ctypes.c_int(pid), ctypes.c_int(tid), ctypes.c_int(sig)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"tgkill({pid}, {tid}, {sig}): {os.strerror(err)}")


def sigstop(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped.

    Linux stops a process's threads asynchronously (one thread takes the signal, then stops
    the others), so without the wait a thread can still answer a request after kill() returned.
    """
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            except FileNotFoundError:  # a thread that exited meanwhile
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        return all(s in ("T", "t") for s in states)

    if not wait_for(all_stopped, timeout, 0.005):
        raise TimeoutError(f"process {pid} did not stop within {timeout} s")
