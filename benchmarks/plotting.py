"""What every benchmark's plot shares: matplotlib on the file-only backend, the line that says
where and when the numbers were taken, and one way to title, lay out and save a figure.

Standard library and matplotlib only: `device.py` imports it on an accelerator machine that
has torch and nothing of ours installed (`common` is for the benchmarks that run here).
Each benchmark's own `plot(results, path)` takes the dict its JSON holds, so any plot can be
redrawn from saved results (`benchmarks/replot.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# One colour per role, the same in every plot: kvpool is always blue, the reference (vLLM
# alone, memcpy) always grey-black, peers in their own colours.
COLORS = {
    "kvpool": "tab:blue", "kvpool_serial": "tab:cyan", "kvpool_staged": "tab:purple", "kvpool_layerwise": "goldenrod",
    "kvpool_server": "tab:brown", "kvpool_tiered": "darkred",
    "vllm": "black", "memcpy": "black", "shm": "tab:gray", "local": "tab:cyan", "server": "tab:blue",
    "mooncake": "tab:orange", "example": "tab:green", "example_unchunked": "tab:olive", "redis": "tab:red",
    "yuanrong": "tab:brown", "memcache": "tab:pink", "routed": "tab:purple", "prefix": "black",
    "roomy": "tab:green", "tiered": "darkred",
}


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend, or None when matplotlib is not installed
    (it is optional: the plot is a convenience next to the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark machine; PNG files only
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def environment_of(results: Mapping[str, Any]) -> Mapping[str, Any]:
    """The machine description inside a result JSON (the benchmarks were written at different
    times and call it `environment`, `env` or, in the device check, `machine`)."""
    for key in ("environment", "env", "machine"):
        env = results.get(key)
        if isinstance(env, Mapping):
            return env
    return {}


def run_label(results: Mapping[str, Any]) -> str:
    """One line for a figure: the machine, the date and the commit the numbers come from, so a
    PNG seen on its own still says what it measured."""
    env = environment_of(results)
    parts = []
    cpus, model = env.get("cpu_count"), env.get("cpu_model") or env.get("cpu")
    if env.get("device_name") and not env.get("smoke_run"):
        parts.append(str(env["device_name"]))
    if cpus or model:
        parts.append(" ".join(x for x in (f"{cpus} CPUs" if cpus else "", f"({model})" if model else "") if x))
    date = env.get("date_utc") or env.get("date")
    if date:
        parts.append(str(date)[:10])
    if env.get("vllm"):
        parts.append(f"vLLM {env['vllm']}")
    if env.get("git_commit"):
        parts.append(f"commit {env['git_commit']}")
    if env.get("smoke_run"):
        parts.append("SMOKE RUN on the CPU: checks the code, not a device")
    return ", ".join(parts) or "machine not recorded"


def finish(plt: Any, fig: Any, title: str, results: Mapping[str, Any], path: Path, dpi: int = 110,
           bottom: float = 0.0) -> Path:
    """Title the figure (`title`, then the run's machine and date), lay it out, write it to
    `path` and free it (benchmarks draw several figures in one process). `bottom`: the share of
    the height kept free below the panels for a figure-wide legend, which the layout ignores."""
    fig.suptitle(f"{title}\n{run_label(results)}", fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def no_data(ax: Any, text: str) -> None:
    """Mark a panel that has nothing to show, rather than leave an empty frame that reads as 0."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
