"""`backend: mooncake`: mooncake.json and its environment overrides (no service needed), then a
real `mooncake_master` going away and coming back, and Mooncake's codes mapped to ours."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import kvpool.backends.mooncake as mc
from kvpool.backends import create_backend, seal
from kvpool.backends.mooncake import MooncakeBackend, load_mooncake_config, map_code
from kvpool.config import load_config
from kvpool.errors import ConfigError, ErrorCode
from kvpool.testing.services import MooncakeMaster, ServiceError, free_port

GiB, MiB = 1 << 30, 1 << 20

SPEC = {  # the spec's mooncake.json, protocol tcp as on this host
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "127.0.0.1:50088",
    "global_segment_size": "1GB",
    "preferred_segment": False,
    "prefer_alloc_in_same_node": True,
}


def write(tmp_path, **fields) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**SPEC, **fields}))
    return str(path)


def err(path, env, key, *needles) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_mooncake_config(path, env)
    assert info.value.key == key, str(info.value)
    for n in needles:
        assert n in str(info.value), str(info.value)
    return info.value


# ---- configuration ---------------------------------------------------------------------------


def test_spec_file_parses(tmp_path):
    cfg = load_mooncake_config(write(tmp_path), {})
    assert cfg.master_server_address == "127.0.0.1:50088"
    assert (cfg.protocol, cfg.metadata_server, cfg.device_name) == ("tcp", "P2PHANDSHAKE", "")
    assert cfg.global_segment_size == GiB and cfg.local_buffer_size == 16 * MiB
    assert cfg.preferred_segment is False and cfg.prefer_alloc_in_same_node is True
    assert cfg.enable_ssd_offload is False and cfg.ssd_offload_path is None
    assert cfg.local_hostname == "127.0.0.1"  # master on this host
    assert cfg.ignored_fields == ()


@pytest.mark.parametrize("size", ["1GB", "1024MB", "1048576KB", "1073741824B", 1073741824, "1073741824"])
def test_size_spellings(tmp_path, size):
    assert load_mooncake_config(write(tmp_path, global_segment_size=size), {}).global_segment_size == GiB


def test_environment_beats_the_file(tmp_path):
    env = {"MOONCAKE_MASTER": "10.1.2.3:6000", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2GB"}
    cfg = load_mooncake_config(write(tmp_path), env)
    assert cfg.master_server_address == "10.1.2.3:6000" and cfg.global_segment_size == 2 * GiB
    assert cfg.sources["master_server_address"] == "MOONCAKE_MASTER"
    # MOONCAKE_CONFIG_PATH names the file when the extra config does not.
    path = write(tmp_path)
    assert load_mooncake_config(None, {"MOONCAKE_CONFIG_PATH": path}).path == path


def test_master_alone_needs_no_file():
    cfg = load_mooncake_config(None, {"MOONCAKE_MASTER": "127.0.0.1:50088"})
    assert cfg.protocol == "tcp" and cfg.global_segment_size == mc.DEFAULT_GLOBAL_SEGMENT_SIZE


def test_missing_everything():
    err(None, {}, "MOONCAKE_CONFIG_PATH", "export MOONCAKE_CONFIG_PATH")


def test_unreadable_file(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    err(str(bad), {}, "mooncake_config_path", "a readable mooncake.json")
    err(None, {"MOONCAKE_CONFIG_PATH": str(tmp_path / "none.json")}, "MOONCAKE_CONFIG_PATH", "a readable")


@pytest.mark.parametrize("addr", ["nohost", "host:", ":50088", "h:99999", 50088])
def test_bad_master_address(tmp_path, addr):
    err(write(tmp_path, master_server_address=addr), {}, "master_server_address", "host:port")
    err(write(tmp_path), {"MOONCAKE_MASTER": str(addr)}, "MOONCAKE_MASTER", "host:port")


def test_protocol(tmp_path):
    assert load_mooncake_config(write(tmp_path, protocol="Ascend"), {}).protocol == "ascend"
    err(write(tmp_path, protocol="udp"), {}, "protocol", "one of tcp, rdma, ascend")


def test_sizes(tmp_path):
    err(write(tmp_path, global_segment_size="1.5XB"), {}, "global_segment_size", "non-negative byte count")
    err(write(tmp_path, global_segment_size="4MB"), {}, "global_segment_size", "at least 16MB")
    err(write(tmp_path), {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"}, "MOONCAKE_GLOBAL_SEGMENT_SIZE", "byte count")
    assert load_mooncake_config(write(tmp_path, global_segment_size=0), {}).global_segment_size == 0


def test_fabric_memory_needs_1gb_multiples(tmp_path):
    fabric = {"ASCEND_ENABLE_USE_FABRIC_MEM": "1"}
    e = err(write(tmp_path, global_segment_size="1280MB"), fabric, "global_segment_size",
            "multiple of 1GB", "ASCEND_ENABLE_USE_FABRIC_MEM=1")
    assert e.value == "1280MB"
    err(write(tmp_path), {**fabric, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1.5GB"}, "MOONCAKE_GLOBAL_SEGMENT_SIZE",
        "multiple of 1GB")
    cfg = load_mooncake_config(write(tmp_path, global_segment_size="20GB", local_buffer_size="1GB"), fabric)
    assert cfg.global_segment_size == 20 * GiB and cfg.local_buffer_size == 0 and cfg.fabric_mem
    # Without fabric memory the same sizes are fine.
    assert load_mooncake_config(write(tmp_path, global_segment_size="1280MB"), {}).global_segment_size == 1280 * MiB


def test_ssd_offload(tmp_path):
    ssd = os.path.realpath(tmp_path / "ssd")
    os.mkdir(ssd)
    cfg = load_mooncake_config(write(tmp_path, enable_ssd_offload=True, ssd_offload_path=ssd), {})
    assert cfg.enable_ssd_offload and cfg.ssd_offload_path == ssd
    err(write(tmp_path, enable_ssd_offload=True), {}, "ssd_offload_path", "required when enable_ssd_offload")
    err(write(tmp_path, enable_ssd_offload=True, ssd_offload_path="rel/dir"), {}, "ssd_offload_path", "absolute")
    err(write(tmp_path, enable_ssd_offload=True, ssd_offload_path=ssd + "/missing"), {}, "ssd_offload_path",
        "an existing directory")
    err(write(tmp_path, enable_ssd_offload="maybe"), {}, "enable_ssd_offload", "true or false")
    # The spec: MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES is a byte literal; "10GB" is silently ignored.
    err(write(tmp_path), {"MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": "10GB"},
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", "digits")
    fabric = {"ASCEND_ENABLE_USE_FABRIC_MEM": "1"}
    on = write(tmp_path, enable_ssd_offload=True, ssd_offload_path=ssd)
    err(on, fabric, "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES", "1280MB")  # the default is not aligned
    assert load_mooncake_config(on, {**fabric, "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": "1073741824"}).fabric_mem


def test_other_fields_are_reported_not_fatal(tmp_path):
    cfg = load_mooncake_config(write(tmp_path, transfer_timeout=5, local_hostname="10.0.0.7"), {})
    assert cfg.ignored_fields == ("transfer_timeout",) and cfg.local_hostname == "10.0.0.7"


def test_extra_config_key_and_bad_file_stop_start_up(tmp_path):
    path = write(tmp_path, protocol="carrier-pigeon")
    with pytest.raises(ConfigError) as info:
        create_backend(load_config({"backend": "mooncake", "mooncake_config_path": path}), "t")
    assert info.value.key == "protocol"


def test_codes_map_to_ours():
    assert map_code(1234) == ErrorCode.OK  # bytes transferred
    assert map_code(-707) == ErrorCode.LEASE_EXPIRED
    assert map_code(-200) == ErrorCode.NO_AVAILABLE_HANDLE
    assert map_code(-703) == ErrorCode.OBJECT_NOT_FOUND
    assert map_code(-705) == ErrorCode.OBJECT_ALREADY_EXISTS  # passed on (the client answers 0 here)
    assert map_code(-800) == ErrorCode.RPC_FAIL
    assert map_code(-12345) == ErrorCode.INTERNAL_ERROR


class _ExpiringStore:
    """Stands in for MooncakeDistributedStore: the object is found, then its lease expires."""

    def health_check(self):
        return 0

    def batch_get_replica_desc(self, keys):
        class D:
            size = 10 + seal.SIZE  # the value, and the seal every value carries

        class R:
            def is_memory_replica(self):
                return True

            def get_memory_descriptor(self):
                class M:
                    buffer_descriptor = D()

                return M()

        return {k: [R()] for k in keys}

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        return [-707] * len(keys)

    def close(self):
        return 0


def test_lease_expiry_is_a_load_error_not_a_crash():
    b = MooncakeBackend.__new__(MooncakeBackend)
    b.config = load_mooncake_config(None, {"MOONCAKE_MASTER": "127.0.0.1:1"})
    b.store, b._registered = _ExpiringStore(), set()
    dest = [np.full(10, 7, np.uint8)]
    assert b.batch_get_into(["k"], [dest]) == [ErrorCode.LEASE_EXPIRED]
    assert b.stats()["failures"] == 1


# ---- a real master ----------------------------------------------------------------------------


@pytest.fixture
def master(tmp_path):
    try:
        m = MooncakeMaster(tmp_path / "master")
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield m
    m.stop()


def restart(m: MooncakeMaster, workdir) -> MooncakeMaster:
    """A new master on the same ports (a restart: it knows no objects and no segments)."""
    from kvpool.testing.services import Service, mooncake_master_binary

    new = MooncakeMaster.__new__(MooncakeMaster)
    Service.__init__(new, workdir)
    new.port, new.metrics_port = m.port, m.metrics_port
    new._spawn([mooncake_master_binary(), "--port", str(m.port), "--rpc_address", "127.0.0.1",
                "--metrics_host", "127.0.0.1", "--metrics_port", str(m.metrics_port),
                "--eviction_high_watermark_ratio", "0.9", "--eviction_ratio", "0.1", "--default_kv_lease_ttl", "11000"])
    new._wait_port(m.port, 20)
    return new


def test_master_not_there_at_start_then_comes_up(tmp_path, monkeypatch):
    monkeypatch.setattr(MooncakeBackend, "retry_first_s", 0.2)
    monkeypatch.setattr(MooncakeBackend, "retry_cap_s", 0.2)
    port = free_port()
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({**SPEC, "master_server_address": f"127.0.0.1:{port}", "global_segment_size": "16MB"}))
    t0 = time.monotonic()
    b = create_backend(load_config({"backend": "mooncake", "mooncake_config_path": str(cfg)}), "late")
    data = np.arange(1000, dtype=np.uint8)
    assert b.batch_exists(["k"]) == [False]
    assert b.batch_put(["k"], [[data]]) == [ErrorCode.RPC_FAIL]
    assert time.monotonic() - t0 < 5, "a missing master must not stall start-up (setup() alone waits ~90 s)"
    assert b.stats()["connect_failures"] >= 1
    m = MooncakeMaster.__new__(MooncakeMaster)
    m.port, m.metrics_port = port, free_port()
    m = restart(m, tmp_path / "late-master")
    try:
        time.sleep(0.3)
        assert b.batch_put(["k"], [[data]]) == [ErrorCode.OK]
        out = [np.empty(1000, np.uint8)]
        assert b.batch_get_into(["k"], [out]) == [ErrorCode.OK] and np.array_equal(out[0], data)
    finally:
        b.close()
        m.stop()


def test_master_stops_mid_run_then_restarts(master, tmp_path):
    holder = master.write_config(tmp_path / "h.json", "16MB")
    b = create_backend(load_config({"backend": "mooncake", "mooncake_config_path": holder}), "holder")
    data = np.arange(4096, dtype=np.uint8)
    assert b.batch_put(["a"], [[data]]) == [ErrorCode.OK]
    master.stop()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert b.batch_exists(["a"], lease=True) == [False]
    assert b.batch_put(["b"], [[data]]) == [ErrorCode.RPC_FAIL]
    dest = [np.full(4096, 0xA5, np.uint8)]
    assert b.batch_get_into(["a"], [dest]) == [ErrorCode.RPC_FAIL] and (dest[0] == 0xA5).all()
    assert time.monotonic() - t0 < 1, "calls to a dead master must fail fast (Mooncake's RPC timeout is ~4 s)"
    m2 = restart(master, tmp_path / "m2")
    try:
        deadline = time.monotonic() + 10
        while b.batch_put(["b"], [[data]]) != [ErrorCode.OK]:  # the client re-mounts its segment
            assert time.monotonic() < deadline, "the client did not come back after the master restarted"
            time.sleep(0.2)
        out = [np.empty(4096, np.uint8)]
        assert b.batch_get_into(["b"], [out]) == [ErrorCode.OK] and np.array_equal(out[0], data)
        # The restarted master knows nothing of what the old one held: a miss, not stale bytes.
        assert b.batch_exists(["a"]) == [False]
    finally:
        b.close()
        m2.stop()


def test_objects_live_in_the_holders_segment(master, tmp_path):
    holder = create_backend(load_config({"backend": "mooncake",
                                         "mooncake_config_path": master.write_config(tmp_path / "h.json", "16MB")}), "h")
    client = create_backend(load_config({"backend": "mooncake",
                                         "mooncake_config_path": master.write_config(tmp_path / "c.json", 0)}), "c")
    data = np.arange(5000, dtype=np.uint8)
    assert client.batch_put(["x"], [[data]]) == [ErrorCode.OK]  # lands in the holder's segment
    out = [np.empty(5000, np.uint8)]
    assert holder.batch_get_into(["x"], [out]) == [ErrorCode.OK] and np.array_equal(out[0], data)
    holder.close()  # its segment, and every object in it, goes
    deadline = time.monotonic() + 5
    while client.batch_exists(["x"]) != [False]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client.batch_put(["y"], [[data]]) == [ErrorCode.NO_AVAILABLE_HANDLE]  # no segment left
    client.close()


def test_kvpool_stats_summarises_the_master(master, tmp_path):
    import subprocess
    import sys

    b = create_backend(load_config({"backend": "mooncake",
                                    "mooncake_config_path": master.write_config(tmp_path / "s.json", "16MB")}), "s")
    try:
        assert b.batch_put(["k1", "k2"], [[np.arange(100, dtype=np.uint8)]] * 2) == [ErrorCode.OK] * 2
        url = f"http://127.0.0.1:{master.metrics_port}"
        run = [sys.executable, "-m", "kvpool.cli", "stats", "--mooncake-metrics-url", url]
        once = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
        assert once.returncode == 0, once.stderr
        numbers = json.loads(once.stdout)
        assert numbers["master_key_count"] == 2 and numbers["master_total_capacity_bytes"] >= 16 << 20
        live = subprocess.run([*run, "--watch", "0.2", "--count", "2"], capture_output=True, text=True, timeout=60)
        assert live.returncode == 0 and live.stdout.count("puts/s") == 2 and "keys" in live.stdout
    finally:
        b.close()


def test_the_masters_eviction_count_is_what_it_evicted(master, tmp_path):
    """`MooncakeMaster.evictions` (the benchmarks' count) reads objects, not bytes or rounds."""
    b = create_backend(load_config({"backend": "mooncake",
                                    "mooncake_config_path": master.write_config(tmp_path / "e.json", "16MB")}), "e")
    try:
        assert master.evictions() == 0
        value = np.zeros(1 << 20, np.uint8)
        for i in range(40):  # 40 MiB through a 16 MiB segment
            assert b.batch_put([f"v{i}"], [[value]]) in ([ErrorCode.OK], [ErrorCode.NO_AVAILABLE_HANDLE])
        stored = sum(b.batch_exists([f"v{i}" for i in range(40)]))
        evicted = master.evictions()
        assert evicted is not None and 0 < evicted <= 40 - stored
    finally:
        b.close()
