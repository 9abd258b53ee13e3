"""Attacks on the real proxy, and what it must do about them.

Each test runs the attack against a proxy served over TCP with test peers behind it, and
asserts the outcome: the status code, which peer got the request, and the headers peers saw.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import httpx
import pytest
from conftest import ADMIN_HEADERS, ADMIN_TOKEN

from kvpool.errors import ConfigError
from kvpool.proxy.config import ADMIN_TOKEN_ENV, ForwardAuth, add_arguments, config_from_args
from kvpool.proxy.intake import MAX_JSON_DEPTH
from kvpool.proxy.registry import Role
from kvpool.testing.launch import ProxyServer
from kvpool.testing.proc import expect, free_port

BODY = {"model": "test-model", "prompt": "the secret prompt", "max_tokens": 4}


def _parse(argv: list[str], env: dict[str, str]):
    """The proxy's config from `argv`; where it names no role at all, one PD-mixed instance
    (a proxy with nothing to route to does not start)."""
    if not any(a.endswith("-hosts") for a in argv) and ADMIN_TOKEN_ENV not in env:
        argv = [*argv, "--instance-hosts", "localhost", "--instance-ports", "8100"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), env=env)


def _raw(port: int, head: bytes, parts: list[bytes]) -> tuple[int, dict]:
    """Send a request by hand (head, then body parts) and read the answer's status and JSON body.

    The body may be cut short on purpose: the proxy must answer without waiting for the rest.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the proxy answered and closed: what comes next is its answer
                break
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head_text, _, body = data.partition(b"\r\n\r\n")
    return int(head_text.split(b" ", 2)[1]), json.loads(body[:_length(data)])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


# ---------------------------------------------------------------- admin routes

def test_admin_routes_are_disabled_without_a_token_and_say_how_to_enable_them(make_peer, start_proxy):
    p, d, evil = make_peer("P"), make_peer("D"), make_peer("EVIL")
    proxy = start_proxy([p], [d], admin_token=None)  # instances from the command line: no token needed
    for path in ("/instances/add", "/instances/remove"):
        resp = proxy.post(path, {"type": "decode", "host": "127.0.0.1", "port": evil.port})
        assert resp.status_code == 403
        assert ADMIN_TOKEN_ENV in resp.json()["error"]["message"]
        # Even the right-looking header does not open a route that is disabled.
        assert proxy.post(path, {"type": "decode", "host": "127.0.0.1", "port": evil.port},
                          headers=ADMIN_HEADERS).status_code == 403
    assert proxy.client.get("/instances").status_code == 403
    for _ in range(3):
        resp = proxy.post("/v1/completions", BODY)
        assert resp.status_code == 200 and resp.headers["x-kvpool-decoder"] == f"127.0.0.1:{d.port}"
    assert evil.received == [] and len(d.completions()) == 3
    assert [i.key for i in proxy.state.registry.all()] == [f"127.0.0.1:{p.port}", f"127.0.0.1:{d.port}"]


WRONG_AUTH = [None, "Bearer wrong-token-0123456789", f"Basic {ADMIN_TOKEN}", ADMIN_TOKEN, f"Bearer {ADMIN_TOKEN}x",
              "Bearer", f"Bearer {ADMIN_TOKEN[:-1]}"]


def test_admin_routes_refuse_a_missing_or_wrong_token(make_peer, start_proxy):
    p, d, evil = make_peer("P"), make_peer("D"), make_peer("EVIL")
    proxy = start_proxy([p], [d])
    for auth in WRONG_AUTH:
        headers = {} if auth is None else {"Authorization": auth}
        resp = proxy.client.post("/instances/add", json={"type": "decode", "host": "127.0.0.1", "port": evil.port},
                                 headers=headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", auth
        assert resp.json()["error"]["type"] == "authentication_error"
        resp = proxy.client.post("/instances/remove", json={"type": "decode", "host": "127.0.0.1", "port": d.port},
                                 headers=headers)
        assert resp.status_code == 401, auth
        assert proxy.client.get("/instances", headers=headers).status_code == 401, auth
    assert proxy.post("/v1/completions", BODY).headers["x-kvpool-decoder"] == f"127.0.0.1:{d.port}"
    assert evil.received == [] and evil.health_probes == 0  # never even probed
    assert len(proxy.state.registry.all()) == 2


def test_the_right_token_opens_the_admin_routes(make_peer, start_proxy):
    p, d, d2 = make_peer("P"), make_peer("D"), make_peer("D2")
    proxy = start_proxy([p], [d])
    resp = proxy.client.post("/instances/add", json={"type": "decode", "host": "127.0.0.1", "port": d2.port},
                             headers={"Authorization": f"bearer  {ADMIN_TOKEN}"})  # scheme is case-insensitive
    assert resp.status_code == 200 and resp.json()["added"][0]["added_at_runtime"] is True
    assert proxy.client.get("/instances", headers=ADMIN_HEADERS).status_code == 200


def test_the_token_comes_from_the_environment_and_a_weak_one_is_refused():
    argv = ["--prefiller-hosts", "localhost", "--prefiller-ports", "8100", "--decoder-hosts", "localhost",
            "--decoder-ports", "8200"]
    assert _parse(argv, {}).admin_token is None
    assert _parse(argv, {ADMIN_TOKEN_ENV: ""}).admin_token is None
    cfg = _parse(argv, {ADMIN_TOKEN_ENV: ADMIN_TOKEN})
    assert cfg.admin_token == ADMIN_TOKEN and ADMIN_TOKEN not in repr(cfg)  # never printed with the config
    for weak in ("short", "with a space inside it", "tab\tinside-0123456789"):
        with pytest.raises(ConfigError) as err:
            _parse(argv, {ADMIN_TOKEN_ENV: weak})
        assert err.value.key == ADMIN_TOKEN_ENV and weak not in str(err.value)  # the secret is not echoed


# ---------------------------------------------------------------- hosts and ports

BAD_HOSTS = ["evil.example/x", "http://127.0.0.1", "h?x=1", "h#frag", "user@127.0.0.1", "127.0.0.1 ", " h",
             "h\tx", "", "[1.2.3.4]", "[not-ip]", "fe80::1%eth0", "h:8100", "a..b", "h-.x", "h" * 64, 5, None]


BAD_ENTRIES = [{"host": "127.0.0.1", "port": "8200"}, {"host": "127.0.0.1", "port": 0},
               {"host": "127.0.0.1", "port": 65536}, {"host": "127.0.0.1", "port": True},
               {"host": "127.0.0.1", "port": 8200.0}, {"host": "127.0.0.1", "port": -1},
               {"instances": ["127.0.0.1:+80"]}, {"instances": ["127.0.0.1:8_0"]},
               {"instances": ["127.0.0.1: 80"]}, {"instances": ["::1:8200"]},
               {"instances": ["127.0.0.1/x:80"]}, {"instances": ["h:80"] * 257}]


def test_bad_hosts_ports_and_entries_are_refused_by_the_admin_api_and_the_command_line(make_peer, start_proxy):
    proxy = start_proxy([make_peer("P")], [make_peer("D")])
    for host in BAD_HOSTS:
        resp = proxy.admin("/instances/add", {"type": "decode", "host": host, "port": 8200})
        assert resp.status_code == 400 and "host name or IP address" in resp.json()["error"]["message"], host
        if isinstance(host, str):
            with pytest.raises(ConfigError):
                _parse(["--decoder-hosts", host, "--decoder-ports", "8200"], {})
    for entry in BAD_ENTRIES:
        resp = proxy.admin("/instances/add", {"type": "decode", **entry})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", entry
    assert len(proxy.state.registry.all()) == 2


def test_good_hosts_are_accepted():
    cfg = _parse(["--prefiller-hosts", "localhost", "node-1.cluster.local", "10.0.0.7", "[::1]", "fe80::2",
                  "--prefiller-ports", "8100", "8101", "8102", "8103", "8104", "--decoder-hosts", "localhost",
                  "--decoder-ports", "8200"], {})
    assert [e.key for e in cfg.prefillers] == ["localhost:8100", "node-1.cluster.local:8101", "10.0.0.7:8102",
                                               "[::1]:8103", "[fe80::2]:8104"]
    for port in ("0", "65536", "+1", " 1", "1e3"):
        with pytest.raises(ConfigError):
            _parse(["--prefiller-hosts", "h", "--prefiller-ports", port], {})


# ---------------------------------------------------------------- body size

def test_a_content_length_over_the_limit_is_refused_before_the_body_is_read(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], max_body_bytes=4096)
    # 200 MiB announced, a few bytes sent: the proxy answers without waiting for (or reading) the rest.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {200 << 20}\r\n\r\n").encode()
    status, body = _raw(proxy.server.port, head, [b'{"prompt": "' + b"a" * 100])
    assert status == 413 and "--max-body-bytes" in body["error"]["message"]
    for path in ("/instances/add", "/instances/remove"):  # the admin routes too
        admin_head = head.replace(b"/v1/completions", path.encode()).replace(
            b"Host: x\r\n", f"Host: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n".encode())
        assert _raw(proxy.server.port, admin_head, [b"{"])[0] == 413
    assert p.received == [] and d.received == []


def test_a_chunked_body_is_counted_as_it_arrives(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], max_body_bytes=4096)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 3000
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    # Two chunks pass the limit; the terminating chunk is never sent, so only counting can tell.
    status, body = _raw(proxy.server.port, head, [framed, framed])
    assert status == 413
    assert p.received == [] and d.received == []


def test_a_body_within_the_limit_is_served(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], max_body_bytes=4096)
    body = dict(BODY, prompt="x" * 3500)
    assert proxy.post("/v1/completions", body).status_code == 200
    assert proxy.post("/v1/completions", dict(BODY, prompt="x" * 5000)).status_code == 413
    assert len(p.completions()) == 1 and len(d.completions()) == 1


def test_the_limit_is_a_flag_with_a_generous_default():
    assert _parse([], {}).max_body_bytes == 16 << 20
    assert _parse(["--max-body-bytes", "65536"], {}).max_body_bytes == 65536
    with pytest.raises(ConfigError):
        _parse(["--max-body-bytes", "10"], {})


# ---------------------------------------------------------------- retries

def test_a_retry_never_goes_back_to_the_instance_that_timed_out(make_peer, start_proxy):
    hung, good, d = make_peer("P-hung", delay=30), make_peer("P-good"), make_peer("D")
    proxy = start_proxy([hung, good], [d], timeout=0.5, max_retries=3, health_interval=300)
    for _ in range(2):
        resp = proxy.post("/v1/completions", BODY)
        assert resp.status_code == 200 and resp.headers["x-kvpool-prefiller"] == f"127.0.0.1:{good.port}"
    assert len(hung.completions()) <= 1  # at most the first request tried it; never twice


def test_every_instance_hung_fails_after_one_timeout_each(make_peer, start_proxy):
    p1, p2, d = make_peer("P1", delay=30), make_peer("P2", delay=30), make_peer("D")
    proxy = start_proxy([p1, p2], [d], timeout=0.5, max_retries=5, health_interval=300)
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "upstream_timeout"
    assert len(p1.completions()) == 1 and len(p2.completions()) == 1  # 2 timeouts, not 6
    assert d.received == []


def test_failing_decoders_are_each_tried_once(make_peer, start_proxy):
    p = make_peer("P")
    ds = [make_peer(f"D{i}", status=500) for i in range(3)]
    proxy = start_proxy([p], ds, max_retries=10, health_interval=300)
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 500  # the last instance's own answer
    assert [len(x.completions()) for x in ds] == [1, 1, 1]
    # Connection refused everywhere: 502, and no instance tried twice (the start-up probe may
    # already have taken both out of rotation, leaving one last-resort attempt).
    proxy = start_proxy([free_port(), free_port()], [make_peer("D")], max_retries=10, health_interval=300)
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "bad_gateway"
    tries = [i.requests for i in proxy.state.registry.instances(Role.PREFILL)]
    assert 1 <= sum(tries) <= 2 and max(tries) == 1


# ---------------------------------------------------------------- bad JSON

def _nested(depth: int) -> bytes:
    """A completion body whose deepest value sits inside ``depth`` arrays/objects (the body's own included)."""
    return b'{"model": "m", "prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


BAD_BODIES = [
    b'{"model": "m", "prompt": "x", "temperature": NaN}',
    b'{"model": "m", "prompt": "x", "temperature": Infinity}',
    b'{"model": "m", "prompt": "x", "temperature": -Infinity}',
    _nested(MAX_JSON_DEPTH + 1),
    b'{"p": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"[" * 500_000,
    b"[]", b'"a string"', b"42", b"null", b"true",
    b'{"prompt": "x", "stream": "false"}',
    b'{"prompt": "x", "stream": 1}',
    b'{"prompt": "x", "max_tokens": "5"}',
    b'{"prompt": "x", "max_tokens": 5.5}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "max_tokens": true}',
    b'{"prompt": "x", "n": "2"}',
    b'{"prompt": "x", "stream_options": []}',
    b'{"prompt": 5}',
    b'{"messages": {"role": "user"}}',
    b'{"prompt": "x", "kv_transfer_params": "remote"}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\xff\xfe"}',
    b"",
    b"{not json",
]


def test_bad_json_is_a_400_with_a_message_never_a_500(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    for raw in BAD_BODIES:
        for path in ("/v1/completions", "/v1/chat/completions"):
            resp = proxy.client.post(path, content=raw, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (raw[:60], resp.text)
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"]
        resp = proxy.client.post("/instances/add", content=raw, headers={"content-type": "application/json",
                                                                         **ADMIN_HEADERS})
        assert resp.status_code == 400, raw[:60]
    assert p.received == [] and d.received == []
    assert proxy.post("/v1/completions", BODY).status_code == 200  # and the proxy still serves


@pytest.mark.parametrize("number", [b"1e400", b"-1e400"])
def test_a_number_past_a_doubles_range_is_a_400_in_both_modes(number, make_peer, start_proxy):
    # Python's json reads 1e400 as inf, which no JSON encoder (httpx's, Starlette's) writes back.
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 4, "temperature": ' + number + b"}"
    p, d, m = make_peer("P"), make_peer("D"), make_peer("M")
    for proxy, peers in ((start_proxy([p], [d]), (p, d)), (start_proxy([], [], [m]), (m,))):
        resp = proxy.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and number.decode() in err["message"]
        assert all(peer.received == [] for peer in peers)
        assert all(i["in_flight"] == 0 for i in proxy.instances().values())
        assert proxy.post("/v1/completions", BODY).status_code == 200  # and the proxy still serves


def test_nesting_up_to_the_limit_passes(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    resp = proxy.client.post("/v1/completions", content=_nested(MAX_JSON_DEPTH),
                             headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert len(d.completions()) == 1


def test_a_prefill_answer_with_bad_json_is_a_502(make_peer, start_proxy):
    p, d = make_peer("P", kv_transfer_params={"x": 1}), make_peer("D")
    proxy = start_proxy([p], [d])
    p.behavior.kv_transfer_params = "not an object"  # type: ignore[assignment]
    resp = proxy.post("/v1/completions", BODY)
    assert resp.status_code == 502 and "kv_transfer_params" in resp.json()["error"]["message"]
    assert d.received == []


# ---------------------------------------------------------------- credentials and transfer params

def _auth_seen(peer) -> list[str | None]:
    return [r.headers.get("authorization") for r in peer.completions()]


def test_the_clients_authorization_is_not_forwarded_by_default(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    assert proxy.post("/v1/completions", BODY, headers={"Authorization": "Bearer client-key"}).status_code == 200
    assert proxy.client.get("/v1/models", headers={"Authorization": "Bearer client-key"}).status_code == 200
    assert _auth_seen(p) == [None] and _auth_seen(d) == [None]
    assert all("authorization" not in r.headers for r in d.received)  # /v1/models too


@pytest.mark.parametrize(("mode", "to_added"), [(ForwardAuth.STATIC, None), (ForwardAuth.ALL, "Bearer client-key")])
def test_an_instance_added_at_runtime_gets_the_clients_authorization_only_with_all(mode, to_added, make_peer,
                                                                                   start_proxy):
    """The reported attack: an added "decode instance" got a client's prompt and its credentials."""
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], forward_authorization=mode)
    assert proxy.post("/v1/completions", BODY, headers={"Authorization": "Bearer client-key"}).status_code == 200
    assert _auth_seen(d) == ["Bearer client-key"]  # given on the command line: forwarded in both modes
    added = make_peer("ADDED")
    assert proxy.admin("/instances/add", {"type": "decode", "host": "127.0.0.1", "port": added.port}).status_code == 200
    proxy.admin("/instances/remove", {"type": "decode", "host": "127.0.0.1", "port": d.port})
    resp = proxy.post("/v1/completions", BODY, headers={"Authorization": "Bearer client-key"})
    assert resp.status_code == 200 and resp.headers["x-kvpool-decoder"] == f"127.0.0.1:{added.port}"
    assert _auth_seen(added) == [to_added]


def test_a_clients_own_kv_transfer_params_never_reach_the_decoder(make_peer, start_proxy):
    kv = {"remote_host": "10.0.0.5", "remote_port": 5600}
    p, d = make_peer("P"), make_peer("D")  # the prefill answers no kv_transfer_params
    proxy = start_proxy([p], [d])
    evil = {"remote_host": "attacker.example", "remote_port": 1, "do_remote_prefill": True}
    assert proxy.post("/v1/completions", dict(BODY, kv_transfer_params=evil)).status_code == 200
    assert "kv_transfer_params" not in d.completions()[0].body
    assert p.completions()[0].body["kv_transfer_params"]["do_remote_decode"] is True  # the proxy's own
    p.behavior.kv_transfer_params = kv  # now it does: the decoder gets exactly the prefill's
    assert proxy.post("/v1/completions", dict(BODY, kv_transfer_params=evil)).status_code == 200
    assert d.completions()[1].body["kv_transfer_params"] == kv
    expect(lambda: all(i.in_flight == 0 for i in proxy.state.registry.all()), what="leases released")


def test_kvpool_proxy_reads_the_token_from_its_environment(make_peer, tmp_path):
    """The command as run: no variable, admin routes off; with it, the token opens them."""
    p, d, d2 = make_peer("P"), make_peer("D"), make_peer("D2")
    add = {"type": "decode", "host": "127.0.0.1", "port": d2.port}
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    for token, expected in ((None, (403, 403)), (ADMIN_TOKEN, (401, 200))):
        run_env = env if token is None else {**env, ADMIN_TOKEN_ENV: token}
        proxy = ProxyServer([p.port], [d.port], env=run_env, extra_args=["--log-level", "warning"],
                            log_path=tmp_path / f"proxy-{expected[0]}.log", startup_timeout_s=20)
        with proxy, httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=10) as client:
            assert client.post("/instances/add", json=add).status_code == expected[0]
            assert client.post("/instances/add", json=add, headers=ADMIN_HEADERS).status_code == expected[1]
            assert client.post("/v1/completions", json=BODY).status_code == 200  # command-line instances serve
        assert ADMIN_TOKEN not in proxy.log()


def test_a_non_ascii_request_id_is_not_a_500(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    resp = proxy.post("/v1/completions", BODY, headers={"x-request-id": "caf\xe9".encode("latin-1")})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("D says")
    # Passed on as the client sent it (the peers decode header bytes as latin-1).
    assert [r.headers["x-request-id"] for r in p.completions() + d.completions()] == ["caf\xe9"] * 2
    assert all(i["in_flight"] == 0 for i in proxy.instances().values())


def test_a_non_ascii_request_id_in_mixed_mode_is_not_a_500(make_peer, start_proxy):
    m = make_peer("M")
    proxy = start_proxy([], [], [m], forward_authorization=ForwardAuth.ALL)
    headers = {"x-request-id": "caf\xe9".encode("latin-1"), "authorization": "Bearer s\xe9cret".encode("latin-1")}
    resp = proxy.post("/v1/completions", BODY, headers=headers)
    assert resp.status_code == 200, resp.text
    (seen,) = m.completions()
    assert seen.headers["authorization"] == "Bearer s\xe9cret"


# ---------------------------------------------------------------- memory and slow clients

def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_bodies_that_would_parse_into_millions_of_objects_are_refused_unparsed(make_peer, start_proxy):
    """16 MiB of `[{},{},...]` is 5.6 million dicts (800 MiB) once parsed: four at once would take
    the proxy past 2 GiB. What a body would build is charged to the body budget before it is
    parsed, so these are 503s, and the proxy (this process: it is served in-process) stays small."""
    import concurrent.futures

    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d])
    body = b'{"prompt": "x", "junk": [' + b"{}," * (5_500_000) + b"{}]}"
    assert len(body) < proxy.config.max_body_bytes
    before = _rss()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{proxy.url}/v1/completions", content=body, timeout=60,
                                                    headers={"Content-Type": "application/json"},
                                                    trust_env=False).status_code, range(4)))
    assert codes == [503] * 4
    assert _rss() - before < 256 << 20
    assert proxy.state.bodies.used == 0 and proxy.state.bodies.refused == 4
    assert p.received == [] and proxy.post("/v1/completions", BODY).status_code == 200  # still serving
    assert proxy.state.bodies.used == 0  # an answered request gives its share back


def test_the_body_budget_is_a_flag_at_least_four_bodies_large():
    assert _parse([], {}).body_budget_bytes == 512 << 20
    with pytest.raises(ConfigError) as exc:
        _parse(["--max-body-bytes", "1048576", "--body-budget-bytes", "1048576"], {})
    assert exc.value.key == "--body-budget-bytes"


def test_a_request_whose_headers_never_finish_gets_a_408_and_is_closed(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], request_timeout=0.5)
    with socket.create_connection(("127.0.0.1", proxy.server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answer = b""
        while chunk := sock.recv(65536):  # the proxy closes after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"--request-timeout" in answer
    assert proxy.post("/v1/completions", BODY).status_code == 200


def test_a_body_that_never_finishes_gets_a_408(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], request_timeout=0.5)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    status, answer = _raw(proxy.server.port, head, [b'{"prompt": "x"'])
    assert status == 408 and "--request-timeout" in answer["error"]["message"]
    assert p.received == [] and proxy.state.bodies.used == 0


def test_one_client_cannot_take_every_connection(make_peer, start_proxy):
    p, d = make_peer("P"), make_peer("D")
    proxy = start_proxy([p], [d], max_client_connections=3, request_timeout=30)
    held = [socket.create_connection(("127.0.0.1", proxy.server.port), timeout=10) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", proxy.server.port), timeout=10) as extra:
            answer = extra.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-client-connections" in answer
    finally:
        for s in held:
            s.close()
    expect(lambda: proxy.post("/v1/completions", BODY).status_code == 200, "the proxy serving again")
