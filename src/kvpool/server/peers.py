"""Who may talk to whom over `kvpool server`'s Unix socket: the kernel's word on the peer.

Both ends ask the kernel who is at the other end of the connection (SO_PEERCRED: the pid, uid
and gid of the process that connected or listened, recorded at that moment, so the peer cannot
lie about them). One pool is one trust domain: our own uid, plus, with group sharing, the users
of one explicitly allowed group (the peer's primary gid or one of its supplementary groups,
SO_PEERGROUPS where the kernel has it, else /proc/<pid>/status). See docs/security.md.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from dataclasses import dataclass

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python lacks the constant


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel recorded it."""

    pid: int
    uid: int
    gid: int

    def describe(self) -> str:
        return f"pid {self.pid}, uid {self.uid}, gid {self.gid}"


def peer_of(sock: socket.socket) -> Peer:
    """SO_PEERCRED of a connected Unix socket; OSError if the kernel cannot say."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return Peer(pid, uid, gid)


def _supplementary_groups(sock: socket.socket, peer: Peer) -> set[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        return set(array.array("I", raw[: len(raw) - len(raw) % 4]))
    except OSError:
        pass
    # Older kernels: the peer's groups now (the peer may have changed them since it connected;
    # only dropping groups is possible without privilege, so this errs on the safe side).
    try:
        with open(f"/proc/{peer.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def trusted(sock: socket.socket, peer: Peer, allowed_gid: int | None) -> bool:
    """Whether ``peer`` is in our trust domain: our uid, or a member of ``allowed_gid``."""
    if peer.uid == os.getuid():
        return True
    if allowed_gid is None:
        return False
    return peer.gid == allowed_gid or allowed_gid in _supplementary_groups(sock, peer)


def domain(allowed_gid: int | None) -> str:
    """The trust domain in words, for error messages."""
    own = f"uid {os.getuid()}"
    return own if allowed_gid is None else f"{own} or members of gid {allowed_gid}"
