"""kvpool inside vLLM's MultiConnector, and under tensor parallelism.

MultiConnector: the spec pairs kvpool with a P2P transfer connector (MooncakeConnectorV1). No
P2P transfer connector runs on this CPU machine (vLLM's NIXL and Mooncake P2P connectors need
their RDMA/GPU transports), so the second child is vLLM's own ExampleConnector, which does run
here: the composition, the top-level `kv_load_failure_policy` and saving to every child are what
is tested.

TP=2: two worker processes share one `kvpool server`; each TP rank saves its own KV heads and a
lookup counts a block only when both ranks' keys exist.
"""

from __future__ import annotations

import os

import pytest

from harness import Engine, kvpool_config, tokens
from kvpool.testing.launch import PoolServer

pytestmark = pytest.mark.vllm

PROMPT = tokens(900, seed=61)  # 7 whole blocks, under ExampleConnector's ~2K-token limit


def test_kvpool_inside_multiconnector(model_dir, tmp_path, engine_factory):
    ref = engine_factory(model_dir, prefix_caching=True)
    ref_cold, ref_hit = ref.generate([PROMPT, PROMPT])
    ref.close()
    example_dir = tmp_path / "example"
    example_dir.mkdir()
    pool = kvpool_config()
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # on the top level, as the spec says
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": pool["kv_connector_extra_config"]},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        ]},
    }
    e = engine_factory(model_dir, kv_transfer_config=multi)
    cold, hit = e.generate([PROMPT, PROMPT])
    assert cold["logprobs"] == ref_cold["logprobs"]
    # kvpool is the first child: it serves the hit, and the output equals a prefix-cache hit.
    assert hit["num_cached_tokens"] == ref_hit["num_cached_tokens"] == 7 * 128
    assert hit["token_ids"] == ref_hit["token_ids"] and hit["logprobs"] == ref_hit["logprobs"]
    assert "load_blocks=7" in e.log_text()
    assert any(example_dir.iterdir())  # MultiConnector saved to the other child too


def test_tensor_parallel_two_ranks_share_a_server(model_dir, tmp_path, engine_factory):
    sock = str(tmp_path / "pool.sock")
    tp_env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with PoolServer(sock, memory_size="512MB", log_path=tmp_path / "pool.log"):
        ref = engine_factory(model_dir, prefix_caching=True, env=tp_env, tensor_parallel_size=2)
        ref_cold, ref_hit = ref.generate([PROMPT, PROMPT])
        ref.close()
        e = engine_factory(model_dir, env=tp_env, tensor_parallel_size=2,
                           kv_transfer_config=kvpool_config(backend="server", server_socket=sock))
        cold, hit = e.generate([PROMPT, PROMPT])
        log = e.log_text()
    assert cold["logprobs"] == ref_cold["logprobs"]
    assert hit["num_cached_tokens"] == 7 * 128
    assert hit["token_ids"] == ref_hit["token_ids"] and hit["logprobs"] == ref_hit["logprobs"]
    # Both ranks wrote their own heads' keys (2 KV heads over TP=2: two shards).
    assert "@tp0/2@" in log and "@tp1/2@" in log
