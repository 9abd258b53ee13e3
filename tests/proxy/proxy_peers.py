"""Test peers for the proxy tests: small real HTTP servers that stand in for vLLM instances.

Each :class:`PeerServer` is a Starlette app under uvicorn, in a thread, on a free 127.0.0.1
port. It records every request it receives and answers OpenAI-shaped completions (plain and
SSE-streamed, ``/v1/completions`` and ``/v1/chat/completions``), ``/v1/models`` and
``/health``. A :class:`PeerBehavior` set by the test decides how it answers: status codes,
held (gated) requests, streams released chunk by chunk, endless streams, delays. They are test
doubles, not vLLM: the lead's end-to-end tests run real vLLM instances behind the proxy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread on 127.0.0.1."""

    def __init__(self, app: Any, port: int = 0, **options: Any) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port: int = self.sock.getsockname()[1]
        options = {"log_level": "warning", **options, "timeout_graceful_shutdown": 1}
        config = uvicorn.Config(app, lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def request_stop(self) -> None:
        self.server.should_exit = True

    def stop(self) -> None:
        """Stop and wait; several servers stop faster with request_stop() on all, then stop()."""
        self.request_stop()
        self.thread.join(3)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(3)
        self.sock.close()


@dataclasses.dataclass
class PeerBehavior:
    """How a peer answers; the test may change it at any time."""

    status: int = 200  # answer to completions (4xx/5xx: an error body)
    health_status: int = 200
    gate: threading.Event | None = None  # hold each completion until set
    delay: float = 0.0  # seconds before answering a completion
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: no details)
    kv_transfer_params: dict[str, Any] | None = None  # returned in non-streaming answers
    stream_chunks: int = 3  # text chunks in a stream
    chunk_gates: list[threading.Event] | None = None  # chunk i+1 is sent only after chunk_gates[i] is set
    endless: bool = False  # stream a chunk every 20 ms until the client goes away
    reject_prompt: str | None = None  # answer 400 to this prompt
    crash_after: int | None = None  # the stream breaks off (connection dropped) after this many chunks


@dataclasses.dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


class Peer:
    """One test peer: its behavior, what it received, and whether a client went away mid-answer."""

    def __init__(self, name: str, behavior: PeerBehavior | None = None, port: int = 0) -> None:
        self.name = name
        self.behavior = behavior or PeerBehavior()
        self.received: list[Received] = []
        self.health_probes = 0
        self.disconnected = threading.Event()  # a client closed the connection before the answer ended
        self.finished_streams = 0
        self._lock = threading.Lock()
        self.server = ServerThread(self._app(), port)

    # --- lifecycle
    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> Peer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def completions(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path.endswith("completions")]

    # --- the app
    def _app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self._completion, methods=["POST"]),
            Route("/v1/chat/completions", self._completion, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ])

    async def _health(self, request: Request) -> Response:
        self.health_probes += 1
        return Response(status_code=self.behavior.health_status)

    async def _models(self, request: Request) -> Response:
        with self._lock:
            self.received.append(Received(request.url.path, {}, dict(request.headers)))
        return JSONResponse({"object": "list", "data": [
            {"id": "test-model", "object": "model", "created": 0, "owned_by": self.name}]})

    async def _wait(self, request: Request, until: Callable[[], bool]) -> bool:
        """Wait until ``until()``; False (and ``disconnected`` set) if the client left first."""
        while not until():
            if await request.is_disconnected():
                self.disconnected.set()
                return False
            await asyncio.sleep(0.01)
        return True

    async def _completion(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.received.append(Received(request.url.path, body, dict(request.headers)))
        b = self.behavior
        chat = request.url.path.endswith("chat/completions")
        if b.gate is not None and not await self._wait(request, b.gate.is_set):
            return Response(status_code=499)
        if b.delay:
            end = time.monotonic() + b.delay
            if not await self._wait(request, lambda: time.monotonic() >= end):
                return Response(status_code=499)
        if b.reject_prompt is not None and body.get("prompt") == b.reject_prompt:
            return JSONResponse({"error": {"message": f"{self.name} rejects this prompt", "type": "BadRequestError",
                                           "code": 400}}, status_code=400)
        if b.status != 200:
            return JSONResponse({"error": {"message": f"{self.name} fails with {b.status}", "type": "InternalError",
                                           "code": b.status}}, status_code=b.status)
        if body.get("stream"):
            return StreamingResponse(self._stream(body, chat), media_type="text/event-stream")
        return JSONResponse(self._answer(body, chat))

    def _usage(self, body: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        prompt = body.get("prompt") or json.dumps(body.get("messages"))
        n = len(str(prompt).split())
        details = None if self.behavior.cached_tokens is None else {"cached_tokens": self.behavior.cached_tokens}
        return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens,
                "prompt_tokens_details": details}

    def _answer(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        text = f"{self.name} says " + " ".join(f"t{i}" for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": f"{self.name}-1", "object": "chat.completion" if chat else "text_completion",
                "created": 0, "model": body.get("model", "test-model"), "choices": [choice],
                "usage": self._usage(body, n), "kv_transfer_params": self.behavior.kv_transfer_params}

    def _chunk(self, body: dict[str, Any], chat: bool, text: str, finish: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        data = {"id": f"{self.name}-s", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": body.get("model", "test-model"), "choices": [choice]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    async def _stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        b = self.behavior
        finished = False
        try:
            i = 0
            while True:
                last = not b.endless and i == b.stream_chunks - 1
                yield self._chunk(body, chat, f"{self.name}-chunk{i} ", "length" if last else None)
                if last:
                    break
                if b.crash_after is not None and i + 1 >= b.crash_after:
                    raise RuntimeError(f"{self.name} crashes mid-stream (a test peer's planned failure)")
                if b.endless:
                    await asyncio.sleep(0.02)
                elif b.chunk_gates is not None:
                    gate = b.chunk_gates[i]
                    while not gate.is_set():
                        await asyncio.sleep(0.005)
                i += 1
            if (body.get("stream_options") or {}).get("include_usage"):
                usage_chunk = {"id": f"{self.name}-s", "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": 0, "model": body.get("model", "test-model"), "choices": [],
                               "usage": self._usage(body, b.stream_chunks)}
                yield b"data: " + json.dumps(usage_chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if finished:
                self.finished_streams += 1
            else:  # closed before the end: the client (the proxy) went away
                self.disconnected.set()
