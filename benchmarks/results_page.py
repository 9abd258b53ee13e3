#!/usr/bin/env python
"""Write docs/benchmarks.md, the benchmarks' results page, from benchmarks/results/*.json.

    .venv/bin/python benchmarks/results_page.py           # rewrite docs/benchmarks.md
    .venv/bin/python benchmarks/results_page.py --check   # exit 1 if the page is not what this writes

Every figure on the page is read from a result file, which the page names; the prose around the
figures is the constant text at the end of this file. The dated investigations behind the figures
are hand-written, in benchmarks/NOTES.md. Which benchmark a file belongs to is `replot`'s call
(`replot.benchmark_of`). The page depends on the result files alone (sorted inputs, no clock), so
`--check` tells a page edited by hand, or not regenerated after a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # replot and plotting are siblings of this file
    sys.path.insert(0, str(BENCH_DIR))

from plotting import environment_of  # noqa: E402
from replot import BENCHMARKS, RESULTS_DIR, benchmark_of  # noqa: E402

DOCS_PAGE = BENCH_DIR.parent / "docs" / "benchmarks.md"
# Links on the page are relative to docs/, where it lives, whichever directory was read.
LINK_DIR = "../benchmarks/results"
NOTES_LINK = "../benchmarks/NOTES.md"
DASH = "–"  # a figure the result file does not have

# The sections in page order: (benchmark, heading). Other documents cite the headings.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("ttft", "TTFT"),
    ("hitpath", "Hit path: where a pool hit spends its time"),
    ("hybrid", "Hybrid models"),
    ("store", "Store throughput"),
    ("tiers", "The host pool in front of Mooncake"),
    ("pd", "PD disaggregation"),
    ("chaos", "Chaos run"),
    ("scale", "Scale"),
    ("trace", "Trace replay"),
    ("device", "Device check (accelerators)"),
)
assert {b for b, _ in SECTIONS} == set(BENCHMARKS), "a benchmark of replot.BENCHMARKS has no section here"


# ---- the result files -----------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One result file: its name (the file's stem), its benchmark and what it holds."""

    name: str
    benchmark: str | None
    data: Mapping[str, Any]
    has_plot: bool

    @property
    def env(self) -> Mapping[str, Any]:
        return environment_of(self.data)

    @property
    def quick(self) -> bool:
        # `-quick` in the name is how the benchmarks name a smoke run; the flag catches one
        # saved under another name (`--out`).
        flag = self.data.get("quick")
        if flag is None:
            flag = dig(self.data, "parameters", "quick")
        return "-quick" in self.name or bool(flag)

    @property
    def date(self) -> str:
        """The ISO date and time the run recorded ("" if none): sorts in time order."""
        return str(self.env.get("date_utc") or self.env.get("date") or "")

    @property
    def cpu(self) -> str | None:
        model = self.env.get("cpu_model") or self.env.get("cpu")
        return str(model) if model else None


def load_runs(results_dir: Path) -> list[Run]:
    """Every *.json of `results_dir`, sorted by name."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        runs.append(Run(path.stem, benchmark_of(path), data if isinstance(data, Mapping) else {},
                        path.with_suffix(".png").is_file()))
    return runs


def newest(runs: Iterable[Run]) -> Run | None:
    return max(runs, key=lambda r: (r.date, r.name), default=None)


def full_runs(runs: Iterable[Run], benchmark: str) -> list[Run]:
    return [r for r in runs if r.benchmark == benchmark and not r.quick]


def dig(data: Any, *keys: Any) -> Any:
    """data[k1][k2]..., or None where a step is missing."""
    for k in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(k)
    return data


# ---- formatting -----------------------------------------------------------------------------


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def num(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if is_number(x) else DASH


def ms(x: Any) -> str:
    """Milliseconds to the precision their size deserves."""
    if not is_number(x):
        return DASH
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def count(x: Any) -> str:
    return f"{x:,.0f}" if is_number(x) else DASH


def mb(x: Any) -> str:
    """Bytes per second as MB/s (10^6), as the benchmarks report disk speeds."""
    return f"{x / 1e6:.0f}" if is_number(x) else DASH


def met(flag: Any) -> str:
    return "**met**" if flag is True else "**not met**" if flag is False else "not measured"


def cpu_label(run: Run) -> str:
    return run.cpu.replace("(R)", "") if run.cpu else DASH


def date_label(run: Run) -> str:
    """"2026-12-06 02:25" from an ISO date."""
    return run.date[:16].replace("T", " ") if run.date else DASH


def commit_label(run: Run) -> str:
    """The short commit, `*` when the tree had uncommitted changes (git_commit "abc1234+...")."""
    commit = run.env.get("git_commit")
    if not commit:
        return DASH
    base, _, dirty = str(commit).partition("+")
    return f"`{base}`" + ("*" if dirty else "")


def run_link(run: Run) -> str:
    return f"[`{run.name}`]({LINK_DIR}/{run.name}.json)"


def machine_facts(run: Run) -> str:
    """Where and when a run's figures were taken: CPU, date, commit, vLLM."""
    env = run.env
    parts = [cpu_label(run) + (f", {env['cpu_count']} vCPUs" if env.get("cpu_count") else "")]
    parts.append(date_label(run) + (" UTC" if env.get("date_utc") else "") if run.date else "date not recorded")
    commit = env.get("git_commit")
    if commit:
        dirty = " with uncommitted changes" if "+" in str(commit) else ""
        parts.append(f"commit {commit_label(run).rstrip('*')}{dirty}")
    else:
        parts.append("commit not recorded")
    if env.get("vllm"):
        parts.append(f"vLLM {env['vllm']}")
    return ", ".join(parts)


def para(text: str) -> str:
    """Prose wrapped as the hand-written docs are, never inside a run's name or a link."""
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


def machine_line(run: Run) -> str:
    return para(f"Run {run_link(run)}: {machine_facts(run)}.")


def plot_line(run: Run, what: str) -> list[str]:
    return [f"![{what} ({run.name})]({LINK_DIR}/{run.name}.png)"] if run.has_plot else []


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> list[str]:
    """A markdown table; `align` has one letter per column, l or r."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(header), line(["---:" if a == "r" else "---" for a in align]), *(line(r) for r in rows)]


def section_end(run: Run, plot: str) -> list[str]:
    """The machine line and the plot that close a benchmark's section."""
    plots = plot_line(run, plot)
    return ["", machine_line(run), "", *plots, *([""] if plots else [])]


# ---- TTFT -----------------------------------------------------------------------------------

# The ratios a ttft JSON records, in page order: (key in `ratios`, label, the two medians it
# divides). `ttft.py` names a median `<system>_<kind>`, kind cold / hit / ext (+1) / part; the
# `vllm` reference's hits are `prefix_*`, vLLM's own prefix cache.
TTFT_RATIOS = (
    ("kvpool_hit/vllm_cold", "pool hit / vLLM cold", "kvpool_hit", "vllm_cold"),
    ("kvpool_ext/prefix_ext", "+1 / prefix cache", "kvpool_ext", "prefix_ext"),
    ("added/memcpy", "+1's added ms / memcpy", "", ""),  # not two medians: see ttft_pair
    ("kvpool_ext/mooncake_ext", "+1 / Mooncake", "kvpool_ext", "mooncake_ext"),
    ("kvpool_ext/example_ext", "+1 / ExampleConnector", "kvpool_ext", "example_ext"),
    ("kvpool_ext/exampleu_ext", "+1 / ExampleConnector, unchunked", "kvpool_ext", "exampleu_ext"),
    ("kvpool_part/prefix_part", "part (+1024 tokens) / prefix cache", "kvpool_part", "prefix_part"),
    ("kvpool_cold/vllm_cold", "cold with saving / vLLM cold", "kvpool_cold", "vllm_cold"),
    ("staged_ext/kvpool_ext", "staged / direct +1", "staged_ext", "kvpool_ext"),
    ("serial_ext/kvpool_ext", "1 copy thread / default +1", "serial_ext", "kvpool_ext"),
    ("server_ext/prefix_ext", "`server` +1 / prefix cache", "server_ext", "prefix_ext"),
    ("tiered_ext/prefix_ext", "server + Mooncake +1 / prefix cache", "tiered_ext", "prefix_ext"),
    ("tiered_cold/vllm_cold", "server + Mooncake cold / vLLM cold", "tiered_cold", "vllm_cold"),
)
# The peers a +1 is compared with in the headline: (system in the JSON, label).
HEADLINE_PEERS = (("mooncake", "Mooncake Store"), ("example", "ExampleConnector"),
                  ("exampleu", "ExampleConnector, unchunked"))

HEADLINE_RULE = ("The headline runs: for each CPU model, the newest full TTFT run among those that measured "
                 "the most configurations, so that each compares kvpool with every peer that ran on that "
                 "machine.")


def ttft_sizes(run: Run) -> list[str]:
    sizes = run.data.get("sizes")
    return list(sizes) if isinstance(sizes, Mapping) else list(run.data.get("ratios") or {})


def ttft_median(run: Run, size: str, column: str) -> float | None:
    entry = dig(run.data, "medians", size, column)
    if isinstance(entry, Mapping) and entry.get("status", "ok") == "ok" and is_number(entry.get("median_ms")):
        return float(entry["median_ms"])
    return None


def ttft_ratio(run: Run, size: str, key: str) -> Any:
    return dig(run.data, "ratios", size, key)


def ttft_pair(run: Run, size: str, key: str, mine: str, theirs: str) -> str:
    """A ratio with the two figures it divides: "1.108 (39.2 vs 35.4 ms)"."""
    ratio = ttft_ratio(run, size, key)
    if ratio is None:
        return DASH
    if key == "added/memcpy":  # the ms kvpool's +1 adds, over one memcpy of the same bytes
        a, b = ttft_ratio(run, size, "added_ms"), dig(run.data, "memcpy_ms", size)
    else:
        a, b = ttft_median(run, size, mine), ttft_median(run, size, theirs)
    return f"{num(ratio, 3)} ({ms(a)} vs {ms(b)} ms)" if is_number(a) and is_number(b) else num(ratio, 3)


def headline_runs(runs: Sequence[Run]) -> list[Run]:
    """HEADLINE_RULE, the one place it is applied: per CPU model (in name order), of the full
    TTFT runs that measured kvpool's +1 against the prefix cache, those with the most
    configurations, and of them the newest."""
    by_cpu: dict[str, list[Run]] = {}
    for run in full_runs(runs, "ttft"):
        if any(ttft_ratio(run, s, "kvpool_ext/prefix_ext") is not None for s in ttft_sizes(run)):
            by_cpu.setdefault(run.cpu or DASH, []).append(run)
    return [max(group, key=lambda r: (len(r.data.get("configs") or {}), r.date, r.name))
            for _, group in sorted(by_cpu.items())]


def headline(runs: Sequence[Run]) -> list[str]:
    heads = headline_runs(runs)
    out = ["## Headline: a pool hit on vLLM", "", para(
        HEADLINE_RULE + " Median time to first token; a ratio is kvpool's time over the other's (below 1, "
        "kvpool is faster). *Pool hit*: the same prompt again, served from the pool, against vLLM computing "
        "it. *+1*: the prompt plus the token its first request generated (a conversation's next turn), which "
        "every cache can serve whole: the like-for-like comparison."), ""]
    if not heads:
        return out + ["No full TTFT run in `benchmarks/results/` measured kvpool.", ""]
    peers = [(peer, label) for peer, label in HEADLINE_PEERS
             if any(ttft_ratio(r, s, f"kvpool_ext/{peer}_ext") is not None for r in heads for s in ttft_sizes(r))]
    header = ["run", "prompt", "pool hit / recompute", "+1 / vLLM prefix cache",
              *(f"+1 / {label}" for _, label in peers), "cold with saving / vLLM cold"]
    rows = [[run_link(run), size,
             ttft_pair(run, size, "kvpool_hit/vllm_cold", "kvpool_hit", "vllm_cold"),
             ttft_pair(run, size, "kvpool_ext/prefix_ext", "kvpool_ext", "prefix_ext"),
             *(ttft_pair(run, size, f"kvpool_ext/{peer}_ext", "kvpool_ext", f"{peer}_ext") for peer, _ in peers),
             ttft_pair(run, size, "kvpool_cold/vllm_cold", "kvpool_cold", "vllm_cold")]
            for run in heads for size in ttft_sizes(run)
            if ttft_ratio(run, size, "kvpool_ext/prefix_ext") is not None]
    out += [*table(header, rows, "ll" + "r" * (len(header) - 2)), ""]
    out += [para(f"- {run_link(run)}: {machine_facts(run)}; the model served in "
                 f"{dig(run.env, 'model', 'served_dtype') or DASH}.").replace("\n", "\n  ") for run in heads]
    # ExampleConnector with and without chunked prefill is one peer to a reader.
    shown = {label.split(",")[0] for _, label in peers}
    missing = sorted({label.split(",")[0] for _, label in HEADLINE_PEERS} - shown)
    if missing:
        out.append(f"- Not measured in these runs: {', '.join(missing)}.")
    return out + [""]


def ttft_target_cell(target: Any) -> str:
    per_size = dig(target, "per_size") or {}
    cells = [f"{met(v.get('met'))} {num(v.get('ratio'), 3)} ({size})" for size, v in per_size.items()
             if isinstance(v, Mapping) and v.get("ratio") is not None]
    return ", ".join(cells) or "not measured"


def ttft_targets(runs: Sequence[Run]) -> list[str]:
    heads = [r for r in headline_runs(runs) if isinstance(r.data.get("targets"), Mapping)]
    if not heads:
        return []
    rows = []
    for key in dict.fromkeys(k for r in heads for k in r.data["targets"]):
        text = next((t for r in heads if (t := dig(r.data, "targets", key, "target"))), key)
        rows.append([str(text), *(ttft_target_cell(dig(r.data, "targets", key)) for r in heads)])
    return [para("Each run records its targets in its JSON; here they are with the figure each was judged "
                 "on. TTFT, on the headline runs:"), "",
            *table(["target", *(run_link(r) for r in heads)], rows, "l" * (len(heads) + 1)), ""]


def kvpool_ttft_runs(runs: Sequence[Run]) -> list[Run]:
    """The full TTFT runs that measured kvpool (a run of the peers alone is not one)."""
    return [r for r in full_runs(runs, "ttft") if any(ttft_ratio(r, s, "kvpool_ext/prefix_ext") is not None
                                                      for s in ttft_sizes(r))]


# What a configuration of a TTFT run came to (`ttft.py`'s `outcome`), in words.
PEER_OUTCOMES = {"measured": "measured", "never_hit": "starts, never hits", "failed_to_start": "does not start",
                 "not_measured": "not measured", "unavailable": "could not run"}


def config_outcome(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """A configuration's outcome as the run recorded it, or, for a run older than that record,
    as its samples say (hits that found cached tokens: measured)."""
    if isinstance(result.get("outcome"), Mapping):
        return result["outcome"]
    if not isinstance(result.get("sizes"), Mapping):
        return {"status": "unavailable", "reason": str(result.get("error") or "")[:300] or None}
    hits = [s for e in result["sizes"].values() if isinstance(e, Mapping)
            for kind in ("hit", "ext") for s in e.get(kind) or () if isinstance(s, Mapping)]
    return {"status": "measured" if any(s.get("cached_tokens") for s in hits) else "not_measured"}


def ttft_peers(runs: Sequence[Run]) -> list[str]:
    """Every connector the TTFT runs tried, with the newest run's outcome for it: the peers that
    cannot run on a CPU say why, in their own words."""
    newest_of: dict[str, tuple[Run, Mapping[str, Any]]] = {}
    for run in sorted(full_runs(runs, "ttft"), key=lambda r: (r.date, r.name)):
        for name, result in (run.data.get("configs") or {}).items():
            if isinstance(result, Mapping):
                newest_of[name] = (run, result)
    if not newest_of:
        return []
    rows = []
    for name, (run, result) in sorted(newest_of.items()):
        connector = dig(result, "kv_transfer_config", "kv_connector") or "none (vLLM alone)"
        outcome = config_outcome(result)
        status, reason = outcome.get("status"), outcome.get("reason")
        rows.append([f"`{name}`", f"`{connector}`", PEER_OUTCOMES.get(status, str(status)),
                     f"`{reason}`" if reason else DASH, run_link(run)])
    return ["### Every connector tried", "", para(
        "Each configuration the TTFT runs started, with what it came to in the newest run that tried it: "
        "measured (it served hits; the tables above and the run's JSON have its figures), started but never "
        "hit, or did not start, with the reason its logs give."), "",
        *table(["configuration", "connector", "outcome", "reason (from its logs)", "run"], rows, "lllll"), ""]


def ttft_section(runs: Sequence[Run]) -> list[str]:
    out = [TTFT_INTRO, "", TTFT_HOW_TO_RUN, "", TTFT_WHAT_IS_MEASURED, ""]
    run = newest(kvpool_ttft_runs(runs))
    if run is None:
        return out + ttft_peers(runs)
    sizes = ttft_sizes(run)
    rows = [[label, *(ttft_pair(run, s, key, mine, theirs) for s in sizes)]
            for key, label, mine, theirs in TTFT_RATIOS if any(ttft_ratio(run, s, key) is not None for s in sizes)]
    out += ["### The newest full run", "",
            "Median TTFT, kvpool's over the other's (the two medians in brackets):", "",
            *table(["ratio", *sizes], rows, "l" + "r" * len(sizes))]
    return out + section_end(run, "TTFT per request kind and system") + ttft_peers(runs)


def ttft_key_figure(run: Run) -> str:
    for key, label in (("kvpool_ext/prefix_ext", "+1 / prefix cache"),
                       ("server_ext/prefix_ext", "`server` +1 / prefix cache"),
                       ("tiered_ext/prefix_ext", "server + Mooncake +1 / prefix cache")):
        values = [f"{num(v, 3)} ({s})" for s in ttft_sizes(run) if (v := ttft_ratio(run, s, key)) is not None]
        if values:
            return f"{label} {', '.join(values)}"
    outcomes = [f"{name}: {PEER_OUTCOMES.get(config_outcome(r).get('status'), DASH)}"
                for name, r in (run.data.get("configs") or {}).items() if isinstance(r, Mapping) and name != "vllm"]
    return "; ".join(outcomes) or DASH


# ---- hit path -------------------------------------------------------------------------------


def hitpath_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "hitpath"))
    if run is None:
        return [HITPATH_INTRO, ""]
    threads = [t for t in dig(run.data, "parameters", "threads") or [] if isinstance(t, int)]
    header = ["prompt", "backend", "MiB", "memcpy", "lookup", "leases", *(f"copy t{t}" for t in threads),
              *(f"load t{t}" for t in threads), "load (default) / memcpy", "staged", "staged / direct"]
    rows = [[str(r.get("size", DASH)), str(r.get("backend", DASH)), num(r.get("mib"), 0), ms(r.get("memcpy_ms")),
             ms(r.get("lookup_ms")), ms(r.get("leases_ms")), *(ms(r.get(f"copy_ms_t{t}")) for t in threads),
             *(ms(r.get(f"load_ms_t{t}")) for t in threads), num(r.get("default_vs_memcpy")),
             ms(r.get("staged_ms")), num(r.get("staged_vs_direct"))]
            for r in run.data.get("rows") or [] if isinstance(r, Mapping)]
    return [HITPATH_INTRO, "", *table(header, rows, "ll" + "r" * (len(header) - 2)),
            *section_end(run, "Hit path")]


def hitpath_key_figure(run: Run) -> str:
    values = [f"{num(r.get('default_vs_memcpy'))} ({r.get('size')})" for r in run.data.get("rows") or []
              if isinstance(r, Mapping) and r.get("backend") == "local"]
    return f"`local` load / memcpy {', '.join(values)}" if values else DASH


# ---- hybrid ---------------------------------------------------------------------------------


def hybrid_spec(run: Run) -> str:
    return str(dig(run.data, "model", "spec") or run.name)


def hybrid_runs(runs: Sequence[Run]) -> list[Run]:
    """The newest full run of each model pattern: each pattern is a benchmark of its own."""
    by_spec: dict[str, list[Run]] = {}
    for run in full_runs(runs, "hybrid"):
        by_spec.setdefault(hybrid_spec(run), []).append(run)
    return [r for _, group in sorted(by_spec.items()) if (r := newest(group)) is not None]


def hybrid_section(runs: Sequence[Run]) -> list[str]:
    heads = hybrid_runs(runs)
    rows = [[f"`{hybrid_spec(run)}`", str(r.get("size", DASH)), count(r.get("cached_tokens")),
             ms(r.get("vllm_cold_ms")), ms(r.get("prefix_hit_ms")), ms(r.get("kvpool_hit_ms")),
             num(r.get("kvpool_vs_prefix")), num(r.get("cold_vs_kvpool"), 1), num(r.get("moved_MiB"), 1),
             num(r.get("all_layers_MiB"), 1), f"{num(r.get('moved_share'), 3)} ({num(r.get('expected_share'), 3)})"]
            for run in heads for r in run.data.get("rows") or [] if isinstance(r, Mapping)]
    out = [HYBRID_INTRO, ""]
    if rows:
        out += [*table(["model", "prompt", "cached tokens", "vLLM cold ms", "vLLM prefix hit ms", "kvpool hit ms",
                        "kvpool / prefix", "cold / kvpool hit", "moved MiB", "every layer's MiB",
                        "moved share (expected)"], rows, "ll" + "r" * 9), ""]
    for run in heads:
        model = run.data.get("model") or {}
        params = model.get("params")
        size = f"{params / 1e6:.0f}M parameters, " if is_number(params) else ""
        out += [para(f"`{hybrid_spec(run)}` ({model.get('family', DASH)} pattern, {size}"
                     f"{model.get('num_hidden_layers', DASH)} layers, served in "
                     f"{dig(run.data, 'parameters', 'dtype') or DASH}): run {run_link(run)}, "
                     f"{machine_facts(run)}."),
                "", *plot_line(run, f"Hybrid model {hybrid_spec(run)}"), ""]
    return out


def hybrid_targets(run: Run) -> list[list[str]]:
    text = str(run.data.get("target") or DASH)
    # hybrid.py judges a model with state layers against its cold prefill and the others against
    # vLLM's own hit; a target that names sizes is judged at those only.
    key, unit = (("cold_vs_kvpool", "x faster than cold") if "cold" in text
                 else ("kvpool_vs_prefix", "x the prefix hit"))
    named = {s for s in ("1K", "4K", "8K", "16K") if s in text}
    rows = [r for r in run.data.get("rows") or [] if isinstance(r, Mapping) and (not named or r.get("size") in named)]
    if not rows:
        return []
    measured = ", ".join(f"{num(r.get(key))}{unit} ({r.get('size')})" for r in rows)
    return [[f"hybrid: `{hybrid_spec(run)}`", text, measured, met(all(r.get("target_met") is True for r in rows))]]


def hybrid_key_figure(run: Run) -> str:
    values = [f"{num(r.get('kvpool_vs_prefix'))} ({r.get('size')})" for r in run.data.get("rows") or []
              if isinstance(r, Mapping)]
    return f"`{hybrid_spec(run)}`: kvpool / prefix hit {', '.join(values)}" if values else DASH


# ---- store ----------------------------------------------------------------------------------

STORE_CASES = (("memcpy", "memcpy (1 process)"), ("shm", "shared_memory (2 processes)"),
               ("local", "local (1 process)"), ("server", "server (2 client processes)"),
               ("redis", "redis (2 client processes)"), ("mooncake", "mooncake (2 client processes, TCP)"),
               ("yuanrong", "yuanrong (2 client processes)"), ("memcache", "memcache"))


def store_sizes(run: Run) -> list[str]:
    sizes = dig(run.data, "parameters", "value_sizes")
    return list(sizes) if isinstance(sizes, Mapping) else []


def store_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "store"))
    if run is None:
        return [STORE_INTRO, ""]
    sizes = store_sizes(run)
    cases = run.data.get("cases") or {}
    labels = dict(STORE_CASES)
    rows = []
    for name in [c for c, _ in STORE_CASES if c in cases] + sorted(set(cases) - set(labels)):
        case = cases[name]
        if case.get("status") != "ok":
            why = case.get("why", case.get("status", DASH))
            rows.append([labels.get(name, name), f"not available: {why}", *([""] * (2 * len(sizes) + 2))])
            continue
        first = dig(case, "sizes", sizes[0]) if sizes else None
        working_set = case.get("working_set") or dig(run.data, "parameters", "working_set")
        rows.append([labels.get(name, name), f"{working_set / 2**20:.0f} MiB" if is_number(working_set) else DASH,
                     *(num(dig(case, "sizes", s, f"{op}_gbps")) for s in sizes for op in ("put", "get")),
                     num(dig(first, "lookup_lease_median_ms"), 3), num(dig(first, "lookup_lease_p99_ms"), 3)])
    header = ["backend", "working set", *(f"{op} {s} GB/s" for s in sizes for op in ("put", "get")),
              "lookup64 median ms", "p99 ms"]
    return [STORE_INTRO, "", *table(header, rows, "l" + "r" * (len(header) - 1)),
            *section_end(run, "Store throughput per backend")]


def store_target_text(key: str) -> str:
    """store.py names its targets as identifiers (`server_put_256KiB_ge_40pct_memcpy`): say them."""
    parts = key.split("_")
    if len(parts) == 6 and parts[3] == "ge" and parts[4].endswith("pct"):
        return f"`server` {parts[1]} of {parts[2]} values >= {parts[4][:-3]}% of memcpy"
    if key.startswith("server_lookup64_median_lt_"):
        return f"`server` 64-key lookup median < {key.rsplit('_', 1)[1].removesuffix('ms')} ms"
    return key


def store_targets(run: Run) -> list[list[str]]:
    rows = []
    for key, t in (run.data.get("targets") or {}).items():
        if not isinstance(t, Mapping):
            continue
        if "value_gbps" in t:
            share = f"{t['ratio'] * 100:.0f}%" if is_number(t.get("ratio")) else DASH
            measured = f"{num(t['value_gbps'])} GB/s = {share} of {num(t.get('memcpy_gbps'))}"
        else:
            measured = f"{num(t.get('value_ms'), 3)} ms"
        rows.append(["store", store_target_text(key), measured, met(t.get("met"))])
    return rows


def store_key_figure(run: Run) -> str:
    sizes = store_sizes(run)
    case = dig(run.data, "cases", "server")
    if not sizes or not isinstance(case, Mapping) or case.get("status") != "ok":
        return DASH
    put, get = (num(dig(case, "sizes", sizes[0], f"{op}_gbps")) for op in ("put", "get"))
    return f"`server` put / get {sizes[0]} {put} / {get} GB/s"


# ---- tiers ----------------------------------------------------------------------------------

TIERS_READS = (("mooncake", "`backend: mooncake` directly"),
               ("first", "host B's first read: through Mooncake, copied into its host pool"),
               ("second", "host B's second read: from its own host pool"),
               ("server", "`backend: server` read of host B's pool directly"),
               ("memcpy", "one memcpy of the same bytes"))


def tiers_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "tiers"))
    if run is None:
        return [TIERS_INTRO, ""]
    rows = [[label, ms(dig(run.data, "run", "ms", key)), num(dig(run.data, "run", "gbps", key))]
            for key, label in TIERS_READS if dig(run.data, "run", "ms", key) is not None]
    value = run.data.get("value_size")
    what = (f"A prompt of {run.data.get('blocks', DASH)} values of {value / 2**20:.0f} MiB, median over "
            f"{run.data.get('prompts', DASH)} prompts:" if is_number(value) else "Medians:")
    return [TIERS_INTRO, "", what, "", *table(["read", "ms", "GB/s"], rows, "lrr"),
            *section_end(run, "A read through each tier")]


def tiers_targets(run: Run) -> list[list[str]]:
    return [["tiers", str(t.get("target", DASH)), num(t.get("ratio")), met(t.get("met"))]
            for t in run.data.get("targets") or [] if isinstance(t, Mapping)]


def tiers_key_figure(run: Run) -> str:
    r = dig(run.data, "run", "ratios") or {}
    return f"first read / Mooncake {num(r.get('first/mooncake'))}, second / server {num(r.get('second/server'))}"


# ---- PD -------------------------------------------------------------------------------------


def pd_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "pd"))
    if run is None:
        return [PD_INTRO, ""]
    rows = []
    for name, cfg in (run.data.get("configs") or {}).items():
        s = cfg.get("summary") or {}
        rows.append([f"`{name}`: {cfg.get('description', DASH)}", num(s.get("requests_per_s")),
                     ms(s.get("ttft_p50_ms")), ms(s.get("ttft_p90_ms")), ms(s.get("tpot_p50_ms")),
                     f"{num(s.get('mean_cached_tokens'), 1)} of {num(s.get('mean_prompt_tokens'), 0)}",
                     num(s.get("mean_decode_cached_tokens"), 1)])
    p = run.data.get("parameters") or {}
    what = para(f"{p.get('passes', DASH)} passes of {p.get('requests', DASH)} requests, each a shared "
                f"{p.get('prefix_tokens', DASH)}-token prefix plus its own {p.get('suffix_tokens', DASH)}-token "
                f"suffix, {p.get('max_tokens', DASH)} tokens out, {p.get('concurrency', DASH)} in flight, model "
                f"`{p.get('model', DASH)}`:")
    header = ["configuration", "requests/s", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "mean cached tokens",
              "decode cached tokens"]
    return [PD_INTRO, "", what, "", *table(header, rows, "lrrrrrr"), *section_end(run, "PD disaggregation")]


def pd_key_figure(run: Run) -> str:
    configs = run.data.get("configs") or {}
    base = dig(configs, "mixed", "summary", "requests_per_s")
    split = dig(configs, "1p1d", "summary", "requests_per_s")
    return f"1P1D / mixed requests/s {num(split / base)}" if is_number(base) and base and is_number(split) else DASH


# ---- chaos ----------------------------------------------------------------------------------


def chaos_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "chaos"))
    if run is None:
        return [CHAOS_INTRO, ""]
    s = run.data.get("summary") or {}

    def seconds_as_ms(x: Any) -> str:
        return ms(x * 1000) if is_number(x) else DASH

    def ttft(key: str) -> str:
        t = s.get(key) or {}
        return f"{seconds_as_ms(t.get('p50'))} / {seconds_as_ms(t.get('p99'))} ({count(t.get('n'))})"
    kinds = ", ".join(f"{k} {v}" for k, v in (s.get("faults_by_kind") or {}).items())
    unavailable = ", ".join(s.get("unavailable") or {}) or "none"
    hit_rate = f"{s['hit_rate'] * 100:.1f} %" if is_number(s.get("hit_rate")) else DASH
    rows = [
        ["requests (wrong / failed / hung)",
         f"{count(s.get('requests'))} ({count(s.get('wrong'))} / {count(s.get('failed'))} / {count(s.get('hung'))})"],
        ["faults (kinds that could not run)", f"{count(s.get('faults'))}: {kinds} ({unavailable})"],
        ["hit rate in the load phase; requests with hits after the last fault",
         f"{hit_rate}; {count(s.get('final_requests_with_hits'))} of {count(s.get('final_requests'))}"],
        ["TTFT, all requests: p50 / p99 ms (n)", ttft("ttft_all")],
        ["TTFT during faults: p50 / p99 ms (n)", ttft("ttft_during_faults")],
        ["TTFT outside faults: p50 / p99 ms (n)", ttft("ttft_outside_faults")],
        ["TTFT cold (no token from the pool, outside faults): p50 / p99 ms (n)", ttft("ttft_cold")],
    ]
    c = run.data.get("config") or {}
    what = para(f"{num(c.get('duration_s'), 0)} s of load from {c.get('clients', DASH)} clients with a fault "
                f"every ~{num(c.get('fault_every_s'), 0)} s, model `{run.data.get('model', DASH)}`:")
    return [CHAOS_INTRO, "", what, "", *table(["", "value"], rows, "lr"),
            *section_end(run, "Chaos run: TTFT over time with the faults shaded")]


def chaos_targets(run: Run) -> list[list[str]]:
    s = run.data.get("summary") or {}
    if "target" not in s:
        return []
    p99, bound = dig(s, "ttft_during_faults", "p99"), s.get("target_bound_s")
    measured = f"{ms(p99 * 1000)} ms against {ms(bound * 1000)} ms" if is_number(p99) and is_number(bound) else DASH
    return [["chaos", str(s["target"]), measured, met(s.get("target_met"))]]


def chaos_key_figure(run: Run) -> str:
    s = run.data.get("summary") or {}
    return (f"{count(s.get('requests'))} requests: {count(s.get('wrong'))} wrong, {count(s.get('failed'))} "
            f"failed, {count(s.get('hung'))} hung")


# ---- scale ----------------------------------------------------------------------------------


def scale_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "scale"))
    if run is None:
        return [SCALE_INTRO, ""]
    # kvpool's metadata is its server's heap per object, Mooncake's its master's.
    rows = [[system, count(r.get("objects")), num(r.get("lookup_p50_ms"), 3), num(r.get("lookup_p99_ms"), 3),
             count(r.get("put_per_s")), f"{count(r.get('puts'))} / {count(r.get('put_evictions'))}",
             count(r.get("get_per_s")), count(r.get("meta_bytes", r.get("master_meta_bytes")))]
            for system in ("kvpool", "mooncake") for r in run.data.get(system) or [] if isinstance(r, Mapping)]
    header = ["system", "objects", "lookup p50 ms", "lookup p99 ms", "put/s (evicting)", "puts / evicted", "get/s",
              "metadata B/object"]
    out = [SCALE_INTRO, "", *table(header, rows, "lrrrrrrr")]
    restart, blocks = run.data.get("restart") or {}, run.data.get("ssd_blocks") or {}
    if restart:
        text = (f"Restart with {count(restart.get('objects'))} objects on the SSD tier: "
                f"{num(restart.get('restart_s'))} s with the restart index, {num(restart.get('restart_scan_s'), 1)} "
                f"s with a full scan; SSD-tier reads of 1 KiB objects "
                f"{num((restart.get('ssd_read_bytes_per_s') or 0) / 1e6, 1)} MB/s against the disk's O_DIRECT "
                f"{mb(restart.get('direct_io_bytes_per_s'))} MB/s")
        if blocks:
            value = blocks.get("value_bytes")
            text += (f"; {count(blocks.get('objects'))} values of "
                     f"{f'{value / 2**20:.0f} MiB' if is_number(value) else DASH} "
                     f"{mb(blocks.get('ssd_read_bytes_per_s'))} MB/s against {mb(blocks.get('direct_io_bytes_per_s'))} "
                     "MB/s")
        out += ["", para(text + ".")]
    return out + section_end(run, "Scale against the object count")


def scale_targets(run: Run) -> list[list[str]]:
    return [["scale", str(t.get("target", DASH)), str(t.get("measured", DASH)), met(t.get("met"))]
            for t in run.data.get("target_results") or [] if isinstance(t, Mapping)]


def scale_key_figure(run: Run) -> str:
    rows = scale_targets(run)
    return f"targets met: {sum(r[-1] == met(True) for r in rows)} of {len(rows)}" if rows else DASH


# ---- trace ----------------------------------------------------------------------------------


def trace_configs(run: Run) -> set[str]:
    return {name for t in (run.data.get("traces") or {}).values() for name in (t.get("configs") or {})}


def trace_runs(runs: Sequence[Run]) -> list[Run]:
    """The trace runs the page shows: the newest full run of the most configurations, then every
    full run newer than it (a run of a few new configurations adds to it, replaces nothing)."""
    full = full_runs(runs, "trace")
    if not full:
        return []
    main = max(full, key=lambda r: (len(trace_configs(r)), r.date, r.name))
    return [main, *sorted((r for r in full if (r.date, r.name) > (main.date, main.name)), key=lambda r: r.date)]


def trace_section(runs: Sequence[Run]) -> list[str]:
    shown = trace_runs(runs)
    if not shown:
        return [TRACE_INTRO, ""]
    out = [TRACE_INTRO, ""]
    for run in shown:
        rows, slices = [], []
        for trace, t in (run.data.get("traces") or {}).items():
            sampling = t.get("sampling") or {}
            slices.append(f"- {trace}: {count(sampling.get('requests'))} requests of "
                          f"{count(sampling.get('conversations'))} conversations, infinite-cache bound "
                          f"{num(t.get('bound_hit_rate'), 3)}, {count(t.get('unique_blocks'))} unique blocks")
            for name, cfg in (t.get("configs") or {}).items():
                s = cfg.get("summary") or {}
                rows.append([trace, f"`{name}`", num(s.get("hit_rate"), 3), num(s.get("of_bound"), 3),
                             count(s.get("computed_tokens")), ms(s.get("ttft_p50_ms")), ms(s.get("ttft_p90_ms")),
                             ms(s.get("ttft_mean_ms"))])
        header = ["trace", "config", "token hit rate", "of bound", "tokens computed", "TTFT p50 ms", "p90 ms",
                  "mean ms"]
        if run is not shown[0]:  # the same slices, sampled alike
            out += [f"A later run of {', '.join(f'`{c}`' for c in sorted(trace_configs(run)))}:", ""]
        else:
            out += [*slices, ""]
        out += [*table(header, rows, "llrrrrrr"), *section_end(run, "Trace replay")]
    return out


def trace_target_results(run: Run) -> dict[str, list[tuple[str, Mapping[str, Any]]]]:
    """Each target with every trace's result: the traces are judged on the same targets."""
    by_target: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for trace, tr in (run.data.get("traces") or {}).items():
        for t in tr.get("targets") or []:
            if isinstance(t, Mapping):
                by_target.setdefault(str(t.get("target", DASH)), []).append((trace, t))
    return by_target


def trace_targets(run: Run) -> list[list[str]]:
    rows = []
    for text, results in trace_target_results(run).items():
        measured = "; ".join(f"{trace} {t.get('value', DASH)}" for trace, t in results)
        flags = {t.get("met") for _, t in results}
        result = (met(flags.pop()) if len(flags) == 1
                  else ", ".join(f"{trace} {met(t.get('met'))}" for trace, t in results))
        rows.append(["trace", text, measured, result])
    return rows


def trace_key_figure(run: Run) -> str:
    results = [t for rs in trace_target_results(run).values() for _, t in rs]
    return f"targets met: {sum(t.get('met') is True for t in results)} of {len(results)}" if results else DASH


# ---- device ---------------------------------------------------------------------------------


def device_section(runs: Sequence[Run]) -> list[str]:
    run = newest(full_runs(runs, "device"))
    if run is None:
        return [DEVICE_INTRO, "", "No accelerator has run it yet: `benchmarks/results/` holds no full `device` run.",
                ""]
    rows = [[str(c.get("case", DASH)), "yes" if c.get("verified") else f"{count(c.get('mismatches'))} mismatches",
             *(num(dig(c, "gbps", k)) for k in ("save", "load", "torch_d2h", "torch_h2d")),
             num(dig(c, "ratio_to_torch", "save")), num(dig(c, "ratio_to_torch", "load"))]
            for c in run.data.get("cases") or [] if isinstance(c, Mapping)]
    device = run.env.get("device_name") or dig(run.data, "parameters", "device") or DASH
    header = ["case", "every byte checked", "save", "load", "torch D2H", "torch H2D", "save / D2H", "load / H2D"]
    return [DEVICE_INTRO, "", f"On {device}, GB/s of KV data moved:", "", *table(header, rows, "llrrrrrr"),
            *section_end(run, "Device check")]


def device_targets(run: Run) -> list[list[str]]:
    if "all_verified" not in run.data:
        return []
    ok = bool(run.data["all_verified"])
    return [["device", "every byte loaded back equals the byte saved", "yes" if ok else "no", met(ok)]]


def device_key_figure(run: Run) -> str:
    if "all_verified" not in run.data:
        return DASH
    return "every byte checked" if run.data["all_verified"] else "mismatches"


# ---- the page -------------------------------------------------------------------------------

SECTION_WRITERS: dict[str, Callable[[Sequence[Run]], list[str]]] = {
    "ttft": ttft_section, "hitpath": hitpath_section, "hybrid": hybrid_section, "store": store_section,
    "tiers": tiers_section, "pd": pd_section, "chaos": chaos_section, "scale": scale_section,
    "trace": trace_section, "device": device_section,
}
TARGET_WRITERS: dict[str, Callable[[Run], list[list[str]]]] = {
    "store": store_targets, "tiers": tiers_targets, "chaos": chaos_targets, "scale": scale_targets,
    "trace": trace_targets, "device": device_targets,
}
KEY_FIGURES: dict[str, Callable[[Run], str]] = {
    "ttft": ttft_key_figure, "hitpath": hitpath_key_figure, "hybrid": hybrid_key_figure,
    "store": store_key_figure, "tiers": tiers_key_figure, "pd": pd_key_figure, "chaos": chaos_key_figure,
    "scale": scale_key_figure, "trace": trace_key_figure, "device": device_key_figure,
}


def other_targets(runs: Sequence[Run]) -> list[str]:
    rows: list[list[str]] = []
    for benchmark, _ in SECTIONS:
        if benchmark == "hybrid":
            for run in hybrid_runs(runs):
                rows += hybrid_targets(run)
        elif benchmark == "trace":
            for run in trace_runs(runs):
                rows += trace_targets(run)
        elif benchmark in TARGET_WRITERS and (run := newest(full_runs(runs, benchmark))) is not None:
            rows += TARGET_WRITERS[benchmark](run)
    if not rows:
        return []
    return ["The other benchmarks, on the run each section below shows:", "",
            *table(["benchmark", "target", "measured", "result"], rows, "llll"), ""]


def index(runs: Sequence[Run]) -> list[str]:
    """One row per benchmark (so the page stays short however many runs there are): its full
    runs, newest first, each with its date, CPU and commit; then its smoke runs."""
    order = {b: i for i, (b, _) in enumerate(SECTIONS)}
    ranked = sorted(runs, key=lambda r: r.name)
    ranked.sort(key=lambda r: r.date, reverse=True)  # stable: newest first, then by name
    by_benchmark: dict[str, list[Run]] = {}
    for r in ranked:
        by_benchmark.setdefault(r.benchmark or DASH, []).append(r)
    rows = []
    for benchmark in sorted(by_benchmark, key=lambda b: order.get(b, len(order))):
        group = by_benchmark[benchmark]
        full = "; ".join(f"{run_link(r)} ({date_label(r)[:10]}, {cpu_label(r)}, {commit_label(r)})"
                         for r in group if not r.quick)
        rows.append([benchmark, full or DASH, ", ".join(run_link(r) for r in group if r.quick) or DASH])
    return ["## Every run", "",
            para("Every file in `benchmarks/results/`, by benchmark, newest first, with its date (UTC), CPU and "
                 "commit (`*`: the tree had uncommitted changes); smoke runs (`--quick`) apart: their figures "
                 "are not results."), "",
            *table(["benchmark", "full runs", "smoke runs"], rows, "lll"), ""]


def render(results_dir: Path = RESULTS_DIR) -> str:
    """The whole results page, from every *.json in `results_dir`."""
    runs = load_runs(Path(results_dir))
    out = [INTRO, "", *headline(runs), "## Targets", "", *ttft_targets(runs), *other_targets(runs)]
    for benchmark, heading in SECTIONS:
        out += [f"## {heading}", "", *SECTION_WRITERS[benchmark](runs)]
    out += index(runs)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what this would write")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the result files are")
    ap.add_argument("--out", type=Path, default=DOCS_PAGE, help="the page (default: docs/benchmarks.md)")
    args = ap.parse_args(argv)
    page = render(args.results)
    if args.check:
        if not args.out.is_file() or args.out.read_text() != page:
            print(f"{args.out} is not generated from the current results: run `python benchmarks/results_page.py`",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out} ({page.count(chr(10))} lines)")
    return 0


# ---- constant text --------------------------------------------------------------------------

INTRO = f"""# Benchmarks

What kvpool costs and saves, measured on vLLM and on the pool alone: time to first token with a
pool hit against recomputing the prompt, vLLM's own prefix cache and the peer connectors, and the
pool's load path, throughput, scale, behaviour under faults and on replayed traces. Every figure
below is read from the result file it names in `benchmarks/results/`, and this page is generated
from those files by `benchmarks/results_page.py` (do not edit it by hand). The machines are small
shared VMs with 2 vCPUs whose speed drifts from hour to hour, so compare ratios within one run,
not milliseconds across runs; the investigations behind the figures are in
[benchmarks/NOTES.md]({NOTES_LINK})."""

TTFT_INTRO = """Time to first token on vLLM with kvpool, against a cold prefill, vLLM's own prefix cache and the
peer connectors that run on a CPU: vLLM's `ExampleConnector` and `MooncakeStoreConnector`
(against a local `mooncake_master`). Script: `benchmarks/ttft.py`."""

TTFT_HOW_TO_RUN = """### How to run

```bash
make bench                                   # every benchmark in full (one to two hours), then this page
make bench-quick                             # each one's --quick smoke run (NAME-quick.json), then this page
.venv/bin/python benchmarks/ttft.py --quick  # one benchmark: 1K and 4K, one prompt each (~10 min)
.venv/bin/python benchmarks/results_page.py  # rewrite this page (replot.py redraws the plots)
```

The Mooncake peer needs the `mooncake` extra and Debian's `libibverbs1` (`make setup` installs
both). A full TTFT run takes 30–60 minutes on two cores; `--help` lists what selects its parts."""

TTFT_WHAT_IS_MEASURED = f"""### What is measured

The `bench` model (a random-weight 96M-parameter Llama, 12 layers, 4 KV heads, built locally;
bf16, 12 KiB of KV per token, or fp32 on a CPU without native bf16) on vLLM's OpenAI server, one
server per configuration on both cores: `vllm` (no connector, its prefix cache on; it runs first
and again last), `kvpool` (backend `local`), `kvpool_server` (a `kvpool server` pool),
`kvpool_staged` (the accelerator staging path on CPU), `kvpool_tiered` (the server with Mooncake
behind it), `example` and `mooncake` (vLLM's connectors). Each prompt of random token ids is
sent **cold**, as a **hit** (again, 0.5 s later; a cache of whole blocks recomputes its last
block, kvpool loads all but one token), as **+1** (plus the token the cold request generated,
three times: every cache serves the whole prompt) and as **part** (plus 1024 new tokens).
"added / memcpy" is what kvpool's +1 adds over the prefix cache's, over one single-threaded
memcpy of the same KV bytes timed in the same run. The full method, and when each part of it
changed: [NOTES.md]({NOTES_LINK}#ttft)."""

HITPATH_INTRO = """`benchmarks/hitpath.py` takes the load of a pool hit apart without vLLM: vLLM-CPU-layout tensors
of the `bench` model (1.5 MiB per 128-token block), a real `local` engine and a real `kvpool
server`, each stage timed alone. `copy tN`: the copy on N threads; `load tN`: the whole load a
hit waits for; `staged`: the accelerator path on CPU. Run `.venv/bin/python benchmarks/hitpath.py`."""

HYBRID_INTRO = """`benchmarks/hybrid.py`: a pool hit on a model with several KV cache groups (a sliding-window layer
needs only its last window, a state layer one state) against vLLM's own prefix-cache hit on the
same model, and the bytes the hit moves. A hit is the prompt plus the token its cold run
generated; `kvpool` is the `local` backend. Run `.venv/bin/python benchmarks/hybrid.py`
(`--spec qwen3-next-bench` for the gated-delta-net pattern)."""

STORE_INTRO = """`benchmarks/store.py`: put and get throughput per backend (GB/s, 1 GB = 10^9 bytes) and the
latency of a 64-key lookup with leases, without vLLM. `memcpy` is numpy in one process (the
ceiling), `shared_memory` two processes around one segment, `local` the in-process engine;
`server`, redis, mooncake and yuanrong run as services with a writer and a reader client
process. Run `.venv/bin/python benchmarks/store.py`."""

TIERS_INTRO = """`benchmarks/tiers.py` (no vLLM): two `kvpool server` host pools with `remote_backend: mooncake` in
front of one `mooncake_master` over TCP; host A saves a prompt, host B reads it through
Mooncake, then from its own pool. Run `.venv/bin/python benchmarks/tiers.py`; TTFT with such a
pool is the `kvpool_tiered` configuration of `benchmarks/ttft.py`."""

PD_INTRO = """`benchmarks/pd.py`: one workload through one PD-mixed instance on both cores, and through a
prefill and a decode instance (one core each) behind `kvpool proxy` with the KV in a `kvpool
server` pool. On one machine the split adds no compute: this measures the price of the path
through the proxy and the pool, and that the pool carries the KV. Run
`.venv/bin/python benchmarks/pd.py`."""

CHAOS_INTRO = """`benchmarks/chaos.py` keeps two vLLM instances sharing one `kvpool server` (with an SSD tier)
under load while it kills, pauses and restarts the pool server, kills writers, corrupts the
shared arena, fills the SSD tier and slows the connections; every answer is compared with a
plain vLLM server's. Run `.venv/bin/python benchmarks/chaos.py` (about 12 minutes)."""

SCALE_INTRO = """`benchmarks/scale.py`: a `kvpool server` holding 1K to 1M objects of 1 KiB against a real
`mooncake_master`: lookups of 64 keys, puts into a full pool (each evicts), gets, metadata per
object; then a restart from the SSD tier, and the tier's reads against the disk's O_DIRECT
bandwidth. Run `.venv/bin/python benchmarks/scale.py`."""

TRACE_INTRO = """`benchmarks/trace.py` replays slices of conversation traces on two vLLM instances behind one
`kvpool proxy`: `prefix` (vLLM's prefix cache alone), `roomy` (a prefix cache large enough for
the slice: hits that move no bytes), `kvpool` (one shared pool), `routed` (the same, routed by
prefix), `mooncake`, and `tiered` (a host pool per instance in front of Mooncake Store, as on two
hosts). `kvpool plan` predicts each pool's hit rate from the same slice. Run
`.venv/bin/python benchmarks/trace.py`."""

DEVICE_INTRO = """`benchmarks/device.py` checks the staged data path on an accelerator (CUDA, NPU or XPU; torch
only): paged KV caches in vLLM's GPU layouts saved into a real pool engine and loaded back,
every byte compared, GB/s against torch's own pinned copy. Run `python3 benchmarks/device.py` on
such a machine; its CPU smoke run is part of `make test`."""

if __name__ == "__main__":
    sys.exit(main())
