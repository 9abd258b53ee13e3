"""A hybrid-attention model through the PD proxy (`make test-models`, not `make test`).

Two vLLM OpenAI servers on GPT-OSS (sliding and full-attention groups) share one `kvpool
server`; `kvpool proxy` sends a request to one as prefill and to the other as decode. The decode
instance finds the prompt's whole blocks of every group in the pool, and its answer equals the
prefill instance's own prefix-cache hit on the same prompt, tokens and top-5 logprobs bit for bit.
"""

from __future__ import annotations

import httpx
import pytest

from harness import instances_on_one_pool, record_matrix_model, tokens, whole
from kvpool.testing.launch import ProxyServer

pytestmark = [pytest.mark.vllm, pytest.mark.models]


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    from kvpool.testing.model import SPECS, build_model

    tmp = tmp_path_factory.mktemp("pd-hybrid")
    model = str(build_model(tmp / "gpt-oss", SPECS["gpt-oss"]))
    with instances_on_one_pool(model, tmp, 2, 9320) as (_, servers):
        record_matrix_model(model, label="kvpool server, PD proxy (2 OpenAI servers)")
        yield servers


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
