"""`kvpool doctor`: each check finds what it should, says how to fix it, and sets the exit status."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvpool.backends import diagnosis
from kvpool.cli import doctor
from kvpool.cli import main as cli_main
from kvpool.testing.services import RedisService, free_port

GiB = 1 << 30


def run(tmp_path, extra: dict, env: dict | None = None, top: dict | None = None, **opts):
    cfg = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": extra, **(top or {})}
    args = argparse.Namespace(kv_transfer_config=json.dumps(cfg), prefix_caching_hash_algo="sha256",
                              default_kv_lease_ttl=None, ranks_per_host=1, timeout=0.5, json=False)
    for k, v in opts.items():
        setattr(args, k, v)
    args.env = env or {}
    return doctor.diagnose(args)


def levels(report, level: str) -> list[str]:
    return [f.what for f in report.findings if f.level == level]


def has(report, level: str, *needles: str) -> doctor.Finding:
    for f in report.findings:
        if f.level == level and all(n in f.what + " " + f.fix for n in needles):
            return f
    raise AssertionError(f"no {level} with {needles}: {report.findings}")


def mooncake_json(tmp_path, **fields) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
                                "master_server_address": f"127.0.0.1:{free_port()}", "global_segment_size": "1GB",
                                **fields}))
    return str(path)


def test_local_default_is_clean(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB"})
    assert r.errors == 0 and levels(r, "warning") == [], r.findings
    has(r, "ok", "backend local")


def test_cli_exit_status_and_file_form(tmp_path, capsys):
    good = tmp_path / "kv.json"
    good.write_text(json.dumps({"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                                "kv_load_failure_policy": "recompute",
                                "kv_connector_extra_config": {"backend": "local", "local_cpu_size": "64MB"}}))
    assert cli_main(["doctor", "--kv-transfer-config", f"@{good}"]) == 0
    assert "0 error(s)" in capsys.readouterr().out
    assert cli_main(["doctor", "--kv-transfer-config", '{"kv_connector": "KVPoolConnector", '
                     '"kv_connector_extra_config": {"backend": "nope"}}', "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert any(f["level"] == "error" and "backend='nope'" in f["what"] for f in out)


def test_unreadable_config(tmp_path):
    r = doctor.diagnose(argparse.Namespace(kv_transfer_config="{not json", prefix_caching_hash_algo="sha256",
                                           default_kv_lease_ttl=None, ranks_per_host=1, timeout=0.5, json=False,
                                           env={}))
    has(r, "error", "cannot read the kv-transfer-config")
    r = doctor.diagnose(argparse.Namespace(kv_transfer_config=f"@{tmp_path}/missing.json",
                                           prefix_caching_hash_algo="sha256", default_kv_lease_ttl=None,
                                           ranks_per_host=1, timeout=0.5, json=False, env={}))
    assert r.errors == 1


def test_bad_key_is_named_with_its_fix(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_sise": "1GB"})
    f = has(r, "error", "local_cpu_sise='1GB' is invalid")
    assert "a known kv_connector_extra_config key" in f.fix


def test_seven_independent_faults_are_all_reported_in_one_run(tmp_path, capsys):
    ssd = os.path.realpath(tmp_path / "ssd")
    os.mkdir(ssd)
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "retry",  # 1: not a policy vLLM knows
        "kv_ip": "xx.xx.xx.xx",  # 2: the guide's placeholder, copied as is; 7: a key vLLM 0.32 refuses
        "kv_connector_extra_config": {
            "backend": "local", "local_cpu_size": "64MB",
            "load_asynk": True,  # 3: misspelt
            "transfer_timeout_s": 0,  # 4: out of range
            "ssd_offload_path": ssd, "ssd_quota": "1000TB",  # 5: more than the disk
        }}))
    args = ["doctor", "--kv-transfer-config", f"@{cfg}", "--prefix-caching-hash-algo", "xxhash", "--json"]  # 6: unseeded
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update(env)
    try:
        assert cli_main(args) == 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    findings = json.loads(capsys.readouterr().out)  # stdout is the JSON alone: safe in a pipe
    errors = [f for f in findings if f["level"] == "error"]
    wanted = ["kv_load_failure_policy='retry'", "kv_ip='xx.xx.xx.xx' is a placeholder", "did you mean 'load_async'",
              "transfer_timeout_s=0 is invalid", "exceeds the disk", "xxhash with PYTHONHASHSEED unset",
              "unknown key 'kv_ip'"]
    for needle in wanted:
        assert sum(needle in f["what"] + " " + f["fix"] for f in errors) == 1, (needle, errors)
    assert len(errors) == 7, errors
    by_what = {needle: next(f for f in errors if needle in f["what"] + " " + f["fix"]) for needle in wanted}
    assert by_what["transfer_timeout_s=0 is invalid"]["source"] == f"file:{cfg}"
    assert by_what["xxhash with PYTHONHASHSEED unset"]["source"] == "argument:--prefix-caching-hash-algo"


def test_placeholders_and_a_transport_without_its_device(tmp_path):
    assert diagnosis.placeholder("xx.xx.xx.xx:50088") and diagnosis.placeholder("<master ip>:50088")
    assert diagnosis.placeholder("${MASTER_HOST}") and not diagnosis.placeholder("192.168.1.10:50088")
    assert not diagnosis.placeholder("/tmp/kvpool-0/server.sock") and not diagnosis.placeholder("P2PHANDSHAKE")
    path = mooncake_json(tmp_path, local_hostname="xx.xx.xx.xx", protocol="ascend")
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path})
    f = has(r, "error", "local_hostname='xx.xx.xx.xx' is a placeholder")
    assert f.source == f"file:{path}"
    if not any(n.startswith("davinci") for n in os.listdir("/dev")):
        has(r, "error", "protocol 'ascend', but this host has no Ascend NPU")


def test_the_spec_connector_name_is_a_warning_not_an_error(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB"}, top={"kv_connector": "AscendStoreConnector"})
    assert r.errors == 0
    has(r, "warning", "upstream vLLM does not register it")


def test_failure_policy_and_multiconnector(tmp_path):
    r = run(tmp_path, {"backend": "local"}, top={"kv_load_failure_policy": "fail"})
    has(r, "warning", "kv_load_failure_policy is 'fail'", "recompute")
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer"},
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
         "kv_connector_extra_config": {"backend": "local", "local_cpu_size": "64MB"}}]}}
    args = argparse.Namespace(kv_transfer_config=json.dumps(multi), prefix_caching_hash_algo="sha256",
                              default_kv_lease_ttl=None, ranks_per_host=1, timeout=0.5, json=False, env={})
    r = doctor.diagnose(args)
    has(r, "ok", "role kv_producer")
    has(r, "warning", "inside the MultiConnector", "top-level")
    multi["kv_connector_extra_config"]["connectors"].pop()
    args.kv_transfer_config = json.dumps(multi)
    has(doctor.diagnose(args), "error", "no KVPoolConnector")


def test_hash_seed_rule(tmp_path):
    has(run(tmp_path, {"backend": "local"}, prefix_caching_hash_algo="xxhash"), "error", "PYTHONHASHSEED unset",
        "export PYTHONHASHSEED=0")
    r = run(tmp_path, {"backend": "local"}, env={"PYTHONHASHSEED": "0"}, prefix_caching_hash_algo="xxhash_cbor")
    has(r, "ok", "PYTHONHASHSEED='0'", "same value")
    assert r.errors == 0
    has(run(tmp_path, {"backend": "local"}, prefix_caching_hash_algo="md5"), "error", "not one of vLLM's")


def test_mooncake_master_down_alignment_and_lease(tmp_path):
    path = mooncake_json(tmp_path)
    env = {"ASCEND_CONNECT_TIMEOUT": "10000", "ASCEND_TRANSFER_TIMEOUT": "10000"}
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path}, env=env, default_kv_lease_ttl=11000)
    has(r, "error", "does not answer", "mooncake_master --rpc_address")
    has(r, "ok", "exceeds the Ascend connect/transfer timeouts")
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path}, env=env, default_kv_lease_ttl=9000)
    has(r, "error", "default_kv_lease_ttl=9000", "ASCEND_CONNECT_TIMEOUT=10000")
    has(r, "error", "ASCEND_TRANSFER_TIMEOUT=10000")
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path}, env={}, default_kv_lease_ttl=2000)
    has(r, "error", "default_kv_lease_ttl=2000", "--default_kv_lease_ttl 5000")
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": mooncake_json(tmp_path, global_segment_size="1280MB")},
            env={"ASCEND_ENABLE_USE_FABRIC_MEM": "1"})
    has(r, "error", "global_segment_size='1280MB' is invalid", "multiple of 1GB")
    has(run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path}, env={"ASCEND_CONNECT_TIMEOUT": "10s"}),
        "error", "ASCEND_CONNECT_TIMEOUT='10s' is not a whole number")


def test_mooncake_ssd_quota_must_fit_the_disk(tmp_path):
    ssd = os.path.realpath(tmp_path / "ssd")
    os.mkdir(ssd)
    path = mooncake_json(tmp_path, enable_ssd_offload=True, ssd_offload_path=ssd)
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path})  # the 2TB default
    has(r, "error", "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES (unset: 2TB)", "exceeds the disk")
    has(r, "warning", "EVICTION_POLICY is none")
    env = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(1 << 20), "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(1 << 20),
           "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru"}
    r = run(tmp_path, {"backend": "mooncake", "mooncake_config_path": path}, env=env, ranks_per_host=8)
    has(r, "ok", "8 rank(s) x 1.0MB", "fits the disk")
    assert not any("OFFLOAD" in w for w in levels(r, "warning") + levels(r, "error")), r.findings


def test_local_ssd_quota(tmp_path):
    ssd = os.path.realpath(tmp_path / "ssd")
    os.mkdir(ssd)
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB", "ssd_offload_path": ssd, "ssd_quota": "1000TB"})
    has(r, "error", "ssd_quota", "exceeds the disk")


def test_server_not_running(tmp_path):
    sock = str(tmp_path / "no.sock")
    has(run(tmp_path, {"backend": "server", "server_socket": sock}), "error", "no kvpool server answers",
        "kvpool server --socket")


def test_server_socket_in_a_directory_anyone_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    has(run(tmp_path, {"backend": "server", "server_socket": str(shared / "kvpool.sock")}), "error",
        "would not trust", "docs/security.md")


@pytest.mark.services
def test_redis(tmp_path):
    has(run(tmp_path, {"backend": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}), "error",
        "does not answer", "redis-server")
    svc = RedisService(tmp_path / "r")
    try:
        r = run(tmp_path, {"backend": "redis", "redis_url": svc.url})
        assert r.errors == 0
        has(r, "warning", "no maxmemory", "allkeys-lru")
    finally:
        svc.stop()


def test_yuanrong_and_memcache_services_down(tmp_path):
    port = free_port()
    r = run(tmp_path, {"backend": "yuanrong"}, env={"DS_WORKER_ADDR": f"127.0.0.1:{port}",
                                                     "DS_ENABLE_EXCLUSIVE_CONNECTION": "0"})
    has(r, "error", "datasystem worker at", "does not answer", "dscli start -w --worker_address")
    has(r, "warning", "EXCLUSIVE_CONNECTION is off")
    has(run(tmp_path, {"backend": "yuanrong"}), "error", "DS_WORKER_ADDR=None is invalid")
    conf = tmp_path / "mmc-local.conf"
    conf.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                    f"ock.mmc.local_service.config_store_url = tcp://127.0.0.1:{port}\n"
                    "ock.mmc.local_service.protocol = host_tcp\nock.mmc.local_service.dram.size = 1GB\n")
    r = run(tmp_path, {"backend": "memcache", "mmc_local_config_path": str(conf)})
    has(r, "error", "MetaService", "does not answer")
    if not os.path.exists("/usr/local/Ascend/driver/version.info"):
        has(r, "error", "no Ascend NPU driver")


def test_doctor_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, kvpool.cli.doctor, kvpool.cli; kvpool.cli.main(['doctor', '--kv-transfer-config', "
            "'{\"kv_connector\":\"KVPoolConnector\",\"kv_load_failure_policy\":\"recompute\"}']); "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("n", [0, 1])
def test_human_sizes(n):
    assert diagnosis.human(GiB + n) == "1.0GB"


def test_a_remote_tier_is_checked_as_its_own_backend(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB", "remote_backend": "redis",
                       "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    has(r, "ok", "remote tier: redis behind the local host pool")
    has(r, "error", "Redis at redis://127.0.0.1")


def test_a_misspelt_top_level_key_is_an_error_with_the_key_it_meant(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB"}, top={"kv_conector": "KVPoolConnector"})
    has(r, "error", "unknown key 'kv_conector'", "did you mean 'kv_connector'?")


def test_a_bad_kv_role_is_reported_where_it_is_written(tmp_path):
    r = run(tmp_path, {"backend": "local", "local_cpu_size": "64MB"}, top={"kv_role": "kv_bogus"})
    f = has(r, "error", "kv_role='kv_bogus'", "kv_producer, kv_consumer, kv_both")
    assert f.what.startswith("--kv-transfer-config:"), f
