"""`backend: yuanrong` — openYuanrong datasystem (a `datasystem_worker` per host, started by `dscli`).

Configured as in the spec: `DS_WORKER_ADDR` (host:port of the local worker), or the JSON file
named by `YR_CONFIG_PATH` (or `yuanrong_config_path` in `kv_connector_extra_config`) with
`worker_addr`, `connect_timeout_ms`, `request_timeout_ms`, `get_sub_timeout_ms`,
`enable_exclusive_connection`, `tenant_id`, `key_prefix`, `ttl_second`; `DS_WORKER_ADDR` and
`DS_ENABLE_EXCLUSIVE_CONNECTION` beat the file. `DATASYSTEM_CLIENT_LOG_DIR` is where the client
SDK logs (created if missing). `load_yuanrong_config` checks it all without importing the SDK.

Data path (host memory, `KVClient`): a put creates the objects in the worker's shared memory
(`mcreate`), copies each value's buffers into them and publishes them (`mset_buffer`); a get
maps the objects read-only (`get_buffers`) and copies them out, checking sizes before writing a
byte. Objects are written evictable (`NONE_L2_CACHE_EVICT`): a full worker evicts old objects
instead of refusing new ones. Exclusive connections are on by default here (on CPU a call costs
~1.5 ms without them). The device-memory client (`HeteroClient`, NPU) is not used: kvpool hands
backends host buffers.

What the datasystem does differently from the pool engine (measured with 0.8.1):
- no batched put-if-absent: `set` and `mcreate` + `mset_buffer` overwrite, `mset` refuses
  `ExistenceOpt.NX` ("The MSet doesn't support ntx_1"), and `msettx` takes NX but at most 8
  keys, all or none, copied from Python bytes. So a put asks which keys exist (`exist`, one
  call for the batch: the only existence check of a save) and writes the others; the keys it
  found are OBJECT_ALREADY_EXISTS. A concurrent writer of the same key may still replace it
  with the same bytes (keys name content).
- objects of size 0 are refused (kvpool never stores empty values).
- keys: at most 255 characters of `[a-zA-Z0-9-_!@#%^*()+=:;]`; others are normalized
  (`keynorm.py`), so kvpool's keys (which contain `/` and `.`) are stored under normalized names.
- no leases: a read holds its mapping, so bytes being copied are never reused, but eviction
  does not skip looked-up objects.
- a refused put (a value larger than the worker can hold) makes the worker evict everything
  evictable first; a full worker retries allocation for `request_timeout_ms` before failing.
- a worker that is gone is detected by the failing call; calls then fail fast (misses,
  RPC_FAIL) and the client reconnects once the worker's port answers again.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpool.backends.base import Backend, gather, scatter, total_size
from kvpool.backends.diagnosis import Report, check_answers, read_store_config
from kvpool.backends.keynorm import normalize_yuanrong_key
from kvpool.backends.net import parse_host_port, probe
from kvpool.config import KVPoolConfig, YuanrongSettings, parse_bool, read_json_object
from kvpool.errors import BackendUnavailable, ConfigError, ErrorCode, KVPoolError
from kvpool.errors import EXISTS, INTERNAL, INVALID, INVALID_KEY  # the codes as ints
from kvpool.errors import NOT_FOUND, NO_HANDLE, OK, RPC_FAIL, RPC_TIMEOUT

logger = logging.getLogger(__name__)


KNOWN_FIELDS = (
    "worker_addr", "connect_timeout_ms", "request_timeout_ms", "get_sub_timeout_ms",
    "enable_exclusive_connection", "tenant_id", "key_prefix", "ttl_second", "enable_remote_h2d",
)
# vLLM-Ascend's YR_CONFIG_PATH fields that concern its NPU data path: accepted, not used here.
NPU_FIELDS = ("use_layerwise", "remote_h2d_transport_backend", "enable_fabric_mem", "enable_dev_mem_pregister")
_MAX_BATCH = 1000  # mcreate/mset_buffer take < 2000 keys, exist <= 10000


@dataclasses.dataclass(frozen=True)
class YuanrongConfig:
    """The datasystem client's settings (`load_yuanrong_config`): the spec's `YR_CONFIG_PATH` JSON
    (`path`; None without one) with the `DS_*` environment over it; timeouts in milliseconds, as
    the SDK takes them."""

    path: str | None
    worker_addr: str
    connect_timeout_ms: int = 9000
    # A full worker retries allocation until this expires; kvpool's default keeps a refused put
    # short (the SDK's 0 means "the connect timeout").
    request_timeout_ms: int = 1000
    get_sub_timeout_ms: int = 0
    enable_exclusive_connection: bool = True
    tenant_id: str = ""
    key_prefix: str = ""
    ttl_second: int = 0
    client_log_dir: str | None = None
    ignored_fields: tuple[str, ...] = ()
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _int_field(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(key, value, f"an integer >= {minimum}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(key, value, f"an integer >= {minimum}") from None
    if n < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")
    return n


def load_yuanrong_config(path: str | None = None, env: Mapping[str, str] | None = None) -> YuanrongConfig:
    """The datasystem client settings: YR_CONFIG_PATH's JSON (or `path`), then the environment."""
    env = os.environ if env is None else env
    where = "yuanrong_config_path"
    if path is None:
        path, where = env.get("YR_CONFIG_PATH") or None, "YR_CONFIG_PATH"
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        raw = read_json_object(where, path, "client config")
        sources.update({k: path for k in raw})
    addr = raw.get("worker_addr")
    addr_key = "worker_addr"
    if env.get("DS_WORKER_ADDR"):
        addr, addr_key = env["DS_WORKER_ADDR"], "DS_WORKER_ADDR"
        sources["worker_addr"] = "DS_WORKER_ADDR"
    if not addr:
        raise ConfigError(
            "DS_WORKER_ADDR", None,
            "the datasystem worker's host:port, as given to dscli start --worker_address (export "
            "DS_WORKER_ADDR=127.0.0.1:31501, or worker_addr in the YR_CONFIG_PATH JSON)",
        )
    parse_host_port(addr_key, addr)
    exclusive = parse_bool("enable_exclusive_connection", raw.get("enable_exclusive_connection", True))
    if env.get("DS_ENABLE_EXCLUSIVE_CONNECTION") not in (None, ""):
        exclusive = parse_bool("DS_ENABLE_EXCLUSIVE_CONNECTION", env["DS_ENABLE_EXCLUSIVE_CONNECTION"])
        sources["enable_exclusive_connection"] = "DS_ENABLE_EXCLUSIVE_CONNECTION"
    h2d = raw.get("enable_remote_h2d", False)
    if env.get("DS_ENABLE_REMOTE_H2D") not in (None, ""):
        h2d = env["DS_ENABLE_REMOTE_H2D"]
    if parse_bool("enable_remote_h2d", h2d):
        raise ConfigError("DS_ENABLE_REMOTE_H2D", h2d,
                          "0: kvpool's yuanrong backend copies host memory (KVClient); remote H2D is for NPU KV caches")
    for key in ("tenant_id", "key_prefix"):
        if not isinstance(raw.get(key, ""), str):
            raise ConfigError(key, raw[key], "a string")
    prefix = raw.get("key_prefix", "")
    if len(prefix) > 64:
        raise ConfigError("key_prefix", prefix, "at most 64 characters")
    log_dir = env.get("DATASYSTEM_CLIENT_LOG_DIR") or None
    if log_dir is not None and not os.path.isabs(log_dir):
        raise ConfigError("DATASYSTEM_CLIENT_LOG_DIR", log_dir, "an absolute directory path")
    return YuanrongConfig(
        path=path,
        worker_addr=addr,
        connect_timeout_ms=_int_field("connect_timeout_ms", raw.get("connect_timeout_ms", 9000), 1),
        request_timeout_ms=_int_field("request_timeout_ms", raw.get("request_timeout_ms", 1000), 0),
        get_sub_timeout_ms=_int_field("get_sub_timeout_ms", raw.get("get_sub_timeout_ms", 0), 0),
        enable_exclusive_connection=exclusive,
        tenant_id=raw.get("tenant_id", ""),
        key_prefix=prefix,
        ttl_second=_int_field("ttl_second", raw.get("ttl_second", 0), 0),
        client_log_dir=log_dir,
        ignored_fields=tuple(sorted(k for k in raw if k not in KNOWN_FIELDS)),
        sources=sources,
    )


def _code_of(exc: BaseException) -> int:
    """The datasystem's RuntimeError ("code: [Out of memory], msg: [...]") -> one of our codes."""
    msg = str(exc)
    if "Out of memory" in msg:
        return NO_HANDLE
    if "Key not found" in msg or "Not exist" in msg:
        return NOT_FOUND
    if "Invalid parameter" in msg and "key" in msg.lower():
        return INVALID_KEY
    if "Invalid parameter" in msg:
        return INVALID
    if "timeout" in msg.lower() or "Timeout" in msg:
        return RPC_TIMEOUT
    if "RPC" in msg or "connect" in msg.lower() or "unavailable" in msg.lower():
        return RPC_FAIL
    return INTERNAL


def _import_sdk() -> Any:
    try:
        from yr.datasystem import KVClient
        from yr.datasystem.kv_client import WriteMode
    except ImportError as exc:
        raise ConfigError(
            "backend", "yuanrong",
            f"openyuanrong-datasystem installed (pip install 'kvpool[yuanrong]'; yr.datasystem must import): {exc}",
        ) from exc
    return KVClient, WriteMode


def _retire(client: Any) -> None:
    """Drop an SDK client on a thread of its own.

    A KVClient whose worker died keeps a thread busy reconnecting (~60% of a core, measured)
    until it is destroyed, and destroying it takes ~3 s: not on the caller's time.
    """
    if client is None:
        return
    box = [client]
    del client

    def drop() -> None:
        time.sleep(1.0)  # let the failing call return first, so this holds the last reference
        box.clear()

    threading.Thread(target=drop, name="kvpool-yr-retire", daemon=True).start()


class YuanrongBackend(Backend):
    """One `KVClient` per process, connected to the host's datasystem worker."""

    name = "yuanrong"
    seal_values = True  # any client of the store can write any key

    @classmethod
    def from_settings(cls, settings: YuanrongSettings, client_name: str) -> "YuanrongBackend":
        return cls(load_yuanrong_config(settings.yuanrong_config_path), client_name)

    def __init__(self, config: YuanrongConfig, client_name: str) -> None:
        self._KVClient, WriteMode = _import_sdk()
        self._evict = WriteMode.NONE_L2_CACHE_EVICT
        self.config = config
        self.client_name = client_name
        self._host, self._port = parse_host_port("worker_addr", config.worker_addr)
        if config.client_log_dir:
            # The SDK reads DATASYSTEM_CLIENT_LOG_DIR when it starts logging and needs it to exist.
            os.makedirs(config.client_log_dir, exist_ok=True)
        self.client: Any = None
        self._names: dict[str, str] = {}
        if not self._link.connect():
            logger.warning("kvpool yuanrong: worker %s is not reachable yet; lookups miss and loads/saves fail "
                           "until it is (retried at least every %.0f s)", config.worker_addr, self.retry_cap_s)

    # ---- connection ---------------------------------------------------------------------------

    def _connect(self) -> bool:
        """A KVClient if the worker's port answers; False (retried after the backoff) otherwise."""
        if self.client is not None:
            return True
        why = probe(self._host, self._port, timeout=1.0)
        if why is None:
            cfg = self.config
            try:
                client = self._KVClient(
                    self._host, self._port, connect_timeout_ms=cfg.connect_timeout_ms, tenant_id=cfg.tenant_id,
                    req_timeout_ms=cfg.request_timeout_ms, enable_exclusive_connection=cfg.enable_exclusive_connection,
                )
                client.init()
                self.client = client
                return True
            except Exception as exc:  # noqa: BLE001 - the SDK raises RuntimeError/TypeError
                why = repr(exc)
        logger.debug("kvpool yuanrong: worker %s: %s", self.config.worker_addr, why)
        return False

    def _sdk(self) -> Any:
        client = self.client
        if client is None:  # dropped by another thread's failing call a moment ago
            raise BackendUnavailable(f"yuanrong worker {self.config.worker_addr} is not connected")
        return client

    def _failed(self, exc: BaseException, what: str) -> int:
        code = _code_of(exc)
        # Only the text: the exception's traceback holds the SDK client, which must not outlive
        # its worker (a log handler that keeps records would keep it alive).
        text = str(exc)
        if code in (RPC_FAIL, RPC_TIMEOUT) and probe(self._host, self._port, timeout=0.2) is not None:
            # The worker is gone: fail fast until the backoff is over, then reconnect (a new client).
            self._link.down()
            dead, self.client = self.client, None
            _retire(dead)
        if code not in (NOT_FOUND, NO_HANDLE):
            logger.warning("kvpool yuanrong: %s failed (%s): %s", what, ErrorCode(code).name, text)
        return code

    def _name(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = normalize_yuanrong_key(self.config.key_prefix + key)
            if len(self._names) > 1_000_000:
                self._names.clear()
            self._names[key] = name
        return name

    # ---- protocol hooks (input checked and deduplicated by Backend) ----------------------------
    # SDK exceptions are handled here, never passed on: their tracebacks hold the KVClient, which
    # must not outlive its worker (see `_failed`).

    def _exist(self, client: Any, names: list[str]) -> list[bool]:
        out: list[bool] = []
        for a in range(0, len(names), 10 * _MAX_BATCH):
            out.extend(bool(x) for x in client.exist(names[a : a + 10 * _MAX_BATCH]))
        return out

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        # No leases in the datasystem (see the module docstring): `lease` changes nothing.
        client = self._sdk()
        try:
            return self._exist(client, [self._name(k) for k in keys])
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "exist")
            self._bump("failures", len(keys))
            return [False] * len(keys)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        client = self._sdk()
        names = [self._name(k) for k in keys]
        try:
            present = self._exist(client, names)  # the datasystem has no batched put-if-absent
        except Exception as exc:  # noqa: BLE001
            return [self._failed(exc, "exist")] * len(keys)
        codes = [EXISTS if p else OK for p in present]
        todo = [i for i, p in enumerate(present) if not p]
        for a in range(0, len(todo), _MAX_BATCH):
            part = todo[a : a + _MAX_BATCH]
            try:
                self._write(client, [names[i] for i in part], [values[i] for i in part])
            except Exception as exc:  # noqa: BLE001
                if len(part) == 1 or _code_of(exc) != NO_HANDLE:
                    code = self._failed(exc, "put")
                    for i in part:
                        codes[i] = code
                    continue
                # One value that cannot fit fails the whole mcreate: store the others one by one.
                for i in part:
                    try:
                        self._write(client, [names[i]], [values[i]])
                    except Exception as exc1:  # noqa: BLE001
                        codes[i] = self._failed(exc1, "put")
        return codes

    def _write(self, client: Any, names: list[str], values: list[list[np.ndarray]]) -> None:
        """Create the objects in the worker's shared memory, fill them, publish them."""
        sizes = [total_size(v) for v in values]
        objs = client.mcreate(names, sizes, write_mode=self._evict, ttl_second=self.config.ttl_second)
        with self._buffers() as admitted:
            if not admitted:  # the caller stopped waiting: its buffers may hold other KV now
                raise KVPoolError("the put's deadline passed before its copy", ErrorCode.RPC_TIMEOUT)
            for obj, bufs in zip(objs, values):
                gather(bufs, np.frombuffer(obj.MutableData(), dtype=np.uint8))
        client.mset_buffer(objs)

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        client = self._sdk()
        codes = [NOT_FOUND] * len(keys)
        want = [total_size(v) for v in values]
        for a in range(0, len(keys), _MAX_BATCH):
            idx = list(range(a, min(a + _MAX_BATCH, len(keys))))
            try:
                bufs = client.get_buffers([self._name(keys[i]) for i in idx], self.config.get_sub_timeout_ms)
            except Exception as exc:  # noqa: BLE001
                code = _code_of(exc)
                if code != NOT_FOUND:  # "Key not found": none of them is there
                    code = self._failed(exc, "get")
                for i in idx:
                    codes[i] = code
                continue
            for i, buf in zip(idx, bufs):
                if buf is None:
                    continue
                src = np.frombuffer(memoryview(buf), dtype=np.uint8)
                if src.size != want[i]:
                    codes[i] = INVALID  # checked before a byte is written
                    continue
                with self._buffers() as admitted:
                    if admitted:
                        scatter(src, values[i])
                    codes[i] = OK if admitted else RPC_TIMEOUT
            del bufs
        return codes

    def _close(self) -> None:
        client, self.client = self.client, None
        del client  # the SDK disconnects when the client object goes (fast while the worker lives)


# ---- `kvpool doctor` ---------------------------------------------------------------------------


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: yuanrong`: its settings, the worker, the client's log directory."""
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
