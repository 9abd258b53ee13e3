"""Instances of different TP sizes share one pool (`share_across_tp`), on real vLLM (`make test-models`).

A TP=1 and a TP=2 instance of the same GQA model write and read one `kvpool server`, each
block as one value per KV head. The TP=2 instance hits what the TP=1 instance computed, and
the reverse, with the token ids vLLM's own prefix cache gives at the reader's TP size. (Logprobs
are not compared: KV computed at another TP size sums its layers' products in another order, so
its last bits differ, as a cold run at TP=1 and at TP=2 differ.)
"""

from __future__ import annotations

import contextlib

import pytest

from harness import Engine, kvpool_config, tokens, whole
from kvpool.testing.launch import PoolServer

pytestmark = [pytest.mark.vllm, pytest.mark.models]

TP2 = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
FROM_TP1 = tokens(700, seed=9501)  # computed at TP=1, read at TP=2
FROM_TP2 = tokens(700, seed=9502)  # computed at TP=2, read at TP=1


@pytest.fixture(scope="module")
def runs(model_dir, reference, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-share")
    sock = str(tmp / "pool.sock")
    out = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(PoolServer(sock, memory_size="512MB", log_path=tmp / "pool.log"))

        def pooled(**kw):
            return Engine(model_dir, kv_transfer_config=kvpool_config(backend="server", server_socket=sock,
                                                                      share_across_tp=True), **kw)

        with pooled() as tp1:
            out["tp1_cold"] = tp1.generate([FROM_TP1])[0]
        with pooled(**TP2) as tp2:
            since = tp2.mark()
            out["tp2_hit"], out["tp2_cold"] = tp2.generate([FROM_TP1, FROM_TP2])
            out["tp2_counters"] = {r: tp2.counters(since, rank=r) for r in ("tp0 pp0", "tp1 pp0")}
        with pooled() as tp1:
            out["tp1_hit"] = tp1.generate([FROM_TP2])[0]
        with Engine(model_dir, prefix_caching=True, **TP2) as alone:  # vLLM's own cache at TP=2
            out["tp2_ref"] = alone.generate([FROM_TP1, FROM_TP1])[1]
    out["tp1_ref"] = reference.generate([FROM_TP2, FROM_TP2])[1]
    return out


def test_tp2_hits_what_tp1_computed(runs):
    assert runs["tp1_cold"]["num_cached_tokens"] == 0
    assert runs["tp2_hit"]["num_cached_tokens"] == runs["tp2_ref"]["num_cached_tokens"] == whole(FROM_TP1)
    assert runs["tp2_hit"]["token_ids"] == runs["tp2_ref"]["token_ids"]
    # Each rank loaded its own head of every block (2 KV heads over TP=2).
    assert [c["load_blocks"] for c in runs["tp2_counters"].values()] == [whole(FROM_TP1) // 128] * 2


def test_tp1_hits_what_tp2_computed(runs):
    assert runs["tp2_cold"]["num_cached_tokens"] == 0
    assert runs["tp1_hit"]["num_cached_tokens"] == runs["tp1_ref"]["num_cached_tokens"] == whole(FROM_TP2)
    assert runs["tp1_hit"]["token_ids"] == runs["tp1_ref"]["token_ids"]
