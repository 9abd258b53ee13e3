"""The per-user runtime directory, socket directories, and the SSD tier's files, modes and lock."""

from __future__ import annotations

import os
import stat

import pytest

from kvpool import paths
from kvpool.errors import ConfigError
from kvpool.store import DiskTier


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _owned_by_someone_else(path: str, monkeypatch) -> None:
    """Make ``path`` look owned by another uid: chown as root, else pretend to be another uid."""
    if os.getuid() == 0:
        os.chown(path, 65534, -1)
    else:
        real = os.getuid()
        monkeypatch.setattr(paths.os, "getuid", lambda: real + 1)


# ---- runtime directory -------------------------------------------------------------------


def test_runtime_dir_is_created_private(fallback_base):
    path = paths.runtime_dir()
    assert path == os.path.join(fallback_base, f"kvpool-{os.getuid()}")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _mode(path) == 0o700
    assert paths.runtime_dir() == path  # and found again as it is
    assert paths.default_server_socket() == os.path.join(path, "server.sock")


def test_runtime_dir_under_xdg_runtime_dir(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    os.chmod(xdg, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert paths.runtime_dir() == str(xdg / "kvpool") and _mode(str(xdg / "kvpool")) == 0o700
    os.chmod(xdg, 0o755)  # not a private XDG_RUNTIME_DIR: not used
    assert paths.runtime_dir_path() != str(xdg / "kvpool")


def test_a_planted_symlink_is_refused(fallback_base, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, paths.runtime_dir_path())
    with pytest.raises(ConfigError) as exc:
        paths.runtime_dir()
    assert exc.value.value == paths.runtime_dir_path() and "symlink" in exc.value.expected


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o777, 0o711])
def test_a_wrong_mode_is_refused_not_repaired(fallback_base, mode):
    os.mkdir(paths.runtime_dir_path())
    os.chmod(paths.runtime_dir_path(), mode)
    with pytest.raises(ConfigError) as exc:
        paths.runtime_dir()
    assert exc.value.value == paths.runtime_dir_path() and f"{mode:04o}" in exc.value.expected
    assert _mode(paths.runtime_dir_path()) == mode


def test_a_directory_owned_by_another_uid_is_refused(fallback_base, monkeypatch):
    path = paths.runtime_dir_path()
    os.mkdir(path, 0o700)
    _owned_by_someone_else(path, monkeypatch)
    with pytest.raises(ConfigError) as exc:
        paths.runtime_dir()
    assert exc.value.value == paths.runtime_dir_path() and "owned by uid" in exc.value.expected


def test_a_file_in_its_place_is_refused(fallback_base):
    open(paths.runtime_dir_path(), "w").close()
    with pytest.raises(ConfigError):
        paths.runtime_dir()


# ---- explicit socket directories ----------------------------------------------------------


def test_socket_dir_rules(tmp_path, fallback_base):
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o755)
    assert paths.check_socket_dir(str(private / "s.sock"), "socket").shared is False
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert paths.check_socket_dir(str(sticky / "s.sock"), "socket").shared is True
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError) as exc:
        paths.check_socket_dir(str(open_dir / "s.sock"), "socket")
    assert exc.value.key == "socket" and "0777" in exc.value.expected
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(ConfigError):
        paths.check_socket_dir(str(group / "s.sock"), "socket")
    gid = os.stat(group).st_gid
    assert paths.check_socket_dir(str(group / "s.sock"), "socket", allowed_gid=gid).shared is False
    with pytest.raises(ConfigError):
        paths.check_socket_dir(str(tmp_path / "missing" / "s.sock"), "socket")
    # The default socket's directory is the runtime directory: created and checked as such.
    assert paths.check_socket_dir(paths.default_server_socket(), "socket").shared is False
    assert _mode(paths.runtime_dir_path()) == 0o700


def test_a_lock_file_planted_as_a_symlink_is_refused(tmp_path):
    os.symlink(tmp_path / "target", tmp_path / "x.lock")
    with pytest.raises(OSError):
        paths.open_private_lock(str(tmp_path / "x.lock"), "socket")
    assert not (tmp_path / "target").exists()


# ---- SSD tier -------------------------------------------------------------------------------


@pytest.fixture
def ssd(tmp_path) -> str:
    path = os.path.realpath(tmp_path / "ssd")
    os.mkdir(path, 0o700)
    return path


def test_ssd_files_are_0600_and_dirs_0700_whatever_the_umask(ssd):
    old = os.umask(0)
    try:
        disk = DiskTier(ssd, 1 << 20)
        assert disk.put("key", b"payload") == 0
    finally:
        os.umask(old)
    digest = next(d for d in os.listdir(ssd) if len(d) == 2)
    [name] = os.listdir(os.path.join(ssd, digest))
    assert _mode(os.path.join(ssd, digest)) == 0o700
    assert _mode(os.path.join(ssd, digest, name)) == 0o600
    assert _mode(os.path.join(ssd, ".kvpool.lock")) == 0o600
    disk.close()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777])
def test_an_ssd_dir_others_can_write_is_refused(ssd, mode):
    os.chmod(ssd, mode)
    with pytest.raises(ConfigError) as exc:
        DiskTier(ssd, 1 << 20)
    assert exc.value.key == "ssd_offload_path" and exc.value.value == ssd
    assert os.listdir(ssd) == []  # refused before it touched anything


def test_an_ssd_dir_owned_by_another_uid_is_refused(ssd, monkeypatch):
    _owned_by_someone_else(ssd, monkeypatch)
    with pytest.raises(ConfigError) as exc:
        paths.validate_offload_path(ssd)
    assert exc.value.value == ssd and "owned by" in exc.value.expected


def test_one_tier_per_directory(ssd):
    first = DiskTier(ssd, 1 << 20)
    with pytest.raises(ConfigError) as exc:
        DiskTier(ssd, 1 << 20)
    assert exc.value.value == ssd and f"pid {os.getpid()}" in exc.value.expected
    first.close()
    DiskTier(ssd, 1 << 20).close()  # free again once the holder closed


def test_the_lock_is_held_across_processes_and_dropped_when_the_holder_dies(ssd):
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvpool.store import DiskTier; d = DiskTier(sys.argv[1], 1 << 20); "
                               "print('ready', flush=True); sys.stdin.read()", ssd],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError) as exc:
            DiskTier(ssd, 1 << 20)
        assert f"pid {holder.pid}" in exc.value.expected
    finally:
        holder.kill()
        holder.wait()
    DiskTier(ssd, 1 << 20).close()
