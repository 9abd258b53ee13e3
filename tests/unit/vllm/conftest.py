"""Fixtures for the unit tests of kvpool's vLLM layer: a private IPC directory, a fake lookup
client for the scheduler, and a factory for `PoolWorker`s over real KV tensors and a fake backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.v1.kv_cache_interface import KVCacheConfig

import kvpool.vllm.lookup as lookup_mod
import kvpool.vllm.scheduler as scheduler_mod
import kvpool.vllm.worker as worker_mod
from connector_fakes import (
    DictBackend,
    FakeLookupClient,
    make_kv_cache_config,
    make_kv_caches,
    make_vllm_config,
)
from kvpool.config import load_config
from kvpool.vllm.worker import PoolWorker


@pytest.fixture(autouse=True)
def rpc_dir(tmp_path, monkeypatch) -> str:
    """Lookup sockets and their lock files go to this test's own directory, never shared /tmp."""
    path = str(tmp_path)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", path)
    # Lookup servers notice close() sooner, so a test's teardown does not wait 200 ms per server.
    monkeypatch.setattr(lookup_mod, "POLL_INTERVAL_MS", 10)
    return path


@pytest.fixture
def fake_lookup(monkeypatch) -> type[FakeLookupClient]:
    """Replace the scheduler's `LookupClient`; tests fill `FakeLookupClient.pooled`."""
    monkeypatch.setattr(FakeLookupClient, "instances", [])
    monkeypatch.setattr(FakeLookupClient, "pooled", set())
    monkeypatch.setattr(scheduler_mod, "LookupClient", FakeLookupClient)
    return FakeLookupClient


WorkerFactory = Callable[..., tuple[PoolWorker, dict[str, torch.Tensor], DictBackend]]


@pytest.fixture
def make_worker(monkeypatch) -> Iterator[WorkerFactory]:
    """Build registered `PoolWorker`s at chosen TP/PP ranks over `make_kv_caches` tensors.

    The backend factory is replaced by one returning the given (or a new) `DictBackend`; every
    worker is shut down after the test, so no transfer or lookup thread outlives it.
    """
    workers: list[PoolWorker] = []

    def factory(extra: dict[str, Any] | None = None, role: str = "kv_both", *, backend: DictBackend | None = None,
                tp: tuple[int, int] = (0, 1), pp: tuple[int, int] = (0, 1), kv_heads: int = 2,
                seed: int = 0, model: dict[str, Any] | None = None,
                kv_cache_config: KVCacheConfig | None = None,
                kv_caches: dict[str, torch.Tensor] | None = None,
                vllm_config: Any = None) -> tuple[PoolWorker, dict[str, torch.Tensor], DictBackend]:
        backend = backend if backend is not None else DictBackend(shared=tp[1] > 1 or pp[1] > 1)
        # The worker imports these at construction time, so patching the module is enough.
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp[0], world_size=tp[1]))
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=pp[0], world_size=pp[1]))
        monkeypatch.setattr(worker_mod, "create_backend", lambda config, client_name=None: backend)
        worker = PoolWorker(vllm_config or make_vllm_config(kv_heads=kv_heads, **(model or {})), load_config(extra, role),
                            kv_cache_config or make_kv_cache_config())
        workers.append(worker)
        caches = kv_caches if kv_caches is not None else make_kv_caches(seed)
        worker.register_kv_caches(caches)
        return worker, caches, backend

    yield factory
    for w in workers:
        w.shutdown()
