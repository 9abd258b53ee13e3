#!/usr/bin/env python
"""Where a pool hit spends its time: the worker's load path taken apart, without vLLM.

    .venv/bin/python benchmarks/hitpath.py           # 4K and 8K tokens, local and server
    .venv/bin/python benchmarks/hitpath.py --quick   # 4K only, fewer repetitions

A pool hit on the `bench` model's geometry (12 layers, 4 KV heads of 64, bf16, 128-token
blocks: 1.5 MiB per block, 48 MiB for 4K tokens) is loaded into a real `KVLayout` over vLLM
CPU-layout tensors, exactly as `PoolWorker._load` does it, and each stage is timed on its own:

  lookup       `batch_exists(keys, lease=True)`: what the scheduler's lookup costs on the worker
  views        building the per-block lists of byte views (`KVLayout.stage_buffers`)
  base class   `Backend.batch_get_into`'s checks, over an adapter that copies nothing
  leases       the engine's batch read with a copy engine that copies nothing: lease, validate,
               release (one lock acquisition each), and for `server` the two round trips
  checksum     XXH3 of every block's destination views (`store.buffers.checksum`): what a
               `server` read adds to check its copy against the writer's checksum (`local`
               serves its own process's memory and checks none)
  copy         the copy alone (`CopyEngine.scatter_all` over the same source and destination
               views), on 1..N threads
  load         the whole `DirectCopier.load` (what a synchronous hit waits for), and the same
               through `StagedCopier` (the accelerator path forced on CPU)
  memcpy       one single-threaded `np.copyto` of the same number of bytes between two
               contiguous buffers: the floor one core sets, the issue's yardstick

Medians of `--reps` repetitions after warm-up. Writes `benchmarks/results/hitpath.json`
(`hitpath-quick.json` with --quick) and, with matplotlib, `hitpath.png`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS_DIR, log, machine_info, markdown_table, package_version, progress, pyplot, save_results
from plotting import finish

from kvpool.backends.base import Backend
from kvpool.backends.local import LocalBackend
from kvpool.backends.pool_server import ServerBackend
from kvpool.config import LocalSettings
from kvpool.device.copy import DirectCopier, StagedCopier
from kvpool.device.layout import KVLayout
from kvpool.errors import OK
from kvpool.keys import KeyScheme
from kvpool.store.buffers import checksum
from kvpool.store.memcopy import CopyEngine, auto_threads
from kvpool.testing.launch import PoolServer

BLOCK, LAYERS, KV_HEADS, HEAD = 128, 12, 4, 64  # the `bench` model, as vLLM-CPU lays it out
SIZES = {"4K": 4096, "8K": 8192}
MiB = 1 << 20


class _NoCopy(CopyEngine):
    """Copies nothing: what is left of a batch read is its bookkeeping."""

    def scatter_all(self, jobs, expect=None):  # type: ignore[override]
        return [None] * len(jobs)


class _NullAdapter(Backend):
    """An adapter that answers OK at once: what is left is the base class."""

    name = "local"

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return [True] * len(keys)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return [OK] * len(keys)

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return [OK] * len(keys)


def median_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def make_layout(num_blocks: int) -> KVLayout:
    gen = torch.Generator().manual_seed(0)
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.randn((num_blocks, 2, BLOCK, KV_HEADS * HEAD), generator=gen).to(torch.bfloat16)
              for i in range(LAYERS)}
    return KVLayout(caches, num_blocks=num_blocks, block_size=BLOCK, num_layers_total=LAYERS, cache_layout="cpu")


def profile(backend_name: str, backend: Backend, layout: KVLayout, n_blocks: int, threads: list[int],
            reps: int) -> dict[str, Any]:
    scheme = KeyScheme(model="bench", layout=layout.info.fingerprint())
    keys = [scheme.key(i.to_bytes(8, "big")) for i in range(n_blocks)]
    src_ids, dst_ids = list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))
    layers = range(len(layout.layers))
    direct = DirectCopier(layout)
    assert all(c in (OK, -705) for c in direct.save(keys, src_ids, layers, backend.batch_put))
    nbytes = n_blocks * layout.block_bytes
    row: dict[str, Any] = {"backend": backend_name, "blocks": n_blocks, "mib": nbytes / MiB}

    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    row["memcpy_ms"] = median_ms(lambda: np.copyto(dst, src), reps)
    row["lookup_ms"] = median_ms(lambda: backend.batch_exists(keys, lease=True), reps)
    row["views_ms"] = median_ms(lambda: [layout.stage_buffers(b, layers) for b in dst_ids], reps)
    views = [layout.stage_buffers(b, layers) for b in dst_ids]
    row["checksum_ms"] = median_ms(lambda: [checksum(v) for v in views], reps)
    null = _NullAdapter()
    row["base_ms"] = median_ms(lambda: null.batch_get_into(keys, views), reps)
    saved = backend._state.copies
    backend._state.copies = _NoCopy(1)
    row["leases_ms"] = median_ms(lambda: backend.batch_get_into(keys, views), reps)
    backend._state.copies = saved

    # The copy alone, between the pool's bytes and the same destinations.
    local_engine = getattr(backend, "engine", None)
    jobs = []
    if local_engine is not None:
        arena = np.frombuffer(local_engine.arena, dtype=np.uint8)
        for k, v in zip(keys, views):
            lease = local_engine.acquire("profile", k)
            jobs.append((arena[lease.offset:lease.offset + lease.size], v))
            local_engine.release(lease)
    else:  # the server's values are in its arena; time the same copy from a private copy
        flat = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
        per = layout.block_bytes
        jobs = [(flat[i * per:(i + 1) * per], v) for i, v in enumerate(views)]
    for t in threads:
        engine = CopyEngine(t)
        row[f"copy_ms_t{t}"] = median_ms(lambda: engine.scatter_all(jobs), reps)
        engine.close()
        backend.use_copy_threads(t)
        codes: list[int] = []

        def load() -> None:
            codes[:] = direct.load(keys, dst_ids, layers, backend.batch_get_into)

        row[f"load_ms_t{t}"] = median_ms(load, reps)
        assert codes == [OK] * n_blocks, f"{backend_name}: a load failed: {set(codes)}"
    # The staged path (what an accelerator takes), forced on CPU, with the default thread count.
    backend.use_copy_threads(auto_threads())
    staged = StagedCopier(layout, 2 * nbytes + MiB)
    row["staged_ms"] = median_ms(lambda: staged.load(keys, dst_ids, layers, backend.batch_get_into), reps)
    for b_src, b_dst in zip(src_ids, dst_ids):  # the loads were real: the blocks came back exact
        for layer in layout.layers:
            assert torch.equal(layer.blocks[b_src], layer.blocks[b_dst]), "a loaded block differs"
    return row


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """From a hitpath.json dict, at `path` (None: matplotlib is not installed): a hit's load
    time over one memcpy of the same bytes against copy_threads, and where a hit's time goes at
    the default thread count (the stages stacked, the whole load and memcpy marked)."""
    plt = pyplot()
    if plt is None:
        return None
    rows = results["rows"]
    threads = results["parameters"]["threads"]
    fig, (ratio, parts) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1, 1.4]})
    for r in rows:
        ratio.plot(threads, [r[f"load_ms_t{t}"] / r["memcpy_ms"] for t in threads], marker="o",
                   ls="-" if r["backend"] == "server" else "--",
                   label=f"{r['backend']} {r['size']} ({r['mib']:.0f} MiB)")
    ratio.axhline(1.0, color="grey", ls=":", label="one memcpy of the same bytes")
    ratio.set_xlabel("copy_threads")
    ratio.set_ylabel("hit load time / single-thread memcpy")
    ratio.set_xticks(threads)
    ratio.set_ylim(bottom=0)
    ratio.grid(True, alpha=0.3)
    ratio.legend(fontsize=8)
    ratio.set_title("the whole load (DirectCopier.load) against memcpy", fontsize=10)

    # Stages of one load, in the order the load runs them; the checksum only where a read
    # checks one (`server`: the reader hashes its copy; `local` serves its own memory).
    stages = [("views_ms", "byte views", "tab:olive"), ("base_ms", "base class", "tab:gray"),
              ("leases_ms", "leases", "tab:orange"), ("checksum_ms", "checksum (server reads)", "tab:red"),
              ("copy", "copy", "tab:blue")]
    labels = [f"{r['size']} {r['backend']}" for r in rows]
    left = [0.0] * len(rows)
    for key, name, color in stages:
        widths = []
        for r in rows:
            if key == "copy":
                widths.append(r[f"copy_ms_t{r['default_threads']}"])
            elif key == "checksum_ms":
                widths.append(r.get(key, 0.0) if r["backend"] == "server" else 0.0)
            else:
                widths.append(r.get(key, 0.0))
        if any(widths):
            parts.barh(range(len(rows)), widths, left=left, color=color, label=name, height=0.6)
            left = [a + b for a, b in zip(left, widths)]
    ys = range(len(rows))
    parts.scatter([r[f"load_ms_t{r['default_threads']}"] for r in rows], ys, marker="D", color="k", zorder=3,
                  label="whole load, measured")
    parts.scatter([r["memcpy_ms"] for r in rows], ys, marker="|", s=400, color="k", zorder=3,
                  label="one memcpy of the same bytes")
    parts.set_yticks(list(ys), labels)
    parts.invert_yaxis()
    parts.set_xlabel(f"ms, medians of {results['parameters']['reps']}")
    parts.grid(True, axis="x", alpha=0.3)
    parts.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    default = rows[0]["default_threads"] if rows else "?"
    parts.set_title(f"where a hit's load goes, each stage timed on its own (copy_threads {default})", fontsize=10)
    p = results["parameters"]
    return finish(plt, fig, f"Pool hit path without vLLM (benchmarks/hitpath.py): {p['layers']} layers x "
                  f"{p['kv_heads']} KV heads x {p['head_dim']}, {p['block_tokens']}-token blocks, bf16", results, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4K tokens only, 5 repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 15; 5 with --quick)")
    p.add_argument("--threads", default="1,2,4", help="copy thread counts to try (default 1,2,4)")
    args = p.parse_args(argv)
    reps = args.reps or (5 if args.quick else 15)
    sizes = {"4K": SIZES["4K"]} if args.quick else SIZES
    auto = auto_threads()  # what `copy_threads: 0`, the default, takes on this machine
    threads = sorted({int(t) for t in args.threads.split(",")} | {auto})
    torch.set_num_threads(1)  # the copies under test bring their own threads
    rows: list[dict[str, Any]] = []
    max_blocks = max(sizes.values()) // BLOCK
    layout = make_layout(2 * max_blocks)
    with tempfile.TemporaryDirectory(prefix="kvpool-hitpath-") as tmp:
        sock = os.path.join(tmp, "pool.sock")
        server = PoolServer(sock, memory_size="1GB", log_path=Path(tmp) / "server.log")
        server.start()
        try:
            backends: dict[str, Backend] = {
                "local": LocalBackend(LocalSettings(memory_size=1 << 30), "hitpath"),
                "server": ServerBackend(sock, "hitpath"),
            }
            with progress(len(sizes) * len(backends), "hitpath", unit="case") as bar:
                for size, tokens in sizes.items():
                    for name, backend in backends.items():
                        log(f"hitpath: {name} {size}")
                        row = profile(name, backend, layout, tokens // BLOCK, threads, reps)
                        row["size"] = size
                        rows.append(row)
                        bar.update(1)
            for backend in backends.values():
                backend.close()
        finally:
            server.stop()
    for r in rows:
        r["default_threads"] = auto
        r["default_vs_memcpy"] = r[f"load_ms_t{auto}"] / r["memcpy_ms"]
        r["serial_vs_memcpy"] = r[f"load_ms_t{threads[0]}"] / r["memcpy_ms"]
        r["staged_vs_direct"] = r["staged_ms"] / r[f"load_ms_t{auto}"]
    heads = ["size", "backend", "MiB", "memcpy", "lookup", "views", "base", "leases", "checksum",
             *[f"copy t{t}" for t in threads], *[f"load t{t}" for t in threads], "staged",
             f"load t{auto}/memcpy", "staged/direct"]
    table = markdown_table(heads, [
        [r["size"], r["backend"], f"{r['mib']:.0f}", f"{r['memcpy_ms']:.2f}", f"{r['lookup_ms']:.2f}",
         f"{r['views_ms']:.2f}", f"{r['base_ms']:.2f}", f"{r['leases_ms']:.2f}", f"{r['checksum_ms']:.2f}",
         *[f"{r[f'copy_ms_t{t}']:.2f}" for t in threads], *[f"{r[f'load_ms_t{t}']:.2f}" for t in threads],
         f"{r['staged_ms']:.2f}", f"{r['default_vs_memcpy']:.2f}", f"{r['staged_vs_direct']:.2f}"]
        for r in rows])
    print(f"times in ms (medians); copy_threads default here: {auto}\n" + table)
    env = machine_info(numpy=package_version("numpy"), torch=torch.__version__)
    results = {"environment": env, "parameters": {"reps": reps, "threads": threads, "block_tokens": BLOCK,
                                                  "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD},
               "rows": rows, "table": table}
    save_results(RESULTS_DIR / ("hitpath-quick.json" if args.quick else "hitpath.json"), results, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
