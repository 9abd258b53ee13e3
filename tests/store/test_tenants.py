"""Per-tenant budgets in the memory tier (`kvpool.store.tenants`): one tenant's flood evicts its
own blocks, never another's within its budget; the shared blocks go first when the pool is full."""

from __future__ import annotations

import numpy as np

from kvpool.errors import ErrorCode
from kvpool.keys import KeyScheme, tenant_tag

KiB = 1024
BLOCK = 4 * KiB
A, B = tenant_tag("salt-of-a"), tenant_tag("salt-of-b")
SCHEME = KeyScheme("model", "fp")


def _keys(tenant: str, first: int, n: int) -> list[str]:
    return SCHEME.keys([i.to_bytes(8, "big") for i in range(first, first + n)], tenant=tenant)


def _put(engine, keys: list[str]) -> list[ErrorCode]:
    value = np.zeros(BLOCK, np.uint8)
    return [engine.put("w", k, [value]) for k in keys]


def _held(engine, keys: list[str]) -> int:
    return sum(engine.exists(keys))


def test_a_flooding_tenant_evicts_only_its_own_blocks(make_engine):
    engine = make_engine(memory_size=1024 * KiB, tenant_budgets={A: 512 * KiB, B: 256 * KiB})
    mine = _keys(B, 0, 50)  # 200 KiB: within B's budget
    assert set(_put(engine, mine)) == {ErrorCode.OK}
    flood = _keys(A, 1000, 2000)  # 8 MB of new prefixes through a 512 KiB budget
    assert set(_put(engine, flood)) == {ErrorCode.OK}
    assert _held(engine, mine) == len(mine)  # target: >= 90%; the budget keeps all of them
    assert engine.stats()["tenant_evictions"] > 1500
    # A kept its newest blocks, as many as its budget holds.
    assert _held(engine, flood[-100:]) == 100 and _held(engine, flood) < 130


def test_unbudgeted_blocks_go_first_when_the_pool_is_full(make_engine):
    engine = make_engine(memory_size=512 * KiB, tenant_budgets={B: 128 * KiB})
    mine = _keys(B, 0, 25)
    _put(engine, mine)
    anyone = _keys("", 100, 400)  # requests without a salt fill the rest of the pool, again and again
    assert set(_put(engine, anyone)) == {ErrorCode.OK}
    assert _held(engine, mine) == len(mine)
    assert engine.stats()["tenant_evictions"] == 0


def test_a_tenant_at_its_budget_with_every_block_held_is_refused(make_engine):
    engine = make_engine(memory_size=512 * KiB, tenant_budgets={A: 64 * KiB})
    held = _keys(A, 0, 16)  # the whole budget
    _put(engine, held)
    leases = [engine.acquire("r", k) for k in held]  # a reader holds every block A has
    codes = _put(engine, _keys(A, 100, 5))
    assert ErrorCode.NO_AVAILABLE_HANDLE in codes and engine.stats()["tenant_budget_refusals"] >= 1
    assert _held(engine, held) == len(held)
    for lease in leases:
        engine.release(lease)
    assert set(_put(engine, _keys(A, 200, 5))) == {ErrorCode.OK}  # its own blocks make room again


def test_a_budget_larger_than_the_pool_is_refused(make_engine):
    import pytest

    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="tenant_budgets"):
        make_engine(memory_size=64 * KiB, tenant_budgets={A: 128 * KiB})
