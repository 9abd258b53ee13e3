"""The controller API of a real `kvpool server` (docs/control.md): every call against the server,
each refused without the admin token, and off without one configured."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvpool.keys import KeyScheme
from kvpool.server.metrics import ADMIN_TOKEN_ENV
from kvpool.testing.metrics import value

TOKEN = "controller-test-token-0123456789"
HASHES = [bytes([i]) * 32 for i in range(4)]


def _keys(scheme_kw: dict, hashes: list[bytes]) -> list[str]:
    return [k for rank in range(2) for group in range(2)
            for k in KeyScheme("m", "fp1", tp_rank=rank, tp_size=2, kv_shards=2, group=group, **scheme_kw).keys(hashes)]


def _call(base: str, route: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(base + route, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def pool(start_server, make_client):
    server = start_server("--metrics_port", "0", env={ADMIN_TOKEN_ENV: TOKEN})
    port = int(server.log().split("metrics http://127.0.0.1:")[1].split()[0])
    client = make_client()
    # Blocks 0 and 1 whole (both TP shards, both groups), block 2 from shard 0 only, and one
    # block of another model.
    keys = _keys({}, HASHES[:2]) + [KeyScheme("m", "fp1", tp_size=2, kv_shards=2, group=g).key(HASHES[2]) for g in (0, 1)]
    keys.append(KeyScheme("other", "fp9").key(HASHES[0]))
    assert client.put(keys, [[np.full(1000, i % 251, np.uint8)] for i in range(len(keys))]) == [0] * len(keys)
    return f"http://127.0.0.1:{port}", keys


def test_usage_and_lookup_per_tier(pool):
    base, keys = pool
    status, usage = _call(base, "/v1/usage")
    assert status == 200
    assert usage["models"]["m"]["memory_objects"] == len(keys) - 1
    assert usage["models"]["other"]["memory_objects"] == 1
    assert usage["total"]["memory_objects"] == len(keys) and usage["total"]["ssd_objects"] == 0
    status, found = _call(base, "/v1/lookup", {"model": "m", "block_hashes": [h.hex() for h in HASHES]})
    assert status == 200
    assert found["blocks"] == 4 and found["hit_blocks"] == 2
    groups = found["layouts"]["fp1"]["groups"]
    assert set(groups) == {"g0", "g1"}
    assert groups["g0"] == {"memory": 2, "ssd": 0, "pool": 2, "present": 2, "pinned": 0}
    # A model the pool never saw: no layouts, no hit.
    assert _call(base, "/v1/lookup", {"model": "nope", "block_hashes": ["00"]})[1]["hit_blocks"] == 0


def test_pin_unpin_and_clear(pool):
    base, keys = pool
    blocks = {"model": "m", "block_hashes": [HASHES[0].hex()]}
    status, pinned = _call(base, "/v1/pin", {**blocks, "ttl_s": 600})
    assert status == 200 and pinned == {"pinned": 4, "absent": 0, "over_pin_share": 0, "failed": 0}
    lookup = _call(base, "/v1/lookup", {"model": "m", "block_hashes": [h.hex() for h in HASHES]})[1]
    assert lookup["layouts"]["fp1"]["groups"]["g1"]["pinned"] == 1
    assert _call(base, "/v1/usage")[1]["models"]["m"]["pinned_objects"] == 4
    assert _call(base, "/v1/unpin", blocks)[1] == {"unpinned": 4, "not_pinned": 0, "failed": 0}
    _call(base, "/v1/pin", {**blocks, "ttl_s": 600})  # clear removes pinned blocks too
    status, cleared = _call(base, "/v1/clear", {"model": "m"})
    assert status == 200 and cleared == {"removed": len(keys) - 1, "busy": 0, "failed": 0}
    assert set(_call(base, "/v1/usage")[1]["models"]) == {"other"}
    assert _call(base, "/v1/clear", {"all": True})[1]["removed"] == 1
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    assert value(metrics, "kvpool_controller_calls_total", op="clear") == 2
    assert value(metrics, "kvpool_pinned_objects") == 0


def test_bad_bodies_are_400s_that_say_why(pool):
    base, _ = pool
    status, answer = _call(base, "/v1/lookup", {"model": "m", "block_hashes": ["not hex"]})
    assert status == 400 and "block_hashes" in answer["error"]
    status, answer = _call(base, "/v1/clear", {})
    assert status == 400 and '"all": true' in answer["error"]
    status, answer = _call(base, "/v1/pin", {"model": "m", "block_hashes": ["00"], "ttl_s": -1})
    assert status == 400 and "ttl_s" in answer["error"]
    assert _call(base, "/v1/nothing", {})[0] == 404


def test_refused_without_the_token_and_off_without_one(pool, start_server, tmp_path):
    base, keys = pool
    for token in (None, "wrong-token-wrong-token"):
        status, answer = _call(base, "/v1/clear", {"all": True}, token=token)
        assert status == 401 and ADMIN_TOKEN_ENV in answer["error"]
    assert _call(base, "/v1/usage")[1]["total"]["memory_objects"] == len(keys)  # nothing was cleared
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    assert value(metrics, "kvpool_controller_refusals_total") == 2

    server = start_server("--metrics_port", "0", socket_path=str(tmp_path / "other.sock"))
    port = int(server.log().split("metrics http://127.0.0.1:")[1].split()[0])
    status, answer = _call(f"http://127.0.0.1:{port}", "/v1/usage")
    assert status == 403 and "controller is off" in answer["error"]


def test_kvpool_ctl_against_the_server(pool, monkeypatch, capsys):
    from kvpool.cli.main import main

    base, keys = pool
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    hashes = ",".join(h.hex() for h in HASHES)
    assert main(["ctl", "--url", base, "lookup", "--model", "m", "--block-hashes", hashes]) == 0
    assert json.loads(capsys.readouterr().out)["hit_blocks"] == 2
    assert main(["ctl", "--url", base, "pin", "--model", "m", "--block-hashes", hashes, "--ttl", "5m"]) == 0
    assert json.loads(capsys.readouterr().out)["pinned"] == 2 * 4 + 2
    assert main(["ctl", "--url", base, "clear", "--all"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == len(keys)
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "wrong-token-wrong-token")
    assert main(["ctl", "--url", base, "usage"]) == 1
    assert "HTTP 401" in capsys.readouterr().err


def test_a_client_pins_through_the_socket(pool, make_client):
    # A request's pin_s reaches the server this way (`ServerBackend.batch_pin`).
    base, keys = pool
    client = make_client(name="pinner")
    assert client.pin(keys[:3] + ["m@never-stored"], 120.0) == [0, 0, 0, -704]
    assert _call(base, "/v1/usage")[1]["total"]["pinned_objects"] == 3
    from kvpool.backends.pool_server import ServerBackend

    backend = ServerBackend(client.socket_path, "pin-backend")
    try:
        assert backend.batch_pin(keys[3:5], 60.0) == [0, 0]
    finally:
        backend.close()
    assert _call(base, "/v1/usage")[1]["total"]["pinned_objects"] == 5


def _tenants_file(tmp_path, mode: int = 0o600) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"a": {"cache_salt": "salt-of-a", "budget": "4MB"},
                                "b": {"cache_salt": "salt-of-b", "budget": "2MB"}}))
    path.chmod(mode)
    return str(path)


def test_a_tenants_flood_leaves_the_other_tenants_blocks(start_server, make_client, tmp_path):
    """The tenants target: while tenant a floods the pool with new prefixes, tenant b keeps its
    blocks within its budget (>= 90%; all of them here), through a real server."""
    from kvpool.keys import tenant_tag

    server = start_server("--memory-size", "12MB", "--metrics_port", "0", "--tenants-file", _tenants_file(tmp_path),
                          env={ADMIN_TOKEN_ENV: TOKEN})
    base = "http://127.0.0.1:" + server.log().split("metrics http://127.0.0.1:")[1].split()[0]
    client = make_client()
    scheme = KeyScheme("m", "fp1")
    block = [np.zeros(32 * 1024, np.uint8)]
    mine = scheme.keys([i.to_bytes(8, "big") for i in range(40)], tenant=tenant_tag("salt-of-b"))  # 1.3 MB
    assert client.put(mine, [block] * len(mine)) == [0] * len(mine)
    for start in range(1000, 1000 + 2000, 100):  # 64 MB of a's new prefixes through 12 MB
        flood = scheme.keys([i.to_bytes(8, "big") for i in range(start, start + 100)], tenant=tenant_tag("salt-of-a"))
        assert set(client.put(flood, [block] * len(flood))) == {0}
    kept = sum(client.exists(mine))
    assert kept >= 0.9 * len(mine), kept
    usage = _call(base, "/v1/usage")[1]["tenants"]
    assert usage["b"]["memory_objects"] == kept and usage["a"]["budget_used_bytes"] <= usage["a"]["budget_bytes"]
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    assert value(metrics, "kvpool_tenant_budget_bytes", tenant="b") == 2 * 1024 * 1024
    assert value(metrics, "kvpool_tenant_evictions_total") > 0
    # Clearing a tenant by name takes its blocks only.
    assert _call(base, "/v1/clear", {"tenant": "b"})[1]["removed"] == kept
    assert sum(client.exists(mine)) == 0 and _call(base, "/v1/usage")[1]["tenants"]["a"]["memory_objects"] > 0
    # A prompt of a tenant is looked up with its salt.
    found = _call(base, "/v1/lookup", {"model": "m", "block_hashes": [(2999).to_bytes(8, "big").hex()],
                                       "cache_salt": "salt-of-a"})[1]
    assert found["hit_blocks"] == 1


def test_a_tenants_file_others_can_read_is_refused(start_server, tmp_path):
    server = start_server("--tenants-file", _tenants_file(tmp_path, 0o644), expect_ready=False)
    assert server.wait() == 2
    assert "tenants_file=" in server.log() and "chmod 600" in server.log()
