"""What `kvpool doctor` reports and the checks every backend's own doctor check uses.

A finding says what was found, where the value came from and how to fix it; a `Report` keeps
every finding of one run in order, so one check never stops the others. Each backend's module
has a `doctor(config, args, report)` (named in `backends.registry`) built from these helpers;
`kvpool.cli.doctor` runs the checks that concern the whole `--kv-transfer-config`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from kvpool.backends.net import probe
from kvpool.errors import ConfigError

TB = 1 << 40


@dataclasses.dataclass
class Finding:
    """One check's outcome: what was found and, for an error or warning, how to fix it."""

    level: str  # "error" | "warning" | "ok"
    what: str
    fix: str = ""
    # Where the value came from: "file:<path>", "argument:<flag>", "env:<NAME>", "default", or "".
    source: str = ""


class Report:
    """Every finding of one run, in the order found: a check never stops the others."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def error(self, what: str, fix: str, source: str = "") -> None:
        self.findings.append(Finding("error", what, fix, source))

    def warn(self, what: str, fix: str = "", source: str = "") -> None:
        self.findings.append(Finding("warning", what, fix, source))

    def ok(self, what: str, source: str = "") -> None:
        self.findings.append(Finding("ok", what, "", source))

    @property
    def errors(self) -> int:
        return sum(f.level == "error" for f in self.findings)


# What a deployment guide writes where an address goes: copied as is, it reaches nothing.
_PLACEHOLDER = re.compile(r"(?i)\bx{1,3}(\.x{1,3}){3}\b|<[^<>]+>|\$\{[^}]+\}|\byour[_-]")


def placeholder(value: str) -> bool:
    """Whether `value` holds a guide's stand-in (xx.xx.xx.xx, <ip>, ${HOST}, your_host) instead of a value."""
    return bool(_PLACEHOLDER.search(value))


def check_placeholders(tree: Any, where: str, source: str, report: Report, path: str = "") -> None:
    """Report every string in `tree` (a parsed JSON config) that still holds a placeholder."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            check_placeholders(v, where, source, report, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_placeholders(v, where, source, report, f"{path}[{i}]")
    elif isinstance(tree, str) and placeholder(tree):
        report.error(f"{where}: {path}={tree!r} is a placeholder, not an address or path",
                     "put the real value (the host's IP, e.g. 192.168.1.10, or a path) in its place", source)


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def human(n: int) -> str:
    """A byte count the way the findings write it (binary units)."""
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def env_int(env: Mapping[str, str], name: str, report: Report) -> int | None:
    """An environment variable of whole digits; None (and an error reported) otherwise."""
    raw = env.get(name)
    if raw in (None, ""):
        return None
    if not raw.strip().isdigit():
        report.error(f"{name}={raw!r} is not a whole number", f"export {name} as digits only, e.g. {name}=10000")
        return None
    return int(raw)


def read_store_config(report: Report, what: str, loader: Callable[[str | None, Mapping[str, str]], Any],
                      path: str | None, env: Mapping[str, str]) -> Any:
    """A store's own config (its file and environment) through its backend's loader; None, and an
    error reported, when the loader refuses it."""
    try:
        return loader(path, env)
    except ConfigError as exc:
        report.error(f"{what}: {exc.key}={exc.value!r} is invalid", exc.expected)
        return None


def check_answers(report: Report, what: str, address: str, host_port: tuple[str, int], timeout: float,
                  fix: str) -> bool:
    """Whether the service at host:port accepts a connection within `timeout` (reported either way)."""
    why = probe(*host_port, timeout)
    if why:
        report.error(f"{what} at {address} does not answer ({why})", fix)
    else:
        report.ok(f"{what} answers at {address}")
    return why is None


def check_lease(lease_ms: int, source: str, env: Mapping[str, str], report: Report) -> None:
    """The spec: default_kv_lease_ttl must exceed ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT."""
    checked = bad = False
    for name in ("ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT"):
        timeout = env_int(env, name, report)
        if timeout is None:
            continue
        checked = True
        if lease_ms <= timeout:
            bad = True
            report.error(f"default_kv_lease_ttl={lease_ms} ms ({source}) does not exceed {name}={timeout} ms: a lease "
                         "can expire while its transfer still runs (LEASE_EXPIRED, a load error)",
                         f"raise default_kv_lease_ttl above {timeout} (e.g. {timeout + 1000}), or lower {name}")
    if checked and not bad:
        report.ok(f"default_kv_lease_ttl={lease_ms} ms exceeds the Ascend connect/transfer timeouts")


def check_ssd_quota(path: str, quota: int, what: str, ranks: int, report: Report, fix: str) -> None:
    """`ranks` x `quota` bytes against the disk of `path`: an error past its size, a warning past its free space."""
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        report.error(f"cannot read the disk of {path}: {exc.strerror}", "check the path")
        return
    total = quota * ranks
    if total > usage.total:
        report.error(f"{what}: {ranks} rank(s) x {human(quota)} = {human(total)} exceeds the disk of {path} "
                     f"({human(usage.total)})", fix)
    elif total > usage.free:
        report.warn(f"{what}: {ranks} rank(s) x {human(quota)} = {human(total)} exceeds the free space of {path} "
                    f"({human(usage.free)} free)", fix)
    else:
        report.ok(f"{what}: {ranks} rank(s) x {human(quota)} fits the disk of {path} ({human(usage.free)} free)")


def check_transport(protocol: str, source: str, report: Report) -> None:
    """A transport needs its device on this host: RDMA a verbs device, ascend an NPU."""
    if protocol == "rdma":
        try:
            devices = os.listdir("/sys/class/infiniband")
        except OSError:
            devices = []
        if not devices:
            report.error("Mooncake protocol 'rdma', but this host has no RDMA device (/sys/class/infiniband is empty)",
                         "use \"protocol\": \"tcp\" on hosts without RDMA NICs", source)
    elif protocol == "ascend":
        if not any(n.startswith("davinci") for n in listdir("/dev")):
            report.error("Mooncake protocol 'ascend', but this host has no Ascend NPU (/dev/davinci*)",
                         "use \"protocol\": \"tcp\" (or \"rdma\" with RDMA NICs) on hosts without NPUs", source)


def listdir(path: str) -> list[str]:
    """The names in `path`, none where it cannot be read."""
    try:
        return os.listdir(path)
    except OSError:
        return []
