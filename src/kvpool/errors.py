"""Error codes and exceptions shared by every layer of kvpool.

Codes reuse Mooncake Store's names and numbers so that a log line or the spec's
troubleshooting section reads the same whichever backend produced it.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mooncake-compatible result codes (0 is success, everything else is negative)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNAVAILABLE_IN_CURRENT_STATUS = -1000


# The codes as plain ints, for the data paths that build per-key code lists.
OK = int(ErrorCode.OK)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
INVALID = int(ErrorCode.INVALID_PARAMS)
INVALID_KEY = int(ErrorCode.INVALID_KEY)
NO_HANDLE = int(ErrorCode.NO_AVAILABLE_HANDLE)
RPC_FAIL = int(ErrorCode.RPC_FAIL)
RPC_TIMEOUT = int(ErrorCode.RPC_TIMEOUT)
INTERNAL = int(ErrorCode.INTERNAL_ERROR)
LEASE_EXPIRED = int(ErrorCode.LEASE_EXPIRED)
CHECKSUM_MISMATCH = int(ErrorCode.CHECKSUM_MISMATCH)


# What a put may answer for a key the pool now holds: written by this put (OK), or stored
# before it and left as it was (OBJECT_ALREADY_EXISTS). Keys name content, so both mean the
# caller's bytes are in the pool.
STORED: frozenset[int] = frozenset({OK, EXISTS})


def code_name(code: int) -> str:
    """The error code's name for logs and the failures counter (its number if it is not one of
    ours: a store may answer others, and a log line must never fail the transfer it reports)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def is_stored(code: int) -> bool:
    """Whether a put's code means the key is in the pool (OK or OBJECT_ALREADY_EXISTS)."""
    return code in STORED


class KVPoolError(Exception):
    """Base of every kvpool exception; carries a Mooncake-compatible code."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"[{self.code.name} {int(self.code)}] {super().__str__()}"


_MAX_SHOWN = 200


def shown_value(value: object) -> str:
    """`repr(value)` for a message, cut short: a config can carry a megabyte string, or an
    integer too long for `repr` (Python refuses over 4300 digits)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN - 40]}... ({len(text)} characters)"


class ConfigError(KVPoolError):
    """A configuration value is invalid; raised at start-up, never mid-request.

    The message names the key, the value that was given and what is expected.
    """

    code = ErrorCode.INVALID_PARAMS

    def __init__(self, key: str, value: object, expected: str) -> None:
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{key}={shown_value(value)} is invalid: {expected}")


class StoreError(KVPoolError):
    """A store operation failed with the given code (for one key or a whole call)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message, code)


class BackendUnavailable(KVPoolError):
    """The backend's service cannot be reached; callers treat it as a miss."""

    code = ErrorCode.RPC_FAIL
