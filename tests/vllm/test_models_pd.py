"""A hybrid-attention model through the PD proxy (`make test-models`, not `make test`).

Two vLLM OpenAI servers on GPT-OSS (sliding and full-attention groups) share one `kvpool
server`; `kvpool proxy` sends a request to one as prefill and to the other as decode. The decode
instance finds the prompt's whole blocks of every group in the pool, and its answer equals the
prefill instance's own prefix-cache hit on the same prompt, tokens and top-5 logprobs bit for bit.
"""

from __future__ import annotations

import httpx
import pytest

from harness import BLOCK, tokens, whole
from kvpool.testing.launch import IN_PROCESS_WORKER_ENV, OpenAIServer, PoolServer, ProxyServer

pytestmark = [pytest.mark.vllm, pytest.mark.models]


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    from kvpool.testing.model import SPECS, build_model

    tmp = tmp_path_factory.mktemp("pd-hybrid")
    model = str(build_model(tmp / "gpt-oss", SPECS["gpt-oss"]))
    sock = str(tmp / "pool.sock")
    pool = PoolServer(sock, memory_size="512MB", log_path=tmp / "pool.log")
    servers = [
        OpenAIServer(model, served_model_name="model", block_size=BLOCK, prefix_caching=True, dtype="float32",
                     max_num_batched_tokens=512, log_path=tmp / f"instance{i}.log", startup_timeout_s=600,
                     env={"VLLM_RPC_BASE_PATH": str(tmp), **IN_PROCESS_WORKER_ENV},
                     kv_transfer_config={
                         "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                         "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {"backend": "server", "server_socket": sock,
                                                       "lookup_rpc_port": 9320 + i}})
        for i in range(2)]
    started = []
    try:
        pool.start()
        started.append(pool)
        for s in servers:  # start-ups overlap
            s.start(wait=False)
            started.append(s)
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for p in reversed(started):
            p.stop()


def test_a_hybrid_model_through_the_pd_proxy_equals_its_own_prefix_cache_hit(pd_pair, tmp_path):
    prefill, decode = pd_pair
    prompt = tokens(700, seed=9401)  # 5 whole blocks, then 60 tokens every run computes
    body = {"model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 5}
    with ProxyServer([prefill.port], [decode.port], log_path=tmp_path / "pd-proxy.log",
                     extra_args=["--log-level", "warning"]) as pd:
        through = httpx.post(f"{pd.base_url}/v1/completions", json=body, timeout=300, trust_env=False).json()
    alone = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=300, trust_env=False).json()
    assert through["usage"]["prompt_tokens_details"]["decode_cached_tokens"] == whole(prompt), through["usage"]
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == whole(prompt), alone["usage"]
    assert through["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
    assert through["choices"][0]["text"] == alone["choices"][0]["text"]
