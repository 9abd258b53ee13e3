"""vLLM on a real distributed store: Mooncake Store and openYuanrong datasystem.

Hits through the store equal vLLM's own prefix-cache hits, bit for bit; when the store goes
away mid-run, requests still succeed (misses and recompute), never error or hang.

Mooncake keeps objects in the segments its clients mount (each vLLM instance mounts one), so
two instances run side by side and the second loads what the first computed, wherever the
master placed it. A Yuanrong worker holds the objects itself, so one instance shows the whole
path; several clients of one worker are the conformance suite's `test_concurrent_processes`.
"""

from __future__ import annotations

import pytest

from harness import Engine, kvpool_config, tokens, whole
from kvpool.testing.services import MooncakeMaster, YuanrongWorker

pytestmark = pytest.mark.vllm

DOC = {"mooncake": tokens(1100, seed=71), "yuanrong": tokens(1100, seed=73)}  # 8 whole blocks
LATE = {"mooncake": tokens(700, seed=72), "yuanrong": tokens(700, seed=74)}  # asked once the store is gone


def _same(got: dict, want: dict) -> None:
    assert got["error"] is None, got
    assert got["num_cached_tokens"] == want["num_cached_tokens"]
    assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]


def test_mooncake_two_instances_share_the_store(model_dir, reference, tmp_path):
    ref_cold, ref_hit, ref_late = reference.generate([DOC["mooncake"], DOC["mooncake"], LATE["mooncake"]])
    master = MooncakeMaster(tmp_path)
    try:
        path = master.write_config(tmp_path / "mooncake.json", global_segment_size="256MB", local_buffer_size="64MB")
        env = {"MOONCAKE_CONFIG_PATH": path}
        engines = [Engine(model_dir, kv_transfer_config=kvpool_config(backend="mooncake"), env=env, wait=False)
                   for _ in range(2)]
        try:
            a, b = (e.wait_ready() for e in engines)
            _same(a.generate([DOC["mooncake"]])[0], ref_cold)
            second = b.generate([DOC["mooncake"]])[0]  # B never saw DOC: A's blocks, through the store
            assert second["num_cached_tokens"] == whole(DOC["mooncake"])
            _same(second, ref_hit)

            master.kill()  # the store dies under both instances
            _same(b.generate([LATE["mooncake"]])[0], ref_late)
            again = a.generate([DOC["mooncake"]])[0]  # the store is gone: recomputed
            assert again["error"] is None and again["token_ids"] == ref_cold["token_ids"]
        finally:
            for e in engines:  # their store is dead: how they shut down is not tested here
                e.kill()
    finally:
        master.stop()


def test_yuanrong_hits_and_survives_the_worker(model_dir, reference, tmp_path):
    ref_cold, ref_hit, ref_late = reference.generate([DOC["yuanrong"], DOC["yuanrong"], LATE["yuanrong"]])
    worker = YuanrongWorker(tmp_path, shared_memory_mb=512)
    try:
        env = {"DS_WORKER_ADDR": worker.address, "DATASYSTEM_CLIENT_LOG_DIR": str(tmp_path / "client-logs")}
        e = Engine(model_dir, kv_transfer_config=kvpool_config(backend="yuanrong"), env=env)
        try:
            cold, hit = e.generate([DOC["yuanrong"], DOC["yuanrong"]])
            _same(cold, ref_cold)
            assert hit["num_cached_tokens"] == whole(DOC["yuanrong"])
            _same(hit, ref_hit)

            worker.kill()  # the store dies under the instance
            _same(e.generate([LATE["yuanrong"]])[0], ref_late)
            again = e.generate([DOC["yuanrong"]])[0]  # the store is gone: recomputed
            assert again["error"] is None and again["token_ids"] == ref_cold["token_ids"]
        finally:
            e.kill()  # its store is dead: how it shuts down is not tested here
    finally:
        worker.stop()
