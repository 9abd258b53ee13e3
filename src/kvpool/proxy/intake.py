"""Reading a request body and checking it before the proxy acts on it.

Every failure here is the sender's fault and becomes a 4xx with a message, never a 500:

- size: a body over ``--max-body-bytes`` is a 413. A ``Content-Length`` over the limit is
  refused before a byte of the body is read; a body without one (chunked) is counted as it
  arrives and refused as soon as it passes the limit, so the proxy never holds more than the
  limit of one request's body;
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

import json
import math
from typing import Any

from starlette.requests import Request

# Deepest nesting of arrays and objects accepted. A chat request with content parts is about
# 6 deep; tool and response-format JSON schemas rarely pass 20.
MAX_JSON_DEPTH = 64

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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; :class:`BadRequest` (413) past it."""
    too_large = f"the request body is larger than the proxy's limit of {limit} bytes (--max-body-bytes)"
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise BadRequest(400, f"Content-Length {length!r} is not a number of bytes")
        if int(length) > limit:
            raise BadRequest(413, too_large)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, too_large)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (use a number or null)")


def _finite_float(text: str) -> float:
    # json reads 1e400 as inf, which no JSON encoder writes back (httpx and Starlette refuse
    # it): refused here, it is the sender's 400 rather than the proxy's 500 when sent on.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a double (about 1.8e308); send a smaller number")
    return value


def parse_json(data: bytes, what: str = "the request body") -> Any:
    """Strict JSON (see the module docstring); :class:`BadRequest` (400) says what is wrong."""
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


def completion_body(data: bytes) -> dict[str, Any]:
    """A completion request's body, parsed and checked (see :data:`FIELD_TYPES`)."""
    body = parse_json(data)
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
