"""Another user and /dev/shm: a full mount kills no client, a squatted name stops no server.

Each scenario runs in a private mount and pid namespace with a small tmpfs of its own at
/dev/shm (`unshare`), so the host's /dev/shm is never touched and the server's pids are small
and known; the attacker is the second uid of conftest.py. See private_shm.py for the scenarios.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.errors import ErrorCode

SCRIPT = Path(__file__).with_name("private_shm.py")
OK = int(ErrorCode.OK)


def run_private(scenario: str, tmp: Path, uid: int, shm_size: str) -> dict:
    unshare = shutil.which("unshare")
    assert unshare, "util-linux `unshare` is needed for the /dev/shm tests"
    mount = f"mount -t tmpfs -o size={shm_size},mode=1777 kvpool-test-shm /dev/shm"
    proc = subprocess.run(
        [unshare, "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c", f'{mount} && exec "$0" "$@"',
         sys.executable, str(SCRIPT), scenario, str(tmp), str(uid)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SCRIPT.parent)})
    assert proc.returncode == 0, (
        f"the victim died ({signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else
        f"exit {proc.returncode}", proc.stderr[-3000:], (tmp / "pool.log").read_text()[-2000:]
        if (tmp / "pool.log").exists() else "")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def private_tmp(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o700)
    return tmp_path


def test_a_full_dev_shm_kills_no_client(attacker, private_tmp):
    """The arena's pages are reserved when the server starts: another user filling /dev/shm
    afterwards leaves every page of it usable (a sparse arena: the client's put dies of SIGBUS)."""
    out = run_private("full", private_tmp, attacker.uid, "24m")
    assert out["free_blocks_after_fill"] == 0  # the attacker did fill the mount
    assert out["put"] == [OK] * 12 and out["get"] == [OK] * 12 and out["equal"]


def test_another_user_cannot_squat_the_arena_name(attacker, private_tmp):
    """Arena names carry a random part: names created first by another user (every pid's name
    under the old scheme) neither stop the server nor get mapped by anyone."""
    out = run_private("squat", private_tmp, attacker.uid, "32m")
    assert out["squatted"] >= 2998 and out["server_pid"] < 3000
    assert out["arena"].startswith("kvpool-") and out["arena"].count("-") == 3
    assert out["put"] == [OK] and out["get"] == [OK] and out["equal"]
