"""Load balancing, failures, health, timeouts, client disconnects and instance add/remove."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from proxy_peers import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvpool.testing.proc import expect, free_port

BODY = {"model": "test-model", "prompt": "a shared prefix and a question", "max_tokens": 8}


def _count(peers) -> list[int]:
    return [len(p.completions()) for p in peers]


def test_concurrent_requests_spread_over_the_least_loaded_instances(make_peer, start_proxy):
    gate_p, gate_d = threading.Event(), threading.Event()
    p1, p2 = make_peer("P1", gate=gate_p), make_peer("P2", gate=gate_p)
    d1, d2 = make_peer("D1", gate=gate_d), make_peer("D2", gate=gate_d)
    proxy = start_proxy([p1, p2], [d1, d2])
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(proxy.post, "/v1/completions", BODY) for _ in range(6)]
        expect(lambda: sum(_count([p1, p2])) == 6, what="6 prefills in flight")
        assert _count([p1, p2]) == [3, 3]  # in flight: 3 and 3, never 4 and 2
        inst = proxy.instances()
        assert inst[f"prefill:{p1.port}"]["in_flight"] == 3 and inst[f"prefill:{p2.port}"]["in_flight"] == 3
        gate_p.set()
        expect(lambda: sum(_count([d1, d2])) == 6, what="6 decodes in flight")
        assert _count([d1, d2]) == [3, 3]
        gate_d.set()
        assert all(f.result().status_code == 200 for f in futures)
    assert all(i["in_flight"] == 0 and i["token_load"] == 0 for i in proxy.instances().values())


def test_a_busy_instance_gets_no_new_requests_until_it_is_free(make_peer, start_proxy):
    """Least-loaded, not round-robin: P1 holds one request, so the next five all go to P2."""
    gate = threading.Event()
    p1, p2 = make_peer("P1", gate=gate), make_peer("P2")
    d = make_peer("D")
    proxy = start_proxy([p1, p2], [d])
    with ThreadPoolExecutor(6) as pool:
        held = pool.submit(proxy.post, "/v1/completions", BODY)
        expect(lambda: len(p1.completions()) == 1, what="P1 holding a request")
        for _ in range(5):
            assert proxy.post("/v1/completions", BODY).status_code == 200
        assert _count([p1, p2]) == [1, 5]
        gate.set()
        assert held.result().status_code == 200


def test_connection_refused_is_retried_on_another_prefiller_which_takes_over(make_peer, start_proxy):
    port = free_port()  # a prefiller that is down: nothing listens there
    p_dead = make_peer("P-dead", port=port)
    p_up, d = make_peer("P-up"), make_peer("D")
    # A long probe interval so that requests, not the probe, find the dead instance.
    proxy = start_proxy([p_dead, p_up], [d], health_interval=300, max_retries=1)
    expect(lambda: p_dead.health_probes >= 1, what="the start-up probe")
    p_dead.stop()
    for _ in range(4):
        resp = proxy.post("/v1/completions", BODY)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvpool-prefiller"] == f"127.0.0.1:{p_up.port}"
    inst = proxy.instances()[f"prefill:{port}"]
    assert inst["healthy"] is False and inst["failures"] == 1  # tried once, then out of rotation
    assert "ConnectError" in inst["last_error"]
    assert len(p_up.completions()) == 4 and len(d.completions()) == 4


def test_a_down_instance_leaves_the_rotation_and_rejoins_when_healthy(make_peer, start_proxy):
    port = free_port()
    p_up, d = make_peer("P-up"), make_peer("D")
    proxy = start_proxy([port, p_up], [d])  # the first prefiller is not started yet
    expect(lambda: proxy.instances()[f"prefill:{port}"]["healthy"] is False, what="probe marks it down")
    assert proxy.client.get("/healthcheck").json()["healthy_prefill_instances"] == 1
    for _ in range(3):
        assert proxy.post("/v1/completions", BODY).status_code == 200
    assert proxy.instances()[f"prefill:{port}"]["requests"] == 0  # out of rotation: never tried
    late = make_peer("P-late", port=port)  # it comes up
    expect(lambda: proxy.instances()[f"prefill:{port}"]["healthy"] is True, what="probe re-admits it")
    for _ in range(4):
        assert proxy.post("/v1/completions", BODY).status_code == 200
    assert len(late.completions()) == 2 and len(p_up.completions()) == 5  # back in the rotation


def test_5xx_is_retried_elsewhere_and_when_all_fail_the_client_gets_the_error(make_peer, start_proxy):
    p = make_peer("P")
    d_bad, d_good = make_peer("D-bad", status=500), make_peer("D-good")
    proxy = start_proxy([p], [d_bad, d_good], health_interval=300)
    for _ in range(3):
        resp = proxy.post("/v1/completions", BODY)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"].startswith("D-good")
    assert len(d_bad.completions()) == 1  # failed once, then out of rotation
    assert proxy.instances()[f"decode:{d_bad.port}"]["last_error"] == "HTTP 500"

    # One decoder, always failing: a retry never goes back to it, so after its one attempt its
    # answer goes back.
    d_only = make_peer("D-only", status=503)
    proxy = start_proxy([p], [d_only], max_retries=2)
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 503 and "D-only fails with 503" in resp.json()["error"]["message"]
    assert len(d_only.completions()) == 1


def test_all_prefillers_down_gives_502_quickly(make_peer, start_proxy):
    d = make_peer("D")
    proxy = start_proxy([free_port(), free_port()], [d], max_retries=3)
    t0 = time.monotonic()
    resp = proxy.post("/v1/completions", BODY)
    assert time.monotonic() - t0 < 3
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert err["type"] == "bad_gateway" and "prefill instance" in err["message"]
    assert d.completions() == []


def test_a_silent_instance_times_out_instead_of_hanging(make_peer, start_proxy):
    p, d = make_peer("P", delay=30), make_peer("D")
    proxy = start_proxy([p], [d], timeout=0.5, max_retries=1)
    t0 = time.monotonic()
    resp = proxy.post("/v1/completions", BODY)
    assert time.monotonic() - t0 < 5
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "upstream_timeout"
    assert len(p.completions()) == 1  # tried, timed out; no other prefiller to retry on


def test_client_disconnect_mid_stream_closes_the_upstream_stream(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D", endless=True)
    proxy = start_proxy([p], [d])
    body = dict(BODY, stream=True)
    with proxy.client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()  # kept referenced: dropping it would close the connection already
        assert b"D-chunk0" in next(chunks)
        assert b"D-chunk1" in next(chunks)
        assert proxy.instances()[f"decode:{d.port}"]["in_flight"] == 1
    # Leaving the block closed the connection mid-stream: the decoder must see it.
    assert d.disconnected.wait(5), "the decoder's stream was not cancelled"
    assert d.finished_streams == 0
    expect(lambda: proxy.instances()[f"decode:{d.port}"]["in_flight"] == 0, what="decode lease released")
    assert proxy.instances()[f"decode:{d.port}"]["healthy"] is True  # a client leaving is not a failure


def test_a_stream_that_breaks_off_ends_with_an_error_event(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D", stream_chunks=5, crash_after=2)
    proxy = start_proxy([p], [d], health_interval=300)
    with proxy.client.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as resp:
        assert resp.status_code == 200  # already sent when the stream broke: it cannot change
        events = [e for e in resp.read().decode().split("\n\n") if e]
    # What the decoder sent before it broke off (the peer may lose its last write), then the error.
    assert 1 <= len(events) - 2 <= 2 and all("D-chunk" in e for e in events[:-2])
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "proxy_error" and "stream broken" in error["message"]
    assert events[-1] == "data: [DONE]"
    assert proxy.instances()[f"decode:{d.port}"]["healthy"] is False  # out of rotation until a probe passes
    # The lease is given back just after the last bytes went out: the client may look first.
    expect(lambda: proxy.instances()[f"decode:{d.port}"]["in_flight"] == 0, what="decode lease released")


def test_client_disconnect_during_prefill_cancels_it(make_peer, start_proxy):
    gate = threading.Event()  # the prefill never answers on its own
    p, d = make_peer("P", gate=gate), make_peer("D")
    proxy = start_proxy([p], [d])
    try:
        proxy.post("/v1/completions", BODY, timeout=httpx.Timeout(5, read=0.5))
        raise AssertionError("the request should have timed out")
    except httpx.ReadTimeout:
        pass  # the client gives up and closes its connection
    assert p.disconnected.wait(5), "the prefill request was not cancelled"
    expect(lambda: proxy.instances()[f"prefill:{p.port}"]["in_flight"] == 0, what="prefill lease released")
    assert d.completions() == []


def test_instances_can_be_added_listed_and_removed(make_peer, start_proxy):
    p1, d1 = make_peer("P1"), make_peer("D1")
    p2, d2 = make_peer("P2"), make_peer("D2")
    proxy = start_proxy([p1], [d1])
    resp = proxy.admin("/instances/add", {"type": "prefill", "host": "127.0.0.1", "port": p2.port})
    assert resp.status_code == 200
    assert resp.json()["added"][0]["healthy"] is True  # probed on the spot
    resp = proxy.admin("/instances/add", {"type": "decode", "instances": [f"127.0.0.1:{d2.port}"]})
    assert resp.status_code == 200 and len(resp.json()["decode_instances"]) == 2
    again = proxy.admin("/instances/add", {"type": "decode", "host": "127.0.0.1", "port": d2.port})
    assert again.json()["added"] == [] and again.json()["already_present"] == [f"127.0.0.1:{d2.port}"]
    assert set(proxy.instances()) == {f"prefill:{p1.port}", f"prefill:{p2.port}",
                                      f"decode:{d1.port}", f"decode:{d2.port}"}
    for _ in range(4):
        assert proxy.post("/v1/completions", BODY).status_code == 200
    assert _count([p1, p2, d1, d2]) == [2, 2, 2, 2]

    resp = proxy.admin("/instances/remove", {"type": "prefill", "host": "127.0.0.1", "port": p1.port})
    assert resp.status_code == 200 and resp.json()["removed"] == [f"127.0.0.1:{p1.port}"]
    for _ in range(3):
        assert proxy.post("/v1/completions", BODY).status_code == 200
    assert _count([p1, p2]) == [2, 5]

    # An instance that is not up yet is added out of rotation and joins when it answers /health.
    port = free_port()
    resp = proxy.admin("/instances/add", {"type": "decoder", "host": "127.0.0.1", "port": port})
    assert resp.status_code == 200 and resp.json()["added"][0]["healthy"] is False
    make_peer("D3", port=port)
    expect(lambda: proxy.instances()[f"decode:{port}"]["healthy"] is True, what="the new decoder joins")

    assert proxy.admin("/instances/remove", {"type": "prefill", "host": "127.0.0.1", "port": 1}).status_code == 404
    for bad in ({"type": "middle", "host": "h", "port": 1}, {"type": "prefill", "host": "h", "port": "x"},
                {"type": "prefill"}, {"type": "decode", "instances": ["no-port"]}):
        resp = proxy.admin("/instances/add", bad)
        assert resp.status_code == 400, bad
        assert resp.json()["error"]["type"] == "invalid_request_error"
    # No prefiller left: requests get a clear 503.
    proxy.admin("/instances/remove", {"type": "prefill", "host": "127.0.0.1", "port": p2.port})
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 503 and "no prefill instance" in resp.json()["error"]["message"]


def test_a_slow_health_probe_takes_an_instance_out_only_after_several_in_a_row():
    import asyncio

    from kvpool.proxy.config import Endpoint
    from kvpool.proxy.health import HealthChecker
    from kvpool.proxy.registry import Registry, Role

    answers: list[object] = []  # what each probe meets: an HTTP status or an exception to raise

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer)

    registry = Registry(instances=[Endpoint("127.0.0.1", 9)])
    (inst,) = registry.instances(Role.MIXED)

    async def probes(*outcomes: object) -> list[bool]:
        answers.extend(outcomes)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(registry, client, interval=1, timeout=0.1, timeouts_allowed=3)
            return [await checker.probe(inst) for _ in outcomes]

    slow = httpx.ReadTimeout("slow")
    # Two timeouts, an answer (the count starts again), two more: in rotation throughout.
    assert asyncio.run(probes(slow, slow, 200, slow, slow)) == [True] * 5
    assert inst.healthy and inst.failures == 0 and inst.probe_timeouts == 2
    # The third in a row takes it out; it stays out while probes time out, and one 200 brings it back.
    assert asyncio.run(probes(slow, httpx.ConnectTimeout("slow"))) == [False, False]
    assert not inst.healthy and inst.failures == 1 and "4 time(s) in a row" in inst.last_error
    assert asyncio.run(probes(200)) == [True] and inst.healthy and inst.probe_timeouts == 0
    # A refused connection or an error status is an answer: out at the first one.
    assert asyncio.run(probes(httpx.ConnectError("refused"))) == [False] and not inst.healthy
    assert asyncio.run(probes(200, 503)) == [True, False] and not inst.healthy and inst.failures == 3


def _broken_5xx_app() -> Starlette:
    """An instance whose 5xx answer breaks off mid-body (it crashed while answering)."""

    async def completion(request: Request) -> Response:
        async def body() -> Any:
            yield b'{"error": {"message": "half an err'
            raise RuntimeError("the instance dies mid-answer (planned)")

        return StreamingResponse(body(), status_code=500, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", completion, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


def test_a_5xx_stream_that_breaks_off_is_a_502_not_a_500(make_peer, start_proxy):
    server = ServerThread(_broken_5xx_app()).start()
    try:
        m = server.port
        proxy = start_proxy([], [], [m], health_interval=300)
        with proxy.client.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as resp:
            resp.read()
        assert resp.status_code == 502, resp.text
        assert resp.json()["error"]["type"] == "bad_gateway"
        expect(lambda: proxy.instances()[f"mixed:{m}"]["in_flight"] == 0, what="lease released")
    finally:
        server.stop()


def test_requests_that_fail_together_spread_their_retries_by_load(make_peer, start_proxy):
    """Each retry is placed with the loads of the retries placed before it, not before any of them."""
    gate_x, gate_ab = threading.Event(), threading.Event()
    x = make_peer("X", gate=gate_x, status=500)
    a, b = make_peer("A", gate=gate_ab), make_peer("B", gate=gate_ab)
    d = make_peer("D")
    # A retry delay long enough that both failures are back before either retry is sent.
    proxy = start_proxy([x, a, b], [d], retry_delay=1.0, health_interval=300)
    with ThreadPoolExecutor(5) as pool:
        futures = []
        for n in range(1, 6):  # one at a time, so least-loaded places them X, A, B, X, A
            futures.append(pool.submit(proxy.post, "/v1/completions", BODY))
            expect(lambda n=n: sum(_count([x, a, b])) == n, what=f"prefill {n} in flight")
        assert _count([x, a, b]) == [2, 2, 1]
        gate_x.set()  # X fails both of its requests at once
        expect(lambda: sum(_count([a, b])) == 5, what="both retries in flight")
        # B (1 in flight) takes the first retry; then A and B hold 2 each and A takes the second.
        assert _count([a, b]) == [3, 2]
        gate_ab.set()
        assert [f.result().status_code for f in futures] == [200] * 5
    assert all(i["in_flight"] == 0 for i in proxy.instances().values())


def _mid_event_break_app() -> Starlette:
    """An instance whose stream breaks off in the middle of an event (it crashed mid-write);
    its non-streaming answers (a PD prefill) are whole."""

    async def completion(request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):
            return Response(json.dumps({"id": "p", "choices": [{"index": 0, "text": "x"}]}),
                            media_type="application/json")

        async def events() -> Any:
            yield b'data: {"id": "s", "choices": [{"index": 0, "text": "whole"}]}\n\n'
            yield b'data: {"id": "s", "choices": [{"index": 0, "text": "hal'
            await asyncio.sleep(0.2)  # the half event reaches the proxy before the connection drops
            raise RuntimeError("the instance dies mid-event (planned)")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", completion, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


@pytest.mark.parametrize("mode", ["mixed", "pd"])
def test_a_stream_that_breaks_off_mid_event_still_ends_with_a_readable_error_event(mode, make_peer, start_proxy):
    server = ServerThread(_mid_event_break_app()).start()
    try:
        port = server.port
        proxy = (start_proxy([], [], [port], health_interval=300) if mode == "mixed"
                 else start_proxy([port], [port], health_interval=300))
        with proxy.client.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as resp:
            assert resp.status_code == 200
            events = [e for e in resp.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].strip()[len("data: "):])["error"]
        assert error["type"] == "proxy_error" and "stream broken" in error["message"]
        assert "whole" in events[0]
    finally:
        server.stop()
