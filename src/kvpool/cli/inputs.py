"""What the CLI reads from places an operator points it at, read with a deadline and a size bound.

A metrics URL may trickle bytes or never stop sending, a `@file` may be `/dev/zero`, JSON may
nest a hundred thousand levels or put text where numbers belong. Each reader here gives up with
`InputError`, one line that says what was wrong with which input, never a hang, a MemoryError or
a traceback.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpx

MAX_HTTP_BYTES = 16 << 20  # a /stats or /metrics answer of a large pool is tens of KiB
MAX_FILE_BYTES = 1 << 20  # a kv-transfer-config is a few hundred bytes

T = TypeVar("T")


class InputError(ValueError):
    """An input was unreachable, too slow, too large or not what it should be (one-line message)."""


def within(deadline_s: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, or InputError once ``deadline_s`` passed without its answer (the call is left to
    finish on a daemon thread: its own timeouts end it)."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            out.append((False, exc))

    worker = threading.Thread(target=call, name="kvpool-cli-read", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if not out:
        raise InputError(f"{what}: no complete answer within {deadline_s:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def http_get(url: str, timeout_s: float, max_bytes: int = MAX_HTTP_BYTES) -> bytes:
    """The body of GET ``url``: all of it within ``timeout_s`` (bytes trickling in do not extend
    it) and at most ``max_bytes``."""
    status, body = http_request(url, timeout_s, max_bytes=max_bytes)
    if status >= 400:
        raise InputError(f"{url}: HTTP {status}")
    return body


def http_request(url: str, timeout_s: float, method: str = "GET", body: bytes | None = None,
                 headers: dict[str, str] | None = None, max_bytes: int = MAX_HTTP_BYTES) -> tuple[int, bytes]:
    """The status and body of one request to ``url``, whatever the status: all of the body within
    ``timeout_s`` (bytes trickling in do not extend it) and at most ``max_bytes``."""

    def call() -> tuple[int, bytes]:
        out = bytearray()
        with httpx.Client(timeout=timeout_s, trust_env=False) as client, \
                client.stream(method, url, content=body, headers=headers) as resp:
            for chunk in resp.iter_raw():
                out += chunk
                if len(out) > max_bytes:
                    raise InputError(f"{url}: the answer is larger than {max_bytes} bytes; is this the right URL?")
            return resp.status_code, bytes(out)

    try:
        return within(timeout_s, url, call)
    except httpx.HTTPError as exc:
        raise InputError(f"{url}: {type(exc).__name__}: {exc or 'no answer'}") from None


def read_file(path: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """A text file of at most ``max_bytes`` (a device or a pipe that never ends is refused)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"{path}: larger than {max_bytes} bytes; is this the right file?")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def loads(text: str | bytes, what: str) -> Any:
    """JSON, with nesting too deep for the parser an InputError, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:
        raise InputError(f"{what}: not JSON ({exc})") from None


def numbers(values: dict[str, Any], keys: Iterable[str], what: str) -> dict[str, Any]:
    """``values``, after checking that each of ``keys`` it has is a finite number (not a bool)."""
    for key in keys:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"{what}: {key}={value!r} is not a finite number; is this a kvpool endpoint?")
    return values
