"""An MLA model (tiny DeepSeek-V2) through the pool on real vLLM: one latent cache, exact hits.

MLA caches one latent per token and layer (kv_lora_rank 512 + rope 64), the same on every TP
rank: kvpool keys it `tp0/1` at any TP size, the first rank writes it and every rank loads it.

No vLLM-alone run computes a hit's split here: vLLM-CPU turns its prefix cache and chunked
prefill off for MLA models ("MLA is enabled on a non-GPU platform; forcing chunked prefill and
prefix caching to be disabled", `CpuPlatform.check_and_update_config`, vLLM 0.32). The
reference for a pool hit is vLLM's own ExampleConnector: it saves the latent rows of a request
from vLLM's KV cache and loads them for a repeat at kvpool's split (whole 16-token blocks, one
token short of the prompt, for prompt lengths that are not 0 or 1 modulo 16) with vLLM's code
alone. A pool hit must equal its hit bit for bit, at the same TP size on the same writer's
latent. Both connectors run in one engine, in vLLM's MultiConnector with ExampleConnector
first: a repeat hits ExampleConnector; with its folder for the prompt deleted, the next repeat
hits the pool, and ExampleConnector saves the rows again, now as the pool's load left them in
vLLM's KV cache.

A hit's answer is not the cold answer on this vLLM: vLLM-CPU's rotary-embedding kernel treats
the MLA layer's [tokens, heads, 64] query and its strided [tokens, 1, 64] key as [tokens, 64],
so which rows it rotates, and by which position, depends on how many tokens a step computes,
where the step starts and how many heads a TP rank holds. A 16 + 6 split computes other logits
than one 22-token step, whoever supplies the 16 (the pool or ExampleConnector), and TP=2 other
logits than TP=1 (docs/models.md). So a cold run is compared with vLLM alone's cold run, and a
hit with ExampleConnector's hit.

TP=2 (two worker processes, the same `kvpool server`): rank 0 alone saves, both ranks load,
TP=1 and TP=2 hit each other's blocks. Their latents agree in layer 0 (computed from the
embeddings by a projection every rank holds whole) and not after it.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from harness import (
    Engine,
    kvpool_config,
    pool_key_prefixes,
    read_pool_values,
    remove_pool_values,
    tokens,
    vllm_block_hashes,
)
from kvpool.errors import ErrorCode
from kvpool.testing.launch import PoolServer

pytestmark = pytest.mark.vllm

BLOCK = 16  # vLLM-CPU's MLA kernels take 16-token blocks only (it overrides any other size)
LAYERS, LATENT = 4, 512 + 64
LAYER_BLOCK_BYTES = BLOCK * LATENT * 4  # fp32
MAX_TOKENS = 6
# 22 tokens: a hit loads 16 and computes 6 (the prompt whose repeat changed its text); 100
# tokens: loads 96, computes 4. Seven whole blocks per prompt set.
S = [tokens(22, seed=901), tokens(100, seed=902)]  # TP=1: cold, ExampleConnector hit, pool hit
A = [tokens(22, seed=903), tokens(100, seed=904)]  # computed at TP=1, hit at TP=2, then computed there
C = [tokens(22, seed=905), tokens(100, seed=906)]  # computed at TP=2, hit at TP=1
HITS = [16, 96]
WHOLE = sum(len(p) // BLOCK for p in S)
TP2 = {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "tensor_parallel_size": 2}
RANKS = ("tp0 pp0", "tp1 pp0")
LEASE_MS = 2000  # a lookup's leases keep its blocks from `Rounds.forget` until they end


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvpool.testing.model import SPECS, build_model

    return str(build_model(tmp_path_factory.mktemp("deepseek-v2") / "deepseek-v2", SPECS["deepseek-v2"]))


@pytest.fixture(scope="module")
def alone(model):
    """vLLM alone: S cold."""
    with Engine(model, block_size=BLOCK) as e:
        return e.generate(S, MAX_TOKENS)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One `kvpool server`, shared by the TP=1 and TP=2 engines."""
    tmp = tmp_path_factory.mktemp("pool")
    sock = str(tmp / "pool.sock")
    with PoolServer(sock, memory_size="256MB", extra_args=["--default_kv_lease_ttl", str(LEASE_MS)],
                    log_path=tmp / "pool.log"):
        yield sock


class Pair:
    """An engine with ExampleConnector (a folder of its own) first and kvpool (`pool`) second in
    vLLM's MultiConnector, and what a test reads of it."""

    def __init__(self, model: str, pool: str, example: Path, **engine_args) -> None:
        self.sock, self.example = pool, example
        example.mkdir()
        kvpool = kvpool_config(backend="server", server_socket=pool)
        config = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"connectors": [
                      {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(example)}},
                      {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": kvpool["kv_connector_extra_config"]},
                  ]}}
        self.e = Engine(model, block_size=BLOCK, kv_transfer_config=config, **engine_args)

    def run(self, prompts: list[list[int]]) -> tuple[list[dict], dict[str, dict[str, float]]]:
        """The prompts' answers, and kvpool's counters of each rank over them."""
        since = self.e.mark()
        out = self.e.generate(prompts, MAX_TOKENS)
        return out, {r: self.e.counters(since, rank=r) for r in RANKS}

    def keys(self, prompts: list[list[int]]) -> list[str]:
        (prefix, size), = set(pool_key_prefixes(self.e))
        assert size == LAYERS * LAYER_BLOCK_BYTES
        return [f"{prefix}@{h.hex()}" for p in prompts for h in vllm_block_hashes(p, BLOCK)]

    def pooled(self, prompts: list[list[int]]) -> list[bytes]:
        """What the pool holds for the prompts' whole blocks (what a pool hit loads), in order."""
        values = read_pool_values(self.sock, self.keys(prompts), LAYERS * LAYER_BLOCK_BYTES)
        assert all(v is not None for v in values)
        return values

    def rows(self, prompts: list[list[int]]) -> list[bytes]:
        """ExampleConnector's latent rows of the prompts' whole blocks (what it took from vLLM's
        KV cache), cut and laid out as the pool's values: per block, layer after layer."""
        from safetensors.numpy import load_file

        out = []
        for p in prompts:
            n = len(p) // BLOCK * BLOCK
            files = sorted(self._folder(p).glob("*.safetensors"),
                           key=lambda f: int(re.search(r"layers\.(\d+)\.", f.name).group(1)))
            assert len(files) == LAYERS
            layers = [load_file(str(f))["kv_cache"] for f in files]
            assert all(x.shape == (n, LATENT) and x.dtype == np.float32 for x in layers)
            out += [b"".join(x[b * BLOCK:(b + 1) * BLOCK].tobytes() for x in layers) for b in range(n // BLOCK)]
        return out

    def forget_rows(self, prompts: list[list[int]]) -> None:
        """Delete ExampleConnector's rows of the prompts: their next repeat hits the pool."""
        for p in prompts:
            shutil.rmtree(self._folder(p))

    def forget_blocks(self, prompts: list[list[int]]) -> None:
        """Remove the prompts' blocks from the pool, once the last lookup's leases on them ended."""
        keys, deadline = self.keys(prompts), time.monotonic() + 5 * LEASE_MS / 1000
        leased = int(ErrorCode.OBJECT_HAS_LEASE)
        while (codes := remove_pool_values(self.sock, keys)) != [0] * len(keys):
            assert time.monotonic() < deadline and set(codes) <= {0, leased}, codes
            keys = [k for k, c in zip(keys, codes) if c == leased]
            time.sleep(0.1)

    def _folder(self, prompt: list[int]) -> Path:
        """ExampleConnector's folder for a prompt: md5 of its whole blocks' token ids as int64."""
        n = len(prompt) // BLOCK * BLOCK
        return self.example / hashlib.md5(np.array(prompt[:n], np.int64).tobytes(), usedforsecurity=False).hexdigest()

    def close(self) -> None:
        self.e.close()


def _same(a: dict, b: dict) -> None:
    assert a["error"] is None and b["error"] is None, (a.get("error"), b.get("error"))
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]


def _layers(value: bytes) -> list[bytes]:
    """A pooled block's value cut into its layers' latents."""
    return [value[i * LAYER_BLOCK_BYTES:(i + 1) * LAYER_BLOCK_BYTES] for i in range(LAYERS)]


@pytest.fixture(scope="module")
def tp1(model, pool, alone, tmp_path_factory):
    """TP=1 with the pair: S cold (into both stores), an ExampleConnector hit, then a pool hit."""
    pair = Pair(model, pool, tmp_path_factory.mktemp("tp1") / "example")
    try:
        t = {}
        t["cold"], t["saved"] = pair.run(S)
        t["pooled"], t["cold_rows"] = pair.pooled(S), pair.rows(S)
        t["example_hit"], t["example_counters"] = pair.run(S)
        pair.forget_rows(S)
        t["pool_hit"], t["loaded"] = pair.run(S)
        t["loaded_rows"] = pair.rows(S)  # saved again, from the KV cache the pool's load filled
        yield pair, t
    finally:
        pair.close()


def test_cold_equals_vllm_alone_and_a_pool_hit_equals_vllm_loading_the_same_split(model, alone, tp1):
    _, t = tp1
    with Engine(model, block_size=BLOCK, kv_transfer_config=kvpool_config()) as e:  # backend local
        since = e.mark()
        cold = e.generate(S, MAX_TOKENS)
        saved = e.counters(since)
        since = e.mark()
        hit = e.generate(S, MAX_TOKENS)
        loaded = e.counters(since)
        log = e.log_text()
    assert "forcing chunked prefill and prefix caching to be disabled" in log
    assert re.search(r"kvpool worker ready: .* key=\S+@tp0/1@pp0/1@g0@0+; group 0 \(mla\)", log)
    for c, c2, a in zip(cold, t["cold"], alone):
        _same(c, a)
        _same(c2, a)
        assert c["num_cached_tokens"] == c2["num_cached_tokens"] == 0
    assert saved["save_blocks"] == t["saved"]["tp0 pp0"]["save_blocks"] == WHOLE
    assert [h["num_cached_tokens"] for h in hit + t["pool_hit"] + t["example_hit"]] == HITS * 3
    assert t["example_counters"]["tp0 pp0"].get("load_blocks", 0) == 0  # ExampleConnector served it
    for counters in (loaded, t["loaded"]["tp0 pp0"]):
        assert (counters["lookup_hit_blocks"], counters["load_blocks"], counters.get("load_failed_blocks", 0)) == (
            WHOLE, WHOLE, 0)
    for h, h2, x in zip(hit, t["pool_hit"], t["example_hit"]):
        _same(h, x)  # backend local
        _same(h2, x)  # kvpool server


def test_a_hit_loads_the_latent_the_cold_run_computed(tp1):
    _, t = tp1
    # The pool holds the latent rows the cold run left in vLLM's KV cache ...
    assert t["pooled"] == t["cold_rows"]
    # ... and a pool hit puts them back there: the rows of the hit's KV cache, byte for byte.
    assert t["loaded_rows"] == t["cold_rows"]


@pytest.mark.models  # a TP=2 engine: `make test-models`
def test_tensor_parallel_ranks_share_one_latent_and_tp1_and_tp2_hit_each_other(model, pool, tp1, tmp_path):
    p1, _ = tp1
    p1.run(A)  # cold at TP=1
    tp1_a = p1.pooled(A)
    p2 = Pair(model, pool, tmp_path / "tp2", **TP2)
    try:
        # Both workers key the latent as TP=1 does.
        assert pool_key_prefixes(p2.e) == pool_key_prefixes(p1.e) * 2
        hit_a, on_a = p2.run(A)  # TP=1's blocks, from the pool
        loaded_a = p2.rows(A)
        example_a, _ = p2.run(A)  # the same latent, through ExampleConnector
        cold_c, saved_c = p2.run(C)
        tp2_c, rows_c = p2.pooled(C), p2.rows(C)
        example_c2, _ = p2.run(C)
        p2.forget_rows(C)
        hit_c2, on_c2 = p2.run(C)  # its own blocks
        # A computed at TP=2 too: out of both stores first.
        p2.forget_rows(A)
        p2.forget_blocks(A)
        cold_a, saved_a = p2.run(A)
        tp2_a = p2.pooled(A)
    finally:
        p2.close()  # one TP=2 engine at a time
    hit_c, on_c = p1.run(C)  # TP=2's blocks, at TP=1
    example_c, _ = p1.run(C)

    # Rank 0 alone writes the latent; rank 0 looks up for both ranks, and each loads it.
    for saved in (saved_c, saved_a):
        assert {r: c.get("save_blocks", 0) for r, c in saved.items()} == {"tp0 pp0": WHOLE, "tp1 pp0": 0}
    for counters in (on_a, on_c2):
        assert counters["tp0 pp0"]["lookup_hit_blocks"] == WHOLE
        assert {r: c["load_blocks"] for r, c in counters.items()} == {"tp0 pp0": WHOLE, "tp1 pp0": WHOLE}
        assert all(c.get("load_failed_blocks", 0) == c.get("save_blocks", 0) == 0 for c in counters.values())
    assert (on_c["tp0 pp0"]["lookup_hit_blocks"], on_c["tp0 pp0"]["load_blocks"]) == (WHOLE, WHOLE)
    hits = hit_a + example_a + example_c2 + hit_c2 + hit_c + example_c
    assert [h["num_cached_tokens"] for h in hits] == HITS * 6
    assert [c["num_cached_tokens"] for c in cold_c + cold_a] == [0] * 4

    # Each pool hit equals ExampleConnector's at the same TP size on the same writer's latent.
    for got, want in zip(hit_a + hit_c2 + hit_c, example_a + example_c2 + example_c):
        _same(got, want)

    # What the pool holds and what a load leaves in a TP=2 engine's KV cache are the writer's rows.
    assert loaded_a == tp1_a
    assert tp2_c == rows_c
    # TP=1's and TP=2's latents of one prompt: equal in layer 0 only.
    assert [_layers(v)[0] for v in tp1_a] == [_layers(v)[0] for v in tp2_a]
    assert tp1_a != tp2_a
