"""`backend: yuanrong`: key normalization, the client settings (DS_WORKER_ADDR, YR_CONFIG_PATH,
...), then a real datasystem worker: kvpool's real keys, and a worker that dies and comes back."""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.backends import create_backend, seal
from kvpool.backends.keynorm import MARKER, KeyNormalizer, normalize_yuanrong_key
from kvpool.backends.yuanrong import load_yuanrong_config
from kvpool.config import load_config
from kvpool.errors import ConfigError, ErrorCode
from kvpool.testing.services import ServiceError, YuanrongWorker, shared_yuanrong_worker

ALLOWED = re.compile(r"^[a-zA-Z0-9\-_!@#%^*()+=:;]*$")
KVPOOL_KEY = "Qwen2.5-7B-Instruct@3f9a0c1b2d4e@tp0/2@pp1/2@g0@" + "ab" * 32


# ---- key normalization -----------------------------------------------------------------------


def test_supported_keys_pass_unchanged():
    for key in ["a", "model@abc@tp0:2@pp0:1@g0@" + "f" * 64, "x" * 255, "!@#%^*()+=:;-_", ""]:
        assert normalize_yuanrong_key(key) == key


def test_other_keys_are_rewritten_within_the_rules():
    for key in [KVPOOL_KEY, "x" * 256, "a/b", "a.b", "sp ace", "ünïcode", "a%%b", "k" * 5000]:
        out = normalize_yuanrong_key(key)
        assert out != key and len(out) <= 255 and ALLOWED.match(out), out
        assert out.count(MARKER) == 1 and normalize_yuanrong_key(key) == out  # deterministic
    # Readable: what fits is kept, illegal characters become '_'.
    assert normalize_yuanrong_key(KVPOOL_KEY).startswith("Qwen2_5-7B-Instruct@3f9a0c1b2d4e@tp0_2@pp1_2@g0@")


def test_near_misses_do_not_collide():
    n = normalize_yuanrong_key
    keys = ["a/b", "a.b", "a_b", "a b", "a%b", "a%%b", "x" * 255, "x" * 256, "x" * 257, "x" * 300 + "1",
            "x" * 300 + "2", KVPOOL_KEY, KVPOOL_KEY.replace("tp0/2", "tp1/2")]
    outs = [n(k) for k in keys]
    assert len(set(outs)) == len(keys), outs
    # A supported key spelled like another key's rewritten form is itself rewritten.
    forged = n("a/b")
    assert n(forged) != forged and n(forged) not in outs


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=300), min_size=2, max_size=30, unique=True))
@example(["a/b", "a_b"])
@example(["x" * 300, "x" * 301])
def test_distinct_keys_never_collide(keys):
    outs = [normalize_yuanrong_key(k) for k in keys]
    assert len(set(outs)) == len(keys)
    assert all(len(o) <= 255 and ALLOWED.match(o) for o in outs)


def test_limit_is_configurable():
    n = KeyNormalizer(max_len=1024)  # the spec's limit, for datasystem releases that take it
    assert n("x" * 1024) == "x" * 1024 and len(n("x" * 1025)) <= 1024
    with pytest.raises(ValueError):
        KeyNormalizer(max_len=10)


# ---- configuration ---------------------------------------------------------------------------


def cfg_err(path, env, key, needle) -> None:
    with pytest.raises(ConfigError) as info:
        load_yuanrong_config(path, env)
    assert info.value.key == key and needle in str(info.value), str(info.value)


def test_ds_worker_addr_alone():
    cfg = load_yuanrong_config(None, {"DS_WORKER_ADDR": "127.0.0.1:31501"})
    assert cfg.worker_addr == "127.0.0.1:31501"
    assert cfg.enable_exclusive_connection is True  # on by default on CPU
    assert (cfg.connect_timeout_ms, cfg.request_timeout_ms, cfg.ttl_second, cfg.key_prefix) == (9000, 1000, 0, "")


def test_yr_config_path_json_form(tmp_path):
    path = tmp_path / "yr.json"
    path.write_text(json.dumps({"worker_addr": "10.0.0.2:31501", "connect_timeout_ms": 12000, "request_timeout_ms": 8000,
                                "get_sub_timeout_ms": 3000, "enable_exclusive_connection": False, "tenant_id": "t1",
                                "key_prefix": "prod:", "ttl_second": 600, "enable_remote_h2d": False,
                                "use_layerwise": False}))
    cfg = load_yuanrong_config(None, {"YR_CONFIG_PATH": str(path)})
    assert (cfg.worker_addr, cfg.connect_timeout_ms, cfg.request_timeout_ms, cfg.get_sub_timeout_ms) == (
        "10.0.0.2:31501", 12000, 8000, 3000)
    assert cfg.enable_exclusive_connection is False and cfg.tenant_id == "t1" and cfg.key_prefix == "prod:"
    assert cfg.ttl_second == 600 and cfg.ignored_fields == ("use_layerwise",)
    # The environment beats the file.
    cfg = load_yuanrong_config(str(path), {"DS_WORKER_ADDR": "127.0.0.1:1", "DS_ENABLE_EXCLUSIVE_CONNECTION": "1"})
    assert cfg.worker_addr == "127.0.0.1:1" and cfg.enable_exclusive_connection is True
    assert cfg.sources["worker_addr"] == "DS_WORKER_ADDR"


def test_bad_settings(tmp_path):
    cfg_err(None, {}, "DS_WORKER_ADDR", "dscli start --worker_address")
    cfg_err(None, {"DS_WORKER_ADDR": "localhost"}, "DS_WORKER_ADDR", "host:port")
    cfg_err(None, {"DS_WORKER_ADDR": "h:1", "DS_ENABLE_EXCLUSIVE_CONNECTION": "sometimes"},
            "DS_ENABLE_EXCLUSIVE_CONNECTION", "true or false")
    cfg_err(None, {"DS_WORKER_ADDR": "h:1", "DS_ENABLE_REMOTE_H2D": "1"}, "DS_ENABLE_REMOTE_H2D", "host memory")
    cfg_err(None, {"DS_WORKER_ADDR": "h:1", "DATASYSTEM_CLIENT_LOG_DIR": "logs"}, "DATASYSTEM_CLIENT_LOG_DIR",
            "absolute")
    path = tmp_path / "yr.json"
    path.write_text(json.dumps({"worker_addr": "h:1", "connect_timeout_ms": -5}))
    cfg_err(str(path), {}, "connect_timeout_ms", "an integer >= 1")
    path.write_text("[]")
    cfg_err(str(path), {}, "yuanrong_config_path", "a JSON object")


# ---- a real worker ---------------------------------------------------------------------------


def yr_backend(tmp_path, worker, name="yr.json", **fields):
    path = tmp_path / name
    path.write_text(json.dumps({"worker_addr": worker.address, "request_timeout_ms": 300,
                                "key_prefix": f"t{time.monotonic_ns()}:", **fields}))
    return create_backend(load_config({"backend": "yuanrong", "yuanrong_config_path": str(path)}), "test")


@pytest.fixture(scope="module")
def worker():
    try:
        return shared_yuanrong_worker()
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)


def test_kvpool_keys_round_trip_under_normalized_names(tmp_path, worker, monkeypatch):
    log_dir = tmp_path / "client-logs"
    monkeypatch.setenv("DATASYSTEM_CLIENT_LOG_DIR", str(log_dir))
    b = yr_backend(tmp_path, worker)
    assert log_dir.is_dir()
    keys = [KVPOOL_KEY, KVPOOL_KEY.replace("tp0/2", "tp1/2"), "plain-key", "x/" * 200]
    vals = [np.frombuffer(os.urandom(3000 + i), np.uint8) for i in range(len(keys))]
    assert b.batch_put(keys, [[v] for v in vals]) == [ErrorCode.OK] * len(keys)
    assert b.batch_exists(keys + ["absent/key"]) == [True] * len(keys) + [False]
    outs = [[np.empty(v.size, np.uint8)] for v in vals]
    assert b.batch_get_into(keys, outs) == [ErrorCode.OK] * len(keys)
    assert all(np.array_equal(o[0], v) for o, v in zip(outs, vals))
    # What the datasystem holds is the normalized name (with the configured prefix) of the
    # sealed value's name.
    from yr.datasystem import KVClient

    raw = KVClient(*worker.address.split(":")[:1], int(worker.address.split(":")[1]))
    raw.init()
    prefix = b.config.key_prefix
    names = [normalize_yuanrong_key(prefix + seal.stored_key(k)) for k in (KVPOOL_KEY, "plain-key")]
    assert raw.exist(names) == [True, True]
    b.close()


@pytest.mark.services
def test_a_start_that_outlasts_its_timeout_is_a_service_error(tmp_path):
    """`dscli start` still waiting at the deadline: a ServiceError naming it (a bare
    TimeoutExpired once left the worker it had started running, outside every clean-up)."""
    with pytest.raises(ServiceError, match="did not return within"):
        YuanrongWorker(tmp_path / "w", shared_memory_mb=64, timeout=0.5)


@pytest.mark.services
def test_worker_dies_then_comes_back(tmp_path):
    # A workdir deep enough that the worker's default socket path would pass the 107 bytes a
    # Unix socket path may hold (as pytest's tmp_path can be, with a longer user name).
    workdir = tmp_path / ("deep" * 20) / "w"
    try:
        w = YuanrongWorker(workdir, shared_memory_mb=64)
    except ServiceError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        b = yr_backend(tmp_path, w, connect_timeout_ms=2000)
        data = np.arange(5000, dtype=np.uint8)
        assert b.batch_put(["k/1"], [[data]]) == [ErrorCode.OK]
        pid = w.pid
        w.kill()
        assert pid is not None and w.pid is None
        t0 = time.monotonic()
        dest = [np.full(5000, 0xA5, np.uint8)]
        code = b.batch_get_into(["k/1"], [dest])[0]
        assert code in (ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT) and (dest[0] == 0xA5).all()
        assert b.batch_exists(["k/1"]) == [False]
        assert b.batch_put(["k/2"], [[data]]) == [ErrorCode.RPC_FAIL]
        assert time.monotonic() - t0 < 5, "calls to a dead worker must fail fast"
        # A new worker on the same address: the backend reconnects by itself.
        w.start()
        assert w.pid not in (None, pid)
        deadline = time.monotonic() + 15
        while b.batch_put(["k/2"], [[data]]) != [ErrorCode.OK]:
            assert time.monotonic() < deadline, "the backend did not reconnect to the restarted worker"
            time.sleep(0.3)
        out = [np.empty(5000, np.uint8)]
        assert b.batch_get_into(["k/2"], [out]) == [ErrorCode.OK] and np.array_equal(out[0], data)
        b.close()
    finally:
        w.kill()
    assert w.pid is None
