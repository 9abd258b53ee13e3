"""PD-mixed mode: each request goes once, as it came, to the instance the routing policy picks.

Test peers stand in for vLLM instances (proxy_peers.py); the proxy is the real one.
"""

from __future__ import annotations

import argparse
import threading

import pytest
from conftest import ADMIN_HEADERS

import kvpool
from kvpool import cli
from kvpool.errors import ConfigError
from kvpool.metrics import catalog
from kvpool.proxy.config import Endpoint, add_arguments, config_from_args
from kvpool.proxy.prefix import chat_text, request_chain
from kvpool.proxy.registry import Registry, Role
from kvpool.proxy.route import COUNTERS
from kvpool.routing import REASONS, text_chain, token_chain
from kvpool.testing.metrics import families, scrape_problems, value
from kvpool.testing.proc import expect

# Small blocks, so short test prompts span several.
ROUTING = dict(routing_block_size=4, routing_block_chars=8)


def served_by(resp, peers) -> str:
    assert resp.status_code == 200, resp.text
    key = resp.headers["x-kvpool-instance"]
    (name,) = [p.name for p in peers if key == f"127.0.0.1:{p.port}"]
    return name


def ask(proxy, peers, prompt, **body):
    resp = proxy.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4, **body})
    return served_by(resp, peers), resp


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), env={})


# ---------------------------------------------------------------- arguments

def test_mixed_mode_arguments_and_defaults():
    cfg = parse("--instance-hosts", "localhost", "--instance-ports", "8300", "8301")
    assert cfg.mixed and cfg.instances == (Endpoint("localhost", 8300), Endpoint("localhost", 8301))
    assert (cfg.routing_policy, cfg.routing_block_size, cfg.routing_block_chars) == ("prefix_aware", 128, 512)
    assert parse("--instance-hosts", "h", "--instance-ports", "1", "--routing-policy", "round_robin"
                 ).routing_policy == "round_robin"
    pd = parse("--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "h", "--decoder-ports", "2")
    assert not pd.mixed and pd.routing_policy == "least_loaded"  # what PD mode always did


@pytest.mark.parametrize(("argv", "message"), [
    (["--instance-hosts", "h", "--instance-ports", "1", "--prefiller-hosts", "h", "--prefiller-ports", "2"],
     "not both"),
    (["--instance-hosts", "h", "--instance-ports", "1", "--decoder-hosts", "h", "--decoder-ports", "2"], "not both"),
    (["--instance-hosts", "a", "b", "--instance-ports", "1", "2", "3"], "2 hosts and 3 ports"),
    (["--instance-ports", "1"], "--instance-ports needs hosts"),
    (["--instance-hosts", "h", "--instance-ports", "1", "1"], "listed twice"),
    (["--instance-hosts", "h", "--instance-ports", "1", "--routing-policy", "random"], "one of round_robin"),
    (["--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "h", "--decoder-ports", "2",
      "--routing-policy", "prefix_aware"], "PD mode always picks the least-loaded"),
    ([], "instances to route to"),  # it would answer every request 503, for good
    (["--prefiller-hosts", "h", "--prefiller-ports", "1"], "instances to route to"),
    (["--instance-hosts", "h", "--instance-ports", "1", "--routing-block-size", "0"], "--routing-block-size"),
    (["--instance-hosts", "h", "--instance-ports", "1", "--routing-block-chars", "0"], "--routing-block-chars"),
    (["--instance-hosts", "h", "--instance-ports", "1", "--routing-load-factor", "0.5"], "number >= 1"),
])
def test_bad_mixed_arguments_exit_with_a_clear_message(argv, message, capsys):
    assert cli.main(["proxy", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool proxy: error: ") and message in err
    with pytest.raises(ConfigError):
        parse(*argv)


# ---------------------------------------------------------------- prefix chains

def test_request_chains_follow_the_prompt_kind():
    ids = list(range(3, 40))
    assert request_chain({"prompt": ids}, 4, 8) == ("tokens", token_chain(ids, 4, 256))
    assert request_chain({"prompt": [ids, [5, 6]]}, 4, 8) == ("tokens", token_chain(ids, 4, 256))  # batch: first
    assert request_chain({"prompt": "x" * 30}, 4, 8) == ("text", text_chain("x" * 30, 8, 256))
    assert request_chain({"prompt": ["abc" * 9, "z"]}, 4, 8)[1] == text_chain("abc" * 9, 8, 256)
    assert request_chain({"prompt": [2**70] * 8}, 4, 8) == ("none", [])  # out of range: routed by load alone
    assert request_chain({"model": "m"}, 4, 8) == ("none", [])
    assert request_chain({"prompt": "short"}, 4, 8) == ("text", [])  # no whole block


def test_a_chats_next_turn_extends_its_chain():
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about pools."}]
    turn2 = turn1 + [{"role": "assistant", "content": "They cache."}, {"role": "user", "content": "More?"}]
    _, c1 = request_chain({"messages": turn1}, 4, 8)
    kind, c2 = request_chain({"messages": turn2}, 4, 8)
    assert kind == "text" and len(c2) > len(c1) > 0 and c2[:len(c1)] == c1
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "image_url", "image_url": {
        "url": "u"}}]}]
    assert chat_text(parts).startswith("user\x1fTell me{")
    # The role is part of the text: the same words from another role are another prefix.
    other = [{"role": "user", "content": "You are terse."}]
    assert request_chain({"messages": other}, 4, 8)[1][:1] != c1[:1]


def test_registry_of_one_mode_refuses_the_others_roles():
    mixed = Registry(instances=[Endpoint("h", 1)])
    assert mixed.roles == (Role.MIXED,) and mixed.counts() == {"mixed_instances": 1, "healthy_mixed_instances": 1}
    with pytest.raises(ValueError, match="PD-mixed"):
        mixed.add(Role.PREFILL, Endpoint("h", 2))
    with pytest.raises(ValueError, match="'mixed'"):
        Registry([Endpoint("h", 1)], []).add(Role.MIXED, Endpoint("h", 3))


# ---------------------------------------------------------------- the policies

def test_round_robin_takes_each_instance_in_turn(make_peer, start_proxy):
    peers = [make_peer(n) for n in "ABC"]
    proxy = start_proxy([], [], instances=peers, routing_policy="round_robin", **ROUTING)
    got = [ask(proxy, peers, "the same prompt every time")[0] for _ in range(6)]
    assert got == list("ABCABC")
    stats = proxy.routing()
    assert stats["policy"] == "round_robin" and stats["by_reason"]["round_robin"]["decisions"] == 6


def test_requests_go_once_and_unchanged_to_the_instance(make_peer, start_proxy):
    a = make_peer("A", cached_tokens=8, kv_transfer_params={"x": 1})
    proxy = start_proxy([], [], instances=[a], **ROUTING)
    body = {"model": "m", "prompt": "Hello there, pool", "max_tokens": 5, "stream": False, "min_tokens": 2,
            "kv_transfer_params": {"client": "own"}}
    resp = proxy.post("/v1/completions", body, headers={"X-Request-Id": "r-1"})
    assert resp.status_code == 200, resp.text
    (got,) = a.completions()
    assert got.body == body and got.headers["x-request-id"] == "r-1"
    data = resp.json()
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}  # not rewritten
    assert data["kv_transfer_params"] == {"x": 1}
    assert resp.headers["x-kvpool-route"] in REASONS


def test_least_loaded_avoids_the_busy_instance(make_peer, start_proxy):
    gate = threading.Event()
    a, b = make_peer("A", gate=gate), make_peer("B")
    proxy = start_proxy([], [], instances=[a, b], routing_policy="least_loaded", **ROUTING)
    held: list = []
    t = threading.Thread(target=lambda: held.append(ask(proxy, [a, b], "held")), daemon=True)
    t.start()
    expect(lambda: len(a.completions()) == 1, "the first request to reach A")
    assert [ask(proxy, [a, b], f"p{i}")[0] for i in range(3)] == ["B", "B", "B"]
    gate.set()
    t.join(10)
    assert held[0][0] == "A"
    assert proxy.routing()["by_reason"]["least_loaded"]["decisions"] == 4


@pytest.mark.parametrize("kind", ["chat", "tokens"])
def test_a_conversations_turns_stick_to_one_instance(kind, make_peer, start_proxy):
    peers = [make_peer(n) for n in "ABC"]
    proxy = start_proxy([], [], instances=peers, **ROUTING)  # prefix_aware, the default
    where: dict[int, list[str]] = {0: [], 1: [], 2: []}
    reasons: dict[int, list[str]] = {0: [], 1: [], 2: []}
    history: dict[int, list] = {c: [] for c in where}
    for turn in range(4):
        for conv in where:
            if kind == "chat":
                history[conv] += [{"role": "user", "content": f"{conv}: conversation {conv}, turn {turn}: tell me more"}]
                resp = proxy.post("/v1/chat/completions", {"model": "m", "messages": history[conv]})
                history[conv] += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]}]
            else:
                history[conv] += [1000 * conv + turn * 10 + i for i in range(9)]
                resp = proxy.post("/v1/completions", {"model": "m", "prompt": history[conv], "max_tokens": 2})
            where[conv].append(served_by(resp, peers))
            reasons[conv].append(resp.headers["x-kvpool-route"])
            if turn:
                assert int(resp.headers["x-kvpool-route-matched-blocks"]) > 0
    assert all(len(set(w)) == 1 for w in where.values()), where
    assert len({w[0] for w in where.values()}) == 3  # three conversations, three idle instances
    assert all(r == ["least_loaded", "prefix_match", "prefix_match", "prefix_match"] for r in reasons.values())
    stats = proxy.routing()
    assert stats["by_reason"]["prefix_match"]["decisions"] == 9
    assert stats["total"]["decisions"] == 12


def test_the_load_bound_spreads_a_hot_prefix(make_peer, start_proxy):
    gates = [threading.Event(), threading.Event()]
    a, b = make_peer("A", gate=gates[0]), make_peer("B", gate=gates[1])
    proxy = start_proxy([], [], instances=[a, b], **ROUTING)
    hot = "the same long system prompt, asked again and again " * 3
    results: list = []
    lock = threading.Lock()

    def one() -> None:
        r = ask(proxy, [a, b], hot)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(12)]
    for t in threads:  # one at a time into the proxy, so every decision sees the loads before it
        t.start()
        n = len(threads[:threads.index(t) + 1])
        expect(lambda: len(a.completions()) + len(b.completions()) == n, f"request {n} at an instance")
    for g in gates:
        g.set()
    for t in threads:
        t.join(10)
    na, nb = len(a.completions()), len(b.completions())
    assert na + nb == 12 and abs(na - nb) <= 0.25 * 12 / 2 + 1, (na, nb)  # none pinned to one instance
    reasons = proxy.routing()["by_reason"]
    assert reasons["load_bound"]["decisions"] > 0 and reasons["prefix_match"]["decisions"] > 0


def test_a_down_instance_is_skipped_and_forgotten_when_it_returns(make_peer, start_proxy):
    a, b = make_peer("A"), make_peer("B")
    proxy = start_proxy([], [], instances=[a, b], **ROUTING)
    conv = "a conversation that went to the first instance, then turn two"
    first, _ = ask(proxy, [a, b], conv)
    home, other = (a, b) if first == "A" else (b, a)
    home.behavior.status, home.behavior.health_status = 500, 503
    key = f"mixed:{home.port}"
    expect(lambda: not proxy.instances()[key]["healthy"], "the probe to take the instance out", timeout=10)
    assert [ask(proxy, [a, b], conv)[0] for _ in range(3)] == [other.name] * 3  # skipped while down
    forgotten = proxy.routing()["forgotten"]
    home.behavior.status, home.behavior.health_status = 200, 200
    expect(lambda: proxy.instances()[key]["healthy"], "the probe to take the instance back", timeout=10)
    assert proxy.routing()["forgotten"] == forgotten + 1  # it may have restarted empty
    # Its old prefix is forgotten there; the other instance has it now.
    name, resp = ask(proxy, [a, b], conv)
    assert name == other.name and resp.headers["x-kvpool-route"] == "prefix_match"


def test_a_failed_attempt_is_retried_on_another_instance_and_counted(make_peer, start_proxy):
    a, b = make_peer("A", status=500), make_peer("B", cached_tokens=4)
    proxy = start_proxy([], [], instances=[a, b], routing_policy="round_robin", health_interval=60, **ROUTING)
    name, resp = ask(proxy, [a, b], "retry me")
    assert name == "B" and len(a.completions()) == 1
    total = proxy.routing()["total"]
    assert (total["decisions"], total["answered"], total["reported"], total["hits"]) == (2, 1, 1, 1)
    b.behavior.status = 503
    resp = proxy.post("/v1/completions", {"model": "m", "prompt": "nobody answers"})
    assert resp.status_code == 503  # the last 5xx, as it was


def test_counters_set_predictions_against_cached_tokens(make_peer, start_proxy):
    a = make_peer("A", cached_tokens=8)
    proxy = start_proxy([], [], instances=[a], **ROUTING)
    prompt = list(range(10, 22))  # 3 blocks of 4 tokens
    ask(proxy, [a], prompt)  # no match predicted, 8 cached reported: an unpredicted hit
    ask(proxy, [a], prompt + [7, 7, 7, 7])  # 3 blocks predicted
    stream_body = {"stream": True, "stream_options": {"include_usage": True}}
    name, resp = ask(proxy, [a], prompt, **stream_body)
    assert resp.text.count("data: ") == 3 + 1 + 1  # chunks, usage, [DONE]: passed as they came
    ask(proxy, [a], prompt, stream=True)  # no usage in the stream: answered, not reported
    a.behavior.cached_tokens = None
    ask(proxy, [a], "text prompt without cached-token details")
    stats = proxy.routing()
    total = stats["total"]
    assert set(total) == set(COUNTERS) and set(stats["by_reason"]) == set(REASONS)
    assert (total["decisions"], total["answered"], total["reported"]) == (5, 5, 3)
    assert (total["hits"], total["predicted_hits"], total["predicted_and_hit"]) == (3, 2, 2)
    assert total["matched_blocks"] == 3 + 3 and total["predicted_tokens"] == 6 * 4
    assert total["cached_tokens"] == total["cached_tokens_of_token_prompts"] == 24
    assert stats["by_instance"] == {f"127.0.0.1:{a.port}": total}
    assert stats["by_reason"]["prefix_match"]["predicted_and_hit"] == 2
    # /metrics tells the same story, in the catalog's names.
    text = proxy.client.get("/metrics").text
    assert scrape_problems(text, catalog.PROXY) == []
    inst = f"127.0.0.1:{a.port}"
    assert value(text, "kvpool_proxy_routing_decisions_total", outcome="predicted_and_hit") == 2
    assert value(text, "kvpool_proxy_routing_decisions_total", outcome="decided") == 5
    assert value(text, "kvpool_proxy_routed_requests_total", instance=inst, outcome="hit") == 3
    assert value(text, "kvpool_proxy_routed_tokens_total", instance=inst, kind="cached") == 24
    assert value(text, "kvpool_proxy_requests_total", endpoint="completions", code="200") == 5
    assert value(text, "kvpool_proxy_response_seconds_count", endpoint="completions") == 5
    assert value(text, "kvpool_proxy_instance_healthy", role="mixed", instance=inst) == 1
    assert value(text, "kvpool_proxy_upstream_requests_total", role="mixed", instance=inst) == 5
    assert value(text, "kvpool_build_info", component="proxy", version=kvpool.__version__) == 1


def test_admin_routes_in_mixed_mode(make_peer, start_proxy):
    a, b = make_peer("A"), make_peer("B")
    proxy = start_proxy([], [], instances=[a], **ROUTING)
    assert proxy.admin("/instances/add", {"type": "prefill", "host": "127.0.0.1", "port": b.port}).status_code == 400
    resp = proxy.admin("/instances/add", {"type": "mixed", "host": "127.0.0.1", "port": b.port})
    assert resp.status_code == 200 and [i["port"] for i in resp.json()["mixed_instances"]] == [a.port, b.port]
    assert proxy.client.get("/healthcheck").json()["healthy_mixed_instances"] == 2
    forgotten = proxy.routing()["forgotten"]
    assert proxy.admin("/instances/remove", {"type": "mixed", "host": "127.0.0.1", "port": a.port}).status_code == 200
    assert proxy.routing()["forgotten"] == forgotten + 1
    assert [ask(proxy, [a, b], "after removal")[0] for _ in range(2)] == ["B", "B"]
    assert proxy.client.get("/routing").status_code == 401  # admin: the token is needed
    assert proxy.client.get("/v1/models").json()["data"][0]["owned_by"] == "B"
    assert proxy.client.get("/routing", headers=ADMIN_HEADERS).status_code == 200


def test_pd_mode_has_no_routing_counters_and_no_mixed_instances(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    assert proxy.post("/v1/completions", {"model": "m", "prompt": "pd"}).status_code == 200
    assert proxy.post("/v1/completions", {"model": "m", "prompt": 7}).status_code == 400
    text = proxy.client.get("/metrics").text
    assert scrape_problems(text, catalog.PROXY) == []
    for role, peer in (("prefill", p), ("decode", d)):
        assert value(text, "kvpool_proxy_upstream_requests_total", role=role, instance=f"127.0.0.1:{peer.port}") == 1
    assert value(text, "kvpool_proxy_requests_total", code="400") == 1
    assert families(text)["kvpool_proxy_routing_decisions"][1] == []  # PD mode routes by load only
    assert proxy.client.get("/routing", headers=ADMIN_HEADERS).status_code == 404
    resp = proxy.admin("/instances/add", {"type": "mixed", "host": "127.0.0.1", "port": p.port})
    assert resp.status_code == 400 and "PD" in resp.json()["error"]["message"]
    assert set(proxy.client.get("/instances", headers=ADMIN_HEADERS).json()) == {"prefill_instances",
                                                                                  "decode_instances"}
