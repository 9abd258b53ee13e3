"""The operator's pins and listing (`kvpool.store.controls`): a pin keeps an object through
eviction for its TTL and no longer, never takes more than its share of memory, and promotes an
SSD-only key first."""

from __future__ import annotations

from kvpool.errors import ErrorCode
from kvpool.store.controls import PIN_SHARE
from store_helpers import payload

OK, ABSENT, FULL = ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.NO_AVAILABLE_HANDLE


def _fill(engine, names, size=64):
    for name in names:
        assert engine.put("w", name, [payload(name, size)]) is ErrorCode.OK


def test_a_pinned_object_outlives_eviction_until_its_ttl(make_engine, clock):
    engine = make_engine(memory_size=1024)
    _fill(engine, ["sys"])
    assert engine.controls.pin(["sys", "nope"], ttl_s=60) == [OK, ABSENT]
    _fill(engine, [f"k{i}" for i in range(40)])  # ~40 x 64 B through a 1 KiB pool
    assert engine.exists(["sys"]) == [True]
    assert engine.remove("sys") is ErrorCode.OBJECT_HAS_LEASE  # pinned: clear must unpin first
    clock.advance(61)
    _fill(engine, [f"j{i}" for i in range(40)])
    assert engine.exists(["sys"]) == [False]
    assert engine.controls.contents().pinned == {}


def test_pinning_again_moves_the_expiry_and_unpin_ends_it(make_engine, clock):
    engine = make_engine(memory_size=1024)
    _fill(engine, ["sys"])
    engine.controls.pin(["sys"], ttl_s=10)
    engine.controls.pin(["sys"], ttl_s=100)
    assert engine.controls.contents().pinned == {"sys": clock.now + 100}
    clock.advance(50)
    _fill(engine, [f"k{i}" for i in range(40)])
    assert engine.exists(["sys"]) == [True]
    assert engine.controls.unpin(["sys", "sys"]) == [OK, ABSENT]
    _fill(engine, [f"j{i}" for i in range(40)])
    assert engine.exists(["sys"]) == [False]


def test_pins_take_at_most_their_share_of_memory(make_engine):
    engine = make_engine(memory_size=4096)
    names = [f"p{i}" for i in range(12)]
    _fill(engine, names, size=256)
    codes = engine.controls.pin(names, ttl_s=60)
    contents = engine.controls.contents()
    held = sum(contents.memory[k] for k in contents.pinned)
    assert held <= PIN_SHARE * 4096 < held + contents.memory["p0"]
    assert codes[: len(contents.pinned)] == [OK] * len(contents.pinned)
    assert set(codes[len(contents.pinned):]) == {FULL}
    # Re-pinning what is pinned costs nothing more: still granted with the share spent.
    assert engine.controls.pin(sorted(contents.pinned)[:1], ttl_s=60) == [OK]
    assert engine.controls.pin(["p0"], ttl_s=0) == [ErrorCode.INVALID_PARAMS]


def test_an_ssd_only_key_is_promoted_then_pinned(make_engine, make_disk):
    engine = make_engine(memory_size=1024, disk=make_disk(), disk_write_through=False)
    _fill(engine, ["sys"])
    _fill(engine, [f"k{i}" for i in range(40)])  # "sys" spilled to the SSD
    contents = engine.controls.contents()
    assert "sys" not in contents.memory and "sys" in contents.ssd
    assert engine.controls.pin(["sys"], ttl_s=60) == [OK]
    assert "sys" in engine.controls.contents().memory
    out = bytearray(64)
    assert engine.get_into("r", "sys", [out]) is ErrorCode.OK and bytes(out) == payload("sys", 64).tobytes()
