"""Every config value that is accepted is inside its key's declared bounds, and every other value
is a `ConfigError`, never a traceback: over the whole config surface, enumerated from the schema
declarations (`config_surfaces()`), so a key added there is covered here without being listed.
Then one regression test per value once accepted though broken."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.config import (
    ALIASES,
    _unwrap,
    DAY_S,
    MAX_SIZE,
    PiB,
    TiB,
    ServerSettings,
    backend_schemas,
    bounds_table,
    flag_name,
    config_surfaces,
    convert,
    field_bounds,
    fields,
    known_keys,
    load_config,
    parse_size,
)
from kvpool.errors import ConfigError, ErrorCode, KVPoolError
from kvpool.server.daemon import add_arguments, config_from_args

REPO = Path(__file__).resolve().parents[2]

# (surface, schema, key as written, field) for every key of every surface.
ENTRIES = [(surface, schema, enc, f) for surface, schemas in config_surfaces().items()
           for schema in schemas for enc, f in fields(schema).items()]
IDS = [f"{schema.__name__}.{enc}" for _, schema, enc, _ in ENTRIES]
NUMERIC = [(schema, enc, f) for _, schema, enc, f in ENTRIES if field_bounds(f.type) is not None]


def assert_declared(key: str, ftype: Any, v: Any) -> None:
    """`v`, an accepted value of a field of type `ftype`, is what the declaration promises."""
    t, extra, optional = _unwrap(ftype)
    if v is None:
        assert optional, f"{key}: None accepted for a key that cannot be unset"
        return
    bounds = field_bounds(ftype)
    if isinstance(t, mi.BoolType):
        assert type(v) is bool, (key, v)
    elif isinstance(t, mi.LiteralType):
        assert v in t.values, (key, v)
    elif isinstance(t, mi.IntType):
        assert type(v) is int and bounds is not None and bounds.admits(v), (key, v, bounds)
    elif isinstance(t, mi.FloatType):
        assert type(v) in (int, float) and math.isfinite(v), (key, v)
        assert bounds is not None and bounds.admits(v), (key, v, bounds)
    elif isinstance(t, mi.StrType):
        assert type(v) is str, (key, v)
        if extra.get("kind") in ("file", "dir", "socket"):
            assert v and "\0" not in v and v.startswith("/"), (key, v)
    elif isinstance(t, mi.VarTupleType):
        assert type(v) is tuple and len(v) <= t.max_length, (key, v)
        assert bounds is not None and all(type(i) is int and bounds.admits(i) for i in v), (key, v, bounds)
    else:
        raise AssertionError(f"{key}: no check for {t}")


def assert_struct_declared(schema: type[msgspec.Struct], obj: Any) -> None:
    for enc, f in fields(schema).items():
        assert_declared(enc, f.type, getattr(obj, f.name))


def assert_named(exc: ConfigError, key: str) -> None:
    assert isinstance(exc, KVPoolError) and exc.code == ErrorCode.INVALID_PARAMS
    assert exc.key == key and str(exc).startswith(f"[INVALID_PARAMS -600] {key}="), str(exc)


# ---- values ---------------------------------------------------------------------------------------

_TRICKY = [
    "1GB", "100000000TB", "1PB", "1025TB", "0", "-0", "+5", "-1", "- 3", "3-", "1.5", "3.0", " 7 ", "1_000", "0x10",
    "1e9", "1e-6", "0.000001", "1e15", "inf", "-inf", "Infinity", "NaN", "nan", "true", "on", "10ms", "1h", "2d",
    "0.5ms", "1us", "0600", "0o600", "0777", "0400", "7777", "30,31", "30,,31", "1,0", "lru", "LRU", "auto", "INFO",
    "/tmp", "/tmp/x.sock", "/", "/no/such/file", "redis://h:1/0", "unix:///r.sock", "", " ", "\0", "/tmp/\0x",
    "\ud800", "/tmp/\udcff", "1" * 400, "1" * 400 + "ms", "1" * 5000, "9" * 30 + "KB",
    "\u0661", "\u0661\u0662\u0663", "\u0661GB", "\uff11", "\uff11GB", "\u0967", "\u0660\u0666\u0660\u0660",
    "\u0661,\u0662", "\u0663s", "65536", "65535", "86401", "86400000", "86400001", "1024", "1025", "1048577",
]
def too_large_to_show(i: int) -> Any:
    """Values whose repr fails or fills a screen (built here: hypothesis reprs its strategies)."""
    return (10**5000, [10**5000], "x" * 10**6)[i]


_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
    | st.sampled_from([10**400, -(10**400), 2**63, 2**64, 2**31, 65536, 0o600])
    | st.integers(0, 2).map(too_large_to_show)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.inf, -math.inf, math.nan, 1e-6, 1e15, 1e300])
    | st.text(max_size=12) | st.sampled_from(_TRICKY)
)
_JSON = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=5)


def near_bounds(ftype: Any) -> st.SearchStrategy[Any]:
    """Numbers at, just inside and just outside a numeric field's bounds, as JSON numbers and strings."""
    b = field_bounds(ftype)
    if b is None:
        return st.nothing()
    edges = [x for x in (b.ge, b.gt, b.le, b.lt) if x is not None] + [0]
    values: list[Any] = []
    for e in edges:
        for x in (e, e - 1, e + 1, e * (1 - 1e-9), e * (1 + 1e-9), e / 2, e * 2, -e):
            values += [x, float(x), f"{x}"]
            if float(x).is_integer():
                values += [int(x), str(int(x)), f"{int(x)}ms", f"{int(x)}s", f"{int(x)}KB", f"{int(x)}MB"]
    return st.sampled_from(values)


def values_for(ftype: Any) -> st.SearchStrategy[Any]:
    if field_bounds(ftype) is None:
        return _JSON
    return _JSON | near_bounds(ftype) | st.lists(near_bounds(ftype), max_size=3)


_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser


SERVER_PARSER = server_parser()  # parse_args leaves the parser as it was
_SSD_DIR: list[str] = []


def ssd_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not _SSD_DIR:
        _SSD_DIR.append(os.path.realpath(tmp_path_factory.mktemp("ssd")))
    return _SSD_DIR[0]


# ---- the property, key by key ---------------------------------------------------------------------


@pytest.mark.parametrize(("surface", "schema", "enc", "f"), ENTRIES, ids=IDS)
@_SETTINGS
@given(data=st.data())
def test_every_key_accepts_only_declared_values(surface, schema, enc, f, data):
    """The parser every surface uses: ConfigError naming the key, or a value inside the bounds."""
    value = data.draw(values_for(f.type))
    try:
        parsed = convert(schema, {enc: value})
    except ConfigError as exc:
        assert_named(exc, enc)
    else:
        assert_struct_declared(schema, parsed)


_OWNER = {enc: name for name, schema in backend_schemas().items() for enc in fields(schema)}


@pytest.mark.parametrize("key", sorted(known_keys()))
@_SETTINGS
@given(data=st.data())
def test_connector_config_accepts_only_declared_values(key, data, tmp_path_factory):
    """`kv_connector_extra_config` end to end, aliases included, with the key's own backend chosen."""
    enc = ALIASES.get(key, key)
    value = data.draw(values_for(next(f.type for _, _, e, f in ENTRIES if e == enc)))
    extra: dict[str, Any] = {key: value, "backend": _OWNER.get(enc, "local")}
    if enc in ("ssd_quota", "ssd_eviction_policy"):
        extra["ssd_offload_path"] = ssd_dir(tmp_path_factory)
    if enc == "prefill_pp_layer_partition":
        extra["prefill_pp_size"] = data.draw(st.integers(1, 3))
    role = data.draw(st.sampled_from(["kv_both", "kv_producer", "kv_consumer"]))
    try:
        cfg = load_config(extra, role)
    except ConfigError as exc:
        assert exc.key in (key, enc, "prefill_pp_layer_partition"), str(exc)
        assert str(exc).startswith(f"[INVALID_PARAMS -600] {exc.key}=")
    else:
        common = config_surfaces()["kv_connector_extra_config"][0]
        assert_struct_declared(common, cfg)
        assert_struct_declared(type(cfg.backend_settings), cfg.backend_settings)


SERVER_FLAGS = sorted(fields(ServerSettings))


@pytest.mark.parametrize("flag", SERVER_FLAGS)
@_SETTINGS
@given(data=st.data())
def test_server_flags_accept_only_declared_values(flag, data, tmp_path_factory):
    """`kvpool server FLAG=TEXT` through its own argument parser and `config_from_args`."""
    f = fields(ServerSettings)[flag]
    text = data.draw(st.text(max_size=12) | st.sampled_from(_TRICKY) | near_bounds(f.type).map(str))
    argv = [f"--{flag}={text}"]
    if flag.startswith("offload_"):
        argv.append("--enable_offload")
        if flag != "offload_path":
            argv.append(f"--offload_path={ssd_dir(tmp_path_factory)}")
    try:
        args = SERVER_PARSER.parse_args(argv)
    except (SystemExit, argparse.ArgumentError):  # argparse's own refusal (a choice flag): no traceback
        return
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        assert exc.key in (flag_name(flag), "--enable-offload"), str(exc)
    else:
        assert_struct_declared(ServerSettings, cfg)


# ---- the declarations themselves ------------------------------------------------------------------


@pytest.mark.parametrize(("schema", "enc", "f"), NUMERIC, ids=[f"{s.__name__}.{e}" for s, e, _ in NUMERIC])
def test_every_numeric_key_declares_sane_bounds(schema, enc, f):
    """Bounds on both sides for every number; sizes within a machine, durations long enough not to
    spin and at most a year, ports TCP ports, counts within an int32."""
    t, extra, _ = _unwrap(f.type)
    b = field_bounds(f.type)
    assert b is not None and b.closed, f"{enc} must declare a lower and an upper bound"
    lo = b.ge if b.ge is not None else b.gt
    hi = b.le if b.le is not None else b.lt
    kind = extra.get("kind")
    if kind == "size":
        assert hi <= MAX_SIZE
    elif kind in ("seconds", "ms"):
        seconds = 1.0 if kind == "seconds" else 1e-3
        assert lo * seconds >= 1e-3, f"{enc}: below 1ms a duration is a busy loop or always expired; declare zero"
        assert hi * seconds <= 365 * DAY_S
    elif kind == "port":
        assert isinstance(t, mi.IntType) and 0 <= lo and hi <= 65535
    elif kind == "id":  # names something (a gid, a channel): bounded by what names it, not a count
        assert isinstance(t, mi.IntType) and 0 <= lo and hi < 2**32
    if (isinstance(t, mi.IntType) and kind not in ("size", "id")) or isinstance(t, mi.VarTupleType):
        assert hi <= 2**31 - 1, f"{enc}: a count needs an upper bound a deployment could mean"
    if isinstance(t, mi.VarTupleType):
        assert t.max_length is not None


@pytest.mark.parametrize("schema", sorted({s for _, s, _, _ in ENTRIES}, key=lambda s: s.__name__),
                         ids=lambda s: s.__name__)
def test_defaults_are_inside_the_declarations(schema):
    assert_struct_declared(schema, schema())


def test_docs_bounds_table_is_the_schema():
    doc = (REPO / "docs" / "configuration.md").read_text()
    start, end = "<!-- bounds-table -->\n", "\n<!-- /bounds-table -->"
    assert doc[doc.index(start) + len(start):doc.index(end)] == bounds_table(), (
        "docs/configuration.md's bounds table is stale: paste kvpool.config.bounds_table()")


# ---- regressions: values once accepted though broken -------------------------------------------------


def error_of(extra: dict[str, Any], key: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(extra)
    assert_named(info.value, key)
    return str(info.value)


def server_error(*argv: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_args(SERVER_PARSER.parse_args(list(argv)))
    return info.value


@pytest.mark.parametrize("key", ["local_cpu_size", "staging_buffer_size", "redis_chunk_size"])
@pytest.mark.parametrize("value", ["100000000TB", "1025TB", 2 * PiB, "1" * 400 + "KB", 10**400, 1e300])
def test_a_size_beyond_a_machine_is_refused(key, value):
    msg = error_of({key: value, "backend": _OWNER.get(key, "local")}, key)
    assert "a byte size from 1MB to" in msg


def test_a_size_in_a_store_file_is_at_most_a_petabyte():
    assert parse_size("global_segment_size", "1PB") == PiB
    for value in ("100000000TB", "1" * 400, 10**400):
        with pytest.raises(ConfigError) as info:
            parse_size("global_segment_size", value)
        assert "at most 1PB" in str(info.value)
    assert parse_size("global_segment_size", 1024 * TiB) == PiB


@pytest.mark.parametrize("value", [1e15, 10**15, "1000000000000000", "277778h", "1" * 400 + "ms", math.inf])
def test_a_lease_ttl_beyond_a_day_is_refused(value):
    msg = error_of({"default_kv_lease_ttl_ms": value}, "default_kv_lease_ttl_ms")
    assert "a number of milliseconds from 1 to 86400000" in msg
    assert server_error(f"--default_kv_lease_ttl={value}").key == "--default-kv-lease-ttl"


@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN", "1e400", "1" + "0" * 400])
def test_lookup_rpc_port_from_json_is_refused_without_a_traceback(text):
    extra = json.loads(f'{{"lookup_rpc_port": {text}}}')
    assert "an integer from 0 to 2147483647" in error_of(extra, "lookup_rpc_port")


@pytest.mark.parametrize("value", [3.0, True, "1.0", "\u0661\u0662", "\uff11", 2**31])
def test_lookup_rpc_port_is_an_integer_only(value):
    # not a TCP port (an IPC socket name's component), but named like one: 3.0 is a mistake
    error_of({"lookup_rpc_port": value}, "lookup_rpc_port")


@pytest.mark.parametrize("value", ["3.0", "65536", "-1", "true", "\u0661\u0662", "\uff11", "Infinity", "1e3"])
def test_metrics_port_is_a_tcp_port(value):
    exc = server_error(f"--metrics_port={value}")
    assert exc.key == "--metrics-port" and "a port number (an integer) from 0 to 65535" in str(exc)


def test_ports_in_range_parse():
    assert load_config({"lookup_rpc_port": "2147483647"}).lookup_rpc_port == 2**31 - 1
    assert load_config({"lookup_rpc_port": 0}).lookup_rpc_port == 0
    assert config_from_args(SERVER_PARSER.parse_args(["--metrics_port=65535"])).metrics_port == 65535


@pytest.mark.parametrize("digits", ["\u0661\u0662", "\uff11\uff12", "\u0967\u0968", "1\u0662"])
@pytest.mark.parametrize(("key", "template"), [
    ("local_cpu_size", "{}GB"), ("staging_buffer_size", "{}MB"), ("lookup_rpc_port", "{}"),
    ("prefill_pp_size", "{}"), ("copy_threads", "{}"), ("stats_log_interval_s", "{}s"),
    ("default_kv_lease_ttl_ms", "{}"), ("eviction_ratio", "0.{}"),
])
def test_non_ascii_digits_are_not_numbers(digits, key, template):
    error_of({key: template.format(digits)}, key)


@pytest.mark.parametrize("value", ["\u0661,\u0662", "\uff13\uff10,31"])
def test_non_ascii_digits_are_not_layer_counts(value):
    error_of({"prefill_pp_size": 2, "prefill_pp_layer_partition": value}, "prefill_pp_layer_partition")


@pytest.mark.parametrize("value", ["\u0660\u0666\u0660\u0660", "\uff10\uff16\uff10\uff10"])
def test_non_ascii_digits_are_not_a_socket_mode(value):
    assert server_error(f"--socket_mode={value}").key == "--socket-mode"


@pytest.mark.parametrize("flag", ["client_ttl", "put_timeout", "hello_timeout"])
@pytest.mark.parametrize("value", ["1e-6", "0.000001", "0.01", "1ms", "0"])
def test_a_server_timeout_short_enough_to_spin_is_refused(flag, value):
    exc = server_error(f"--{flag}={value}")
    assert exc.key == flag_name(flag) and "a number of seconds from 0.1 to" in str(exc)


def test_client_ttl_at_its_floor_parses():
    assert config_from_args(SERVER_PARSER.parse_args(["--client_ttl=100ms"])).client_ttl_s == pytest.approx(0.1)


@pytest.mark.parametrize(("key", "value", "zero_means"), [
    ("redis_ttl_s", "0.0001", "never expire"),  # PX 0: Redis would refuse every put
    ("ssd_quota", "1KB", "90% of the disk's free space"),  # holds no block
    ("stats_log_interval_s", "1e-9", "at every stats collection"),
])
def test_a_positive_value_below_the_floor_is_refused_where_zero_is_a_switch(key, value, zero_means, tmp_path):
    extra: dict[str, Any] = {key: value, "backend": _OWNER.get(key, "local")}
    if key == "ssd_quota":
        extra["ssd_offload_path"] = os.path.realpath(tmp_path)
    assert f"0 ({zero_means}) or " in error_of(extra, key)
    extra[key] = 0
    load_config(extra)


CONNECTOR_NUMERIC = sorted({enc for surface, _, enc, f in ENTRIES
                           if surface == "kv_connector_extra_config" and field_bounds(f.type) is not None})


@pytest.mark.parametrize("key", CONNECTOR_NUMERIC)
@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -math.inf, 10**400, [1.5], {"a": 1}, "- 3", "3-"])
def test_no_number_key_takes_a_bool_nan_infinity_or_a_huge_int(key, value, tmp_path):
    extra: dict[str, Any] = {key: value, "backend": _OWNER.get(key, "local")}
    if key == "ssd_quota":
        extra["ssd_offload_path"] = os.path.realpath(tmp_path)
    if key == "prefill_pp_layer_partition":
        extra["prefill_pp_size"] = 1
    error_of(extra, key)


@pytest.mark.parametrize("value", [10**5000, [10**5000], "1" * 10**6], ids=["int", "list", "str"])
def test_a_value_too_large_to_show_is_still_a_config_error(value):
    msg = error_of({"copy_threads": value}, "copy_threads")
    assert len(msg) < 400 and "an integer from 0 to 64" in msg


def test_a_non_string_key_is_an_unknown_key():
    with pytest.raises(ConfigError) as info:
        load_config({7: 1, "local_cpu_size": "1GB"})  # type: ignore[dict-item]
    assert info.value.key == "7"


@pytest.mark.parametrize("value", ["\ud800", "/tmp/\0x", "/tmp/\ud800.sock"])
@pytest.mark.parametrize("key", ["server_socket", "ssd_offload_path", "mooncake_config_path"])
def test_unusable_path_strings_are_config_errors(key, value):
    error_of({key: value, "backend": _OWNER.get(key, "local")}, key)
