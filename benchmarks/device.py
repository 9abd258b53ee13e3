#!/usr/bin/env python3
"""Device check of the accelerator data path: paged KV cache <-> pinned host staging <-> pool.

What it checks, per KV layout (vLLM's GPU ones) and dtype, on real tensors of the chosen device:

- a save through `StagedCopier` (index_select on a side stream, non-blocking D2H into pinned host
  buffers, in rounds) into a real `PoolEngine`, then a load back (H2D, index_copy_) into other,
  shuffled block ids, leaves every byte of every loaded block equal to its source block, touches
  no other block, and does not modify the cache it saved from;
- the pool's value for a block is that block's bytes layer by layer (the format every instance
  with the same layout fingerprint reads);
- a load with missing keys reports those blocks not OK, loads the others exactly, and leaves the
  failed blocks' bytes as they were (not overwritten with another block's);

and what it measures: save (gather + D2H + engine put) and load (engine get + H2D + scatter) in
GB/s of KV data moved, the same two with a no-op pool (staging only: the engine's share is the
difference), and torch's own baseline, one contiguous pinned-host <-> device copy_ of the same
number of bytes. Medians of several reps after warm-up.

Run it on an accelerator machine from the repository root; it needs torch and numpy only (no
vLLM, no msgspec, nothing installed: it puts src/ on sys.path itself):

    python3 benchmarks/device.py                  # 6 cases, 1 GiB per rep: a few minutes at most
    python3 benchmarks/device.py --quick          # seconds; on a CPU-only machine a smoke run
    python3 benchmarks/device.py --device cpu --quick --out /tmp/d.json

`--device auto` (the default) takes torch.accelerator's current device, else the CPU: then the
same code runs on host tensors, labelled a smoke run (its GB/s say nothing about a device).
Exit status 1 when any byte, code or block differs (the failures name layout, dtype and block).
Writes benchmarks/results/device.json (device-quick.json with --quick, device-cpu.json for a
full run on the CPU), or --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout, nothing installed
    sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Only the layers below kvpool.vllm: the accelerator machine has torch but no vLLM or msgspec.
from host import cpu_model  # noqa: E402  (the standard library only)
from plotting import finish, pyplot  # noqa: E402  (the standard library; matplotlib if installed)
from kvpool.device.copy import StagedCopier  # noqa: E402
from kvpool.device.layout import KVLayout  # noqa: E402
from kvpool.errors import OK  # noqa: E402
from kvpool.store import EngineConfig, PoolEngine  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
MiB = 1 << 20
CLIENT = "device-check"
# The worker's default staging buffer (kvpool.config.DEFAULT_STAGING_BYTES; config is not
# imported because it needs msgspec).
DEFAULT_STAGING_MIB = 512
# Blocks whose pool value is compared with the cache's bytes (value format); a few suffice.
VALUE_FORMAT_SAMPLES = 3
# Failure lines kept per check: one broken index would otherwise print thousands.
MAX_FAILURE_LINES = 5
ALL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- the KV layouts -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """One of vLLM's per-layer KV cache layouts: logical shape, and the order in memory."""

    name: str
    shape: str  # for the table and JSON
    block_dim: int  # in the logical shape

    def allocate(self, num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, gen: torch.Generator) -> torch.Tensor:
        """A layer's cache filled with random bit patterns (NaN and inf included, so any byte
        mix-up shows in a bytewise comparison), with vLLM's shape and strides."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.name == "flash_attn":
            phys, perm = (2, num_blocks, block_size, heads, head_dim), None
        elif self.name == "flashinfer_nhd":
            phys, perm = (num_blocks, 2, block_size, heads, head_dim), None
        elif self.name == "flashinfer_hnd":
            # vLLM allocates in the stride order (0, 1, 3, 2, 4) and hands connectors the logical
            # [num_blocks, 2, block_size, heads, head_dim] view: a non-contiguous tensor.
            phys, perm = (num_blocks, 2, heads, block_size, head_dim), (0, 1, 3, 2, 4)
        else:
            raise ValueError(self.name)
        raw = torch.randint(0, 256, (*phys[:-1], phys[-1] * itemsize), dtype=torch.uint8, device=device,
                            generator=gen)
        t = raw.view(dtype)
        return t.permute(*perm) if perm else t


LAYOUTS = {
    "flash_attn": Layout("flash_attn", "[2, blocks, block_size, kv_heads, head_dim]", 1),
    "flashinfer_nhd": Layout("flashinfer_nhd", "[blocks, 2, block_size, kv_heads, head_dim]", 0),
    "flashinfer_hnd": Layout("flashinfer_hnd", "[blocks, 2, block_size, kv_heads, head_dim] (HND memory)", 0),
}


# ---- device plumbing ------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if not torch.accelerator.is_available():
            return torch.device("cpu")
        acc = torch.accelerator.current_accelerator()
        assert acc is not None
        return torch.device(acc.type, torch.accelerator.current_device_index())
    dev = torch.device(name)
    if dev.type == "cpu":
        return dev
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        raise SystemExit(f"--device {name}: this torch sees no {dev.type} accelerator "
                         f"(current accelerator: {acc}); use --device auto or cpu")
    if dev.index is None:
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    torch.accelerator.set_device_index(dev.index)
    return dev


def sync(device: torch.device) -> None:
    """Wait for all queued work on the device, so a timer brackets only what it should."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return f"cpu ({cpu_model() or platform.processor() or platform.machine()})"
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    module = getattr(torch, device.type, None)  # xpu, npu (torch_npu) have the same call
    get = getattr(module, "get_device_name", None)
    if callable(get):
        try:
            return str(get(device))
        except Exception:  # a name is decoration; never fail the check for it
            pass
    return str(device)


def machine(device: torch.device) -> dict[str, Any]:
    return {
        "device": str(device),
        "device_name": device_name(device),
        "smoke_run": device.type == "cpu",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }


# ---- checking -------------------------------------------------------------------------------


class Checker:
    """Counts the bytes compared and the mismatches of one case; keeps a few failure lines."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.bytes_checked = 0
        self.mismatches = 0
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.mismatches += 1
        if len(self.failures) < MAX_FAILURE_LINES:
            self.failures.append(f"{self.case}: {what}")
        elif len(self.failures) == MAX_FAILURE_LINES:
            self.failures.append(f"{self.case}: (more mismatches left out)")

    def codes(self, what: str, codes: Sequence[int], expect_ok: Sequence[bool], block_ids: Sequence[int]) -> None:
        if len(codes) != len(expect_ok):
            self.fail(f"{what}: {len(codes)} codes for {len(expect_ok)} keys")
            return
        for i, (code, ok) in enumerate(zip(codes, expect_ok)):
            if (code == OK) != ok:
                self.fail(f"{what}: block {block_ids[i]} (key {i}) has code {int(code)}, "
                          f"expected {'OK' if ok else 'not OK'}")


def block_rows(cache: torch.Tensor, block_dim: int, index: torch.Tensor) -> torch.Tensor:
    """[len(index), bytes per block] uint8: the blocks' bytes in the tensor's logical order,
    taken from the cache tensor itself rather than through KVLayout, so a wrong view there
    shows up here."""
    picked = cache.index_select(block_dim, index).movedim(block_dim, 0).contiguous()
    return picked.view(torch.uint8).reshape(len(index), -1)


def changed_blocks(cache: torch.Tensor, before: torch.Tensor, block_dim: int) -> set[int]:
    """The block ids where `cache` and its earlier clone differ in any byte."""
    ne = cache.view(torch.uint8) != before.view(torch.uint8)
    others = tuple(d for d in range(ne.dim()) if d != block_dim)
    return set(torch.nonzero(ne.any(dim=others)).flatten().tolist())


def compare_rows(check: Checker, what: str, layer: int, got: torch.Tensor, want: torch.Tensor,
                 block_ids: Sequence[int], src_ids: Sequence[int]) -> None:
    check.bytes_checked += got.numel()
    bad = torch.nonzero(~(got == want).all(dim=1)).flatten().tolist()
    for j in bad:
        check.fail(f"{what}: layer {layer} block {block_ids[j]} (copied from block {src_ids[j]}) "
                   f"differs from its source")


def compare_untouched(check: Checker, what: str, caches: list[torch.Tensor], before: list[torch.Tensor],
                      block_dim: int, may_change: set[int]) -> None:
    """Every block outside `may_change`, in every layer, must have kept its bytes."""
    for layer, (t, b) in enumerate(zip(caches, before)):
        check.bytes_checked += t.numel() * t.element_size()
        for blk in sorted(changed_blocks(t, b, block_dim) - may_change):
            check.fail(f"{what}: layer {layer} block {blk} was written but should have kept its bytes")


def rerandomize(caches: list[torch.Tensor], block_dim: int, index: torch.Tensor, gen: torch.Generator) -> None:
    """New random bytes in these blocks, so a load that skips them cannot pass by luck."""
    for t in caches:
        u8 = t.view(torch.uint8)
        shape = list(u8.shape)
        shape[block_dim] = len(index)
        u8.index_copy_(block_dim, index, torch.randint(0, 256, shape, dtype=torch.uint8, device=t.device,
                                                        generator=gen))


def missing_pattern(n: int, per_round: int) -> list[bool]:
    """Which keys of a batch are present for the partial load: round 0 complete, round 1 all
    missing, later rounds every third key missing, so each branch of the scatter (all, none,
    some of a round) runs. With fewer than three rounds: every third key missing."""
    rounds = math.ceil(n / per_round)
    present = []
    for i in range(n):
        r = i // per_round
        if rounds < 3:
            present.append(i % 3 != 1)
        else:
            present.append(r == 0 or (r >= 2 and i % 3 != 1))
    return present


# ---- timing ---------------------------------------------------------------------------------


def timed(device: torch.device, reps: int, warmup: int, run: Callable[[int], None],
          after: Callable[[int], None] | None = None) -> list[float]:
    """Seconds of each timed rep of `run(rep)`, synchronized on both sides; `after(rep)` is
    untimed clean-up (removing a rep's keys so the next one really writes)."""
    out = []
    for rep in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        run(rep)
        sync(device)
        dt = time.perf_counter() - t0
        if after is not None:
            after(rep)
        if rep >= warmup:
            out.append(dt)
    return out


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


# ---- one case -------------------------------------------------------------------------------


@dataclasses.dataclass
class Params:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    blocks: int  # per batch moved
    staging_bytes: int | None  # None: from blocks_per_round
    blocks_per_round: int | None
    reps: int
    warmup: int
    seed: int


def run_case(layout: Layout, dtype_name: str, p: Params, device: torch.device, case_no: int) -> dict[str, Any]:
    dtype = ALL_DTYPES[dtype_name]
    case = f"{layout.name}/{dtype_name}"
    check = Checker(case)
    gen = torch.Generator(device=device).manual_seed(p.seed * 1000 + case_no)
    caches = [layout.allocate(p.num_blocks, p.block_size, p.kv_heads, p.head_dim, dtype, device, gen)
              for _ in range(p.layers)]
    kv = KVLayout({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)},
                  num_blocks=p.num_blocks, block_size=p.block_size, num_layers_total=p.layers,
                  cache_layout=layout.name)
    bb = kv.block_bytes
    budget = p.staging_bytes if p.staging_bytes is not None else 2 * (p.blocks_per_round or 1) * bb
    copier = StagedCopier(kv, budget)
    n = p.blocks
    nbytes = n * bb
    all_layers = range(p.layers)
    bdim = layout.block_dim

    # Shuffled, disjoint, non-contiguous source and destination blocks, as vLLM's are.
    ids = list(range(p.num_blocks))
    random.Random(p.seed + case_no).shuffle(ids)
    src_ids, dst_ids = ids[:n], ids[n:2 * n]
    src_idx = torch.tensor(src_ids, dtype=torch.long, device=device)
    dst_idx = torch.tensor(dst_ids, dtype=torch.long, device=device)

    # The watermark evicts past 90% of the pool; a missing key must be one we removed.
    reserved = -(-bb // 64) * 64
    engine = PoolEngine(EngineConfig(memory_size=-(-int(n * reserved / 0.8) // 64) * 64 + MiB,
                                     reap_interval_s=0))
    try:
        put = lambda keys, values: engine.batch_put(CLIENT, keys, values)  # noqa: E731
        get = lambda keys, bufs: engine.batch_get_into(CLIENT, keys, bufs)  # noqa: E731

        # -- save: codes, the cache left as it was, the value format ----------------------------
        keys = [f"{case}/v/{i}" for i in range(n)]
        sync(device)
        before = [t.clone() for t in caches]
        src_rows = [block_rows(t, bdim, src_idx) for t in caches]
        check.codes("save", copier.save(keys, src_ids, all_layers, put, ready=copier.written()),
                    [True] * n, src_ids)
        sync(device)
        compare_untouched(check, "save", caches, before, bdim, set())
        for j in sorted({0, n // 2, n - 1})[:VALUE_FORMAT_SAMPLES]:
            value = np.empty(bb, dtype=np.uint8)
            code = engine.batch_get_into(CLIENT, [keys[j]], [[value]])[0]
            want = torch.cat([rows[j] for rows in src_rows]).cpu().numpy()
            check.bytes_checked += bb
            if code != OK:
                check.fail(f"value format: block {src_ids[j]}: pool get answered {int(code)}")
            elif not np.array_equal(value, want):
                off = int(np.flatnonzero(value != want)[0])
                check.fail(f"value format: block {src_ids[j]}: the pool's value differs from the block's "
                           f"bytes layer by layer (first at byte {off}: layer {off // kv.layer_block_bytes})")

        # -- full load into other blocks --------------------------------------------------------
        rerandomize(caches, bdim, dst_idx, gen)
        sync(device)
        before = [t.clone() for t in caches]
        check.codes("load", copier.load(keys, dst_ids, all_layers, get), [True] * n, dst_ids)
        sync(device)
        for layer, t in enumerate(caches):
            compare_rows(check, "load", layer, block_rows(t, bdim, dst_idx), src_rows[layer], dst_ids, src_ids)
        compare_untouched(check, "load", caches, before, bdim, set(dst_ids))

        # -- a load with missing keys -----------------------------------------------------------
        present = missing_pattern(n, copier.capacity)
        for key, here in zip(keys, present):
            if not here and engine.remove(key) != OK:
                check.fail(f"partial load: could not remove key {key} to make it missing")
        rerandomize(caches, bdim, dst_idx, gen)
        sync(device)
        before = [t.clone() for t in caches]
        check.codes("partial load", copier.load(keys, dst_ids, all_layers, get), present, dst_ids)
        sync(device)
        loaded = [j for j in range(n) if present[j]]
        if loaded:
            loaded_idx = torch.tensor([dst_ids[j] for j in loaded], dtype=torch.long, device=device)
            pick = torch.tensor(loaded, dtype=torch.long, device=device)
            for layer, t in enumerate(caches):
                compare_rows(check, "partial load", layer, block_rows(t, bdim, loaded_idx),
                             src_rows[layer].index_select(0, pick), [dst_ids[j] for j in loaded],
                             [src_ids[j] for j in loaded])
        # The failed blocks are among those that must be unchanged: not written with any bytes.
        compare_untouched(check, "partial load (failed blocks and the rest)", caches, before, bdim,
                          {dst_ids[j] for j in loaded})
        del before, src_rows

        # -- timing -----------------------------------------------------------------------------
        # The removed keys back in, so every timed load is a full hit.
        copier.save(keys, src_ids, all_layers, put, ready=copier.written())

        def load_engine(rep: int) -> None:
            codes = copier.load(keys, dst_ids, all_layers, get)
            if any(c != OK for c in codes):
                check.fail(f"timed load rep {rep}: {sum(c != OK for c in codes)} blocks not OK")

        t_load = timed(device, p.reps, p.warmup, load_engine)
        for key in keys:  # room for the timed saves, whose keys must be new to be written
            engine.remove(key)

        def save_engine(rep: int) -> None:
            codes = copier.save([f"{case}/t{rep}/{i}" for i in range(n)], src_ids, all_layers, put,
                                ready=copier.written())
            if any(c != OK for c in codes):
                check.fail(f"timed save rep {rep}: {sum(c != OK for c in codes)} blocks not OK")

        def drop_rep(rep: int) -> None:
            for i in range(n):
                engine.remove(f"{case}/t{rep}/{i}")

        t_save = timed(device, p.reps, p.warmup, save_engine, drop_rep)
        evictions = engine.stats().get("evictions", 0)
        if evictions:
            check.fail(f"the pool evicted {evictions} objects: raise its memory_size in this script")
    finally:
        engine.close()

    noop = lambda keys, bufs: [OK] * len(keys)  # noqa: E731
    t_save_stage = timed(device, p.reps, p.warmup,
                         lambda rep: copier.save(keys, src_ids, all_layers, noop, ready=copier.written()))
    t_load_stage = timed(device, p.reps, p.warmup, lambda rep: copier.load(keys, dst_ids, all_layers, noop))

    # torch's own rate for the same bytes: one contiguous copy, pinned host memory (as the
    # staging buffers are) when there is a device.
    pinned = device.type != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    t_d2h = timed(device, p.reps, p.warmup, lambda rep: host.copy_(dev, non_blocking=True))
    t_h2d = timed(device, p.reps, p.warmup, lambda rep: dev.copy_(host, non_blocking=True))
    del host, dev, caches, kv

    rates = {
        "save": gbps(nbytes, t_save),
        "load": gbps(nbytes, t_load),
        "save_staging_only": gbps(nbytes, t_save_stage),
        "load_staging_only": gbps(nbytes, t_load_stage),
        "torch_d2h": gbps(nbytes, t_d2h),
        "torch_h2d": gbps(nbytes, t_h2d),
    }
    return {
        "case": case,
        "layout": layout.name,
        "shape": layout.shape,
        "dtype": dtype_name,
        "block_bytes": bb,
        "blocks_per_batch": n,
        "bytes_per_rep": nbytes,
        "staging_buffer_bytes": copier.buffer_bytes,
        "blocks_per_round": copier.capacity,
        "rounds": math.ceil(n / copier.capacity),
        "partial_load": {"present": sum(present), "missing": n - sum(present)},
        "verified": check.mismatches == 0,
        "bytes_checked": check.bytes_checked,
        "mismatches": check.mismatches,
        "failures": check.failures,
        "gbps": rates,
        "ratio_to_torch": {
            "save": rates["save"] / rates["torch_d2h"],
            "load": rates["load"] / rates["torch_h2d"],
            "save_staging_only": rates["save_staging_only"] / rates["torch_d2h"],
            "load_staging_only": rates["load_staging_only"] / rates["torch_h2d"],
        },
        "seconds": {"save": t_save, "load": t_load, "save_staging_only": t_save_stage,
                    "load_staging_only": t_load_stage, "torch_d2h": t_d2h, "torch_h2d": t_h2d},
    }


# ---- output ---------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    head = ["case", "MiB/rep", "rounds", "checked", "save", "load", "save stg", "load stg",
            "torch D2H", "torch H2D", "save/D2H", "load/H2D"]
    rows = [head]
    for c in results["cases"]:
        g, r = c["gbps"], c["ratio_to_torch"]
        rows.append([
            c["case"], f"{c['bytes_per_rep'] / MiB:.{0 if c['bytes_per_rep'] >= 100 * MiB else 2}f}",
            str(c["rounds"]),
            "ok" if c["verified"] else f"{c['mismatches']} BAD",
            *(f"{g[k]:.2f}" for k in ("save", "load", "save_staging_only", "load_staging_only",
                                        "torch_d2h", "torch_h2d")),
            f"{r['save']:.2f}", f"{r['load']:.2f}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """From a device.json dict, at `path` (None: matplotlib is not installed, as it may not be on
    an accelerator machine): GB/s per layout/dtype case, saves (device -> pool) and loads (pool ->
    device), each against the staging alone (a no-op pool) and torch's own contiguous copy."""
    plt = pyplot()
    if plt is None:
        return None
    cases = results["cases"]
    names = [c["case"] for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(cases) + 4), 4.8), sharey=True)
    for ax, (op, torch_key, title) in zip(axes, (("save", "torch_d2h", "save: paged cache -> staging -> pool (D2H)"),
                                                  ("load", "torch_h2d", "load: pool -> staging -> paged cache (H2D)"))):
        bars = [(op, "kvpool, through the pool engine", "tab:blue"),
                (f"{op}_staging_only", "staging only (no-op pool)", "tab:cyan"),
                (torch_key, "torch: one contiguous pinned copy", "tab:gray")]
        for k, (key, label, color) in enumerate(bars):
            ax.bar([i - 0.27 + 0.27 * k for i in range(len(cases))], [c["gbps"][key] for c in cases], 0.27,
                   color=color, label=label)
        for i, c in enumerate(cases):
            if not c["verified"]:  # a throughput of wrong bytes is no throughput: mark it
                ax.text(i, 0, f"{c['mismatches']} MISMATCHES", rotation=90, ha="center", va="bottom", color="red")
        ax.set_xticks(range(len(cases)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s of KV data moved (median rep)")
    pr = results["parameters"]
    return finish(plt, fig, f"Device check of the staged data path (benchmarks/device.py): {pr['layers']} layers x "
                  f"{pr['kv_heads']} KV heads x {pr['head_dim']}, {pr['block_size']}-token blocks, {pr['blocks']} "
                  f"blocks per rep", results, path)


def _progress(total: int) -> Any:
    """A progress bar over the cases on stderr, on a terminal only; None where tqdm is not
    installed (this script needs torch and numpy, nothing else)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="device check", unit="case", file=sys.stderr, leave=False, disable=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (torch.accelerator, else cpu), cpu, cuda, cuda:1, xpu ...")
    ap.add_argument("--quick", action="store_true", help="tiny caches, 3 reps: seconds, also on a CPU")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated, of bfloat16, float16, float32 (default bf16,fp16; fp32 too on cpu)")
    ap.add_argument("--layers", type=int, default=None, help="attention layers (default 32, quick 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8, quick 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="head size (default 128, quick 32)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--num-blocks", type=int, default=None, help="blocks in the cache (default 2048, quick 64)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="blocks moved per rep, at most half of --num-blocks (default 512, quick 24)")
    ap.add_argument("--staging-mib", type=int, default=None,
                    help=f"staging buffer, both directions together (default {DEFAULT_STAGING_MIB}, the worker's)")
    ap.add_argument("--blocks-per-round", type=int, default=None,
                    help="size the staging buffer to this many blocks per round instead (quick: 5)")
    ap.add_argument("--reps", type=int, default=None, help="timed reps (default 5, quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed reps first (default 2, quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = ap.parse_args(argv)

    device = pick_device(args.device)
    if device.type == "cpu":
        # Copies of a few dozen KiB cross torch's parallel grain; on a busy host OpenMP's thread
        # hand-offs then cost milliseconds each. The smoke run checks the code, not CPU speed.
        torch.set_num_threads(1)
    q = args.quick
    blocks_per_round = args.blocks_per_round or (5 if q and args.staging_mib is None else None)
    p = Params(
        layers=args.layers or (4 if q else 32),
        kv_heads=args.kv_heads or (2 if q else 8),
        head_dim=args.head_dim or (32 if q else 128),
        block_size=args.block_size,
        num_blocks=args.num_blocks or (64 if q else 2048),
        blocks=args.blocks or (24 if q else 512),
        staging_bytes=None if blocks_per_round else (args.staging_mib or DEFAULT_STAGING_MIB) * MiB,
        blocks_per_round=blocks_per_round,
        reps=args.reps or (3 if q else 5),
        warmup=args.warmup if args.warmup is not None else (1 if q else 2),
        seed=args.seed,
    )
    if 2 * p.blocks > p.num_blocks:
        ap.error(f"--blocks {p.blocks} needs --num-blocks of at least {2 * p.blocks} (sources and destinations)")
    layouts = [n for n in args.layouts.split(",") if n]
    for n in layouts:
        if n not in LAYOUTS:
            ap.error(f"unknown layout {n!r}: one of {', '.join(LAYOUTS)}")
    dtypes = [n for n in (args.dtypes or ("bfloat16,float16,float32" if device.type == "cpu"
                                          else "bfloat16,float16")).split(",") if n]
    for n in dtypes:
        if n not in ALL_DTYPES:
            ap.error(f"unknown dtype {n!r}: one of {', '.join(ALL_DTYPES)}")
    out = args.out or RESULTS_DIR / ("device-quick.json" if q else "device.json" if device.type != "cpu"
                                     else "device-cpu.json")

    info = machine(device)
    label = " -- SMOKE RUN on the CPU: checks the code, its GB/s say nothing about a device" \
        if device.type == "cpu" else ""
    print(f"device check on {info['device_name']} ({device}), torch {torch.__version__}{label}", flush=True)
    print(f"{p.layers} layers x {p.kv_heads} KV heads x head {p.head_dim}, block {p.block_size} tokens, "
          f"{p.num_blocks} blocks per layer; {p.blocks} blocks per rep, {p.reps} reps after {p.warmup} warm-up",
          flush=True)

    t_start = time.perf_counter()
    cases = []
    todo = [(ln, dn) for ln in layouts for dn in dtypes]
    bar = _progress(len(todo))
    say = bar.write if bar is not None else print  # a line printed under a bar would break it
    for no, (lname, dname) in enumerate(todo):
        t0 = time.perf_counter()
        result = run_case(LAYOUTS[lname], dname, p, device, no)
        cases.append(result)
        status = "verified" if result["verified"] else f"{result['mismatches']} MISMATCHES"
        say(f"  {result['case']}: {status}, {result['bytes_checked'] / MiB:.0f} MiB compared, "
            f"{result['rounds']} rounds of {result['blocks_per_round']} blocks "
            f"({time.perf_counter() - t0:.1f} s)")
        for line in result["failures"]:
            say(f"    FAIL {line}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    results = {
        "machine": info,
        "parameters": {**dataclasses.asdict(p), "device": str(device), "quick": q, "layouts": layouts,
                       "dtypes": dtypes},
        "cases": cases,
        "all_verified": all(c["verified"] for c in cases),
        "runtime_s": time.perf_counter() - t_start,
    }
    print()
    print("GB/s of KV data moved (medians); stg = staging only (no-op pool); ratios to torch's contiguous copy")
    print(table(results))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    png = plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f" ({results['runtime_s']:.1f} s)")
    if not results["all_verified"]:
        print("DEVICE CHECK FAILED: see the FAIL lines above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
