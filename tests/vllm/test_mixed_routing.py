"""Prefix-aware routing on real vLLM: `kvpool proxy --instance-*` in front of two PD-mixed
instances (`kv_both`, vLLM's prefix cache on, one shared `kvpool server`).

Two conversations, two turns each, through the proxy with `--routing-policy prefix_aware`:
the first turns go to the two idle instances (least loaded), each second turn goes where its
first went (its prefix chain matches there) and hits (cached tokens = the first turn's whole
blocks). The answers' token ids equal vLLM's own (the shared reference engine: the first turn
cold, the second a prefix-cache hit of the same length). Only token ids are compared: the
OpenAI servers and the reference engine do not run the same serving loop (README.md,
exactness rule). The proxy's `GET /routing` counters must tell the same story.

The same two instances then serve as a PD pair behind a second proxy (`--prefiller-*` the
first, `--decoder-*` the second): the decode instance loads the prompt's whole blocks from the
pool, which the prefill instance computed, and its answer must equal, tokens and top-5 logprobs
bit for bit, the prefill instance's own prefix-cache hit of the same prompt (same flags, same
split: the whole blocks cached, the rest computed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness import BLOCK, instances_on_one_pool, tokens, whole
from kvpool.keys import model_key_name
from kvpool.metrics import catalog
from kvpool.server.metrics import ADMIN_TOKEN_ENV
from kvpool.testing.launch import ProxyServer, stream_completion
from kvpool.testing.metrics import dashboard_problems, families, scrape_problems, value

pytestmark = pytest.mark.vllm

TOKEN = "routing-test-admin-token-0123456789"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpool.json"
MAX_TOKENS = 8
# 300 prompt tokens + 8 generated: 2 whole blocks either way, so the instance's own prefix cache
# (prompt and decode blocks) and the pool (prompt blocks) both hold exactly whole(first turn).
FIRST = [tokens(300, seed=9101), tokens(300, seed=9102)]
FOLLOW_UP = [tokens(100, seed=9111), tokens(100, seed=9112)]


@pytest.fixture(scope="module")
def mixed_deployment(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    with instances_on_one_pool(model_dir, tmp, 2, 9120, pool_args=("--metrics_port", "0"),
                               pool_env={ADMIN_TOKEN_ENV: TOKEN}) as (pool, servers):
        proxy = ProxyServer([], [], instance_ports=[s.port for s in servers], log_path=tmp / "proxy.log",
                            extra_args=["--routing-policy", "prefix_aware", "--log-level", "warning"],
                            env={**os.environ, "KVPOOL_PROXY_ADMIN_TOKEN": TOKEN})
        proxy.start()
        try:
            yield proxy, servers, pool
        finally:
            proxy.stop()


def test_a_conversation_sticks_to_its_instance_and_hits_like_vllms_own_prefix_cache(mixed_deployment, reference):
    proxy, servers, _ = mixed_deployment
    keys = {f"127.0.0.1:{s.port}" for s in servers}
    with httpx.Client(base_url=proxy.base_url, timeout=300, trust_env=False) as client:
        def ask(prompt):
            return stream_completion(client, "model", prompt, MAX_TOKENS, ignore_eos=True)

        first = [ask(p) for p in FIRST]
        second_prompts = [FIRST[c] + first[c].token_ids + FOLLOW_UP[c] for c in range(2)]
        second = [ask(p) for p in second_prompts]
        # A streamed answer is settled once the proxy has sent its last byte, which the client
        # may read before the proxy's bookkeeping ran: wait (bounded) for the fourth to settle.
        deadline = time.monotonic() + 30
        while True:
            stats = client.get("/routing", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            if stats["total"]["answered"] >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)

    # Where they went: two idle instances for the first turns, then each conversation's own.
    homes = [c.headers["x-kvpool-instance"] for c in first]
    assert set(homes) == keys, homes
    assert [c.headers["x-kvpool-instance"] for c in second] == homes
    assert [c.headers["x-kvpool-route"] for c in first] == ["least_loaded", "least_loaded"]
    assert [c.headers["x-kvpool-route"] for c in second] == ["prefix_match", "prefix_match"]
    assert [int(c.headers["x-kvpool-route-matched-blocks"]) for c in second] == [len(p) // BLOCK for p in FIRST]

    # What they computed: vLLM alone, the first turn cold and the second a prefix-cache hit.
    for c in range(2):
        ref_first, ref_second = reference.generate([FIRST[c], second_prompts[c]], max_tokens=MAX_TOKENS)
        assert first[c].cached_tokens == 0 and first[c].token_ids == ref_first["token_ids"]
        assert ref_second["num_cached_tokens"] == whole(FIRST[c])
        assert second[c].cached_tokens == whole(FIRST[c]) > 0, second[c].usage
        assert second[c].token_ids == ref_second["token_ids"]

    # The proxy's counters: 4 decisions, all reported, both predicted hits came true.
    total = stats["total"]
    assert (total["decisions"], total["answered"], total["reported"]) == (4, 4, 4)
    assert (total["hits"], total["predicted_hits"], total["predicted_and_hit"]) == (2, 2, 2)
    assert total["predicted_tokens"] == total["cached_tokens_of_token_prompts"] == sum(whole(p) for p in FIRST)
    assert stats["by_reason"]["prefix_match"]["predicted_and_hit"] == 2
    assert {k: v["decisions"] for k, v in stats["by_instance"].items()} == dict.fromkeys(keys, 2)



def test_pd_through_the_proxy_equals_vllms_own_prefix_cache_hit_bit_for_bit(mixed_deployment, tmp_path):
    _, (prefill, decode), _ = mixed_deployment
    prompt = tokens(700, seed=9201)  # 5 whole blocks, then 60 tokens every run computes
    body = {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 5}
    with ProxyServer([prefill.port], [decode.port], log_path=tmp_path / "pd-proxy.log",
                     extra_args=["--log-level", "warning"]) as pd:
        through = httpx.post(f"{pd.base_url}/v1/completions", json=body, timeout=300, trust_env=False).json()
    # vLLM alone: the prefill instance computed the prompt itself; asked again, its own cache serves it.
    alone = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=300, trust_env=False).json()
    details = through["usage"]["prompt_tokens_details"]
    assert details["decode_cached_tokens"] == whole(prompt), through["usage"]
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == whole(prompt), alone["usage"]
    assert through["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
    assert through["choices"][0]["text"] == alone["choices"][0]["text"]


def test_every_catalog_series_is_on_the_live_pool_proxy_and_instances(mixed_deployment):
    """A scrape of each component's /metrics has every series of the metrics reference, with its
    type and labels; and the numbers move: instance 0 computes and saves a prompt, instance 1
    loads it from the pool."""
    proxy, servers, pool = mixed_deployment
    prompt = tokens(300, seed=9301)
    pool_url = "http://127.0.0.1:" + pool.log().split("metrics http://127.0.0.1:")[1].split()[0]
    labels = {"model_name": "model", "engine": "0"}

    def scrape(url: str) -> str:
        return httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text

    def settled(url: str, name: str, want: float, **sample_labels: str) -> str:
        # The engine reports its connector stats with its steps: the last ones may trail the answer.
        deadline = time.monotonic() + 30
        while True:
            text = scrape(url)
            if value(text, name, **sample_labels) >= want or time.monotonic() > deadline:
                return text
            time.sleep(0.2)

    saved_before = value(scrape(servers[0].base_url), "vllm:kvpool_blocks_total", op="save", result="ok", **labels)
    assert servers[0].complete(prompt, max_tokens=2).cached_tokens == 0
    # Instance 0 saves after it answers: instance 1 asks once those blocks are in the pool.
    settled(servers[0].base_url, "vllm:kvpool_blocks_total", saved_before + whole(prompt) // BLOCK,
            op="save", result="ok", **labels)
    assert servers[1].complete(prompt, max_tokens=2).cached_tokens == whole(prompt)
    saved = settled(servers[0].base_url, "vllm:kvpool_blocks_total", 2, op="save", result="ok", **labels)
    loaded = settled(servers[1].base_url, "vllm:kvpool_blocks_total", 2, op="load", result="ok", **labels)
    for text in (saved, loaded):
        assert scrape_problems(text, catalog.CONNECTOR) == []
    assert value(saved, "vllm:kvpool_blocks_total", op="save", result="ok", **labels) >= whole(prompt) // BLOCK
    assert value(loaded, "vllm:kvpool_blocks_total", op="load", result="ok", **labels) >= whole(prompt) // BLOCK
    assert value(loaded, "vllm:kvpool_prompt_tokens_total", source="pool", **labels) >= whole(prompt)
    assert value(loaded, "vllm:kvpool_transfer_seconds_count", op="load", **labels) >= 1

    # The vLLM series the dashboard shows beside kvpool's exist on a live instance.
    _, vllms_own = dashboard_problems(json.loads(DASHBOARD.read_text()), catalog.ALL)
    samples = {sample.name for _, found in families(loaded).values() for sample in found}
    assert vllms_own and vllms_own <= samples, vllms_own - samples

    served = scrape(pool_url)
    assert scrape_problems(served, catalog.SERVER) == []
    assert value(served, "kvpool_read_hits_total", tier="memory") >= whole(prompt) // BLOCK
    # The scheduler's lookup leased the blocks and the load copied under those leases: a
    # Lookup and a Release, no Acquire.
    assert value(served, "kvpool_request_duration_seconds_count", op="lookup") >= 1
    assert value(served, "kvpool_request_duration_seconds_count", op="release") >= 1

    routed = scrape(proxy.base_url)
    assert scrape_problems(routed, catalog.PROXY) == []
    assert value(routed, "kvpool_proxy_instance_healthy", role="mixed") == 2


def test_kvpool_ctl_looks_up_pins_and_clears_what_the_instances_saved(mixed_deployment, model_dir, capsys,
                                                                     monkeypatch):
    """`kvpool ctl` against the live pool: the prompt's block hashes it computes from token ids are
    the ones the instance saved under (its lookup finds every whole block), a pin holds them, and
    after a clear of the model the other instance, which never saw the prompt, computes it all."""
    from kvpool.cli.main import main
    from kvpool.vllm.prompt_hashes import prompt_block_hashes

    _, servers, pool = mixed_deployment
    url = "http://127.0.0.1:" + pool.log().split("metrics http://127.0.0.1:")[1].split()[0]
    prompt = tokens(300, seed=9401)
    blocks = whole(prompt) // BLOCK
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)

    def ctl(*args: str) -> dict:  # in this process: vLLM is imported once, not per call
        assert main(["ctl", "--url", url, *args]) == 0
        return json.loads(capsys.readouterr().out)

    hashes = ("--model", model_dir, "--block-hashes", ",".join(h.hex() for h in prompt_block_hashes(prompt, BLOCK)))
    assert servers[0].complete(prompt, max_tokens=2).cached_tokens == 0
    deadline = time.monotonic() + 30  # the instance saves after it answers
    while ctl("lookup", *hashes)["hit_blocks"] < blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    # The command itself, from the prompt's token ids, as an operator runs it.
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "ctl", "--url", url, "lookup", "--model", model_dir,
                           "--block-size", str(BLOCK), "--token-ids", ",".join(map(str, prompt))],
                          capture_output=True, text=True, timeout=120, env={**os.environ, ADMIN_TOKEN_ENV: TOKEN})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["blocks"] == blocks and found["hit_blocks"] == blocks, found
    (layout,) = found["layouts"].values()
    assert layout["groups"]["g0"]["memory"] == blocks
    assert ctl("pin", *hashes, "--ttl", "10m")["pinned"] == blocks
    assert ctl("usage")["models"][model_key_name(model_dir)]["pinned_objects"] == blocks
    assert ctl("clear", "--model", model_dir)["removed"] >= blocks
    assert ctl("lookup", *hashes)["hit_blocks"] == 0
    assert servers[1].complete(prompt, max_tokens=2).cached_tokens == 0
