"""A plan's results as a table (stdout), a JSON document and a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvpool.config import human_size

from kvpool.plan.replay import TIERS, Point
from kvpool.tracefile import Trace


def size_text(n: int) -> str:
    """Bytes for a table or a label: "2TB", "1.12TB", "0"."""
    if n == 0:
        return "0"
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if n % scale else human_size(n)
    return f"{n}B"


_HEADS = {"local": "local%", "memory": "mem%", "ssd": "ssd%", "remote": "remote%", "recomputed": "recomp%"}


def table(points: Sequence[Point]) -> str:
    """One row per point: capacities, (policy, instances, hosts,) each tier's share of block
    references; the local cache's only in cluster mode, the remote tier's only where one was
    modelled."""
    cluster = any(p.policy is not None for p in points)
    remote = any(p.remote_bytes for p in points)
    hosts = any(p.hosts > 1 for p in points)
    tiers = [t for t in TIERS if (cluster or t != "local") and (remote or t != "remote")]
    head = ["pool mem", "blocks", "pool ssd"] + (["remote"] if remote else []) + \
        (["policy", "inst"] if cluster else []) + (["hosts"] if hosts else []) + [_HEADS[t] for t in tiers] + \
        ["hit%", "secs"]
    rows = [head]
    for p in points:
        rates = p.counts.rates()
        row = [size_text(p.memory_bytes), str(p.extra.get("capacity_blocks", "")), size_text(p.ssd_bytes)]
        if remote:
            row.append(size_text(p.remote_bytes))
        if cluster:
            row += [p.policy or "", str(p.instances)]
        if hosts:
            row.append(str(p.hosts))
        row += [f"{rates[t] * 100:.1f}%" for t in tiers]
        row += [f"{(1 - rates['recomputed']) * 100:.1f}%", f"{p.seconds:.1f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def document(trace: Trace, source: str, settings: dict[str, Any], points: Sequence[Point]) -> dict[str, Any]:
    """The JSON form: the trace's figures, the settings the plan ran with, every point."""
    return {
        "trace": {"path": source, "requests": len(trace.requests), "block_size": trace.block_size,
                  "block_refs": trace.block_refs, "unique_blocks": trace.unique_blocks},
        "settings": settings,
        "points": [p.as_dict() for p in points],
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def plot(path: str, points: Sequence[Point], title: str) -> None:
    """Hit rate against memory capacity (one line per SSD and remote tier size), or in cluster
    mode against instances (per policy and pool size: all tiers, without the remote tier, without
    the SSD, the local cache alone)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    if any(p.policy is not None for p in points):
        groups: dict[tuple, list[Point]] = {}
        for p in points:
            groups.setdefault((p.policy, p.memory_bytes, p.ssd_bytes, p.remote_bytes), []).append(p)
        multi = len({(m, s, r) for _, m, s, r in groups}) > 1
        for (policy, memory, ssd, remote), pts in groups.items():
            pts.sort(key=lambda q: q.instances or 0)
            xs = [q.instances for q in pts]
            label = policy + (f" mem {size_text(memory)} ssd {size_text(ssd)}" if multi else "")
            label += f" remote {size_text(remote)}" if multi and remote else ""
            line, = ax.plot(xs, [100 * (1 - q.counts.rates()["recomputed"]) for q in pts], marker="o",
                            label=f"{label}: all tiers")
            if remote:
                ax.plot(xs, [100 * (1 - q.counts.rates()["recomputed"] - q.counts.rates()["remote"]) for q in pts],
                        marker="x", linestyle="-.", color=line.get_color(), label=f"{label}: without the remote tier")
            if any(q.ssd_bytes for q in pts):
                ax.plot(xs, [100 * (q.counts.rates()["local"] + q.counts.rates()["memory"]) for q in pts],
                        marker=".", linestyle=":", color=line.get_color(), label=f"{label}: local + pool memory")
            ax.plot(xs, [100 * q.counts.rates()["local"] for q in pts], marker=".", linestyle="--",
                    color=line.get_color(), label=f"{label}: local cache only")
        ax.set_xlabel("instances")
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        for ssd, remote in sorted({(p.ssd_bytes, p.remote_bytes) for p in points}):
            pts = sorted((p for p in points if (p.ssd_bytes, p.remote_bytes) == (ssd, remote)),
                         key=lambda q: q.memory_bytes)
            xs = [q.memory_bytes / (1 << 30) for q in pts]
            label = "memory tier" + (f" + SSD {size_text(ssd)}" if ssd else "") + \
                (f" + remote {size_text(remote)}" if remote else "")
            ax.plot(xs, [100 * (1 - q.counts.rates()["recomputed"]) for q in pts], marker="o", label=label)
        ax.set_xlabel("pool memory (GiB)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
