"""Arenas of dead servers do not pile up in /dev/shm: every server removes, at start-up, this
user's arenas that nobody holds and whose creator is gone; `kvpool doctor` reports them. An
arena of a live server, of an older server that is still running, of another user or under a
name that is not an arena's is never touched."""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys

import pytest

from kvpool.backends.diagnosis import Report
from kvpool.backends.pool_server import check_leftover_arenas
from kvpool.server import shm


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(directory, name: str, size: int = 8192) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"\1" * size)  # resident pages, as an arena's
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    return tmp_path


TAG = "0123456789abcdef"


def test_only_arenas_nobody_holds_whose_creator_is_gone_are_leftovers(shm_dir):
    gone = dead_pid()
    live = shm.create(shm.arena_name("/run/x.sock", os.getpid()), 1 << 16)  # holds its lock
    old_layout = plant(shm_dir, f"kvpool-{TAG}-{gone}")  # an arena name of earlier releases
    dead = plant(shm_dir, f"kvpool-{TAG}-{gone}-{'f' * 16}")
    held = plant(shm_dir, f"kvpool-{TAG}-{gone}-{'e' * 16}")
    running_old = plant(shm_dir, f"kvpool-{TAG}-{os.getpid()}")  # an older server, alive, holding no lock
    other = plant(shm_dir, f"kvpool-{TAG}-{gone}-notanarena")
    os.symlink(dead, os.path.join(shm_dir, f"kvpool-{TAG}-{gone}-{'d' * 16}"))
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        found = shm.leftovers()
        assert sorted(d.name for d in found) == sorted(os.path.basename(p) for p in (old_layout, dead))
        assert all(d.pid == gone and d.size == 8192 and d.resident >= 8192 for d in found)
        removed = shm.remove_leftovers()
        assert sorted(d.name for d in removed) == sorted(d.name for d in found)
        assert not os.path.exists(dead) and not os.path.exists(old_layout)
        for path in (live.path, held, running_old, other):
            assert os.path.exists(path), path
    finally:
        os.close(holder)
        live.close()
    # Its holder let go: a leftover now. The live arena's server closed it without unlinking,
    # but its pid (ours) is alive: it stays.
    assert [d.name for d in shm.leftovers()] == [os.path.basename(held)]


def test_doctor_reports_leftovers_with_their_memory(shm_dir):
    plant(shm_dir, f"kvpool-{TAG}-{dead_pid()}-{'a' * 16}", size=3 << 20)
    report = Report()
    check_leftover_arenas(report)
    (finding,) = report.findings
    assert finding.level == "warning" and "1 arena(s)" in finding.what and "3.0MB" in finding.what
    shm.remove_leftovers()
    report = Report()
    check_leftover_arenas(report)
    assert report.findings == []


def test_a_server_removes_the_arena_of_a_killed_server_of_another_socket(start_server, sock_dir):
    killed = start_server(socket_path=os.path.join(sock_dir, "a.sock"))
    live = start_server(socket_path=os.path.join(sock_dir, "b.sock"))
    (killed_arena,) = shm.arena_names(killed.socket_path)
    (live_arena,) = shm.arena_names(live.socket_path)
    killed.kill()
    assert killed_arena in {d.name for d in shm.leftovers()}
    assert live_arena not in {d.name for d in shm.leftovers()}
    start_server(socket_path=os.path.join(sock_dir, "c.sock"))
    assert shm.arena_names(killed.socket_path) == []
    assert shm.arena_names(live.socket_path) == [live_arena]
