"""Addresses of the stores the backends reach: parsing "host:port" and "tcp://host:port", a
reachability probe, and the local address that routes to a peer."""

from __future__ import annotations

import re
import socket
from typing import Any

from kvpool.errors import ConfigError

_TCP_URL = re.compile(r"^tcp://(?P<host>[^:/\s]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})$")


def split_host_port(value: str) -> tuple[str, str] | None:
    """The one rule for "host:port" wherever kvpool reads one (a store's address, a proxy's
    instance): split at the last colon, IPv6 in brackets ("[::1]:8000", kept as given); None
    without a colon or a host, or for an IPv6 address without brackets, whose last colon may be
    its own."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        return None
    return host, port


def parse_host_port(key: str, value: Any) -> tuple[str, int]:
    """"host:port" (IPv6 as "[::1]:port") -> (host, port)."""
    expected = 'host:port of the service, e.g. "127.0.0.1:50088" (IPv6: "[::1]:50088")'
    split = split_host_port(value) if isinstance(value, str) else None
    if split is None:
        raise ConfigError(key, value, expected)
    host, port = split[0].strip("[]"), split[1]
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, value, expected)
    return host, int(port)


def parse_tcp_url(key: str, value: str) -> tuple[str, int]:
    """"tcp://host:port" (Memcache's URLs) -> (host, port)."""
    m = _TCP_URL.match(value or "")
    if not m or not 0 < int(m.group("port")) < 65536:
        raise ConfigError(key, value, "tcp://host:port, e.g. tcp://10.0.0.1:5000")
    return m.group("host").strip("[]"), int(m.group("port"))


def default_local_hostname(master_host: str) -> str:
    """The local address that routes to the master (127.0.0.1 for a master on this host)."""
    try:
        if master_host in ("localhost",) or master_host.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, 9))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def probe(host: str, port: int, timeout: float = 1.0) -> str | None:
    """None if a TCP connection to host:port succeeds within `timeout`, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
