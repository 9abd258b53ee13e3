"""Hostile and broken peers: whatever arrives on the socket gets an error reply or a closed
connection, and the server keeps serving everyone else."""

from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from srvutil import arena_files, payload, socket_dir

from kvpool.errors import ErrorCode
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.server.client import PoolClient
from kvpool.testing.launch import PoolServer
from kvpool.testing.proc import wait_for

INVALID = int(ErrorCode.INVALID_PARAMS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = socket_dir(tmp_path_factory.mktemp("fuzz"))
    proc = PoolServer(os.path.join(d, "kvpool.sock"), memory_size="4MB", log_path=os.path.join(d, "server.log"),
                      extra_args=["--hello_timeout", "0.5", "--max-connections", "64"], startup_timeout_s=15.0).start()
    yield proc
    try:
        log = proc.log()
        assert proc.stop() == 0, log[-2000:]
        assert arena_files(proc.socket_path) == []
        # Every bad input above was handled on a planned path, not by the catch-all.
        assert "internal error" not in log and "Traceback" not in log, log[-4000:]
    finally:
        proc.kill()
        for name in arena_files(proc.socket_path):
            shm.unlink(name)


@pytest.fixture(scope="module")
def good(server):
    """A well-behaved client that must keep working throughout."""
    client = PoolClient(server.socket_path, "good", retry_interval_s=0.05)
    assert client.put(["good"], [[payload("good", 256)]]) == [0]
    yield client
    client.close()


def assert_still_serving(server: PoolServer, good: PoolClient) -> None:
    assert server.alive(), server.log()[-2000:]
    assert good.ping() == 0
    assert good.exists(["good"]) == [True]


def connect(server: PoolServer) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(server.socket_path)
    return s


def frame(body: bytes) -> bytes:
    return P.HEADER.pack(len(body)) + body


def hello() -> bytes:
    return bytes(P.encode_frame(P.Hello("fuzz", os.getpid())))


def exchange(server: PoolServer, data: bytes, close_write: bool = True) -> list[P.Message] | str:
    """Send ``data``, then read replies until the server closes. Returns the decoded replies, all of
    which must be valid frames; raises if the server neither answers nor closes."""
    s = connect(server)
    try:
        try:
            s.sendall(data)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us mid-send: an allowed answer
        replies = []
        while True:
            try:
                body = P.recv_frame(s, P.MAX_REPLY_FRAME)
            except ConnectionResetError:
                return replies
            if body is None:
                return replies
            replies.append(P.reply_decoder.decode(body))
    finally:
        s.close()


def request(s: socket.socket, message: P.Message | bytes) -> P.Message:
    s.sendall(message if isinstance(message, bytes) else bytes(P.encode_frame(message)))
    body = P.recv_frame(s, P.MAX_REPLY_FRAME)
    assert body is not None, "server closed the connection"
    return P.reply_decoder.decode(body)


# ---- specific cases ------------------------------------------------------------------------------


def test_garbage_bytes(server, good):
    replies = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(replies) == 1 and isinstance(replies[0], P.Error) and "exceeds the limit" in replies[0].message
    assert_still_serving(server, good)


def test_oversized_length_prefix(server, good):
    replies = exchange(server, hello() + b"\xff\xff\xff\xff" + b"x" * 100)
    assert isinstance(replies[0], P.HelloReply)
    assert isinstance(replies[1], P.Error) and replies[1].code == INVALID
    assert_still_serving(server, good)


def test_truncated_frames(server, good):
    replies = exchange(server, b"\x00\x00")  # half a header, then EOF
    assert [type(r) for r in replies] == [P.Error] and "mid-frame" in replies[0].message
    body = bytes(P.encode_frame(P.Exists(["a", "b"])))
    replies = exchange(server, hello() + body[:-3])  # header promises more than comes
    assert [type(r) for r in replies] == [P.HelloReply, P.Error]
    assert_still_serving(server, good)


def test_request_before_hello_and_bad_hello(server, good):
    replies = exchange(server, bytes(P.encode_frame(P.Ping())))
    assert len(replies) == 1 and isinstance(replies[0], P.Error) and "Hello" in replies[0].message
    replies = exchange(server, frame(msgspec.msgpack.encode(["Hello", "x", -5])))
    assert len(replies) == 1 and isinstance(replies[0], P.Error)
    replies = exchange(server, bytes(P.encode_frame(P.Hello("old", 1, version=99))))
    assert isinstance(replies[0], P.Error) and "version" in replies[0].message
    assert_still_serving(server, good)


def test_a_version_1_client_is_served(server, good):
    # Version 2 only added Lookup: a client of the version before it still works unchanged.
    replies = exchange(server, bytes(P.encode_frame(P.Hello("v1", 1, version=1)))
                       + bytes(P.encode_frame(P.Exists(["a"], True))))
    assert isinstance(replies[0], P.HelloReply) and isinstance(replies[1], P.Found)
    assert_still_serving(server, good)


def test_unknown_op_and_invalid_fields_keep_the_connection(server, good):
    s = connect(server)
    try:
        assert isinstance(request(s, hello()), P.HelloReply)
        cases = [
            frame(msgspec.msgpack.encode(["Frobnicate", 1, 2])),  # unknown message type
            frame(msgspec.msgpack.encode(["HelloReply", "a", "b", 1, 1, 1.0, 1, 1])),  # a reply, not a request
            bytes(P.encode_frame(P.Exists(["x" * (P.MAX_KEY_BYTES + 1)]))),  # oversized key
            frame(msgspec.msgpack.encode(["Exists", [""], False])),  # empty key
            frame(msgspec.msgpack.encode(["Exists", ["k"] * (P.MAX_BATCH + 1), False])),  # batch too big
            frame(msgspec.msgpack.encode(["Allocate", ["k"], [-1]])),  # negative size
            frame(msgspec.msgpack.encode(["Allocate", ["k"], [2**63]])),  # absurd size
            frame(msgspec.msgpack.encode(["Commit", [-3]])),
            frame(msgspec.msgpack.encode(["Exists", ["k"], False, "extra"])),
            frame(b"\xc1"),  # never-used msgpack byte
            frame(b""),
            bytes(P.encode_frame(P.Hello("again", 1))),  # a second Hello
        ]
        for case in cases:
            reply = request(s, case)
            assert isinstance(reply, P.Error) and reply.code == INVALID, (case[:40], reply)
        assert request(s, P.Allocate(["k1", "k2"], [10])) == P.Error(INVALID, "keys and sizes differ in length")
        # A size no arena holds is a per-key code, not a protocol error.
        assert request(s, P.Allocate(["big"], [1 << 40])).codes == [int(ErrorCode.NO_AVAILABLE_HANDLE)]
        assert request(s, P.Ping()) == P.Codes([0])  # the same connection still works
    finally:
        s.close()
    assert_still_serving(server, good)


def test_silent_clients_are_closed_after_the_hello_timeout(server, good):
    silent = [connect(server) for _ in range(10)]
    try:
        assert_still_serving(server, good)  # served while they sit there
        t0 = time.monotonic()
        for s in silent:
            # Told why, then closed by the server.
            reply = P.reply_decoder.decode(P.recv_frame(s, P.MAX_REPLY_FRAME))
            assert isinstance(reply, P.Error) and reply.code == int(ErrorCode.RPC_TIMEOUT)
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3
    finally:
        for s in silent:
            s.close()
    assert good.server_stats()[0]["handshake_timeouts"] >= len(silent)
    assert_still_serving(server, good)


def test_connections_beyond_the_limit_are_refused_politely(server, good):
    held = []
    try:
        while True:
            s = connect(server)
            held.append(s)
            try:
                s.sendall(hello())
            except BrokenPipeError:
                pass  # refused before we spoke: its error reply is already waiting
            body = P.recv_frame(s, P.MAX_REPLY_FRAME)
            reply = P.reply_decoder.decode(body) if body is not None else None
            if not isinstance(reply, P.HelloReply):
                # This process hits its per-process cap before the server's total one.
                assert isinstance(reply, P.Error) and "--max-connections" in reply.message
                break
            assert len(held) <= 64
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: good.ping() == 0, 3)
    assert_still_serving(server, good)


# ---- fuzz ------------------------------------------------------------------------------------------

TAGS = ["Hello", "Ping", "Exists", "Allocate", "Commit", "Abort", "Acquire", "Release", "Remove", "GetStats",
        "Bogus", ""]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64 - 1), st.floats(allow_nan=False),
                 st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(leaf, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=5), kids,
                                                                                     max_size=3), max_leaves=20)
structured = st.builds(lambda tag, rest: [tag, *rest], st.sampled_from(TAGS), st.lists(values, max_size=4))


def _body(obj) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError):
        return b"\xc0"


fuzz_settings = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


@fuzz_settings
@given(raw=st.binary(max_size=300))
def test_fuzz_raw_bytes(server, good, raw):
    exchange(server, raw)
    assert_still_serving(server, good)


@fuzz_settings
@given(bodies=st.lists(st.one_of(structured.map(_body), st.binary(max_size=64)), min_size=1, max_size=4),
       say_hello=st.booleans(), cut=st.integers(0, 8))
def test_fuzz_frames(server, good, bodies, say_hello, cut):
    data = (hello() if say_hello else b"") + b"".join(frame(b) for b in bodies)
    replies = exchange(server, data[: len(data) - cut] if cut else data)
    for reply in replies:
        assert isinstance(reply, (P.HelloReply, P.Error, P.Codes, P.Found, P.Allocated, P.Acquired, P.StatsReply))
    assert_still_serving(server, good)
