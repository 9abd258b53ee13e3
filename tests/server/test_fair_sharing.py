"""Fair sharing in `kvpool server`: each attack a hostile client can mount on a shared pool, run
against a real server, with the outcome asserted through codes and counters: other clients
are still served, and the attacker keeps no more than its quota."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import argparse

import numpy as np
import pytest
from srvutil import arena_files, payload, payload_ok

from kvpool.errors import ConfigError, ErrorCode
from kvpool.server import daemon
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.server.client import PoolClient
from kvpool.testing.proc import expect, wait_for

OK = 0
MiB = 1 << 20
HOSTILE = str(Path(__file__).resolve().parent / "hostile.py")


def spawn(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, HOSTILE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def finish(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
    except OSError:
        pass
    try:
        proc.wait(1)
    except subprocess.TimeoutExpired:  # e.g. still pinning: an attacker need not be polite
        proc.kill()
        proc.wait()


def held_by(client, pid: int) -> int:
    _, clients = client.server_stats()
    return max([c["held_bytes"] for c in clients if c["pid"] == pid] or [0])


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def read_reply(s: socket.socket) -> P.Message | None:
    body = P.recv_frame(s, P.MAX_REPLY_FRAME)
    return None if body is None else P.reply_decoder.decode(body)


# ---- the settings ---------------------------------------------------------------------------


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    daemon.add_arguments(parser)
    return daemon.config_from_args(parser.parse_args(list(argv)))


def test_quota_flags_parse_and_are_bounded():
    cfg = parse("--client_max_hold", "2m", "--client-pool-share", "0.25", "--client_max_leases", "1000",
                "--max_connections_per_client", "4", "--max-handshakes", "8")
    assert (cfg.client_max_hold_s, cfg.client_pool_share, cfg.client_max_leases) == (120.0, 0.25, 1000)
    assert (cfg.max_connections_per_client, cfg.max_handshakes) == (4, 8)
    defaults = parse()
    assert (defaults.client_pool_share, defaults.client_max_leases, defaults.client_max_hold_s) == (0.5, 1 << 18, 120.0)
    for flag, value in [("--client_pool_share", "0"), ("--client_pool_share", "1.5"), ("--client_max_leases", "-1"),
                        ("--max_handshakes", "0"), ("--client_max_hold", "-1")]:
        with pytest.raises(ConfigError) as exc:
            parse(flag, value)
        assert exc.value.key == flag.replace("_", "-")  # named as --help shows it, whatever the spelling


# ---- pinning the pool with leases ---------------------------------------------------------------


def test_re_taken_leases_pin_at_most_the_share_and_let_go_after_the_hold_limit(start_server, make_client):
    start_server("--default_kv_lease_ttl", "1000", "--client_max_hold", "2", "--client_pool_share", "0.5")
    victim = make_client(name="victim")
    cap = victim.server_stats()[0]["memory_capacity"]
    # 14 of 16 MiB stored by the attacker, every key re-leased (lookup + unreleased read) every 0.2 s.
    hostile = spawn("pin", victim.socket_path, "14", str(MiB - 4096), "8", "0.2")
    try:
        assert wait_for(lambda: held_by(victim, hostile.pid) > 0, 3)
        assert held_by(victim, hostile.pid) <= cap // 2  # never more than its share pinned
        # The victim is served meanwhile: the attacker's unpinned half makes room.
        keys = [f"v{i}" for i in range(5)]
        assert victim.put(keys, [[payload(k, MiB - 4096)] for k in keys]) == [OK] * 5
        outs = [np.zeros(MiB - 4096, np.uint8) for _ in keys]
        assert victim.get_into(keys, [[o] for o in outs]) == [OK] * 5
        assert all(payload_ok(k, o) for k, o in zip(keys, outs))
        # Renewing forever does not pin forever: past --client_max_hold (plus one lease TTL for
        # the last renewal to lapse) the attacker pins nothing for a TTL.
        assert wait_for(lambda: held_by(victim, hostile.pid) == 0, 6, interval=0.05)
        more = [f"w{i}" for i in range(12)]
        codes = victim.put(more, [[payload(k, MiB - 4096)] for k in more])
        assert codes.count(OK) >= 10, codes  # nearly the whole pool, attacker evicted
        stats = victim.server_stats()[0]
        assert stats["hold_limit_hits"] > 0 and stats["unpinned_leases"] > 0
    finally:
        finish(hostile)


# ---- pinning the pool with uncommitted allocations ---------------------------------------------------


def test_uncommitted_allocations_stop_at_the_share(start_server, make_client):
    start_server("--client_pool_share", "0.5", "--put_timeout", "30")
    victim = make_client(name="victim")
    cap = victim.server_stats()[0]["memory_capacity"]
    hostile = spawn("hoard", victim.socket_path, str(MiB))
    try:
        got = json.loads(hostile.stdout.readline())
        assert 0 < got["allocated"] <= cap // 2
        assert got["last_code"] == int(ErrorCode.NO_AVAILABLE_HANDLE)  # told: over quota
        assert held_by(victim, hostile.pid) <= cap // 2
        assert victim.server_stats()[0]["quota_refusals"] >= 1
        # Not 100% of the pool for put_timeout: the victim's puts go through right now.
        keys = [f"v{i}" for i in range(6)]
        assert victim.put(keys, [[payload(k, MiB)] for k in keys]) == [OK] * 6
    finally:
        finish(hostile)
    # Its allocations go with its connection.
    assert wait_for(lambda: victim.server_stats()[0]["pending_allocations"] == 0, 5)


# ---- locking everyone out with connections ------------------------------------------------------------


def test_idle_strangers_cannot_lock_clients_out(start_server, make_client):
    server = start_server("--max_connections", "8", "--max_handshakes", "4", "--hello_timeout", "30")
    idle = [raw_connect(server.socket_path) for _ in range(16)]  # never say Hello
    try:
        client = make_client(name="late", connect_timeout_s=2.0)
        assert client.wait_connected(5)
        assert client.ping() == OK
        # The oldest strangers were told why, then closed.
        evicted = 0
        for s in idle[:8]:
            reply = read_reply(s)
            assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
            assert "--max-handshakes" in reply.message
            evicted += 1
        stats = client.server_stats()[0]
        assert stats["evicted_handshakes"] >= evicted and stats["pending_handshakes"] <= 4
    finally:
        for s in idle:
            s.close()


def test_one_process_cannot_take_every_connection(start_server, make_client):
    server = start_server("--max_connections", "20", "--max_connections_per_client", "4")
    hostile = spawn("conns", server.socket_path, "10")
    try:
        assert json.loads(hostile.stdout.readline())["connected"] == 4
        victim = make_client(name="victim")
        assert victim.wait_connected(5) and victim.ping() == OK
        stats = victim.server_stats()[0]
        assert stats["refused_connections"] >= 6 and stats["connected_clients"] == 5
    finally:
        finish(hostile)
    # A refused client is told why before the close.
    mine = [make_client(name=f"mine{i}") for i in range(3)]  # with victim: 4 for this process
    assert all(c.wait_connected(5) for c in mine)
    s = raw_connect(server.socket_path)
    try:
        # The kernel's pid counts, not what the client says: a process id of its own buys nothing.
        P.send_frame(s, P.Hello("one-too-many", os.getpid(), process="another-process"))
        reply = read_reply(s)
        assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
        assert "--max-connections-per-client" in reply.message
    finally:
        s.close()


def _in_new_pid_namespace(*argv: str, **kwargs) -> subprocess.Popen:
    """`argv` as pid 1 of a PID namespace of its own, as in a container or pod (SIGKILLed if
    the `unshare` around it dies first)."""
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *argv], **kwargs)


def _stop_namespaced(proc: subprocess.Popen) -> None:
    """SIGTERM to the namespace's pid 1 itself (`unshare` passes no signal on), then wait."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        os.kill(int(child), signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _accepts(path: str) -> bool:
    try:
        raw_connect(path).close()
        return True
    except OSError:
        return False


def test_quotas_tell_apart_identical_containers(sock_dir, sock_path):
    """A server in its own PID namespace (a host-pool pod) gets no pid from the kernel for
    clients of other namespaces (vLLM pods), and each of those reports pid 1, as identical
    containers do. Each must still be a process of its own: with one connection allowed per
    process, both connect, and the server lists two owners, not one."""
    log = open(os.path.join(sock_dir, "server.log"), "w")
    server = _in_new_pid_namespace(sys.executable, "-m", "kvpool.server.daemon", "--socket", sock_path,
                                   "--memory-size", "16MB", "--max_connections_per_client", "1",
                                   stdout=log, stderr=subprocess.STDOUT)
    pods: list[subprocess.Popen] = []
    try:
        expect(lambda: _accepts(sock_path), "the namespaced server's socket", timeout=15)
        for _ in range(2):
            pods.append(_in_new_pid_namespace(sys.executable, HOSTILE, "conns", sock_path, "1",
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for pod in pods:
            assert pod.stdout.readline().strip() == "READY"
            assert json.loads(pod.stdout.readline())["connected"] == 1
        observer = PoolClient(sock_path, "observer")
        try:
            stats, clients = observer.server_stats()
        finally:
            observer.close()
        pods_seen = [c for c in clients if c["name"].startswith("hostile")]
        assert [c["pid"] for c in pods_seen] == [0, 0]  # the kernel could not say: the premise holds
        assert len({c["owner"] for c in pods_seen}) == 2 and all(c["owner"].startswith("pid:1@") for c in pods_seen)
        assert stats["refused_connections"] == 0
    finally:
        for pod in pods:
            finish(pod)
        _stop_namespaced(server)
        log.close()
        for name in arena_files(sock_path):
            shm.unlink(name)


# ---- what a stranger costs before its handshake -------------------------------------------------------


def test_handshake_frames_are_small(start_server, make_client):
    server = start_server()
    s = raw_connect(server.socket_path)
    try:
        s.sendall(P.HEADER.pack(16 << 20))  # a 16 MiB "Hello": refused before any buffer is made
        reply = read_reply(s)
        assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.INVALID_PARAMS)
        assert str(P.MAX_HELLO_FRAME) in reply.message
        assert s.recv(1) == b""
    finally:
        s.close()
    assert make_client().ping() == OK


def test_a_trickled_handshake_does_not_extend_the_deadline(start_server, make_client):
    server = start_server("--hello_timeout", "1")
    s = raw_connect(server.socket_path)
    t0 = time.monotonic()
    try:
        s.sendall(P.HEADER.pack(200))
        closed = False
        for _ in range(60):  # one byte per 0.1 s: 6 s if every byte reset the timeout
            try:
                s.sendall(b"\x90")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
            s.setblocking(False)
            try:
                data = s.recv(1 << 16, socket.MSG_PEEK)
            except BlockingIOError:
                data = None
            finally:
                s.setblocking(True)
            if data is not None:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 4  # generous: the deadline is 1 s from accept
        s.settimeout(5)
        reply = read_reply(s)
        assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.RPC_TIMEOUT)
    finally:
        s.close()
    client = make_client()
    assert client.server_stats()[0]["handshake_timeouts"] >= 1


# ---- CPU: many leases on one key --------------------------------------------------------------------------


def test_thousands_of_leases_on_one_key_cost_linear_work(start_server, make_client):
    start_server()
    c = make_client(name="leaser")
    assert c.put(["hot"], [[payload("hot", 4096)]]) == [OK]
    base = c.server_stats()[0]["lease_ops"]
    for round_ in range(4):
        reply = c.acquire(["hot"] * P.MAX_BATCH)  # 4096 leases per request, never released
        assert reply.codes == [OK] * P.MAX_BATCH
    stats = c.server_stats()[0]
    assert stats["leases"] >= 4 * P.MAX_BATCH
    # A constant number of bookkeeping steps per lease (quadratic pruning would be ~n/2 each).
    assert stats["lease_ops"] - base <= 3 * 4 * P.MAX_BATCH


# ---- heap: long keys ---------------------------------------------------------------------------------------


def test_long_keys_are_charged_to_the_memory_budget(start_server, make_client):
    start_server()
    c = make_client()
    used = c.server_stats()[0]["memory_used"]
    keys = [f"{i:04d}".ljust(4000, "k") for i in range(200)]
    assert c.put(keys, [[np.zeros(0, np.uint8)] for _ in keys]) == [OK] * len(keys)
    # Key bytes plus per-object overhead count, not just the 64-byte minimum reservation.
    assert c.server_stats()[0]["memory_used"] - used >= len(keys) * (4000 + 1024)
    # A key is bounded in bytes, not characters: 3000 two-byte characters are 6000 bytes.
    assert c.put(["é" * 3000], [[np.zeros(8, np.uint8)]]) == [int(ErrorCode.INVALID_KEY)]


def _anon_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_an_objects_heap_stays_under_what_it_is_charged(start_server, make_client):
    """The sizing rule (docs/server.md): the server's heap per object (its index entries and key,
    off the arena) is at most what the object is charged in the arena (1 KiB plus its key), so
    the heap is at most (heap / charge) of the memory tier whatever objects are stored."""
    server = start_server("--memory-size", "96MB")
    c = make_client()
    warm = [f"w{i:05d}".ljust(1024, "k") for i in range(2000)]  # the server's first allocations
    assert c.put(warm, [[np.zeros(1, np.uint8)] for _ in warm]) == [OK] * len(warm)
    before, used = _anon_rss(server.pid), c.server_stats()[0]["memory_used"]
    keys = [f"{i:06d}".ljust(1024, "k") for i in range(30000)]  # 1-byte values: heap is all they cost
    for i in range(0, len(keys), 2000):
        batch = keys[i:i + 2000]
        assert c.put(batch, [[np.zeros(1, np.uint8)] for _ in batch]) == [OK] * len(batch)
    heap = (_anon_rss(server.pid) - before) / len(keys)
    charged = (c.server_stats()[0]["memory_used"] - used) / len(keys)
    assert charged >= 1024 + 1024 and heap < charged, (heap, charged)


# ---- a connection handed over by the process that opened it -------------------------------------------------

# A child that opens a connection, says Hello, allocates, hands the socket over (SCM_RIGHTS) and exits.
HANDOFF = r"""
import os, socket, sys
from kvpool.server import protocol as P
path, back = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
s = socket.socket(socket.AF_UNIX)
s.connect(path)
s.sendall(P.encode_frame(P.Hello("child", os.getpid())))
P.recv_frame(s, P.MAX_REPLY_FRAME)
s.sendall(P.encode_frame(P.Allocate(["held-by-a-dead-child"], [1 << 20])))
P.recv_frame(s, P.MAX_REPLY_FRAME)
socket.send_fds(back, [b"x"], [s.fileno()])
"""


def test_a_connection_handed_to_another_process_ends_with_the_process_that_opened_it(start_server, make_client,
                                                                                      sock_path):
    """Quotas count against the process that opened a connection. Children that open
    connections, hand them over and exit would each be a fresh quota; instead a connection
    ends with its opener: what it held is freed, and its new holder gets nothing more through it."""
    start_server()
    good = make_client()
    mine, theirs = socket.socketpair()
    with mine, theirs:
        subprocess.run([sys.executable, "-c", HANDOFF, sock_path, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                       check=True, timeout=60)
        _, fds, _, _ = socket.recv_fds(mine, 16, 1)
    conn = socket.socket(fileno=fds[0])
    with conn:
        expect(lambda: good.server_stats()[0]["orphaned_connections"] == 1, "the handed-over connection closed")
        expect(lambda: good.server_stats()[0]["pending_allocations"] == 0, "the dead child's allocation freed")
        conn.settimeout(5)
        try:
            conn.sendall(P.encode_frame(P.Allocate(["stolen"], [1 << 20])))
            answer = P.recv_frame(conn, P.MAX_REPLY_FRAME)
        except OSError:
            answer = None
        assert answer is None
    assert good.ping() == OK


# ---- a connection that outlived its client TTL ------------------------------------------------------------


def test_a_connection_reaped_for_silence_still_counts_against_its_process(start_server, make_client):
    # A process stalled past --client_ttl (paused, swapping) keeps its connection open (the idle
    # timeout is longer) and is reaped by the engine meanwhile. Once it talks again its holdings
    # must still count against its process, or each such connection gets a share of its own.
    start_server("--client_ttl", "0.5", "--client_pool_share", "0.25", "--put_timeout", "30")
    awake = make_client(name="awake")  # pings: never reaped
    stalled = make_client(name="stalled", ping=False)
    cap = awake.server_stats()[0]["memory_capacity"]
    expect(lambda: awake.server_stats()[0]["reaped_clients"] >= 1, "the silent connection to be reaped")
    assert stalled.connected
    part = cap * 3 // 16  # each under the process's quarter, both together over it
    first = stalled.allocate(["s0"], [part])
    assert first.codes == [OK]
    second = awake.allocate(["a0"], [part])
    assert second.codes == [int(ErrorCode.NO_AVAILABLE_HANDLE)]
    assert held_by(awake, os.getpid()) >= part
