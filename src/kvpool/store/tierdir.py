"""The SSD tier's directory, opened once: every shard and file reached through descriptors.

A path is checked when the tier opens (`paths.validate_offload_path`), but a path can be
swapped after it was checked: another user who may write the directory's parent can move it
aside and put one of their own in its place, with files the tier would then serve. So the tier
holds one descriptor of its directory for its lifetime, and names every shard and file relative
to a descriptor (`openat` and friends: `dir_fd=`), never by a path from the root again.

Each entry is also checked on the descriptor it was opened as, not by its name: the directory
itself (ours, writable by no one else), a shard (a directory of ours, 0700), a file (a regular
file of ours, 0600). A shard or file that fails is `Untrusted` (an OSError: to the tier, an
unreadable file, so a read of it is a miss and a write to it fails), whoever put it there.
Symlinks are never followed (`O_NOFOLLOW`).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

FILE_MODE = 0o600  # every file the tier makes
DIR_MODE = 0o700  # every shard directory it makes
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Untrusted(OSError):
    """An entry of the tier's directory that is not what the tier itself would have made."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EPERM, what)


def _check(fd: int, what: str, kind: int, private: int) -> os.stat_result:
    """Raise Untrusted unless ``fd`` is a ``kind`` (S_IFDIR / S_IFREG) of our uid without any of
    the ``private`` mode bits."""
    st = os.fstat(fd)
    if stat.S_IFMT(st.st_mode) != kind:
        raise Untrusted(f"{what} is not a {'directory' if kind == stat.S_IFDIR else 'regular file'}")
    if st.st_uid != os.getuid():
        raise Untrusted(f"{what} belongs to uid {st.st_uid}, not to this process's uid {os.getuid()}")
    if st.st_mode & private:
        made = DIR_MODE if kind == stat.S_IFDIR else FILE_MODE
        raise Untrusted(f"{what} has mode {stat.S_IMODE(st.st_mode):04o}; the tier makes it {made:04o}")
    return st


class TierDir:
    """One open directory and its open shard directories (thread-safe)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, _DIR_FLAGS)
        try:
            # The same rule as the path's check, now on what was actually opened.
            _check(self.fd, path, stat.S_IFDIR, stat.S_IWGRP | stat.S_IWOTH)
        except BaseException:
            os.close(self.fd)
            raise
        self._shards: dict[str, int] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close every descriptor (idempotent: a second close closes nothing, never another's fd)."""
        with self._lock:
            fds, self._shards = list(self._shards.values()), {}
            fd, self.fd = self.fd, -1
        for shard_fd in fds:
            os.close(shard_fd)
        if fd >= 0:
            os.close(fd)

    # ---- shards ---------------------------------------------------------------------------------

    def shard(self, name: str, create: bool = False) -> int:
        """The descriptor of shard directory ``name`` (created 0700 if ``create``); FileNotFoundError
        if absent, Untrusted if it is not the tier's."""
        with self._lock:
            fd = self._shards.get(name)
        if fd is not None:
            return fd
        if create:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
            except FileExistsError:
                pass
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        try:
            _check(fd, os.path.join(self.path, name), stat.S_IFDIR, 0o077)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            if name in self._shards:  # another thread opened it meanwhile
                os.close(fd)
                return self._shards[name]
            self._shards[name] = fd
        return fd

    def shard_names(self) -> Iterator[str]:
        """Names of the directory's subdirectories (unchecked: `shard` checks one when opened)."""
        with os.scandir(self.fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    yield entry.name

    def files(self, shard: str) -> Iterator[os.DirEntry]:
        """The regular files in ``shard`` (whose descriptor is checked first)."""
        with os.scandir(self.shard(shard)) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    yield entry

    # ---- entries, relative to a directory (None: the tier's own) --------------------------------

    def _at(self, shard: str | None) -> int:
        return self.fd if shard is None else self.shard(shard)

    def create(self, shard: str | None, name: str, truncate: bool = False) -> int:
        """A new file of ours, 0600 whatever the umask (O_EXCL unless ``truncate``: then an existing
        file of that name must be ours)."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_EXCL)
        return self._file(self._at(shard), shard, name, flags, chmod=True)

    def open(self, shard: str | None, name: str, write: bool = False) -> int:
        """An existing file of ours, read-only (or read-write); Untrusted if it is not ours and 0600."""
        return self._file(self._at(shard), shard, name, os.O_RDWR if write else os.O_RDONLY)

    def lock_file(self, name: str) -> int:
        """The directory's lock file (created if absent), read-write."""
        return self._file(self.fd, None, name, os.O_RDWR | os.O_CREAT)

    def _file(self, at: int, shard: str | None, name: str, flags: int, chmod: bool = False) -> int:
        """Open ``name`` relative to ``at`` (never through a symlink) and check it is a file of ours."""
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=at)
        try:
            if chmod:
                os.fchmod(fd, FILE_MODE)
            _check(fd, self.where(shard, name), stat.S_IFREG, 0o077)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def replace(self, shard: str | None, src: str, dst: str) -> None:
        at = self._at(shard)
        os.replace(src, dst, src_dir_fd=at, dst_dir_fd=at)

    def unlink(self, shard: str | None, name: str) -> None:
        os.unlink(name, dir_fd=self._at(shard))

    def lstat(self, shard: str | None, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self._at(shard), follow_symlinks=False)

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.fd)

    def where(self, shard: str | None, name: str) -> str:
        """The entry's path, for messages only."""
        return os.path.join(self.path, name) if shard is None else os.path.join(self.path, shard, name)


def pread_into(fd: int, dest: Any, offset: int) -> int:
    """Read from ``offset`` of ``fd`` until ``dest`` (a writable buffer) is full or the file
    ends; the bytes read."""
    view = memoryview(dest).cast("B")
    got = 0
    while got < len(view):  # a read may return fewer bytes than asked for
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got
