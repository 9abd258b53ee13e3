"""kvpool inside vLLM's MultiConnector, and under tensor parallelism.

MultiConnector: the spec pairs kvpool with a P2P transfer connector (MooncakeConnectorV1). No
P2P transfer connector runs on this CPU machine (vLLM's NIXL and Mooncake P2P connectors need
their RDMA/GPU transports), so the second child is vLLM's own ExampleConnector, which does run
here: the composition, the top-level `kv_load_failure_policy` and saving to every child are what
is tested.

TP=2: two worker processes share one `kvpool server`; each TP rank saves and loads its own KV
heads, and a lookup counts a block only when both ranks' keys exist. The TP engine is its own
reference (vLLM's prefix cache on, emptied before the pool hit), as TP=2 computes other sums
than TP=1.
"""

from __future__ import annotations

import pytest

from harness import Engine, kvpool_config, tokens, whole
from kvpool.testing.launch import PoolServer

pytestmark = pytest.mark.vllm

PROMPT = tokens(900, seed=61)  # 7 whole blocks, under ExampleConnector's ~2K-token limit
TP_PROMPT = tokens(900, seed=62)


def test_kvpool_inside_multiconnector(model_dir, reference, tmp_path, engine_factory):
    ref_cold, ref_hit = reference.generate([PROMPT, PROMPT])
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
    cold = e.generate([PROMPT])[0]
    assert any(example_dir.iterdir())  # MultiConnector saved to the other child too
    since = e.mark()
    hit = e.generate([PROMPT])[0]
    assert cold["token_ids"] == ref_cold["token_ids"] and cold["logprobs"] == ref_cold["logprobs"]
    # kvpool is the first child: it serves the hit, and the output equals a prefix-cache hit.
    assert e.counters(since)["load_blocks"] == 7
    assert hit["num_cached_tokens"] == ref_hit["num_cached_tokens"] == 7 * 128
    assert hit["token_ids"] == ref_hit["token_ids"] and hit["logprobs"] == ref_hit["logprobs"]


@pytest.mark.models  # two TP ranks on two cores: `make test-models`, with the other TP=2 tests
def test_tensor_parallel_two_ranks_share_a_server(model_dir, tmp_path):
    sock = str(tmp_path / "pool.sock")
    with PoolServer(sock, memory_size="512MB", log_path=tmp_path / "pool.log"), \
            Engine(model_dir, prefix_caching=True, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2,
                   kv_transfer_config=kvpool_config(backend="server", server_socket=sock)) as e:
        cold, prefix_hit = e.generate([TP_PROMPT, TP_PROMPT])
        e.reset_prefix_cache()
        since = e.mark()
        pool_hit = e.generate([TP_PROMPT])[0]
        ranks = {r: e.counters(since, rank=r) for r in ("tp0 pp0", "tp1 pp0")}
        saved = {r: e.counters(0, rank=r)["save_blocks"] for r in ranks}
    assert cold["num_cached_tokens"] == 0
    assert prefix_hit["num_cached_tokens"] == pool_hit["num_cached_tokens"] == whole(TP_PROMPT)
    # Both ranks wrote their own heads' keys (2 KV heads over TP=2: two shards) and each loaded
    # its own 7 blocks.
    assert saved == {"tp0 pp0": 7, "tp1 pp0": 7}
    assert {r: c["load_blocks"] for r, c in ranks.items()} == {"tp0 pp0": 7, "tp1 pp0": 7}
    assert pool_hit["token_ids"] == prefix_hit["token_ids"] and pool_hit["logprobs"] == prefix_hit["logprobs"]
