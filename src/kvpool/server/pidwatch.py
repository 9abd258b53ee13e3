"""Which client processes are still alive: a connection ends with the process that opened it.

The server counts a connection's leases and allocations against the process that opened it
(the kernel's SO_PEERCRED pid). A process could otherwise shed that account cheaply: open
connections in short-lived children, take them over (SCM_RIGHTS) and let the children exit,
each child a fresh quota. So the server watches every opener with a pidfd (`pidfd_open`, Linux
5.3): when it exits, the connections it opened are closed, their leases dropped and their
allocations freed, whoever holds the socket now. A legitimate client never outlives the process
that connected (kvpool's client reconnects in a forked child).
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists in this PID namespace (one of another user counts: its
    pid is taken, so whatever had it before is not provably gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PidWatch:
    """Calls ``on_exit(pid)`` (on its own thread) once each watched process has exited."""

    def __init__(self, on_exit: Callable[[int], None]) -> None:
        self._on_exit = on_exit
        self._sel = selectors.DefaultSelector()
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self.available = hasattr(os, "pidfd_open")
        self._thread = threading.Thread(target=self._run, name="kvpool-pidwatch", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> bool:
        """Watch ``pid`` (again: a no-op). False when it cannot be watched (gone already, no
        pidfd on this kernel): the caller decides what that means."""
        with self._lock:
            if pid in self._fds:
                return True
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError) as exc:
                if isinstance(exc, AttributeError) or exc.errno == 38:  # ENOSYS: a kernel before 5.3
                    self.available = False
                return False
            self._fds[pid] = fd
            self._sel.register(fd, selectors.EVENT_READ, pid)
        os.write(self._wake_w, b"x")  # the selector's new fd counts from its next select()
        return True

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._sel.select():
                if key.fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                pid = key.data
                with self._lock:
                    self._sel.unregister(key.fd)
                    os.close(self._fds.pop(pid))
                try:
                    self._on_exit(pid)
                except Exception:  # a bug here must not end the watch of every other process
                    logger.exception("closing the connections of exited process %d failed", pid)

    def close(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
