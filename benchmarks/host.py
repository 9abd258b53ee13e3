"""Facts about the machine a benchmark runs on, with the standard library only (the device
check imports this on an accelerator machine that has torch and nothing of ours installed)."""

from __future__ import annotations

from pathlib import Path


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
