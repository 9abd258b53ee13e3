"""The shared-memory arena: a file in /dev/shm that the server creates and its clients map.

POSIX shared memory on Linux is a tmpfs file under /dev/shm; opening it by path is what
``shm_open`` does, without needing ctypes. The file is created with ``O_EXCL | O_NOFOLLOW`` and
mode 0600 (0660 and the shared group with group sharing), so no other user can read or write the
KV cache it holds. A client checks owner and mode on the opened descriptor before it maps
anything, so it never maps a file another user planted under an arena's name.

The arena's pages are reserved when it is created (``posix_fallocate``): a tmpfs file is
sparse, and a page first touched after another user filled /dev/shm would kill the process that
touched it (a client's put: a vLLM worker) with SIGBUS. A server that cannot reserve its arena
refuses to start and says so.

Names are ``kvpool-<socket tag>-<pid>-<random>``: the tag (a hash of the socket path) lets a
server that takes over a dead server's socket find and unlink the arena that server left behind
after a SIGKILL, without touching another socket's arenas; the random part keeps another user
from creating the name first (which would stop the server from starting).

Arenas of dead servers of other sockets (a test's, a demo's, a server moved to another path)
would hold their memory until reboot. The server holds an ``flock`` on its arena for its whole
life, which the kernel drops however it dies; `leftovers` finds the arenas of this user that
nobody holds and whose creator's pid is gone, and `remove_leftovers` (run by every server at
start-up) unlinks them. Both conditions must hold: the lock proves a live server of this
version, the pid a live server of an older one (which held no lock) in this PID namespace.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

import numpy as np

from kvpool.errors import ConfigError
from kvpool.server.pidwatch import pid_alive
from kvpool.store.prefault import Prefaulter

logger = logging.getLogger(__name__)

# Where arenas live: a tmpfs the server and every client see, each at its own path. Set
# KVPOOL_SHM_DIR (the same directory of the host, wherever each container mounts it) to keep a
# container's own /dev/shm out of the pool's: vLLM puts its own shared memory there.
SHM_ENV = "KVPOOL_SHM_DIR"
SHM_DIR = os.environ.get(SHM_ENV) or "/dev/shm"
_PREFIX = "kvpool-"


def socket_tag(socket_path: str) -> str:
    """A short, file-name-safe tag identifying the server bound to ``socket_path``."""
    return hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:16]


def arena_name(socket_path: str, pid: int) -> str:
    """A fresh arena name for the server of ``socket_path`` with process id ``pid``: no one can
    guess it before the server creates it."""
    return f"{_PREFIX}{socket_tag(socket_path)}-{pid}-{secrets.token_hex(8)}"


def arena_names(socket_path: str, pid: int | None = None) -> list[str]:
    """The arenas in /dev/shm of ``socket_path``'s servers (of process ``pid`` only, if given)."""
    pattern = f"{_PREFIX}{socket_tag(socket_path)}-{'*' if pid is None else pid}-*"
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, pattern)))


# Every arena name kvpool has used: `kvpool-<tag>-<pid>`, then `kvpool-<tag>-<pid>-<random>`.
_ARENA_NAME = re.compile(r"kvpool-[0-9a-f]{16}-(?P<pid>[0-9]{1,10})(-[0-9a-f]{16})?")


def _check_name(name: str) -> str:
    # The name comes over the socket; it must not point outside /dev/shm.
    if not name.startswith(_PREFIX) or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"invalid arena name {name!r}")
    return os.path.join(SHM_DIR, name)


@dataclass
class Arena:
    """A mapped arena; ``array`` is a writable uint8 view of all ``size`` bytes.

    A client's arena (`attach`) has a prefaulter: the client notes each range it is about to
    copy to or from (`note`), and the pages a little past the highest are mapped ahead on a
    background thread, so its copies do not take page faults (store/prefault.py)."""

    name: str
    size: int
    mm: mmap.mmap
    array: np.ndarray
    prefault: Prefaulter | None = None
    lock_fd: int | None = None  # the creating server's: holds the arena's flock while it lives

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def note(self, end: int) -> None:
        """This process is about to copy bytes of the arena below offset ``end``."""
        if self.prefault is not None:
            self.prefault.note(end)

    def close(self) -> None:
        """Drop this handle's view; the mapping goes once no copy still uses it.

        mmap.close() fails while numpy views export its buffer, and a concurrent copy may still
        hold one, so we only drop our references and let the last user release the mapping.
        """
        if self.prefault is not None:
            self.prefault.close()
            self.prefault = None
        self.array = np.empty(0, dtype=np.uint8)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def arena_mode(allowed_gid: int | None) -> int:
    """The only mode an arena may have: owner only, or owner and the shared group."""
    return 0o600 if allowed_gid is None else 0o660


def create(name: str, size: int, allowed_gid: int | None = None) -> Arena:
    """Create, reserve and map a new arena of ``size`` bytes."""
    if not os.path.isabs(SHM_DIR) or not os.path.isdir(SHM_DIR):
        raise ConfigError(SHM_ENV, SHM_DIR, "an existing directory on a tmpfs, by absolute path (unset: /dev/shm, "
                                            "POSIX shared memory)")
    free = os.statvfs(SHM_DIR)
    available = free.f_bavail * free.f_frsize
    if size > available:
        raise ConfigError(
            "global_segment_size", size,
            f"at most the {available} bytes free in {SHM_DIR}; lower --memory-size or enlarge "
            f"{SHM_DIR} (e.g. docker --shm-size)",
        )
    path = _check_name(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # Held until this process ends: the arena is in use (`leftovers`). A server in another
        # PID namespace could have taken it for a leftover in the instant before: then the name
        # is gone, and this arena must not be used.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(f"{path} was removed while it was being created; start again")
        if allowed_gid is not None:
            os.fchown(fd, -1, allowed_gid)
            os.fchmod(fd, arena_mode(allowed_gid))
        os.ftruncate(fd, size)
        try:
            # Every page now, while /dev/shm has room: a page first touched later, after someone
            # else filled the mount, is SIGBUS in whichever process touches it.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            now = os.statvfs(SHM_DIR)
            raise ConfigError(
                "global_segment_size", size,
                f"room for the whole arena in {SHM_DIR} when the server starts (reserving it failed: "
                f"{os.strerror(exc.errno or 0)}; {now.f_bavail * now.f_frsize} bytes free now); lower "
                f"--memory-size, or free or enlarge {SHM_DIR} (e.g. docker --shm-size)",
            ) from exc
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    # The mapping keeps the memory and the name stays until unlink(); the descriptor stays open
    # for its lock.
    return Arena(name, size, mm, np.frombuffer(mm, dtype=np.uint8), lock_fd=fd)


def attach(name: str, size: int, owner_uid: int, allowed_gid: int | None = None) -> Arena:
    """Map an arena the server (running as ``owner_uid``) created; raises OSError/ValueError if
    it is not there or is not what that server would have created (owner, mode, group).

    Mapped read-write: clients write their puts straight into it."""
    path = _check_name(name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise ValueError(f"{path} is not an arena of {size} bytes (size {st.st_size})")
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != owner_uid:
            raise ValueError(f"{path} is owned by uid {st.st_uid}, not by the server's uid {owner_uid}; "
                             f"refusing to map it")
        group_shared = allowed_gid is not None and mode == 0o660 and st.st_gid == allowed_gid
        if mode != 0o600 and not group_shared:
            raise ValueError(f"{path} has mode {mode:04o} (group {st.st_gid}); an arena must be 0600, or 0660 "
                             f"with the shared group (allowed_gid={allowed_gid}); refusing to map it")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    array = np.frombuffer(mm, dtype=np.uint8)
    return Arena(name, size, mm, array, Prefaulter(array, name="kvpool-prefault-client"))


def unlink(name: str) -> None:
    try:
        os.unlink(_check_name(name))
    except FileNotFoundError:
        pass


def remove_stale(socket_path: str, keep: str | None = None) -> list[str]:
    """Unlink arenas left by earlier servers of ``socket_path`` (call only while holding its lock).

    Only files we own are touched; the lock guarantees no live server uses this tag.
    """
    removed = []
    for name in arena_names(socket_path):
        path = os.path.join(SHM_DIR, name)
        if name == keep:
            continue
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


@dataclass(frozen=True)
class Leftover:
    """An arena of a dead server: ``size`` bytes long, ``resident`` of them held in memory."""

    name: str
    pid: int
    size: int
    resident: int


def _open_leftover(name: str) -> tuple[int, Leftover] | None:
    """A locked descriptor of arena ``name`` and what it holds, if it is this user's and its
    server is provably dead; None otherwise (the descriptor closed)."""
    match = _ARENA_NAME.fullmatch(name)
    if match is None:
        return None
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError("not ours")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its server lives
        pid = int(match["pid"])
        if pid_alive(pid):
            raise OSError("its creator's pid is alive")
        return fd, Leftover(name, pid, st.st_size, st.st_blocks * 512)
    except OSError:
        os.close(fd)
        return None


def leftovers() -> list[Leftover]:
    """This user's arenas in /dev/shm whose servers are provably dead: nobody holds the arena's
    lock and its creator's pid is gone."""
    return _scan(remove=False)


def remove_leftovers() -> list[Leftover]:
    """Unlink `leftovers` (each while holding its lock, and only if its name still names the
    file that was checked); returns what was removed."""
    return _scan(remove=True)


def _scan(remove: bool) -> list[Leftover]:
    found = []
    for path in sorted(glob.glob(os.path.join(SHM_DIR, _PREFIX + "*"))):
        opened = _open_leftover(os.path.basename(path))
        if opened is None:
            continue
        fd, leftover = opened
        try:
            if remove:
                if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                    continue
                os.unlink(path)
            found.append(leftover)
        except OSError:
            pass
        finally:
            os.close(fd)
    return found
