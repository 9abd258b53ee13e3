"""docs/deploy.md's many-host steps, run with stand-ins for their programs (no vLLM, no
services): what each step would start, after the shell's expansion, must be a command line
that kvpool's own parsers accept and that agrees with the other steps (ports, addresses,
files). tests/vllm/test_multihost.py runs the same steps for real; this catches a broken edit
in the fast pass, and gives the other tests of this folder the vLLM flags that test runs."""

from __future__ import annotations

import json

import pytest

import kvpool.backends.mooncake as mooncake
from deployfiles import DEPLOY, DOC, ROOT, SYSTEMD, comment_above, doc_host_vars, environment_file, flag_value
from deployfiles import mooncake_master_flags, own_address, parse_kvpool, run_doc_step
from kvpool.config import load_config
from kvpool.proxy.config import config_from_args as proxy_config
from kvpool.testing.docsteps import doc_steps

STEPS = doc_steps(DOC)
HOST_VARS = doc_host_vars()
OWN_ADDRESS = {h: own_address(h) for h in "ABC"}
run_step = run_doc_step


def only(calls: list[dict], prog: str) -> dict:
    found = [c for c in calls if c["prog"] == prog]
    assert len(found) == 1, calls
    return found[0]


def master_argv(tmp_path) -> list[str]:
    return only(run_step("master", "A", tmp_path), "mooncake_master")["argv"]


def test_the_hosts_step_gives_each_host_an_address_of_its_own():
    assert HOST_VARS["HOST_IP"] == HOST_VARS["HOST_B"]  # "here, host B's"
    assert len(set(OWN_ADDRESS.values())) == 3


def test_the_master_listens_on_its_hosts_address_with_admin_on_loopback(tmp_path):
    argv = master_argv(tmp_path)
    flags = {a.split("=", 1)[0].lstrip("-") for a in argv if a.startswith("-")}
    assert flags <= mooncake_master_flags(), flags - mooncake_master_flags()
    assert flag_value(argv, "--rpc_address") == OWN_ADDRESS["A"]
    assert flag_value(argv, "--metrics_host") == "127.0.0.1"


def test_each_instance_host_writes_a_mooncake_json_naming_itself_and_the_master(tmp_path):
    port = flag_value(master_argv(tmp_path), "--rpc_port")
    for host in STEPS["config"].hosts:
        assert run_step("config", host, tmp_path) == []  # a file, nothing started
        path = tmp_path / host / "conf" / "mooncake.json"
        cfg = mooncake.load_mooncake_config(str(path), {})
        assert cfg.local_hostname == OWN_ADDRESS[host]
        assert cfg.master_server_address == f"{OWN_ADDRESS['A']}:{port}"
        assert cfg.protocol == "tcp" and cfg.metadata_server == "P2PHANDSHAKE"
        assert json.loads(path.read_text())["global_segment_size"] == HOST_VARS["SEGMENT_SIZE"]


def instance_calls(host: str, tmp_path) -> tuple[dict, dict]:
    run_step("config", host, tmp_path)
    calls = run_step("instance", host, tmp_path)
    assert [c["prog"] for c in calls] == ["kvpool", "python"], calls  # doctor first, then vLLM
    return calls[0], calls[1]


def test_each_instance_is_checked_by_doctor_then_served_on_its_hosts_address(tmp_path):
    for host in STEPS["instance"].hosts:
        doctor, vllm = instance_calls(host, tmp_path)
        args = parse_kvpool(doctor["argv"])
        assert args.cmd == "doctor"
        conf = str(tmp_path / host / "conf" / "mooncake.json")
        assert doctor["env"]["MOONCAKE_CONFIG_PATH"] == vllm["env"]["MOONCAKE_CONFIG_PATH"] == conf
        argv = vllm["argv"]
        assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"], argv
        assert flag_value(argv, "--model") == HOST_VARS["MODEL"]
        assert flag_value(argv, "--host") == OWN_ADDRESS[host]
        # One config for both, and it loads.
        kv = json.loads(flag_value(argv, "--kv-transfer-config"))
        assert kv == json.loads(args.kv_transfer_config)
        cfg = load_config(kv["kv_connector_extra_config"], kv["kv_role"])
        assert (cfg.backend, cfg.remote_backend) == ("server", "mooncake")
        assert kv["kv_connector"] == "KVPoolConnector" and kv["kv_load_failure_policy"] == "recompute"
        # The master's lease, as doctor is told.
        assert str(args.default_kv_lease_ttl) == flag_value(master_argv(tmp_path), "--default_kv_lease_ttl")


def test_each_instance_host_runs_its_host_pool_on_the_socket_its_instance_uses(tmp_path):
    from kvpool.config import ServerClientSettings, parse_size
    from kvpool.server.daemon import config_from_args

    for host in STEPS["server"].hosts:
        assert host in STEPS["instance"].hosts
        (server,) = run_step("server", host, tmp_path)
        assert server["prog"] == "kvpool"
        args = parse_kvpool(server["argv"])
        assert args.cmd == "server"
        cfg = config_from_args(args)
        assert cfg.memory_size == parse_size("HOST_POOL_SIZE", HOST_VARS["HOST_POOL_SIZE"])
        assert cfg.socket_path == ServerClientSettings().server_socket  # the backend's default


def test_the_proxy_fronts_exactly_the_instances_on_host_as_address(tmp_path):
    argv = only(run_step("proxy", "A", tmp_path), "kvpool")["argv"]
    config = proxy_config(parse_kvpool(argv), env={})
    assert config.host == OWN_ADDRESS["A"]
    served = set()
    for host in STEPS["instance"].hosts:
        vllm = instance_calls(host, tmp_path)[1]["argv"]
        served.add((flag_value(vllm, "--host"), int(flag_value(vllm, "--port"))))
    assert {(e.host, e.port) for e in config.instances} == served


@pytest.mark.parametrize("step", ["segments", "keys", "where"])
def test_the_checks_ask_the_masters_admin_port_on_loopback(step, tmp_path):
    master = master_argv(tmp_path)
    url = only(run_step(step, "A", tmp_path, KEY="some-key"), "curl")["argv"][-1]
    assert url.startswith(f"http://{flag_value(master, '--metrics_host')}:{flag_value(master, '--metrics_port')}/")


def test_the_proxy_env_file_is_the_pages_proxy_for_the_pages_hosts(tmp_path):
    args = environment_file(SYSTEMD / "proxy.env")["KVPOOL_PROXY_ARGS"].split()
    config = proxy_config(parse_kvpool(["proxy", *args]), env={})
    page = proxy_config(parse_kvpool(only(run_step("proxy", "A", tmp_path), "kvpool")["argv"]), env={})
    assert (config.host, config.port, config.instances) == (page.host, page.port, page.instances)
    # Not loopback, so the file says why.
    assert "--host" in comment_above(SYSTEMD / "proxy.env", "KVPOOL_PROXY_ARGS=")


def test_every_deployment_file_is_explained_on_the_page_and_the_readme_links_it():
    text = DOC.read_text()
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        rel = path.relative_to(ROOT).as_posix()
        assert rel in text or f"`{path.name}`" in text, f"docs/deploy.md does not mention {rel}"
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()
    assert "test_multihost" in (ROOT / "tests" / "vllm" / "README.md").read_text()


def test_a_step_marker_without_its_block_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- step lost on A -->\n\nprose\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="marker"):
        doc_steps(page)
    page.write_text("<!-- step twice -->\n```bash\na\n```\n<!-- step twice -->\n```bash\nb\n```\n")
    with pytest.raises(ValueError, match="twice"):
        doc_steps(page)
