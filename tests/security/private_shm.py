"""One /dev/shm attack, run inside a private mount and pid namespace (test_shm.py starts it there).

`private_shm.py SCENARIO TMPDIR ATTACKER_UID` runs with a tmpfs of its own at /dev/shm (the
host's is never touched) and prints one JSON object: what the victim (this process, a pool
client as a vLLM worker is one, and the server it starts) saw.

- `full`: another user fills /dev/shm after the server started; the client then puts and gets
  as much as the arena holds.
- `squat`: another user first creates every arena name the server's pid could give it under
  the old naming scheme (`kvpool-<socket tag>-<pid>`), mode 0666; then the server starts.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from kvpool.server import shm
from kvpool.server.client import PoolClient
from kvpool.testing.launch import PoolServer

MiB = 1 << 20


def as_attacker(uid: int, action) -> None:
    """Run `action` in a child process with the attacker's uid (and no groups); wait for it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def fill_shm() -> None:
    """Write a file into /dev/shm until the mount is full."""
    chunk = b"\xff" * MiB
    with open(os.path.join(shm.SHM_DIR, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def full(tmp: str, uid: int) -> dict:
    sock = os.path.join(tmp, "pool.sock")
    with PoolServer(sock, memory_size="16MB", log_path=os.path.join(tmp, "pool.log")):
        client = PoolClient(sock, name="victim")
        as_attacker(uid, fill_shm)
        free = os.statvfs(shm.SHM_DIR).f_bavail
        keys = [f"k{i}" for i in range(12)]
        values = [np.full(MiB, i, np.uint8) for i in range(12)]
        put = client.put(keys, [[v] for v in values])
        out = [np.zeros(MiB, np.uint8) for _ in keys]
        got = client.get_into(keys, [[o] for o in out])
        client.close()
    return {"free_blocks_after_fill": free, "put": [int(c) for c in put], "get": [int(c) for c in got],
            "equal": all((o == v).all() for o, v in zip(out, values))}


def squat(tmp: str, uid: int) -> dict:
    sock = os.path.join(tmp, "pool.sock")
    tag = shm.socket_tag(sock)

    def create_names() -> None:
        for pid in range(2, 3000):
            fd = os.open(os.path.join(shm.SHM_DIR, f"kvpool-{tag}-{pid}"), os.O_CREAT | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)
            os.close(fd)

    as_attacker(uid, create_names)
    squatted = len(os.listdir(shm.SHM_DIR))
    with PoolServer(sock, memory_size="4MB", log_path=os.path.join(tmp, "pool.log")) as server:
        client = PoolClient(sock, name="victim")
        value = np.full(4096, 7, np.uint8)
        put = client.put(["k"], [[value]])
        out = np.zeros(4096, np.uint8)
        got = client.get_into(["k"], [[out]])
        arena = client.server_info.arena_name
        client.close()
        pid = server.pid
    return {"squatted": squatted, "server_pid": pid, "arena": arena, "put": [int(c) for c in put],
            "get": [int(c) for c in got], "equal": bool((out == value).all())}


if __name__ == "__main__":
    scenario, tmp, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps({"full": full, "squat": squat}[scenario](tmp, uid)), flush=True)
