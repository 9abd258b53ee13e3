"""KV events with a shared `kvpool server` that evicts: an instance's stream announces what it
saved and what the server dropped (its feed of the pool's drops), so a subscriber that applies
the stream holds exactly the instance's blocks the pool still has, evictions included."""

from __future__ import annotations

import time

import pytest

from harness import BLOCK, Engine, kv_events_config, kvpool_config, pool_key_prefixes, replay_kv_events, tokens, \
    vllm_block_hashes
from kvpool.server.client import PoolClient
from kvpool.testing.launch import PoolServer

pytestmark = pytest.mark.vllm

PROMPTS = [tokens(5 * BLOCK + 7, seed=7000 + i) for i in range(24)]  # 120 blocks through a pool of ~100


def test_a_subscriber_holds_what_the_shared_pool_still_has(model_dir, tmp_path):
    sock = str(tmp_path / "pool.sock")
    with PoolServer(sock, memory_size="16MB", log_path=tmp_path / "pool.log"), \
            Engine(model_dir, kv_transfer_config=kvpool_config(backend="server", server_socket=sock),
                   kv_events_config=kv_events_config()) as engine:
        for prompt in PROMPTS:
            engine.generate([prompt], max_tokens=1)
        time.sleep(0.3)  # drops are asked for at most every 0.1 s, at an engine step
        engine.generate([tokens(10, seed=7999)], max_tokens=1)
        events = replay_kv_events(engine.spec["kv_events_config"])
        (prefix, _), = pool_key_prefixes(engine)
        hashes = [h for p in PROMPTS for h in vllm_block_hashes(p, BLOCK)]
        with PoolClient(sock, "test-events", ping=False) as client:
            in_pool = dict(zip(hashes, client.exists([f"{prefix}@{h.hex()}" for h in hashes])))

    stored, view = set(), set()
    for event in events:
        if getattr(event, "ownership", None) != "kvpool":
            continue
        blocks = set(event.block_hashes)
        if type(event).__name__ == "BlockStored":
            stored |= blocks
            view |= blocks
        else:
            view -= blocks

    def published(h: bytes) -> object:  # as the events carry a hash: an int, unless told otherwise
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if any(isinstance(b, int) for b in stored) else h

    assert {published(h) for h in hashes} <= stored  # every block was saved and announced
    evicted = [h for h in hashes if not in_pool[h]]
    assert evicted and len(evicted) < len(hashes)  # the pool evicted some, and kept some
    assert {published(h) for h in hashes if in_pool[h]} == view & {published(h) for h in hashes}
