"""The proxy's HTTP routes, its server, and ``main``.

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: prefill, then decode (``forward.py``)
- ``GET /v1/models``: from a decode instance
- ``GET /healthcheck``: instance counts; 200 while at least one prefill and one decode
  instance is healthy, else 503
- ``GET /instances``: every instance with its health and load
- ``POST /instances/add``, ``POST /instances/remove``: ``{"type": "prefill"|"decode",
  "host": H, "port": P}``, or vLLM-Ascend's ``{"type": ..., "instances": ["H:P", ...]}``.
  An added instance is probed at once and joins the rotation when ``GET /health`` answers 200
  (at once, or at a later probe: it may still be starting). A removed one gets no new
  requests; those in flight on it finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvpool.errors import ConfigError
from kvpool.proxy.config import Endpoint, ProxyConfig, add_arguments, config_from_args, endpoints
from kvpool.proxy.forward import Forwarder, error_response
from kvpool.proxy.health import HealthChecker
from kvpool.proxy.registry import Registry, Role

logger = logging.getLogger("kvpool.proxy")


class ProxyState:
    """What the routes share: the instances, the upstream client, the forwarder, the prober."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.registry = Registry(config.prefillers, config.decoders)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,  # never send 127.0.0.1 traffic through an http_proxy
        )
        self.forwarder = Forwarder(self.registry, self.client, config)
        self.health = HealthChecker(self.registry, self.client, config.health_interval,
                                    timeout=min(5.0, config.timeout, config.connect_timeout + 1.0))

    async def aclose(self) -> None:
        await self.client.aclose()


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (closing its upstream requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            logger.info("client disconnected from %s before the answer; request cancelled", request.url.path)
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def config_error_text(exc: ConfigError) -> str:
    value = exc.value if isinstance(exc.value, str) and " " in exc.value else repr(exc.value)
    return f"{exc.key}: {exc.expected} (got {value})"


def _parse_instances(body: Any) -> tuple[Role, list[Endpoint]]:
    """``{"type", "host", "port"}`` or ``{"type", "instances": "H:P" | ["H:P", ...]}``."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    role = Role.parse(body.get("type"))
    if "instances" in body:
        items = body["instances"]
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            raise ValueError('"instances" must be "host:port" or a list of them')
        hosts, ports = [], []
        for item in items:
            host, sep, port = item.rpartition(":")
            if not sep or not host:
                raise ValueError(f'"instances" entry {item!r} is not "host:port"')
            hosts.append(host)
            ports.append(port)
    elif "host" in body and "port" in body:
        hosts, ports = [body["host"]], [body["port"]]
    else:
        raise ValueError('give "host" and "port", or "instances": ["host:port", ...]')
    try:
        return role, list(endpoints(role.value + "r", hosts, ports))
    except ConfigError as exc:
        raise ValueError(config_error_text(exc)) from None


def create_app(config: ProxyConfig) -> FastAPI:
    state = ProxyState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        prober = asyncio.create_task(state.health.run(), name="kvpool-proxy-health")
        try:
            yield
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            await state.aclose()

    app = FastAPI(title="kvpool proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state

    async def _completion(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_response(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", "invalid_request_error")
        headers = {k.lower(): v for k, v in request.headers.items()}
        return await _until_disconnect(request, state.forwarder.completion(path, body, headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _completion(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        return await state.forwarder.get(Role.DECODE, "/v1/models", headers)

    @app.get("/healthcheck")
    async def healthcheck() -> Response:
        counts = state.registry.counts()
        ok = counts["healthy_prefill_instances"] > 0 and counts["healthy_decode_instances"] > 0
        in_flight = sum(i.in_flight for i in state.registry.instances(Role.DECODE))
        return JSONResponse({"status": "ok" if ok else "unavailable", **counts, "requests_in_flight": in_flight},
                            status_code=200 if ok else 503)

    @app.get("/instances")
    async def list_instances() -> Response:
        return JSONResponse(state.registry.snapshot())

    async def _instances_body(request: Request) -> tuple[Role, list[Endpoint]] | Response:
        try:
            return _parse_instances(json.loads(await request.body()))
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")

    @app.post("/instances/add")
    async def add_instances(request: Request) -> Response:
        parsed = await _instances_body(request)
        if isinstance(parsed, Response):
            return parsed
        role, eps = parsed
        added, present = [], []
        for ep in eps:
            inst = state.registry.add(role, ep, healthy=False)
            if inst is None:
                present.append(ep.key)
            else:
                added.append(inst)
        await asyncio.gather(*(state.health.probe(i) for i in added))
        return JSONResponse({"type": role.value, "added": [i.to_dict() for i in added],
                             "already_present": present, **state.registry.snapshot()})

    @app.post("/instances/remove")
    async def remove_instances(request: Request) -> Response:
        parsed = await _instances_body(request)
        if isinstance(parsed, Response):
            return parsed
        role, eps = parsed
        removed = [ep.key for ep in eps if state.registry.remove(role, ep) is not None]
        missing = [ep.key for ep in eps if ep.key not in removed]
        if not removed:
            return error_response(404, f"no {role.value} instance {', '.join(missing)}", "not_found")
        return JSONResponse({"type": role.value, "removed": removed, "not_found": missing,
                             **state.registry.snapshot()})

    return app


def serve(config: ProxyConfig) -> None:
    """Run the proxy until interrupted."""
    if not config.prefillers or not config.decoders:
        logger.warning("no %s instances given: requests fail with 503 until some are added with "
                       "POST /instances/add", "prefill" if not config.prefillers else "decode")
    logger.info("kvpool proxy on http://%s:%d: prefill %s, decode %s", config.host, config.port,
                [e.key for e in config.prefillers], [e.key for e in config.decoders])
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=config.log_level.lower(), timeout_graceful_shutdown=5)


def run(args: argparse.Namespace) -> int:
    """``kvpool proxy``: validate the arguments, then serve; the exit status for the shell."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvpool proxy: error: {config_error_text(exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, config.log_level),
                        format="%(asctime)s %(levelname)s kvpool-proxy: %(message)s")
    logging.getLogger("kvpool").setLevel(getattr(logging, config.log_level))
    serve(config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool proxy",
                                     description="PD-disaggregation proxy: prefill instances, then decode instances")
    add_arguments(parser)
    return run(parser.parse_args(argv))
