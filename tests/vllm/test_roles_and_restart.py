"""Roles decide who saves and who loads; the SSD tier outlives the instance.

Instances run one after another on the same `ssd_offload_path`, so what one saved is what the
next finds: a restarted instance hits, and file counts show who wrote.
"""

from __future__ import annotations

import os

import pytest

from harness import BLOCK, Engine, kvpool_config, tokens

pytestmark = pytest.mark.vllm

P = tokens(700, seed=21)  # 5 whole blocks
R = tokens(400, seed=22)  # 3 whole blocks
WHOLE_P, WHOLE_R = (len(P) // BLOCK) * BLOCK, (len(R) // BLOCK) * BLOCK


def _files(root: str) -> int:
    return sum(len([f for f in fs if not f.startswith(".")]) for _, _, fs in os.walk(root))


def _run(model_dir: str, ssd: str, role: str, prompts: list[list[int]], **flags) -> list[dict]:
    e = Engine(model_dir, kv_transfer_config=kvpool_config(role=role, ssd_offload_path=ssd, **flags))
    try:
        return e.generate(prompts)
    finally:
        e.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    e = Engine(model_dir, prefix_caching=True)
    try:
        yield {"P": e.generate([P, P])[1], "R": e.generate([R, R])[1]}
    finally:
        e.close()


@pytest.fixture(scope="module")
def ssd(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ssd").resolve())


def test_producer_saves_but_does_not_load(model_dir, ssd):
    first, second = _run(model_dir, ssd, "kv_producer", [P, P])
    assert first["num_cached_tokens"] == second["num_cached_tokens"] == 0
    assert _files(ssd) == len(P) // BLOCK


def test_consumer_neither_loads_nor_saves(model_dir, ssd):
    before = _files(ssd)
    p, r = _run(model_dir, ssd, "kv_consumer", [P, R])
    assert p["num_cached_tokens"] == 0 and r["num_cached_tokens"] == 0
    assert _files(ssd) == before


def test_consumer_flags_load_and_put(model_dir, ssd, reference):
    before = _files(ssd)
    p, r = _run(model_dir, ssd, "kv_consumer", [P, R], consumer_is_to_load=True, consumer_is_to_put=True)
    assert p["num_cached_tokens"] == WHOLE_P  # the producer's blocks, from the SSD tier
    assert p["token_ids"] == reference["P"]["token_ids"] and p["logprobs"] == reference["P"]["logprobs"]
    assert _files(ssd) == before + len(R) // BLOCK


def test_restart_on_same_ssd_path_hits(model_dir, ssd, reference):
    p, r = _run(model_dir, ssd, "kv_both", [P, R])
    assert (p["num_cached_tokens"], r["num_cached_tokens"]) == (WHOLE_P, WHOLE_R)
    assert p["logprobs"] == reference["P"]["logprobs"]
    assert r["logprobs"] == reference["R"]["logprobs"]
