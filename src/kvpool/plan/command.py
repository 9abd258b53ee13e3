"""`kvpool plan`: flags, and the run that reads a trace, replays it and writes the results."""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import asdict

from kvpool.config import parse_size
from kvpool.errors import ConfigError
from kvpool.routing import POLICIES
from kvpool.store import EngineConfig
from kvpool.store.policy import MEMORY_POLICIES
from kvpool.store.quota import POLICIES as SSD_POLICIES

from kvpool.plan import report
from kvpool.plan.cluster import TRAFFIC, ServiceModel
from kvpool.plan.modelkv import KV_CACHE_DTYPES, kv_bytes_per_token
from kvpool.plan.sweep import ClusterSpec, PoolSpec, run_plan
from kvpool.tracefile import DEFAULT_BLOCK_SIZE, Trace, read_trace

DEFAULT_MEMORY = "5%,10%,20%,40%,70%,100%"
DEFAULT_CLUSTER_MEMORY = "20%"
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$", re.ASCII)


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help strings with %


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="request trace, one JSON line per request (docs/plan.md: the format)")
    p.add_argument("--kv-bytes-per-token",
                   help='KV bytes one token takes in the pool, all layers, e.g. "160KB" (binary units); or --model')
    p.add_argument("--model", metavar="DIR",
                   help="a model directory (Hugging Face layout): the KV bytes per token from its config.json "
                        "(attention layers' K and V, or MLA's latent; docs/plan.md)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="with --model: vLLM's --kv-cache-dtype (auto: the model's dtype)")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per hash id in the trace (default: what its lines say, else {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--memory", default=None,
                   help="comma-separated pool memory sizes to try, e.g. \"64GB,128GB\"; N%% is that share of "
                        f"the trace's working set (unique blocks); default {_escaped(DEFAULT_MEMORY)} "
                        f"({_escaped(DEFAULT_CLUSTER_MEMORY)} with --instances)")
    p.add_argument("--ssd", default="0",
                   help='comma-separated SSD tier sizes to try with each memory size, e.g. "0,1TB" '
                        "(0: no SSD tier; N%% as for --memory; default 0)")
    p.add_argument("--remote", default="0",
                   help='comma-separated sizes of a remote tier (remote_backend: a distributed store behind '
                        'the host pools, shared by every host) to try with each memory and SSD size, e.g. '
                        '"0,2TB" (0: none; N%% as for --memory; default 0)')
    p.add_argument("--ssd-policy", choices=SSD_POLICIES, default="lru",
                   help="SSD tier eviction policy (the server's ssd_eviction_policy; default lru)")
    defaults = EngineConfig(memory_size=EngineConfig.alignment)
    p.add_argument("--high-watermark", type=float, default=defaults.eviction_high_watermark_ratio,
                   help="memory tier eviction_high_watermark_ratio "
                        f"(default {defaults.eviction_high_watermark_ratio})")
    p.add_argument("--eviction-ratio", type=float, default=defaults.eviction_ratio,
                   help=f"memory tier eviction_ratio (default {defaults.eviction_ratio})")
    p.add_argument("--eviction-policy", choices=MEMORY_POLICIES, default=defaults.eviction_policy,
                   help=f"memory tier eviction_policy (the server's --eviction-policy; default "
                        f"{defaults.eviction_policy})")
    p.add_argument("--object-overhead", default="0",
                   help="bytes the memory tier charges per block on top of its KV bytes (kvpool server: "
                        "1KB plus the key; local backend: 0; default 0)")
    p.add_argument("--save-decode", action="store_true",
                   help="each request also stores the blocks its answer fills (the connector's "
                        "save_decode_cache), read off the conversation's next turn (docs/plan.md)")
    p.add_argument("--instances", type=int, default=0,
                   help="cluster mode: this many vLLM instances share the pool (0: the pool alone; default 0)")
    p.add_argument("--hosts", type=int, default=1,
                   help="cluster mode: the instances run on this many hosts (instance i on host i mod N), "
                        "each host with a pool of its own of --memory and --ssd (default 1: one pool shared "
                        "by every instance)")
    p.add_argument("--local-cache", default="0",
                   help='cluster mode: each instance\'s own prefix cache (GPU KV cache), e.g. "40GB" (default 0)')
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"cluster mode: comma-separated routing policies to compare (default {','.join(POLICIES)})")
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="cluster mode: prefix_aware's load bound factor (default 1.25)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=ServiceModel.prefill_tokens_per_s,
                   help="cluster mode: service-time model, prefill speed of one instance "
                        f"(default {ServiceModel.prefill_tokens_per_s:g})")
    p.add_argument("--decode-ms-per-token", type=float, default=ServiceModel.decode_ms_per_token,
                   help=f"cluster mode: service-time model, decode time per output token "
                        f"(default {ServiceModel.decode_ms_per_token:g})")
    p.add_argument("--sweep-instances", action="store_true",
                   help="cluster mode: replay 1, 2, ... --instances instances (how many one pool serves)")
    p.add_argument("--traffic", choices=TRAFFIC, default=None,
                   help="cluster mode: split = the trace is routed over the instances; replicate = each "
                        "instance brings its own copy of the trace (default: replicate with "
                        "--sweep-instances, else split)")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests (0: all; default 0)")
    p.add_argument("--jobs", type=int, default=0,
                   help="processes running points in parallel (0: one per CPU; default 0)")
    p.add_argument("--json", metavar="PATH", help="write every point as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of hit rate against capacity to PATH")


def _sizes(flag: str, text: str, working_set: int) -> list[int]:
    out = []
    for item in text.split(","):
        m = _PERCENT.match(item)
        if m:
            out.append(int(working_set * float(m.group(1)) / 100))
        else:
            out.append(parse_size(flag, item.strip()))
    if not out:
        raise ConfigError(flag, text, 'a comma-separated list of sizes, e.g. "64GB,128GB"')
    return out


def _positive(flag: str, value: float, expected: str) -> None:
    if not value > 0:
        raise ConfigError(flag, value, expected)


def build(args: argparse.Namespace) -> tuple[dict, list]:
    """Validate the flags, read the trace and run the plan: (settings, points)."""
    if (args.kv_bytes_per_token is None) == (args.model is None):
        raise ConfigError("--kv-bytes-per-token", args.kv_bytes_per_token or "unset",
                          'one of --kv-bytes-per-token (e.g. "160KB") or --model DIR, not both')
    if args.model is not None:
        per_token, counted = kv_bytes_per_token(args.model, args.kv_cache_dtype)
    else:
        per_token, counted = parse_size("--kv-bytes-per-token", args.kv_bytes_per_token), "given"
        _positive("--kv-bytes-per-token", per_token, 'a positive byte count, e.g. "160KB"')
    if args.block_size is not None:
        _positive("--block-size", args.block_size, "a positive int of tokens, e.g. 512")
    for flag, value in (("--high-watermark", args.high_watermark), ("--eviction-ratio", args.eviction_ratio)):
        if not 0 < value <= 1:
            raise ConfigError(flag, value, "a ratio in (0, 1], e.g. 0.9 / 0.1")
    if args.instances < 0 or args.limit < 0 or args.jobs < 0:
        bad = next(f for f, v in (("--instances", args.instances), ("--limit", args.limit),
                                  ("--jobs", args.jobs)) if v < 0)
        raise ConfigError(bad, getattr(args, bad[2:].replace("-", "_")), "an int >= 0")
    if args.hosts < 1:
        raise ConfigError("--hosts", args.hosts, "an int >= 1")
    if args.hosts > 1 and not args.instances:
        raise ConfigError("--hosts", args.hosts, "--instances N as well: hosts are where the instances run")
    if args.hosts > max(1, args.instances):
        raise ConfigError("--hosts", args.hosts, f"at most --instances ({args.instances}): a host runs an instance")
    if args.sweep_instances and not args.instances:
        raise ConfigError("--sweep-instances", True, "--instances N as well: the sweep runs 1..N instances")
    if args.save_decode and args.instances:
        raise ConfigError("--save-decode", True, "the pool alone (no --instances): cluster mode does not model it")
    trace = read_trace(args.trace, args.block_size)
    if args.limit:
        trace = Trace(trace.requests[: args.limit], trace.block_size)
    block_bytes = per_token * trace.block_size
    working_set = trace.unique_blocks * block_bytes
    memory_text = args.memory or (DEFAULT_CLUSTER_MEMORY if args.instances else DEFAULT_MEMORY)
    memories = _sizes("--memory", memory_text, working_set)
    for m in memories:
        if m < EngineConfig.alignment:
            raise ConfigError("--memory", m, f"sizes of at least {EngineConfig.alignment} bytes, e.g. 4GB")
    ssds = _sizes("--ssd", args.ssd, working_set)
    remotes = _sizes("--remote", args.remote, working_set)
    spec = PoolSpec(block_bytes, args.ssd_policy, parse_size("--object-overhead", args.object_overhead),
                    args.high_watermark, args.eviction_ratio, args.eviction_policy, args.save_decode)
    cluster = None
    if args.instances:
        policies = tuple(p.strip() for p in args.policies.split(","))
        for policy in policies:
            if policy not in POLICIES:
                raise ConfigError("--policies", policy, f"policies among {', '.join(POLICIES)}")
        _positive("--prefill-tokens-per-s", args.prefill_tokens_per_s, "a positive token rate, e.g. 20000")
        if args.decode_ms_per_token < 0:
            raise ConfigError("--decode-ms-per-token", args.decode_ms_per_token, "milliseconds >= 0, e.g. 30")
        if args.load_factor < 1:
            raise ConfigError("--load-factor", args.load_factor, "a number >= 1, e.g. 1.25")
        traffic = args.traffic or ("replicate" if args.sweep_instances else "split")
        cluster = ClusterSpec(args.instances, policies, parse_size("--local-cache", args.local_cache) // block_bytes,
                              ServiceModel(args.prefill_tokens_per_s, args.decode_ms_per_token),
                              args.load_factor, args.sweep_instances, traffic, args.hosts)
    jobs = args.jobs or os.cpu_count() or 1
    points = run_plan(trace, spec, memories, ssds, cluster, jobs, remotes)
    settings = {"kv_bytes_per_token": per_token, "kv_bytes_counted": counted, "block_bytes": block_bytes,
                "working_set_bytes": working_set,
                "pool": asdict(spec), "cluster": None if cluster is None else asdict(cluster)}
    return {"trace": trace, "settings": settings}, points


def _check_outputs(args: argparse.Namespace) -> None:
    """Before the replay, which may take minutes: each output's directory is there and
    writable, and matplotlib imports for --plot."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        where = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(flag, path, f"a file in a directory that exists and that you may write ({where} "
                                          "is not)")
        if os.path.isdir(path):
            raise ConfigError(flag, path, "a file path, not a directory")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot", args.plot, "matplotlib installed (pip install matplotlib, or "
                                                   "'kvpool[bench]'), or no --plot") from None


def run(args: argparse.Namespace) -> int:
    try:
        _check_outputs(args)
        built, points = build(args)
    except ConfigError as exc:
        print(f"kvpool plan: {exc}", file=sys.stderr)
        return 2
    trace, settings = built["trace"], built["settings"]
    if args.model is not None:
        print(f"{args.model}: {settings['kv_bytes_per_token']} KV bytes per token ({settings['kv_bytes_counted']})")
    print(f"{args.trace}: {len(trace.requests)} requests, {trace.block_refs} block references, "
          f"{trace.unique_blocks} unique blocks of {settings['block_bytes']} bytes "
          f"(working set {report.size_text(settings['working_set_bytes'])})")
    print(report.table(points))
    try:
        if args.json:
            report.write_json(args.json, report.document(trace, args.trace, settings, points))
        if args.plot:
            report.plot(args.plot, points, os.path.basename(args.trace))
    except OSError as exc:  # the directory went away during the replay, a full disk, ...
        print(f"kvpool plan: cannot write {exc.filename or 'the output'}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
