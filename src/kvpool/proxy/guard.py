"""What a client may cost the proxy: connections, time to send a request, memory for bodies.

- **Connections**: at most ``max_connections`` in all and ``max_client_connections`` from one
  client address; one more is answered 503 and closed at once (uvicorn would count it only once
  its request line arrived, and a client that never sends one would hold it, and its socket,
  for ever).
- **Time**: a request's line and headers must arrive within ``request_timeout_s`` of the
  connection (or of the previous response, on a kept-alive connection), and its body within
  ``request_timeout_s`` of its headers (`intake.read_body`); past it a 408 and the connection
  is closed. Bytes trickling in do not extend either.
- **Memory**: every body in the proxy is charged to one `BodyBudget` while its request is
  served: its bytes as they arrive, and once parsed, a bound of what its JSON tree holds
  (`intake.tree_cost`). A request that would pass the budget is answered 503 (retry later).

So the proxy's memory is bounded by ``max_connections`` x h11's 16 KiB header buffer, plus the
budget, plus its own code, whatever clients send (docs/security.md, `kvpool proxy`).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_CLOSE = b"Connection: close\r\nContent-Type: application/json\r\n"


def _plain(status: str, message: str) -> bytes:
    body = ('{"error": {"message": "%s", "type": "invalid_request_error"}}' % message).encode()
    return b"HTTP/1.1 " + status.encode() + b"\r\n" + _CLOSE + b"Content-Length: %d\r\n\r\n" % len(body) + body


class BodyBudget:
    """Bytes all requests' bodies (and their parsed trees) may hold together. Used from the event
    loop's thread only, so it needs no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refused += 1
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def guarded_protocol(max_connections: int, max_client_connections: int, request_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection caps and the header deadline above."""
    per_client: collections.Counter[str] = collections.Counter()
    open_connections = [0]

    class Guarded(H11Protocol):
        _counted = False
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._host = self.client[0] if self.client else ""
            if open_connections[0] >= max_connections:
                return self._refuse("503 Service Unavailable", f"the proxy holds {max_connections} connections "
                                    "(--max-connections); retry later")
            if per_client[self._host] >= max_client_connections:
                return self._refuse("503 Service Unavailable", f"{max_client_connections} connections from this "
                                    "client are open (--max-client-connections); reuse them or retry later")
            self._counted = True
            open_connections[0] += 1
            per_client[self._host] += 1
            self._arm()

        def _refuse(self, status: str, message: str) -> None:
            self.transport.write(_plain(status, message))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:  # still no whole request line and headers
                self._refuse("408 Request Timeout", f"no complete request within {request_timeout_s:g} s "
                             "(--request-timeout)")

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # its headers are in: the body has a deadline of its own (read_body)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted:
                self._counted = False
                open_connections[0] -= 1
                per_client[self._host] -= 1
                if not per_client[self._host]:
                    del per_client[self._host]
            super().connection_lost(exc)

    return Guarded
