"""Sending one client request through a prefill instance and then a decode instance, or (in
PD-mixed mode) once to the PD-mixed instance the routing policy picks.

Mixed request: the client's body as it came, to one instance, and its answer or stream back
as it came (the bytes unchanged); the answer's ``usage`` is read on the way (in a stream, from
the events that carry one) to count the routing decision's outcome (``route.py``). Response
headers ``x-kvpool-instance`` (the instance), ``x-kvpool-route`` (why it was chosen: a reason
of ``kvpool.routing.REASONS``) and ``x-kvpool-route-matched-blocks`` (the leading blocks it was
expected to hold). Retries, health and client disconnects as for the decode leg below.

Prefill request: the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` if
the body has it), ``stream=false``, ``n=1``, no ``stream_options``/``min_tokens``, and
``kv_transfer_params={"do_remote_decode": true, ...}`` as vLLM's P2P connectors (NIXL,
Mooncake transfer) expect; kvpool's connector ignores it.

Decode request: the client's body as it came, less any ``kv_transfer_params`` of the
client's own (they tell a transfer connector where to fetch KV from, which is the prefill's to
say, not the client's), plus the ``kv_transfer_params`` the prefill answered with (when it
answered any). The client's switches for kvpool (``kv_transfer_params.kvpool``) go to both
legs as they came. Its answer or SSE stream goes back to the client.

Headers sent on: ``x-request-id`` (the client's, or a new one), and the client's
``Authorization`` only as ``--forward-authorization`` says (default: to no instance).

Cached tokens reported: when the prefill's answer has
``usage.prompt_tokens_details.cached_tokens`` (vLLM reports it with
``--enable-prompt-tokens-details``), that number (the prompt tokens the prefill did not have to
compute: prefix-cache and pool hits) becomes ``usage.prompt_tokens_details.cached_tokens`` of
the answer the client gets, in the non-streaming body and in every stream chunk that has a
``usage``. The decoder's own count (in PD it loaded nearly the whole prompt, so it is close to
the prompt length), when it reported one, moves to ``prompt_tokens_details.decode_cached_tokens``.
When the prefill reported none, the decoder's usage is passed on untouched. The response header
``x-kvpool-prefill-cached-tokens`` carries the prefill's number too.

Failures: a connection error, a timeout, a dropped connection or a 5xx answer fails the attempt;
the instance is marked down and the request is tried on another healthy instance it has not
tried yet, up to ``--max-retries`` more times, ``--retry-delay`` seconds apart; never on one
that already failed it. A 4xx answer is the client's problem: it is passed back as it is,
without retrying. When every attempt failed, or no untried healthy instance is left, the
client gets the last 5xx answer as it was (502 if its body broke off), or 502 (connection
errors) / 504 (timeouts) with an OpenAI-shaped error body; 503 when there is no instance at
all. Once a stream has started it cannot be retried: a failure mid-stream ends it with an SSE ``error`` event and ``data: [DONE]``.

Client disconnects: while the proxy waits for the prefill or a non-streaming decode, the route
watches for the client going away and cancels the upstream request (closing its connection,
which makes vLLM abort it); during a stream, :class:`UpstreamStream` does the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvpool.config import REQUEST_PARAMS_KEY
from kvpool.proxy.config import ForwardAuth, ProxyConfig
from kvpool.proxy.intake import BadRequest, parse_json
from kvpool.proxy.prefix import request_chain
from kvpool.proxy.registry import Instance, Lease, Registry, Role
from kvpool.proxy.route import MixedRouter, Routed

logger = logging.getLogger("kvpool.proxy")

# What a P2P transfer connector (vLLM's NixlConnector, MooncakeConnector) expects on the
# prefill request; the same dict vLLM's own disaggregation proxies send.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

HEADER_PREFILLER = "x-kvpool-prefiller"
HEADER_DECODER = "x-kvpool-decoder"
HEADER_PREFILL_CACHED = "x-kvpool-prefill-cached-tokens"
HEADER_INSTANCE = "x-kvpool-instance"
HEADER_ROUTE = "x-kvpool-route"
HEADER_ROUTE_MATCHED = "x-kvpool-route-matched-blocks"


def error_response(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    """An OpenAI-shaped error answer made by the proxy itself."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


class UpstreamFailed(Exception):
    """Every attempt failed; :meth:`response` is what the client gets."""

    def __init__(self, status: int, message: str, upstream: httpx.Response | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.upstream = upstream  # the last 5xx answer, body read, when there was one

    def response(self) -> Response:
        if self.upstream is not None:
            return passthrough(self.upstream)
        kind = {503: "service_unavailable", 504: "upstream_timeout"}.get(self.status, "bad_gateway")
        return error_response(self.status, self.message, kind)


def passthrough(resp: httpx.Response, headers: Mapping[str, str] | None = None) -> Response:
    """An upstream answer (body already read) passed back as it is."""
    return Response(resp.content, status_code=resp.status_code, headers=dict(headers or {}),
                    media_type=resp.headers.get("content-type"))


# ---------------------------------------------------------------------------- payloads

def prefill_payload(body: Mapping[str, Any]) -> dict[str, Any]:
    payload = dict(body)
    payload["max_tokens"] = 1
    if "max_completion_tokens" in payload:
        payload["max_completion_tokens"] = 1
    payload["stream"] = False
    payload["n"] = 1
    payload.pop("stream_options", None)
    payload.pop("min_tokens", None)  # min_tokens > max_tokens is a 400
    payload["kv_transfer_params"] = {**PREFILL_KV_TRANSFER_PARAMS, **_pool_switches(body)}
    return payload


def decode_payload(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    payload = dict(body)
    switches = _pool_switches(body)
    payload.pop("kv_transfer_params", None)
    if kv_transfer_params or switches:
        payload["kv_transfer_params"] = {**(kv_transfer_params if isinstance(kv_transfer_params, dict) else {}),
                                         **switches}
    return payload


def _pool_switches(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's own switches for kvpool (`kv_transfer_params.kvpool`), which both legs honour;
    the rest of its `kv_transfer_params` is the prefill's to say."""
    params = body.get("kv_transfer_params")
    return {REQUEST_PARAMS_KEY: params[REQUEST_PARAMS_KEY]} if isinstance(params, dict) and \
        REQUEST_PARAMS_KEY in params else {}


def _text_tokens(value: Any) -> int:
    """A rough token count of a prompt or message content (4 characters a token)."""
    if isinstance(value, str):
        return len(value) // 4 + 1
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # token ids
        return sum(_text_tokens(v) for v in value)
    if isinstance(value, dict):
        return _text_tokens(value.get("text") or value.get("content") or "")
    return 0


def prompt_tokens(body: Mapping[str, Any]) -> int:
    if "messages" in body:
        return _text_tokens(body.get("messages") or [])
    return _text_tokens(body.get("prompt", ""))


def output_tokens(body: Mapping[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 16


def cached_tokens(data: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def merge_usage(data: Any, prefill_cached: int) -> bool:
    """Put the prefill's cached-token count into ``data["usage"]`` (see the module docstring)."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    decode_cached = details.get("cached_tokens")
    if isinstance(decode_cached, int):
        details["decode_cached_tokens"] = decode_cached
    details["cached_tokens"] = prefill_cached
    usage["prompt_tokens_details"] = details
    return True


_EVENT_END = re.compile(rb"\r?\n\r?\n")
_ENDS_EVENT = re.compile(rb"\r?\n\r?\n\Z")


class SSEUsageRewriter:
    """Rewrites the ``usage`` of SSE events as they pass; everything else goes through unchanged.

    Each complete event is emitted as soon as its end arrives, so the stream keeps its pace.
    With ``prefill_cached`` None nothing is rewritten: the events pass byte for byte and only
    ``on_usage`` sees each usage record.
    """

    def __init__(self, prefill_cached: int | None, on_usage: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.prefill_cached = prefill_cached
        self.on_usage = on_usage
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out: list[bytes] = []
        while True:
            m = _EVENT_END.search(self._buf)
            if m is None:
                break
            out.append(self._event(self._buf[:m.start()]) + self._buf[m.start():m.end()])
            self._buf = self._buf[m.end():]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return self._event(rest) if rest.strip() else rest

    def _event(self, event: bytes) -> bytes:
        if b'"usage"' not in event:
            return event
        lines = event.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:].strip())
            except (ValueError, RecursionError):  # not ours to fix: passed on as it came
                return event
            if self.on_usage is not None and isinstance(data, dict) and isinstance(data.get("usage"), dict):
                self.on_usage(data["usage"])
            if self.prefill_cached is None or not merge_usage(data, self.prefill_cached):
                return event
            lines[i] = b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
            return b"\n".join(lines)
        return event


def sse_error_event(message: str, status: int = 502) -> bytes:
    err = {"error": {"message": message, "type": "proxy_error", "param": None, "code": status}}
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


# ---------------------------------------------------------------------------- streaming

class UpstreamStream(Response):
    """Passes an upstream stream to the client chunk by chunk.

    It always watches for the client disconnecting (whatever the ASGI server's spec version)
    and then stops at once: the upstream response is closed, which closes its connection, so
    the instance sees the disconnect and aborts the request. ``on_close`` runs exactly once
    when the stream ends, however it ends.
    """

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None],
                 on_error: Callable[[str], None], rewriter: SSEUsageRewriter | None,
                 headers: Mapping[str, str]) -> None:
        self.upstream = upstream
        self.on_close = on_close
        self.on_error = on_error
        self.rewriter = rewriter
        self.status_code = upstream.status_code
        self.media_type = upstream.headers.get("content-type")
        self.background = None
        self.init_headers(dict(headers))
        self.is_sse = (self.media_type or "").startswith("text/event-stream")

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = b""  # the last bytes sent: whether the client is between two SSE events
        try:
            async for chunk in self.upstream.aiter_bytes():
                out = self.rewriter.feed(chunk) if self.rewriter else chunk
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    last = (last + out)[-4:]
            tail = self.rewriter.flush() if self.rewriter else b""
        except httpx.HTTPError as exc:  # the instance died or stalled mid-stream
            reason = f"stream broken: {type(exc).__name__}: {exc}"
            self.on_error(reason)
            logger.warning("decode stream from %s ended early: %s", self.upstream.url, reason)
            tail = self.rewriter.flush() if self.rewriter else b""
            if self.is_sse:
                # A stream cut mid-event: end that event first, or the error's "data:" would
                # join its last line and the client could not read the error.
                sent = (last + tail)[-4:]
                tail += (b"\n\n" if sent and not _ENDS_EVENT.search(sent) else b"") + sse_error_event(reason)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def pump() -> None:
                    try:
                        await self._pump(send)
                    except OSError:  # the client went away (ASGI spec >= 2.4 servers)
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    logger.info("client disconnected; closing the stream from %s", self.upstream.url)
                    tg.cancel_scope.cancel()

                tg.start_soon(pump)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_close()


# ---------------------------------------------------------------------------- forwarding

class Forwarder:
    """Sends each client request on (module docstring): to a prefill then a decode instance, or
    once to the PD-mixed instance the router picks, retrying on other instances as allowed."""

    def __init__(self, registry: Registry, client: httpx.AsyncClient, config: ProxyConfig,
                 router: MixedRouter | None = None) -> None:
        self.registry = registry
        self.client = client
        self.config = config
        self.router = router  # mixed mode only

    async def _attempts(self, role: Role, send: Callable[[Instance], Awaitable[httpx.Response]],
                        tokens: int, choose: Callable[[list[Instance]], Instance] | None = None,
                        ) -> tuple[Instance, httpx.Response, Lease]:
        """Send to the least-loaded instance of ``role`` (or the one ``choose`` takes of the
        candidates), retrying elsewhere on failure.

        Returns an answer below 500 with the lease still held; the caller releases it (and
        closes the answer, if it is a stream).
        """
        tried: list[Instance] = []
        failure: UpstreamFailed | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt and self.config.retry_delay > 0 and self.registry.candidates(role, exclude=tried):
                # Before the pick, not between it and the lease: requests that failed together
                # would all pick by the loads from before any of their retries was placed, and
                # pile onto one instance past its share (and past prefix_aware's load bound).
                await asyncio.sleep(self.config.retry_delay)
            inst = self.registry.pick(role, exclude=tried, choose=choose)
            if inst is None:
                if failure is not None:  # a retry, and no healthy instance left that it has not tried
                    logger.warning("%s: no other healthy %s instance to retry on", failure.message, role.value)
                    raise failure
                raise UpstreamFailed(503, f"no {role.value} instance is configured")
            if attempt:
                logger.info("retrying on %s instance %s (retry %d of %d)", role.value, inst.key, attempt,
                            self.config.max_retries)
            tried.append(inst)
            lease = self.registry.lease(inst, tokens)
            try:
                resp = await send(inst)
            except httpx.TimeoutException as exc:
                lease.release()
                reason = f"{type(exc).__name__} after {self.config.timeout:g}s" if not isinstance(
                    exc, httpx.ConnectTimeout) else f"ConnectTimeout after {self.config.connect_timeout:g}s"
                failure = UpstreamFailed(504, f"{role.value} instance {inst.key}: {reason}")
            except httpx.HTTPError as exc:
                lease.release()
                reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                failure = UpstreamFailed(502, f"{role.value} instance {inst.key}: {reason}")
            except BaseException:
                lease.release()
                raise
            else:
                if resp.status_code < 500:
                    if not inst.healthy:
                        self.registry.mark_up(inst)
                    return inst, resp, lease
                upstream: httpx.Response | None = resp
                try:
                    await resp.aread()
                except httpx.HTTPError:
                    upstream = None  # its body broke off: nothing whole to pass back, so a 502 of our own
                finally:
                    await resp.aclose()
                    lease.release()
                reason = f"HTTP {resp.status_code}"
                failure = UpstreamFailed(resp.status_code if upstream is not None else 502,
                                         f"{role.value} instance {inst.key}: {reason}", upstream)
            self.registry.mark_down(inst, reason)
            logger.warning("%s attempt %d on %s failed: %s", role.value, attempt + 1, inst.key, reason)
        assert failure is not None
        raise failure

    def _headers(self, incoming: Mapping[str, str], request_id: str, inst: Instance) -> dict[bytes, bytes]:
        """What ``inst`` gets: the request id, and the client's credentials only where allowed."""
        # As bytes: Starlette decoded the client's headers as latin-1, and httpx would encode a
        # str as ASCII, raising on any other byte a client may send; latin-1 gives its bytes back.
        headers = {b"x-request-id": request_id.encode("latin-1")}
        mode = self.config.forward_authorization
        allowed = mode is ForwardAuth.ALL or (mode is ForwardAuth.STATIC and not inst.added_at_runtime)
        if allowed and "authorization" in incoming:
            headers[b"authorization"] = incoming["authorization"].encode("latin-1")
        return headers

    async def completion(self, path: str, body: dict[str, Any], incoming: Mapping[str, str]) -> Response:
        """One ``/v1/completions`` or ``/v1/chat/completions`` request, prefill then decode."""
        request_id = incoming.get("x-request-id") or uuid.uuid4().hex
        n_prompt = prompt_tokens(body)
        if not any(i.healthy for i in self.registry.instances(Role.DECODE)):
            # A prefill now would compute a KV cache no decoder loads: answer at once instead.
            return error_response(503, "no healthy decode instance: the prefill was not sent; the health probe "
                                  "brings a decode instance back as soon as it answers", "service_unavailable")

        # Prefill: a whole (non-streaming) answer, lease released as soon as it is in.
        pbody = prefill_payload(body)

        async def send_prefill(inst: Instance) -> httpx.Response:
            return await self.client.post(inst.base_url + path, json=pbody,
                                          headers=self._headers(incoming, request_id, inst))

        try:
            pinst, presp, p_lease = await self._attempts(Role.PREFILL, send_prefill, n_prompt)
        except UpstreamFailed as exc:
            return exc.response()
        p_lease.release()
        out_headers = {"x-request-id": request_id, HEADER_PREFILLER: pinst.key}
        if presp.status_code != 200:
            return passthrough(presp, out_headers)  # 4xx: the request is wrong; no decode
        try:
            pdata = parse_json(presp.content, f"prefill instance {pinst.key}'s answer")
        except BadRequest as exc:
            return error_response(502, exc.message, "bad_gateway")
        kv_params = pdata.get("kv_transfer_params") if isinstance(pdata, dict) else None
        if kv_params is not None and not isinstance(kv_params, dict):
            return error_response(502, f"prefill instance {pinst.key} answered kv_transfer_params that are not an "
                                  f"object: {kv_params!r:.100}", "bad_gateway")
        prefill_cached = cached_tokens(pdata)
        if prefill_cached is not None:
            out_headers[HEADER_PREFILL_CACHED] = str(prefill_cached)

        # Decode: the original request (plus the prefill's kv_transfer_params).
        dbody = decode_payload(body, kv_params)
        stream = bool(body.get("stream"))
        dtokens = n_prompt + output_tokens(body)

        async def send_decode(inst: Instance) -> httpx.Response:
            req = self.client.build_request("POST", inst.base_url + path, json=dbody,
                                            headers=self._headers(incoming, request_id, inst))
            return await self.client.send(req, stream=stream)

        try:
            dinst, dresp, dlease = await self._attempts(Role.DECODE, send_decode, dtokens)
        except UpstreamFailed as exc:
            return exc.response()
        out_headers[HEADER_DECODER] = dinst.key
        if not stream:
            dlease.release()
            if dresp.status_code == 200 and prefill_cached is not None:
                try:
                    ddata = parse_json(dresp.content, "the decode answer")
                except BadRequest:
                    ddata = None  # passed on as it came
                if merge_usage(ddata, prefill_cached):
                    return JSONResponse(ddata, headers=out_headers)
            return passthrough(dresp, out_headers)

        if dresp.status_code != 200:  # 4xx: passed back as it is
            try:
                await dresp.aread()
            except httpx.HTTPError as exc:
                return error_response(502, f"decode instance {dinst.key}: {type(exc).__name__}", "bad_gateway")
            finally:
                await dresp.aclose()
                dlease.release()
            return passthrough(dresp, out_headers)
        ctype = dresp.headers.get("content-type", "")
        rewriter = (SSEUsageRewriter(prefill_cached)
                    if prefill_cached is not None and ctype.startswith("text/event-stream") else None)
        return UpstreamStream(dresp, on_close=dlease.release,
                              on_error=lambda reason: self.registry.mark_down(dinst, reason),
                              rewriter=rewriter, headers=out_headers)

    async def mixed(self, path: str, body: dict[str, Any], incoming: Mapping[str, str]) -> Response:
        """One request to the PD-mixed instance the routing policy picks, sent and answered as is."""
        assert self.router is not None, "mixed() needs the proxy's router (mixed mode)"
        router = self.router
        request_id = incoming.get("x-request-id") or uuid.uuid4().hex
        kind, chain = request_chain(body, self.config.routing_block_size, self.config.routing_block_chars)
        stream = bool(body.get("stream"))
        routed: dict[int, Routed] = {}  # id(instance) -> its decision, for this request's attempts

        def choose(candidates: list[Instance]) -> Instance:
            r = router.choose(candidates, chain, kind)
            routed[id(r.instance)] = r
            return r.instance

        async def send(inst: Instance) -> httpx.Response:
            req = self.client.build_request("POST", inst.base_url + path, json=body,
                                            headers=self._headers(incoming, request_id, inst))
            return await self.client.send(req, stream=stream)

        try:
            inst, resp, lease = await self._attempts(Role.MIXED, send, prompt_tokens(body) + output_tokens(body),
                                                     choose)
        except UpstreamFailed as exc:
            for r in routed.values():
                router.settle(r, answered=False)
            return exc.response()
        decision = routed[id(inst)]
        for r in routed.values():  # the attempts that failed before this one
            if r is not decision:
                router.settle(r, answered=False)
        out_headers = {"x-request-id": request_id, HEADER_INSTANCE: inst.key, HEADER_ROUTE: decision.decision.reason,
                       HEADER_ROUTE_MATCHED: str(decision.decision.matched_blocks)}
        ok = resp.status_code == 200
        if not stream or not ok:
            try:
                if stream:
                    await resp.aread()
            except httpx.HTTPError as exc:
                router.settle(decision, answered=False)
                return error_response(502, f"mixed instance {inst.key}: {type(exc).__name__}", "bad_gateway")
            finally:
                if stream:
                    await resp.aclose()
                lease.release()
            usage = None
            if ok:
                try:
                    data = parse_json(resp.content, f"mixed instance {inst.key}'s answer")
                except BadRequest:
                    data = None  # passed on as it came; the outcome is not known
                usage = data.get("usage") if isinstance(data, dict) else None
            router.settle(decision, answered=ok, usage=usage)
            return passthrough(resp, out_headers)

        # The last usage record only: with continuous_usage_stats every event carries one.
        last: dict[str, dict[str, Any] | None] = {"usage": None}

        def on_close() -> None:
            lease.release()
            router.settle(decision, answered=True, usage=last["usage"])

        ctype = resp.headers.get("content-type", "")
        watcher = SSEUsageRewriter(None, on_usage=lambda usage: last.update(usage=usage)) if ctype.startswith("text/event-stream") else None
        return UpstreamStream(resp, on_close=on_close, on_error=lambda reason: self.registry.mark_down(inst, reason),
                              rewriter=watcher, headers=out_headers)

    async def get(self, roles: Sequence[Role], path: str, incoming: Mapping[str, str]) -> Response:
        """A GET (``/v1/models``) answered by one instance, with retries: of the first of ``roles``
        with a healthy instance (every instance serves the same model), else of the first role."""
        request_id = incoming.get("x-request-id") or uuid.uuid4().hex

        async def send(inst: Instance) -> httpx.Response:
            return await self.client.get(inst.base_url + path, headers=self._headers(incoming, request_id, inst))

        role = next((r for r in roles if any(i.healthy for i in self.registry.instances(r))), roles[0])
        try:
            _, resp, lease = await self._attempts(role, send, 0)
        except UpstreamFailed as exc:
            return exc.response()
        lease.release()
        return passthrough(resp)
