"""`share_across_tp`: a block stored as one value per KV head, so instances of any TP size share it.

vLLM's CPU cache is head-major inside a block ([heads, tokens, K and V]): a TP=2 rank holds half
the heads of a TP=1 instance's block, and a head's bytes are the same whoever computed them.
"""

from __future__ import annotations

import pytest
import torch

from connector_fakes import BLOCK_SIZE, HEAD_DIM, LAYER_NAMES, NUM_BLOCKS, make_kv_cache_config
from kvpool.errors import ConfigError
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata

HEADS = 2
SHARE = {"backend": "server", "share_across_tp": True}
H = [bytes([i]) * 32 for i in range(3)]


def config(layout: str = "LBHNC"):
    """vLLM's KV cache config with the axis order it resolved (the CPU backend's: heads first)."""
    c = make_kv_cache_config()
    c.kv_cache_layout = layout
    return c


def head_major(heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_DIM, generator=g) for name in LAYER_NAMES}


def save(worker, block_ids):
    worker.wait_for_save(KVPoolMetadata(saves=[BlockTask("a", H[:len(block_ids)], block_ids)]))
    worker._transfer.wait(timeout=10)


def load(worker, block_ids):
    worker.start_load_kv(KVPoolMetadata(loads=[BlockTask("b", H[:len(block_ids)], block_ids)]))
    return worker.get_block_ids_with_load_errors()


def test_tp2_ranks_load_their_heads_of_what_tp1_saved(make_worker):
    tp1, kv1, pool = make_worker(SHARE, kv_heads=HEADS, kv_cache_config=config(), kv_caches=head_major(HEADS, 1))
    ranks = [make_worker({**SHARE, "lookup_rpc_port": 10 + r}, tp=(r, 2), kv_heads=HEADS, backend=pool,
                         kv_cache_config=config(), kv_caches=head_major(1, 2 + r)) for r in range(2)]
    save(tp1, [1, 2])
    assert len(pool.data) == 2 * HEADS and {k.split("@")[2] for k in pool.data} == {"h0/2", "h1/2"}
    assert ranks[0][0]._lookup_hit(H[:3], 0).blocks == 2  # every head of blocks 0 and 1, no block 2
    for r, (worker, kv, _) in enumerate(ranks):
        assert load(worker, [5, 6]) == set()
        for name in LAYER_NAMES:
            assert torch.equal(kv[name][5:7, 0], kv1[name][1:3, r])  # rank r holds head r


def test_tp1_assembles_its_heads_from_what_tp2_ranks_saved(make_worker):
    ranks = [make_worker({**SHARE, "lookup_rpc_port": 10 + r}, tp=(r, 2), kv_heads=HEADS,
                         kv_cache_config=config(), kv_caches=head_major(1, 2 + r)) for r in range(2)]
    pool = ranks[0][2]
    ranks[1][0].backend = pool  # one shared store (the factory made one per worker)
    for worker, _, _ in ranks:
        save(worker, [3])
    tp1, kv1, _ = make_worker({**SHARE, "lookup_rpc_port": 20}, kv_heads=HEADS, backend=pool,
                              kv_cache_config=config(), kv_caches=head_major(HEADS, 9))
    assert tp1._lookup_hit(H[:1], 0).blocks == 1
    assert load(tp1, [7]) == set()
    for r, (_, kv, _) in enumerate(ranks):
        for name in LAYER_NAMES:
            assert torch.equal(kv1[name][7, r], kv[name][3, 0])


def test_a_missing_head_fails_the_whole_block(make_worker):
    tp1, kv1, pool = make_worker(SHARE, kv_heads=HEADS, kv_cache_config=config(), kv_caches=head_major(HEADS, 1))
    save(tp1, [1, 2])
    del pool.data[next(k for k in pool.data if "@h1/2@" in k and k.endswith(H[1].hex()))]
    reader, kv, _ = make_worker({**SHARE, "lookup_rpc_port": 30}, kv_heads=HEADS, backend=pool,
                                kv_cache_config=config(), kv_caches=head_major(HEADS, 4))
    assert reader._lookup_hit(H[:2], 0).blocks == 1
    assert load(reader, [5, 6]) == {6}
    assert torch.count_nonzero(kv[LAYER_NAMES[0]][6]) == 0  # never half a block: zeroed whole


def test_ranks_that_share_a_head_write_it_once(make_worker):
    # One KV head over TP=2: both ranks hold head 0, the first writes it.
    ranks = [make_worker({**SHARE, "lookup_rpc_port": 40 + r}, tp=(r, 2), kv_heads=1,
                         kv_cache_config=config(), kv_caches=head_major(1, 5)) for r in range(2)]
    assert [w.scheme.is_writer for w, _, _ in ranks] == [True, False]
    assert [list(w.scheme.head_range) for w, _, _ in ranks] == [[0], [0]]


@pytest.mark.parametrize("layout", ["LBNHC", None])
def test_a_cache_that_is_not_head_major_is_refused(make_worker, layout):
    with pytest.raises(ConfigError) as exc:
        make_worker(SHARE, kv_heads=HEADS, kv_cache_config=config(layout))  # tokens before heads, or unknown
    assert exc.value.key == "share_across_tp"


def test_a_block_whose_first_axis_is_not_its_heads_is_refused(make_worker):
    with pytest.raises(ConfigError) as exc:  # [blocks, tokens, heads, dim]: vLLM said LBHNC, the shape disagrees
        make_worker(SHARE, kv_heads=HEADS, kv_cache_config=config(),
                    kv_caches={n: torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM) for n in LAYER_NAMES})
    assert exc.value.key == "share_across_tp"
