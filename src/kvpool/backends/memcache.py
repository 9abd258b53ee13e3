"""`backend: memcache` — MemCache (`memcache-hybrid` on `memfabric-hybrid`), configured by the spec's
`MMC_LOCAL_CONFIG_PATH` (or `mmc_local_config_path`) file, `ock.mmc.* = value` lines.

The MetaService (`python -c "from memcache_hybrid import MetaService; MetaService.main()"`, with
`MMC_META_CONFIG_PATH`) runs on a CPU-only host. The local service that every client embeds does
not: `DistributedObjectStore.init()` fails in memfabric's `hybm_init` for every protocol, the
host ones (`host_tcp`, `host_shm`) included, because it needs the Ascend NPU driver
(`/usr/local/Ascend/driver/version.info`, then the HAL). Measured with 1.3.0; see
docs/backends.md. So this adapter is built from the library's API and the spec, and tested here
only up to that point: its configuration, and the exact error. On an NPU host it uses the
host-memory copy directions (H2G to put, G2H to get) of the batch calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpool.backends.base import Backend, spans
from kvpool.backends.diagnosis import Report, check_answers, read_store_config
from kvpool.backends.net import parse_tcp_url, probe
from kvpool.config import KVPoolConfig, MemcacheSettings, parse_size
from kvpool.errors import BackendUnavailable, ConfigError, ErrorCode
from kvpool.errors import EXISTS, INTERNAL, INVALID, NOT_FOUND, OK, RPC_FAIL, RPC_TIMEOUT  # the codes as ints

logger = logging.getLogger(__name__)

PROTOCOLS = ("host_tcp", "host_shm", "host_rdma", "host_urma", "device_rdma", "device_sdma", "device_uboe",
             "device_urma")
LOG_LEVELS = ("debug", "info", "warn", "error")
# Keys of mmc-local.conf this adapter checks; others are passed through to MemCache (which
# refuses keys it does not know: "Invalid key <...>").
REQUIRED = ("ock.mmc.meta_service_url", "ock.mmc.local_service.config_store_url")
H2G, G2H = 3, 2  # memfabric_hybrid.bm.BmCopyType

# MemCache's MMC_DUPLICATED_OBJECT. Its batch put turns it into 0 ("Duplicated key, put
# operation skipped", mmcache_store.cpp ReturnWrapper); mapped in case a release passes it on.
MMC_DUPLICATED_OBJECT = -3006

NO_NPU_DRIVER = (
    "MemCache's local service could not start (DistributedObjectStore.init returned {rc}). On a host "
    "without the Ascend NPU driver this is expected: memfabric's hybm_init needs the driver "
    "(/usr/local/Ascend/driver/version.info and the HAL library) for every protocol, host_tcp and "
    "host_shm included; its log says 'the current version of ascend driver does not support mf!'. "
    "Use backend mooncake, yuanrong or redis on such hosts."
)


@dataclasses.dataclass(frozen=True)
class MemcacheConfig:
    """MemCache's client config file (`MMC_LOCAL_CONFIG_PATH`), parsed: the fields kvpool reads,
    and every `key = value` entry as written (`entries`)."""

    path: str
    meta_service_url: str
    config_store_url: str
    protocol: str
    world_size: int
    dram_size: int
    hbm_size: int
    log_level: str
    entries: Mapping[str, str]


def parse_conf(path: str, where: str) -> dict[str, str]:
    """`key = value` lines; `#` starts a comment. Raises ConfigError for an unreadable file or line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(where, path, f"a readable MemCache config file: {exc.strerror}") from None
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise ConfigError(where, path, f"'key = value' lines; line {n} is {line!r}")
        out[key.strip()] = value.strip()
    return out


def load_memcache_config(path: str | None = None, env: Mapping[str, str] | None = None) -> MemcacheConfig:
    """Read and check mmc-local.conf (`path`, else $MMC_LOCAL_CONFIG_PATH)."""
    env = os.environ if env is None else env
    where = "mmc_local_config_path"
    if path is None:
        path, where = env.get("MMC_LOCAL_CONFIG_PATH") or None, "MMC_LOCAL_CONFIG_PATH"
    if path is None:
        raise ConfigError("MMC_LOCAL_CONFIG_PATH", None,
                          "the path of mmc-local.conf (export MMC_LOCAL_CONFIG_PATH=/path/mmc-local.conf)")
    conf = parse_conf(path, where)
    for key in REQUIRED:
        if key not in conf:
            raise ConfigError(key, None, f"set in {path}, e.g. {key} = tcp://10.0.0.1:{5000 if 'meta' in key else 6000}")
    parse_tcp_url("ock.mmc.meta_service_url", conf["ock.mmc.meta_service_url"])
    parse_tcp_url("ock.mmc.local_service.config_store_url", conf["ock.mmc.local_service.config_store_url"])
    protocol = conf.get("ock.mmc.local_service.protocol", "host_tcp")
    if protocol not in PROTOCOLS:
        raise ConfigError("ock.mmc.local_service.protocol", protocol, f"one of {', '.join(PROTOCOLS)}")
    ws = conf.get("ock.mmc.local_service.world_size", "1")
    if not (ws.isascii() and ws.isdigit()) or int(ws) < 1:
        raise ConfigError("ock.mmc.local_service.world_size", ws,
                          "an integer >= 1: the number of local services, including those added later")
    level = conf.get("ock.mmc.log_level", "error")
    if level not in LOG_LEVELS:
        raise ConfigError("ock.mmc.log_level", level, f"one of {', '.join(LOG_LEVELS)}")
    dram = parse_size("ock.mmc.local_service.dram.size", conf.get("ock.mmc.local_service.dram.size", "0"))
    hbm = parse_size("ock.mmc.local_service.hbm.size", conf.get("ock.mmc.local_service.hbm.size", "0"))
    if dram == 0 and hbm == 0:
        raise ConfigError("ock.mmc.local_service.dram.size", conf.get("ock.mmc.local_service.dram.size"),
                          "a size (e.g. 1GB) of memory this local service gives the pool (or hbm.size)")
    return MemcacheConfig(
        path=path,
        meta_service_url=conf["ock.mmc.meta_service_url"],
        config_store_url=conf["ock.mmc.local_service.config_store_url"],
        protocol=protocol,
        world_size=int(ws),
        dram_size=dram,
        hbm_size=hbm,
        log_level=level,
        entries=conf,
    )


def _import_store() -> Any:
    try:
        from memcache_hybrid import DistributedObjectStore
    except ImportError as exc:
        raise ConfigError("backend", "memcache",
                          f"memcache-hybrid installed: pip install 'kvpool[memcache]' ({exc})") from exc
    return DistributedObjectStore


class MemcacheBackend(Backend):
    """One `DistributedObjectStore` (an embedded local service) per process."""

    name = "memcache"
    seal_values = True  # any client of the store can write any key

    @classmethod
    def from_settings(cls, settings: MemcacheSettings, client_name: str) -> "MemcacheBackend":
        return cls(load_memcache_config(settings.mmc_local_config_path), client_name)

    def __init__(self, config: MemcacheConfig, client_name: str, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        # MemCache reads MMC_LOCAL_CONFIG_PATH once, when the library is first imported: one
        # config per process, and it must be in the environment before that import.
        import sys

        if "memcache_hybrid" in sys.modules and os.environ.get("MMC_LOCAL_CONFIG_PATH") != config.path:
            raise ConfigError("mmc_local_config_path", config.path,
                              "the same file as MMC_LOCAL_CONFIG_PATH had when memcache_hybrid was first imported in "
                              f"this process ({os.environ.get('MMC_LOCAL_CONFIG_PATH')!r}): MemCache reads it only then")
        os.environ["MMC_LOCAL_CONFIG_PATH"] = config.path
        self._Store = _import_store()
        self.config = config
        self.client_name = client_name
        self.device_id = int(env.get("LOCAL_RANK", "0") or 0)
        self._meta = parse_tcp_url("ock.mmc.meta_service_url", config.meta_service_url)
        self.store: Any = None
        if not self._link.connect():  # BackendUnavailable (no NPU driver) stops start-up
            logger.warning("kvpool memcache: MetaService %s is not reachable yet; lookups miss until it is",
                           config.meta_service_url)

    def _connect(self) -> bool:
        """The embedded local service, once the MetaService answers (retried after the backoff)."""
        if self.store is not None:
            return True
        if probe(*self._meta) is not None:
            return False
        store = self._Store()
        rc = store.init(self.device_id)
        if rc != 0:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
            raise BackendUnavailable(NO_NPU_DRIVER.format(rc=rc))
        self.store = store
        return True

    # ---- protocol hooks (input checked and deduplicated by Backend) ----------------------------

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        res = self.store.batch_is_exist(keys)
        hits = [r == 1 for r in res]
        if lease:
            found = [k for k, h in zip(keys, hits) if h]
            if found:
                self.store.batch_add_lease(found)  # the MetaService's default lease TTL
        return hits

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        # No existence check: MemCache's put is put-if-absent (MMC_DUPLICATED_OBJECT, skipped).
        want = [spans(v) for v in values]
        # The native call reads our buffers and talks to the store in one: admitted as a whole.
        with self._buffers() as admitted:
            if not admitted:
                return [RPC_TIMEOUT] * len(keys)
            res = self.store.batch_put_from_layers(keys, [w[0] for w in want], [w[1] for w in want], H2G)
        codes = []
        for key, rc in zip(keys, res):
            if rc == 0:
                codes.append(OK)
            elif rc == MMC_DUPLICATED_OBJECT:
                codes.append(EXISTS)
            else:
                codes.append(INTERNAL)
                logger.warning("kvpool memcache: put %r failed with MemCache code %s", key, rc)
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        codes = [NOT_FOUND] * len(keys)
        want = [spans(v) for v in values]
        infos = self.store.batch_get_key_info(keys)
        fetch = []
        for i, info in enumerate(infos):
            size = getattr(info, "size", 0) if info is not None else 0
            if size:
                if size != want[i][2]:
                    codes[i] = INVALID  # checked before a byte is written
                else:
                    fetch.append(i)
        if fetch:
            with self._buffers() as admitted:
                if not admitted:
                    return [RPC_TIMEOUT if i in fetch else c for i, c in enumerate(codes)]
                res = self.store.batch_get_into_layers([keys[i] for i in fetch], [want[i][0] for i in fetch],
                                                       [want[i][1] for i in fetch], G2H)
            for i, rc in zip(fetch, res):
                codes[i] = OK if rc == 0 else INTERNAL
                if rc != 0:
                    logger.warning("kvpool memcache: get %r failed with MemCache code %s", keys[i], rc)
        return codes

    def _close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()


# ---- `kvpool doctor` ---------------------------------------------------------------------------


def doctor(cfg: KVPoolConfig, args: argparse.Namespace, report: Report) -> None:
    """`kvpool doctor` for `backend: memcache`: mmc-local.conf, the MetaService, the NPU driver."""
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
