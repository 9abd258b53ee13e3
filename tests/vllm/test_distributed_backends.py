"""Two vLLM instances share a real distributed store: Mooncake Store and openYuanrong datasystem.

The second instance hits what the first computed, with outputs equal to vLLM alone; when the
store goes away mid-run, requests still succeed (misses and recompute), never error or hang.
"""

from __future__ import annotations

import json

import pytest

from harness import Engine, tokens
from kvpool.testing.launch import OpenAIServer
from kvpool.testing.services import MooncakeMaster, YuanrongWorker

pytestmark = pytest.mark.vllm

DOC = tokens(1100, seed=71)  # 8 whole blocks
LATE = tokens(700, seed=72)  # asked after the store is gone


@pytest.fixture(scope="module")
def reference(model_dir):
    e = Engine(model_dir)
    try:
        doc, late = e.generate([DOC, LATE], max_tokens=8)
        yield {"doc": doc["token_ids"], "late": late["token_ids"]}
    finally:
        e.close()


def _store(kind: str, workdir):
    """Start the store; return it with the env and extra config that point vLLM at it."""
    if kind == "mooncake":
        master = MooncakeMaster(workdir)
        path = master.write_config(workdir / "mooncake.json", global_segment_size="256MB", local_buffer_size="64MB")
        return master, {"MOONCAKE_CONFIG_PATH": path}
    worker = YuanrongWorker(workdir, shared_memory_mb=512)
    return worker, {"DS_WORKER_ADDR": worker.address, "DATASYSTEM_CLIENT_LOG_DIR": str(workdir / "client-logs")}


@pytest.mark.parametrize("kind", ["mooncake", "yuanrong"])
def test_two_instances_share_the_store(kind, model_dir, reference, tmp_path):
    store, env = _store(kind, tmp_path)
    servers: list[OpenAIServer] = []
    try:
        for port in ("21", "22"):
            cfg = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"lookup_rpc_port": port, "backend": kind}}
            servers.append(OpenAIServer(model_dir, dtype="float32", max_num_batched_tokens=512,
                                        kv_transfer_config=cfg, env={**env, "VLLM_RPC_BASE_PATH": str(tmp_path)},
                                        log_path=tmp_path / f"vllm-{port}.log", startup_timeout_s=240).start())
        a, b = servers
        first = a.complete(DOC, max_tokens=8)
        assert first.cached_tokens == 0 and first.token_ids == reference["doc"]
        second = b.complete(DOC, max_tokens=8)  # B never saw DOC
        assert second.cached_tokens == 8 * 128, json.dumps(second.__dict__)[:500]
        assert second.token_ids == reference["doc"]

        store.kill()  # the store dies under both instances
        late = b.complete(LATE, max_tokens=8)
        assert late.cached_tokens == 0 and late.token_ids == reference["late"]
        again = a.complete(DOC, max_tokens=8)  # its blocks are gone with the store: recomputed
        assert again.token_ids == reference["doc"]
    finally:
        for s in servers:
            s.stop()
        store.stop()
