"""Load failures never cost a wrong answer or a hung request.

The pool's reads are made to fail (every 3rd block read, counted per engine) with the real
store behind them. With `recompute`, vLLM recomputes from the first failed block on and the
output is exactly what vLLM alone gives for that split; with `fail`, that request ends with an
error and the engine keeps serving. Sync loads and `load_async` both report their failures.
"""

from __future__ import annotations

import pytest

from harness import BLOCK, kvpool_config, tokens

pytestmark = pytest.mark.vllm

PROMPT = tokens(1000, seed=11)  # 7 whole blocks: block reads 3 and 6 of the engine fail
OTHER = tokens(300, seed=12)
# Block reads 1 and 2 succeed, so a recomputing engine keeps PROMPT's first 2 blocks.
KEPT = 2 * BLOCK
# PROMPT's first 3 blocks, then 3 whole blocks and 20 tokens of its own.
EXT = PROMPT[:3 * BLOCK] + tokens(3 * BLOCK + 20, seed=14)


@pytest.fixture(scope="module")
def refs(reference) -> dict:
    """vLLM alone, with the split a recomputing engine ends up with: PROMPT's first 2 blocks
    cached and the rest computed.

    The 2 blocks must be cached from the same computation as in the kvpool engine, whose cold
    run prefilled PROMPT in chunks of 512: so vLLM first prefills a prompt that shares only
    those 2 blocks with PROMPT and has PROMPT's length (same chunks), then PROMPT hits them.
    """
    reference.generate([PROMPT[:KEPT] + tokens(len(PROMPT) - KEPT, seed=13)])
    split, other, ext = reference.generate([PROMPT, OTHER, EXT])
    assert split["num_cached_tokens"] == KEPT and other["num_cached_tokens"] == 0
    return {"split": split, "other": other, "ext": ext}


@pytest.mark.parametrize("load_async", [False, True])
def test_recompute_after_failed_loads_is_exact(model_dir, refs, engine_factory, load_async):
    e = engine_factory(model_dir, kv_transfer_config=kvpool_config(
        policy="recompute", load_async=load_async, inject_load_failure_every=3))
    cold = e.generate([PROMPT])[0]
    since = e.mark()
    again = e.generate([PROMPT])[0]
    counters = e.counters(since)
    assert again["error"] is None, again
    # All 7 blocks were offered; reads 3 and 6 failed, 5 succeeded.
    assert (counters["lookup_hit_blocks"], counters["load_blocks"], counters["load_failed_blocks"]) == (7, 5, 2)
    # vLLM kept the 2 blocks before the first failed one and recomputed the rest. A cold run
    # computed other chunks (0-512, 512-1000 instead of 256-768, 768-1000): token ids only.
    assert again["token_ids"] == cold["token_ids"] == refs["split"]["token_ids"]
    assert again["logprobs"] == refs["split"]["logprobs"]

    # EXT hits PROMPT's 3 pooled blocks; block reads 8-10 lose block 1 (read 9). A sync load's
    # failure is known only after the forward pass that computed EXT's blocks 3-5 over block 1's
    # failed bytes: those 3 are held back. vLLM recomputes from block 1 (chunks 128-640 and
    # 640-788), and then blocks 1-5 are offered: 1 and 2 are pooled already, 3-5 are saved
    # from the recompute. An async load fails before anything is computed, so nothing is held
    # back, but the recompute is offered from block 1 all the same.
    since = e.mark()
    ext = e.generate([EXT])[0]
    c = e.counters(since)
    assert ext["error"] is None and ext["token_ids"] == refs["ext"]["token_ids"]
    assert (c["load_blocks"], c["load_failed_blocks"]) == (2, 1)
    assert (c["save_dropped_blocks"], c["save_blocks"], c["save_skipped_blocks"]) == (0 if load_async else 3, 3, 2)


def test_fail_policy_fails_only_that_request(model_dir, refs, engine_factory):
    # Through `kv_connector_module_path`, the spec's other way to name the connector.
    cfg = kvpool_config(policy="fail", inject_load_failure_every=3)
    cfg["kv_connector_module_path"] = "kvpool.vllm"
    e = engine_factory(model_dir, kv_transfer_config=cfg)
    cold = e.generate([PROMPT])[0]  # nothing to load yet
    assert cold["error"] is None and cold["token_ids"] == refs["split"]["token_ids"]
    since = e.mark()
    failed = e.generate([PROMPT])[0]
    assert failed["error"] is not None or failed["finish_reason"] == "error", failed
    assert e.counters(since)["load_failed_blocks"] == 2
    after = e.generate([OTHER])[0]  # cold, as in vLLM alone: same split, so same logprobs
    assert after["error"] is None and after["num_cached_tokens"] == 0
    assert after["token_ids"] == refs["other"]["token_ids"] and after["logprobs"] == refs["other"]["logprobs"]
