"""Hybrid-attention models through the pool on real vLLM: answers unchanged, hits exact, windows only.

A model with sliding-window and full-attention layers has several KV cache groups. kvpool
supports vLLM's hybrid KV cache manager, so configuring it changes nothing about how vLLM runs
the model (without that support vLLM turns its hybrid manager off and runs sliding layers as
full attention: other numbers). A pool hit must equal vLLM's own prefix-cache hit on the same
model, through `local` and through `kvpool server`, and move of each sliding group only the
blocks of its window.

`make test` runs one sliding multi-group family (GPT-OSS: alternating sliding/full layers,
attention sinks, MoE) through `local`; `make test-models` (KVPOOL_TEST_FAMILIES=all) adds
Gemma 3 (5 sliding layers : 1 full, six groups), Mistral (a window on every layer: one group)
and `kvpool server` for each.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from harness import BLOCK, Engine, pooled_config, tokens

pytestmark = pytest.mark.vllm

FULL = os.environ.get("KVPOOL_TEST_FAMILIES") == "all"  # `make test-models`
# `make test-compat` names the families where a vLLM release cannot run the default one.
FAMILIES = (os.environ["KVPOOL_HYBRID_FAMILIES"].split(",") if os.environ.get("KVPOOL_HYBRID_FAMILIES")
            else ["gpt-oss"] + (["gemma3", "mistral"] if FULL else []))

# 900 tokens: 7 whole blocks and a partial one, prefilled in two chunks (512 + 388).
LONG = tokens(900, seed=401)
# Exactly 6 blocks: the hit ends a whole block early, as vLLM's own prefix cache does.
ALIGNED = tokens(6 * BLOCK, seed=402)
# 17 whole blocks over five chunks: sliding blocks leave the window (and vLLM's cache) mid-prefill.
VERY_LONG = tokens(2200, seed=403)
PROMPTS = [LONG, ALIGNED, VERY_LONG]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from kvpool.testing.model import SPECS, build_model

    spec = SPECS[request.param]
    model = str(build_model(tmp_path_factory.mktemp(request.param) / request.param, spec))
    return request.param, model, spec


@pytest.fixture(scope="module")
def reference(family):
    """vLLM alone with its prefix cache (hybrid manager on): round 1 cold, round 2 a hit."""
    _, model, _ = family
    with Engine(model, prefix_caching=True) as e:
        yield [e.generate(PROMPTS), e.generate(PROMPTS)]


@pytest.fixture(scope="module", params=["local"] + (["server"] if FULL else []))
def pooled(request, family, reference, tmp_path_factory):
    """vLLM with kvpool (`local`, or a `kvpool server`) and no prefix cache of its own: round 2
    hits only through the pool."""
    _, model, _ = family
    with contextlib.ExitStack() as stack:
        config = pooled_config(stack, tmp_path_factory.mktemp("pool"), request.param)
        e = stack.enter_context(Engine(model, kv_transfer_config=config))
        rounds, counters = [], []
        for _ in range(2):
            since = e.mark()
            rounds.append(e.generate(PROMPTS))
            counters.append(e.counters(since))
        yield rounds, counters, e.log_text(), request.param


def _single_group(spec) -> bool:
    return sum(spec.kv_cache_groups) == 1


def _hit_blocks(spec) -> list[int]:
    """Whole blocks a pool hit loads per prompt. A prompt that hits whole gives one token back on a
    single-group model, its last block on a model with several groups (as vLLM's own cache)."""
    aligned = len(ALIGNED) // BLOCK - (0 if _single_group(spec) else 1)
    return [len(LONG) // BLOCK, aligned, len(VERY_LONG) // BLOCK]


def _same(a: dict, b: dict) -> None:
    assert a["error"] is None and b["error"] is None, (a.get("error"), b.get("error"))
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]


def test_vllm_keeps_its_hybrid_kv_cache_manager(pooled):
    _, _, log, _ = pooled
    assert "Turning off hybrid kv cache manager" not in log


def test_cold_request_with_kvpool_equals_vllm_alone(reference, pooled):
    rounds, _, _, _ = pooled
    for ref, got in zip(reference[0], rounds[0]):
        _same(ref, got)
        assert got["num_cached_tokens"] == 0


def test_pool_hit_equals_vllms_own_prefix_cache_hit(family, reference, pooled):
    _, _, spec = family
    rounds, _, _, _ = pooled
    expected = [len(LONG) // BLOCK * BLOCK, len(ALIGNED) - BLOCK, len(VERY_LONG) // BLOCK * BLOCK]
    assert [r["num_cached_tokens"] for r in reference[1]] == expected
    for i, (ref, got) in enumerate(zip(reference[1], rounds[1])):
        if _single_group(spec) and i == 1:
            # The pool serves all but the last token of a whole-block prompt; vLLM's cache keeps
            # whole blocks under it: no run of the same split, so token ids only.
            assert got["num_cached_tokens"] == len(ALIGNED) - 1
            assert got["token_ids"] == reference[0][i]["token_ids"]
            continue
        assert got["num_cached_tokens"] == ref["num_cached_tokens"]
        _same(ref, got)


def test_a_hit_moves_the_full_layers_and_one_window_per_sliding_group(family, pooled):
    _, _, spec = family
    _, (first, second), _, backend = pooled
    whole_blocks = [len(p) // BLOCK for p in PROMPTS]
    hit_blocks = _hit_blocks(spec)
    window = [min(n, -(-(spec.sliding_window - 1) // BLOCK)) for n in hit_blocks]
    full_groups, sliding_groups = spec.kv_cache_groups
    # Round 1 saved every whole block of every group (a sliding one before it left the window).
    assert first["save_blocks"] == sum(whole_blocks) * (full_groups + sliding_groups)
    assert first.get("save_failed_blocks", 0) == first.get("load_blocks", 0) == 0
    # Round 2 loaded every hit block of the full groups and one window of each sliding group,
    # and saved nothing again.
    assert second["load_blocks"] == sum(hit_blocks) * full_groups + sum(window) * sliding_groups
    assert second.get("load_failed_blocks", 0) == second.get("save_blocks", 0) == 0
    if not _single_group(spec):
        # `local` pins a hit in the worker's memory at the lookup: each loads in the step that
        # computes. A `kvpool server`'s hit could fail, so vLLM is told by request, a step later.
        assert second.get("pinned_loads", 0) == (len(PROMPTS) if backend == "local" else 0)
    # In bytes: one layer's block costs the same in every group, and round 1 saved every layer.
    layer_block = first["save_bytes"] / (sum(whole_blocks) * spec.num_hidden_layers)
    assert second["load_bytes"] == layer_block * (sum(hit_blocks) * spec.full_layers + sum(window) * spec.sliding_layers)
