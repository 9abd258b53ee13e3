"""`Backend`, the base class: what it does for every adapter (checks, duplicates, empty values,
exceptions, stats) and `Reconnect`'s backoff, against an in-memory adapter that records what
its hooks were given. No service needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.backends import seal
from kvpool.backends.base import STATS, Backend, Reconnect, gather, scatter, spans, total_size
from kvpool.backends.net import parse_host_port, split_host_port
from kvpool.errors import STORED, BackendUnavailable, ConfigError, ErrorCode, is_stored

OK, EXISTS = ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS
NOT_FOUND, INVALID, RPC_FAIL = ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_PARAMS, ErrorCode.RPC_FAIL


class Memory(Backend):
    """A dict behind the hooks; `calls` records each hook call's keys, `fail` makes hooks raise."""

    name = "memory"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.fail: Exception | None = None
        self.connected = True

    def _connect(self) -> bool:
        return self.connected

    def _check(self, what: str, keys: list[str]) -> None:
        assert keys and len(set(keys)) == len(keys), f"{what} got {keys}"
        self.calls.append((what, list(keys)))
        if self.fail is not None:
            raise self.fail

    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        self._check("exists", keys)
        return [k in self.data for k in keys]

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self._check("put", keys)
        codes = []
        for k, v in zip(keys, values):
            assert total_size(v) > 0
            if k in self.data:
                codes.append(int(EXISTS))
            else:
                self.data[k] = gather(v).tobytes()
                codes.append(int(OK))
        return codes

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self._check("get", keys)
        codes = []
        for k, v in zip(keys, values):
            if k not in self.data:
                codes.append(int(NOT_FOUND))
            elif len(self.data[k]) != total_size(v):
                codes.append(int(INVALID))
            else:
                scatter(self.data[k], v)
                codes.append(int(OK))
        return codes


def val(n: int, seed: int = 0) -> list[np.ndarray]:
    data = np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)
    return [data[: n // 3], data[n // 3 :]]


def test_empty_batches_never_reach_the_store():
    b = Memory()
    assert b.batch_exists([]) == [] and b.batch_put([], []) == [] and b.batch_get_into([], []) == []
    assert b.calls == []


def test_length_mismatch_names_both_counts():
    b = Memory()
    with pytest.raises(ValueError, match="3 keys but 2 values"):
        b.batch_put(["a", "b", "c"], [val(10), val(10)])
    with pytest.raises(ValueError, match="1 keys but 2 values"):
        b.batch_get_into(["a"], [val(10), val(10)])


def test_hooks_get_distinct_non_empty_input_and_duplicates_share_the_first_code():
    b = Memory()
    e = np.empty(0, np.uint8)
    codes = b.batch_put(["a", "b", "a", "e", "e", "c"], [val(30, 1), val(30, 2), val(30, 3), [e], val(30), val(10)])
    assert codes == [OK, OK, OK, INVALID, INVALID, OK]
    assert b.calls == [("put", ["a", "b", "c"])]
    assert b.data["a"] == gather(val(30, 1)).tobytes()  # the first value won
    assert b.batch_put(["a", "a", "d"], [val(30), val(30), val(5)]) == [EXISTS, EXISTS, OK]
    assert b.batch_exists(["a", "x", "a", ""]) == [True, False, True, False]
    assert b.calls[-1] == ("exists", ["a", "x"])
    outs = [[np.zeros(30, np.uint8)], [np.zeros(30, np.uint8)], [np.zeros(5, np.uint8)]]
    assert b.batch_get_into(["a", "a", "d"], outs) == [OK, OK, OK]
    assert b.calls[-2:] == [("get", ["a", "d"]), ("get", ["a"])]  # one round per copy of a key
    assert all(gather(o).tobytes() == b.data[k] for k, o in zip(["a", "a", "d"], outs))
    stats = b.stats()
    assert (stats["puts"], stats["put_existing"], stats["failures"], stats["gets"]) == (4, 1, 1, 3)


def test_an_adapters_exception_is_a_per_key_code():
    b = Memory()
    b.fail = RuntimeError("binding blew up")
    assert b.batch_put(["a", "b"], [val(10), val(10)]) == [RPC_FAIL, RPC_FAIL]
    assert b.batch_get_into(["a"], [[np.zeros(10, np.uint8)]]) == [RPC_FAIL]
    assert b.batch_exists(["a", "b"]) == [False, False]
    b.fail = BackendUnavailable("gone", ErrorCode.RPC_TIMEOUT)  # a KVPoolError keeps its code
    assert b.batch_put(["a"], [val(10)]) == [ErrorCode.RPC_TIMEOUT]
    assert b.stats()["failures"] == 6


def test_a_store_that_is_down_answers_fast_and_backs_off():
    now = [0.0]
    tries = []

    def connect() -> bool:
        tries.append(now[0])
        return len(tries) >= 5

    link = Reconnect(connect, first_s=0.5, cap_s=2.0, clock=lambda: now[0])
    assert link.ready() is False  # try 1 fails: next at 0.5
    for t in (0.1, 0.4, 0.5, 0.6, 1.4, 1.5, 3.0, 3.4, 3.5, 5.5):
        now[0] = t
        link.ready()
    # tries at 0 (then wait 0.5), 0.5 (wait 1), 1.5 (wait 2), 3.5 (wait 2, the cap), 5.5: up
    assert tries == [0.0, 0.5, 1.5, 3.5, 5.5] and link.up and link.failures == 4
    link.down()
    now[0] = 5.6
    assert link.ready() is False  # the backoff kept growing: no success confirmed a call yet
    now[0] = 7.5
    assert link.ready() is True and len(tries) == 6
    link.confirm()
    link.down()
    now[0] = 8.0
    assert link.ready() is True  # after a confirmed call, the shortest backoff again
    link.close()
    now[0] = 100.0
    assert link.ready() is False and len(tries) == 7


def test_calls_fail_fast_while_the_store_is_down():
    b = Memory()
    b.connected = False
    assert b.batch_put(["a"], [val(10)]) == [RPC_FAIL]
    assert b.batch_exists(["a"]) == [False]
    assert b.batch_get_into(["a"], [[np.zeros(10, np.uint8)]]) == [RPC_FAIL]
    assert b.calls == [] and b.stats()["connect_failures"] == 1  # one try, then the backoff


def test_stats_shape():
    b = Memory()
    assert list(b.stats()) == list(STATS)


def test_stored_codes():
    assert STORED == {0, -705} and is_stored(OK) and is_stored(EXISTS) and not is_stored(RPC_FAIL)


def test_buffer_helpers():
    parts = val(100)
    ptrs, sizes, total = spans([np.empty(0, np.uint8), *parts])
    assert sizes == [33, 67] and total == 100 and ptrs[0] == parts[0].ctypes.data
    whole = gather(parts)
    out = [np.zeros(50, np.uint8), np.zeros(0, np.uint8), np.zeros(50, np.uint8)]
    scatter(whole, out)
    assert np.array_equal(np.concatenate(out), whole)
    with pytest.raises(ValueError):
        scatter(whole, [np.zeros(99, np.uint8)])
    with pytest.raises(ValueError):
        gather(parts, np.zeros(99, np.uint8))


def test_an_exception_from_the_availability_check_is_a_per_key_code():
    # `_available` (Mooncake's health_check, a reconnect) ran outside the hooks' exception
    # handling: its exception escaped the batch call into vLLM's worker.
    class Flaky(Memory):
        def _available(self) -> bool:
            raise RuntimeError("health_check on a client being torn down")

    b = Flaky()
    assert b.batch_exists(["a"]) == [False]
    assert b.batch_put(["a"], [val(10)]) == [RPC_FAIL]
    assert b.batch_get_into(["a"], [[np.zeros(10, np.uint8)]]) == [RPC_FAIL]
    assert b.calls == []


class Sealed(Memory):
    """A store any client can write under any key (as Mooncake, openYuanrong, MemCache)."""

    seal_values = True


def test_a_sealed_value_reads_back_and_its_seal_follows_it_under_its_own_name():
    b = Sealed()
    value = val(1000)
    assert b.batch_put(["k"], [value]) == [OK]
    (name,) = b.data
    assert name == seal.stored_key("k") and len(b.data[name]) == 1000 + seal.SIZE
    out = [np.zeros(333, np.uint8), np.zeros(667, np.uint8)]
    assert b.batch_get_into(["k"], [out]) == [OK]
    assert gather(out).tobytes() == gather(value).tobytes()
    assert b.batch_exists(["k", "other"]) == [True, False]
    assert b.stats()["put_bytes"] == b.stats()["get_bytes"] == 1000  # the seal is not counted


def test_bytes_not_sealed_under_the_key_read_are_never_ok():
    b = Sealed()
    assert b.batch_put(["src", "k"], [val(1000, 1), val(1000, 2)]) == [OK, OK]
    src, k = seal.stored_key("src"), seal.stored_key("k")
    original = b.data[k]
    forged = {
        "another key's object": b.data[src],
        "one byte changed": original[:10] + bytes([original[10] ^ 1]) + original[11:],
        "its seal changed": original[:-1] + bytes([original[-1] ^ 1]),
        "no seal at all": bytes(1000) + bytes(seal.SIZE),
    }
    for why, data in forged.items():
        b.data[k] = data
        assert b.batch_get_into(["k"], [[np.zeros(1000, np.uint8)]]) == [ErrorCode.CHECKSUM_MISMATCH], why
    assert b.stats()["corrupt_reads"] == len(forged)
    assert b.batch_get_into(["src"], [[np.zeros(1000, np.uint8)]]) == [OK]


def test_an_unsealed_object_under_the_plain_key_is_a_miss():
    # What a kvpool that did not seal stored: never read as a sealed value, never a load error.
    b = Sealed()
    b.data["k"] = bytes(1000)
    assert b.batch_exists(["k"]) == [False]
    assert b.batch_get_into(["k"], [[np.zeros(1000, np.uint8)]]) == [NOT_FOUND]


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:50088", ("127.0.0.1", 50088)),
    ("master.example:8000", ("master.example", 8000)),
    ("[::1]:50088", ("::1", 50088)),
])
def test_one_rule_reads_host_port(text, expected):
    assert parse_host_port("k", text) == expected
    assert split_host_port(text) is not None


@pytest.mark.parametrize("text", ["50088", ":50088", "::1:50088", "host:", "host:port", "host:70000", "[::1]"])
def test_one_rule_refuses_what_is_not_host_port(text):
    # An IPv6 address without brackets is refused: its last colon may be the address's own.
    with pytest.raises(ConfigError, match="host:port"):
        parse_host_port("master_server_address", text)
