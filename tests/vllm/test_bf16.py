"""A bf16 model: pool hits are as exact as with fp32 (bytes are copied, never converted).

One engine is both the pooled instance and its reference: it runs kvpool with vLLM's own
prefix cache on. A repeated prompt is a prefix-cache hit (the connector has nothing to add);
after vLLM's prefix cache is emptied, the same prompt can only hit through the pool, and must
give the same tokens and logprobs, bit for bit.
"""

from __future__ import annotations

import pytest

from harness import Engine, kvpool_config, tokens, whole

# In `make test-models` with the other dtypes (fp8 KV caches): `make test` meets bf16 KV in its
# Qwen3-Next runs (tests/vllm/test_state_models.py).
pytestmark = [pytest.mark.vllm, pytest.mark.models]

PROMPT = tokens(400, seed=41)  # 3 whole blocks (bf16 is slow to compute on most CPUs)


def test_bf16_pool_hit_equals_prefix_cache_hit(bf16_model_dir):
    with Engine(bf16_model_dir, prefix_caching=True, dtype="bfloat16", kv_transfer_config=kvpool_config()) as e:
        cold, prefix_hit = e.generate([PROMPT, PROMPT])
        e.reset_prefix_cache()
        since = e.mark()
        pool_hit = e.generate([PROMPT])[0]
        loaded = e.counters(since)["load_blocks"]
    assert cold["num_cached_tokens"] == 0
    assert prefix_hit["num_cached_tokens"] == pool_hit["num_cached_tokens"] == whole(PROMPT)
    assert loaded == whole(PROMPT) // 128  # the hit came from the pool
    assert pool_hit["token_ids"] == prefix_hit["token_ids"] and pool_hit["logprobs"] == prefix_hit["logprobs"]
