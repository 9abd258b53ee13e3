"""Fixtures for the trust-model tests: a second uid to attack with, and private directories.

The attacker is a real other user (`kvpool-attacker`, created with useradd when the tests run
as root): its code runs in a child process that drops to that uid before it starts, under the
system Python in isolated mode (stdlib only, nothing of kvpool), and reports what it achieved
as one JSON object on stdout. Without root there is no second uid: the attack tests skip, and
fail under CI=true (tests/conftest.py turns a skip there into a failure).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvpool import paths

ATTACKER = "kvpool-attacker"
# The attacker runs outside our virtualenv (under /root, which it may not read).
ATTACKER_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


@dataclass(frozen=True)
class Attacker:
    uid: int
    gid: int

    def _drop(self) -> None:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def start(self, code: str) -> subprocess.Popen[str]:
        """Run ``code`` as the attacker; it reads stdin and prints JSON (see ``finish``)."""
        return subprocess.Popen([ATTACKER_PYTHON, "-I", "-S", "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                env={"PATH": "/usr/bin:/bin"}, preexec_fn=self._drop)

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout_s: float = 20.0) -> dict[str, Any]:
        out, err = proc.communicate("", timeout=timeout_s)
        assert proc.returncode == 0, f"attacker code failed: {err}"
        return json.loads(out.strip().splitlines()[-1])

    def run(self, code: str, timeout_s: float = 20.0) -> dict[str, Any]:
        return self.finish(self.start(code), timeout_s)


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    # Idempotent across concurrent runs: a second useradd fails with "already exists" (9).
    proc = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 9):
        pytest.fail(f"useradd {ATTACKER} failed ({proc.returncode}): {proc.stderr}")
    return pwd.getpwnam(ATTACKER)


@pytest.fixture(scope="session")
def attacker() -> Attacker:
    """A second uid: created when running as root; skipped (failed under CI=true) otherwise."""
    if os.getuid() != 0:
        pytest.skip("the attack tests need a second uid: run them as root (they create "
                    f"the user {ATTACKER}) -- under CI=true this is a failure")
    if not os.access(ATTACKER_PYTHON, os.X_OK):
        pytest.fail(f"no system Python at {ATTACKER_PYTHON} for the attacker's code")
    entry = _ensure_user()
    assert entry.pw_uid != os.getuid()
    return Attacker(entry.pw_uid, entry.pw_gid)


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A directory the attacker can traverse (mode 0755, ours): where victim directories go."""
    path = tempfile.mkdtemp(prefix="kvsec", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fallback_base(shared_dir: str, monkeypatch) -> str:
    """The runtime directory's base without XDG_RUNTIME_DIR, in a /tmp-like directory of this
    test (sticky, writable by all), never the real /tmp."""
    base = os.path.join(shared_dir, "tmp")
    os.mkdir(base)
    os.chmod(base, 0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(paths, "FALLBACK_BASE", base)
    return base
