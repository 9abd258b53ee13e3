"""vLLM's per-layer KV cache tensors -> per-block bytes, and the layout fingerprint.

vLLM hands the worker one tensor per attention layer. Whatever the backend's layout
([num_blocks, 2, block_size, ...] on CPU, [2, num_blocks, ...] on some GPU backends), a block's
bytes in one layer are a few contiguous runs. We find the block dimension from the tensor
(its size is `num_blocks`), never from assumptions, and keep two views of every layer:

- `blocks`: the layer with the block dimension first ([num_blocks, ...], possibly strided), on
  the cache's own device, as the widest integer type that tiles its last dimension (int64 for
  any usual head size): what the staging path gathers from and scatters into. Device gathers
  and scatters cost per element, and on CPU an 8-byte element moves 5x faster than a byte;
- for a cache in host memory, uint8 numpy views of the contiguous runs of each block, so a
  block's value is a list of views with no copy made (the direct path).

Both give a block's bytes in the same order (layer by layer, runs in memory order within a
layer), so a value written by one path reads back through the other.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvpool.keys import LayoutInfo


def _manager_blocks(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`t` with vLLM's blocks as its first dimension. Where the attention kernel takes smaller
    blocks than the KV cache manager (vLLM splits each block into `ratio` kernel blocks, uniformly
    strided, e.g. a hybrid model's raised block size on a GPU kernel of 16-token blocks), the
    first dimension counts kernel blocks: regrouping them is a view."""
    if t.dim() and t.shape[0] != num_blocks and num_blocks and t.shape[0] % num_blocks == 0 \
            and num_blocks not in t.shape:
        return t.unflatten(0, (num_blocks, -1))
    return t


def _block_dim(t: torch.Tensor, num_blocks: int) -> int:
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"KV cache tensor of shape {tuple(t.shape)} has no dimension of num_blocks={num_blocks}")
    # If several dims match (tiny caches), the outermost one with the largest stride is the block dim.
    return max(dims, key=lambda d: t.stride(d))


def _segments(t: torch.Tensor) -> list[torch.Tensor]:
    """Split `t` ([num_blocks, ...] after moving the block dim first) into views whose
    per-block part is contiguous."""
    rest = t[0]
    if rest.is_contiguous():
        return [t]
    return [seg for i in range(t.shape[1]) for seg in _segments(t.select(1, i))]


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` (uint8, last dimension contiguous) viewed as the widest integer type whose size
    divides the last dimension, every other stride and the start offset: the same bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        w = dtype.itemsize
        if (t.shape[-1] % w == 0 and t.storage_offset() % w == 0
                and all(st % w == 0 for st in t.stride()[:-1])):
            return t.view(dtype)
    return t


def _host_views(t: torch.Tensor) -> list[np.ndarray]:
    """uint8 numpy views of `t` ([num_blocks, ...], host memory), one per contiguous run of a block."""
    return [s.view(s.shape[0], -1).view(torch.uint8).numpy() for s in _segments(t)]


@dataclasses.dataclass
class LayerView:
    """One layer's KV cache as `KVLayout` addresses it: its blocks as integer words (any device)
    and, for a cache in host memory, byte views of each block's contiguous runs."""

    name: str
    blocks: torch.Tensor  # integer words, block dimension first, on the cache's device
    segments: list[np.ndarray]  # host caches only: each [num_blocks, segment_bytes], uint8 views
    # Split by KV head (`heads`): per head, its views like `segments` (host caches only).
    head_segments: list[list[np.ndarray]] = dataclasses.field(default_factory=list)


class KVLayout:
    """Byte views of every layer's KV cache, addressed by vLLM block id.

    Invariant: `block_buffers(b)` lists the same byte ranges, in the same order, on every
    instance with the same fingerprint, so a pooled value can be written by one and read by
    another.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int,
                 num_layers_total: int, cache_layout: str, heads: int = 0) -> None:
        """`heads`: the KV heads a block of each layer holds, to address each head's bytes on
        its own (`head_buffers`): a value per head is the same bytes whatever the TP size that
        wrote it. The block's outermost dimension must be its heads (a head-major block, as
        vLLM's CPU cache is); the fingerprint then describes one head's block."""
        self.layers: list[LayerView] = []
        first: torch.Tensor | None = None
        block_shape: tuple[int, ...] = ()
        for name, t in kv_caches.items():
            t = _manager_blocks(t, num_blocks)
            d = _block_dim(t, num_blocks)
            moved = t.movedim(d, 0)
            if first is None:
                first, block_shape = t, tuple(moved.shape[1:])
            elif t.dtype != first.dtype or tuple(moved.shape[1:]) != block_shape or t.device != first.device:
                raise ValueError(f"layer {name} has another KV shape, dtype or device than the first layer")
            if moved.stride(-1) != 1:
                raise ValueError(f"KV cache of layer {name} has a strided last dimension {tuple(t.stride())}")
            as_words = _as_words(moved.view(torch.uint8))  # the last dimension becomes bytes, then words
            segs = []
            if t.device.type == "cpu":
                segs = _host_views(moved)
            per_head = []
            if heads:
                if moved.dim() < 3 or moved.shape[1] != heads:
                    raise ValueError(f"KV cache of layer {name} (block shape {tuple(moved.shape[1:])}) is not "
                                     f"head-major with {heads} heads: its heads cannot be stored apart")
                if t.device.type != "cpu":
                    raise ValueError(f"the KV cache is on {t.device}: values per head need a cache in host memory")
                per_head = [_host_views(moved.select(1, h)) for h in range(heads)]
            self.layers.append(LayerView(name, as_words, segs, per_head))
        if first is None:
            raise ValueError("no KV cache tensors were registered")
        self.dtype = first.dtype
        self.device = first.device
        # One layer's block in bytes; every layer has the same (checked above).
        first_blocks = self.layers[0].blocks
        self.layer_block_bytes = first_blocks[0].numel() * first_blocks.element_size()
        self.block_bytes = self.layer_block_bytes * len(self.layers)
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}
        # Every layer's segments in one list, and where each layer's start: a block's views for a
        # range of layers are then one slice and one comprehension (a hit builds hundreds).
        self._segments = [seg for layer in self.layers for seg in layer.segments]
        self._first_segment = [0]
        for layer in self.layers:
            self._first_segment.append(self._first_segment[-1] + len(layer.segments))
        self.heads = heads
        # Per head, every layer's views of that head in one list (layers start where the whole
        # block's do only when a head is one run per layer, so they keep their own index).
        self._head_segments = [[seg for layer in self.layers for seg in layer.head_segments[h]]
                               for h in range(heads)]
        self._first_head_segment = [0]
        for layer in self.layers:
            self._first_head_segment.append(self._first_head_segment[-1] + (len(layer.head_segments[0]) if heads else 0))
        self.info = LayoutInfo(
            dtype=str(first.dtype).removeprefix("torch."),
            block_size=block_size,
            block_shape=block_shape[1:] if heads else block_shape,
            num_layers_total=num_layers_total,
            cache_layout=f"{cache_layout}:per-head" if heads else cache_layout,
        )

    @property
    def in_host_memory(self) -> bool:
        """Whether numpy views of the cache exist (the direct path's precondition)."""
        return self.device.type == "cpu"

    def index_of(self, layer_name: str) -> int | None:
        """The position of a layer by vLLM's name for it (layerwise hooks name layers); None for
        a layer without a KV cache of its own (one that shares another layer's)."""
        return self._index.get(layer_name)

    def block_buffers(self, block_id: int) -> list[np.ndarray]:
        """The byte views that make up block `block_id` across all layers, in layer order."""
        return self.stage_buffers(block_id, range(len(self.layers)))

    def head_buffers(self, block_id: int, head: int, layer_range: range) -> list[np.ndarray]:
        """The byte views of KV head `head` (of this rank's) of block `block_id`, for a slice of
        the layers, in layer order. Host caches split by head only."""
        first = self._first_head_segment
        start, stop = first[min(layer_range.start, len(self.layers))], first[min(layer_range.stop, len(self.layers))]
        return [seg[block_id] for seg in self._head_segments[head][start:stop]]

    def stage_buffers(self, block_id: int, layer_range: range) -> list[np.ndarray]:
        """The byte views of block `block_id` for a slice of the layers (one PP stage's, or one
        layer's in layerwise mode). Host caches only."""
        if not self.in_host_memory:
            raise ValueError(f"the KV cache is on {self.device}: its blocks move through the staging path")
        first = self._first_segment
        start, stop = first[min(layer_range.start, len(self.layers))], first[min(layer_range.stop, len(self.layers))]
        return [seg[block_id] for seg in self._segments[start:stop]]
