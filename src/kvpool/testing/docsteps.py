"""Shell steps read out of a Markdown page, so that a test runs the page's own commands.

A step is a fenced `bash` block right after a marker comment naming it and the hosts it runs
on:

    <!-- step instance on B C -->
    ```bash
    vllm serve "$MODEL" --host "$HOST_IP" ...
    ```

docs/deploy.md marks its multi-host walk-through this way; tests/vllm/test_multihost.py runs
each step on its hosts, and tests/deploy/test_deploy_doc.py runs them against stand-in
programs that record their arguments, so an edit to the page changes what both tests run and
a page that drifts from working commands fails them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

__all__ = ["DocStep", "assigned_variables", "doc_steps", "used_variables"]

_STEP = re.compile(
    r"^<!--\s*step\s+(?P<name>[a-z][a-z0-9_-]*)(?:\s+on\s+(?P<hosts>[A-Z](?:\s+[A-Z])*))?\s*-->[ \t]*\n"
    r"```(?:bash|sh)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
    re.M | re.S,
)
_MARKER = re.compile(r"^<!--\s*step\b", re.M)
# $NAME and ${NAME...}; special parameters ($1, $@, $?) are not variables a step needs.
_USE = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)=", re.M)


@dataclasses.dataclass(frozen=True)
class DocStep:
    """One marked block: its name, the hosts it runs on (none: not run on a host) and its text."""

    name: str
    hosts: tuple[str, ...]
    script: str
    line: int  # of the marker, 1-based, for messages


def doc_steps(path: str | Path) -> dict[str, DocStep]:
    """The page's steps by name, in page order. ValueError for a marker not followed by a
    bash block, or a name used twice: a step the tests cannot find must not pass silently."""
    text = Path(path).read_text()
    steps: dict[str, DocStep] = {}
    for m in _STEP.finditer(text):
        name = m["name"]
        if name in steps:
            raise ValueError(f"{path}: step {name!r} is defined twice")
        line = text.count("\n", 0, m.start()) + 1
        steps[name] = DocStep(name, tuple((m["hosts"] or "").split()), m["body"], line)
    markers = len(_MARKER.findall(text))
    if markers != len(steps):
        raise ValueError(f"{path}: {markers} step markers but {len(steps)} steps: a marker must be followed "
                         "directly by a ```bash block")
    return steps


def used_variables(script: str) -> set[str]:
    """The shell variables a script expands (outside single quotes, too: a heredoc expands)."""
    return {m["braced"] or m["plain"] for m in _USE.finditer(script)}


def assigned_variables(script: str) -> set[str]:
    """The variables a script sets itself (`NAME=...`, `export NAME=...` at a line's start)."""
    return {m["name"] for m in _ASSIGN.finditer(script)}
