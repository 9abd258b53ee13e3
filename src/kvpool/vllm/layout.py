"""vLLM's per-layer KV cache tensors -> per-block byte segments, and the layout fingerprint.

vLLM hands the worker one tensor per attention layer. Whatever the backend's layout
([num_blocks, 2, block_size, ...] on CPU, [2, num_blocks, ...] on some GPU backends), a block's
bytes in one layer are a few contiguous runs. We find the block dimension from the tensor
(its size is `num_blocks`), never from assumptions, and keep uint8 numpy views of those runs,
so a block's value is a list of views with no copy made.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvpool.keys import LayoutInfo


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


@dataclasses.dataclass
class LayerView:
    name: str
    segments: list[np.ndarray]  # each [num_blocks, segment_bytes], uint8 views into the KV cache

    def block(self, block_id: int) -> list[np.ndarray]:
        return [s[block_id] for s in self.segments]


class KVLayout:
    """Byte views of every layer's KV cache, addressed by vLLM block id.

    Invariant: `block_buffers(b)` lists the same byte ranges, in the same order, on every
    instance with the same fingerprint, so a pooled value can be written by one and read by
    another.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int,
                 num_layers_total: int, cache_layout: str) -> None:
        self.layers: list[LayerView] = []
        first: torch.Tensor | None = None
        block_shape: tuple[int, ...] = ()
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise NotImplementedError(
                    f"KV cache of layer {name} is on {t.device}; this kvpool release copies from "
                    "host memory only (vLLM's CPU backend)"
                )
            d = _block_dim(t, num_blocks)
            moved = t.movedim(d, 0)
            if first is None:
                first, block_shape = t, tuple(moved.shape[1:])
            elif t.dtype != first.dtype or tuple(moved.shape[1:]) != block_shape:
                raise ValueError(f"layer {name} has another KV shape or dtype than the first layer")
            segs = []
            for s in _segments(moved):
                flat = s.view(s.shape[0], -1)
                segs.append(flat.view(torch.uint8).numpy())
            self.layers.append(LayerView(name, segs))
        if first is None:
            raise ValueError("no KV cache tensors were registered")
        self.dtype = first.dtype
        self.block_bytes = sum(s.shape[1] for layer in self.layers for s in layer.segments)
        self.info = LayoutInfo(
            dtype=str(first.dtype).removeprefix("torch."),
            block_size=block_size,
            block_shape=block_shape,
            num_layers_total=num_layers_total,
            cache_layout=cache_layout,
        )

    def block_buffers(self, block_id: int) -> list[np.ndarray]:
        """The byte views that make up block `block_id` across all layers, in layer order."""
        return [seg for layer in self.layers for seg in layer.block(block_id)]

    def stage_buffers(self, block_id: int, layer_range: range) -> list[np.ndarray]:
        """The byte views of block `block_id` for a slice of the layers (one PP stage's)."""
        return [seg for layer in self.layers[layer_range.start:layer_range.stop] for seg in layer.block(block_id)]
