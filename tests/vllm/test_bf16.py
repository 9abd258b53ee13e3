"""A bf16 model: pool hits are as exact as with fp32 (bytes are copied, never converted)."""

from __future__ import annotations

import pytest

from harness import Engine, kvpool_config, tokens

pytestmark = pytest.mark.vllm

PROMPT = tokens(900, seed=41)


def test_bf16_pool_hit_equals_prefix_cache_hit(bf16_model_dir, engine_factory):
    ref = engine_factory(bf16_model_dir, prefix_caching=True, dtype="bfloat16")
    ref_cold, ref_hit = ref.generate([PROMPT, PROMPT])
    ref.close()
    pooled = engine_factory(bf16_model_dir, kv_transfer_config=kvpool_config(), dtype="bfloat16")
    cold, hit = pooled.generate([PROMPT, PROMPT])
    assert cold["logprobs"] == ref_cold["logprobs"]
    assert hit["num_cached_tokens"] == ref_hit["num_cached_tokens"] == 896
    assert hit["token_ids"] == ref_hit["token_ids"] and hit["logprobs"] == ref_hit["logprobs"]
