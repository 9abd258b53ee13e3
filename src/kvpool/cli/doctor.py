"""`kvpool doctor`: check a deployment before vLLM starts.

Reads the `--kv-transfer-config` vLLM will get (JSON, or `@file`), the backend's own files and
environment, and reports every finding with its fix: configuration errors, sizes and alignment,
paths, the lease TTL against the Ascend timeouts, SSD quotas against the disk, whether the
master / worker / server answers, and whether block hashes (hence pool keys) will match across
instances. Exit status 1 when anything is an error. Imports neither vLLM nor the stores' client
libraries (Redis' excepted, to ask the server about its memory policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvpool.backends.net import parse_host_port, parse_tcp_url, probe
from kvpool.backends.registry import doctor_check
from kvpool.cli.inputs import loads, read_file
from kvpool.config import KVPoolConfig, LocalSettings, RedisSettings, ServerClientSettings, check_config, int_arg
from kvpool.config import unknown_key_error
from kvpool.errors import ConfigError
from kvpool.paths import check_socket_dir
from kvpool.server import peers, shm

KVPOOL_CONNECTORS = ("KVPoolConnector", "AscendStoreConnector")
# vLLM's non-cryptographic block hashes: seeded randomly per process unless PYTHONHASHSEED is set.
NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
MOONCAKE_DEFAULT_LEASE_MS = 10000  # mooncake_master's own default for --default_kv_lease_ttl
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


# ---- the kv-transfer-config -----------------------------------------------------------------------


def read_transfer_config(text: str) -> dict[str, Any]:
    """JSON text, or `@path` of a file holding it."""
    what = text[1:] if text.startswith("@") else "--kv-transfer-config"
    if text.startswith("@"):
        text = read_file(text[1:])
    value = loads(text, what)
    if not isinstance(value, dict):
        raise ValueError("the kv-transfer-config must be a JSON object")
    return value


# The keys of vLLM's --kv-transfer-config: the fields of its KVTransferConfig (vLLM 0.32; a test
# keeps this equal to the installed vLLM's), which refuses any other.
TRANSFER_CONFIG_KEYS = ("enable_permute_local_kv", "engine_id", "kv_buffer_device", "kv_connector",
                        "kv_connector_extra_config", "kv_connector_module_path", "kv_load_failure_policy", "kv_port",
                        "kv_role")


def check_top_level_keys(cfg: Mapping[str, Any], source: str, report: Report) -> None:
    """Keys vLLM's KVTransferConfig does not have: vLLM would not start."""
    for key in cfg:
        if key not in TRANSFER_CONFIG_KEYS:
            exc = unknown_key_error(str(key), cfg[key], set(TRANSFER_CONFIG_KEYS), "--kv-transfer-config")
            report.error(f"--kv-transfer-config: unknown key {exc.key!r}: vLLM refuses it", exc.expected, source)


def find_kvpool_entry(cfg: Mapping[str, Any], report: Report) -> Mapping[str, Any] | None:
    """kvpool's own connector entry: the config itself, or its child inside a MultiConnector."""
    name = cfg.get("kv_connector")
    if name in KVPOOL_CONNECTORS:
        return cfg
    if name == "MultiConnector":
        children = (cfg.get("kv_connector_extra_config") or {}).get("connectors") or []
        mine = [c for c in children if isinstance(c, dict) and c.get("kv_connector") in KVPOOL_CONNECTORS]
        if mine:
            if "kv_load_failure_policy" in mine[0]:
                report.warn("kv_load_failure_policy is set on kvpool's entry inside the MultiConnector, where vLLM "
                            "ignores it", "set kv_load_failure_policy on the top-level MultiConnector config")
            return mine[0]
        report.error("the MultiConnector has no KVPoolConnector / AscendStoreConnector entry",
                     "add {\"kv_connector\": \"KVPoolConnector\", \"kv_role\": ..., \"kv_connector_extra_config\": "
                     "{...}} to kv_connector_extra_config.connectors")
        return None
    report.error(f"kv_connector={name!r} is not kvpool's connector",
                 "use \"kv_connector\": \"KVPoolConnector\" (or \"AscendStoreConnector\", or a MultiConnector "
                 "holding one of them)")
    return None


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


def check_connector_name(name: Any, source: str, report: Report) -> None:
    if name == "AscendStoreConnector":
        report.warn("kv_connector 'AscendStoreConnector' is the spec's (vLLM-Ascend's) name: upstream vLLM does not "
                    "register it; kvpool's plugin (entry point vllm.general_plugins) does, so every vLLM process "
                    "must have kvpool installed", "keep it, or use \"KVPoolConnector\" (the same connector)", source)


def check_failure_policy(cfg: Mapping[str, Any], report: Report, source: str = "") -> None:
    policy = cfg.get("kv_load_failure_policy")
    if policy is None:
        report.warn("kv_load_failure_policy is not set: vLLM's default is 'fail', so a block evicted between lookup "
                    "and load fails the request", "set \"kv_load_failure_policy\": \"recompute\"", "default")
    elif policy == "fail":
        report.warn("kv_load_failure_policy is 'fail': a load error (evicted block, store down) fails the request",
                    "use \"recompute\" unless failing is what you want", source)
    elif policy != "recompute":
        report.error(f"kv_load_failure_policy={policy!r} is not a value vLLM knows", "use \"recompute\" or \"fail\"",
                     source)


# ---- hash seed -------------------------------------------------------------------------------------


def check_hash_seed(algo: str, env: Mapping[str, str], report: Report) -> None:
    """vLLM's rule (kvpool.vllm.scheduler.check_hash_seed), restated without importing vLLM."""
    seed = env.get("PYTHONHASHSEED")
    if algo not in HASH_ALGOS:
        report.error(f"--prefix-caching-hash-algo {algo!r} is not one of vLLM's ({', '.join(HASH_ALGOS)})",
                     "pass the value you give vLLM")
        return
    if algo in NON_CRYPTO_HASHES and seed is None:
        report.error(f"prefix-caching hash {algo} with PYTHONHASHSEED unset: vLLM seeds these block hashes randomly "
                     "per process, so no other instance and no restart would ever hit the pool",
                     "use --prefix-caching-hash-algo sha256 (vLLM's default), or export PYTHONHASHSEED=0 (the same "
                     "value) on every instance", "argument:--prefix-caching-hash-algo")
    elif seed is None:
        report.ok(f"block hashes: {algo} with vLLM's fixed seed (PYTHONHASHSEED unset); every instance that also "
                  "leaves it unset computes the same keys")
    else:
        report.ok(f"block hashes: {algo} seeded from PYTHONHASHSEED={seed!r}; every instance sharing the pool must "
                  "export the same value (an instance without it computes other keys and never hits)")


# ---- helpers --------------------------------------------------------------------------------------


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def human(n: int) -> str:
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _env_int(env: Mapping[str, str], name: str, report: Report) -> int | None:
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
        timeout = _env_int(env, name, report)
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


# ---- per backend -----------------------------------------------------------------------------------


def check_local(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    local = cfg.backend_settings
    assert isinstance(local, LocalSettings)
    avail = mem_available()
    per_host = local.memory_size * args.ranks_per_host
    if avail is not None and per_host > avail:
        report.warn(f"local_cpu_size={human(local.memory_size)} x {args.ranks_per_host} worker(s) exceeds the "
                    f"memory available on this host ({human(avail)})", "lower local_cpu_size")
    if local.offload_path:
        quota = local.offload_quota
        if quota:
            check_ssd_quota(local.offload_path, quota, "ssd_quota", args.ranks_per_host, report,
                            "lower ssd_quota (per worker), or use 0 for 90% of the free space")
        else:
            report.ok(f"ssd_quota 0: each worker takes 90% of the free space of {local.offload_path} when it "
                      "starts (several workers on one disk would overcommit it: set ssd_quota)")
    check_lease(local.default_kv_lease_ttl_ms, "default_kv_lease_ttl_ms", args.env, report)


def check_server(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    assert isinstance(cfg.backend_settings, ServerClientSettings)
    path = cfg.backend_settings.server_socket
    allowed_gid = cfg.backend_settings.allowed_gid
    try:
        check_socket_dir(path, "server_socket", allowed_gid)
    except ConfigError as exc:
        report.error(f"the workers would not trust {path}: {exc.expected}", "see docs/security.md")
        return
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(args.timeout)
            s.connect(path)
            server = peers.peer_of(s)
            trusted = peers.trusted(s, server, allowed_gid)
        if trusted:
            report.ok(f"kvpool server answers on {path}")
        else:
            report.error(f"the process on {path} ({server.describe()}) is not {peers.domain(allowed_gid)}: the "
                         "workers will refuse it", "run kvpool server as this user, or set allowed_gid on both "
                         "(docs/security.md)")
    except OSError as exc:
        report.error(f"no kvpool server answers on {path} ({exc.strerror or exc})",
                     f"start it first: kvpool server --socket {path} --memory-size 8GB (see docs/server.md)")
    check_leftover_arenas(report)


def check_leftover_arenas(report: Report) -> None:
    """Arenas of this user's dead servers still in /dev/shm (`shm.leftovers`)."""
    dead = shm.leftovers()
    if dead:
        names = ", ".join(f"{d.name} ({human(d.resident)})" for d in dead)
        report.warn(f"{len(dead)} arena(s) of dead kvpool servers hold {human(sum(d.resident for d in dead))} of "
                    f"memory in {shm.SHM_DIR}: {names}",
                    f"the next kvpool server to start removes them; or remove them now: rm {shm.SHM_DIR}/NAME")


def check_redis(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    try:
        import redis
    except ImportError:
        report.error("the redis client library is not installed", "pip install 'kvpool[redis]'")
        return
    settings = cfg.backend_settings
    assert isinstance(settings, RedisSettings)
    r = redis.Redis.from_url(settings.redis_url, socket_timeout=args.timeout, socket_connect_timeout=args.timeout)
    try:
        r.ping()
        info = r.info("memory")
    except redis.RedisError as exc:
        report.error(f"Redis at {settings.redis_url} does not answer ({exc})",
                     "start it (redis-server --port ... --maxmemory 8gb --maxmemory-policy allkeys-lru) or fix redis_url")
        return
    finally:
        r.close()
    report.ok(f"Redis answers at {settings.redis_url}")
    maxmemory, policy = int(info.get("maxmemory", 0) or 0), info.get("maxmemory_policy", "?")
    if not maxmemory:
        report.warn("Redis has no maxmemory: the pool grows until the host runs out of memory",
                    "set maxmemory (e.g. CONFIG SET maxmemory 8gb) with maxmemory-policy allkeys-lru")
    if policy not in ("allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu", "allkeys-random", "volatile-ttl",
                      "volatile-random"):
        report.warn(f"Redis maxmemory-policy is {policy}: once full, every save fails (NO_AVAILABLE_HANDLE)",
                    "CONFIG SET maxmemory-policy allkeys-lru")
    elif policy.startswith("volatile") and not settings.redis_ttl_s:
        report.warn(f"Redis maxmemory-policy {policy} evicts only keys with a TTL, and redis_ttl_s is 0",
                    "use allkeys-lru, or set redis_ttl_s")


def check_mooncake(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    from kvpool.backends.mooncake import DEFAULT_OFFLOAD_BUFFER, MASTER_LEASE_TTL_S, load_mooncake_config

    env = args.env
    mc = read_store_config(report, "Mooncake", load_mooncake_config,
                           getattr(cfg.backend_settings, "mooncake_config_path", None), env)
    if mc is None:
        return
    mc_source = f"file:{mc.path}" if mc.path else "env:MOONCAKE_*"
    report.ok(f"mooncake.json {mc.path or '(none: environment only)'}: protocol {mc.protocol}, master "
              f"{mc.master_server_address}, segment {human(mc.global_segment_size)}", mc_source)
    if mc.path:
        try:
            with open(mc.path) as f:
                check_placeholders(json.load(f), "mooncake.json", mc_source, report)
        except (OSError, ValueError):
            pass  # the loader has read it; a race is not this check's business
    check_transport(mc.protocol, mc_source, report)
    if mc.ignored_fields:
        report.warn(f"mooncake.json fields kvpool does not use: {', '.join(mc.ignored_fields)}",
                    "remove them, or ignore this if another tool reads the same file")
    host, port = parse_host_port("master_server_address", mc.master_server_address)
    check_answers(report, "mooncake_master", mc.master_server_address, (host, port), args.timeout,
                  f"start it: mooncake_master --rpc_address {host} --port {port} --eviction_high_watermark_ratio 0.9 "
                  "--eviction_ratio 0.1 --default_kv_lease_ttl 11000 (or fix master_server_address / MOONCAKE_MASTER)")
    lease = args.default_kv_lease_ttl or MOONCAKE_DEFAULT_LEASE_MS
    check_lease(lease, "--default_kv_lease_ttl of mooncake_master" if args.default_kv_lease_ttl
                else "mooncake_master's default; pass --default-kv-lease-ttl with the master's value", env, report)
    trusted_ms = int(MASTER_LEASE_TTL_S * 1000)
    if lease < trusted_ms:
        # kvpool calls a read a hit when its copy ended within this long of the lease's grant: a
        # shorter lease lets the master evict and reuse the replica while a copy may still read it.
        report.error(f"default_kv_lease_ttl={lease} ms is shorter than the {trusted_ms} ms for which kvpool trusts "
                     "a Mooncake read: a replica could be evicted and reused while a load still copies it",
                     f"start mooncake_master with --default_kv_lease_ttl {trusted_ms} or more (the spec uses 11000)")
    offload_buffer = DEFAULT_OFFLOAD_BUFFER
    if env.get("MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"):
        offload_buffer = int(env["MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"])  # digits: checked by the loader
    if mc.enable_ssd_offload and mc.ssd_offload_path:
        limit = _env_int(env, "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", report)
        check_ssd_quota(mc.ssd_offload_path, limit if limit is not None else 2 * TB,
                        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES" + ("" if limit is not None else " (unset: 2TB)"),
                        args.ranks_per_host, report,
                        "export MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES=<disk size / ranks per host>")
        bucket = _env_int(env, "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE", report)
        if bucket:
            check_ssd_quota(mc.ssd_offload_path, bucket, "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE", args.ranks_per_host,
                            report, "export MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE=<disk size / ranks per host>")
        policy = env.get("MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY", "none")
        if policy not in ("none", "fifo", "lru"):
            report.error(f"MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY={policy!r} is not none, fifo or lru",
                         "export MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY=lru")
        elif policy == "none":
            report.warn("MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY is none: once the SSD quota is full, offload writes fail",
                        "export MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY=lru")
    else:
        offload_buffer = 0
    avail = mem_available()
    need = args.ranks_per_host * (mc.global_segment_size + mc.local_buffer_size + offload_buffer)
    if avail is not None and need > avail:
        report.warn(f"Mooncake needs {args.ranks_per_host} rank(s) x (segment + local buffer + SSD buffer) = "
                    f"{human(need)} of host memory; {human(avail)} is available",
                    "lower global_segment_size (or MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES)")


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
        if not any(n.startswith("davinci") for n in _listdir("/dev")):
            report.error("Mooncake protocol 'ascend', but this host has no Ascend NPU (/dev/davinci*)",
                         "use \"protocol\": \"tcp\" (or \"rdma\" with RDMA NICs) on hosts without NPUs", source)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def check_yuanrong(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    from kvpool.backends.yuanrong import load_yuanrong_config

    yr = read_store_config(report, "Yuanrong", load_yuanrong_config,
                           getattr(cfg.backend_settings, "yuanrong_config_path", None), args.env)
    if yr is None:
        return
    check_answers(report, "datasystem worker", yr.worker_addr, parse_host_port("worker_addr", yr.worker_addr),
                  args.timeout, f"start it: dscli start -w --worker_address {yr.worker_addr} --etcd_address "
                  "<etcd host:port> --shared_memory_size_mb 40960 --arena_per_tenant 1 (or --metastore_address ... "
                  "--start_metastore_service true without etcd); DS_WORKER_ADDR must equal --worker_address")
    if not yr.enable_exclusive_connection:
        report.warn("DS_ENABLE_EXCLUSIVE_CONNECTION is off: on CPU each datasystem call then costs ~1.5 ms",
                    "export DS_ENABLE_EXCLUSIVE_CONNECTION=1 (at most 128 such clients per worker)")
    if yr.ignored_fields:
        report.warn(f"YR_CONFIG_PATH fields kvpool does not use: {', '.join(yr.ignored_fields)}",
                    "they concern the NPU data path of vLLM-Ascend; remove them or ignore this")
    if yr.client_log_dir:
        d = yr.client_log_dir
        parent = d if os.path.isdir(d) else os.path.dirname(d.rstrip("/")) or "/"
        if not os.access(parent, os.W_OK):
            report.error(f"DATASYSTEM_CLIENT_LOG_DIR={d} cannot be created or written",
                         f"mkdir -p {d} and give it to the serving user")


def check_memcache(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    from kvpool.backends.memcache import load_memcache_config

    mmc = read_store_config(report, "MemCache", load_memcache_config,
                           getattr(cfg.backend_settings, "mmc_local_config_path", None), args.env)
    if mmc is None:
        return
    check_answers(report, "MemCache MetaService", mmc.meta_service_url,
                  parse_tcp_url("ock.mmc.meta_service_url", mmc.meta_service_url), args.timeout,
                  "start it: MMC_META_CONFIG_PATH=/path/mmc-meta.conf python -c \"from memcache_hybrid import "
                  "MetaService; MetaService.main()\"")
    if not any(os.path.exists(p) for p in ("/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info")):
        report.error("no Ascend NPU driver on this host: MemCache's local service (memfabric hybm_init) needs it for "
                     "every protocol, host_tcp and host_shm included",
                     "run on an Ascend host, or use backend mooncake, yuanrong or redis")




# ---- command ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transfer-config", required=True, metavar="JSON|@FILE",
                   help="the --kv-transfer-config given to vLLM, or @path of a file holding it")
    p.add_argument("--prefix-caching-hash-algo", default="sha256",
                   help="the value given to vLLM (default: vLLM's default, sha256)")
    p.add_argument("--default-kv-lease-ttl", type=int_arg, default=None, metavar="MS",
                   help="mooncake_master's --default_kv_lease_ttl (ms), checked against the Ascend timeouts")
    p.add_argument("--ranks-per-host", type=int_arg, default=1, metavar="N",
                   help="worker processes (TP x PP ranks) per host sharing its memory and disk (default 1)")
    p.add_argument("--timeout", type=float, default=1.0, metavar="S",
                   help="seconds to wait for a service to answer (default 1)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def diagnose(args: argparse.Namespace) -> Report:
    report = Report()
    if not hasattr(args, "env"):
        args.env = os.environ
    text = args.kv_transfer_config
    source = f"file:{text[1:]}" if text.startswith("@") else "argument:--kv-transfer-config"
    try:
        raw = read_transfer_config(text)
    except (OSError, ValueError) as exc:
        report.error(f"cannot read the kv-transfer-config: {exc}",
                     "pass the JSON object given to vLLM's --kv-transfer-config, or @path of a file holding it", source)
        return report
    check_top_level_keys(raw, source, report)
    check_failure_policy(raw, report, source)
    check_placeholders(raw, "kv-transfer-config", source, report)
    entry = find_kvpool_entry(raw, report)
    if entry is not None:
        check_connector_name(entry.get("kv_connector"), source, report)
        extra = entry.get("kv_connector_extra_config") or {}
        cfg, errors = check_config(extra, entry.get("kv_role", raw.get("kv_role")))
        for exc in errors:
            where = "--kv-transfer-config" if exc.key == "kv_role" else "kv_connector_extra_config"  # its level
            report.error(f"{where}: {exc.key}={exc.value!r} is invalid", f"{exc.expected} (see docs/configuration.md)",
                         source)
        if cfg is not None:
            if not errors:
                report.ok(f"kv_connector_extra_config parses: backend {cfg.backend}, role {cfg.kv_role}", source)
            # The other checks run on what is valid (bad values at their defaults): one run finds all.
            doctor_check(cfg.backend)(cfg, args, report)
            if cfg.remote_backend is not None and cfg.remote_settings is not None:
                report.ok(f"remote tier: {cfg.remote_backend} behind the {cfg.backend} host pool", source)
                remote = msgspec.structs.replace(cfg, backend=cfg.remote_backend, backend_settings=cfg.remote_settings)
                doctor_check(cfg.remote_backend)(remote, args, report)
    check_hash_seed(args.prefix_caching_hash_algo, args.env, report)
    return report


def run(args: argparse.Namespace) -> int:
    report = diagnose(args)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in report.findings], indent=2))
    else:
        marks = {"error": "ERROR", "warning": "WARN ", "ok": "ok   "}
        for f in report.findings:
            print(f"{marks[f.level]} {f.what}")
            if f.source and f.level != "ok":
                print(f"      from: {f.source}")
            if f.fix:
                print(f"      fix: {f.fix}")
        n_warn = sum(f.level == "warning" for f in report.findings)
        print(f"\n{report.errors} error(s), {n_warn} warning(s)")
    return 1 if report.errors else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpool doctor", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
