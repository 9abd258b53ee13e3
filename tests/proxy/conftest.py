"""Fixtures for the proxy tests: test peers (stand-in vLLM instances) and the real proxy, in-process.

The proxy under test is `kvpool.proxy.app.create_app` served by uvicorn on a free 127.0.0.1
port, exactly as `kvpool proxy` serves it; the clients are plain httpx over TCP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from proxy_peers import Peer, PeerBehavior, ServerThread

from kvpool.proxy.app import create_app, server_options
from kvpool.proxy.config import Endpoint, ProxyConfig

# The admin token the test proxies run with (as if from KVPOOL_PROXY_ADMIN_TOKEN).
ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# Fast settings for tests: short probe interval and retry delay, bounded waits.
TEST_DEFAULTS: dict[str, Any] = dict(max_retries=2, retry_delay=0.01, health_interval=0.2,
                                     connect_timeout=2.0, timeout=10.0, log_level="WARNING",
                                     admin_token=ADMIN_TOKEN)


class ProxyHandle:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.app = create_app(config)
        # Served as `kvpool proxy` serves it: through kvpool.proxy.guard's connection caps and deadline.
        self.server = ServerThread(self.app, config.port, **server_options(config)).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)

    @property
    def state(self) -> Any:
        return self.app.state.proxy

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def admin(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST to an admin route with the test token."""
        return self.client.post(path, json=body, headers=ADMIN_HEADERS)

    def routing(self) -> dict[str, Any]:
        """GET /routing (mixed mode's routing counters)."""
        resp = self.client.get("/routing", headers=ADMIN_HEADERS)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def instances(self) -> dict[str, dict[str, Any]]:
        """GET /instances, keyed by "prefill:PORT" / "decode:PORT" / "mixed:PORT"."""
        snap = self.client.get("/instances", headers=ADMIN_HEADERS).json()
        return {f"{i['type']}:{i['port']}": i for role in snap.values() for i in role}

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def _endpoints(items: list[Peer | int]) -> tuple[Endpoint, ...]:
    return tuple(Endpoint("127.0.0.1", p.port if isinstance(p, Peer) else p) for p in items)


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def factory(name: str, port: int = 0, **behavior: Any) -> Peer:
        peer = Peer(name, PeerBehavior(**behavior), port=port).start()
        peers.append(peer)
        return peer

    yield factory
    for peer in peers:
        if peer.behavior.gate is not None:
            peer.behavior.gate.set()
        for gate in peer.behavior.chunk_gates or []:
            gate.set()
        peer.server.request_stop()
    for peer in peers:
        peer.stop()


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., ProxyHandle]]:
    proxies: list[ProxyHandle] = []

    def factory(prefill: list[Peer | int], decode: list[Peer | int], instances: list[Peer | int] = (),
                **overrides: Any) -> ProxyHandle:
        """A PD proxy, or with ``instances`` (and no prefill/decode) a PD-mixed one."""
        settings = {**TEST_DEFAULTS, **overrides}
        config = ProxyConfig(host="127.0.0.1", port=0, prefillers=_endpoints(prefill),
                             decoders=_endpoints(decode), instances=_endpoints(list(instances)), **settings)
        handle = ProxyHandle(config)
        proxies.append(handle)
        return handle

    yield factory
    for handle in proxies:
        handle.client.close()
        handle.server.request_stop()
    for handle in proxies:
        handle.stop()
