"""The block-hash log: one line per finished request, in the request-trace format `kvpool plan` reads.

With `block_hash_log: PATH`, the scheduler appends a JSON line per finished request:
`{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...], "block_size": B}`,
the format of the Mooncake FAST'25 traces (docs/plan.md) plus the block size. `timestamp` is the
request's arrival in milliseconds since the epoch; `hash_ids` are the prompt's whole blocks, each
vLLM's chained block hash cut to 63 bits, so equal ids mean equal prefixes up to that block, as in
those traces. It holds no token and no text, but a hash of a known prompt can be recognised, so
the file is created 0600, and never followed through a symlink.

One `os.write` per line on an `O_APPEND` descriptor: lines of several schedulers (data-parallel
ranks) sharing one file never interleave within a line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec

from kvpool.errors import ConfigError


class HashLogLine(msgspec.Struct, frozen=True):
    """One request, as a trace line."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_size: int


def block_id(block_hash: bytes) -> int:
    """A vLLM block hash as a non-negative 63-bit id (its last 8 bytes: the hash's own bits)."""
    return int.from_bytes(bytes(block_hash)[-8:], "little") >> 1


class BlockHashLog:
    """Appends requests to the log file (see the module docstring)."""

    def __init__(self, path: str, block_size: int) -> None:
        self.path = path
        self.block_size = block_size
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError("block_hash_log", path, f"a file this process may create or append to ({exc.strerror})") from None
        self._encoder = msgspec.json.Encoder()

    def record(self, arrival_time_s: float, prompt_tokens: int, output_tokens: int,
               block_hashes: Sequence[bytes]) -> None:
        """Log one finished request: the hashes of its prompt's whole blocks only."""
        whole = prompt_tokens // self.block_size
        line = HashLogLine(int(arrival_time_s * 1000), prompt_tokens, output_tokens,
                           [block_id(h) for h in block_hashes[:whole]], self.block_size)
        os.write(self._fd, self._encoder.encode(line) + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
