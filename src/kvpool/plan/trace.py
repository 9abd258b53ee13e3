"""The request trace format ``kvpool plan`` reads, and its reader.

One JSON object per line, one line per request, in arrival order (the Mooncake FAST'25 trace
format; the connector writes the same from vLLM's pool block hashes)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 2353]}

``timestamp``
    arrival, integer milliseconds from the start of the trace (>= 0);
``input_length`` / ``output_length``
    prompt and generated tokens (>= 0);
``hash_ids``
    one id per ``block_size``-token block of the prompt, the last one possibly partial, so
    ``len(hash_ids) == ceil(input_length / block_size)``. Equal ids are equal KV: an id stands
    for its block *and* everything before it (a prefix hash), so two requests share their first
    ``n`` blocks exactly when they share their first ``n`` ids.

Other keys are ignored; blank lines are skipped. Requests are replayed in timestamp order
(a stable sort, so equal timestamps keep their line order).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from kvpool.errors import ConfigError

DEFAULT_BLOCK_SIZE = 512

NonNegative = Annotated[int, msgspec.Meta(ge=0)]

# What each field must be, for the error that names a bad one.
_EXPECTED = {
    "timestamp": "an integer >= 0: arrival in ms from the start of the trace",
    "input_length": "an integer >= 0: prompt tokens",
    "output_length": "an integer >= 0: generated tokens",
    "hash_ids": "a list of integers >= 0, one per block of the prompt",
}
_AT = re.compile(r"`\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace (see the module docstring)."""

    timestamp: NonNegative
    input_length: NonNegative
    output_length: NonNegative
    hash_ids: list[NonNegative]


@dataclass(frozen=True)
class Trace:
    """A parsed trace: its requests in arrival order and the block size its ids are cut at."""

    requests: list[TraceRequest]
    block_size: int

    @property
    def block_refs(self) -> int:
        """Block references over all requests (what a hit rate is a fraction of)."""
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        return len({h for r in self.requests for h in r.hash_ids})


_DECODER = msgspec.json.Decoder(TraceRequest)


def parse_lines(lines: Iterable[bytes | str], block_size: int = DEFAULT_BLOCK_SIZE,
                source: str = "trace") -> Trace:
    """Parse trace lines; ConfigError naming ``source:line``, the field and the fix on the first bad one."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("block_size", block_size, "a positive int of tokens per block, e.g. 512")
    requests: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            req = _DECODER.decode(line)
        except msgspec.ValidationError as exc:
            raise _line_error(source, lineno, str(exc), line) from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{source}:{lineno}", _shown(line),
                              f"one JSON object per line ({exc}); fix line {lineno} of the trace") from None
        want = math.ceil(req.input_length / block_size)
        if len(req.hash_ids) != want:
            raise ConfigError(
                f"{source}:{lineno} hash_ids", f"{len(req.hash_ids)} ids",
                f"ceil(input_length / block_size) = ceil({req.input_length} / {block_size}) = {want} ids; "
                f"fix line {lineno} or pass the block size the trace was cut at (--block-size)")
        requests.append(req)
    if not requests:
        raise ConfigError(source, "no requests", "at least one request line (see docs/plan.md for the format)")
    requests.sort(key=lambda r: r.timestamp)  # stable: equal arrivals keep their order
    return Trace(requests, block_size)


def read_trace(path: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Read a trace file (see the module docstring for the format)."""
    try:
        with open(path, "rb") as f:
            return parse_lines(f, block_size, source=path)
    except OSError as exc:
        raise ConfigError("trace", path, f"a readable trace file ({exc.strerror})") from None


def _line_error(source: str, lineno: int, problem: str, line: bytes | str) -> ConfigError:
    m = _AT.search(problem) or _MISSING.search(problem)
    if m is None:
        return ConfigError(f"{source}:{lineno}", _shown(line),
                           f"a JSON object with the fields {', '.join(_EXPECTED)} ({problem}); fix line {lineno}")
    name = m.group(1)
    expected = _EXPECTED.get(name, "a valid value")
    return ConfigError(f"{source}:{lineno} {name}", problem,
                       f"{expected}; fix line {lineno} of the trace")


def _shown(line: bytes | str) -> str:
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    return text.strip()[:120]
