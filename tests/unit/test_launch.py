"""The launchers' lifecycle: what a stop leaves behind (`kvpool.testing.launch`).

The programs here are small Python scripts standing in for vLLM's process tree: a leader that
exits on SIGTERM and a child of its process group with clean-up of its own to finish (as
Python's resource tracker unlinks vLLM's shared memory after the API server exits), and an
OpenAI-server stand-in that answers `/health` and binds its IPC socket where vLLM would.
"""

from __future__ import annotations

import stat
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from kvpool.testing.launch import ChildProcess, OpenAIServer
from kvpool.testing.proc import group_alive

LEADER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, sys, time
    def term(*_):
        time.sleep(0.5)  # clean-up that outlasts the leader
        open(sys.argv[1], "w").write("cleaned")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    open(sys.argv[1] + ".up", "w").close()
    while True:
        time.sleep(0.05)
    ''', sys.argv[1]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.05)
""")

FAKE_OPENAI = textwrap.dedent("""
    import http.server, os, socket, sys, tempfile
    port = int(sys.argv[sys.argv.index("--port") + 1])
    rpc = socket.socket(socket.AF_UNIX)
    rpc.bind(os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", "/tmp"), f"ipc-{os.getpid()}"))  # left behind
    tempfile.NamedTemporaryFile(prefix="vllm_dist_", delete=False)  # a worker rendezvous file, left behind
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


class _Leader(ChildProcess):
    name = "leader"

    def __init__(self, marker: Path, script: Path) -> None:
        super().__init__([sys.executable, str(script), str(marker)], log_path=marker.parent / "leader.log",
                         stop_grace_s=10)
        self.marker = marker

    def _ready(self) -> bool:
        return Path(str(self.marker) + ".up").exists()


def test_stop_lets_the_process_group_finish_its_clean_up(tmp_path: Path) -> None:
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    marker = tmp_path / "cleaned"
    p = _Leader(marker, script).start()
    pgid = p.pid
    assert group_alive(pgid)
    assert p.stop() == 0
    # The child was not SIGKILLed the moment its leader exited: its clean-up ran to the end.
    assert marker.read_text() == "cleaned"
    assert not group_alive(pgid)


def _fake_python(tmp_path: Path) -> str:
    """An executable that runs FAKE_OPENAI with OpenAIServer's vLLM command line."""
    server = tmp_path / "fake_openai.py"
    server.write_text(FAKE_OPENAI)
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {server} \"$@\"\n")
    exe.chmod(0o700)
    return str(exe)


@pytest.mark.parametrize("given", [False, True])
def test_vllm_ipc_sockets_and_temp_files_live_in_a_private_directory_removed_at_stop(
        tmp_path: Path, given: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch sets it once it has used the cache
    chosen = tmp_path / "rpc"
    chosen.mkdir(mode=0o700)
    parent_tmp = tmp_path / "tmp"  # the launching process's temp directory
    parent_tmp.mkdir()
    env = {"VLLM_RPC_BASE_PATH": str(chosen)} if given else {"VLLM_RPC_BASE_PATH": ""}
    srv = OpenAIServer(tmp_path / "model", python=_fake_python(tmp_path), env={"TMPDIR": str(parent_tmp), **env},
                       log_path=tmp_path / "s.log", startup_timeout_s=30)
    for _ in range(2):  # a restart gets a directory again
        with srv:  # stopped on the way out, also when a check fails
            where = Path(srv.env["VLLM_RPC_BASE_PATH"])
            assert any(where.glob("ipc-*"))
            if given:
                assert where == chosen
            else:
                assert where.parent == Path(tempfile.gettempdir()) and where.name.startswith("kvpool-vllm-rpc-")
                assert stat.S_IMODE(where.stat().st_mode) == 0o700
            assert any(where.glob("vllm_dist_*")) and not any(parent_tmp.iterdir())
            # torch's compile cache does not move with the temp directory
            assert srv.env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(parent_tmp / "torchinductor_"))
        assert where.exists() == given
