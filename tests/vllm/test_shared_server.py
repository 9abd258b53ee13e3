"""Several vLLM instances on one host share one `kvpool server`.

What any instance computed, the others load; blocks outlive the instance that wrote them; and
a pool server killed under running instances costs misses, never errors or hangs.
"""

from __future__ import annotations

import time

import pytest

from harness import Engine, tokens
from kvpool.testing.launch import OpenAIServer, PoolServer

pytestmark = pytest.mark.vllm

DOC_A = tokens(1100, seed=51)  # 8 whole blocks
DOC_B = tokens(800, seed=52)  # 6 whole blocks
DOC_C = tokens(600, seed=53)  # 4 whole blocks
BLOCKS = {id(DOC_A): 8, id(DOC_B): 6, id(DOC_C): 4}


def instance(model_dir: str, sock: str, port: str, rpc_dir: str) -> OpenAIServer:
    cfg = {
        "kv_connector": "KVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": port, "backend": "server", "server_socket": sock},
    }
    return OpenAIServer(model_dir, dtype="float32", max_num_batched_tokens=512, kv_transfer_config=cfg,
                        env={"VLLM_RPC_BASE_PATH": rpc_dir}, startup_timeout_s=240)


@pytest.fixture(scope="module")
def reference(model_dir):
    """vLLM alone: the cold output of each document."""
    e = Engine(model_dir)
    try:
        yield {id(d): r["token_ids"] for d, r in zip((DOC_A, DOC_B, DOC_C), e.generate([DOC_A, DOC_B, DOC_C], max_tokens=8))}
    finally:
        e.close()


def test_instances_share_one_pool(model_dir, reference, tmp_path):
    sock, log, rpc = str(tmp_path / "pool.sock"), str(tmp_path / "pool.log"), str(tmp_path)
    pool = PoolServer(sock, extra_args=["--client_ttl", "5"], log_path=log).start()
    try:
        a = instance(model_dir, sock, "11", rpc).start()
        b = instance(model_dir, sock, "12", rpc).start()
        try:
            ra = a.complete(DOC_A, max_tokens=8)
            assert ra.cached_tokens == 0 and ra.token_ids == reference[id(DOC_A)]
            rb = b.complete(DOC_A, max_tokens=8)  # B never saw DOC_A: it comes from A's saves
            assert rb.cached_tokens == 8 * 128 and rb.token_ids == reference[id(DOC_A)]
            a.complete(DOC_B, max_tokens=8)
        finally:
            a.stop()
        # A is gone; its blocks are not.
        rb = b.complete(DOC_B, max_tokens=8)
        assert rb.cached_tokens == 6 * 128 and rb.token_ids == reference[id(DOC_B)]
        c = instance(model_dir, sock, "13", rpc).start()
        try:
            for doc in (DOC_A, DOC_B):
                rc = c.complete(doc, max_tokens=8)
                assert rc.cached_tokens == BLOCKS[id(doc)] * 128 and rc.token_ids == reference[id(doc)]
        finally:
            c.stop()

        # The pool server dies under a running instance: misses, not errors.
        pool.kill()
        r = b.complete(DOC_C, max_tokens=8)
        assert r.cached_tokens == 0 and r.token_ids == reference[id(DOC_C)]
        # A new server on the same socket: the instance reconnects and hits again.
        pool = PoolServer(sock, extra_args=["--client_ttl", "5"], log_path=log).start()
        b.complete(DOC_C, max_tokens=8)
        deadline = time.monotonic() + 30
        while True:
            r = b.complete(DOC_C, max_tokens=8)
            if r.cached_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.cached_tokens == 4 * 128 and r.token_ids == reference[id(DOC_C)]
        b.stop()
    finally:
        pool.stop()
