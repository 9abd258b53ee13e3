"""Every `kvpool` subcommand, fed wrong flags, wrong values and unwritable paths, never crashes.

Each case runs `kvpool.cli.main.main(argv)` in a forked child (the parent imported every command
once, so a case costs a fork, not an interpreter start), its output in a file. A case passes
when the child ended without an uncaught exception and printed no traceback, whatever its exit
code: a value that is wrong for one command ("0" ports, "-1" counts) is fine for another. A case
whose command accepted everything and started working (a server, a proxy) is stopped after
`RUNNING_S` and passes the same way.

The base arguments of each command are valid but make it end quickly once every flag is checked
(a socket in a directory that cannot exist, a proxy host no interface has), so the values under
test decide how a case ends; the children run in a directory they cannot write (`/proc`), so a
relative path given for a socket or a file is refused rather than created here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvpool.cli.main import COMMANDS, build_parser

# Values tried for every flag that takes one (not a number, a negative number, past every float),
# and for a flag that takes a path, a path nobody can create.
BAD_VALUES = ("nope", "-1", "1e400")
UNWRITABLE = "/proc/kvpool-none/x"
PATH_WORDS = ("path", "socket", "file", "dir", "json", "plot", "config", "log", "url")
RUNNING_S = 3.0  # a case still running after this long accepted its input: stopped, passed
CRASHED = 99  # the child's exit code when main() raised


def _base(name: str, tmp: Path) -> list[str]:
    trace = tmp / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 256, "output_length": 4, "hash_ids": [1, 2]}\n')
    return {
        "server": ["--socket", "/proc/kvpool-none/pool.sock", "--global_segment_size", "4MB"],
        "stats": ["--socket", str(tmp / "no-server.sock"), "--count", "2"],
        "ctl": ["--url", "http://127.0.0.1:1", "usage"],
        "proxy": ["--host", "256.0.0.1", "--port", "0", "--instance-hosts", "127.0.0.1", "--instance-ports", "1"],
        "doctor": [],
        "plan": [str(trace), "--kv-bytes-per-token", "1KB", "--memory", "1GB", "--jobs", "1"],
        "build-model": [str(tmp / "model")],
        "version": [],
    }[name]


def _cases(name: str, base: list[str]) -> list[list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = [[name, *base, "--no-such-flag"], [name, *base, "--no-such-flag", "1"]]
    for action in sub.choices[name]._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings or action.nargs == 0:
            continue
        flag = action.option_strings[0]  # another spelling is the same action
        cases.append([name, *base, flag])  # the value missing
        cases += [[name, *base, flag, value] for value in BAD_VALUES]
        if any(w in f"{action.dest} {action.metavar or ''}".lower() for w in PATH_WORDS):
            cases.append([name, *base, flag, UNWRITABLE])
    return cases


def _run(argv: list[str], out: Path) -> tuple[int | str, str]:
    """(exit code, or "running" if stopped after RUNNING_S; what it printed)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = CRASHED
        try:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir("/proc")
            from kvpool.cli.main import main

            code = main(argv) or 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + RUNNING_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), out.read_text(errors="replace")
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "running", out.read_text(errors="replace")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_input_crashes_a_subcommand(name, tmp_path, monkeypatch):
    # What a command imports when it runs is imported once here, not in every child.
    for module in ("kvpool.proxy.app", "kvpool.server.daemon", "kvpool.plan.command"):
        importlib.import_module(module)
    # Environment that would point a command at real services or files stays out of the children.
    for var in [v for v in os.environ if v.startswith(("KVPOOL_", "MOONCAKE_"))]:
        monkeypatch.delenv(var)
    crashed = []
    for argv in _cases(name, _base(name, tmp_path)):
        code, output = _run(argv, tmp_path / "out.txt")
        if code == CRASHED or (isinstance(code, int) and code < 0) or "Traceback (most recent call last)" in output:
            crashed.append((argv, code, output.strip().splitlines()[-1:] if output.strip() else []))
    assert not crashed, crashed
