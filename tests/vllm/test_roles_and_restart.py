"""Roles decide who saves and who loads; the SSD tier outlives the instance.

Instances run one after the other on the same `ssd_offload_path`: a `kv_producer` (it loads
pooled prefixes, as the spec's producer does), one with `producer_is_to_load: false` (it only
saves), then a `kv_consumer` with `consumer_is_to_load` and `consumer_is_to_put`. The consumer is a restarted
instance: what it loads of the producer's work can only come from the SSD tier. File counts on
the SSD show who wrote. Every role/flag combination's load and save decisions are unit tests
(tests/unit/vllm/test_scheduler.py::test_roles_and_their_flags); `kv_consumer` with only
`consumer_is_to_load` and `kv_producer` also run as the decode and prefill nodes of
test_pd_examples.py.
"""

from __future__ import annotations

import os

import pytest

from harness import BLOCK, Engine, kvpool_config, tokens, whole

pytestmark = pytest.mark.vllm

P = tokens(700, seed=21)  # 5 whole blocks
R = tokens(400, seed=22)  # 3 whole blocks


def _files(root: str) -> int:
    return sum(len([f for f in fs if not f.startswith(".")]) for _, _, fs in os.walk(root))


@pytest.fixture(scope="module")
def ssd(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ssd").resolve())


@pytest.fixture(scope="module")
def ref(reference) -> dict:
    """vLLM alone: cold, then a prefix-cache hit of each prompt."""
    p_cold, p_hit, r_cold, r_hit = reference.generate([P, P, R, R])
    return {"P": (p_cold, p_hit), "R": (r_cold, r_hit)}


def test_producer_saves_and_loads_pooled_prefixes(model_dir, ssd, ref):
    with Engine(model_dir, kv_transfer_config=kvpool_config(role="kv_producer", ssd_offload_path=ssd)) as e:
        first, second = e.generate([P, P])
        counters = e.counters()
    assert first["num_cached_tokens"] == 0
    assert first["token_ids"] == ref["P"][0]["token_ids"] and first["logprobs"] == ref["P"][0]["logprobs"]
    # vLLM's prefix cache is off: the second request's prefix came from the pool, and equals
    # vLLM's own prefix-cache hit.
    assert second["num_cached_tokens"] == whole(P)
    assert counters.get("load_blocks", 0) == len(P) // BLOCK
    assert second["token_ids"] == ref["P"][1]["token_ids"] and second["logprobs"] == ref["P"][1]["logprobs"]
    assert _files(ssd) == len(P) // BLOCK


def test_producer_opted_out_saves_but_does_not_load(model_dir, ssd, ref):
    cfg = kvpool_config(role="kv_producer", ssd_offload_path=ssd, producer_is_to_load=False)
    with Engine(model_dir, kv_transfer_config=cfg) as e:
        first, second = e.generate([P, P])  # P is pooled (the test above): not looked up
        counters = e.counters()
    assert first["num_cached_tokens"] == second["num_cached_tokens"] == 0
    assert counters.get("load_blocks", 0) == counters.get("lookups", 0) == 0
    assert second["token_ids"] == ref["P"][0]["token_ids"] and second["logprobs"] == ref["P"][0]["logprobs"]
    assert _files(ssd) == len(P) // BLOCK


def test_restarted_consumer_loads_from_ssd_and_puts(model_dir, ssd, ref):
    before = _files(ssd)
    assert before == len(P) // BLOCK, "the producer tests run first and fill the SSD"
    cfg = kvpool_config(role="kv_consumer", ssd_offload_path=ssd, consumer_is_to_load=True, consumer_is_to_put=True)
    with Engine(model_dir, kv_transfer_config=cfg) as e:
        p, r = e.generate([P, R])
        # The producer's blocks, from the SSD tier of a process that is gone: a prefix-cache hit.
        assert p["num_cached_tokens"] == whole(P)
        assert p["token_ids"] == ref["P"][1]["token_ids"] and p["logprobs"] == ref["P"][1]["logprobs"]
        # R was new: computed (as vLLM alone) and put.
        assert r["num_cached_tokens"] == 0
        assert r["token_ids"] == ref["R"][0]["token_ids"] and r["logprobs"] == ref["R"][0]["logprobs"]
        r_again = e.generate([R])[0]
    assert r_again["num_cached_tokens"] == whole(R)
    assert r_again["token_ids"] == ref["R"][1]["token_ids"] and r_again["logprobs"] == ref["R"][1]["logprobs"]
    assert _files(ssd) == before + len(R) // BLOCK
