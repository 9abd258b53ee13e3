"""Moving a batch of blocks between the paged KV cache and pool values: directly or staged.

Both copiers take a batch (keys, vLLM block ids, which layers) and a backend call (`batch_put`
or `batch_get_into`), and return the backend's per-key codes. They differ in where the bytes
the backend sees live:

- `DirectCopier` (a cache in host memory): the backend copies straight between its store and
  numpy views of the KV cache itself; no intermediate buffer exists.
- `StagedCopier` (a cache on any device; forced on CPU by `transfer_path: staged`): blocks pass
  through bounded host buffers, pinned where the device allows. A save gathers each layer's
  blocks with `index_select` on a side stream (after the compute stream's writes, via an
  event) and copies them to the host buffer non-blocking; a load copies the host buffer to the
  device and scatters it with `index_copy_`. An event marks the end of each round and the host
  waits for it before the buffer is handed on or reused. A batch bigger than a buffer moves in
  rounds.

Invariant: for the same block and layers, both paths produce the same value bytes in the same
order (layer by layer; within a layer, the block's runs in memory order), so a value saved by
one is read correctly by the other, on any instance with the same layout fingerprint.

Only torch's device-neutral calls are used (`torch.Stream`, `torch.Event`, `copy_(non_blocking)`,
`index_select`, `index_copy_`), so CUDA, NPU (torch_npu) and XPU take the same code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from kvpool.device.layout import KVLayout
from kvpool.errors import OK, ConfigError, is_stored
from kvpool.store import streamcopy

# A backend's batch call: keys and, per key, the value's buffers -> one code per key.
BatchCall = Callable[[list[str], list[list[np.ndarray]]], list[int]]


class Copier(Protocol):
    """What the worker needs from a data path."""

    kind: str

    def written(self) -> torch.Event | None:
        """A marker of the KV writes enqueued so far (the forward pass, or one layer of it);
        a save passed it as `ready` reads the cache only after those writes."""

    def save(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, put: BatchCall,
             ready: torch.Event | None = None) -> list[int]:
        """Hand the blocks' bytes (these layers) to `put`; its codes."""

    def load(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, get: BatchCall) -> list[int]:
        """Fill the blocks (these layers) from `get`; its codes. A block whose code is not OK
        (the caller reports it as a load error) keeps its earlier bytes or is zeroed, never
        holds part of a failed copy: vLLM recomputes it, but attention kernels read whole
        blocks, unused slots included, and one NaN there poisons every later request that
        gets the block (seen with vLLM's CPU attention)."""

    def describe(self) -> str:
        """One line for the start-up log."""


def per_block(codes: list[int], heads: int) -> list[int]:
    """One code per block from one per value (`heads` values per block; 0: one). A block is OK
    only if every head is; stored, if every head is stored (written now or already there)."""
    if not heads:
        return codes
    out = []
    for i in range(0, len(codes), heads):
        part = codes[i:i + heads]
        if all(c == OK for c in part):
            out.append(OK)
        elif all(is_stored(c) for c in part):  # written now (some heads) or already there (all)
            out.append(OK if OK in part else part[0])
        else:
            out.append(next(c for c in part if not is_stored(c)))
    return out


def _zero(values: Sequence[Sequence[np.ndarray]]) -> None:
    for value in values:
        for buf in value:
            buf.fill(0)


class DirectCopier:
    """The backend copies between its store and views of a host-memory KV cache."""

    kind = "direct"

    def __init__(self, layout: KVLayout) -> None:
        if not layout.in_host_memory:
            raise ConfigError("transfer_path", "direct",
                              f"auto or staged: the KV cache is on {layout.device}, not in host memory")
        self.layout = layout

    def written(self) -> None:
        return None  # on the host the forward pass has finished writing when a save is queued

    def _values(self, block_ids: Sequence[int], layers: range) -> list[list[np.ndarray]]:
        """Per value, its views: one value per block, or, for a layout split by head, one per
        head of each block in turn (the order of `KeyScheme.keys`)."""
        if self.layout.heads:
            return [self.layout.head_buffers(b, h, layers) for b in block_ids for h in range(self.layout.heads)]
        return [self.layout.stage_buffers(b, layers) for b in block_ids]

    def save(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, put: BatchCall,
             ready: torch.Event | None = None) -> list[int]:
        return per_block(put(list(keys), self._values(block_ids, layers)), self.layout.heads)

    def load(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, get: BatchCall) -> list[int]:
        return load_direct([(self, keys, block_ids, layers)], get)[0]

    def describe(self) -> str:
        return f"direct copies between the pool and the host-memory KV cache ({streamcopy.describe()})"


def load_direct(loads: Sequence[tuple[DirectCopier, Sequence[str], Sequence[int], range]],
                get: BatchCall) -> list[list[int]]:
    """Several direct loads (copier, keys, block ids, layers) as one `get` call, and each one's
    per-block codes: a model with several KV cache groups loads all of a step's groups in one
    backend batch, not one per group. A block whose code is not OK is zeroed (`Copier.load`)."""
    values = [copier._values(block_ids, layers) for copier, _, block_ids, layers in loads]
    flat = [v for vs in values for v in vs]
    # The backend copies into the cache itself: a block that failed may hold part of a value.
    try:
        got = get([k for _, keys, _, _ in loads for k in keys], flat)
    except BaseException:  # a store gone mid-copy: every block failed (the caller reports them)
        _zero(flat)
        raise
    out, i = [], 0
    for (copier, _, _, _), vs in zip(loads, values):
        codes = per_block(got[i:i + len(vs)], copier.layout.heads)
        i += len(vs)
        per = max(1, copier.layout.heads)  # a block whose one head failed is failed whole
        _zero([value for j, value in enumerate(vs) if codes[j // per] != OK])
        out.append(codes)
    return out


class StagedCopier:
    """Blocks pass through two bounded host buffers (one for loads, one for saves).

    Each buffer is [layers, capacity, layer_block_bytes] uint8: a round of n blocks uses rows
    [:n] of every layer, so each layer's part of a round is one contiguous run and moves in one
    device copy. A buffer is held (its lock) from the first copy of a round until the backend
    and the device are done with it.
    """

    kind = "staged"

    def __init__(self, layout: KVLayout, budget_bytes: int) -> None:
        self.layout = layout
        self.device = layout.device
        self.accelerated = self.device.type != "cpu"
        num_layers, lb = len(layout.layers), layout.layer_block_bytes
        self.capacity = (budget_bytes // 2) // layout.block_bytes  # blocks per round
        if self.capacity < 1:
            raise ConfigError("staging_buffer_size", budget_bytes,
                              f"at least {2 * layout.block_bytes} bytes: two blocks of "
                              f"{layout.block_bytes} bytes (one for loads, one for saves)")
        self.buffer_bytes = 2 * self.capacity * layout.block_bytes

        def buffer() -> tuple[torch.Tensor, np.ndarray, threading.Lock]:
            t = torch.empty((num_layers, self.capacity, lb), dtype=torch.uint8, pin_memory=self.accelerated)
            return t, t.numpy(), threading.Lock()

        self._save_buf, self._save_np, self._save_lock = buffer()
        self._load_buf, self._load_np, self._load_lock = buffer()
        # What the gathers and scatters index: each layer's blocks as 16-byte elements where the
        # device moves those fastest, and the buffers viewed as the same type row by row.
        self._moved = [_widest(layer.blocks) for layer in layout.layers]
        self._stream = torch.Stream(device=self.device) if self.accelerated else None
        # The stream vLLM computes on, captured on the thread that registers the caches: a load
        # or save running on the transfer thread must order itself after that stream's work,
        # not after its own thread's (default) stream.
        self._compute = torch.accelerator.current_stream(self.device) if self.accelerated else None

    # ---- device synchronisation (no-ops for a host cache: CPU copies are synchronous) --------

    def written(self) -> torch.Event | None:
        if not self.accelerated:
            return None
        event = torch.Event(device=self.device)
        event.record(self._compute)
        return event

    def _round_done(self) -> None:
        if self._stream is not None:
            # A blocking event sleeps in the driver instead of spinning a core the engine needs.
            event = torch.Event(device=self.device, blocking=True)
            event.record(self._stream)
            event.synchronize()

    def _on_side_stream(self):
        return self._stream if self._stream is not None else _NoStream()

    # ---- the two directions --------------------------------------------------------------------

    def save(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, put: BatchCall,
             ready: torch.Event | None = None) -> list[int]:
        if ready is None:  # never read blocks the compute stream may still be writing
            ready = self.written()
        codes: list[int] = []
        for start in range(0, len(block_ids), self.capacity):
            ids = block_ids[start:start + self.capacity]
            with self._save_lock:
                self._gather(ids, layers, ready)
                codes += put(list(keys[start:start + len(ids)]), self._values(self._save_np, len(ids), layers))
        return codes

    def load(self, keys: Sequence[str], block_ids: Sequence[int], layers: range, get: BatchCall) -> list[int]:
        codes: list[int] = []
        for start in range(0, len(block_ids), self.capacity):
            ids = block_ids[start:start + self.capacity]
            with self._load_lock:
                got = get(list(keys[start:start + len(ids)]), self._values(self._load_np, len(ids), layers))
                self._scatter(ids, [i for i, c in enumerate(got) if c == OK], layers)
            codes += got
        return codes

    @staticmethod
    def _values(host: np.ndarray, n: int, layers: range) -> list[list[np.ndarray]]:
        """Per block of the round, its value's buffers: one row per layer."""
        return [[host[layer, j] for layer in layers] for j in range(n)]

    def _gather(self, block_ids: Sequence[int], layers: range, ready: torch.Event | None) -> None:
        n = len(block_ids)
        with self._on_side_stream():
            if ready is not None and self._stream is not None:
                self._stream.wait_event(ready)
            index = _on(self.device, block_ids)
            for layer in layers:
                blocks = self._moved[layer]
                rows = blocks.index_select(0, index)
                self._save_buf[layer, :n].view(blocks.dtype).copy_(rows.view(n, -1), non_blocking=True)
            self._round_done()

    def _scatter(self, block_ids: Sequence[int], ok: list[int], layers: range) -> None:
        if not ok:
            return
        n = len(block_ids)
        # Kernels still queued on the compute stream may read these blocks' previous contents.
        ready = self.written()
        with self._on_side_stream():
            if ready is not None and self._stream is not None:
                self._stream.wait_event(ready)
            # The whole round leaves the pinned buffer in one copy per layer; only the rows that
            # arrived are scattered (selected on the device), the other blocks keep their bytes.
            index = _on(self.device, [block_ids[i] for i in ok])
            rows = None if len(ok) == n else _on(self.device, ok)
            for layer in layers:
                dst = self._moved[layer]
                src = self._load_buf[layer, :n].view(dst.dtype).to(self.device, non_blocking=True)
                if rows is not None:
                    src = src.index_select(0, rows)
                dst.index_copy_(0, index, src.view(len(ok), *dst.shape[1:]))
            self._round_done()

    def describe(self) -> str:
        pinned = "pinned " if self.accelerated else ""
        return (f"staged through {self.buffer_bytes / 2**20:.0f} MiB of {pinned}host memory "
                f"({self.capacity} blocks per round each way) for a KV cache on {self.device}")


def _widest(blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` (integer words, block dimension first) viewed as complex128 on CPU, where the
    16-byte element tiles it.

    torch's CPU `index_copy_` and `index_select` cost per element: for a bf16 KV cache moved as
    int64 a scatter of 96 MiB took 11 ms on a 2-vCPU Xeon, as complex128 8 ms, the same bytes
    (every bit pattern, NaNs included, is moved, never computed on). Accelerators keep the
    integer words, which every device's kernels take (complex ones are not on every device).
    Only the copies use this view; comparisons stay on integers, where equal values are equal
    bytes.
    """
    w = torch.complex128.itemsize
    if (blocks.device.type != "cpu" or blocks.shape[-1] * blocks.element_size() % w
            or blocks.storage_offset() * blocks.element_size() % w
            or any(st * blocks.element_size() % w for st in blocks.stride()[:-1])):
        return blocks
    return blocks.view(torch.complex128)


def _on(device: torch.device, ids: Sequence[int]) -> torch.Tensor:
    """Block ids as an index tensor on `device`. A blocking copy: the host tensor is temporary,
    and an asynchronous copy could read it after it was freed."""
    return torch.tensor(ids, dtype=torch.long).to(device)


class _NoStream:
    """`with` target for a host cache: CPU work has no stream."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def make_copier(layout: KVLayout, transfer_path: str, staging_buffer_size: int) -> Copier:
    """The data path `transfer_path` asks for: `auto` stages only a cache off the host."""
    if transfer_path == "staged" or (transfer_path == "auto" and not layout.in_host_memory):
        if layout.heads:
            raise ConfigError("transfer_path", transfer_path,
                              "direct (a KV cache in host memory) with share_across_tp: values per KV head "
                              "are copied by the direct path only")
        return StagedCopier(layout, staging_buffer_size)
    return DirectCopier(layout)
