"""Client processes for the server tests (run as scripts: they get killed, stopped and raced).

    srvworker.py hang-put SOCKET KEY SIZE       allocate, write half, wait for "commit" on stdin
    srvworker.py writer SOCKET SEED SECONDS NKEYS
    srvworker.py reader SOCKET SEED SECONDS NKEYS fast|slow

writer/reader print one JSON line of counts when done.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter

import numpy as np
from srvutil import payload, payload_ok, size_of

from kvpool.errors import ErrorCode
from kvpool.server.client import PoolClient


def hang_put(sock: str, key: str, size: int) -> None:
    client = PoolClient(sock, "hang-put")
    reply = client.allocate([key], [size])
    assert reply.codes == [0], reply
    handle, offset = reply.handles[0], reply.offsets[0]
    arena = client.arena
    assert arena is not None
    data = payload(key, size)
    arena[offset : offset + size // 2] = data[: size // 2]  # a partial copy: must never be visible
    print(f"ALLOCATED {handle} {offset}", flush=True)
    sys.stdin.readline()
    print(f"COMMIT {client.commit([handle])[0]}", flush=True)
    client.close()


def writer(sock: str, seed: int, seconds: float, nkeys: int) -> None:
    rng = random.Random(seed)
    client = PoolClient(sock, f"writer{seed}")
    cache = {i: payload(f"k{i}", size_of(i)) for i in range(nkeys)}
    counts: Counter[str] = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        idx = rng.sample(range(nkeys), 8)
        keys = [f"k{i}" for i in idx]
        # Two segments per value, as a block is several layer segments in vLLM.
        values = [[cache[i][: size_of(i) // 3], cache[i][size_of(i) // 3 :]] for i in idx]
        for code in client.put(keys, values):
            counts[ErrorCode(code).name] += 1
    client.close()
    print(json.dumps(counts), flush=True)


def reader(sock: str, seed: int, seconds: float, nkeys: int, mode: str) -> None:
    rng = random.Random(seed)
    client = PoolClient(sock, f"reader{seed}")
    counts: Counter[str] = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        idx = rng.sample(range(nkeys), 8 if mode == "fast" else 4)
        keys = [f"k{i}" for i in idx]
        if mode == "fast":
            found = client.exists(keys, lease=True)  # as vLLM's scheduler looks up before loading
            counts["lookup_hits"] += sum(found)
            outs = [np.zeros(size_of(i), dtype=np.uint8) for i in idx]
            codes = client.get_into(keys, [[o[:100], o[100:]] for o in outs])
            for key, out, code in zip(keys, outs, codes):
                counts[ErrorCode(code).name] += 1
                if code == 0 and not payload_ok(key, out):
                    counts["WRONG"] += 1
        else:
            slow_read(client, keys, idx, rng, counts)
    client.close()
    print(json.dumps(counts), flush=True)


def slow_read(client: PoolClient, keys: list[str], idx: list[int], rng: random.Random, counts: Counter[str]) -> None:
    """acquire -> sleep up to 2x the lease TTL -> copy -> release: leases expire under eviction."""
    reply = client.acquire(keys)
    info = client.server_info
    arena = client.arena
    if not hasattr(reply, "codes") or info is None or arena is None:
        counts["RPC_FAIL"] += len(keys)
        return
    time.sleep(rng.uniform(0, 2 * info.lease_ttl_ms / 1000))
    leased = []
    for key, code, lease_id, offset, size, data in zip(
        keys, reply.codes, reply.lease_ids, reply.offsets, reply.sizes, reply.data
    ):
        if code != 0:
            counts[ErrorCode(code).name] += 1
            continue
        if offset == -1:
            out = np.frombuffer(data, dtype=np.uint8).copy()
            counts["OK"] += 1
            counts["WRONG"] += not payload_ok(key, out)
            continue
        leased.append((key, lease_id, arena[offset : offset + size].copy()))
    if not leased:
        return
    for (key, _, out), code in zip(leased, client.release([lid for _, lid, _ in leased])):
        counts[ErrorCode(code).name] += 1
        if code == 0:
            counts["WRONG"] += not payload_ok(key, out)
        elif not payload_ok(key, out):
            counts["expired_and_overwritten"] += 1  # a race the lease check caught


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "hang-put":
        hang_put(args[0], args[1], int(args[2]))
    elif cmd == "writer":
        writer(args[0], int(args[1]), float(args[2]), int(args[3]))
    elif cmd == "reader":
        reader(args[0], int(args[1]), float(args[2]), int(args[3]), args[4])
    else:
        raise SystemExit(f"unknown command {cmd}")
