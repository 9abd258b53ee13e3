"""Requests through the real proxy to test peers: prefill then decode, usage, streaming, 4xx, models."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kvpool.proxy.config import ForwardAuth
from kvpool.testing.proc import expect

COMPLETION = {"model": "test-model", "prompt": "Hello. I have a question. The president of the United States is",
              "max_tokens": 20, "temperature": 0.0}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hello there"}], "max_completion_tokens": 12}


def test_prefill_gets_one_token_then_decode_gets_the_original_request(make_peer, start_proxy):
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p0"}
    p = make_peer("P", kv_transfer_params=kv)
    d = make_peer("D")
    proxy = start_proxy([p], [d], forward_authorization=ForwardAuth.STATIC)
    resp = proxy.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer k", "X-Request-Id": "req-1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("D says t0")  # the decoder's answer
    assert resp.json()["choices"][0]["text"].count(" t") == 20
    (pre,), (dec,) = p.completions(), d.completions()
    assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    assert pre.body["kv_transfer_params"]["do_remote_decode"] is True
    assert pre.body["prompt"] == COMPLETION["prompt"]
    assert dec.body == {**COMPLETION, "kv_transfer_params": kv}  # the original + the prefill's params
    for r in (pre, dec):  # the same request id and credentials on both legs
        assert r.headers["x-request-id"] == "req-1" and r.headers["authorization"] == "Bearer k"
    assert resp.headers["x-request-id"] == "req-1"
    assert resp.headers["x-kvpool-prefiller"] == f"127.0.0.1:{p.port}"
    assert resp.headers["x-kvpool-decoder"] == f"127.0.0.1:{d.port}"


def test_the_clients_kvpool_switches_reach_both_legs_and_nothing_else_of_its_params(make_peer, start_proxy):
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0"}
    p = make_peer("P", kv_transfer_params=kv)
    d = make_peer("D")
    proxy = start_proxy([p], [d])
    switches = {"skip_save": True, "save_decode": False}
    body = {**COMPLETION, "kv_transfer_params": {"kvpool": switches, "remote_engine_id": "forged"}}
    assert proxy.post("/v1/completions", body).status_code == 200
    (pre,), (dec,) = p.completions(), d.completions()
    assert pre.body["kv_transfer_params"]["kvpool"] == switches and pre.body["kv_transfer_params"]["do_remote_decode"]
    assert pre.body["kv_transfer_params"]["remote_engine_id"] is None  # not the client's
    assert dec.body["kv_transfer_params"] == {**kv, "kvpool": switches}  # the prefill's say, and the switches


def test_chat_max_completion_tokens_and_usage_with_the_prefills_cached_tokens(make_peer, start_proxy):
    p = make_peer("P", cached_tokens=32)
    d = make_peer("D", cached_tokens=96)
    proxy = start_proxy([p], [d])
    resp = proxy.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 200, resp.text
    (pre,), (dec,) = p.completions(), d.completions()
    assert pre.body["max_completion_tokens"] == 1 and pre.body["max_tokens"] == 1
    assert dec.body == CHAT  # the prefill answered no kv_transfer_params: nothing added
    data = resp.json()
    assert data["choices"][0]["message"]["content"].startswith("D says")
    assert data["usage"]["completion_tokens"] == 12  # the decoder's usage, passed through
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 32, "decode_cached_tokens": 96}
    assert resp.headers["x-kvpool-prefill-cached-tokens"] == "32"


def test_usage_untouched_when_the_prefill_reports_no_cached_tokens(make_peer, start_proxy):
    p = make_peer("P")
    d = make_peer("D", cached_tokens=7)
    proxy = start_proxy([p], [d])
    data = proxy.post("/v1/completions", COMPLETION).json()
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}


def _sse_events(resp: httpx.Response, on_event) -> list[str]:
    """Read an SSE stream event by event, calling on_event(i, data) as each arrives."""
    events: list[str] = []
    buf = ""
    for text in resp.iter_text():
        buf += text
        while "\n\n" in buf:
            event, buf = buf.split("\n\n", 1)
            assert event.startswith("data: ")
            events.append(event[len("data: "):])
            on_event(len(events) - 1, events[-1])
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_pass_through_chunk_by_chunk(path, make_peer, start_proxy):
    """The decoder sends chunk i+1 only after the client has received chunk i: no buffering."""
    gates = [threading.Event() for _ in range(3)]
    p = make_peer("P", cached_tokens=16)
    d = make_peer("D", stream_chunks=4, chunk_gates=gates, cached_tokens=64)
    proxy = start_proxy([p], [d])
    body = dict(COMPLETION if path == "/v1/completions" else CHAT, stream=True,
                stream_options={"include_usage": True})
    received_at_release: list[int] = []

    def on_event(i: int, data: str) -> None:
        if i < len(gates):
            received_at_release.append(i)
            gates[i].set()  # let the decoder send the next chunk

    with proxy.client.stream("POST", path, json=body, timeout=httpx.Timeout(10, read=5)) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp, on_event)
    assert received_at_release == [0, 1, 2]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    texts = [c["choices"][0].get("text") or c["choices"][0]["delta"]["content"] for c in chunks[:4]]
    assert texts == [f"D-chunk{i} " for i in range(4)]
    usage = chunks[4]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16, "decode_cached_tokens": 64}
    (pre,), (dec,) = p.completions(), d.completions()
    assert pre.body["stream"] is False and "stream_options" not in pre.body and pre.body["max_tokens"] == 1
    assert dec.body["stream"] is True and dec.body["stream_options"] == {"include_usage": True}
    expect(lambda: proxy.instances()[f"decode:{d.port}"]["in_flight"] == 0, what="decode lease released")


def test_upstream_4xx_is_passed_through_without_retry(make_peer, start_proxy):
    p1 = make_peer("P1", reject_prompt="bad")
    p2 = make_peer("P2", reject_prompt="bad")
    d = make_peer("D")
    proxy = start_proxy([p1, p2], [d], max_retries=3)
    resp = proxy.post("/v1/completions", {"model": "test-model", "prompt": "bad", "max_tokens": 5})
    assert resp.status_code == 400
    assert "rejects this prompt" in resp.json()["error"]["message"]
    assert len(p1.completions()) + len(p2.completions()) == 1  # no retry
    assert d.completions() == []  # and no decode
    assert all(i["healthy"] for i in proxy.instances().values())  # a 4xx is not the instance's fault
    # A decoder's 4xx goes back as it is too, for streaming requests as well.
    d.behavior.status = 404
    for stream in (False, True):
        resp = proxy.post("/v1/completions", dict(COMPLETION, stream=stream))
        assert resp.status_code == 404 and "fails with 404" in resp.json()["error"]["message"]
    assert len(d.completions()) == 2


def test_models_from_a_decoder_and_healthcheck(make_peer, start_proxy):
    p = make_peer("P")
    d = make_peer("D")
    proxy = start_proxy([p], [d])
    models = proxy.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["owned_by"] == "D"
    hc = proxy.client.get("/healthcheck")
    assert hc.status_code == 200
    assert hc.json()["status"] == "ok"
    assert proxy.client.get("/health").json() == hc.json()  # the probes' usual name, same answer
    assert hc.json()["prefill_instances"] == 1 and hc.json()["decode_instances"] == 1
    d.stop()  # no decoder left: the probe takes it out, /healthcheck says so
    expect(lambda: proxy.client.get("/healthcheck").status_code == 503, what="healthcheck 503")
    assert proxy.client.get("/healthcheck").json()["healthy_decode_instances"] == 0
    assert proxy.client.get("/health").status_code == 503
    resp = proxy.client.get("/v1/models")  # every instance serves the same model: a prefill one answers
    assert resp.status_code == 200 and resp.json()["data"][0]["owned_by"] == "P"
    # No decoder to load what a prefill would compute: the prefill is not sent at all.
    before = len(p.completions())
    resp = proxy.client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
    assert len(p.completions()) == before
    p.stop()
    expect(lambda: proxy.client.get("/healthcheck").json()["healthy_prefill_instances"] == 0, what="prefill down")
    resp = proxy.client.get("/v1/models")
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "bad_gateway"


def test_bad_request_bodies(make_peer, start_proxy):
    proxy = start_proxy([make_peer("P")], [make_peer("D")])
    resp = proxy.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert proxy.post("/v1/completions", [1, 2]).status_code == 400  # type: ignore[arg-type]
