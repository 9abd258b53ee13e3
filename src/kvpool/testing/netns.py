"""Several "hosts" on one machine: Linux network namespaces on a private subnet.

Every other test runs its services on 127.0.0.1, where every address is every process's
address. A deployment across hosts differs in what that hides: which address a store client
advertises to its peers, whether a service bound to loopback can be reached at all, a
segment read from another machine. `VirtualNetwork` builds a small LAN to show those: one
bridge in the root namespace (the "switch", with address .254: the root namespace is the
client outside the hosts) and one network namespace per host, each joined to the bridge by a
veth pair and given its own address on a /24 of 10.77.0.0/16.

    with VirtualNetwork(["A", "B", "C"]) as net:
        net.hosts["A"].address                     # "10.77.k.1"
        subprocess.run(net.hosts["B"].prefix + ["ip", "addr"])

The namespaces share the machine's file system, users and processes; only the network is
their own. Processes started in a namespace belong to the caller, who stops them;
`destroy()` (also on leaving the `with`) kills whatever still runs in them, then removes the
namespaces and links. Names carry the creating process's id, so a later run removes what a
crashed run left behind (`remove_stale()`) instead of tripping over it. Needs root
(CAP_NET_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from kvpool.server.pidwatch import pid_alive

__all__ = ["NetnsError", "VirtualHost", "VirtualNetwork", "remove_stale", "unavailable_reason"]

PREFIX = "kvn"
# kvn<pid in hex>-<sequence><host letter> for namespaces; links add "0" (root side, on the
# bridge) or "1" (inside the namespace); the bridge is kvn<pid>-<sequence>br. Link names are
# at most 15 bytes (IFNAMSIZ): a 6-hex-digit pid (Linux pids stay below 2^22) leaves room.
_NAME = re.compile(rf"^{PREFIX}(?P<pid>[0-9a-f]+)-(?P<seq>[0-9])(?P<rest>br|[a-z][01]?)$")
SUBNETS = ipaddress.ip_network("10.77.0.0/16")
ROOT_HOST = 254  # the bridge's address in each /24: the root namespace's
_seq = itertools.count()


class NetnsError(RuntimeError):
    """A namespace or link could not be created or removed; the message has `ip`'s answer."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (None when they can): not root, or no `ip`."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the test as root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed: apt-get install -y iproute2"
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_namespace_processes(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in namespace `ns` (all were started in it by its creator) and
    wait until they are gone: a namespace with processes in it outlives `ip netns del`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in namespace {ns} did not die")
        time.sleep(0.05)


def remove_stale() -> list[str]:
    """Remove the namespaces, links and bridges that earlier runs (processes no longer alive)
    left behind, killing what still runs in those namespaces; the names removed."""
    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not pid_alive(int(m["pid"], 16)):
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for link in _links():
        m = _NAME.match(link)
        if m and not pid_alive(int(m["pid"], 16)):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def _used_subnets() -> set[ipaddress.IPv4Network]:
    """The /24s of 10.77.0.0/16 that an address in the root namespace already sits in."""
    used = set()
    for word in _ip("-o", "-4", "addr", "show", check=False).stdout.split():
        if "/" in word:
            try:
                iface = ipaddress.ip_interface(word)
            except ValueError:
                continue
            if iface.ip in SUBNETS:
                used.add(ipaddress.ip_network(f"{iface.ip}/24", strict=False))
    return used


@dataclasses.dataclass(frozen=True)
class VirtualHost:
    """One "host": a network namespace with one address on the network's /24."""

    name: str  # as the caller named it, e.g. "A"
    netns: str  # the kernel's name of its namespace
    address: str  # its own address, e.g. "10.77.12.1"

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host: `prefix + argv`."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """`subprocess.run(prefix + argv, **kw)`."""
        return subprocess.run([*self.prefix, *argv], **kw)


class VirtualNetwork:
    """A bridge and one network namespace per host name, on a /24 no address here uses yet.

    Host i (in the order given) gets address .i+1; the root namespace is .254 on the bridge,
    so a process outside the hosts (the test, a client) reaches every host's address.
    """

    def __init__(self, host_names: Sequence[str]) -> None:
        if not host_names or len(set(host_names)) != len(host_names) or len(host_names) > 26:
            raise ValueError(f"1 to 26 distinct host names, not {host_names!r}")
        self.host_names = list(host_names)
        seq = next(_seq) % 10
        self._tag = f"{PREFIX}{os.getpid():x}-{seq}"
        self.bridge = f"{self._tag}br"
        self.hosts: dict[str, VirtualHost] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.root_address: str | None = None
        self._created: list[tuple[str, str]] = []  # ("netns" | "link", name), to undo in reverse

    def create(self) -> "VirtualNetwork":
        """Build the bridge and the namespaces; on any failure undo what was built and raise."""
        why = unavailable_reason()
        if why:
            raise NetnsError(why)
        remove_stale()
        # A name of ours can exist already only if a dead process had our pid: it is stale.
        for ns in _namespaces():
            if ns.startswith(self._tag):
                _kill_namespace_processes(ns)
                _ip("netns", "del", ns, check=False)
        for link in _links():
            if link.startswith(self._tag):
                _ip("link", "del", link, check=False)
        used = _used_subnets()
        start = (os.getpid() * 10 + int(self._tag[-1])) % 250
        for k in range(250):
            candidate = ipaddress.ip_network(f"10.77.{(start + k) % 250 + 1}.0/24")
            if candidate not in used:
                self.subnet = candidate
                break
        else:
            raise NetnsError("every /24 of 10.77.0.0/16 is in use on this machine")
        base = self.subnet.network_address
        self.root_address = str(base + ROOT_HOST)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", self.bridge))
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.host_names):
                letter = chr(ord("a") + i)
                ns = f"{self._tag}{letter}"
                outer, inner = f"{ns}0", f"{ns}1"
                _ip("netns", "add", ns)
                self._created.append(("netns", ns))
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
                self._created.append(("link", outer))
                _ip("link", "set", outer, "master", self.bridge, "up")
                address = str(base + i + 1)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")  # services in a host bind 127.0.0.1 too
                self.hosts[name] = VirtualHost(name, ns, address)
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Kill what runs in the namespaces, then remove them and the links; idempotent."""
        errors = []
        for kind, name in reversed(self._created):
            try:
                if kind == "netns":
                    _kill_namespace_processes(name)
                    _ip("netns", "del", name, check=False)
                else:
                    # Deleted with its namespace's end too, but asynchronously: at once here.
                    _ip("link", "del", name, check=False)
            except NetnsError as exc:
                errors.append(str(exc))
        self._created.clear()
        self.hosts.clear()
        if errors:
            raise NetnsError("; ".join(errors))

    def __enter__(self) -> "VirtualNetwork":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
