"""`backend: mooncake` — Mooncake Store (`mooncake_master` + `MooncakeDistributedStore`).

Configured as in the spec: `MOONCAKE_CONFIG_PATH` (or `mooncake_config_path` in
`kv_connector_extra_config`) names a mooncake.json with `metadata_server`, `protocol`,
`device_name`, `master_server_address`, `global_segment_size`, `local_buffer_size`,
`preferred_segment`, `prefer_alloc_in_same_node`, `enable_ssd_offload`, `ssd_offload_path`
(and optionally `local_hostname`); `MOONCAKE_MASTER` and `MOONCAKE_GLOBAL_SEGMENT_SIZE` beat the
file. With `ASCEND_ENABLE_USE_FABRIC_MEM=1` every fabric-memory size must be a multiple of 1GB.
`load_mooncake_config` checks all of it without importing Mooncake (`kvpool doctor` uses it).

Data path: zero-copy batch calls (`batch_put_from_multi_buffers`,
`batch_get_into_multi_buffers`) straight between the caller's buffers and the store's segments;
with the TCP transport Mooncake copies from any memory, with RDMA/Ascend the buffers are
registered (`register_buffer`) the first time they are seen. A get first asks the master for
the replicas (`batch_get_replica_desc`, one RPC that also grants the lease) so a destination of
the wrong size is refused (INVALID_PARAMS) before a byte is written.

Mooncake facts this adapter works around (measured with mooncake-transfer-engine 0.3.13):
- `setup()` blocks ~90 s when the master is not there: the master's port is probed first (1 s
  timeout) and, while it does not answer, calls fail fast and setup is retried after a backoff
  (`base.Reconnect`, up to `retry_cap_s`). A master that goes away is seen by `health_check()`
  (a local flag), so calls fail fast (misses, RPC_FAIL) instead of each waiting ~4 s for an RPC
  timeout; the client re-mounts its segment by itself when a master is back.
- A put is put-if-absent in the master (PutStart refuses an existing key), but the client
  answers 0 for a key it skipped as for one it wrote: this adapter reports OK for both
  (`Capabilities.put_reports_existing` is off) and never asks for existence first.
- Eviction runs on a master thread every few ms, after a put found no room: a put that failed
  with NO_AVAILABLE_HANDLE is retried briefly so eviction can make room, as the pool engine does
  synchronously.
- `batch_is_exist` grants a lease like a read: every lookup leases its hits.
- Objects live in the segment of the client that holds them: they vanish when that client
  (vLLM worker) stops. A client with `global_segment_size` 0 only reads and writes others'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpool.backends.base import Backend, spans
from kvpool.backends.diagnosis import TB, Report, check_answers, check_lease, check_placeholders
from kvpool.backends.diagnosis import check_ssd_quota, check_transport, env_int, human, mem_available, read_store_config
from kvpool.backends.net import default_local_hostname, parse_host_port, probe
from kvpool.config import KVPoolConfig, MooncakeSettings, parse_bool, parse_size, read_json_object
from kvpool.errors import ConfigError, ErrorCode
from kvpool.errors import EXISTS, INTERNAL, INVALID, LEASE_EXPIRED, NOT_FOUND, NO_HANDLE, OK  # the codes as ints
from kvpool.errors import RPC_FAIL, RPC_TIMEOUT

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# Mooncake's own defaults (vLLM's MooncakeStoreConnector uses the same segment size).
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
# Only Mooncake's copying calls use the local buffer; kvpool's zero-copy calls do not.
DEFAULT_LOCAL_BUFFER_SIZE = 16 * MiB
# mooncake_master's default_kv_lease_ttl (5000 ms): how long a replica handed out for a read
# stays put. A get that takes longer is not trusted (`_get_into`).
MASTER_LEASE_TTL_S = 5.0
# Measured: setup() fails ("Total size must be at least 16777216") below this.
MIN_SEGMENT_SIZE = 16 * MiB
# MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES when unset (per the spec).
DEFAULT_OFFLOAD_BUFFER = 1342177280
PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa", "cxl")
KNOWN_FIELDS = (
    "local_hostname", "metadata_server", "protocol", "device_name", "master_server_address",
    "global_segment_size", "local_buffer_size", "preferred_segment", "prefer_alloc_in_same_node",
    "enable_ssd_offload", "ssd_offload_path",
)

_OURS = {int(c) for c in ErrorCode}
# Mooncake codes with no twin in ours.
_MAP = {
    -703: NOT_FOUND,  # REPLICA_IS_NOT_READY: still being written, not readable yet
    -800: RPC_FAIL,  # TRANSFER_FAIL
    -1010: RPC_FAIL,  # ETCD_OPERATION_ERROR and friends: metadata service trouble
}
# A put refused for room is retried after these pauses: the master evicts on its own thread
# (every ~10 ms when idle, later on a busy host), after a refused put or past the watermark.
_NO_ROOM_BACKOFF_S = (0.01, 0.02, 0.04, 0.08, 0.15, 0.2)


def map_code(rc: int) -> int:
    """A Mooncake result (negative code, or bytes transferred) -> one of kvpool's codes."""
    if rc >= 0:
        return OK
    if rc in _MAP:
        return _MAP[rc]
    return rc if rc in _OURS else INTERNAL


# ---- configuration -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MooncakeConfig:
    """mooncake.json after the environment's overrides, validated."""

    path: str | None
    master_server_address: str
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    preferred_segment: bool = False
    prefer_alloc_in_same_node: bool = True
    enable_ssd_offload: bool = False
    ssd_offload_path: str | None = None
    fabric_mem: bool = False
    # Fields of the file kvpool does not use (other tools' settings): reported, not fatal.
    ignored_fields: tuple[str, ...] = ()
    # Where each effective value came from, e.g. {"master_server_address": "MOONCAKE_MASTER"}.
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)


def load_mooncake_config(path: str | None = None, env: Mapping[str, str] | None = None) -> MooncakeConfig:
    """Read mooncake.json (`path`, else $MOONCAKE_CONFIG_PATH), apply the environment, validate.

    Raises ConfigError naming the field (or environment variable), the value and what is expected.
    """
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    if path is None:
        path = env.get("MOONCAKE_CONFIG_PATH") or None
        where = "MOONCAKE_CONFIG_PATH"
    else:
        where = "mooncake_config_path"
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_json_object(where, path, "mooncake.json")
        sources.update({k: path for k in raw})
    elif not env.get("MOONCAKE_MASTER"):
        raise ConfigError(
            "MOONCAKE_CONFIG_PATH", None,
            "the path of mooncake.json (export MOONCAKE_CONFIG_PATH=/path/mooncake.json, or set "
            "mooncake_config_path in kv_connector_extra_config); with no file, MOONCAKE_MASTER at least",
        )

    master = raw.get("master_server_address")
    if env.get("MOONCAKE_MASTER"):
        master, sources["master_server_address"] = env["MOONCAKE_MASTER"], "MOONCAKE_MASTER"
    master_key = sources.get("master_server_address", "master_server_address")
    if master_key != "MOONCAKE_MASTER":
        master_key = "master_server_address"
    if master is None:
        raise ConfigError("master_server_address", None,
                          'the master\'s host:port in mooncake.json (or MOONCAKE_MASTER), e.g. "127.0.0.1:50088"')
    master_host, _ = parse_host_port(master_key, master)

    protocol = raw.get("protocol", "tcp")
    if not isinstance(protocol, str) or protocol.strip().lower() not in PROTOCOLS:
        raise ConfigError("protocol", protocol, f"one of {', '.join(PROTOCOLS)} (tcp on hosts without RDMA/NPU)")
    protocol = protocol.strip().lower()

    seg_key, seg_value = "global_segment_size", raw.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)
    if env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        seg_key, seg_value = "MOONCAKE_GLOBAL_SEGMENT_SIZE", env["MOONCAKE_GLOBAL_SEGMENT_SIZE"]
        sources["global_segment_size"] = "MOONCAKE_GLOBAL_SEGMENT_SIZE"
    segment = parse_size(seg_key, seg_value)
    if 0 < segment < MIN_SEGMENT_SIZE:
        raise ConfigError(seg_key, seg_value,
                          "0 (this client stores nothing itself) or at least 16MB: Mooncake refuses smaller segments")
    local_buffer = parse_size("local_buffer_size", raw.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE))

    fabric = parse_bool("ASCEND_ENABLE_USE_FABRIC_MEM", env.get("ASCEND_ENABLE_USE_FABRIC_MEM") or "0")
    enable_ssd = parse_bool("enable_ssd_offload", raw.get("enable_ssd_offload", False))
    ssd_path = raw.get("ssd_offload_path")
    if enable_ssd:
        if ssd_path is None:
            raise ConfigError("ssd_offload_path", None,
                              "an existing absolute directory, required when enable_ssd_offload is true")
        from kvpool.paths import validate_offload_path

        validate_offload_path(ssd_path)
    offload_buffer = env.get("MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES")
    if offload_buffer is not None and not offload_buffer.strip().isdigit():
        raise ConfigError("MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", offload_buffer,
                          "a byte count written as digits, e.g. 1073741824: Mooncake ignores '10G'/'10GB' and "
                          "silently falls back to 1280MB")
    if fabric:
        if segment % GiB:
            raise ConfigError(seg_key, seg_value,
                              "a multiple of 1GB (1073741824 bytes), e.g. \"1GB\" or \"20GB\", required when "
                              "ASCEND_ENABLE_USE_FABRIC_MEM=1 (Mooncake does not round up; adxl MallocMem fails)")
        if enable_ssd:
            n = int(offload_buffer) if offload_buffer is not None else DEFAULT_OFFLOAD_BUFFER
            if n % GiB:
                raise ConfigError(
                    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", offload_buffer,
                    f"a multiple of 1GB when ASCEND_ENABLE_USE_FABRIC_MEM=1 and enable_ssd_offload is true "
                    f"(unset means {DEFAULT_OFFLOAD_BUFFER}, 1280MB, which is not); e.g. 1073741824",
                )
        local_buffer = 0  # unused with fabric memory: vLLM-Ascend passes 0 to setup()

    for key in ("metadata_server", "device_name", "local_hostname"):
        if key in raw and not isinstance(raw[key], str):
            raise ConfigError(key, raw[key], "a string (in mooncake.json)")
    metadata = raw.get("metadata_server", "P2PHANDSHAKE")
    if not metadata:
        raise ConfigError("metadata_server", metadata, '"P2PHANDSHAKE" or the URL of a metadata server')
    return MooncakeConfig(
        path=path,
        master_server_address=master,
        local_hostname=raw.get("local_hostname") or default_local_hostname(master_host),
        metadata_server=metadata,
        protocol=protocol,
        device_name=raw.get("device_name", ""),
        global_segment_size=segment,
        local_buffer_size=local_buffer,
        preferred_segment=parse_bool("preferred_segment", raw.get("preferred_segment", False)),
        prefer_alloc_in_same_node=parse_bool("prefer_alloc_in_same_node", raw.get("prefer_alloc_in_same_node", True)),
        enable_ssd_offload=enable_ssd,
        ssd_offload_path=ssd_path if enable_ssd else None,
        fabric_mem=fabric,
        ignored_fields=tuple(sorted(k for k in raw if k not in KNOWN_FIELDS)),
        sources=sources,
    )


# ---- backend -------------------------------------------------------------------------------------


def _import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ConfigError(
            "backend", "mooncake",
            "Mooncake installed: pip install 'kvpool[mooncake]' (CPU: mooncake-transfer-engine-non-cuda; CUDA: "
            f"mooncake-transfer-engine), and on Debian apt-get install libibverbs1 ({exc})",
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


class MooncakeBackend(Backend):
    """One `MooncakeDistributedStore` client per process (vLLM worker)."""

    name = "mooncake"
    seal_values = True  # any client of the store can write any key

    @classmethod
    def from_settings(cls, settings: MooncakeSettings, client_name: str) -> "MooncakeBackend":
        return cls(load_mooncake_config(settings.mooncake_config_path), client_name)

    def __init__(self, config: MooncakeConfig, client_name: str) -> None:
        self._Store, self._ReplicateConfig = _import_store()
        self.config = config
        self.client_name = client_name
        self._master = parse_host_port("master_server_address", config.master_server_address)
        self.store: Any = None
        self._registered: set[tuple[int, int]] = set()
        self._ssd_path = None
        if config.enable_ssd_offload and config.ssd_offload_path:
            # One directory per process (the spec's rank_N/): ranks never share files.
            self._ssd_path = os.path.join(config.ssd_offload_path, client_name)
            os.makedirs(self._ssd_path, exist_ok=True)
        if not self._link.connect():
            logger.warning(
                "kvpool mooncake: master %s is not reachable yet; lookups miss and loads/saves fail until it is "
                "(retried at least every %.0f s)", config.master_server_address, self.retry_cap_s,
            )

    # ---- connection ---------------------------------------------------------------------------

    def _connect(self) -> bool:
        """Set the store up if the master answers; False (retried after the backoff) otherwise."""
        if self.store is not None:
            return True
        why = probe(*self._master)
        if why is not None:
            logger.debug("kvpool mooncake: master %s: %s", self.config.master_server_address, why)
            return False
        cfg = self.config
        store = self._Store()
        setup: dict[str, Any] = {
            "local_hostname": cfg.local_hostname,
            "metadata_server": cfg.metadata_server,
            "global_segment_size": cfg.global_segment_size,
            "local_buffer_size": cfg.local_buffer_size,
            "protocol": cfg.protocol,
            "rdma_devices": cfg.device_name,
            "master_server_addr": cfg.master_server_address,
        }
        if self._ssd_path:
            setup.update(enable_ssd_offload=True, ssd_offload_path=self._ssd_path)
        rc = store.setup(setup)
        if rc != 0:
            logger.error("kvpool mooncake: setup(%s) failed with %s (%s)", setup, rc, _name(rc))
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
            return False
        rep = self._ReplicateConfig()
        rep.replica_num = 1
        rep.prefer_alloc_in_same_node = cfg.prefer_alloc_in_same_node
        if cfg.preferred_segment and cfg.global_segment_size:
            rep.preferred_segment = store.get_hostname()
        self._replicate = rep
        self.store = store
        return True

    def _available(self) -> bool:
        """Whether calls can go to the master now (fast: a local flag once set up)."""
        store = self.store if super()._available() else None
        return store is not None and store.health_check() == 0

    def _register(self, ptrs: list[int], sizes: list[int]) -> None:
        # TCP copies from any memory; RDMA/Ascend need registered memory.
        if self.config.protocol == "tcp":
            return
        for p, n in zip(ptrs, sizes):
            if (p, n) not in self._registered:
                rc = self.store.register_buffer(p, n)
                if rc != 0:
                    logger.warning("kvpool mooncake: register_buffer(%#x, %d) failed with %s", p, n, rc)
                self._registered.add((p, n))

    # ---- protocol hooks (input checked and deduplicated by Backend) ----------------------------

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        # Mooncake leases every hit of batch_is_exist, with or without `lease`.
        res = self.store.batch_is_exist(keys)
        if any(r < 0 for r in res):
            logger.debug("kvpool mooncake: batch_is_exist answered %s", sorted({r for r in res if r < 0}))
        return [r == 1 for r in res]

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        # No existence check: the master's PutStart skips a key it has (see the module docstring).
        want = [spans(v) for v in values]
        codes = [RPC_FAIL] * len(keys)
        pending = list(range(len(keys)))
        for pause in (*_NO_ROOM_BACKOFF_S, None):
            if not pending:
                break
            ptrs = [want[i][0] for i in pending]
            sizes = [want[i][1] for i in pending]
            for p, s in zip(ptrs, sizes):
                self._register(p, s)
            # One native call reads our buffers and talks to the master: admitted as a whole.
            with self._buffers() as admitted:
                if not admitted:  # the caller stopped waiting: its buffers may hold other KV now
                    for i in pending:
                        codes[i] = RPC_TIMEOUT
                    break
                res = self.store.batch_put_from_multi_buffers([keys[i] for i in pending], ptrs, sizes,
                                                              self._replicate)
            retry = []
            for i, rc in zip(pending, res):
                code = map_code(rc)
                if code == NO_HANDLE and pause is not None:
                    retry.append(i)
                    continue
                codes[i] = code
                if code not in (OK, EXISTS, NO_HANDLE):
                    logger.warning("kvpool mooncake: put %r failed with %s (%s)", keys[i], rc, _name(rc))
            pending = retry
            if pending and pause is not None:
                time.sleep(pause)
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        codes = [NOT_FOUND] * len(keys)
        want = [spans(v) for v in values]
        # Sizes (and leases) of the keys in one RPC, so a wrong-size destination is refused
        # before a byte is written. The lease starts no earlier than this clock reading.
        leased_at = time.monotonic()
        desc = self.store.batch_get_replica_desc(keys)
        fetch: list[int] = []
        for i, key in enumerate(keys):
            size = _object_size(desc.get(key))
            if size is not None:
                if size != want[i][2]:
                    codes[i] = INVALID
                else:
                    fetch.append(i)
        if fetch:
            ptrs = [want[i][0] for i in fetch]
            sizes = [want[i][1] for i in fetch]
            for p, s in zip(ptrs, sizes):
                self._register(p, s)
            with self._buffers() as admitted:
                if not admitted:  # the caller stopped waiting: its buffers may hold other KV now
                    for i in fetch:
                        codes[i] = RPC_TIMEOUT
                    return codes
                res = self.store.batch_get_into_multi_buffers([keys[i] for i in fetch], ptrs, sizes)
            # A copy that outlasted the lease may have read a replica the master evicted and
            # reused meanwhile: never call it a hit.
            expired = time.monotonic() - leased_at > MASTER_LEASE_TTL_S
            for i, rc in zip(fetch, res):
                if expired and rc >= 0:
                    codes[i] = LEASE_EXPIRED
                    continue
                if rc >= 0 and rc != want[i][2]:
                    codes[i] = INVALID  # cannot happen after the size check; never call it OK
                    logger.error("kvpool mooncake: get %r returned %d bytes, expected %d", keys[i], rc, want[i][2])
                else:
                    codes[i] = map_code(rc)
                if codes[i] not in (OK, NOT_FOUND):
                    # LEASE_EXPIRED and transfer failures: a load error for vLLM, never a crash.
                    logger.warning("kvpool mooncake: get %r failed with %s (%s)", keys[i], rc, _name(rc))
        return codes

    def _close(self) -> None:
        store, self.store = self.store, None
        if store is None:
            return
        for p, n in self._registered:
            try:
                store.unregister_buffer(p)
            except Exception:  # noqa: BLE001
                pass
        self._registered.clear()
        store.close()


def _object_size(replicas: Any) -> int | None:
    """The object's size from its replica descriptors (None: not stored)."""
    if not replicas:
        return None
    for r in replicas:
        try:
            if r.is_memory_replica():
                return int(r.get_memory_descriptor().buffer_descriptor.size)
            d = r.get_disk_descriptor()
            for attr in ("object_size", "file_size", "size"):
                if hasattr(d, attr):
                    return int(getattr(d, attr))
        except Exception:  # noqa: BLE001 - unknown descriptor kinds
            continue
    return None


def _name(rc: int) -> str:
    try:
        return ErrorCode(rc).name
    except ValueError:
        return {-703: "REPLICA_IS_NOT_READY", -705: "OBJECT_ALREADY_EXISTS", -800: "TRANSFER_FAIL"}.get(rc, "UNKNOWN")


# ---- `kvpool doctor` ---------------------------------------------------------------------------


# mooncake_master's own default for --default_kv_lease_ttl
MASTER_DEFAULT_LEASE_MS = 10000


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: mooncake`: mooncake.json, the master, leases, SSD offload, memory."""
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
    lease = args.default_kv_lease_ttl or MASTER_DEFAULT_LEASE_MS
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
        limit = env_int(env, "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", report)
        check_ssd_quota(mc.ssd_offload_path, limit if limit is not None else 2 * TB,
                        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES" + ("" if limit is not None else " (unset: 2TB)"),
                        args.ranks_per_host, report,
                        "export MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES=<disk size / ranks per host>")
        bucket = env_int(env, "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE", report)
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
