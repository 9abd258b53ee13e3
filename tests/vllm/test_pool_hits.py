"""Pool hits on real vLLM are real and exact.

A cold request through kvpool must equal vLLM without kvpool, and a pool hit must equal vLLM's
own prefix-cache hit of the same length: same tokens, same top-5 logprobs, bit for bit.
"""

from __future__ import annotations

import pytest

from harness import BLOCK, Engine, kv_events_config, kvpool_config, replay_kv_events, tokens
from kvpool.keys import block_of

pytestmark = pytest.mark.vllm

# 900 tokens: 7 whole blocks and a partial one, longer than max_num_batched_tokens (512), so
# the prompt is prefilled in chunks and saved across steps.
LONG = tokens(900, seed=1)
# Exactly 6 blocks: a full hit must give one token back to vLLM.
ALIGNED = tokens(6 * BLOCK, seed=2)
# Longer than 4 chunks of 512.
VERY_LONG = tokens(2100, seed=3)
PROMPTS = [LONG, ALIGNED, VERY_LONG]


@pytest.fixture(scope="module")
def ref_rounds(reference):
    """vLLM alone with its prefix cache: round 1 is cold, round 2 a prefix-cache hit."""
    return [reference.generate(PROMPTS), reference.generate(PROMPTS)]


# The data paths: direct copies (sync and load_async); the accelerator staging path forced on
# CPU; and layerwise transfer (loads waited for per layer inside the forward pass, saves sent
# per layer), also staged.
MODES = {
    "sync": {},
    "async": {"load_async": True},
    "staged": {"transfer_path": "staged"},
    "staged-layerwise": {"transfer_path": "staged", "use_layerwise": True},
}


@pytest.fixture(scope="module", params=list(MODES))
def pooled(request, model_dir):
    """vLLM with kvpool and no prefix cache: round 2 can only hit through the pool.

    Yields the mode, both rounds' results, kvpool's counters of each round, and the engine, which
    publishes vLLM's KV events (`e.spec["kv_events_config"]`).
    """
    with Engine(model_dir, kv_transfer_config=kvpool_config(**MODES[request.param]),
                kv_events_config=kv_events_config()) as e:
        rounds, counters = [], []
        for _ in range(2):
            since = e.mark()
            rounds.append(e.generate(PROMPTS))
            counters.append(e.counters(since))
        yield request.param, rounds, counters, e


def _same(a: dict, b: dict) -> None:
    assert a["error"] is None and b["error"] is None, (a.get("error"), b.get("error"))
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]  # exact floats: the same KV gives the same numbers


def test_cold_request_equals_vllm_alone(ref_rounds, pooled):
    _, rounds, _, _ = pooled
    for ref, got in zip(ref_rounds[0], rounds[0]):
        _same(ref, got)
        assert got["num_cached_tokens"] == 0


def test_second_round_hits_all_whole_blocks(pooled):
    _, rounds, _, _ = pooled
    hits = [r["num_cached_tokens"] for r in rounds[1]]
    assert hits == [
        (len(LONG) // BLOCK) * BLOCK,  # 896: every whole block
        len(ALIGNED) - 1,  # full hit: all but the last token
        (len(VERY_LONG) // BLOCK) * BLOCK,
    ]


def test_pool_hit_equals_prefix_cache_hit(ref_rounds, pooled):
    _, rounds, _, _ = pooled
    for i in (0, 2):  # the unaligned prompts: vLLM's prefix cache hits the same 896/2048 tokens
        assert ref_rounds[1][i]["num_cached_tokens"] == rounds[1][i]["num_cached_tokens"]
        _same(ref_rounds[1][i], rounds[1][i])


def test_full_hit_output_equals_cold(ref_rounds, pooled):
    _, rounds, _, _ = pooled
    # All 6 blocks come from the pool and only the last token is recomputed. vLLM's prefix
    # cache never hits all 6 (it keeps whole blocks under the last token: 5), so there is no
    # run with the same split to compare logprobs with: token ids only.
    assert rounds[1][1]["token_ids"] == ref_rounds[0][1]["token_ids"]


def test_counters(pooled):
    _, _, (first, second), _ = pooled
    blocks = sum(len(p) // BLOCK for p in PROMPTS)  # 7 + 6 + 16
    # Round 1 saves every whole prompt block (chunked prefill: over several steps), loads nothing.
    assert (first["save_blocks"], first["lookup_hit_blocks"], first["load_blocks"]) == (blocks, 0, 0)
    # Round 2 loads all of them, none fails, and saves nothing again (loaded blocks are pooled).
    assert (second["load_blocks"], second["load_failed_blocks"]) == (blocks, 0)
    assert second["save_blocks"] == second["save_skipped_blocks"] == 0


def test_layerwise_hooks_run_on_real_vllm(pooled):
    """vLLM's CPU attention calls the connector's per-layer hooks: every layer of a loading
    step was waited for inside the forward pass, and saves left from save_kv_layer."""
    mode, _, (first, second), _ = pooled
    if mode != "staged-layerwise":
        assert first.get("layer_saves_sent", 0) == second.get("layer_loads_waited", 0) == 0
        return
    assert first["layer_saves_sent"] > 0
    assert second["layer_loads_waited"] > 0


# A conversation: turn 1 is a prompt under one block and an answer that fills two blocks with it;
# turn 2 sends both back with a question. Only decode-cache saving pools the answer's blocks.
TURN1 = tokens(100, seed=4)
ANSWER_TOKENS = 160
QUESTION = tokens(40, seed=5)


@pytest.fixture(scope="module")
def ref_conversation(reference):
    first = reference.generate([TURN1], max_tokens=ANSWER_TOKENS)[0]
    return first, reference.generate([TURN1 + first["token_ids"] + QUESTION])[0]


def test_a_request_that_asks_for_it_saves_its_answer_and_the_next_turn_hits_it(ref_conversation, pooled):
    mode, _, _, engine = pooled
    ref_first, ref_second = ref_conversation
    first = engine.generate([TURN1], max_tokens=ANSWER_TOKENS, kv_transfer_params={"kvpool": {"save_decode": True}})[0]
    _same(ref_first, first)
    second = engine.generate([TURN1 + first["token_ids"] + QUESTION])[0]
    # vLLM's own prefix cache kept the answer's blocks too: the same split, the same numbers.
    assert second["num_cached_tokens"] == ref_second["num_cached_tokens"] == 2 * BLOCK, mode
    _same(ref_second, second)


def test_kv_events_rebuild_the_pools_contents(pooled):
    """A subscriber of vLLM's KV events (its own classes, its publisher's replay buffer) that
    applies the pool's events (ownership "kvpool") in order holds what the pool holds: no block
    missing, none left over. The pool's drops, which this pool never has, are unit-tested."""
    mode, _, _, engine = pooled
    keys = engine.pool_keys()
    events = replay_kv_events(engine.spec["kv_events_config"])
    view: set = set()
    for event in events:
        if getattr(event, "ownership", None) != "kvpool":
            continue  # vLLM's own prefix cache's events (none here: it is off)
        blocks = {(event.group_idx, h) for h in event.block_hashes}
        if type(event).__name__ == "BlockStored":
            assert event.medium == "CPU" and event.block_size == BLOCK and len(event.token_ids) == BLOCK
            view |= blocks
        else:
            view -= blocks

    def published(h: bytes) -> object:  # as vLLM's events carry a hash: an int, unless told otherwise
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if any(isinstance(b, int) for _, b in view) else h

    pool = {(group, published(h)) for group, h in map(block_of, keys)}
    assert pool and view == pool, (mode, len(view), len(pool))
