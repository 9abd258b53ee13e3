"""`backend: memcache`: mmc-local.conf parsing, and what happens on this (NPU-less) host: the
MetaService runs, the embedded local service cannot start (see docs/backends.md)."""

from __future__ import annotations

import pytest

from kvpool.backends import create_backend
from kvpool.backends.memcache import load_memcache_config
from kvpool.config import load_config
from kvpool.errors import BackendUnavailable, ConfigError
from kvpool.testing.services import MemcacheMetaService, ServiceError

SPEC_LOCAL = """\
ock.mmc.meta_service_url = tcp://10.0.0.1:5000
ock.mmc.local_service.config_store_url = tcp://10.0.0.1:6000
ock.mmc.log_level = error
ock.mmc.local_service.world_size = 256
ock.mmc.local_service.protocol = device_sdma
ock.mmc.local_service.dram.size = 1GB
"""


def conf(tmp_path, text: str) -> str:
    p = tmp_path / "mmc-local.conf"
    p.write_text(text)
    return str(p)


def bad(path, env, key, needle) -> None:
    with pytest.raises(ConfigError) as info:
        load_memcache_config(path, env)
    assert info.value.key == key and needle in str(info.value), str(info.value)


def test_spec_local_config_parses(tmp_path):
    cfg = load_memcache_config(None, {"MMC_LOCAL_CONFIG_PATH": conf(tmp_path, "# comment\n\n" + SPEC_LOCAL)})
    assert cfg.meta_service_url == "tcp://10.0.0.1:5000" and cfg.config_store_url == "tcp://10.0.0.1:6000"
    assert (cfg.protocol, cfg.world_size, cfg.dram_size, cfg.log_level) == ("device_sdma", 256, 1 << 30, "error")


@pytest.mark.parametrize(
    ("line", "key", "needle"),
    [
        ("ock.mmc.local_service.protocol = carrier_pigeon", "ock.mmc.local_service.protocol", "one of host_tcp"),
        ("ock.mmc.local_service.world_size = 0", "ock.mmc.local_service.world_size", "an integer >= 1"),
        ("ock.mmc.local_service.dram.size = lots", "ock.mmc.local_service.dram.size", "byte count"),
        ("ock.mmc.local_service.dram.size = 0", "ock.mmc.local_service.dram.size", "a size (e.g. 1GB)"),
        ("ock.mmc.log_level = chatty", "ock.mmc.log_level", "one of debug"),
        ("ock.mmc.meta_service_url = 10.0.0.1:5000", "ock.mmc.meta_service_url", "tcp://host:port"),
        ("just some words", "MMC_LOCAL_CONFIG_PATH", "'key = value' lines"),
    ],
)
def test_bad_lines(tmp_path, line, key, needle):
    bad(None, {"MMC_LOCAL_CONFIG_PATH": conf(tmp_path, SPEC_LOCAL + line + "\n")}, key, needle)


def test_missing(tmp_path):
    bad(None, {}, "MMC_LOCAL_CONFIG_PATH", "export MMC_LOCAL_CONFIG_PATH")
    bad(str(tmp_path / "none.conf"), {}, "mmc_local_config_path", "a readable MemCache config file")
    text = SPEC_LOCAL.replace("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n", "")
    bad(None, {"MMC_LOCAL_CONFIG_PATH": conf(tmp_path, text)}, "ock.mmc.meta_service_url", "tcp://10.0.0.1:5000")


@pytest.mark.services
def test_meta_service_runs_but_the_local_service_needs_the_npu_driver(tmp_path, capfd):
    """The finding docs/backends.md reports: on an NPU host this test instead sees a working store."""
    try:
        meta = MemcacheMetaService(tmp_path / "meta")
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        assert meta.alive()
        path = meta.write_local_config(tmp_path / "mmc-local.conf", protocol="host_tcp")
        try:
            b = create_backend(load_config({"backend": "memcache", "mmc_local_config_path": path}), "mmc-test")
        except BackendUnavailable as exc:
            assert "ascend driver" in str(exc) and "hybm_init" in str(exc)
            # MemCache's own log names the cause.
            assert "ascend driver does not support mf" in capfd.readouterr().out
            return
        import numpy as np  # an NPU host: the store works

        data = np.arange(4096, dtype=np.uint8)
        assert b.batch_put(["k"], [[data]]) == [0]
        out = [np.empty(4096, np.uint8)]
        assert b.batch_get_into(["k"], [out]) == [0] and np.array_equal(out[0], data)
        b.close()
    finally:
        meta.stop()
