"""Request frames a client never finishes cost the server what arrived, for a bounded time, and a
client never sends a frame the server would refuse.

A peer past its Hello may declare a frame of up to MAX_REQUEST_FRAME bytes and then send a
byte now and then. The server's buffer grows with what arrived (never to the declared length),
all connections' partly received frames share `--frame_budget`, and a frame must be whole within
`--request-timeout` of its first byte.
"""

from __future__ import annotations

import os
import socket

import numpy as np
from srvutil import payload

from kvpool.errors import ErrorCode
from kvpool.server import protocol as P
from kvpool.testing.proc import wait_for

MiB = 1 << 20
OK = int(ErrorCode.OK)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def handshaken(sock_path: str, name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    s.sendall(P.encode_frame(P.Hello(name, os.getpid())))
    reply = P.reply_decoder.decode(P.recv_frame(s, P.MAX_REPLY_FRAME))
    assert isinstance(reply, P.HelloReply), reply
    return s


def declare(s: socket.socket, sent: int = 1) -> None:
    """Declare the largest request frame the server takes, then send only `sent` bytes of it (or
    until the server closes the connection)."""
    try:
        s.sendall(P.HEADER.pack(P.MAX_REQUEST_FRAME) + b"\x93" + bytes(sent - 1))
    except (BrokenPipeError, ConnectionResetError):
        pass


def answer(s: socket.socket) -> P.Message | None:
    """The server's last word on this connection: an Error frame, or None if it just closed."""
    try:
        body = P.recv_frame(s, P.MAX_REPLY_FRAME)
    except (ConnectionResetError, P.FrameError):
        return None
    return None if body is None else P.reply_decoder.decode(body)


def test_declared_frames_cost_what_arrived_not_what_they_declare(start_server, make_client, sock_path):
    server = start_server()
    good = make_client()
    assert good.put(["k"], [[payload("k", 4096)]]) == [OK]
    before = rss_bytes(server.pid)
    conns = [handshaken(sock_path, f"slow{i}") for i in range(15)]  # the per-process cap is 16
    try:
        for s in conns:
            declare(s)
        assert wait_for(lambda: good.ping() == OK, 5)
        grown = rss_bytes(server.pid) - before
        # 15 declared 16 MiB frames: 240 MiB if the server sized its buffers by the declaration.
        assert grown < 32 * MiB, grown
        assert good.exists(["k"]) == [True]
    finally:
        for s in conns:
            s.close()


def test_a_frame_not_whole_within_the_request_timeout_closes_its_connection(start_server, make_client, sock_path):
    start_server("--request_timeout", "0.5")
    good = make_client()
    s = handshaken(sock_path, "trickler")
    declare(s)
    reply = answer(s)  # bytes trickling in do not extend the deadline: it comes, whatever we send
    assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.RPC_TIMEOUT), reply
    assert "--request-timeout" in reply.message
    s.close()
    assert good.server_stats()[0]["request_timeouts"] == 1
    assert good.ping() == OK


def test_partly_received_frames_share_one_budget(start_server, make_client, sock_path):
    start_server("--frame_budget", "2MB")
    good = make_client()
    first, second = handshaken(sock_path, "big1"), handshaken(sock_path, "big2")
    try:
        declare(first, sent=900 << 10)  # its buffer grows to 1 MiB of the budget
        assert wait_for(lambda: good.server_stats()[0]["partial_frame_bytes"] == MiB, 5)
        declare(second, sent=1100 << 10)  # would need 2 MiB more: refused, connection closed
        reply = answer(second)
        assert isinstance(reply, P.Error) and "budget" in reply.message, reply
        stats = good.server_stats()[0]
        assert stats["frame_budget_refusals"] == 1 and stats["partial_frame_bytes"] == MiB
        assert good.ping() == OK and good.put(["after"], [[payload("after", 4096)]]) == [OK]
    finally:
        first.close()
        second.close()


def test_a_batch_of_maximal_keys_is_split_into_frames_the_server_takes(start_server, make_client):
    start_server("--memory-size", "64MB")
    client = make_client()
    keys = [f"{i:06d}".ljust(P.MAX_KEY_BYTES, "k") for i in range(P.MAX_BATCH)]  # 16 MiB of keys
    values = [[np.full(16, i % 251, np.uint8)] for i in range(P.MAX_BATCH)]
    assert client.put(keys, values) == [OK] * P.MAX_BATCH
    assert client.exists(keys) == [True] * P.MAX_BATCH
    assert client.exists(keys, lease=True) == [True] * P.MAX_BATCH
    out = [[np.zeros(16, np.uint8)] for _ in keys]
    assert client.get_into(keys, out) == [OK] * P.MAX_BATCH
    assert all((o[0] == v[0]).all() for o, v in zip(out, values))
    # Every key answered (the lookup's and the read's leases may still hold them), none RPC_FAIL.
    assert set(client.remove(keys)) <= {OK, int(ErrorCode.OBJECT_HAS_LEASE)}
