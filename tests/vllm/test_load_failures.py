"""Load failures never cost a wrong answer or a hung request.

The pool's reads are made to fail (every 3rd block read) with the real store behind them.
With `recompute`, vLLM recomputes exactly the lost blocks and the output equals vLLM alone;
with `fail`, that request ends with an error and the engine keeps serving.
"""

from __future__ import annotations

import pytest

from harness import Engine, kvpool_config, tokens

pytestmark = pytest.mark.vllm

PROMPT = tokens(1000, seed=11)  # 7 whole blocks: block reads 3 and 6 fail
OTHER = tokens(300, seed=12)


@pytest.fixture(scope="module")
def reference(model_dir):
    e = Engine(model_dir)
    try:
        yield e.generate([PROMPT, OTHER])
    finally:
        e.close()


@pytest.mark.parametrize("load_async", [False, True])
def test_recompute_after_failed_loads_is_exact(model_dir, reference, engine_factory, load_async):
    e = engine_factory(model_dir, kv_transfer_config=kvpool_config(
        policy="recompute", load_async=load_async, inject_load_failure_every=3))
    cold = e.generate([PROMPT])[0]
    again = e.generate([PROMPT])[0]
    assert cold["token_ids"] == again["token_ids"] == reference[0]["token_ids"]
    assert again["logprobs"] == reference[0]["logprobs"]
    # Reads 3 and 6 of the 7 failed; vLLM recomputed from the first failed block on and
    # still produced exactly the reference output.
    assert "2 of 7 blocks of request" in e.log_text()


def test_fail_policy_fails_only_that_request(model_dir, reference, engine_factory):
    e = engine_factory(model_dir, kv_transfer_config=kvpool_config(policy="fail", inject_load_failure_every=3))
    assert e.generate([PROMPT])[0]["error"] is None  # cold: nothing to load yet
    failed = e.generate([PROMPT])[0]
    assert failed["error"] is not None or failed["finish_reason"] == "error", failed
    after = e.generate([OTHER])[0]
    assert after["error"] is None and after["token_ids"] == reference[1]["token_ids"]
