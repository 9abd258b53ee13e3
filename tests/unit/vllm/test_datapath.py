"""PoolWorker on its two data paths and in layerwise mode, over real CPU KV tensors.

`transfer_path: staged` runs the accelerator path (host buffers, index_select/index_copy_) on
CPU; layerwise mode is driven through the connector hooks vLLM calls per attention layer
(`save_kv_layer` after a layer wrote its KV, `wait_for_layer_load` before it reads it).
"""

from __future__ import annotations

import threading

import pytest
import torch

import kvpool.vllm.worker as worker_mod
from connector_fakes import LAYER_NAMES, NUM_BLOCKS, DictBackend, block_hash
from kvpool.device.copy import StagedCopier
from kvpool.errors import ConfigError
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata

H = [block_hash(i) for i in range(8)]
STAGED = {"transfer_path": "staged", "staging_buffer_size": "1MB"}
LAYERWISE = {"use_layerwise": True}


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch) -> None:
    monkeypatch.setattr(worker_mod, "DRAIN_TIMEOUT_S", 10.0)
    monkeypatch.setattr(worker_mod, "LAYER_WAIT_TIMEOUT_S", 10.0)


def same_block(a: dict[str, torch.Tensor], a_id: int, b: dict[str, torch.Tensor], b_id: int) -> bool:
    return all(torch.equal(a[n][a_id], b[n][b_id]) for n in LAYER_NAMES)


def saves(req_id: str, hashes: list[bytes], ids: list[int]) -> KVPoolMetadata:
    return KVPoolMetadata(saves=[BlockTask(req_id, hashes, ids)])


def loads(req_id: str, hashes: list[bytes], ids: list[int]) -> KVPoolMetadata:
    return KVPoolMetadata(loads=[BlockTask(req_id, hashes, ids)])


def forward(worker, meta: KVPoolMetadata, hooks: bool = True) -> None:
    """One step as vLLM's model runner drives it: start loads, each attention layer waits for
    its load and then hands its KV over, then the step's end."""
    worker.start_load_kv(meta)
    if hooks:
        for name in LAYER_NAMES:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)


def stats(worker) -> dict[str, float]:
    s = worker.get_stats()
    return dict(s.data) if s is not None else {}


@pytest.mark.parametrize("writer_extra,reader_extra", [
    (STAGED, STAGED), (STAGED, {}), ({}, STAGED),
], ids=["staged-staged", "staged-direct", "direct-staged"])
def test_staged_and_direct_paths_share_values_bit_exactly(make_worker, writer_extra, reader_extra):
    writer, w_kv, pool = make_worker(writer_extra, seed=1)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1, **reader_extra}, backend=pool, seed=2)
    forward(writer, saves("a", H[:3], [1, 2, 3]))
    assert writer._transfer.wait(timeout=10)
    forward(reader, loads("b", H[:3], [7, 8, 9]))
    assert reader.get_block_ids_with_load_errors() == set()
    assert all(same_block(r_kv, r, w_kv, w) for w, r in ((1, 7), (2, 8), (3, 9)))


def test_staged_batch_larger_than_its_buffer_moves_in_rounds(make_worker):
    writer, w_kv, pool = make_worker(STAGED, seed=13)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1, **STAGED}, backend=pool, seed=14)
    for w in (writer, reader):  # two blocks per round (the smallest configurable buffer holds 512)
        w.groups[0].copier = StagedCopier(w.layout, budget_bytes=4 * w.layout.block_bytes)
    hashes, n = [block_hash(100 + i) for i in range(5)], 5
    forward(writer, saves("a", hashes, list(range(n))))
    assert writer._transfer.wait(timeout=10)
    assert len(pool.data) == n
    forward(reader, loads("b", hashes, list(range(NUM_BLOCKS - n, NUM_BLOCKS))))
    assert reader.get_block_ids_with_load_errors() == set()
    assert all(same_block(r_kv, NUM_BLOCKS - n + i, w_kv, i) for i in range(n))


def test_layerwise_saves_leave_layer_by_layer_and_load_back_exactly(make_worker):
    writer, w_kv, pool = make_worker(LAYERWISE, seed=3)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1, **LAYERWISE}, backend=pool, seed=4)
    forward(writer, saves("a", H[:2], [1, 2]))
    assert writer._transfer.wait(timeout=10)
    keys = set(pool.data)
    assert len(keys) == 2 * len(LAYER_NAMES) and all("@l" in k for k in keys)
    w = stats(writer)
    assert (w["save_blocks"], w["layer_saves_sent"]) == (2, len(LAYER_NAMES))
    assert w["save_bytes"] == 2 * sum(t[0].numel() * t.element_size() for t in w_kv.values())

    assert reader._lookup_hit(H[:3]).blocks == 2  # every layer's key of a block must exist
    forward(reader, loads("b", H[:2], [5, 6]))
    assert reader.get_block_ids_with_load_errors() == set()
    assert same_block(r_kv, 5, w_kv, 1) and same_block(r_kv, 6, w_kv, 2)
    r = stats(reader)
    assert (r["load_blocks"], r["layer_loads_waited"]) == (2, len(LAYER_NAMES))


class GatedBackend(DictBackend):
    """Reads wait at a gate per call, so a test can hold a layer back and see who waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)

    def batch_get_into(self, keys, values):
        self.gate.acquire(timeout=10)
        return super().batch_get_into(keys, values)


def test_the_forward_pass_waits_for_exactly_its_layer(make_worker):
    pool = GatedBackend()
    writer, w_kv, _ = make_worker(LAYERWISE, backend=pool, seed=5)
    forward(writer, saves("a", H[:1], [1]))
    assert writer._transfer.wait(timeout=10)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1, **LAYERWISE}, backend=pool, seed=6)
    meta = loads("b", H[:1], [4])
    reader.start_load_kv(meta)
    first, second = LAYER_NAMES[0], LAYER_NAMES[1]
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (reader.wait_for_layer_load(first), done.set()))
    waiter.start()
    assert not done.wait(0.2)  # layer 0 has not arrived: the forward pass waits
    pool.gate.release()  # layer 0 arrives
    assert done.wait(10)
    waiter.join()
    assert torch.equal(r_kv[first][4], w_kv[first][1])
    assert not torch.equal(r_kv[second][4], w_kv[second][1])  # layer 1 still on its way
    for _ in LAYER_NAMES[1:]:
        pool.gate.release()
    for name in LAYER_NAMES[1:]:
        reader.wait_for_layer_load(name)
    reader.wait_for_save(meta)
    assert reader.get_block_ids_with_load_errors() == set()
    assert same_block(r_kv, 4, w_kv, 1)


def test_layers_the_forward_pass_never_waited_for_become_load_errors(make_worker):
    """If a platform skipped vLLM's per-layer hooks, the forward pass may have read KV that had
    not arrived: those blocks must be recomputed, never trusted."""
    writer, _, pool = make_worker(LAYERWISE, seed=7)
    forward(writer, saves("a", H[:2], [1, 2]), hooks=False)  # wait_for_save sends every layer
    assert writer._transfer.wait(timeout=10)
    assert len(pool.data) == 2 * len(LAYER_NAMES)
    reader, _, _ = make_worker({"lookup_rpc_port": 1, **LAYERWISE}, backend=pool, seed=8)
    forward(reader, loads("b", H[:2], [5, 6]), hooks=False)
    assert reader.get_block_ids_with_load_errors() == {5, 6}


def test_a_missing_layer_fails_its_block(make_worker):
    writer, _, pool = make_worker(LAYERWISE, seed=9)
    forward(writer, saves("a", H[:2], [1, 2]))
    assert writer._transfer.wait(timeout=10)
    victim = next(k for k in pool.data if k.endswith(f"{H[1].hex()}@l1"))
    del pool.data[victim]
    reader, _, _ = make_worker({"lookup_rpc_port": 1, **LAYERWISE}, backend=pool, seed=10)
    forward(reader, loads("b", H[:2], [5, 6]))
    assert reader.get_block_ids_with_load_errors() == {6}


def test_layerwise_async_loads_fetch_every_layer(make_worker):
    writer, w_kv, pool = make_worker(LAYERWISE, seed=11)
    forward(writer, saves("a", H[:2], [1, 2]))
    assert writer._transfer.wait(timeout=10)
    reader, r_kv, _ = make_worker({"lookup_rpc_port": 1, "load_async": True, **LAYERWISE}, backend=pool, seed=12)
    reader.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", H[:2], [5, 6], is_async=True)]))
    assert reader._transfer.wait(timeout=10)
    assert reader.get_finished(None) == (None, {"b"})
    assert reader.get_block_ids_with_load_errors() == set()
    assert same_block(r_kv, 5, w_kv, 1) and same_block(r_kv, 6, w_kv, 2)


def test_layerwise_with_pipeline_parallelism_is_refused(make_worker):
    with pytest.raises(ConfigError, match="use_layerwise.*pipeline"):
        make_worker({**LAYERWISE, "backend": "server"}, pp=(0, 2))
