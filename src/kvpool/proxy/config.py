"""`kvpool proxy` arguments and the validated config they become.

The instance arguments follow vLLM-Ascend's ``load_balance_proxy_server_example.py`` (the
spec's "启动代理服务器" step): ``--prefiller-hosts H1 H2 --prefiller-ports P1 P2`` pairs the
i-th host with the i-th port. One host with several ports means that host for every port
(``--prefiller-hosts localhost --prefiller-ports 8100 8101``). Any other mismatch is an error.

Two modes, exclusive: PD disaggregation (``--prefiller-*`` and ``--decoder-*``: every request
goes to a prefill instance, then a decode instance, each the least loaded of its role) or
PD-mixed (``--instance-hosts/--instance-ports``: every request goes once, as it came, to one
instance that ``--routing-policy`` picks; see docs/proxy.md).

Instance hosts, given here or to ``POST /instances/add``, are a host name or an IP literal and
nothing else (no scheme, path, user info or whitespace); ports are whole numbers 1..65535.

The admin token is read from the environment (:data:`ADMIN_TOKEN_ENV`), never from a flag, so
it does not show in ``ps`` or shell history. Without it the admin routes are disabled
(docs/security.md, `kvpool proxy`).

This module imports nothing beyond the standard library, so ``kvpool --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import ipaddress
import math
import os
import re
from collections.abc import Mapping, Sequence

from kvpool.config import ADMIN_TOKEN_MIN_LENGTH, admin_token_from, int_arg
from kvpool.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One vLLM instance's OpenAI server, as ``host:port``."""

    host: str
    port: int

    @property
    def key(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.key}"


# The environment variable that holds the token for the admin routes (``/instances*``).
ADMIN_TOKEN_ENV = "KVPOOL_PROXY_ADMIN_TOKEN"


# The routing policy of PD-mixed mode when none is given: send a request where its prefix most
# likely is already cached (a conversation's turns stick to one instance), within a load bound.
DEFAULT_MIXED_POLICY = "prefix_aware"
# What PD mode does (it always did): the least-loaded instance of each role.
PD_POLICY = "least_loaded"


class ForwardAuth(str, enum.Enum):
    """To which instances the client's ``Authorization`` header is passed on."""

    NONE = "none"  # to none: the instances see no client credentials
    STATIC = "static"  # to the instances given on the command line only
    ALL = "all"  # to every instance, those added with POST /instances/add too


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """Everything `kvpool proxy` runs with: where it listens, its instances (PD pairs, or
    PD-mixed ones and their routing policy), and its retry, timeout and health settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    prefillers: tuple[Endpoint, ...] = ()
    decoders: tuple[Endpoint, ...] = ()
    # PD-mixed instances (kv_both): given, the proxy runs in mixed mode (no prefillers or
    # decoders then): each request goes once, as it came, to the instance the policy picks.
    instances: tuple[Endpoint, ...] = ()
    # Mixed mode's routing policy (kvpool.routing.POLICIES); PD mode is always least_loaded.
    routing_policy: str = DEFAULT_MIXED_POLICY
    # Tokens per block of a token-id prompt's prefix chain. 128 is vLLM's block size on CPU
    # (the examples and tests here); on GPU vLLM's 16 divides it, so a predicted match is a
    # whole number of the instance's blocks, rounded down to 128 tokens.
    routing_block_size: int = 128
    # Characters per block of a text prompt's (or chat's) chain: about 128 tokens of text.
    routing_block_chars: int = 512
    # The load bound of prefix_aware (kvpool.routing): an instance takes a request for a
    # prefix it holds only while below load_factor x its fair share of the requests in flight.
    routing_load_factor: float = 1.25
    # Chain hashes remembered per instance (least recently used first out), an estimate of an
    # instance's own prefix cache; 100,000 blocks of 128 tokens is 12.8M tokens.
    routing_capacity_blocks: int = 100_000
    # A request that fails on one instance (connection error, timeout, 5xx) is tried on
    # another up to this many more times; 0 = one attempt only.
    max_retries: int = 3
    # Seconds to wait before each retry.
    retry_delay: float = 0.2
    # Seconds between background `GET /health` probes of every instance.
    health_interval: float = 2.0
    # Consecutive probes that time out before an instance leaves rotation. A server busy with a
    # long prefill, or on a starved host, can answer a probe late while it is serving fine;
    # taking it out at once would send all traffic to the others (and its prefix cache with it).
    # A refused connection or a non-200 answer takes it out at the first probe.
    health_timeouts: int = 3
    # Seconds to wait for a TCP connection to an instance.
    connect_timeout: float = 10.0
    # Seconds an instance may stay silent: the wait for a non-streaming answer, or between
    # two chunks of a stream. Past it the attempt fails (and is retried, if it can be).
    timeout: float = 600.0
    log_level: str = "INFO"
    # Bytes a request body may have (Content-Length or counted as it arrives); more is a 413.
    max_body_bytes: int = 16 * 1024 * 1024
    # Bytes all request bodies in the proxy, and what parsing them builds, may hold together
    # (kvpool.proxy.guard); a request past it is a 503.
    body_budget_bytes: int = 512 * 1024 * 1024
    # Seconds a request's line and headers may take to arrive, and then its body (each a 408 past it).
    request_timeout: float = 30.0
    # Connections open at once: in all, and from one client address (one more is a 503, closed).
    max_connections: int = 1024
    max_client_connections: int = 64
    # Which instances get the client's Authorization header (see ForwardAuth).
    forward_authorization: ForwardAuth = ForwardAuth.NONE
    # The admin routes' bearer token; None disables them. Not in repr: it must not reach a log.
    admin_token: str | None = dataclasses.field(default=None, repr=False)

    @property
    def mixed(self) -> bool:
        """PD-mixed mode (``--instance-*``) rather than PD disaggregation."""
        return bool(self.instances)


def _port(key: str, value: object) -> int:
    """A port as an int, or as the decimal digits of one (command-line and "host:port" strings)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ConfigError(key, value, "expected a TCP port number (1-65535)")
    return value


# One DNS label: letters, digits, '-' and '_' (common in container and cluster names).
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _host(key: str, value: object) -> str:
    """A host name or IP literal (IPv6 with or without brackets); anything else is refused.

    What makes a URL more than ``http://host:port`` (a scheme, ``/?#@``, whitespace, ``%``) is
    never accepted, so a registered host cannot point a request somewhere else.
    """
    expected = "expected a host name or IP address (no scheme, path, port, user or spaces)"
    if not isinstance(value, str) or not value or len(value) > 255:
        raise ConfigError(key, value, expected)
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        addr = ipaddress.ip_address(inner)
    except ValueError:
        addr = None
    if addr is not None and "%" not in inner:
        if inner is not value and addr.version != 6:
            raise ConfigError(key, value, expected)
        return str(addr) if addr.version == 6 else inner
    name = value[:-1] if value.endswith(".") else value
    if inner is not value or len(name) > 253 or not all(_LABEL.fullmatch(p) for p in name.split(".")):
        raise ConfigError(key, value, expected)
    return value


def validate_endpoint(key: str, host: object, port: object) -> Endpoint:
    """One instance's host and port, validated (as given to POST /instances/add)."""
    return Endpoint(_host(key, host), _port(key, port))


def endpoints(role: str, hosts: Sequence[str], ports: Sequence[object]) -> tuple[Endpoint, ...]:
    """Pair ``--{role}-hosts`` with ``--{role}-ports``: N hosts with N ports, or one host for all."""
    hkey, pkey = f"--{role}-hosts", f"--{role}-ports"
    hosts, ports = list(hosts), list(ports)
    if not hosts and not ports:
        return ()
    if not ports:
        raise ConfigError(pkey, "no ports", f"{hkey} needs ports to go with its {len(hosts)} host(s)")
    if not hosts:
        raise ConfigError(hkey, "no hosts", f"{pkey} needs hosts to go with its {len(ports)} port(s)")
    if len(hosts) == 1:
        hosts = hosts * len(ports)
    elif len(hosts) != len(ports):
        raise ConfigError(f"{hkey}/{pkey}", f"{len(hosts)} hosts and {len(ports)} ports",
                          "give one host per port, or a single host for all the ports")
    result = [Endpoint(_host(hkey, h), _port(pkey, p)) for h, p in zip(hosts, ports)]
    seen: set[str] = set()
    for ep in result:
        if ep.key in seen:
            raise ConfigError(f"--{role}-hosts/--{role}-ports", ep.key, "an instance is listed twice")
        seen.add(ep.key)
    return tuple(result)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ProxyConfig()
    parser.add_argument("--host", default=d.host,
                        help=f"address to listen on (default {d.host}; 0.0.0.0 listens on every interface)")
    parser.add_argument("--port", type=int_arg, default=d.port, help=f"port to listen on (default {d.port})")
    parser.add_argument("--prefiller-hosts", nargs="*", default=[], metavar="HOST",
                        help="prefill (kv_producer) instances' hosts: one per --prefiller-ports entry, or one for all")
    parser.add_argument("--prefiller-ports", nargs="*", default=[], metavar="PORT",
                        help="prefill instances' OpenAI server ports")
    parser.add_argument("--decoder-hosts", nargs="*", default=[], metavar="HOST",
                        help="decode (kv_consumer) instances' hosts: one per --decoder-ports entry, or one for all")
    parser.add_argument("--decoder-ports", nargs="*", default=[], metavar="PORT",
                        help="decode instances' OpenAI server ports")
    parser.add_argument("--instance-hosts", nargs="*", default=[], metavar="HOST",
                        help="PD-mixed (kv_both) instances' hosts: one per --instance-ports entry, or one for all; "
                             "not with --prefiller-*/--decoder-* (each request goes once to one instance)")
    parser.add_argument("--instance-ports", nargs="*", default=[], metavar="PORT",
                        help="PD-mixed instances' OpenAI server ports")
    routing = parser.add_argument_group(
        "routing (PD-mixed instances)", "Which --instance-* instance serves a request; PD mode always takes the "
        "least-loaded instance of each role. See docs/proxy.md.")
    # Checked in config_from_args against kvpool.routing.POLICIES (that module needs numpy,
    # which `kvpool --help` should not load).
    routing.add_argument("--routing-policy", default=None, metavar="POLICY",
                         help=f"round_robin, least_loaded (fewest requests in flight) or prefix_aware (where the "
                              f"prompt's leading blocks went before, within a load bound; else least loaded); "
                              f"default {DEFAULT_MIXED_POLICY}")
    routing.add_argument("--routing-block-size", metavar="TOKENS", type=int_arg, default=d.routing_block_size,
                         help="tokens per prefix block of a token-id prompt (default "
                              f"{d.routing_block_size}: vLLM's CPU block size, a multiple of its GPU one)")
    routing.add_argument("--routing-block-chars", metavar="CHARS", type=int_arg, default=d.routing_block_chars,
                         help=f"characters per prefix block of a text prompt or chat (default {d.routing_block_chars})")
    routing.add_argument("--routing-load-factor", metavar="FACTOR", type=float, default=d.routing_load_factor,
                         help="prefix_aware's bound: an instance takes a request for a prefix it holds only while its "
                              "requests in flight are below this times its fair share (default "
                              f"{d.routing_load_factor}; >= 1)")
    routing.add_argument("--routing-capacity-blocks", metavar="BLOCKS", type=int_arg, default=d.routing_capacity_blocks,
                         help="prefix blocks remembered per instance, least recently used first out (default "
                              f"{d.routing_capacity_blocks})")
    parser.add_argument("--max-retries", type=int_arg, default=d.max_retries,
                        help="after a failed attempt (connection error, timeout, 5xx), try another instance "
                             f"up to this many more times (default {d.max_retries})")
    parser.add_argument("--retry-delay", type=float, default=d.retry_delay,
                        help=f"seconds to wait before each retry (default {d.retry_delay})")
    parser.add_argument("--health-interval", type=float, default=d.health_interval,
                        help="seconds between GET /health probes; a failed instance returns to rotation "
                             f"when a probe succeeds (default {d.health_interval})")
    parser.add_argument("--health-timeouts", type=int_arg, default=d.health_timeouts,
                        help="consecutive GET /health probes that time out before an instance leaves rotation; "
                             "a refused connection or a non-200 answer takes it out at once "
                             f"(default {d.health_timeouts})")
    parser.add_argument("--connect-timeout", type=float, default=d.connect_timeout,
                        help=f"seconds to wait for a connection to an instance (default {d.connect_timeout})")
    parser.add_argument("--timeout", type=float, default=d.timeout,
                        help="seconds an instance may stay silent (whole non-streaming answer, or between "
                             f"stream chunks) before the attempt fails (default {d.timeout})")
    security = parser.add_argument_group(
        "security", f"The admin routes (GET /instances, POST /instances/add and /instances/remove) are disabled "
        f"unless the environment variable {ADMIN_TOKEN_ENV} holds a token ({ADMIN_TOKEN_MIN_LENGTH}+ characters); "
        "requests to them then send 'Authorization: Bearer <token>'. Instances given by the flags above need none.")
    security.add_argument("--max-body-bytes", type=int_arg, default=d.max_body_bytes,
                        help="largest request body accepted, in bytes; a larger one is answered 413 before "
                             f"it is read (default {d.max_body_bytes}, 16 MiB)")
    security.add_argument("--body-budget-bytes", type=int_arg, default=d.body_budget_bytes,
                        help="bytes all request bodies being served, and what parsing them builds, may hold "
                             "together; a request past it is answered 503 (default "
                             f"{d.body_budget_bytes}, 512 MiB; at least --max-body-bytes x 4)")
    security.add_argument("--request-timeout", type=float, default=d.request_timeout,
                        help="seconds a request's line and headers may take to arrive, and then its body; "
                             f"past it a 408 and the connection is closed (default {d.request_timeout})")
    security.add_argument("--max-connections", type=int_arg, default=d.max_connections,
                        help=f"connections open at once; one more is answered 503 (default {d.max_connections})")
    security.add_argument("--max-client-connections", type=int_arg, default=d.max_client_connections,
                        help="connections open at once from one client address; one more is answered 503 "
                             f"(default {d.max_client_connections})")
    security.add_argument("--forward-authorization", default=d.forward_authorization.value,
                        choices=[m.value for m in ForwardAuth],
                        help="pass the client's Authorization header on to: no instance (none, the default), "
                             "the instances given on this command line (static), or also those added with "
                             "POST /instances/add (all)")
    parser.add_argument("--log-level", default=d.log_level, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="log level of the proxy and its web server (default %(default)s)")


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ProxyConfig:
    """The validated config; :class:`ConfigError` names the argument that is wrong.

    ``env`` (default: the process environment) supplies the admin token.
    """
    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", args.port, "expected a TCP port number (0-65535)")
    if args.max_retries < 0:
        raise ConfigError("--max-retries", args.max_retries, "expected 0 or more")
    if not (math.isfinite(args.retry_delay) and args.retry_delay >= 0):
        raise ConfigError("--retry-delay", args.retry_delay, "expected a number of seconds >= 0")
    for name in ("health_interval", "connect_timeout", "timeout", "request_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError("--" + name.replace("_", "-"), value, "expected a number of seconds > 0")
    if args.health_timeouts < 1:
        raise ConfigError("--health-timeouts", args.health_timeouts, "expected a whole number >= 1")
    if args.max_body_bytes < 1024:
        raise ConfigError("--max-body-bytes", args.max_body_bytes, "expected a number of bytes >= 1024")
    if args.body_budget_bytes < 4 * args.max_body_bytes:
        # A body's parsed tree is charged too, at up to ~4x its bytes for ordinary requests.
        raise ConfigError("--body-budget-bytes", args.body_budget_bytes,
                          f"expected at least 4 x --max-body-bytes ({4 * args.max_body_bytes})")
    for name in ("max_connections", "max_client_connections"):
        if getattr(args, name) < 1:
            raise ConfigError("--" + name.replace("_", "-"), getattr(args, name), "expected a whole number >= 1")
    prefillers = endpoints("prefiller", args.prefiller_hosts, args.prefiller_ports)
    decoders = endpoints("decoder", args.decoder_hosts, args.decoder_ports)
    instances = endpoints("instance", args.instance_hosts, args.instance_ports)
    if instances and (prefillers or decoders):
        raise ConfigError("--instance-hosts/--instance-ports", f"{len(instances)} instance(s) with "
                          f"{len(prefillers)} prefiller(s) and {len(decoders)} decoder(s)",
                          "PD-mixed instances or prefill/decode instances, not both: give --instance-* alone "
                          "(mixed), or --prefiller-* with --decoder-* (PD disaggregation), and run one proxy each")
    admin_token = admin_token_from(os.environ if env is None else env, ADMIN_TOKEN_ENV)
    if admin_token is None and not instances and not (prefillers and decoders):
        # Such a proxy would start and answer every request 503: nothing could ever be added.
        raise ConfigError("--instance-hosts/--prefiller-hosts/--decoder-hosts",
                          f"{len(prefillers)} prefiller(s), {len(decoders)} decoder(s), 0 instances",
                          "instances to route to: --instance-hosts with --instance-ports (PD-mixed), or "
                          "--prefiller-* and --decoder-* (PD disaggregation); or KVPOOL_PROXY_ADMIN_TOKEN set, "
                          "to add them at runtime through the admin routes")
    from kvpool.routing import POLICIES

    policy = args.routing_policy
    if policy is not None and policy not in POLICIES:
        raise ConfigError("--routing-policy", policy, f"one of {', '.join(POLICIES)}")
    if not instances and policy not in (None, PD_POLICY):
        raise ConfigError("--routing-policy", policy, f"{PD_POLICY} or nothing without --instance-*: PD mode always "
                          "picks the least-loaded instance of each role; the policies route PD-mixed instances")
    for flag, value, low in (("--routing-block-size", args.routing_block_size, 1),
                             ("--routing-block-chars", args.routing_block_chars, 1),
                             ("--routing-capacity-blocks", args.routing_capacity_blocks, 1)):
        if value < low:
            raise ConfigError(flag, value, f"expected a whole number >= {low}")
    if not (math.isfinite(args.routing_load_factor) and args.routing_load_factor >= 1):
        raise ConfigError("--routing-load-factor", args.routing_load_factor, "expected a number >= 1, e.g. 1.25")
    return ProxyConfig(
        host=_host("--host", args.host),
        port=args.port,
        prefillers=prefillers,
        decoders=decoders,
        instances=instances,
        routing_policy=(policy or DEFAULT_MIXED_POLICY) if instances else PD_POLICY,
        routing_block_size=args.routing_block_size,
        routing_block_chars=args.routing_block_chars,
        routing_load_factor=args.routing_load_factor,
        routing_capacity_blocks=args.routing_capacity_blocks,
        max_retries=args.max_retries,
        retry_delay=args.retry_delay,
        health_interval=args.health_interval,
        health_timeouts=args.health_timeouts,
        connect_timeout=args.connect_timeout,
        timeout=args.timeout,
        log_level=args.log_level,
        max_body_bytes=args.max_body_bytes,
        body_budget_bytes=args.body_budget_bytes,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        max_client_connections=args.max_client_connections,
        forward_authorization=ForwardAuth(args.forward_authorization),
        admin_token=admin_token,
    )
