"""Wire protocol between `kvpool server` and its clients: metadata only, never payloads.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Every message is
a msgspec Struct tagged with its name, encoded as an array (compact, and cheap to decode). The
client sends one request and waits for its reply; there is no pipelining, so replies need no
request ids.

Payload bytes travel through the shared-memory arena: the server hands out offsets
(`AllocateReply`, `AcquireReply`) and the client copies with its own mapping. The one exception
is an object the server had to serve from its disk tier without room to promote it into the
arena: its bytes come inline in `AcquireReply.data`.

Limits are enforced by the decoder (`msgspec.Meta`), so a hostile or buggy frame is rejected
as a whole before the engine sees any of it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Annotated, Union

import msgspec

from kvpool.store.controls import MAX_PIN_S

# 2 added Lookup. A server speaks every version in SUPPORTED_VERSIONS (a client that says 1
# never sends Lookup); a client speaks PROTOCOL_VERSION, so servers are upgraded first.
PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})

HEADER = struct.Struct("!I")
# Requests carry keys and numbers only. A client splits a batch so that its keys take at most
# MAX_REQUEST_KEY_BYTES (UTF-8) and MAX_BATCH items, which with each item's numbers stays under
# MAX_REQUEST_FRAME; a server reads a frame only as fast as its bytes arrive (`recv_frame`).
MAX_REQUEST_FRAME = 16 << 20
MAX_REQUEST_KEY_BYTES = 8 << 20
# Before its Hello a peer is unknown: its frame is a Hello (a name of at most MAX_NAME characters
# and two ints), so a few KiB is plenty and an idle stranger costs no more than that.
MAX_HELLO_FRAME = 4096
# Replies may carry disk-served payloads inline (bounded by MAX_INLINE_BYTES) plus metadata.
MAX_REPLY_FRAME = 1 << 30
MAX_INLINE_BYTES = 256 << 20
MAX_KEY_BYTES = 4096
MAX_BATCH = 4096
MAX_NAME = 256

Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)]
Ids = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class Message(msgspec.Struct, tag=True, array_like=True, forbid_unknown_fields=True):
    """Base of every frame's body; the tag (class name) selects the type."""


# ---- requests ---------------------------------------------------------------------------


class Hello(Message):
    """First message on a connection; nothing else is accepted before it."""

    client_name: Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
    pid: Annotated[int, msgspec.Meta(ge=0)]
    version: int = PROTOCOL_VERSION
    # A random id the client process drew: tells apart processes of other PID namespaces that
    # report the same pid (identical containers), where the kernel gives the server no pid.
    process: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Ping(Message):
    """Liveness heartbeat (every request counts as one; this is for idle clients)."""


class Exists(Message):
    keys: Keys
    lease: bool = False


class Lookup(Message):
    """`Exists` with a lease: which keys are stored, each in-memory hit's lookup lease handed
    back (`Looked`). The scheduler looks up, and the load that follows copies under those
    leases, so it needs no `Acquire` round trip. A lookup lease is one per object and client,
    extended by each lookup; `Release` only checks it, and it keeps the hit from eviction until
    its TTL, for every request that looked the key up."""

    keys: Keys


class Allocate(Message):
    """Reserve room for each key (two-phase put, step 1)."""

    keys: Keys
    sizes: Annotated[list[Size], msgspec.Meta(max_length=MAX_BATCH)]


Checksums = Annotated[list[Union[Annotated[int, msgspec.Meta(ge=0)], None]], msgspec.Meta(max_length=MAX_BATCH)]


class Commit(Message):
    """Publish allocations this connection made (step 3, after the copy), each with the
    checksum of the bytes the client copied in (`store.buffers.checksum`; None: unchecked)."""

    handles: Ids
    checksums: Checksums = []


class Abort(Message):
    """Give back allocations this connection made without publishing them."""

    handles: Ids


class Acquire(Message):
    """Lease each key for reading."""

    keys: Keys


class Release(Message):
    """End leases, reporting per lease whether the copy made under it is trustworthy. A lookup
    lease (`Lookup`) is only checked: it protects its hit until its TTL, for every request
    that looked the key up.
    ``corrupt``: those of them whose copy did not match its checksum; the server checks each
    object itself and drops it if its arena bytes are damaged."""

    lease_ids: Ids
    corrupt: Ids = []


class Remove(Message):
    keys: Keys


class Pin(Message):
    """Keep these objects in memory for ``ttl_s`` seconds (a request's ``pin_s``); the answer is
    a code per key (`kvpool.store.controls`)."""

    keys: Keys
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_PIN_S)]


class TakeDrops(Message):
    """The keys that left the pool since this connection last asked (the first ask starts the
    feed for it: an empty answer)."""


class GetStats(Message):
    """Engine counters plus server facts (clients, arena, uptime)."""


Request = Union[Hello, Ping, Exists, Lookup, Allocate, Commit, Abort, Acquire, Release, Remove, Pin, TakeDrops,
                GetStats]


# ---- replies ----------------------------------------------------------------------------


class HelloReply(Message):
    client_id: str
    arena_name: str  # file name under /dev/shm
    arena_size: int
    lease_ttl_ms: int
    client_ttl_s: float
    server_pid: int
    version: int = PROTOCOL_VERSION


class Codes(Message):
    """One Mooncake code per item of the request (0 = OK)."""

    codes: list[int]


class Found(Message):
    found: list[bool]


class Looked(Message):
    """Per key of a `Lookup`: found or not; for an in-memory hit its lease id (0: found but not
    leased, e.g. only on disk or refused by the quotas), arena offset, size and the checksum
    its copy must have (None: its writer sent none)."""

    found: list[bool]
    lease_ids: list[int]
    offsets: list[int]
    sizes: list[int]
    checksums: list[Union[int, None]]


class Allocated(Message):
    """Per key: code, handle and arena offset (handle/offset 0 unless code is OK)."""

    codes: list[int]
    handles: list[int]
    offsets: list[int]


class Acquired(Message):
    """Per key: code, lease id, arena offset, size, and inline bytes for disk-served hits.

    A disk-served hit has offset -1, lease id 0 and its bytes in ``data``; it needs no release.
    """

    codes: list[int]
    lease_ids: list[int]
    offsets: list[int]
    sizes: list[int]
    data: list[Union[bytes, None]]
    # What each arena-served copy must hash to (None: its writer sent no checksum).
    checksums: list[Union[int, None]] = []


class Dropped(Message):
    keys: list[str]
    missed: bool = False  # some drops were lost: the asker fell behind by more than the server keeps


class StatsReply(Message):
    stats: dict[str, Union[int, float, str]]
    clients: list[dict[str, Union[int, float, str]]]


class Error(Message):
    """The request as a whole was rejected (malformed, unknown, out of order)."""

    code: int
    message: str


Reply = Union[HelloReply, Codes, Found, Looked, Allocated, Acquired, Dropped, StatsReply, Error]

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


class FrameError(Exception):
    """The byte stream is not a valid frame sequence; the connection cannot continue."""


def encode_frame(message: object) -> bytearray:
    """Length prefix and body in one buffer, so a frame goes out in one sendall.

    `message` is a `Message` here; the lookup channel (`kvpool.vllm.lookup`) frames plain
    msgpack values (a list of block hashes, a hit count) the same way."""
    buf = bytearray(HEADER.size)
    _encoder.encode_into(message, buf, HEADER.size)
    HEADER.pack_into(buf, 0, len(buf) - HEADER.size)
    return buf


def send_frame(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode_frame(message))


class FrameBudgetSpent(FrameError):
    """A frame needed more of the shared receive budget than was left (`FrameBudget`)."""


FRAME_DEADLINE = "frame not complete by its deadline"  # how a TimeoutError of `recv_frame` starts


class FrameBudget:
    """Bytes that the partly received frames of all connections may hold together (thread-safe).

    A server's receive buffer grows with the bytes that arrived, never to a length a peer only
    declared, and each growth is taken from this budget: peers that declare big frames and
    send a byte now and then cost what they sent, and all of them together at most the budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


_GROW_FROM = 64 << 10  # a budgeted buffer starts this large (or at the frame's size) and doubles


def _recv_exact(sock: socket.socket, n: int, first: bool = False,
                deadline: float | None = None, budget: FrameBudget | None = None) -> bytearray | None:
    """Read exactly n bytes. None on a clean EOF before the first byte of a frame.

    With ``deadline`` (time.monotonic()), the whole read must finish by then: a peer
    trickling one byte at a time cannot stretch a per-recv timeout. With ``budget`` the buffer
    grows (doubling) as bytes arrive, each growth taken from the budget and all of it given
    back on return: FrameError if the budget has no room.
    """
    taken = 0
    try:
        buf = bytearray(n if budget is None else 0)
        got = 0
        while got < n:
            if got == len(buf):  # budgeted: room for more only once what came fills the buffer
                more = min(n, max(_GROW_FROM, 2 * len(buf))) - len(buf)
                if not budget.take(more):
                    raise FrameBudgetSpent(f"the server's budget for partly received frames ({budget.limit} bytes) "
                                     f"is spent; frame of {n} bytes refused, retry later")
                taken += more
                buf.extend(bytes(more))
            got += _recv_some(sock, buf, got, n, first, deadline)
            if got == 0:
                return None
        return buf
    finally:
        if taken:
            budget.give(taken)


def _recv_some(sock: socket.socket, buf: bytearray, got: int, n: int, first: bool,
               deadline: float | None) -> int:
    """One recv into ``buf[got:]``: the bytes it read; 0 only at a clean EOF before a frame."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{FRAME_DEADLINE} ({got} of {n} bytes)")
        sock.settimeout(left)
    with memoryview(buf) as view:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"{FRAME_DEADLINE} ({got} of {n} bytes)") from None
    if k == 0:
        if first and got == 0:
            return 0
        raise FrameError(f"connection closed mid-frame ({got} of {n} bytes)")
    return k


def recv_frame(sock: socket.socket, max_size: int, deadline: float | None = None,
               frame_timeout_s: float | None = None, budget: FrameBudget | None = None) -> bytearray | None:
    """The body of the next frame, or None if the peer closed between frames.

    Raises FrameError for a length over ``max_size``, a truncated frame or a spent ``budget``
    (see `_recv_exact`); socket timeouts and OSErrors propagate. ``deadline`` (time.monotonic())
    bounds the whole frame, not each recv; ``frame_timeout_s`` bounds the body from the moment its
    length arrived (the socket's own timeout is back in force for the next frame).
    """
    header = _recv_exact(sock, HEADER.size, first=True, deadline=deadline)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > max_size:
        raise FrameError(f"frame of {length} bytes exceeds the limit of {max_size}")
    if frame_timeout_s is None:
        return _recv_exact(sock, length, deadline=deadline, budget=budget)
    idle = sock.gettimeout()
    body_deadline = time.monotonic() + frame_timeout_s
    body = _recv_exact(sock, length, deadline=body_deadline if deadline is None else min(deadline, body_deadline),
                       budget=budget)
    sock.settimeout(idle)
    return body
