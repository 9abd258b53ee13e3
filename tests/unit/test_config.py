"""`kv_connector_extra_config` -> `KVPoolConfig`: what parses, the defaults, and what stops start-up.

Every rejected value must raise `ConfigError` whose message names the key, the value given and
what was expected, so an operator can fix the config from the log line alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.backends.registry import REGISTRY
from kvpool.config import (
    ALIASES,
    BACKENDS,
    MiB,
    KVPoolConfig,
    LocalSettings,
    RedisSettings,
    known_keys,
    load_config,
    parse_size,
)
from kvpool.errors import ConfigError, ErrorCode

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def real_dir(tmp_path: Path, name: str = "ssd") -> str:
    """An existing, writable directory given by its resolved path (no symlink anywhere in it)."""
    d = tmp_path / name
    d.mkdir()
    return os.path.realpath(d)


def assert_config_error(extra: dict, key: str, value: object, expected: str, kv_role: str = "kv_both") -> ConfigError:
    """load_config(extra) must fail naming `key`, `value` and containing `expected`."""
    with pytest.raises(ConfigError) as info:
        load_config(extra, kv_role)
    err = info.value
    msg = str(err)
    assert err.key == key, msg
    assert err.code == ErrorCode.INVALID_PARAMS
    assert msg.startswith(f"[INVALID_PARAMS -600] {key}="), msg
    assert repr(value) in msg, f"value {value!r} not named in: {msg}"
    assert expected in msg, f"{expected!r} not in: {msg}"
    return err


# ---------------------------------------------------------------------------------------------
# parse_size


@pytest.mark.parametrize(
    "value",
    ["1GB", "1024MB", "1048576KB", "1073741824B", 1073741824, "1073741824", "1gb", "1 GB", " 1G ", "1GiB",
     "1048576K", "1024mib", 1073741824.0],
)
def test_parse_size_spellings_of_one_gib(value):
    assert parse_size("global_segment_size", value) == GiB


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1.5GB", GiB + GiB // 2), ("0.5KB", 512), ("1.5B", 1), ("2TB", 2 << 40), ("0", 0), (0, 0), ("3k", 3072),
     (1.9, 1)],
)
def test_parse_size_units_are_binary_and_fractions_round_down(value, expected):
    assert parse_size("x", value) == expected


@pytest.mark.parametrize("value", ["1.5XB", "-1GB", "abc", True, False, -1, -0.5, "", "GB", "1 G B", "1e9", None,
                                   [1], float("nan")])
def test_parse_size_rejects(value):
    with pytest.raises(ConfigError) as info:
        parse_size("local_cpu_size", value)
    msg = str(info.value)
    assert info.value.key == "local_cpu_size"
    assert f"local_cpu_size={value!r}" in msg
    assert "non-negative byte count" in msg and '"4GB"' in msg


def test_parse_size_rejects_infinity():
    # json.loads accepts Infinity, so a config can carry it.
    with pytest.raises(ConfigError):
        parse_size("local_cpu_size", float("inf"))


# ---------------------------------------------------------------------------------------------
# every documented key parses, from the spec's string spelling too


def test_defaults():
    cfg = load_config({})
    assert cfg == KVPoolConfig()
    assert load_config(None) == cfg
    assert load_config({}, None).kv_role == "kv_both"
    assert (cfg.kv_role, cfg.backend, cfg.lookup_rpc_port) == ("kv_both", "local", 0)
    assert cfg.load_async is False
    assert cfg.consumer_is_to_load is False and cfg.consumer_is_to_put is False
    assert cfg.producer_is_to_load is True  # as the spec's AscendStore: only the consumer is gated
    assert cfg.prefill_pp_size is None and cfg.prefill_pp_layer_partition is None
    assert cfg.discard_partial_chunks is True
    assert cfg.inject_load_failure_every == 0
    assert cfg.stats_log_interval_s == 10.0
    assert cfg.backend_settings == LocalSettings(
        memory_size=2 * GiB,
        eviction_high_watermark_ratio=0.9,
        eviction_ratio=0.1,
        default_kv_lease_ttl_ms=11000,
        offload_path=None,
        offload_quota=0,
        offload_eviction_policy="lru",
    )


def full_extra(ssd: str) -> dict:
    """Every key config.py accepts, spelled as strings as the spec's JSON examples do."""
    return {
        "backend": "local",
        "lookup_rpc_port": "1",
        "load_async": "true",
        "consumer_is_to_load": "true",
        "consumer_is_to_put": "false",
        "producer_is_to_load": "true",
        "save_sync": "true",
        "save_decode_cache": "yes",
        "request_pin_max_s": "1h",
        "prefill_pp_size": "2",
        "prefill_pp_layer_partition": "30,31",
        "discard_partial_chunks": "true",
        "transfer_path": "staged",
        "staging_buffer_size": "64MB",
        "use_layerwise": "true",
        "share_across_tp": "true",
        "copy_threads": "2",
        "lookup_timeout_s": "0.5",
        "transfer_timeout_s": "2",
        "breaker_failures": "4",
        "breaker_cooldown_s": "0.25",
        "inject_load_failure_every": "3",
        "stats_log_interval_s": "5",
        "block_hash_log": ssd + ".hashes.jsonl",
        "local_cpu_size": "4GB",
        "eviction_high_watermark_ratio": "0.8",
        "eviction_ratio": "0.25",
        "eviction_policy": "s3fifo",
        "default_kv_lease_ttl_ms": "5000",
        "ssd_offload_path": ssd,
        "ssd_quota": "10GB",
        "ssd_eviction_policy": "fifo",
        "server_socket": "/tmp/kvpool-test.sock",
        "allowed_gid": "1234",
        "redis_url": "redis://10.0.0.5:6380/2",
        "redis_ttl_s": "3600",
        "redis_chunk_size": "32MB",
        "redis_timeout_s": "2.5",
        "remote_backend": "redis",
        "remote_queue_blocks": "100",
        **backend_files(ssd),
    }


def backend_files(directory: str) -> dict:
    """The backend-file keys, naming files that exist (their content is read by the backends)."""
    out = {}
    for key in ("mooncake_config_path", "yuanrong_config_path", "mmc_local_config_path"):
        path = os.path.join(directory, key + ".conf")
        Path(path).write_text("{}")
        out[key] = path
    return out


def test_every_key_parses_from_strings(tmp_path):
    ssd = real_dir(tmp_path)
    extra = full_extra(ssd)
    # The test covers every key config.py accepts: a new key must be added here (and documented).
    assert set(extra) == known_keys() - set(ALIASES)
    cfg = load_config(extra, "kv_consumer")
    assert cfg == KVPoolConfig(
        kv_role="kv_consumer",
        backend="local",
        lookup_rpc_port=1,
        load_async=True,
        consumer_is_to_load=True,
        consumer_is_to_put=False,
        producer_is_to_load=True,
        save_sync=True,
        save_decode_cache=True,
        request_pin_max_s=3600.0,
        prefill_pp_size=2,
        prefill_pp_layer_partition=(30, 31),
        discard_partial_chunks=True,
        transfer_path="staged",
        staging_buffer_size=64 * MiB,
        use_layerwise=True,
        share_across_tp=True,
        copy_threads=2,
        lookup_timeout_s=0.5,
        transfer_timeout_s=2.0,
        breaker_failures=4,
        breaker_cooldown_s=0.25,
        inject_load_failure_every=3,
        stats_log_interval_s=5.0,
        block_hash_log=ssd + ".hashes.jsonl",
        backend_settings=LocalSettings(
            memory_size=4 * GiB,
            eviction_high_watermark_ratio=0.8,
            eviction_ratio=0.25,
            eviction_policy="s3fifo",
            default_kv_lease_ttl_ms=5000,
            offload_path=ssd,
            offload_quota=10 * GiB,
            offload_eviction_policy="fifo",
        ),
        remote_backend="redis",
        remote_queue_blocks=100,
        remote_settings=RedisSettings(
            redis_url="redis://10.0.0.5:6380/2", redis_ttl_s=3600.0, redis_chunk_size=32 << 20, redis_timeout_s=2.5
        ),
    )
    # The other backends' keys are checked, and each backend finds its own.
    del extra["remote_backend"]  # only a host pool has a remote tier
    assert load_config({**extra, "backend": "redis"}).backend_settings == cfg.remote_settings
    server = load_config({**extra, "backend": "server"}).backend_settings
    assert (server.server_socket, server.allowed_gid) == ("/tmp/kvpool-test.sock", 1234)
    for key in ("mooncake_config_path", "yuanrong_config_path", "mmc_local_config_path"):
        backend = {"mooncake_config_path": "mooncake", "yuanrong_config_path": "yuanrong"}.get(key, "memcache")
        assert getattr(load_config({**extra, "backend": backend}).backend_settings, key) == os.path.join(ssd, key + ".conf")


def test_native_json_types_parse_the_same(tmp_path):
    ssd = real_dir(tmp_path)
    native = {
        "lookup_rpc_port": 1, "load_async": True, "consumer_is_to_load": True, "consumer_is_to_put": False,
        "producer_is_to_load": True, "save_sync": True, "save_decode_cache": True, "request_pin_max_s": 3600,
        "prefill_pp_size": 2, "prefill_pp_layer_partition": [30, 31],
        "discard_partial_chunks": True, "inject_load_failure_every": 3, "stats_log_interval_s": 5,
        "transfer_path": "staged", "staging_buffer_size": 64 * MiB, "use_layerwise": True, "share_across_tp": True,
        "copy_threads": 2,
        "lookup_timeout_s": 0.5, "transfer_timeout_s": 2, "breaker_failures": 4, "breaker_cooldown_s": 0.25,
        "local_cpu_size": 4 * GiB, "eviction_high_watermark_ratio": 0.8, "eviction_ratio": 0.25,
        "eviction_policy": "s3fifo", "default_kv_lease_ttl_ms": 5000, "ssd_offload_path": ssd, "ssd_quota": 10 * GiB,
        "ssd_eviction_policy": "fifo", "server_socket": "/tmp/kvpool-test.sock", "allowed_gid": 1234,
        "redis_url": "redis://10.0.0.5:6380/2", "redis_ttl_s": 3600, "redis_chunk_size": 32 << 20,
        "redis_timeout_s": 2.5, "block_hash_log": ssd + ".hashes.jsonl", "remote_backend": "redis",
        "remote_queue_blocks": 100, **backend_files(ssd),
    }
    assert load_config(native, "kv_consumer") == load_config(full_extra(ssd), "kv_consumer")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ("True", True), ("FALSE", False), (" true ", True), ("1", True),
     ("0", False), ("yes", True), ("no", False), (True, True), (False, False), (1, True), (0, False)],
)
@pytest.mark.parametrize("key", ["load_async", "consumer_is_to_load", "consumer_is_to_put", "producer_is_to_load"])
def test_booleans(key, value, expected):
    assert getattr(load_config({key: value}), key) is expected


@pytest.mark.parametrize("value", ["maybe", "tru", 2, -1, None, 0.5, ""])
@pytest.mark.parametrize("key", ["load_async", "consumer_is_to_load", "consumer_is_to_put", "producer_is_to_load"])
def test_bad_booleans(key, value):
    assert_config_error({key: value}, key, value, "true or false")


def test_spec_pd_consumer_example_works_with_the_local_backend():
    # The spec's decode-node config (consumer puts for PP prefill nodes), backend swapped for `local`.
    extra = {"lookup_rpc_port": "0", "backend": "local", "consumer_is_to_put": True,
             "prefill_pp_size": 2, "prefill_pp_layer_partition": "30,31"}
    cfg = load_config(extra, "kv_consumer")
    assert cfg.lookup_rpc_port == 0
    assert cfg.saves is True and cfg.loads is False
    assert cfg.prefill_pp_size == 2 and cfg.prefill_pp_layer_partition == (30, 31)


def test_partition_accepts_spaces_and_lists():
    cfg = load_config({"prefill_pp_size": "3", "prefill_pp_layer_partition": " 10, 11 ,12"})
    assert cfg.prefill_pp_layer_partition == (10, 11, 12)
    assert load_config({"prefill_pp_size": 1, "prefill_pp_layer_partition": ["7"]}).prefill_pp_layer_partition == (7,)
    assert load_config({"prefill_pp_size": 4}).prefill_pp_layer_partition is None


def test_config_is_immutable():
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.backend = "server"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# aliases


def test_mooncake_rpc_port_alias():
    cfg = load_config({"mooncake_rpc_port": "7"})
    assert cfg.lookup_rpc_port == 7
    assert cfg == load_config({"lookup_rpc_port": 7})


def test_alias_and_new_name_together_is_an_error():
    assert_config_error({"mooncake_rpc_port": "1", "lookup_rpc_port": "2"}, "mooncake_rpc_port", "1",
                        "not both mooncake_rpc_port and lookup_rpc_port; use lookup_rpc_port")


def test_default_kv_lease_ttl_alias_is_milliseconds():
    assert load_config({"default_kv_lease_ttl": "5000"}).backend_settings.default_kv_lease_ttl_ms == 5000
    assert_config_error({"default_kv_lease_ttl": 1, "default_kv_lease_ttl_ms": 2}, "default_kv_lease_ttl", 1,
                        "not both")


def test_alias_does_not_mutate_the_callers_dict():
    extra = {"mooncake_rpc_port": "3"}
    load_config(extra)
    assert extra == {"mooncake_rpc_port": "3"}


# ---------------------------------------------------------------------------------------------
# bad values stop start-up, naming key, value and what is expected


def test_unknown_backend():
    assert_config_error({"backend": "foo"}, "backend", "foo", "one of local, server, mooncake, yuanrong, memcache, redis")


def test_every_backend_is_registered_once():
    # The config's names derive from the schemas; every one has a registry entry and vice versa.
    assert set(BACKENDS) == set(REGISTRY)
    assert BACKENDS == ("local", "server", "mooncake", "yuanrong", "memcache", "redis")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_name_parses(backend):
    assert load_config({"backend": backend}).backend == backend


def test_redis_defaults():
    cfg = load_config({"backend": "redis"}).backend_settings
    assert cfg == RedisSettings(redis_url="redis://127.0.0.1:6379/0", redis_ttl_s=0.0,
                                     redis_chunk_size=64 << 20, redis_timeout_s=5.0)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("redis_url", "http://host:6379", "a URL redis://"),
        ("redis_url", "127.0.0.1:6379", "a URL redis://"),
        ("redis_url", 6379, "a URL redis://"),
        ("redis_chunk_size", "600MB", "from 1MB to 512MB"),
        ("redis_chunk_size", "512KB", "from 1MB to 512MB"),
        ("redis_chunk_size", "lots", "non-negative byte count"),
        ("redis_ttl_s", "-1", "0 (never expire) or a number of seconds from 0.001 to 31536000"),
        ("redis_timeout_s", "0", "a number of seconds from 0.01 to 86400"),
        ("redis_timeout_s", "soon", "a number of seconds from 0.01 to 86400"),
    ],
)
def test_bad_redis_values(key, value, expected):
    assert_config_error({"backend": "redis", key: value}, key, value, expected)


@pytest.mark.parametrize("key", ["mooncake_config_path", "yuanrong_config_path", "mmc_local_config_path"])
def test_backend_file_paths(key, tmp_path):
    assert_config_error({key: "mooncake.json"}, key, "mooncake.json", "an absolute path of an existing file")
    missing = str(tmp_path / "missing.json")
    assert_config_error({key: missing}, key, missing, "an existing file")
    assert_config_error({key: str(tmp_path)}, key, str(tmp_path), "an existing file")
    f = tmp_path / "ok.json"
    f.write_text("{}")
    backend = {"mooncake_config_path": "mooncake", "yuanrong_config_path": "yuanrong"}.get(key, "memcache")
    assert getattr(load_config({"backend": backend, key: str(f)}).backend_settings, key) == str(f)


def test_unknown_key_lists_the_known_ones():
    err = assert_config_error({"backend": "local", "local_cpu_sise": "1GB"}, "local_cpu_sise", "1GB",
                              "a known kv_connector_extra_config key")
    for key in known_keys() - set(ALIASES):
        assert key in err.expected
    assert "did you mean 'local_cpu_size'?" in err.expected


def test_unknown_keys_are_reported_in_sorted_order():
    assert_config_error({"zzz": 1, "aaa": 2}, "aaa", 2, "a known kv_connector_extra_config key")


@pytest.mark.parametrize("role", ["kv_both ", "producer", "KV_BOTH"])
def test_bad_kv_role(role):
    assert_config_error({}, "kv_role", role, "one of kv_producer, kv_consumer, kv_both", kv_role=role)


@pytest.mark.parametrize("role", [None, ""])
def test_unset_kv_role_is_kv_both(role):
    assert load_config({}, role).kv_role == "kv_both"


@pytest.mark.parametrize("value", ["1.5XB", "-1GB", "abc", True, "", None])
@pytest.mark.parametrize("key", ["local_cpu_size", "ssd_quota"])
def test_bad_sizes(key, value, tmp_path):
    extra = {key: value}
    if key == "ssd_quota":
        extra["ssd_offload_path"] = real_dir(tmp_path)
    assert_config_error(extra, key, value, "non-negative byte count")


def test_negative_ssd_quota(tmp_path):
    assert_config_error({"ssd_offload_path": real_dir(tmp_path), "ssd_quota": -1}, "ssd_quota", -1,
                        "non-negative byte count")


@pytest.mark.parametrize("value", [0, "0", "0GB"])
def test_zero_memory_is_rejected(value):
    assert_config_error({"local_cpu_size": value}, "local_cpu_size", value, "a byte size from 1MB to 1PB")


def test_zero_ssd_quota_means_automatic(tmp_path):
    cfg = load_config({"ssd_offload_path": real_dir(tmp_path), "ssd_quota": "0"})
    assert cfg.backend_settings.offload_quota == 0


@pytest.mark.parametrize("value", ["random", "LRU", "", "None"])
def test_bad_ssd_eviction_policy(value, tmp_path):
    assert_config_error({"ssd_offload_path": real_dir(tmp_path), "ssd_eviction_policy": value},
                        "ssd_eviction_policy", value, "one of fifo, lru, none")


@pytest.mark.parametrize("policy", ["none", "fifo", "lru"])
def test_ssd_eviction_policies(policy, tmp_path):
    cfg = load_config({"ssd_offload_path": real_dir(tmp_path), "ssd_eviction_policy": policy})
    assert cfg.backend_settings.offload_eviction_policy == policy


@pytest.mark.parametrize(("key", "value"), [("ssd_quota", "10GB"), ("ssd_eviction_policy", "fifo")])
def test_ssd_settings_without_ssd_offload_path(key, value):
    assert_config_error({key: value}, key, value, "to be used with ssd_offload_path")


class TestSsdOffloadPath:
    def test_resolved_existing_directory(self, tmp_path):
        ssd = real_dir(tmp_path)
        assert load_config({"ssd_offload_path": ssd}).backend_settings.offload_path == ssd

    def test_trailing_slash_is_accepted(self, tmp_path):
        ssd = real_dir(tmp_path) + "/"
        assert load_config({"ssd_offload_path": ssd}).backend_settings.offload_path == ssd

    def test_relative(self):
        assert_config_error({"ssd_offload_path": "kvpool_ssd"}, "ssd_offload_path", "kvpool_ssd", "an absolute path")

    def test_dot_dot(self, tmp_path):
        base = real_dir(tmp_path)
        os.mkdir(os.path.join(base, "a"))
        path = os.path.join(base, "a", "..", "a")  # exists, but through '..'
        assert os.path.isdir(path)
        assert_config_error({"ssd_offload_path": path}, "ssd_offload_path", path, "without '..'")

    def test_symlink(self, tmp_path):
        target = real_dir(tmp_path, "target")
        link = os.path.join(real_dir(tmp_path, "links"), "ssd")
        os.symlink(target, link)
        err = assert_config_error({"ssd_offload_path": link}, "ssd_offload_path", link, "without symlinks")
        assert target in str(err)  # says where it resolves to

    def test_symlink_in_a_parent_component(self, tmp_path):
        target = real_dir(tmp_path, "target")
        os.mkdir(os.path.join(target, "ssd"))
        link = os.path.join(real_dir(tmp_path, "links"), "parent")
        os.symlink(target, link)
        path = os.path.join(link, "ssd")
        assert_config_error({"ssd_offload_path": path}, "ssd_offload_path", path, "without symlinks")

    def test_nonexistent(self, tmp_path):
        path = os.path.join(real_dir(tmp_path), "missing")
        assert_config_error({"ssd_offload_path": path}, "ssd_offload_path", path, "an existing directory")

    def test_a_file(self, tmp_path):
        path = os.path.join(real_dir(tmp_path), "file")
        Path(path).write_bytes(b"x")
        assert_config_error({"ssd_offload_path": path}, "ssd_offload_path", path, "a directory, not a file")

    def test_empty(self):
        assert_config_error({"ssd_offload_path": ""}, "ssd_offload_path", "", "non-empty absolute directory")

    def test_not_writable(self):
        # sysfs refuses new files even to root, unlike a chmod-ed directory.
        assert_config_error({"ssd_offload_path": "/sys/kernel"}, "ssd_offload_path", "/sys/kernel", "writable")


@pytest.mark.parametrize("value", [0, "0", 1.5, "1.5", -0.1, "abc", True, None, float("nan")])
@pytest.mark.parametrize("key", ["eviction_high_watermark_ratio", "eviction_ratio"])
def test_ratios_out_of_range(key, value):
    expected = "a number in (0, 1]"
    assert_config_error({key: value}, key, value, expected)


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), ("1.0", 1.0), ("0.5", 0.5), (0.01, 0.01)])
@pytest.mark.parametrize("key", ["eviction_high_watermark_ratio", "eviction_ratio"])
def test_ratios_in_range(key, value, expected):
    assert getattr(load_config({key: value}).backend_settings, key) == expected


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("lookup_rpc_port", -1, "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", "abc", "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", "1.5", "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", 1.5, "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", True, "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", float("inf"), "an integer from 0 to 2147483647"),
        ("lookup_rpc_port", "\u0663", "an integer from 0 to 2147483647"),  # a non-ASCII digit
        ("prefill_pp_size", 0, "an integer from 1 to 1024"),
        ("prefill_pp_size", "two", "an integer from 1 to 1024"),
        ("default_kv_lease_ttl_ms", 0, "a number of milliseconds from 1 to 86400000"),
        ("default_kv_lease_ttl_ms", 1e15, "a number of milliseconds from 1 to 86400000"),
        ("inject_load_failure_every", -2, "an integer from 0 to 2147483647"),
        ("stats_log_interval_s", "-1", "0 (at every stats collection) or a number of seconds from 0.01 to 86400"),
        ("local_cpu_size", "100000000TB", "a byte size from 1MB to 1PB"),
        ("local_cpu_size", "\u0661GB", "non-negative byte count"),
    ],
)
def test_bad_integers(key, value, expected):
    assert_config_error({key: value}, key, value, expected)


def test_integral_float_is_an_integer():
    assert load_config({"prefill_pp_size": 3.0}).prefill_pp_size == 3


class TestPrefillPpLayerPartition:
    def test_without_prefill_pp_size(self):
        assert_config_error({"prefill_pp_layer_partition": "30,31"}, "prefill_pp_layer_partition", "30,31",
                            "to be set with prefill_pp_size")

    @pytest.mark.parametrize("value", ["30", "30,31,1", "10,10,10,10"])
    def test_wrong_number_of_entries(self, value):
        assert_config_error({"prefill_pp_size": "2", "prefill_pp_layer_partition": value},
                            "prefill_pp_layer_partition", value,
                            "2 positive layer counts, one per prefill PP stage (prefill_pp_size=2)")

    @pytest.mark.parametrize("value", ["30,0", "30,-1"])
    def test_non_positive_entries(self, value):
        assert_config_error({"prefill_pp_size": 2, "prefill_pp_layer_partition": value},
                            "prefill_pp_layer_partition", value, 'comma-separated positive layer counts, e.g. "30,31"')

    @pytest.mark.parametrize("value", ["a,b", "30;31", "30,,31", "30.5,31"])
    def test_not_numbers(self, value):
        assert_config_error({"prefill_pp_size": 2, "prefill_pp_layer_partition": value},
                            "prefill_pp_layer_partition", value, 'comma-separated layer counts, e.g. "30,31"')


@pytest.mark.parametrize("value", [False, "false", "False", "0", 0, "no"])
def test_discard_partial_chunks_false_is_refused(value):
    assert_config_error({"discard_partial_chunks": value}, "discard_partial_chunks", value,
                        "a partial block has no stable block hash, so only full blocks can be pooled")


def test_discard_partial_chunks_bad_value():
    assert_config_error({"discard_partial_chunks": "sometimes"}, "discard_partial_chunks", "sometimes",
                        "true or false")


# ---------------------------------------------------------------------------------------------
# role semantics


@pytest.mark.parametrize("to_load", [False, True])
@pytest.mark.parametrize("to_put", [False, True])
def test_kv_both_saves_and_loads_whatever_the_consumer_flags(to_load, to_put):
    cfg = load_config({"consumer_is_to_load": to_load, "consumer_is_to_put": to_put}, "kv_both")
    assert (cfg.saves, cfg.loads) == (True, True)


@pytest.mark.parametrize("to_load", [False, True])
@pytest.mark.parametrize("to_put", [False, True])
def test_kv_producer_saves_and_loads_and_ignores_the_consumer_flags(to_load, to_put):
    cfg = load_config({"consumer_is_to_load": to_load, "consumer_is_to_put": to_put}, "kv_producer")
    assert (cfg.saves, cfg.loads) == (True, True)


def test_kv_producer_loads_unless_producer_is_to_load_is_false():
    assert load_config({}, "kv_producer").loads is True
    assert load_config({"producer_is_to_load": "true"}, "kv_producer").loads is True
    opt_out = load_config({"producer_is_to_load": "false"}, "kv_producer")
    assert (opt_out.saves, opt_out.loads) == (True, False)


@pytest.mark.parametrize(
    ("to_load", "to_put", "saves", "loads"),
    [(False, False, False, False), (True, False, False, True), (False, True, True, False), (True, True, True, True)],
)
def test_kv_consumer_follows_its_flags(to_load, to_put, saves, loads):
    cfg = load_config({"consumer_is_to_load": str(to_load).lower(), "consumer_is_to_put": str(to_put).lower()},
                      "kv_consumer")
    assert (cfg.saves, cfg.loads) == (saves, loads)


@pytest.mark.parametrize("producer_is_to_load", [False, True])
def test_kv_consumer_and_kv_both_ignore_producer_is_to_load(producer_is_to_load):
    cfg = load_config({"producer_is_to_load": producer_is_to_load}, "kv_consumer")
    assert (cfg.saves, cfg.loads) == (False, False)
    cfg = load_config({"producer_is_to_load": producer_is_to_load}, "kv_both")
    assert (cfg.saves, cfg.loads) == (True, True)


# ---------------------------------------------------------------------------------------------
# documentation stays complete


def test_every_accepted_key_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [k for k in sorted(known_keys())
               if f"`{k}`" not in doc]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_hash_seed_check(monkeypatch):
    from kvpool.vllm.scheduler import check_hash_seed

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    check_hash_seed("sha256")  # vLLM's fixed seed: keys match across processes
    with pytest.raises(ConfigError) as exc:
        check_hash_seed("xxhash")
    assert exc.value.key == "prefix_caching_hash_algo" and "PYTHONHASHSEED" in str(exc.value)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_hash_seed("xxhash")  # the spec's ritual still works


def test_save_sync_defaults_on_for_producers_only():
    assert load_config({}, "kv_producer").save_sync is True
    assert load_config({}, "kv_both").save_sync is False
    assert load_config({}, "kv_consumer").save_sync is False
    assert load_config({"save_sync": "false"}, "kv_producer").save_sync is False


# ---------------------------------------------------------------------------------------------
# no value of any type, for any key, escapes as anything but ConfigError


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["1GB", "0", "-1", "10ms", "lru", "/tmp", "redis://h:1/0", "\u0661", "1e9", "inf", "0600"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backend=st.sampled_from(BACKENDS) | _ANY, key=st.sampled_from(sorted(known_keys())), value=_ANY,
       role=st.sampled_from(["kv_both", "kv_producer", "kv_consumer"]) | _ANY)
def test_any_value_of_any_key_is_accepted_or_a_config_error(backend, key, value, role):
    try:
        cfg = load_config({"backend": backend, key: value}, role)
    except ConfigError as exc:
        assert exc.key and str(exc).startswith(f"[INVALID_PARAMS -600] {exc.key}=")
    else:
        assert cfg.backend == backend and cfg.kv_role in ("kv_both", "kv_producer", "kv_consumer")


def test_automatic_ssd_quota_counts_the_tiers_own_files_as_free(tmp_path, monkeypatch):
    # A restarted pool must not shrink its automatic quota by what its tier already holds
    # (and then evict that to fit): the tier's files count as free space.
    import collections
    import shutil

    tier = tmp_path / "tier"
    (tier / "ab").mkdir(parents=True)
    (tier / "ab" / "obj").write_bytes(b"x" * 3 * MiB)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * MiB, 10 * MiB, 7 * MiB))
    disk = LocalSettings(offload_path=str(tier), offload_quota=0).engine_config().disk
    assert disk is not None and disk.quota_bytes == int(10 * MiB * 0.9)
    disk.close()
    disk = LocalSettings(offload_path=str(tier), offload_quota=5 * MiB).engine_config().disk
    assert disk is not None and disk.quota_bytes == 5 * MiB  # an explicit quota stays as given
    disk.close()


def test_check_config_reports_every_bad_key_and_keeps_the_good_ones():
    from kvpool.config import check_config

    cfg, errors = check_config({"backend": "server", "lookup_rpc_port": "x", "load_asynk": True,
                                "transfer_timeout_s": 0, "copy_threads": 3}, "kv_both")
    assert [e.key for e in errors] == ["load_asynk", "lookup_rpc_port", "transfer_timeout_s"]
    assert "did you mean 'load_async'" in errors[0].expected
    # The valid values stand, the bad ones are at their defaults: the doctor's other checks use it.
    assert cfg is not None and cfg.backend == "server" and cfg.copy_threads == 3
    assert cfg.transfer_timeout_s == load_config({}).transfer_timeout_s
    with pytest.raises(ConfigError) as exc:
        load_config({"backend": "server", "lookup_rpc_port": "x", "load_asynk": True})
    assert exc.value.key == "load_asynk"  # load_config raises the first of them
    assert check_config({"backend": "nope"}, "kv_both")[0] is None


def test_the_docs_sample_error_is_what_a_misspelt_key_says_today():
    # docs/configuration.md shows this message whole, every accepted key listed: it must not go stale.
    with pytest.raises(ConfigError) as exc:
        load_config({"local_cpu_sise": "1GB"})
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert f"\n{exc.value}\n" in doc
