"""The lookup channel: LookupClient (scheduler) <-> LookupServer (worker rank 0) over the real
Unix socket, in this test's own VLLM_RPC_BASE_PATH, or by a direct call where both are in one
process; and the worker's hit count behind it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

import kvpool.vllm.lookup as lookup_mod
from connector_fakes import (
    BLOCK_SIZE,
    DictBackend,
    kv_blocks,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    new_req,
    scheduler_output,
)
from kvpool.config import load_config
from kvpool.errors import ConfigError
from kvpool.vllm.lookup import Hit, LookupClient, LookupServer, lookup_socket_path
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.scheduler import PoolScheduler

HASHES = [bytes([i]) * 32 for i in range(5)]


def socket_client(port: int, dp_rank: int = 0) -> LookupClient:
    """A client that asks over the socket even though the server is in this process, as a
    scheduler in another process does."""
    return LookupClient(port, dp_rank, direct=False)


@pytest.fixture(params=["socket", "direct"])
def client_for(request) -> Callable[..., LookupClient]:
    """For behaviour both ways of asking share: a client over the socket, or one in the server's
    process that calls it directly."""
    return socket_client if request.param == "socket" else LookupClient


@pytest.fixture
def closing() -> Iterator[Callable]:
    """Register servers/clients to close after the test, whatever it asserted."""
    objs: list = []

    def register(obj):
        objs.append(obj)
        return obj

    yield register
    for obj in reversed(objs):
        obj.close()


def counting_server(port: int, pooled: set[bytes], seen: list[list[bytes]], dp_rank: int = 0) -> LookupServer:
    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        seen.append(list(hashes))
        n = 0
        while n < len(hashes) and hashes[n] in pooled:
            n += 1
        return n

    return LookupServer(port, dp_rank, count_hits)


def test_round_trip_over_ipc(rpc_dir, closing):
    seen: list[list[bytes]] = []
    server = closing(counting_server(5, set(HASHES[:3]), seen))
    assert server.path == lookup_socket_path(5, 0)
    assert os.path.dirname(server.path) == rpc_dir and os.path.exists(server.path)
    client = closing(socket_client(5))
    assert client.lookup(HASHES).blocks == 3
    assert client.lookup(HASHES[3:]).blocks == 0
    assert seen == [HASHES, HASHES[3:]]  # the hashes arrive as sent, as bytes


def test_an_empty_lookup_is_answered_without_asking(closing, client_for):
    seen: list[list[bytes]] = []
    closing(counting_server(5, set(HASHES), seen))
    assert closing(client_for(5)).lookup([]).blocks == 0
    assert seen == []


def test_a_pinned_hit_says_so_both_ways_of_asking(closing, client_for):
    # Whether a hit's load cannot fail decides whether vLLM may load it synchronously: the flag
    # must arrive as the worker said it, and a hit the client refuses carries no flag either.
    answers = {2: Hit(2, True), 3: Hit(3, False), 4: Hit(9, True)}
    closing(LookupServer(5, 0, lambda hashes, start=0, tenant="": answers[len(hashes)]))
    client = closing(client_for(5))
    assert client.lookup(HASHES[:2]) == Hit(2, True)
    assert client.lookup(HASHES[:3]) == Hit(3, False)
    assert client.lookup(HASHES[:4]) == Hit(0, False)  # more blocks than asked about: a miss


def test_dp_ranks_have_separate_channels(closing, client_for):
    seen0: list[list[bytes]] = []
    seen1: list[list[bytes]] = []
    closing(counting_server(5, set(HASHES[:1]), seen0, dp_rank=0))
    closing(counting_server(5, set(HASHES[:2]), seen1, dp_rank=1))
    assert closing(client_for(5, 1)).lookup(HASHES).blocks == 2
    assert closing(client_for(5, 0)).lookup(HASHES).blocks == 1


def test_a_backend_error_answers_zero_and_the_server_lives_on(closing, client_for):
    calls = []

    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        calls.append(len(hashes))
        if len(calls) == 1:
            raise ConnectionError("store went away")
        return len(hashes)

    closing(LookupServer(6, 0, count_hits))
    client = closing(client_for(6))
    assert client.lookup(HASHES).blocks == 0
    assert client.lookup(HASHES[:2]).blocks == 2
    assert calls == [5, 2]


def test_no_server_is_a_miss_within_the_timeout_and_the_client_recovers(monkeypatch, closing):
    monkeypatch.setattr(lookup_mod, "LOOKUP_TIMEOUT_MS", 50)
    client = closing(socket_client(7))
    assert client.lookup(HASHES).blocks == 0
    assert client.lookup(HASHES).blocks == 0
    # The server comes up late (worker rank 0 starts after the scheduler): the next lookup works.
    # (The timeout is read when the client opens its next socket; a generous one keeps a slow
    # machine from turning the connect into a miss.)
    closing(counting_server(7, set(HASHES[:4]), []))
    monkeypatch.setattr(lookup_mod, "LOOKUP_TIMEOUT_MS", 5000)
    assert client.lookup(HASHES).blocks == 4


def test_a_stuck_server_is_a_miss_and_does_not_poison_the_next_lookup(monkeypatch, closing):
    monkeypatch.setattr(lookup_mod, "LOOKUP_TIMEOUT_MS", 300)
    calls: list[int] = []
    stuck, entered, release = threading.Event(), threading.Event(), threading.Event()

    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        calls.append(len(hashes))
        if stuck.is_set() and not release.is_set():
            entered.set()
            assert release.wait(10)
        return len(calls)  # the n-th lookup answers n, so a stale answer is recognisable

    closing(LookupServer(8, 0, count_hits))
    client = closing(socket_client(8))
    # Connect first, so the stuck lookup below times out waiting for its answer, not for the connect.
    for _ in range(20):
        if client.lookup(HASHES).blocks:
            break
    else:
        pytest.fail("the lookup server never answered")
    stuck.set()
    assert client.lookup(HASHES).blocks == 0  # the server is stuck: a miss, not a stalled scheduler
    assert entered.wait(5)
    stuck_call = len(calls)
    release.set()
    monkeypatch.setattr(lookup_mod, "LOOKUP_TIMEOUT_MS", 5000)
    client._skip_until = 0.0  # past the breaker's back-off (its own test is below)
    # The stuck lookup's late answer went to the abandoned socket; this one gets its own.
    assert client.lookup(HASHES).blocks == stuck_call + 1


def test_a_stuck_server_costs_one_timeout_per_back_off_not_one_per_lookup(monkeypatch, closing):
    monkeypatch.setattr(lookup_mod, "LOOKUP_TIMEOUT_MS", 300)
    monkeypatch.setattr(lookup_mod, "LOOKUP_BACKOFF_S", 0.5)
    calls: list[int] = []
    release = threading.Event()

    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        calls.append(len(hashes))
        if len(calls) > 1:
            release.wait(10)
        return 2

    closing(LookupServer(14, 0, count_hits))
    client = closing(socket_client(14))
    assert client.lookup(HASHES).blocks == 2  # connected and answering
    assert client.lookup(HASHES).blocks == 0  # stuck: one timeout, and the breaker opens
    assert len(calls) == 2
    for _ in range(50):  # a scheduler's next lookups: misses at once, the worker is not asked
        assert client.lookup(HASHES).blocks == 0
    assert len(calls) == 2 and client.skipped == 50
    time.sleep(0.6)
    release.set()  # the worker recovers; after the back-off one lookup asks again
    deadline = time.monotonic() + 10
    while client.lookup(HASHES).blocks != 2:
        assert time.monotonic() < deadline, "the breaker never closed"
        time.sleep(0.05)
    assert client.lookup(HASHES).blocks == 2  # closed: every lookup asks again


def test_a_second_server_on_the_same_port_is_refused_until_the_first_closes(closing):
    first = counting_server(9, set(), [])
    try:
        with pytest.raises(ConfigError) as exc:
            counting_server(9, set(), [])
        assert exc.value.key == "lookup_rpc_port" and exc.value.value == 9
        closing(counting_server(10, set(), []))  # another port is free
        closing(counting_server(9, set(), [], dp_rank=1))  # so is another DP rank's channel
    finally:
        first.close()
    assert not os.path.exists(first.path)
    second = closing(counting_server(9, set(HASHES[:1]), []))
    assert closing(socket_client(9)).lookup(HASHES).blocks == 1
    assert second.path == first.path


def test_a_client_in_the_servers_process_calls_it_directly(closing):
    """No socket, no server thread: the hit count runs on the scheduler's own thread. Once the
    server has closed, the client asks over the socket again (and, nobody listening, misses)."""
    threads: list[int] = []

    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        threads.append(threading.get_ident())
        return len(hashes)

    server = LookupServer(19, 0, count_hits)
    client = closing(LookupClient(19))
    try:
        assert client.lookup(HASHES).blocks == 5
        assert threads == [threading.get_ident()]
        assert closing(LookupClient(19, 1)).lookup(HASHES).blocks == 0  # another DP rank's worker is elsewhere
        assert closing(socket_client(19)).lookup(HASHES).blocks == 5 and threads[1] != threading.get_ident()
    finally:
        server.close()
    assert client.lookup(HASHES).blocks == 0 and len(threads) == 2
    successor = closing(LookupServer(19, 0, lambda hashes, start=0, tenant="": 1))  # a restarted worker: asked again
    assert client.lookup(HASHES).blocks == 1 and successor.path == server.path


# ---- through the worker -----------------------------------------------------------------------------


def test_scheduler_finds_what_the_worker_saved(make_worker, closing):
    """Worker rank 0 serves lookups from its backend; the scheduler's real client asks it."""
    worker, _, _ = make_worker({"lookup_rpc_port": 11})
    req = make_request("a", 3 * BLOCK_SIZE + 1)
    worker.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", req.block_hashes[:2], [1, 2])]))
    assert worker._transfer.wait(timeout=10)

    sched = PoolScheduler(make_vllm_config(), load_config({"lookup_rpc_port": 11}), make_kv_cache_config())
    closing(sched._client)
    other = make_request("b", 3 * BLOCK_SIZE + 1)  # same prompt, another request
    assert sched.get_num_new_matched_tokens(other, 0) == (2 * BLOCK_SIZE, False)
    sched.update_state_after_alloc(other, kv_blocks([5, 6, 7, 8]), 2 * BLOCK_SIZE)
    meta = sched.build_connector_meta(scheduler_output(new=[(new_req(other, [5, 6, 7, 8], 2 * BLOCK_SIZE), BLOCK_SIZE + 1)]))
    assert [(t.block_hashes, t.block_ids) for t in meta.loads] == [(req.block_hashes[:2], [5, 6])]
    stats = worker.get_stats()
    assert stats is not None and (stats.data["lookups"], stats.data["lookup_hit_blocks"]) == (1, 2)


def test_a_block_is_a_hit_only_when_every_tp_shard_has_it(make_worker, closing):
    pool = DictBackend(shared=True)
    extra = {"backend": "server", "lookup_rpc_port": 12}
    rank0, _, _ = make_worker(extra, tp=(0, 2), backend=pool)
    hashes = HASHES[:3]
    rank0.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", hashes, [1, 2, 3])]))
    assert rank0._transfer.wait(timeout=10)
    client = closing(LookupClient(12))
    assert client.lookup(hashes).blocks == 0  # rank 1's keys are missing
    rank1, _, _ = make_worker(extra, tp=(1, 2), backend=pool)  # rank 1 serves no lookups
    rank1.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", hashes[:2], [1, 2])]))
    assert rank1._transfer.wait(timeout=10)
    assert client.lookup(hashes).blocks == 2


def test_only_rank_zero_of_a_loading_instance_serves_lookups(make_worker, rpc_dir):
    make_worker({"lookup_rpc_port": 13, "producer_is_to_load": False}, role="kv_producer")  # never loads: no server
    assert not os.path.exists(lookup_socket_path(13))
    make_worker({"lookup_rpc_port": 16}, role="kv_producer")  # loads by default, as kv_both
    assert os.path.exists(lookup_socket_path(16))
    make_worker({"backend": "server", "lookup_rpc_port": 14}, tp=(1, 2), backend=DictBackend(shared=True))
    assert not os.path.exists(lookup_socket_path(14))
    make_worker({"lookup_rpc_port": 15})
    assert os.path.exists(lookup_socket_path(15))


@pytest.mark.parametrize("answer", [10**9, -1, len(HASHES) + 1])
def test_an_impossible_hit_count_is_a_miss(closing, answer, client_for):
    # More hits than blocks asked about (or fewer than none) would have vLLM load blocks nobody
    # stored: whatever answered, such a reply is a miss.
    closing(LookupServer(9, 0, lambda hashes, start=0, tenant="": answer))
    client = closing(client_for(9))
    for _ in range(20):
        assert client.lookup(HASHES).blocks == 0


def test_a_long_prompts_lookup_is_answered_whole(closing, client_for):
    # 100,000 hashes (3.5 MB): far beyond one socket buffer, as a million-token prompt in
    # 16-token blocks would be.
    hashes = [i.to_bytes(32, "big") for i in range(100_000)]
    seen: list[list[bytes]] = []
    closing(counting_server(17, set(hashes[:70_000]), seen))
    assert closing(client_for(17)).lookup(hashes).blocks == 70_000
    assert seen == [hashes]


def test_garbage_from_a_client_costs_only_its_connection(closing):
    from kvpool.server.protocol import HEADER, MAX_REQUEST_FRAME, encode_frame, recv_frame

    seen: list[list[bytes]] = []
    server = closing(counting_server(18, set(HASHES), seen))
    client = closing(socket_client(18))
    assert client.lookup(HASHES).blocks == 5

    def raw() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(server.path)
        return s

    # A well-framed body that is not a list of hashes: a miss, and the connection stays usable.
    s = raw()
    s.sendall(encode_frame({"not": "hashes"}))
    assert recv_frame(s, 64) == encode_frame([0, False])[HEADER.size:]
    s.sendall(encode_frame(HASHES[:2]))  # the hashes without the start they follow
    assert recv_frame(s, 64) == encode_frame([0, False])[HEADER.size:]
    s.sendall(encode_frame([-1, HASHES[:2], ""]))  # a start before the prompt
    assert recv_frame(s, 64) == encode_frame([0, False])[HEADER.size:]
    s.sendall(encode_frame([0, HASHES[:2], ""]))
    assert recv_frame(s, 64) == encode_frame([2, False])[HEADER.size:]
    # A length over the limit, and a frame cut short: the server drops that connection only.
    s.sendall(HEADER.pack(MAX_REQUEST_FRAME + 1))
    assert s.recv(1) == b""
    s = raw()
    s.sendall(HEADER.pack(100) + b"\x91")
    s.close()
    raw().close()  # connects and leaves without a word
    assert client.lookup(HASHES).blocks == 5
    assert seen == [HASHES, HASHES[:2], HASHES]


def test_a_base_path_too_long_for_a_socket_name_is_refused(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(deep))
    with pytest.raises(ConfigError) as exc:
        lookup_socket_path(1, 0)
    assert exc.value.key == "VLLM_RPC_BASE_PATH" and exc.value.value == str(deep)


def test_the_tenant_crosses_the_channel_and_a_malformed_one_is_a_miss(rpc_dir, closing):
    asked: list[str] = []

    def count_hits(hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> int:
        asked.append(tenant)
        return len(hashes)

    closing(LookupServer(31, 0, count_hits))
    client = closing(LookupClient(31, 0, direct=False))
    assert client.lookup(HASHES[:2], 0, "0123456789ab").blocks == 2
    assert client.lookup(HASHES[:2]).blocks == 2
    assert client.lookup(HASHES[:2], 0, "../etc").blocks == 0  # not a tag: refused before counting
    assert asked == ["0123456789ab", ""]
