"""Reading a request body and checking it before the proxy acts on it.

Every failure here is the sender's fault and becomes a 4xx with a message, never a 500:

- size: a body over ``--max-body-bytes`` is a 413. A ``Content-Length`` over the limit is
  refused before a byte of the body is read; a body without one (chunked) is counted as it
  arrives and refused as soon as it passes the limit, so the proxy never holds more than the
  limit of one request's body;
- time: the body must arrive within ``--request-timeout`` of its headers (408);
- memory: the body's bytes, then a bound of what parsing it builds (`tree_cost`, computed
  before it is parsed), are charged to the proxy's `guard.BodyBudget` until the request ends;
  past the budget the request is a 503 and nothing is parsed (16 MiB of ``[{},{},...]`` would
  build 5 million dicts, 800 MiB);
- JSON: strict JSON only. ``NaN``/``Infinity`` literals (Python's ``json`` accepts them, JSON
  does not, and the proxy could not send them on), numbers past a double's range (``1e400``:
  Python reads them as infinity, which cannot be sent on either), nesting deeper than
  :data:`MAX_JSON_DEPTH`, text that is not UTF-8, and strings with lone surrogates (they cannot
  be re-encoded) are 400s;
- shape: a completion body is an object, and the fields the proxy itself reads have the types
  the OpenAI API gives them (:data:`FIELD_TYPES`).

The same strict parser reads the instances' answers (:func:`parse_json`), where a failure is
the instance's and the caller answers 502.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from kvpool.proxy.guard import BodyBudget

# Deepest nesting of arrays and objects accepted. A chat request with content parts is about
# 6 deep; tool and response-format JSON schemas rarely pass 20.
MAX_JSON_DEPTH = 64

# What parsing builds, at most, per array or object and per value besides the raw bytes
# (CPython: an empty dict is 64 bytes, ~140 with its slot in a list and the allocator's rounding;
# a short string about 50 plus its slot, an int 28 plus its slot): `tree_cost` charges these.
CONTAINER_COST = 160
VALUE_COST = 64

# The completion fields the proxy reads or rewrites, and the JSON types each may have
# (None: null). A field not listed is passed on untouched for the instance to judge.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "stream": (bool, type(None)),
    "stream_options": (dict, type(None)),
    "max_tokens": (int, type(None)),
    "max_completion_tokens": (int, type(None)),
    "min_tokens": (int, type(None)),
    "n": (int, type(None)),
    "prompt": (str, list),
    "messages": (list,),
    "kv_transfer_params": (dict, type(None)),
}
_TYPE_NAMES = {bool: "true or false", dict: "an object", int: "an integer", str: "a string", list: "an array",
               type(None): "null"}


class BadRequest(Exception):
    """The request cannot be served as sent; ``status`` and ``message`` are the answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Admission:
    """What one request's body holds of the proxy's `BodyBudget`, given back (`release`) when the
    request has been answered."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.charged = 0

    def charge(self, n: int) -> None:
        if not self.budget.take(n):
            raise BadRequest(503, f"the proxy is holding as many request bodies as it may ({self.budget.limit} "
                                  "bytes, --body-budget-bytes); retry later")
        self.charged += n

    def release(self) -> None:
        self.budget.give(self.charged)
        self.charged = 0


async def read_body(request: Request, limit: int, timeout_s: float | None = None,
                    admission: Admission | None = None) -> bytes:
    """The whole body, at most ``limit`` bytes (413 past it), within ``timeout_s`` (408), each
    chunk charged to ``admission`` as it arrives (503): :class:`BadRequest` says which."""
    too_large = f"the request body is larger than the proxy's limit of {limit} bytes (--max-body-bytes)"
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise BadRequest(400, f"Content-Length {length!r} is not a number of bytes")
        if int(length) > limit:
            raise BadRequest(413, too_large)
    chunks: list[bytes] = []
    size = 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, too_large)
            if admission is not None:
                admission.charge(len(chunk))
            chunks.append(chunk)

    try:
        async with asyncio.timeout(timeout_s):
            await receive()
    except TimeoutError:
        raise BadRequest(408, f"the request body did not arrive within {timeout_s:g} s "
                              f"(--request-timeout; {size} bytes came)") from None
    return b"".join(chunks)


def tree_cost(data: bytes) -> int:
    """An upper bound of the bytes parsing ``data`` builds, the raw bytes included, counted
    without parsing: every array or object opens with a bracket, every value but the first
    follows a comma or a colon or opens a container. The same characters inside strings count
    too, which only raises the bound (four scans at memchr speed, no copy)."""
    containers = data.count(b"{") + data.count(b"[")
    values = data.count(b",") + data.count(b":") + containers + 1
    return 2 * len(data) + CONTAINER_COST * containers + VALUE_COST * values


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (use a number or null)")


def _finite_float(text: str) -> float:
    # json reads 1e400 as inf, which no JSON encoder writes back (httpx and Starlette refuse
    # it): refused here, it is the sender's 400 rather than the proxy's 500 when sent on.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a double (about 1.8e308); send a smaller number")
    return value


def parse_json(data: bytes, what: str = "the request body", charge: Callable[[int], None] | None = None) -> Any:
    """Strict JSON (see the module docstring); :class:`BadRequest` (400) says what is wrong.
    ``charge`` is given what parsing will build (`tree_cost`) before it builds it."""
    if charge is not None:
        charge(tree_cost(data) - len(data))  # the raw bytes were charged as they arrived
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise BadRequest(400, f"{what} is not UTF-8 text") from None
    except RecursionError:
        raise BadRequest(400, f"{what} is nested deeper than {MAX_JSON_DEPTH} arrays/objects") from None
    except ValueError as exc:  # json.JSONDecodeError, our constants, too many digits in an int
        raise BadRequest(400, f"{what} is not valid JSON: {exc}") from None
    _check_tree(value, what)
    return value


def _check_tree(value: Any, what: str) -> None:
    # Iterative: the tree may be as deep as the decoder allowed (close to the recursion limit).
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise BadRequest(400, f"{what} is nested deeper than {MAX_JSON_DEPTH} arrays/objects")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str):
                    _check_str(key, what)
                stack.append((child, depth + 1))
        elif isinstance(node, str):
            _check_str(node, what)


def _check_str(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, f"{what} has a string with a lone UTF-16 surrogate (\\ud800-\\udfff)") from None


def completion_body(data: bytes, admission: Admission | None = None) -> dict[str, Any]:
    """A completion request's body, parsed and checked (see :data:`FIELD_TYPES`), what parsing
    builds charged to ``admission``."""
    body = parse_json(data, charge=admission.charge if admission is not None else None)
    if not isinstance(body, dict):
        raise BadRequest(400, f"the request body must be a JSON object, not {_json_type(body)}")
    for field, types in FIELD_TYPES.items():
        if field not in body:
            continue
        value = body[field]
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if wrong:
            names = " or ".join(_TYPE_NAMES[t] for t in types)
            raise BadRequest(400, f'"{field}" must be {names}, not {_json_type(value)}')
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise BadRequest(400, f'"{field}" must be 0 or more, not {value}')
    return body


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, float):
        return "a number with a fraction"
    for t, name in _TYPE_NAMES.items():
        if isinstance(value, t):
            return name
    return type(value).__name__
