"""KVLayout: per-layer KV cache tensors -> per-block uint8 views, checked on real CPU tensors.

The views must alias the KV cache (a load writes straight into vLLM's blocks), cover exactly one
block's bytes in every layer, and copy bit-exactly between blocks whatever the dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.device.layout import KVLayout

NUM_BLOCKS = 10
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD = 8
LAYERS = 3


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and infs included), so any byte mix-up is visible."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (bit-exact comparison, NaN payloads included)."""
    return t.contiguous().view(torch.uint8)


def cpu_layout(dtype: torch.dtype, num_blocks: int = NUM_BLOCKS, seed: int = 0):
    """vLLM-CPU: [num_blocks, kv_heads, block_size, 2*head] per layer; block dim 0."""
    caches = {f"model.layers.{i}.self_attn.attn": random_tensor((num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD), dtype,
                                                                 seed + i)
              for i in range(LAYERS)}
    return caches, 0


def kv_first_layout(dtype: torch.dtype, num_blocks: int = NUM_BLOCKS, seed: int = 0):
    """GPU flash-attention style: [2, num_blocks, block_size, heads, head] per layer; block dim 1."""
    caches = {f"model.layers.{i}.self_attn.attn": random_tensor((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD), dtype,
                                                                 seed + i)
              for i in range(LAYERS)}
    return caches, 1


LAYOUTS = {"cpu": cpu_layout, "kv_first": kv_first_layout}
DTYPES = [torch.float32, torch.bfloat16]


def make(kind: str, dtype: torch.dtype):
    caches, block_dim = LAYOUTS[kind](dtype)
    layout = KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS,
                      cache_layout=f"cpu:{kind}")
    return caches, block_dim, layout


def block_of(t: torch.Tensor, block_dim: int, b: int) -> torch.Tensor:
    return t.select(block_dim, b)


params = pytest.mark.parametrize(("kind", "dtype"), [(k, d) for k in LAYOUTS for d in DTYPES],
                                 ids=[f"{k}-{str(d).removeprefix('torch.')}" for k in LAYOUTS for d in DTYPES])


@params
def test_buffers_are_uint8_views_covering_one_block(kind, dtype):
    caches, block_dim, layout = make(kind, dtype)
    one_layer_block = block_of(next(iter(caches.values())), block_dim, 0)
    expected = LAYERS * one_layer_block.numel() * one_layer_block.element_size()
    for b in (0, 5, NUM_BLOCKS - 1):
        bufs = layout.block_buffers(b)
        assert all(isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 1 for x in bufs)
        assert all(x.flags.c_contiguous for x in bufs)  # backends copy each as one run
        assert sum(x.nbytes for x in bufs) == expected
        assert layout.block_bytes == expected
    # one contiguous run per layer on CPU; K and V are two runs per layer when K/V come first
    assert len(layout.block_buffers(0)) == LAYERS * (1 if kind == "cpu" else 2)


@params
def test_buffers_hold_the_blocks_bytes_in_layer_order(kind, dtype):
    caches, block_dim, layout = make(kind, dtype)
    b = 4
    got = b"".join(x.tobytes() for x in layout.block_buffers(b))
    want = b"".join(
        raw(block_of(t, block_dim, b)[kv]).numpy().tobytes() if kind == "kv_first"
        else raw(block_of(t, block_dim, b)).numpy().tobytes()
        for t in caches.values()
        for kv in ((0, 1) if kind == "kv_first" else (None,))
    )
    assert got == want


@params
def test_writing_through_a_blocks_buffers_changes_that_block_only(kind, dtype):
    caches, block_dim, layout = make(kind, dtype)
    before = {n: t.clone() for n, t in caches.items()}
    b = 6
    for x in layout.block_buffers(b):
        x[:] = 0xA5
    for name, t in caches.items():
        for other in range(NUM_BLOCKS):
            now, was = raw(block_of(t, block_dim, other)), raw(block_of(before[name], block_dim, other))
            if other == b:
                assert bool((now == 0xA5).all()), f"{name} block {b} not fully written"
            else:
                assert torch.equal(now, was), f"{name} block {other} changed"


@params
def test_copying_block_3_into_block_7_is_bit_exact(kind, dtype):
    caches, block_dim, layout = make(kind, dtype)
    before = {n: t.clone() for n, t in caches.items()}
    src, dst = layout.block_buffers(3), layout.block_buffers(7)
    assert len(src) == len(dst)
    for d, s in zip(dst, src):
        d[:] = s
    for name, t in caches.items():
        assert torch.equal(raw(block_of(t, block_dim, 7)), raw(block_of(before[name], block_dim, 3)))
        for other in range(NUM_BLOCKS):
            if other != 7:
                assert torch.equal(raw(block_of(t, block_dim, other)), raw(block_of(before[name], block_dim, other)))


@params
def test_a_value_round_trips_through_bytes(kind, dtype):
    # What a backend does: serialize block 2 to one byte string, later scatter it into block 9.
    caches, block_dim, layout = make(kind, dtype)
    before = {n: t.clone() for n, t in caches.items()}
    blob = b"".join(x.tobytes() for x in layout.block_buffers(2))
    off = 0
    for x in layout.block_buffers(9):
        x[:] = np.frombuffer(blob, dtype=np.uint8, count=x.nbytes, offset=off)
        off += x.nbytes
    assert off == len(blob)
    for name, t in caches.items():
        assert torch.equal(raw(block_of(t, block_dim, 9)), raw(block_of(before[name], block_dim, 2)))


@params
def test_stage_buffers_are_a_slice_of_the_layers(kind, dtype):
    _, _, layout = make(kind, dtype)
    per_layer = len(layout.block_buffers(0)) // LAYERS
    whole = layout.block_buffers(5)
    first, rest = layout.stage_buffers(5, range(0, 1)), layout.stage_buffers(5, range(1, LAYERS))
    assert len(first) == per_layer and len(first) + len(rest) == len(whole)
    for a, b in zip(first + rest, whole):
        assert np.shares_memory(a, b) and a.nbytes == b.nbytes
        assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


@params
def test_layout_info(kind, dtype):
    caches, block_dim, layout = make(kind, dtype)
    info = layout.info
    assert info.dtype == str(dtype).removeprefix("torch.")
    assert info.block_size == BLOCK_SIZE
    assert info.num_layers_total == LAYERS
    assert info.cache_layout == f"cpu:{kind}"
    t = next(iter(caches.values()))
    assert info.block_shape == tuple(t.movedim(block_dim, 0).shape[1:])
    assert layout.dtype == dtype


def test_fingerprint_differs_between_dtypes_and_layouts():
    fps = {make(k, d)[2].info.fingerprint() for k in LAYOUTS for d in DTYPES}
    assert len(fps) == len(LAYOUTS) * len(DTYPES)


def test_block_dim_is_found_when_another_dim_has_the_same_size():
    # num_blocks == kv_heads: the block dim is the outermost (largest stride) of the matching dims.
    caches, _ = cpu_layout(torch.float32, num_blocks=KV_HEADS)
    layout = KVLayout(caches, num_blocks=KV_HEADS, block_size=BLOCK_SIZE, num_layers_total=LAYERS, cache_layout="cpu")
    t = next(iter(caches.values()))
    assert layout.block_buffers(1)[0].tobytes() == raw(t[1]).numpy().tobytes()


def test_a_cache_in_kernel_blocks_is_addressed_by_vllms_blocks():
    # vLLM split each of its blocks into 2 kernel blocks: the tensor's first dimension is twice
    # num_blocks, and block b is kernel blocks 2b and 2b+1.
    t = random_tensor((2 * NUM_BLOCKS, KV_HEADS, BLOCK_SIZE // 2, 16), torch.float32, seed=5)
    layout = KVLayout({"l0": t}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=1, cache_layout="cpu")
    assert b"".join(v.tobytes() for v in layout.block_buffers(3)) == raw(t[6:8]).numpy().tobytes()


def test_mismatched_layer_shapes_raise():
    caches, _ = cpu_layout(torch.float32)
    caches["model.layers.9.self_attn.attn"] = random_tensor((NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD), torch.float32, 9)
    with pytest.raises(ValueError, match="model.layers.9.self_attn.attn has another KV shape, dtype or device"):
        KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS + 1, cache_layout="cpu")


def test_mismatched_layer_dtypes_raise():
    caches, _ = cpu_layout(torch.float32)
    caches["model.layers.9.self_attn.attn"] = random_tensor((NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD),
                                                            torch.bfloat16, 9)
    with pytest.raises(ValueError, match="another KV shape, dtype or device"):
        KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS + 1, cache_layout="cpu")


def test_mixed_layouts_across_layers_raise():
    caches, _ = cpu_layout(torch.float32)
    kv_first, _ = kv_first_layout(torch.float32)
    caches["model.layers.9.self_attn.attn"] = next(iter(kv_first.values()))
    with pytest.raises(ValueError, match="another KV shape"):
        KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS + 1, cache_layout="cpu")


def test_no_block_dimension_raises():
    caches, _ = cpu_layout(torch.float32)
    with pytest.raises(ValueError, match="has no dimension of num_blocks=11"):
        KVLayout(caches, num_blocks=11, block_size=BLOCK_SIZE, num_layers_total=LAYERS, cache_layout="cpu")


def test_no_layers_raise():
    with pytest.raises(ValueError, match="no KV cache tensors"):
        KVLayout({}, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=LAYERS, cache_layout="cpu")


def test_accelerator_cache_has_no_host_views():
    """A cache off the host (here torch's `meta` device) is accepted for the staging path, and
    the direct path's numpy views are refused with a message naming the device."""
    caches = {"l0": torch.empty((NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD), device="meta")}
    layout = KVLayout(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers_total=1, cache_layout="meta")
    assert not layout.in_host_memory
    assert layout.block_bytes == KV_HEADS * BLOCK_SIZE * 2 * HEAD * 4
    with pytest.raises(ValueError, match="on meta.*staging path"):
        layout.block_buffers(0)
