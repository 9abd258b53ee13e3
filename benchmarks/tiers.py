#!/usr/bin/env python
"""The host pool in front of Mooncake Store: what a read costs through each tier.

    .venv/bin/python benchmarks/tiers.py            # 16 prompts of 32 blocks of 1 MiB
    .venv/bin/python benchmarks/tiers.py --quick    # 6 prompts

Two "hosts" on this machine, each a `kvpool server` (its own socket and arena) with
`remote_backend: mooncake` behind it, sharing one `mooncake_master` over TCP: host A's client
mounts the Mooncake segment, host B's mounts none (so B's reads cross the transfer engine, as
from another host). For each prompt (`blocks` values of `value_size` bytes, fresh keys), host A
saves it and waits for the write-through; then, side by side in one round:

  mooncake  `backend: mooncake` read directly (a client that mounts no segment): the baseline a
            remote-tier read is held to;
  first     host B's first read: its host pool misses, Mooncake serves it, and a copy is
            queued for B's host pool (promotion, stored by a background thread, not timed);
  second    host B's second read: from its own host pool;
  server    `backend: server` read of host B's pool directly (no remote tier in front): what the
            second read is held to;
  memcpy    numpy copying the same bytes once (the ceiling).

Which of `mooncake` and `first` goes first alternates by round (the second of them finds warmer
caches in the holder). Every read is compared byte for byte with what was written, outside the
timed region. Medians over the prompts; targets (issue 42, at the store level rather than TTFT):
first <= 1.1x mooncake, second <= 1.05x server.

Writes benchmarks/results/tiers.json (tiers-quick.json with --quick) and its plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, log, machine_info, markdown_table, package_version, save_results, say  # noqa: E402
from plotting import pyplot  # noqa: E402

from kvpool.backends import create_backend  # noqa: E402
from kvpool.backends.tiered import TieredBackend  # noqa: E402
from kvpool.config import load_config  # noqa: E402
from kvpool.testing.launch import PoolServer  # noqa: E402
from kvpool.testing.services import MooncakeMaster  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
READS = ("mooncake", "first", "second", "server", "memcpy")
TARGETS = (("first", "mooncake", 1.1), ("second", "server", 1.05))


def _values(prompt: int, blocks: int, size: int) -> tuple[list[str], list[np.ndarray]]:
    rng = np.random.default_rng(prompt)
    return [f"p{prompt}-b{i}" for i in range(blocks)], [rng.integers(0, 256, size, np.uint8) for _ in range(blocks)]


def _timed_read(backend: Any, keys: list[str], want: list[np.ndarray]) -> float:
    outs = [np.empty_like(w) for w in want]
    for o in outs:
        o.fill(0)  # pre-faulted
    t = time.perf_counter()
    codes = backend.batch_get_into(keys, [[o] for o in outs])
    seconds = time.perf_counter() - t
    assert codes == [0] * len(keys), codes
    assert all(np.array_equal(o, w) for o, w in zip(outs, want)), "a read returned other bytes"
    return seconds


def _memcpy(want: list[np.ndarray]) -> float:
    outs = [np.zeros_like(w) for w in want]
    t = time.perf_counter()
    for o, w in zip(outs, want):
        np.copyto(o, w)
    return time.perf_counter() - t


def run(prompts: int, blocks: int, size: int, workdir: Path) -> dict[str, Any]:
    master = MooncakeMaster(workdir / "master")
    servers: list[PoolServer] = []
    clients: list[Any] = []
    try:
        pool = 4 * blocks * size * prompts  # nothing is evicted while measured

        def server(name: str) -> str:
            sock = str(workdir / f"{name}.sock")
            s = PoolServer(sock, memory_size=pool, log_path=str(workdir / f"{name}.log"), startup_timeout_s=30)
            servers.append(s)
            s.start()
            return sock

        def client(extra: dict[str, Any], name: str) -> Any:
            b = create_backend(load_config(extra), name)
            clients.append(b)
            return b

        holder = master.write_config(workdir / "holder.json", pool, local_buffer_size="64MB")
        reader = master.write_config(workdir / "reader.json", 0, local_buffer_size="64MB")
        a = client({"backend": "server", "server_socket": server("a"), "remote_backend": "mooncake",
                    "mooncake_config_path": holder, "transfer_timeout_s": 60}, "host-a")
        sock_b = server("b")
        b = client({"backend": "server", "server_socket": sock_b, "remote_backend": "mooncake",
                    "mooncake_config_path": reader, "transfer_timeout_s": 60}, "host-b")
        direct = client({"backend": "mooncake", "mooncake_config_path": reader, "transfer_timeout_s": 60}, "direct")
        b_server = client({"backend": "server", "server_socket": sock_b}, "host-b-direct")
        assert isinstance(a, TieredBackend) and isinstance(b, TieredBackend)
        samples: dict[str, list[float]] = {r: [] for r in READS}
        for p in range(prompts + 1):  # prompt 0 warms every path up, and is not counted
            keys, vals = _values(p, blocks, size)
            assert a.batch_put(keys, [[v] for v in vals]) == [0] * blocks
            assert a.flush(120), "the write-through did not finish"
            order = [("mooncake", direct), ("first", b)] if p % 2 else [("first", b), ("mooncake", direct)]
            got = {name: _timed_read(backend, keys, vals) for name, backend in order}
            assert b.flush(120), "the promotion did not finish"  # in the background, not timed
            got["second"] = _timed_read(b, keys, vals)
            got["server"] = _timed_read(b_server, keys, vals)
            got["memcpy"] = _memcpy(vals)
            if p:
                for name, s in got.items():
                    samples[name].append(s)
        stats = b.tier_stats()
        assert stats["remote_hit_blocks"] == (prompts + 1) * blocks, stats
        ms = {name: statistics.median(v) * 1000 for name, v in samples.items()}
        nbytes = blocks * size
        return {"ms": ms, "gbps": {n: nbytes / (m / 1000) / 1e9 for n, m in ms.items()},
                "samples_ms": {n: [s * 1000 for s in v] for n, v in samples.items()},
                "ratios": {f"{x}/{y}": ms[x] / ms[y] for x, y, _ in TARGETS},
                "tier_stats": stats}
    finally:
        for c in reversed(clients):
            c.close()
        for s in servers:
            s.stop(grace_s=10)
        master.stop()


def plot(results: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    ms = results["run"]["ms"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(READS), [ms[r] for r in READS], color=["#888", "#c44", "#4a4", "#48c", "#ccc"])
    ax.set_ylabel(f"ms per prompt ({results['blocks']} x {results['value_size'] >> 20} MiB)")
    ax.set_title("A read through each tier (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 prompts instead of 16")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--value-size", type=int, default=1 << 20)
    args = p.parse_args(argv)
    prompts = 6 if args.quick else 16
    with tempfile.TemporaryDirectory(prefix="kvpool-tiers-") as tmp:
        result = run(prompts, args.blocks, args.value_size, Path(tmp))
    report = {"environment": machine_info(mooncake_transfer_engine=package_version(
        "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")),
        "prompts": prompts, "blocks": args.blocks, "value_size": args.value_size, "run": result,
        "targets": [{"target": f"{x} <= {limit}x {y}", "ratio": result["ratios"][f"{x}/{y}"],
                     "met": result["ratios"][f"{x}/{y}"] <= limit} for x, y, limit in TARGETS]}
    rows = [[r, fmt(result["ms"][r], 2), fmt(result["gbps"][r], 2)] for r in READS]
    say(markdown_table(["read", "ms (median)", "GB/s"], rows))
    say(markdown_table(["target", "ratio", "met"], [[t["target"], fmt(t["ratio"], 3), t["met"]]
                                                     for t in report["targets"]]))
    save_results(RESULTS / ("tiers-quick.json" if args.quick else "tiers.json"), report, plot)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
