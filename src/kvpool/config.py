"""Every setting kvpool accepts, declared once as msgspec structs, and the one parser for them.

Three surfaces read these schemas: the connector's `kv_connector_extra_config` (`load_config`),
the settings of the pool engine shared by `backend: local` and `kvpool server`
(`EngineSettings`), and `kvpool server`'s command-line flags (`ServerSettings`,
`add_flags`/`from_flags`). A field's type and `msgspec.Meta` say what it accepts: its kind
(`extra={"kind": ...}`: a byte size, a duration, a port, a path ...), its bounds (`ge`, `gt`,
`le`, `lt`; every number has both a lower and an upper one, and `extra={"zero": "what 0 means"}`
admits 0 besides them where 0 switches something off) and its help text (`description`). One
function per kind parses a value whatever the surface, so "4GB", "true" and "500ms" mean the
same everywhere, and an error always names the key the user wrote, the value and what is
expected (the range included), with "did you mean" for a misspelt key. Whatever JSON value a
key is given, parsing returns a value inside its bounds or raises `ConfigError`. The docs' table
of ranges is generated from the same declarations (`bounds_table`).

Each backend's own keys are a `BackendSettings` subclass naming its backend; that class is the
backend's config schema in the registry (`kvpool.backends.registry`), and the list of backend
names derives from those classes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hmac
import ipaddress
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import msgspec.inspect as mi

from kvpool.errors import ConfigError
from kvpool.keys import tenant_tag
from kvpool.paths import default_server_socket, validate_offload_path
from kvpool.store import DiskTier, EngineConfig
from kvpool.store.controls import MAX_PIN_S
from kvpool.store.policy import DISK_POLICIES, MEMORY_POLICIES, DiskPolicy, MemoryPolicy

Meta = msgspec.Meta

ROLES = ("kv_producer", "kv_consumer", "kv_both")
SSD_POLICIES = DISK_POLICIES
KiB, MiB, GiB, TiB, PiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50
# Where `kvpool server` listens and `backend: server` connects unless told otherwise: in the
# per-user runtime directory (kvpool.paths), which no other user can create entries in.
DEFAULT_SERVER_SOCKET = default_server_socket()
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes including the terminating NUL
DAY_S = 86_400.0
# Counts no deployment comes near (the largest models have a few hundred layers); a larger value
# is a typo.
MAX_PP_SIZE = 1024
MAX_LAYERS = 1 << 16
# Pinned host memory per worker for the staging path (half for loads, half for saves): a
# 4K-token hit of a 7B model (~2 GiB of KV) moves in a few rounds.
DEFAULT_STAGING_BYTES = 512 * MiB

# ---- one parser per kind ------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kb": KiB, "kib": KiB,
    "m": MiB, "mb": MiB, "mib": MiB,
    "g": GiB, "gb": GiB, "gib": GiB,
    "t": TiB, "tb": TiB, "tib": TiB,
    "p": PiB, "pb": PiB, "pib": PiB,
}
# ASCII digits only: `\d`, str.isdigit(), int() and float() also accept other scripts' digits
# ("١", "１"), which no config means as a number.
_NUMBER_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_SIGNED_RE = re.compile(r"^\s*([+-]?[0-9]+(?:\.[0-9]+)?)\s*$", re.ASCII)
_INT_RE = re.compile(r"^\s*([+-]?[0-9]+)\s*$", re.ASCII)
_OCTAL_RE = re.compile(r"^\s*(0o|0)?([0-7]{1,4})\s*$", re.ASCII)
# No key's bound comes near this; larger numbers are refused before float() or int() can
# overflow, and before a 10**400 reaches a comparison with a float bound.
_MAX_MAGNITUDE = 2**63
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# The largest size any surface accepts: no host addresses a petabyte of memory or disk, so a
# larger value is a typo ("100000000TB"), not a configuration.
MAX_SIZE = PiB
SIZE_EXPECTED = 'a non-negative byte count: an integer or a number with a unit B/KB/MB/GB/TB/PB, e.g. "4GB"'


def human_size(n: float) -> str:
    """Bytes as the largest binary unit that divides them ("1MB", "512MB", "1536KB")."""
    n = int(n)
    for unit, size in (("PB", PiB), ("TB", TiB), ("GB", GiB), ("MB", MiB), ("KB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _size_bytes(key: str, value: Any) -> int:
    """Any non-negative size, unbounded above but never an overflow: the caller checks the range."""
    if isinstance(value, bool):
        raise ConfigError(key, value, SIZE_EXPECTED)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, value, SIZE_EXPECTED)
        return value
    if isinstance(value, float):
        if not 0 <= value < math.inf:  # also rejects NaN
            raise ConfigError(key, value, SIZE_EXPECTED)
        return int(value)
    if isinstance(value, str):
        m = _NUMBER_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            # float() of a few hundred digits is inf, not an error
            return int(n) if math.isfinite(n) else _MAX_MAGNITUDE
    raise ConfigError(key, value, SIZE_EXPECTED)


# A shorter admin token (the proxy's, the server's controller's) is refused: it could be guessed.
ADMIN_TOKEN_MIN_LENGTH = 16


def admin_token_from(env: Mapping[str, str], name: str) -> str | None:
    """The admin token in environment variable ``name``; None when unset or empty (the admin
    routes are off)."""
    token = env.get(name, "")
    if not token:
        return None
    if len(token) < ADMIN_TOKEN_MIN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(name, f"a {len(token)}-character value",
                          f"expected at least {ADMIN_TOKEN_MIN_LENGTH} printable ASCII characters without "
                          "spaces, e.g. from: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` as its bearer token, compared in
    constant time (the time taken does not tell how much of a guess was right)."""
    scheme, _, credential = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), token.encode())


def parse_size(key: str, value: Any) -> int:
    """A byte size as Mooncake writes them: an int, or "1GB" / "1024MB" / "1048576KB" / "1073741824B".

    Units are binary (1KB = 1024 bytes), as in mooncake.json; fractions ("1.5GB") round down.
    At most `MAX_SIZE` (1PB).
    """
    n = _size_bytes(key, value)
    if n > MAX_SIZE:
        raise ConfigError(key, value, f"a byte size of at most {human_size(MAX_SIZE)}")
    return n


def parse_bool(key: str, value: Any) -> bool:
    """true/false, 1/0, yes/no, on/off (any case), or a JSON boolean or 0/1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(key, value, "true or false")


def _number(key: str, value: Any, expected: str) -> float:
    """A finite JSON number or a numeric ASCII string; booleans are never numbers here."""
    if isinstance(value, bool):
        raise ConfigError(key, value, expected)
    if isinstance(value, int):
        if abs(value) > _MAX_MAGNITUDE:  # float(10**400) would raise OverflowError
            raise ConfigError(key, value, expected)
        f = float(value)
    elif isinstance(value, float):
        f = value
    elif isinstance(value, str) and (m := _SIGNED_RE.match(value)):
        f = float(m.group(1))
    else:
        raise ConfigError(key, value, expected)
    if not math.isfinite(f) or abs(f) > _MAX_MAGNITUDE:
        raise ConfigError(key, value, expected)
    return f


def parse_int(key: str, value: Any, expected: str, *, integral_floats: bool = True) -> int:
    """An integer, from an int, a string of ASCII digits or (with `integral_floats`) an
    integral float such as 3.0."""
    if isinstance(value, bool):
        raise ConfigError(key, value, expected)
    if isinstance(value, int):
        if abs(value) > _MAX_MAGNITUDE:
            raise ConfigError(key, value, expected)
        return value
    if isinstance(value, str):
        if not (m := _INT_RE.match(value)) or len(m.group(1)) > 20:
            raise ConfigError(key, value, expected)
        return int(m.group(1))
    if isinstance(value, float) and integral_floats:
        f = _number(key, value, expected)
        if f == int(f):
            return int(f)
    raise ConfigError(key, value, expected)


def parse_duration(key: str, value: Any, unit_s: float, expected: str) -> float:
    """A duration in units of `unit_s` seconds: a number in that unit, or "500ms"/"10s"/"2m"/"1h"."""
    if isinstance(value, str) and (m := _NUMBER_RE.match(value)) and m.group(2):
        scale = _DURATION_UNITS.get(m.group(2).lower())
        f = float(m.group(1)) * scale / unit_s if scale is not None else math.nan
        if not math.isfinite(f) or f > _MAX_MAGNITUDE:
            raise ConfigError(key, value, expected)
        return f
    return _number(key, value, expected)


def _path_text(key: str, value: Any, expected: str) -> str:
    """A string the OS can take as a path: no NUL, encodable (a lone surrogate from JSON's "\\ud800" is not)."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(key, value, expected)
    try:
        os.fsencode(value)
    except UnicodeError:
        raise ConfigError(key, value, expected) from None
    return value


def parse_socket_path(key: str, value: Any) -> str:
    """An absolute Unix socket path that fits in sun_path (107 bytes)."""
    expected = f"an absolute Unix socket path of at most {MAX_SOCKET_PATH} bytes, e.g. {DEFAULT_SERVER_SOCKET!r}"
    value = _path_text(key, value, expected)
    if not os.path.isabs(value) or len(os.fsencode(value)) > MAX_SOCKET_PATH:
        raise ConfigError(key, value, expected)
    return value


def _parse_file(key: str, value: Any) -> str:
    value = _path_text(key, value, "an absolute path of an existing file, e.g. /etc/kvpool/<file>")
    if not os.path.isabs(value):
        raise ConfigError(key, value, "an absolute path of an existing file, e.g. /etc/kvpool/<file>")
    if not os.path.isfile(value):
        raise ConfigError(key, value, "an existing file (it does not exist or is not a regular file)")
    return value


def _parse_output_file(key: str, value: Any) -> str:
    expected = "an absolute path of a file to write, in an existing directory, e.g. /var/log/kvpool/hashes.jsonl"
    value = _path_text(key, value, expected)
    if not os.path.isabs(value) or not os.path.isdir(os.path.dirname(value)) or os.path.isdir(value):
        raise ConfigError(key, value, expected)
    return value


def _parse_dir(key: str, value: Any) -> str:
    try:
        _path_text(key, value, "a non-empty absolute directory path, e.g. /mnt/nvme/kvpool")
        validate_offload_path(value)
    except ConfigError as exc:  # name the key as the user wrote it
        raise ConfigError(key, value, exc.expected) from None
    return value


def read_json_object(key: str, path: str, what: str) -> dict[str, Any]:
    """A store's JSON config file (mooncake.json, the Yuanrong client config) as a dict."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, path, f"a readable {what} file holding a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(key, path, f"a {what} file holding a JSON object")
    return raw


def _parse_redis_url(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(key, value, "a URL redis://[user:password@]host:port/db, rediss://... or unix:///path.sock")
    return value


def _parse_int_list(key: str, value: Any) -> tuple[int, ...]:
    expected = 'comma-separated layer counts, e.g. "30,31"'
    if isinstance(value, str):
        parts: list[Any] = value.split(",")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ConfigError(key, value, expected)
    try:
        return tuple(parse_int(key, p, expected, integral_floats=False) for p in parts)
    except ConfigError:
        raise ConfigError(key, value, expected) from None  # name the whole value, as written


def _parse_octal(key: str, value: Any) -> int:
    # A JSON number 600 is what someone writing "0600" meant; the digits are read as octal.
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 7777 else value
    if not isinstance(text, str) or not (m := _OCTAL_RE.match(text)):
        raise ConfigError(key, value, "an octal file mode such as 0600 or 0660")
    return int(m.group(2), 8)


def _parse_ip(key: str, value: Any) -> str:
    """An IPv4 or IPv6 address literal (what a listener binds; a name could resolve anywhere)."""
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else _refuse_ip(key, value)
    except ValueError:
        return _refuse_ip(key, value)


def _refuse_ip(key: str, value: Any) -> str:
    raise ConfigError(key, value, "an IP address to bind, e.g. 127.0.0.1 (loopback) or ::1")


# String kinds: parsers for str fields that need more than "is a string".
_STR_KINDS = {"ip": _parse_ip, "file": _parse_file, "output_file": _parse_output_file, "dir": _parse_dir, "socket": parse_socket_path, "redis_url": _parse_redis_url}

# ---- the schema machinery --------------------------------------------------------------------


def _number_text(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric key accepts, from its `Meta(ge=, gt=, le=, lt=)`, plus its
    `extra={"zero": "..."}`: 0 is accepted too, meaning that (a switch-off or automatic value
    below the range's sane minimum, such as a quota of 0 for "90% of the disk")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    zero: str | None = None

    def admits(self, v: float) -> bool:
        if self.zero is not None and v == 0:
            return True
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    @property
    def closed(self) -> bool:
        """Bounded on both sides (every numeric key must be: tests/unit/test_config_properties.py)."""
        return (self.ge is not None or self.gt is not None) and (self.le is not None or self.lt is not None)

    def text(self, fmt: Callable[[float], str] = _number_text) -> str:
        lo = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        hi = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        if lo and hi and lo[0] == ">=" and hi[0] == "<=":
            return f" from {fmt(lo[1])} to {fmt(hi[1])}"
        return " and".join(f" {op} {fmt(v)}" for op, v in (lo, hi) if op)


def _unwrap(t: Any) -> tuple[Any, dict[str, Any], bool]:
    """(type, extra metadata, optional) of a field's msgspec type."""
    optional = False
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        optional, t = len(rest) < len(t.types), rest[0]
    extra: dict[str, Any] = {}
    if isinstance(t, mi.Metadata):
        extra, t = dict(t.extra or {}), t.type
    return t, extra, optional


def field_bounds(ftype: Any) -> Bounds | None:
    """The `Bounds` of a numeric field (of each item, for a list of numbers); None for others."""
    t, extra, _ = _unwrap(ftype)
    if isinstance(t, mi.VarTupleType):
        t = t.item_type
    if not isinstance(t, (mi.IntType, mi.FloatType)):
        return None
    return Bounds(ge=t.ge, gt=t.gt, le=t.le, lt=t.lt, zero=extra.get("zero"))


def expected_text(ftype: Any) -> str:
    """What a field accepts, as its errors and docs/configuration.md's bounds table say it."""
    t, extra, _ = _unwrap(ftype)
    kind = extra.get("kind")
    b = field_bounds(ftype)
    why = f" ({extra['why']})" if "why" in extra else ""
    if isinstance(t, mi.VarTupleType):
        assert b is not None
        return f'comma-separated positive layer counts, e.g. "30,31": each{b.text()}, at most {t.max_length} of them'
    if b is None:
        return ""
    if kind == "size":
        text = f"a byte size{b.text(human_size)}"
    elif kind in ("seconds", "ms"):
        text = f"a number of {'seconds' if kind == 'seconds' else 'milliseconds'}{b.text()}"
    elif kind == "port":
        text = f"a port number (an integer){b.text()}"
    elif kind == "octal":
        text = "an octal mode that includes 0600, e.g. 0600 or 0660"
    elif isinstance(t, mi.IntType):  # also kind "id": an integer that names something, never 3.0
        text = f"an integer{b.text()}"
    elif t.gt is not None and t.le is not None:
        text = f"a number in ({t.gt:g}, {t.le:g}]"
    else:
        text = f"a number{b.text()}"
    zero = f"0 ({b.zero}) or " if b.zero is not None else ""
    return f"{zero}{text}{why}"


def parse_value(key: str, value: Any, ftype: Any) -> Any:
    """Parse one raw value for a field of msgspec type `ftype` (from `msgspec.inspect`)."""
    t, extra, optional = _unwrap(ftype)
    if value is None and optional:
        return None
    kind = extra.get("kind")
    if isinstance(t, mi.BoolType):
        return parse_bool(key, value)
    if isinstance(t, mi.LiteralType):
        if not any(type(value) is type(v) and value == v for v in t.values):
            raise ConfigError(key, value, f"one of {', '.join(map(str, t.values))}")
        return value
    if isinstance(t, (mi.IntType, mi.FloatType)):
        bounds = field_bounds(ftype)
        expected = expected_text(ftype)
        if bounds is None or not bounds.closed:
            raise TypeError(f"{key} declares no lower or no upper bound")  # a schema bug, not user input
        f: float
        if kind == "size":
            f = _size_bytes(key, value)
        elif kind == "octal":
            f = _parse_octal(key, value)
            if int(f) & 0o600 != 0o600:
                raise ConfigError(key, value, expected)
        elif kind in ("seconds", "ms"):
            f = parse_duration(key, value, 1.0 if kind == "seconds" else 1e-3, expected)
            if isinstance(t, mi.IntType):
                if f != int(f):
                    raise ConfigError(key, value, expected)
                f = int(f)
        elif isinstance(t, mi.IntType):
            f = parse_int(key, value, expected, integral_floats=kind not in ("port", "id"))
        else:
            f = _number(key, value, expected)
        if not bounds.admits(f):
            raise ConfigError(key, value, expected)
        return f
    if isinstance(t, mi.StrType):
        if kind in _STR_KINDS:
            return _STR_KINDS[kind](key, value)
        if not isinstance(value, str):
            raise ConfigError(key, value, "a string")
        return value
    if isinstance(t, mi.VarTupleType):
        items = _parse_int_list(key, value)
        bounds = field_bounds(ftype)
        if (bounds is None or not all(bounds.admits(v) for v in items)
                or (t.max_length is not None and len(items) > t.max_length)):
            raise ConfigError(key, value, expected_text(ftype))
        return items
    raise TypeError(f"no parser for the type of {key}: {ftype}")  # a schema bug, not user input


def fields(schema: type[msgspec.Struct]) -> dict[str, mi.Field]:
    """The schema's fields by the key users write: the field's name, or its entry in the
    schema's `KEYS` (how a surface spells a shared setting: `local_cpu_size` is the connector's
    name for the engine's `memory_size`)."""
    keys: Mapping[str, str] = getattr(schema, "KEYS", {})
    return {keys.get(f.name, f.name): f for f in mi.type_info(schema).fields}


def describe(schema: type[msgspec.Struct], key: str) -> str:
    """A field's help text (its `Meta(description=...)`)."""
    t = fields(schema)[key].type
    if isinstance(t, mi.UnionType):
        t = next(x for x in t.types if not isinstance(x, mi.NoneType))
    return (t.extra_json_schema or {}).get("description", "") if isinstance(t, mi.Metadata) else ""


def unknown_key_error(key: str, value: Any, known: set[str], surface: str) -> ConfigError:
    """ConfigError for a key no schema declares, with the closest known key as a suggestion."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(key, value, f"{hint}a known {surface} key ({', '.join(sorted(known))})")


def convert(schema: type[msgspec.Struct], raw: Mapping[str, Any], names: Mapping[str, str] | None = None) -> Any:
    """Build `schema` from `raw` (keys as users write them); unknown keys are the caller's business.

    `names` maps a key to the spelling that error messages use (e.g. a command-line flag).
    """
    names = names or {}
    values = {}
    for enc, f in fields(schema).items():
        if enc in raw:
            values[f.name] = parse_value(names.get(enc, enc), raw[enc], f.type)
    return schema(**values)


# ---- the pool engine's settings (backend `local` and `kvpool server`) ------------------------------


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (symlinks not followed; unreadable entries skipped)."""
    total, todo = 0, [path]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the pool engine is configured with; `local` and `kvpool server` spell the keys
    their own way (the subclasses' `KEYS`), the rules are these."""

    memory_size: Annotated[int, Meta(ge=MiB, le=PiB, extra={"kind": "size"},
                                      description="memory tier size, e.g. \"4GB\" (binary units)")] = 2 * GiB
    eviction_high_watermark_ratio: Annotated[float, Meta(gt=0, le=1, description=(
        "evict once usage passes this fraction of the memory tier"))] = 0.9
    eviction_ratio: Annotated[float, Meta(gt=0, le=1, description="fraction of objects evicted per eviction")] = 0.1
    eviction_policy: Annotated[MemoryPolicy, Meta(description=(
        f"which objects the memory tier evicts first ({' or '.join(MEMORY_POLICIES)}): lru, the least "
        "recently used; s3fifo, those used only once, so a scan of one-off prompts does not flush "
        "the prefixes that are reused"))] = "lru"
    default_kv_lease_ttl_ms: Annotated[int, Meta(ge=1, le=int(DAY_S * 1000), extra={"kind": "ms"}, description=(
        "lease of a looked-up or read object, in milliseconds: it is not evicted meanwhile"))] = 11000
    offload_path: Annotated[str, Meta(extra={"kind": "dir"}, description=(
        "SSD tier directory: absolute, existing, writable, no symlinks (off when unset)"))] | None = None
    # A positive quota below 1MB holds no block; 0 is the automatic quota.
    offload_quota: Annotated[int, Meta(ge=MiB, le=PiB, extra={"kind": "size", "zero": "90% of the disk's free space"},
                                       description=(
        "SSD tier byte quota (0: 90% of the disk's free space at start)"))] = 0
    offload_eviction_policy: Annotated[DiskPolicy, Meta(description=(
        f"when the SSD tier is full ({', '.join(DISK_POLICIES)}): none, writes fail; else evict, "
        "oldest written first (fifo), least recently read (lru) or written once (s3fifo)"))] = "lru"

    def engine_config(self, offload_subdir: str = "", **engine_kwargs: Any) -> EngineConfig:
        """The engine's config, with its SSD tier in `offload_path/offload_subdir` when enabled.

        A quota of 0 takes 90% of the disk's free space, as Mooncake's bucket backend does.
        """
        disk = None
        if self.offload_path:
            path = os.path.join(self.offload_path, offload_subdir) if offload_subdir else self.offload_path
            os.makedirs(path, mode=0o700, exist_ok=True)
            # The tier's own files from an earlier run count as free: otherwise every restart
            # would shrink the automatic quota by what the tier holds and evict it to fit.
            quota = self.offload_quota or int((shutil.disk_usage(path).free + _tree_bytes(path)) * 0.9)
            disk = DiskTier(path, quota, self.offload_eviction_policy)
        return EngineConfig(
            memory_size=self.memory_size,
            eviction_high_watermark_ratio=self.eviction_high_watermark_ratio,
            eviction_ratio=self.eviction_ratio,
            eviction_policy=self.eviction_policy,
            default_kv_lease_ttl_ms=self.default_kv_lease_ttl_ms,
            disk=disk,
            **engine_kwargs,
        )



# ---- the connector's `kv_connector_extra_config` --------------------------------------------------


class BackendSettings(msgspec.Struct, frozen=True, kw_only=True):
    """A backend's own `kv_connector_extra_config` keys. Subclasses set `backend`."""

    backend: ClassVar[str] = ""


class LocalSettings(EngineSettings, BackendSettings, frozen=True, kw_only=True):
    """`backend: local`: the pool engine inside the vLLM worker process (memory + SSD tier)."""

    backend: ClassVar[str] = "local"
    KEYS: ClassVar[dict[str, str]] = {
        "memory_size": "local_cpu_size", "offload_path": "ssd_offload_path", "offload_quota": "ssd_quota",
        "offload_eviction_policy": "ssd_eviction_policy"}


class ServerClientSettings(BackendSettings, frozen=True, kw_only=True):
    """`backend: server`: the host-shared pool of `kvpool server`."""

    backend: ClassVar[str] = "server"
    server_socket: Annotated[str, Meta(extra={"kind": "socket"}, description=(
        "the Unix socket of `kvpool server` (same default as its --socket)"))] = DEFAULT_SERVER_SOCKET
    allowed_gid: Annotated[int, Meta(ge=0, le=2**32 - 2, extra={"kind": "id"}, description=(
        "group sharing: also trust a server whose user is in this group (default: only our own uid)"))] | None = None


class MooncakeSettings(BackendSettings, frozen=True, kw_only=True):
    """`backend: mooncake`: Mooncake Store; its own settings are in mooncake.json."""

    backend: ClassVar[str] = "mooncake"
    mooncake_config_path: Annotated[str, Meta(extra={"kind": "file"}, description=(
        "mooncake.json (unset: $MOONCAKE_CONFIG_PATH)"))] | None = None


class YuanrongSettings(BackendSettings, frozen=True, kw_only=True):
    """`backend: yuanrong`: openYuanrong datasystem; its worker address is in its config file."""

    backend: ClassVar[str] = "yuanrong"
    yuanrong_config_path: Annotated[str, Meta(extra={"kind": "file"}, description=(
        "the Yuanrong client config (unset: $YR_CONFIG_PATH, or $DS_WORKER_ADDR alone)"))] | None = None


class MemcacheSettings(BackendSettings, frozen=True, kw_only=True):
    """`backend: memcache`: Memcache (memcache-hybrid); its settings are in mmc-local.conf."""

    backend: ClassVar[str] = "memcache"
    mmc_local_config_path: Annotated[str, Meta(extra={"kind": "file"}, description=(
        "mmc-local.conf (unset: $MMC_LOCAL_CONFIG_PATH)"))] | None = None


class RedisSettings(BackendSettings, frozen=True, kw_only=True):
    """`backend: redis`: a Redis (or Valkey) server the operator already runs."""

    backend: ClassVar[str] = "redis"
    redis_url: Annotated[str, Meta(extra={"kind": "redis_url"}, description=(
        "redis://[user:password@]host:port/db, rediss://... or unix:///path.sock"))] = "redis://127.0.0.1:6379/0"
    # Redis expires in whole milliseconds and refuses PX 0, so a positive TTL starts at 1 ms.
    redis_ttl_s: Annotated[float, Meta(ge=1e-3, le=365 * DAY_S, extra={"kind": "seconds", "zero": "never expire"},
                                       description=(
        "expire pooled objects after this long (0: never; Redis' maxmemory-policy evicts them)"))] = 0.0
    redis_chunk_size: Annotated[int, Meta(ge=MiB, le=512 * MiB, extra={"kind": "size", "why": (
        "Redis' proto-max-bulk-len")}, description="values above this are split into chunk keys")] = 64 * MiB
    redis_timeout_s: Annotated[float, Meta(ge=0.01, le=DAY_S, extra={"kind": "seconds"}, description=(
        "socket timeout of each Redis call"))] = 5.0



def backend_schemas() -> dict[str, type[BackendSettings]]:
    """Every backend's key schema, by backend name (the subclasses of `BackendSettings`)."""
    out: dict[str, type[BackendSettings]] = {}
    todo = list(BackendSettings.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls.backend:
            out[cls.backend] = cls
        todo.extend(cls.__subclasses__())
    return out


BACKENDS: tuple[str, ...] = tuple(backend_schemas())
# Pools on this host, which can have a distributed store behind them (`remote_backend`), and
# the stores that can be that remote tier.
HOST_BACKENDS: tuple[str, ...] = ("local", "server")
REMOTE_BACKENDS: tuple[str, ...] = tuple(b for b in BACKENDS if b not in HOST_BACKENDS)


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The keys every backend shares."""

    backend: Annotated[str, Meta(description="where the pool lives: " + ", ".join(BACKENDS))] = "local"
    remote_backend: Annotated[str, Meta(description=(
        "a distributed store behind the host pool (`local`, `server`): one of " + ", ".join(REMOTE_BACKENDS) +
        ", configured by its own keys; saves are written through to it in the background, a lookup that "
        "misses the host pool asks it, and what it serves is copied into the host pool"))] | None = None
    remote_queue_blocks: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "saved blocks waiting to be written through to the remote tier; past it a save is not written "
        "through (counted as dropped in `vllm:kvpool_remote_tier_blocks`)"))] = 8192
    # Not a TCP port despite its name (a component of an IPC socket name), hence the wide range;
    # still a whole number only, as a port would be.
    lookup_rpc_port: Annotated[int, Meta(ge=0, le=2**31 - 1, extra={"kind": "id"}, description=(
        "names the scheduler<->worker lookup channel; unique per instance on a host"))] = 0
    load_async: Annotated[bool, Meta(description=(
        "load on a background thread; the request waits in WAITING_FOR_REMOTE_KVS"))] = False
    consumer_is_to_load: Annotated[bool, Meta(description="a kv_consumer looks up and loads from the pool")] = False
    consumer_is_to_put: Annotated[bool, Meta(description="a kv_consumer also saves KV to the pool")] = False
    # As in the spec's AscendStore, where only the consumer role is gated: prefill nodes reuse
    # each other's prefixes through the pool unless this is turned off.
    producer_is_to_load: Annotated[bool, Meta(description=(
        "a kv_producer looks up and loads pooled prefixes (false: it only saves)"))] = True
    save_sync: Annotated[bool, Meta(description=(
        "finish a step's saves before the step returns (default: on for kv_producer)"))] | None = None
    save_decode_cache: Annotated[bool, Meta(description=(
        "also save the blocks a request fills while decoding, so that a conversation's next turn "
        "(whose prompt holds this answer) hits them; a request may ask for it, or refuse it, in its "
        "kv_transfer_params"))] = False
    request_pin_max_s: Annotated[float, Meta(ge=1e-3, le=MAX_PIN_S, extra={"kind": "seconds", "zero": (
        "requests may not pin")}, description=(
        "the longest a request may keep its prompt's blocks in the host pool's memory with `pin_s` "
        "in its kv_transfer_params (a longer one is cut to this); `local` and `server` only"))] = 0.0
    prefill_pp_size: Annotated[int, Meta(ge=1, le=MAX_PP_SIZE, description=(
        "PP size of the prefill nodes a decode node puts for"))] | None = None
    prefill_pp_layer_partition: Annotated[tuple[Annotated[int, Meta(ge=1, le=MAX_LAYERS)], ...], Meta(
        max_length=MAX_PP_SIZE, description="layers per prefill PP stage, e.g. \"30,31\"")] | None = None
    discard_partial_chunks: Annotated[bool, Meta(description="only full blocks are saved (must be true)")] = True
    transfer_path: Annotated[Literal["auto", "direct", "staged"], Meta(description=(
        "how blocks move between the KV cache and the pool: `auto` copies host-memory caches "
        "directly and stages accelerator caches through pinned host buffers; `staged` forces "
        "staging (also on CPU, to test it)"))] = "auto"
    staging_buffer_size: Annotated[int, Meta(ge=MiB, le=64 * GiB, extra={"kind": "size"}, description=(
        "host memory for staging, split between loads and saves; a larger batch moves in "
        "several rounds"))] = DEFAULT_STAGING_BYTES
    use_layerwise: Annotated[bool, Meta(description=(
        "one pool value per block and layer: loads stream layer by layer into the forward pass "
        "(wait_for_layer_load) and saves leave as each layer is written (save_kv_layer)"))] = False
    share_across_tp: Annotated[bool, Meta(description=(
        "store a block as one value per KV head, so that instances of any tensor-parallel size share "
        "it (a rank reads and writes the heads it holds); more, smaller values"))] = False
    copy_threads: Annotated[int, Meta(ge=0, le=64, description=(
        "threads that copy one batch's values in parallel (`local`, `server`; in vLLM's CPU worker "
        "a synchronous load runs on vLLM's own OpenMP threads, at most this many); 0: one "
        "per CPU the worker process computes on, at most 4"))] = 0
    lookup_timeout_s: Annotated[float, Meta(ge=0.001, le=60, extra={"kind": "seconds"}, description=(
        "the longest a lookup waits for a store outside this process; then it is a miss and the "
        "circuit breaker opens"))] = 0.3
    transfer_timeout_s: Annotated[float, Meta(ge=0.001, le=3600, extra={"kind": "seconds"}, description=(
        "the longest a batch load or save waits for such a store before the store starts moving "
        "bytes; then its blocks fail (loads are recomputed) and the breaker opens"))] = 5.0
    breaker_failures: Annotated[int, Meta(ge=1, le=10_000, description=(
        "failed store calls in a row that open the circuit breaker (one timeout opens it at once)"))] = 3
    breaker_cooldown_s: Annotated[float, Meta(ge=0.01, le=3600, extra={"kind": "seconds"}, description=(
        "how long an open breaker answers without the store (lookups miss, loads recompute, saves "
        "are dropped) before a probe; doubles while probes fail, up to 30 s or this value"))] = 1.0
    inject_load_failure_every: Annotated[int, Meta(ge=0, le=2**31 - 1, description=(
        "test aid: fail every Nth block read (0: never)"))] = 0
    stats_log_interval_s: Annotated[float, Meta(ge=0.01, le=DAY_S, extra={"kind": "seconds", "zero": (
        "at every stats collection")}, description=(
        "log kvpool's counters at most this often"))] = 10.0
    block_hash_log: Annotated[str, Meta(extra={"kind": "output_file"}, description=(
        "append one line per finished request (arrival, lengths, the prompt's block hashes; no "
        "tokens) to this file, in the trace format `kvpool plan` reads (default: off)"))] | None = None


# The key under a request's `kv_transfer_params` that holds kvpool's per-request switches
# (`kvpool.vllm.control`); the PD proxy passes it on to both legs.
REQUEST_PARAMS_KEY = "kvpool"

# Accepted for compatibility with the reference connector's configs: old name -> key.
ALIASES = {"mooncake_rpc_port": "lookup_rpc_port", "default_kv_lease_ttl": "default_kv_lease_ttl_ms"}


class KVPoolConfig(ConnectorSettings, frozen=True, kw_only=True):
    """Everything kvpool reads from `kv_connector_extra_config` (and `kv_role`), validated: the
    shared keys with their role-dependent defaults resolved, the role, and the chosen backend's
    own keys."""

    kv_role: str = "kv_both"
    # Resolved: `None` (the role's default) is on for a producer. In PD disaggregation the proxy
    # sends the decode request the moment the prefill answers, so the prefill's blocks must
    # already be findable then.
    save_sync: bool = False
    # The chosen backend's own keys (its `BackendSettings` subclass).
    backend_settings: BackendSettings = msgspec.field(default_factory=LocalSettings)
    # The remote tier's (`remote_backend`), when there is one.
    remote_settings: BackendSettings | None = None

    @property
    def saves(self) -> bool:
        """Whether this instance writes KV to the pool."""
        return self.consumer_is_to_put if self.kv_role == "kv_consumer" else True

    @property
    def loads(self) -> bool:
        """Whether this instance looks up and loads KV from the pool.

        A producer (prefill node) loads pooled prefixes like `kv_both` unless
        `producer_is_to_load` is false; a consumer (decode node) only loads with
        `consumer_is_to_load`.
        """
        if self.kv_role == "kv_both":
            return True
        if self.kv_role == "kv_producer":
            return self.producer_is_to_load
        return self.consumer_is_to_load


def known_keys() -> set[str]:
    """Every `kv_connector_extra_config` key any backend accepts, aliases included."""
    keys = set(fields(ConnectorSettings)) | set(ALIASES)
    for schema in backend_schemas().values():
        keys |= set(fields(schema))
    return keys


def int_arg(text: str) -> int:
    """argparse `type` for integer flags (proxy, doctor): ASCII digits only (`int()` also takes e.g. fullwidth ones)."""
    body = text[1:] if text[:1] in "+-" else text
    if not (body.isascii() and body.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer written in ASCII digits")
    return int(text)


def load_config(extra: Mapping[str, Any] | None, kv_role: str | None = "kv_both") -> KVPoolConfig:
    """Validate `kv_connector_extra_config` into a `KVPoolConfig`; raise `ConfigError` on the first bad value
    (`check_config` lists them all).

    Keys of a backend other than the chosen one are checked too (a typo there is still a typo)
    and then not used.
    """
    config, errors = _parse_config(extra, kv_role)
    if errors:
        raise errors[0]
    assert config is not None
    return config


def check_config(extra: Mapping[str, Any] | None, kv_role: str | None = "kv_both"
                 ) -> tuple[KVPoolConfig | None, list[ConfigError]]:
    """Every problem of a `kv_connector_extra_config` at once (each key is checked on its own, so
    one bad value does not hide the next), and the config the valid values make, bad ones at
    their defaults (None when no backend can be told): what `kvpool doctor` reports and checks."""
    return _parse_config(extra, kv_role)


def _convert_each(schema: type[msgspec.Struct], raw: Mapping[str, Any], errors: list[ConfigError]) -> Any:
    """`convert`, key by key: a bad value is added to `errors` and left out (its default stands)."""
    ok = {}
    for key in fields(schema):  # the schema's order, as `convert` meets them
        if key not in raw:
            continue
        try:
            convert(schema, {key: raw[key]})
        except ConfigError as exc:
            errors.append(exc)
        else:
            ok[key] = raw[key]
    return convert(schema, ok)


def _parse_config(extra: Mapping[str, Any] | None, kv_role: str | None) -> tuple[KVPoolConfig | None,
                                                                                  list[ConfigError]]:
    errors: list[ConfigError] = []
    extra = dict(extra or {})
    role = "kv_both" if kv_role is None or kv_role == "" else kv_role
    if not isinstance(role, str) or role not in ROLES:
        errors.append(ConfigError("kv_role", role, f"one of {', '.join(ROLES)}"))
        role = "kv_both"
    for old, new in ALIASES.items():
        if old in extra:
            if new in extra:
                errors.append(ConfigError(old, extra[old], f"not both {old} and {new}; use {new}"))
                extra.pop(old)
            else:
                extra[new] = extra.pop(old)
    known = known_keys()
    for key in sorted(set(extra) - known, key=str):  # a dict built in Python may have non-str keys
        errors.append(unknown_key_error(str(key), extra.pop(key), known - set(ALIASES), "kv_connector_extra_config"))
    schemas = backend_schemas()
    backend = extra.get("backend", "local")
    if not isinstance(backend, str) or backend not in schemas:
        errors.append(ConfigError("backend", backend, f"one of {', '.join(BACKENDS)}"))
        backend = None
    common_keys = fields(ConnectorSettings)
    common = _convert_each(ConnectorSettings, {k: v for k, v in extra.items()
                                               if k in common_keys and (k != "backend" or backend)}, errors)
    if common.prefill_pp_layer_partition is not None:
        counts = common.prefill_pp_layer_partition
        if common.prefill_pp_size is None:
            errors.append(ConfigError("prefill_pp_layer_partition", extra["prefill_pp_layer_partition"],
                                      "to be set with prefill_pp_size"))
        elif len(counts) != common.prefill_pp_size:
            errors.append(ConfigError("prefill_pp_layer_partition", extra["prefill_pp_layer_partition"],
                                      f"{common.prefill_pp_size} positive layer counts, one per prefill PP stage "
                                      f"(prefill_pp_size={common.prefill_pp_size})"))
    if not common.discard_partial_chunks:
        errors.append(ConfigError("discard_partial_chunks", extra["discard_partial_chunks"],
                                  "true: a partial block has no stable block hash, so only full blocks can be pooled"))
    remote = common.remote_backend
    if remote is not None and remote not in REMOTE_BACKENDS:
        errors.append(ConfigError("remote_backend", remote, f"one of {', '.join(REMOTE_BACKENDS)}"))
        remote = None
    if remote is not None and backend not in HOST_BACKENDS:
        errors.append(ConfigError("remote_backend", remote, f"unset with backend {backend}, or backend one of "
                                  f"{', '.join(HOST_BACKENDS)} (the host pool a remote tier stands behind)"))
        remote = None
    chosen: BackendSettings | None = None
    remote_settings: BackendSettings | None = None
    for name, schema in schemas.items():
        mine = {k: v for k, v in extra.items() if k in fields(schema)}
        if mine or name in (backend, remote):
            settings = _convert_each(schema, mine, errors)
            if name == backend:
                chosen = settings
            if name == remote:
                remote_settings = settings
    local_ssd = [k for k in ("ssd_quota", "ssd_eviction_policy") if k in extra]
    if local_ssd and extra.get("ssd_offload_path") is None:
        errors.append(ConfigError(local_ssd[0], extra[local_ssd[0]],
                                  "to be used with ssd_offload_path (the SSD tier is off without it)"))
    if backend is None:
        return None, errors
    assert chosen is not None and backend is not None
    shared = msgspec.structs.asdict(common)
    shared.update(backend=backend, remote_backend=remote,
                  save_sync=role == "kv_producer" if common.save_sync is None else common.save_sync)
    return KVPoolConfig(**shared, kv_role=role, backend_settings=chosen, remote_settings=remote_settings), errors


# ---- `kvpool server`'s flags ---------------------------------------------------------------------


class ServerSettings(EngineSettings, frozen=True, kw_only=True):
    """Everything `kvpool server` is told on its command line (flag = the field's key with
    dashes; mooncake_master's underscore spelling of each is taken too)."""

    KEYS: ClassVar[dict[str, str]] = {
        "memory_size": "global_segment_size", "default_kv_lease_ttl_ms": "default_kv_lease_ttl",
        "client_ttl_s": "client_ttl", "put_timeout_s": "put_timeout", "hello_timeout_s": "hello_timeout",
        "socket_path": "socket", "client_max_hold_s": "client_max_hold", "request_timeout_s": "request_timeout"}

    memory_size: Annotated[int, Meta(ge=MiB, le=PiB, extra={"kind": "size"}, description=(
        'memory tier size, e.g. "4GB" (binary units)'))] = 4 * GiB
    socket_path: Annotated[str, Meta(extra={"kind": "socket"}, description=(
        "Unix socket to listen on (the backend's default server_socket)"))] = DEFAULT_SERVER_SOCKET
    socket_mode: Annotated[int, Meta(gt=0, le=0o777, extra={"kind": "octal"}, description=(
        "file mode of the socket (0600: this user only; who may use the pool is --allowed-gid's business)"))] = 0o600
    allowed_gid: Annotated[int, Meta(ge=0, le=2**32 - 2, extra={"kind": "id"}, description=(
        "group sharing: also serve users in this group; socket and arena get this group, mode 0660 "
        "(default: only the server's own uid)"))] | None = None
    client_ttl_s: Annotated[float, Meta(ge=0.1, le=DAY_S, extra={"kind": "seconds", "why": (
        "clients ping every client_ttl/3: shorter is a busy loop")},
        description=(
        "drop a client's leases and unfinished puts after this long without a ping"))] = 10.0
    put_timeout_s: Annotated[float, Meta(ge=0.1, le=DAY_S, extra={"kind": "seconds"}, description=(
        "reclaim an allocation not committed within this time"))] = 30.0
    enable_offload: Annotated[bool, Meta(description="enable the SSD offload tier (needs --offload-path)")] = False
    metrics_port: Annotated[int, Meta(ge=0, le=65535, extra={"kind": "port"}, description=(
        "serve /metrics, /stats, /healthz and the controller's /v1/* routes (with KVPOOL_SERVER_ADMIN_TOKEN "
        "set) on --metrics-host:PORT (0: any free port; default off)"))] | None = None
    metrics_host: Annotated[str, Meta(extra={"kind": "ip"}, description=(
        "IP address the metrics endpoint binds (it has no auth and tells what the host caches: "
        "keep the loopback default unless a scraper on another host needs it)"))] = "127.0.0.1"
    hello_timeout_s: Annotated[float, Meta(ge=0.1, le=3600, extra={"kind": "seconds"}, description=(
        "close a connection that has not said Hello within this time"))] = 5.0
    request_timeout_s: Annotated[float, Meta(ge=0.1, le=3600, extra={"kind": "seconds"}, description=(
        "close a connection whose request frame is not whole within this time of its first byte"))] = 10.0
    frame_budget: Annotated[int, Meta(ge=MiB, le=PiB, extra={"kind": "size"}, description=(
        "memory all connections' partly received request frames may hold together; a frame that "
        "would go past it closes its connection"))] = 256 * MiB
    max_connections: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "refuse handshakes beyond this many connected clients"))] = 1024
    max_connections_per_client: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "refuse handshakes beyond this many connections from one client process"))] = 16
    max_connections_per_uid: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "with --allowed-gid: refuse handshakes beyond this many connections from one other user, "
        "all its processes together (room for a TP=8 vLLM instance: 9 processes, 1-2 each)"))] = 64
    max_handshakes: Annotated[int, Meta(ge=1, le=1 << 16, description=(
        "connections that have not said Hello yet; past it the oldest is closed to admit a new one"))] = 32
    client_pool_share: Annotated[float, Meta(gt=0, le=1, description=(
        "fraction of the memory tier one client process may pin in leased objects plus "
        "uncommitted allocations (its leases past it still read, but do not pin)"))] = 0.5
    client_max_leases: Annotated[int, Meta(ge=0, le=1 << 30, description=(
        "leases plus uncommitted allocations one client process may hold at once (0: no cap)"))] = 1 << 18
    client_max_hold_s: Annotated[float, Meta(ge=1, le=DAY_S, extra={"kind": "seconds", "zero": "no cap"}, description=(
        "longest one client process may keep one object leased by renewing it (0: no cap)"))] = 120.0
    tenants_file: Annotated[str, Meta(extra={"kind": "file"}, description=(
        "per-tenant memory budgets: a JSON file of {NAME: {\"cache_salt\": SALT, \"budget\": SIZE}}, "
        "readable by this user only (it holds the salts); a tenant past its budget evicts its own "
        "blocks (docs/control.md)"))] | None = None
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="log level")] = "INFO"

    @property
    def idle_timeout_s(self) -> float:
        # Clients ping every client_ttl/3; a connection silent for this long is gone or hung.
        return max(2 * self.client_ttl_s, 5.0)


@dataclasses.dataclass(frozen=True)
class Tenant:
    """One entry of `--tenants-file`: the name the controller and the metrics show, the tag its
    keys carry (`kvpool.keys.tenant_tag` of its cache_salt) and its memory budget in bytes."""

    name: str
    tag: str
    budget: int


_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TENANTS = 256  # the metrics' tenant label takes these names: a bounded set


def load_tenants(path: str, key: str = "tenants_file") -> tuple[Tenant, ...]:
    """The tenants of a `--tenants-file`; ConfigError naming what is wrong and how to fix it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(key, path, f"a readable file ({exc.strerror})") from None
    if mode & 0o077:
        raise ConfigError(key, path, f"a file only its owner can read (mode {mode & 0o777:o}: it holds the "
                                     f"tenants' cache salts); chmod 600 {path}")
    raw = read_json_object(key, path, "tenants")
    if len(raw) > MAX_TENANTS:
        raise ConfigError(key, path, f"at most {MAX_TENANTS} tenants (it has {len(raw)})")
    tenants, tags = [], set()
    for name, entry in raw.items():
        where = f"{key}[{name!r}]"
        if not _TENANT_NAME.fullmatch(name):
            raise ConfigError(where, name, "a name of 1 to 64 letters, digits, '_', '.' or '-'")
        if not isinstance(entry, dict) or set(entry) != {"cache_salt", "budget"}:
            raise ConfigError(where, entry, 'an object {"cache_salt": "...", "budget": "4GB"}, those two keys only')
        salt = entry["cache_salt"]
        if not isinstance(salt, str) or not salt:
            raise ConfigError(f"{where}.cache_salt", "(hidden)", "a non-empty string: the salt its requests carry")
        tag = tenant_tag(salt)
        if tag in tags:
            raise ConfigError(f"{where}.cache_salt", "(hidden)", "a salt no other tenant of the file has")
        tags.add(tag)
        tenants.append(Tenant(name, tag, parse_size(f"{where}.budget", entry["budget"])))
    return tuple(tenants)


# Extra spellings of a flag that mean the same (mooncake_master's and kvpool's own).
SERVER_FLAG_ALIASES = {"global_segment_size": ("memory_size",), "request_timeout": ("request_timeout_s",)}


_METAVARS = {"ip": "ADDRESS", "size": "SIZE", "ms": "MS", "seconds": "SECONDS", "dir": "DIR", "socket": "PATH", "octal": "OCTAL"}


def flag_name(key: str) -> str:
    """A setting's command-line flag: its key with dashes (`--memory-size`)."""
    return f"--{key.replace('_', '-')}"


def _flag_spellings(name: str) -> tuple[list[str], list[str]]:
    """(the flags `--help` shows: dashes; the spellings also taken: mooncake_master's underscores)."""
    names = (name, *SERVER_FLAG_ALIASES.get(name, ()))
    shown = list(dict.fromkeys(flag_name(n) for n in names))
    taken = [f"--{n}" for n in names if f"--{n}" not in shown]
    return shown, taken


def add_flags(parser: argparse.ArgumentParser, schema: type[msgspec.Struct] = ServerSettings) -> None:
    """One flag per field of `schema`, help and default from the schema; values stay raw
    strings until `from_flags` parses them with the same rules as every other surface."""
    defaults = schema()
    for enc, f in fields(schema).items():
        t, extra, _ = _unwrap(f.type)
        default = getattr(defaults, f.name)
        help_text = describe(schema, enc).replace("%", "%%")  # argparse formats help with %
        shown_flags, taken_flags = _flag_spellings(enc)
        if isinstance(t, mi.BoolType):
            # --enable-offload alone, as mooncake_master; also --enable-offload=true/false.
            kw: dict[str, Any] = dict(dest=enc, nargs="?", const="true", default=None, metavar="true|false")
        else:
            if default is not None:
                shown = human_size(default) if extra.get("kind") == "size" else (
                    oct(default).replace("0o", "0") if extra.get("kind") == "octal" else default)
                help_text = f"{help_text} (default {shown})"
            choices = t.values if isinstance(t, mi.LiteralType) else None
            metavar = None if choices else _METAVARS.get(extra.get("kind", ""), "N" if isinstance(t, mi.IntType) else "X")
            kw = dict(dest=enc, default=None, choices=choices, metavar=metavar)
        parser.add_argument(*shown_flags, help=help_text, **kw)
        if taken_flags:  # a mooncake_master command line works unchanged; --help shows one style
            parser.add_argument(*taken_flags, help=argparse.SUPPRESS, **kw)


def from_flags(args: argparse.Namespace, schema: type[msgspec.Struct] = ServerSettings) -> Any:
    """Parse the flags `add_flags` registered; errors name the flag as `--name`."""
    raw = {enc: getattr(args, enc) for enc in fields(schema) if getattr(args, enc, None) is not None}
    return convert(schema, raw, names={enc: flag_name(enc) for enc in raw})


# ---- every surface, for the docs and the tests ---------------------------------------------------


def config_surfaces() -> dict[str, tuple[type[msgspec.Struct], ...]]:
    """Every schema a user's values reach, by surface: the connector's keys (shared and each
    backend's) and `kvpool server`'s flags. A schema added to either is covered by the bounds
    table and by the property tests without being listed anywhere else."""
    return {
        "kv_connector_extra_config": (ConnectorSettings, *backend_schemas().values()),
        "kvpool server": (ServerSettings,),
    }


def bounds_table() -> str:
    """docs/configuration.md's table of every numeric key's range (a test keeps the doc equal to it)."""
    rows = ["| key | where | accepts |", "| --- | --- | --- |"]
    for surface, schemas in config_surfaces().items():
        seen: set[str] = set()
        for schema in schemas:
            for enc, f in fields(schema).items():
                text = expected_text(f.type)
                if not text or enc in seen:
                    continue
                seen.add(enc)
                name = f"`{flag_name(enc)}`" if surface == "kvpool server" else f"`{enc}`"
                rows.append(f"| {name} | {surface} | {text} |")
    return "\n".join(rows)
