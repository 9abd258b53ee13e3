"""The two data paths on real KV tensors: the staged path (what an accelerator cache takes, here
forced on CPU) must write the same value bytes as the direct path, read them back bit-exactly,
move a batch bigger than its buffer in rounds, and leave failed blocks alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.device.copy import DirectCopier, StagedCopier, make_copier
from kvpool.device.layout import KVLayout
from kvpool.errors import NOT_FOUND, OK, ConfigError

from tests.unit.test_layout import BLOCK_SIZE, LAYERS, LAYOUTS, NUM_BLOCKS, random_tensor, raw


class DictStore:
    """A pool in a dict: `put`/`get` have the backends' batch signature."""

    def __init__(self, missing: set[str] = frozenset()) -> None:
        self.values: dict[str, bytes] = {}
        self.missing = missing
        self.calls = 0

    def put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self.calls += 1
        for k, bufs in zip(keys, values):
            self.values[k] = b"".join(b.tobytes() for b in bufs)
        return [OK] * len(keys)

    def get(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        self.calls += 1
        codes = []
        for k, bufs in zip(keys, values):
            if k in self.missing or k not in self.values:
                codes.append(NOT_FOUND)
                continue
            data, pos = np.frombuffer(self.values[k], dtype=np.uint8), 0
            for b in bufs:
                b[:] = data[pos:pos + b.size]
                pos += b.size
            codes.append(OK)
        return codes


def layout_of(kind: str, dtype: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor], KVLayout]:
    caches, _ = LAYOUTS[kind](dtype, seed=seed)
    return caches, KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS,
                            cache_layout=kind)


def staged(layout: KVLayout, blocks_per_round: int) -> StagedCopier:
    return StagedCopier(layout, budget_bytes=2 * blocks_per_round * layout.block_bytes)


cases = pytest.mark.parametrize(("kind", "dtype"), [(k, d) for k in LAYOUTS for d in (torch.float32, torch.bfloat16)])
ALL = range(LAYERS)


@cases
def test_staged_save_writes_the_direct_paths_bytes(kind, dtype):
    caches, layout = layout_of(kind, dtype, seed=1)
    ids = [7, 2, 9, 0, 5]
    keys = [f"k{b}" for b in ids]
    direct, stage = DictStore(), DictStore()
    assert DirectCopier(layout).save(keys, ids, ALL, direct.put) == [OK] * 5
    assert staged(layout, 2).save(keys, ids, ALL, stage.put) == [OK] * 5
    assert stage.values == direct.values
    assert stage.calls == 3  # 5 blocks, 2 per round


@cases
@pytest.mark.parametrize("blocks_per_round", [1, 3, NUM_BLOCKS])
def test_staged_load_restores_blocks_bit_exactly(kind, dtype, blocks_per_round):
    src_caches, src = layout_of(kind, dtype, seed=2)
    dst_caches, dst = layout_of(kind, dtype, seed=3)
    store = DictStore()
    from_ids, to_ids = [1, 4, 8, 3], [6, 0, 2, 9]
    keys = [f"k{b}" for b in from_ids]
    DirectCopier(src).save(keys, from_ids, ALL, store.put)
    before = {n: raw(t).clone() for n, t in dst_caches.items()}
    assert staged(dst, blocks_per_round).load(keys, to_ids, ALL, store.get) == [OK] * 4
    block_dim = 0 if kind == "cpu" else 1
    for name in src_caches:
        s, d, b = src_caches[name], dst_caches[name], before[name]
        for f, t in zip(from_ids, to_ids):
            assert torch.equal(raw(d.select(block_dim, t)), raw(s.select(block_dim, f)))
        for other in set(range(NUM_BLOCKS)) - set(to_ids):  # nothing else written
            assert torch.equal(raw(d.select(block_dim, other)), b.select(block_dim, other))


@cases
def test_failed_blocks_are_left_untouched_and_reported(kind, dtype):
    _, src = layout_of(kind, dtype, seed=4)
    dst_caches, dst = layout_of(kind, dtype, seed=5)
    store = DictStore(missing={"k1"})
    DirectCopier(src).save(["k0", "k1", "k2"], [0, 1, 2], ALL, store.put)
    before = {n: raw(t).clone() for n, t in dst_caches.items()}
    codes = staged(dst, 8).load(["k0", "k1", "k2"], [3, 4, 5], ALL, store.get)
    assert codes == [OK, NOT_FOUND, OK]
    block_dim = 0 if kind == "cpu" else 1
    for name, t in dst_caches.items():
        assert torch.equal(raw(t.select(block_dim, 4)), before[name].select(block_dim, 4))
        assert not torch.equal(raw(t.select(block_dim, 3)), before[name].select(block_dim, 3))


@cases
@pytest.mark.parametrize("failure", ["code", "raise"])
def test_a_failed_direct_load_leaves_zeros_not_the_failed_bytes(kind, dtype, failure):
    # A store that writes k0, part of k1, and then fails k1 (a checksum mismatch after the copy)
    # or the whole call (its connection breaks mid-batch): no failed block keeps what it wrote.
    _, src = layout_of(kind, dtype, seed=8)
    dst_caches, dst = layout_of(kind, dtype, seed=9)
    store = DictStore()
    DirectCopier(src).save(["k0", "k1"], [0, 1], ALL, store.put)

    def failing_get(keys, values):
        codes = store.get(keys, values)
        for buf in values[1]:
            buf.fill(0xFF)  # NaN in every float format
        if failure == "raise":
            raise ConnectionResetError("the store went away")
        return [codes[0], NOT_FOUND]

    before = {n: raw(t).clone() for n, t in dst_caches.items()}
    if failure == "raise":
        with pytest.raises(ConnectionResetError):
            DirectCopier(dst).load(["k0", "k1"], [3, 4], ALL, failing_get)
    else:
        assert DirectCopier(dst).load(["k0", "k1"], [3, 4], ALL, failing_get) == [OK, NOT_FOUND]
    block_dim = 0 if kind == "cpu" else 1
    for name, t in dst_caches.items():
        assert not torch.any(raw(t.select(block_dim, 4))), name
        if failure == "raise":  # every block of the call failed
            assert not torch.any(raw(t.select(block_dim, 3))), name
        else:
            assert not torch.equal(raw(t.select(block_dim, 3)), before[name].select(block_dim, 3))
        for other in set(range(NUM_BLOCKS)) - {3, 4}:
            assert torch.equal(raw(t.select(block_dim, other)), before[name].select(block_dim, other))


@cases
def test_a_layer_slice_moves_only_those_layers(kind, dtype):
    """One layer (layerwise mode) or one PP stage's layers: the value holds exactly those."""
    src_caches, src = layout_of(kind, dtype, seed=6)
    dst_caches, dst = layout_of(kind, dtype, seed=7)
    store = DictStore()
    staged(src, 4).save(["a", "b"], [2, 3], range(1, 2), store.put)
    assert len(store.values["a"]) == src.layer_block_bytes
    direct = DictStore()
    DirectCopier(src).save(["a", "b"], [2, 3], range(1, 2), direct.put)
    assert store.values == direct.values
    before = {n: raw(t).clone() for n, t in dst_caches.items()}
    staged(dst, 4).load(["a", "b"], [2, 3], range(1, 2), store.get)
    block_dim = 0 if kind == "cpu" else 1
    names = list(dst_caches)
    assert torch.equal(raw(dst_caches[names[1]].select(block_dim, 3)), raw(src_caches[names[1]].select(block_dim, 3)))
    for name in (names[0], names[2]):
        assert torch.equal(raw(dst_caches[name]), before[name])


def test_values_cross_between_paths_and_layouts_of_equal_bytes():
    """A value saved by the staged path loads through the direct one, and the reverse."""
    src_caches, src = layout_of("kv_first", torch.bfloat16, seed=8)
    dst_caches, dst = layout_of("kv_first", torch.bfloat16, seed=9)
    store = DictStore()
    staged(src, 2).save(["x", "y", "z"], [0, 1, 2], ALL, store.put)
    assert DirectCopier(dst).load(["x", "y", "z"], [5, 6, 7], ALL, store.get) == [OK] * 3
    for name in src_caches:
        for f, t in ((0, 5), (1, 6), (2, 7)):
            assert torch.equal(raw(dst_caches[name][:, t]), raw(src_caches[name][:, f]))


@pytest.mark.parametrize(("last_dim", "moved"), [(8, torch.complex128), (4, torch.int64), (3, torch.int16)])
def test_staged_moves_the_widest_element_that_tiles_a_block(last_dim, moved):
    """On CPU the gathers and scatters index 16-byte elements where a block's rows allow it,
    narrower ones where they do not, and every width moves every bit pattern unchanged."""
    def caches(seed: int) -> dict[str, torch.Tensor]:
        return {f"l{i}": random_tensor((NUM_BLOCKS, 2, BLOCK_SIZE, last_dim), torch.bfloat16, seed + i)
                for i in range(2)}

    src_caches, dst_caches = caches(10), caches(20)
    src, dst = (KVLayout(c, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=2, cache_layout="cpu")
                for c in (src_caches, dst_caches))
    store = DictStore()
    assert staged(src, 2).save(["a", "b", "c"], [1, 2, 3], range(2), store.put) == [OK] * 3
    copier = staged(dst, 2)
    assert {t.dtype for t in copier._moved} == {moved}
    assert copier.load(["a", "b", "c"], [7, 8, 9], range(2), store.get) == [OK] * 3
    for name in src_caches:
        for f, t in ((1, 7), (2, 8), (3, 9)):
            assert torch.equal(raw(dst_caches[name][t]), raw(src_caches[name][f]))


def test_budget_below_two_blocks_is_a_config_error():
    _, layout = layout_of("cpu", torch.float32, seed=0)
    with pytest.raises(ConfigError, match="staging_buffer_size.*two blocks"):
        StagedCopier(layout, budget_bytes=layout.block_bytes)


def test_auto_picks_direct_on_host_and_staged_is_forced_by_config():
    _, layout = layout_of("cpu", torch.float32, seed=0)
    assert make_copier(layout, "auto", 1 << 20).kind == "direct"
    assert make_copier(layout, "staged", 1 << 20).kind == "staged"
    assert "host memory" in make_copier(layout, "staged", 1 << 20).describe()


def test_direct_path_refuses_a_cache_off_the_host():
    caches = {"l0": random_tensor((NUM_BLOCKS, 2, BLOCK_SIZE, 16), torch.float32, 0).to("meta")}
    layout = KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=1, cache_layout="meta")
    with pytest.raises(ConfigError, match="transfer_path.*on meta"):
        make_copier(layout, "direct", 1 << 20)
