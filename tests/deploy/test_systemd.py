"""deploy/systemd/: `systemd-analyze verify` accepts both units; their commands, expanded as
systemd expands them (specifiers, `$VAR` from the environment file), parse with kvpool's own
parsers; and they start: the server unit's command serves its socket in a runtime directory
made as systemd makes it, and stops cleanly on the unit's KillSignal; the proxy unit's command
answers `GET /health`. No systemd manager is needed (none runs here)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployfiles import SYSTEMD, comment_above, environment_file, expand_exec, flag_value, parse_kvpool, unit
from kvpool.config import ServerSettings, from_flags
from kvpool.proxy.config import config_from_args as proxy_config
from kvpool.testing.proc import free_port

UNITS = ("kvpool-server.service", "kvpool-proxy.service")
ENV_FILES = {"kvpool-server.service": "server.env", "kvpool-proxy.service": "proxy.env"}
VENV_BIN = Path(sys.executable).parent
OPT_BIN = "/opt/kvpool/bin/"  # where the units (and the Dockerfile's virtualenv) keep kvpool


def service(name: str) -> dict[str, list[str]]:
    return unit(SYSTEMD / name)["Service"]


def exec_start(name: str, runtime_dir: str = "/run", **overrides: str) -> list[str]:
    """The unit's ExecStart as systemd would run it: %t the runtime directory, the variables
    from the unit's environment file (a site's values, overridden by `overrides`)."""
    env = {**environment_file(SYSTEMD / ENV_FILES[name]), **overrides}
    (line,) = service(name)["ExecStart"]
    return expand_exec(line, env, {"t": runtime_dir})


def here(argv: list[str]) -> list[str]:
    """The same command with this checkout's virtualenv in place of /opt/kvpool."""
    assert argv[0].startswith(OPT_BIN), argv
    return [str(VENV_BIN / argv[0][len(OPT_BIN):]), *argv[1:]]


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verify_accepts_the_unit(name, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")  # a failure under CI=true
    # verify also checks that ExecStart's program exists: point it at this checkout's kvpool.
    text = (SYSTEMD / name).read_text().replace(OPT_BIN, f"{VENV_BIN}/")
    copy = tmp_path / name
    copy.write_text(text)
    res = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    # It exits 0 even for an unknown key ("Unknown key ..., ignoring"): any output is a finding.
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_verify_would_catch_a_bad_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    copy = tmp_path / "bad.service"
    copy.write_text((SYSTEMD / UNITS[0]).read_text().replace(OPT_BIN, f"{VENV_BIN}/")
                    .replace("RuntimeDirectoryMode=", "RuntimeDirMode="))
    res = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in res.stdout + res.stderr


def test_the_server_unit_runs_kvpool_server_on_a_socket_in_its_private_runtime_directory():
    s = service("kvpool-server.service")
    assert s["Type"] == ["simple"] and s["User"] == ["kvpool"]
    assert s["RuntimeDirectory"] == ["kvpool"] and s["RuntimeDirectoryMode"] == ["0700"]
    argv = exec_start("kvpool-server.service")
    args = parse_kvpool(argv)
    assert args.cmd == "server"
    settings = from_flags(args, ServerSettings)
    assert settings.socket_path == "/run/kvpool/server.sock"  # in RuntimeDirectory=
    assert settings.memory_size >= 1 << 30
    # SIGTERM is the server's clean shutdown; exit statuses 1 and 2 are not worth a restart.
    assert s["KillSignal"] == ["SIGTERM"] and s["RestartPreventExitStatus"] == ["1 2"]
    # No private /dev: the vLLM instances must map the arena in the host's /dev/shm.
    assert "PrivateDevices" not in s and "RemoveIPC" not in s


def test_the_proxy_unit_runs_kvpool_proxy_on_an_explicit_address():
    s = service("kvpool-proxy.service")
    assert s["DynamicUser"] == ["yes"] and s["RestartPreventExitStatus"] == ["2"]
    assert s["EnvironmentFile"] == ["/etc/kvpool/proxy.env"]  # required: the instances are the site's
    config = proxy_config(parse_kvpool(exec_start("kvpool-proxy.service")), env={})
    assert config.instances and config.host not in ("127.0.0.1", "localhost", "::1")
    assert "--host" in comment_above(SYSTEMD / "proxy.env", "KVPOOL_PROXY_ARGS=")


def test_environment_files_are_what_the_units_read():
    for name, env_file in ENV_FILES.items():
        files = service(name)["EnvironmentFile"]
        assert [f.lstrip("-") for f in files] == [f"/etc/kvpool/{env_file}"]
        variables = environment_file(SYSTEMD / env_file)
        (line,) = service(name)["ExecStart"]
        assert {w[1:] for w in line.split() if w.startswith("$")} == set(variables) - {"KVPOOL_PROXY_ADMIN_TOKEN"}


def test_systemd_expansion_is_modelled_as_systemd_does_it():
    env = {"ARGS": "--a 1  --b", "EMPTY": "", "ONE": "x y"}
    assert expand_exec("/bin/p %t/s $ARGS $EMPTY ${ONE} '%%'", env, {"t": "/run"}) == \
        ["/bin/p", "/run/s", "--a", "1", "--b", "x y", "%"]


def test_the_server_units_command_starts_serves_and_stops_cleanly(tmp_path):
    # The runtime directory as systemd makes it for RuntimeDirectory=kvpool, RuntimeDirectoryMode=0700.
    runtime = tmp_path / "run"
    (runtime / "kvpool").mkdir(parents=True)
    (runtime / "kvpool").chmod(int(service("kvpool-server.service")["RuntimeDirectoryMode"][0], 8))
    site = environment_file(SYSTEMD / "server.env")["KVPOOL_SERVER_ARGS"].split()
    # This machine's /dev/shm may be smaller than the site's memory tier: everything else as shipped.
    site[site.index("--memory-size") + 1] = "64MB"
    argv = here(exec_start("kvpool-server.service", str(runtime), KVPOOL_SERVER_ARGS=" ".join(site)))
    sock = flag_value(argv, "--socket")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            stats = subprocess.run([str(VENV_BIN / "kvpool"), "stats", "--socket", sock, "--json"],
                                   capture_output=True, text=True, timeout=30)
            if stats.returncode == 0:
                break
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, stats.stderr
            time.sleep(0.1)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        proc.send_signal(getattr(signal, service("kvpool-server.service")["KillSignal"][0]))
        assert proc.wait(timeout=float(service("kvpool-server.service")["TimeoutStopSec"][0])) == 0
        assert not os.path.exists(sock)  # removed by the clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_proxy_units_command_starts_and_answers_health():
    # The site's address is not this machine's: listen on loopback, on a free port, instead.
    site = environment_file(SYSTEMD / "proxy.env")["KVPOOL_PROXY_ARGS"].split()
    port = free_port()
    site[site.index("--host") + 1] = "127.0.0.1"
    site[site.index("--port") + 1] = str(port)
    argv = here(exec_start("kvpool-proxy.service", KVPOOL_PROXY_ARGS=" ".join(site)))
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_PROXY_ADMIN_TOKEN"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the proxy did not answer"
                time.sleep(0.2)
        # Its instances (the page's hosts) are not reachable from here: unhealthy, but serving.
        assert r.status_code == 503 and "instance" in r.text.lower(), r.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
