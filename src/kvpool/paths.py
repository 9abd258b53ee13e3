"""Where kvpool's local files may live, and the checks that keep another user out of them.

Two kinds of place: the per-user runtime directory (sockets and lock files of `kvpool server`
and of the lookup channel; `runtime_dir`), and directories that hold pooled KV on disk (the SSD
tier's `ssd_offload_path`, Mooncake's offload path; `validate_offload_path`). An explicit socket
path outside the runtime directory is accepted when its directory cannot be used by another user
to plant a socket there (`check_socket_dir`). The trust model is written down in docs/security.md.
Stdlib only: every layer uses this module.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass

from kvpool.errors import ConfigError

RUNTIME_SUBDIR = "kvpool"
SERVER_SOCKET_NAME = "server.sock"
# Where the runtime directory goes without a usable XDG_RUNTIME_DIR (a module value so that
# tests can point it at a directory of their own instead of the real /tmp).
FALLBACK_BASE = "/tmp"


def runtime_dir_path() -> str:
    """The per-user runtime directory's path, without creating or checking it.

    ``$XDG_RUNTIME_DIR/kvpool`` when ``XDG_RUNTIME_DIR`` is a directory of ours with mode 0700
    (what a login session provides), else ``/tmp/kvpool-<uid>``.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() \
                and stat.S_IMODE(st.st_mode) == 0o700:
            return os.path.join(xdg, RUNTIME_SUBDIR)
    return os.path.join(FALLBACK_BASE, f"kvpool-{os.getuid()}")


def default_server_socket() -> str:
    """Where `kvpool server` listens and `backend: server` connects unless told otherwise."""
    return os.path.join(runtime_dir_path(), SERVER_SOCKET_NAME)


def check_private_dir(path: str, key: str = "runtime_dir") -> None:
    """Refuse ``path`` unless it is a real directory (not a symlink) owned by us with mode 0700.

    Checked on an fd opened with O_NOFOLLOW, so what is checked is what is there, not what a
    racing rename puts there after the check.
    """
    fix = (f"remove it (rm -rf {path}) and let kvpool create it, or fix it with "
           f"chown {os.getuid()} {path} && chmod 0700 {path}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(key, path, f"a real directory, not a symlink (it points to "
                                         f"{os.readlink(path)!r}); {fix}") from None
        raise ConfigError(key, path, f"a directory we can open ({exc.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid():
        raise ConfigError(key, path, f"a directory owned by uid {os.getuid()} (it is owned by uid "
                                     f"{st.st_uid}: another user may have created it to intercept "
                                     f"kvpool's sockets); {fix}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise ConfigError(key, path, f"a directory of mode 0700 (it is {stat.S_IMODE(st.st_mode):04o}); {fix}")


def runtime_dir() -> str:
    """The per-user runtime directory, created (mode 0700) when missing and always checked."""
    path = runtime_dir_path()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError("runtime_dir", path, f"a directory kvpool can create ({exc.strerror}); "
                                               f"set XDG_RUNTIME_DIR to a private directory") from None
    check_private_dir(path)
    return path


@dataclass(frozen=True)
class SocketDir:
    """What `check_socket_dir` found: whether another user could create entries there."""

    path: str
    shared: bool  # others may create files (a sticky directory such as /tmp)


def check_socket_dir(socket_path: str, key: str, allowed_gid: int | None = None) -> SocketDir:
    """Check the directory of an explicitly configured socket path.

    The runtime directory is checked (and created) as such. Any other directory must exist,
    be owned by us or root, and not be writable by others (nor by its group, unless that group is
    the ``allowed_gid`` of group sharing) -- or be sticky (like /tmp): others may then create
    entries but not replace ours, so a caller must check the socket file's owner itself
    (``shared`` is then True).
    """
    parent = os.path.dirname(os.path.abspath(socket_path))
    if parent == runtime_dir_path():
        runtime_dir()
        return SocketDir(parent, False)
    try:
        st = os.stat(parent)
    except OSError as exc:
        raise ConfigError(key, socket_path, f"a path in an existing directory ({parent}: {exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(key, socket_path, f"a path in a directory ({parent} is not one)")
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(key, socket_path, f"a path in a directory owned by us or root ({parent} is owned by uid "
                                            f"{st.st_uid}, who could replace the socket); use the default")
    group_ok = allowed_gid is not None and st.st_gid == allowed_gid
    writable_by_others = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not group_ok)
    if not writable_by_others:
        return SocketDir(parent, False)
    if st.st_mode & stat.S_ISVTX:
        return SocketDir(parent, True)
    raise ConfigError(key, socket_path, f"a path in a directory other users cannot write ({parent} has mode "
                                        f"{stat.S_IMODE(st.st_mode):04o}, so anyone could put a socket there); "
                                        f"use the default socket or chmod go-w {parent}")


def open_private_lock(lock_path: str, key: str) -> int:
    """Open (creating, mode 0600) a lock file that must be ours: never a symlink, never a file
    another user planted (who could then hold the lock or read what we write into it)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(key, lock_path, f"a lock file of ours (it is owned by uid {st.st_uid}); remove it")
    return fd

def validate_offload_path(path: str) -> None:
    """Check the SSD offload directory, raising ``ConfigError`` naming what to fix.

    Rules: absolute, no ``..`` component, no symlink anywhere in it (the resolved
    path must equal the written one, so the pool can never be redirected
    elsewhere by a link), exists, is a directory owned by the serving user and not
    writable by group or others (anyone who can write there could plant files the
    tier would serve as KV), writable.
    """

    def fail(expected: str) -> None:
        raise ConfigError(key="ssd_offload_path", value=path, expected=expected)

    if not isinstance(path, str) or not path:
        fail("a non-empty absolute directory path, e.g. /mnt/nvme/kvpool")
    if not os.path.isabs(path):
        fail("an absolute path (starting with '/'), e.g. /mnt/nvme/kvpool")
    if ".." in path.split("/"):
        fail("a path without '..' components; write the resolved directory instead")
    normalized = os.path.normpath(path)
    if os.path.realpath(path) != normalized:
        fail(
            f"a path without symlinks (it resolves to {os.path.realpath(path)!r}); "
            f"use the resolved path"
        )
    if not os.path.exists(path):
        fail("an existing directory; create it first (mkdir -p) with the serving user as owner")
    if not os.path.isdir(path):
        fail("a directory, not a file")
    st = os.stat(path)
    if st.st_uid != os.getuid():
        fail(f"a directory owned by the serving user, uid {os.getuid()} (it is owned by uid {st.st_uid}); "
             f"chown {os.getuid()} {path}, or use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        fail(f"a directory only its owner can write (mode {stat.S_IMODE(st.st_mode):04o} lets others plant "
             f"files the pool would serve); chmod 0700 {path}")
    # A real write, not os.access: root passes every mode check but still cannot write to a
    # read-only mount, and that is what would fail later, mid-serving.
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvpool-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        fail(f"a directory writable by the serving user ({exc.strerror}); fix its owner, mode or mount")
