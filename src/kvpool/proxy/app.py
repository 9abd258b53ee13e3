"""The proxy's HTTP routes, its server, and ``main``.

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: prefill, then decode; in PD-mixed
  mode once, to the instance the routing policy picks (``forward.py``)
- ``GET /v1/models``: from a healthy decode instance, else a healthy prefill one (mixed mode: a
  mixed one)
- ``GET /metrics``: Prometheus series (docs/metrics.md), no auth: they name instances and counts,
  never prompts
- ``GET /healthcheck`` (and ``GET /health``, the name vLLM and Kubernetes probes use):
  instance counts; 200 while at least one prefill and one decode instance is healthy (mixed
  mode: one mixed instance), else 503

Admin routes (they need ``Authorization: Bearer <token>``, the token being the value of
``KVPOOL_PROXY_ADMIN_TOKEN`` in the proxy's environment; without that variable they answer 403
and say how to enable them; a missing or wrong token is a 401):

- ``GET /instances``: every instance with its health and load
- ``GET /routing``: mixed mode's routing decisions and their outcomes (``route.py``); 404 in
  PD mode
- ``POST /instances/add``, ``POST /instances/remove``: ``{"type": "prefill"|"decode"|"mixed",
  "host": H, "port": P}``, or vLLM-Ascend's ``{"type": ..., "instances": ["H:P", ...]}``.
  An added instance is probed at once and joins the rotation when ``GET /health`` answers 200
  (at once, or at a later probe: it may still be starting). A removed one gets no new
  requests; those in flight on it finish. A type the proxy's mode does not serve is a 400.

Every request body is read under ``--max-body-bytes`` and parsed strictly (``intake.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response

from kvpool.backends.net import split_host_port
from kvpool.config import bearer_matches
from kvpool.errors import ConfigError
from kvpool.proxy.config import (
    ADMIN_TOKEN_ENV,
    Endpoint,
    ProxyConfig,
    add_arguments,
    config_from_args,
    validate_endpoint,
)
from kvpool.proxy.forward import Forwarder, error_response
from kvpool.proxy.health import HealthChecker
from kvpool.proxy.guard import BodyBudget, guarded_protocol
from kvpool.proxy.intake import Admission, BadRequest, completion_body, parse_json, read_body
from kvpool.proxy.metrics import ProxyMetrics
from kvpool.proxy.registry import Registry, Role
from kvpool.proxy.route import MixedRouter

logger = logging.getLogger("kvpool.proxy")


class ProxyState:
    """What the routes share: the instances, the upstream client, the forwarder, the prober."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        # Command line: not added at runtime.
        self.registry = Registry(config.prefillers, config.decoders, config.instances, mixed=config.mixed)
        self.router = MixedRouter(self.registry, config) if config.mixed else None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,  # never send 127.0.0.1 traffic through an http_proxy
        )
        self.forwarder = Forwarder(self.registry, self.client, config, self.router)
        self.metrics = ProxyMetrics(self.registry, self.router)
        self.bodies = BodyBudget(config.body_budget_bytes)  # kvpool.proxy.guard
        self.health = HealthChecker(self.registry, self.client, config.health_interval,
                                    timeout=min(5.0, config.timeout, config.connect_timeout + 1.0),
                                    timeouts_allowed=config.health_timeouts)

    async def aclose(self) -> None:
        await self.client.aclose()


def _releasing(resp: Response, admission: Admission) -> Response:
    """``resp``, giving the body's budget back once it has been sent (a stream: once it ended;
    the request's body lives as long as the forwarding that reads it)."""
    earlier = resp.background

    async def release() -> None:
        admission.release()
        if earlier is not None:
            await earlier()

    resp.background = BackgroundTask(release)
    return resp


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


# Instances one admin request may name: a typo'd loop must not register thousands.
MAX_INSTANCES_PER_REQUEST = 256


def _parse_instances(body: Any) -> tuple[Role, list[Endpoint]]:
    """``{"type", "host", "port"}`` or ``{"type", "instances": "H:P" | ["H:P", ...]}``.

    ``port`` is a JSON integer; in ``"H:P"`` it is decimal digits, and an IPv6 ``H`` is in
    brackets (``"[::1]:8100"``). Hosts are validated as on the command line.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    role = Role.parse(body.get("type"))
    pairs: list[tuple[str, object, object]] = []
    if "instances" in body:
        items = body["instances"]
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            raise ValueError('"instances" must be "host:port" or a list of them')
        if len(items) > MAX_INSTANCES_PER_REQUEST:
            raise ValueError(f'"instances" lists {len(items)} entries; at most {MAX_INSTANCES_PER_REQUEST} '
                             "in one request")
        for item in items:
            split = split_host_port(item)
            if split is None:
                raise ValueError(f'"instances" entry {item!r} is not "host:port" (IPv6: "[addr]:port")')
            pairs.append((f'"instances" entry {item!r}', *split))
    elif "host" in body and "port" in body:
        if not isinstance(body["port"], int) or isinstance(body["port"], bool):
            raise ValueError(f'"port" must be an integer 1-65535, not {body["port"]!r:.50}')
        pairs.append(('"host"/"port"', body["host"], body["port"]))
    else:
        raise ValueError('give "host" and "port", or "instances": ["host:port", ...]')
    result: list[Endpoint] = []
    for key, host, port in pairs:
        try:
            ep = validate_endpoint(key, host, port)
        except ConfigError as exc:
            raise ValueError(config_error_text(exc)) from None
        if ep not in result:
            result.append(ep)
    return role, result


def admin_denied(config: ProxyConfig, request: Request) -> Response | None:
    """None if ``request`` may use an admin route, else the 403 or 401 it gets.

    Checked before the body is read: an unauthenticated client cannot make the proxy read it.
    """
    if config.admin_token is None:
        return error_response(
            403, f"the admin routes are disabled; to enable them, start the proxy with {ADMIN_TOKEN_ENV} set to "
            "a secret token (16+ characters) and send it as 'Authorization: Bearer <token>'", "permission_denied")
    if bearer_matches(request.headers.get("authorization", ""), config.admin_token):
        return None
    resp = error_response(401, f"the admin routes need 'Authorization: Bearer <token>' with the token in "
                          f"the proxy's {ADMIN_TOKEN_ENV}; this request has none or a wrong one",
                          "authentication_error")
    resp.headers["www-authenticate"] = "Bearer"
    return resp


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

    async def _completion(request: Request, path: str, endpoint: str) -> Response:
        started = time.monotonic()
        admission = Admission(state.bodies)
        try:
            body = completion_body(await read_body(request, config.max_body_bytes, config.request_timeout, admission),
                                   admission)
        except BadRequest as exc:
            resp: Response = error_response(exc.status, exc.message, "invalid_request_error")
        else:
            headers = {k.lower(): v for k, v in request.headers.items()}
            forward = state.forwarder.mixed if config.mixed else state.forwarder.completion
            resp = await _until_disconnect(request, forward(path, body, headers))
        state.metrics.observe(endpoint, resp.status_code, time.monotonic() - started)
        return _releasing(resp, admission)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completion(request, "/v1/completions", "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _completion(request, "/v1/chat/completions", "chat_completions")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        roles = [Role.MIXED] if config.mixed else [Role.DECODE, Role.PREFILL]
        return await state.forwarder.get(roles, "/v1/models", headers)

    @app.get("/healthcheck")
    @app.get("/health")
    async def healthcheck() -> Response:
        counts = state.registry.counts()
        ok = all(counts[f"healthy_{role.value}_instances"] > 0 for role in state.registry.roles)
        serving = Role.MIXED if config.mixed else Role.DECODE
        in_flight = sum(i.in_flight for i in state.registry.instances(serving))
        return JSONResponse({"status": "ok" if ok else "unavailable", **counts, "requests_in_flight": in_flight},
                            status_code=200 if ok else 503)

    @app.get("/instances")
    async def list_instances(request: Request) -> Response:
        denied = admin_denied(config, request)
        return denied or JSONResponse(state.registry.snapshot())

    @app.get("/routing")
    async def routing(request: Request) -> Response:
        denied = admin_denied(config, request)
        if denied is not None:
            return denied
        if state.router is None:
            return error_response(404, "no routing policy: this proxy runs in PD mode (least-loaded prefill, then "
                                  "decode); routing counters are kept for PD-mixed instances (--instance-*)",
                                  "not_found")
        return JSONResponse(state.router.snapshot())

    async def _instances_body(request: Request) -> tuple[Role, list[Endpoint]] | Response:
        denied = admin_denied(config, request)
        if denied is not None:
            return denied
        try:
            role, eps = _parse_instances(parse_json(await read_body(request, config.max_body_bytes,
                                                                    config.request_timeout)))
            state.registry.check_role(role)
            return role, eps
        except BadRequest as exc:
            return error_response(exc.status, exc.message, "invalid_request_error")
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
            inst = state.registry.add(role, ep, healthy=False, added_at_runtime=True)
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
    if config.mixed:
        logger.info("kvpool proxy on http://%s:%d: PD-mixed instances %s, routing %s", config.host, config.port,
                    [e.key for e in config.instances], config.routing_policy)
    elif not config.prefillers or not config.decoders:
        how = ("POST /instances/add" if config.admin_token is not None
               else f"POST /instances/add, which needs {ADMIN_TOKEN_ENV} set")
        logger.warning("no %s instances given: requests fail with 503 until some are added with %s",
                       "prefill" if not config.prefillers else "decode", how)
    logger.info("admin routes (/instances*): %s", "enabled, bearer token required" if config.admin_token
                else f"disabled ({ADMIN_TOKEN_ENV} is not set)")
    if not config.mixed:
        logger.info("kvpool proxy on http://%s:%d: prefill %s, decode %s", config.host, config.port,
                    [e.key for e in config.prefillers], [e.key for e in config.decoders])
    logging.getLogger("uvicorn.access").addFilter(ProbesAtDebug())
    uvicorn.run(create_app(config), host=config.host, port=config.port, **server_options(config))


def server_options(config: ProxyConfig) -> dict[str, Any]:
    """How uvicorn serves the proxy: its log level, and connections through `guard`'s caps and deadline."""
    return {"log_level": config.log_level.lower(), "timeout_graceful_shutdown": 5,
            "http": guarded_protocol(config.max_connections, config.max_client_connections, config.request_timeout)}


PROBE_PATHS = frozenset({"/health", "/healthcheck"})


class ProbesAtDebug(logging.Filter):
    """Access-log lines of health probes (a load balancer or Kubernetes asks every few seconds)
    only when the proxy logs at DEBUG: at INFO they would drown the requests that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) >= 3 and str(args[2]).split("?", 1)[0] in PROBE_PATHS:
            return logging.getLogger("kvpool.proxy").isEnabledFor(logging.DEBUG)
        return True


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
                                     description="PD-disaggregation proxy (prefill instances, then decode instances) "
                                     "or router of PD-mixed instances")
    add_arguments(parser)
    return run(parser.parse_args(argv))
