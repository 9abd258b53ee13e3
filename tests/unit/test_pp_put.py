"""A decode node without PP puts blocks that PP prefill stages read (consumer_is_to_put).

vLLM's CPU backend cannot run eager PP here (DESIGN §9: PP rank 1 dies on the first request in
eager mode), so this checks the layer-slicing logic on real KV tensors and a real pool engine:
each stage's key holds exactly that stage's layers, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.backends.local import LocalBackend
from kvpool.config import LocalSettings
from kvpool.errors import ConfigError, ErrorCode
from kvpool.keys import KeyScheme, prefill_stage_schemes
from kvpool.device.layout import KVLayout

NUM_BLOCKS, BLOCK, HEADS, HEAD = 8, 16, 2, 32


def caches(layers: range, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)
            for i in layers}


def layout(kv: dict[str, torch.Tensor]) -> KVLayout:
    return KVLayout(kv, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_layers_total=6, cache_layout="cpu:test")


@pytest.mark.parametrize("partition", [(3, 3), (2, 4), (5, 1)])
def test_decode_put_is_read_by_each_prefill_stage(partition):
    decode_kv = caches(range(6), seed=1)
    decode = layout(decode_kv)
    scheme = KeyScheme(model="m", layout=decode.info.fingerprint())
    targets = prefill_stage_schemes(scheme, 6, 2, partition)
    split = partition
    assert [len(r) for _, r in targets] == list(split)

    pool = LocalBackend(LocalSettings(memory_size=64 << 20), "test")
    block_hash, decode_block = b"\x01" * 32, 5
    for stage_scheme, layers in targets:
        assert pool.batch_put([stage_scheme.key(block_hash)], [decode.stage_buffers(decode_block, layers)]) == [0]

    start = 0
    for stage, count in enumerate(split):
        names = range(start, start + count)
        stage_kv = caches(names, seed=100 + stage)  # other contents: the read must overwrite them
        reader = layout(stage_kv)
        assert reader.info.fingerprint() == decode.info.fingerprint()
        reader_scheme = KeyScheme(model="m", layout=reader.info.fingerprint(), pp_rank=stage, pp_size=2)
        assert pool.batch_get_into([reader_scheme.key(block_hash)], [reader.block_buffers(2)]) == [ErrorCode.OK]
        for i in names:
            name = f"model.layers.{i}.self_attn.attn"
            assert torch.equal(stage_kv[name][2], decode_kv[name][decode_block])
        start += count
    pool.close()


def test_partition_must_cover_all_layers():
    scheme = KeyScheme(model="m", layout="x")
    with pytest.raises(ConfigError) as exc:
        prefill_stage_schemes(scheme, 6, 2, (2, 2))
    assert exc.value.key == "prefill_pp_layer_partition"


def test_vllm_split_is_used_when_none_is_configured():
    from vllm.distributed.utils import get_pp_indices

    # The worker's default: vLLM's own split of the layers over the prefill stages.
    assert [e - s for s, e in (get_pp_indices(7, p, 3) for p in range(3))] == [2, 3, 2]
