"""The request trace format: its reader (``kvpool plan``) and its writer (the connector's
``block_hash_log``), so both sides agree on one definition.

One JSON object per line, one line per request, in arrival order (the Mooncake FAST'25 trace
format; the connector writes the same from vLLM's block hashes)::

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
``block_size`` (optional)
    the tokens per id. The connector's `block_hash_log` writes it, with an id for each *whole*
    block only (a partial block has no block hash in vLLM), so on such lines
    ``len(hash_ids) == input_length // block_size``; its timestamps are milliseconds since the
    epoch. A trace whose lines say their block size needs no ``--block-size``.

The writer (:class:`BlockHashLog`) makes one ``os.write`` per line on an ``O_APPEND`` descriptor,
so the lines of several schedulers (data-parallel ranks) sharing a file never interleave within a
line. A log holds no token and no text, but the hash of a known prompt can be recognised: the
file is created 0600 and never followed through a symlink.

Other keys are ignored; blank lines are skipped. Requests are replayed in timestamp order
(a stable sort, so equal timestamps keep their line order), from the first one's arrival.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
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
    "block_size": "an integer > 0: tokens per id (lines the connector's block_hash_log wrote)",
}
_AT = re.compile(r"`\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace (see the module docstring)."""

    timestamp: NonNegative
    input_length: NonNegative
    output_length: NonNegative
    hash_ids: list[NonNegative]
    block_size: Annotated[int, msgspec.Meta(gt=0)] | None = None


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


def parse_lines(lines: Iterable[bytes | str], block_size: int | None = DEFAULT_BLOCK_SIZE,
                source: str = "trace") -> Trace:
    """Parse trace lines; ConfigError naming ``source:line``, the field and the fix on the first bad one.

    ``block_size`` None: the lines' own ``block_size``, or DEFAULT_BLOCK_SIZE where they have none.
    """
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size <= 0):
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
        if block_size is None:
            block_size = req.block_size or DEFAULT_BLOCK_SIZE
        if req.block_size is not None and req.block_size != block_size:
            raise ConfigError(f"{source}:{lineno} block_size", req.block_size,
                              f"the block size of the rest of the trace ({block_size}); fix line {lineno} "
                              "or plan each block size's lines on their own")
        if req.block_size is None:
            want = math.ceil(req.input_length / block_size)
            rule = f"ceil(input_length / block_size) = ceil({req.input_length} / {block_size})"
        else:
            want, rule = req.input_length // block_size, f"input_length // block_size = {req.input_length} // {block_size}"
        if len(req.hash_ids) != want:
            raise ConfigError(
                f"{source}:{lineno} hash_ids", f"{len(req.hash_ids)} ids",
                f"{rule} = {want} ids; fix line {lineno} or pass the block size the trace was cut at (--block-size)")
        requests.append(req)
    if not requests or block_size is None:
        raise ConfigError(source, "no requests", "at least one request line (see docs/plan.md for the format)")
    requests.sort(key=lambda r: r.timestamp)  # stable: equal arrivals keep their order
    t0 = requests[0].timestamp
    if t0:
        requests = [msgspec.structs.replace(r, timestamp=r.timestamp - t0) for r in requests]
    return Trace(requests, block_size)


def read_trace(path: str, block_size: int | None = DEFAULT_BLOCK_SIZE) -> Trace:
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


def block_id(block_hash: bytes) -> int:
    """A vLLM block hash as a non-negative 63-bit id (its last 8 bytes: the hash's own bits)."""
    return int.from_bytes(bytes(block_hash)[-8:], "little") >> 1


class BlockHashLog:
    """Appends one line per finished request to a trace file (see the module docstring)."""

    def __init__(self, path: str, block_size: int) -> None:
        self.path = path
        self.block_size = block_size
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError("block_hash_log", path,
                              f"a file this process may create or append to ({exc.strerror})") from None
        self._encoder = msgspec.json.Encoder()

    def record(self, arrival_time_s: float, prompt_tokens: int, output_tokens: int,
               block_hashes: Sequence[bytes]) -> None:
        """Log one finished request: the ids of its prompt's whole blocks only, arrival in epoch ms."""
        whole = prompt_tokens // self.block_size
        line = TraceRequest(int(arrival_time_s * 1000), prompt_tokens, output_tokens,
                            [block_id(h) for h in block_hashes[:whole]], self.block_size)
        os.write(self._fd, self._encoder.encode(line) + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
