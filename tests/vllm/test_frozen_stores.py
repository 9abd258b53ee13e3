"""A store that hangs (SIGSTOP) under a live vLLM instance costs one deadline, never a wrong
token, a failed request or a stalled engine; hits come back by themselves once it thaws.

For `server` and `mooncake`: while the store is frozen every request answers what vLLM alone
answers; the counters show that at most one call per kvpool thread waited for the deadline and
every later request was answered without asking the store (the circuit breaker was open). After
SIGCONT the breaker's probe finds the store again and the prefix is a pool hit, exact.
"""

from __future__ import annotations

import time

import pytest

from harness import Engine, kvpool_config, tokens, whole
from kvpool.testing.launch import PoolServer
from kvpool.testing.services import MooncakeMaster

pytestmark = pytest.mark.vllm

# kvpool threads that may call the store at once (lookup, load, save): each may meet the
# freeze before the breaker opens, and then no call waits for the store any more.
MAX_TIMEOUTS = 3
FROZEN_ASKS = 4
GUARD = {"lookup_timeout_s": 0.3, "transfer_timeout_s": 1.0, "breaker_cooldown_s": 0.5}


def _same(got: dict, want: dict, logprobs: bool = True) -> None:
    assert got["error"] is None, got
    assert got["token_ids"] == want["token_ids"]
    if logprobs:
        assert got["logprobs"] == want["logprobs"]


def _freeze_and_thaw(e: Engine, store, reference, seed: int) -> None:
    doc = tokens(900, seed=seed)  # 7 whole blocks
    others = [tokens(300 + 40 * i, seed=seed + 1 + i) for i in range(FROZEN_ASKS)]
    ref_cold, ref_hit = reference.generate([doc, doc])
    ref_others = reference.generate(others)
    _same(e.generate([doc])[0], ref_cold)
    hit = e.generate([doc])[0]
    assert hit["num_cached_tokens"] == whole(doc)
    _same(hit, ref_hit)

    since = e.mark()
    store.pause()
    try:
        for prompt, ref in zip(others, ref_others):
            got = e.generate([prompt])[0]
            _same(got, ref)  # cold while frozen: the same computation as vLLM's
        frozen_doc = e.generate([doc])[0]  # its blocks are in the frozen store: recomputed
        assert frozen_doc["num_cached_tokens"] == 0
        _same(frozen_doc, ref_cold, logprobs=False)
        c = e.counters(since)
        assert 1 <= c["store_timeouts"] <= MAX_TIMEOUTS, c
        assert c["store_calls_skipped"] >= FROZEN_ASKS, c
    finally:
        store.resume()

    deadline = time.monotonic() + 60
    while True:  # the probe closes the breaker within a cooldown or two
        again = e.generate([doc])[0]
        if again["num_cached_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert again["num_cached_tokens"] == whole(doc)
    _same(again, ref_hit)


def test_frozen_pool_server(model_dir, reference, tmp_path, engine_factory):
    sock = str(tmp_path / "pool.sock")
    with PoolServer(sock, memory_size="256MB", log_path=tmp_path / "pool.log") as server:
        e = engine_factory(model_dir, kv_transfer_config=kvpool_config(backend="server", server_socket=sock, **GUARD))
        _freeze_and_thaw(e, server, reference, seed=81)


def test_frozen_mooncake_master(model_dir, reference, tmp_path):
    master = MooncakeMaster(tmp_path)
    try:
        path = master.write_config(tmp_path / "mooncake.json", global_segment_size="256MB", local_buffer_size="64MB")
        e = Engine(model_dir, kv_transfer_config=kvpool_config(backend="mooncake", **GUARD),
                   env={"MOONCAKE_CONFIG_PATH": path})
        try:
            _freeze_and_thaw(e, master, reference, seed=91)
        finally:
            e.kill()  # a client of a store that was frozen: how it shuts down is not tested here
    finally:
        master.stop()


def test_a_frozen_remote_tier_behind_the_host_pool(model_dir, reference, tmp_path):
    """`server` with Mooncake behind it, the master frozen: cold requests answer as vLLM alone
    (their lookups of blocks the host pool lacks pay the deadline once, then the breaker answers),
    and what the host pool holds is still a hit, exact."""
    doc = tokens(900, seed=161)
    others = [tokens(300 + 40 * i, seed=162 + i) for i in range(FROZEN_ASKS)]
    ref_cold, ref_hit = reference.generate([doc, doc])
    ref_others = reference.generate(others)
    master = MooncakeMaster(tmp_path / "master")
    sock = str(tmp_path / "pool.sock")
    try:
        path = master.write_config(tmp_path / "mooncake.json", global_segment_size="256MB", local_buffer_size="64MB")
        with PoolServer(sock, memory_size="256MB", log_path=tmp_path / "pool.log"):
            e = Engine(model_dir, kv_transfer_config=kvpool_config(
                backend="server", server_socket=sock, remote_backend="mooncake", mooncake_config_path=path, **GUARD))
            try:
                _same(e.generate([doc])[0], ref_cold)
                since = e.mark()
                master.pause()
                try:
                    for prompt, ref in zip(others, ref_others):
                        _same(e.generate([prompt])[0], ref)
                    hit = e.generate([doc])[0]  # the host pool still serves it
                    assert hit["num_cached_tokens"] == whole(doc)
                    _same(hit, ref_hit)
                    c = e.counters(since)
                    # The write-through thread is one more kvpool thread that may meet the freeze.
                    assert 1 <= c["store_timeouts"] <= MAX_TIMEOUTS + 1, c
                    assert c["store_calls_skipped"] >= FROZEN_ASKS, c
                finally:
                    master.resume()
            finally:
                e.kill()  # a client of a store that was frozen: how it shuts down is not tested here
    finally:
        master.stop()
