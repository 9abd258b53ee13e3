"""Hostile client processes for tests/server/test_fair_sharing.py (quotas are per client process,
so the attacker must be another process than the test's own clients).

    hostile.py pin SOCKET NKEYS SIZE SECONDS INTERVAL   store NKEYS keys, then re-lease them all
                                                        (lookup and read leases, never released)
                                                        every INTERVAL seconds for SECONDS
    hostile.py hoard SOCKET SIZE                        allocate SIZE-byte ranges, never commit,
                                                        until refused
    hostile.py conns SOCKET N                           open N connections and keep them

Each prints READY (and for hoard a JSON line of what it got), then waits for a line on stdin
(pin: until SECONDS pass) and exits.
"""

from __future__ import annotations

import json
import sys
import time

from srvutil import payload

from kvpool.server.client import PoolClient


def pin(sock: str, nkeys: int, size: int, seconds: float, interval: float) -> None:
    client = PoolClient(sock, "hostile-pin")
    keys = [f"pin{i}" for i in range(nkeys)]
    codes = client.put(keys, [[payload(k, size)] for k in keys])
    assert all(c == 0 for c in codes), codes
    print("READY", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        client.exists(keys, lease=True)
        client.acquire(keys)  # read leases it never releases
        time.sleep(interval)
    print("DONE", flush=True)
    sys.stdin.readline()
    client.close()


def hoard(sock: str, size: int) -> None:
    client = PoolClient(sock, "hostile-hoard")
    got, codes = 0, []
    for i in range(1024):
        reply = client.allocate([f"hoard{i}"], [size])
        codes.append(reply.codes[0])
        if reply.codes[0] != 0:
            break
        got += size
    print("READY", flush=True)
    print(json.dumps({"allocated": got, "last_code": codes[-1]}), flush=True)
    sys.stdin.readline()
    client.close()


def conns(sock: str, n: int) -> None:
    clients = [PoolClient(sock, f"hostile-conn{i}", ping=True) for i in range(n)]
    deadline = time.monotonic() + 1.5  # refused ones keep retrying: do not wait on each in turn
    while time.monotonic() < deadline and not all(c.connected for c in clients):
        time.sleep(0.05)
    connected = sum(c.connected for c in clients)
    print("READY", flush=True)
    print(json.dumps({"connected": connected}), flush=True)
    sys.stdin.readline()
    for c in clients:
        c.close()


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "pin":
        pin(args[0], int(args[1]), int(args[2]), float(args[3]), float(args[4]))
    elif cmd == "hoard":
        hoard(args[0], int(args[1]))
    elif cmd == "conns":
        conns(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown command {cmd}")
