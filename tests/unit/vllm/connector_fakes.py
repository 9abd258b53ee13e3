"""Fakes and builders for unit tests of kvpool's vLLM layer, in the style of vLLM's own
`tests/v1/kv_connector/unit/utils.py`: real vLLM requests and scheduler-output dataclasses,
small stand-ins for the configs the connector reads, an in-memory backend and a fake lookup.

Nothing here starts an engine or touches a device.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.request import Request

from kvpool.backends.base import Backend, Buffers, Presence
from kvpool.errors import ErrorCode
from kvpool.vllm.lookup import Hit

# Small but real geometry: vLLM's CPU cache is [num_blocks, 2, block_size, heads*head_dim] per layer.
BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 8
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]

init_none_hash(sha256)  # what vLLM's engine does once per process before hashing blocks


# ---- vLLM-side objects -------------------------------------------------------------------------


def make_vllm_config(block_size: int = BLOCK_SIZE, hash_algo: str = "sha256", dp_rank: int = 0,
                     num_layers: int = NUM_LAYERS, kv_heads: int = KV_HEADS, use_mla: bool = False,
                     cache_dtype: str = "auto", **model: Any) -> SimpleNamespace:
    """The attributes of `VllmConfig` the connector reads (a real one needs a model on disk);
    ``model`` overrides fields of its model config (``quantization="fp8"``)."""
    model_config = SimpleNamespace(
        model="unit-test-model",
        revision=None,
        code_revision=None,
        quantization=None,
        dtype=torch.float32,
        hf_text_config=SimpleNamespace(rope_theta=10000.0, rope_scaling=None),
        use_mla=use_mla,
        get_total_num_hidden_layers=lambda: num_layers,
        get_total_num_kv_heads=lambda: kv_heads,
    )
    vars(model_config).update(model)
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, prefix_caching_hash_algo=hash_algo, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(data_parallel_rank=dp_rank),
        model_config=model_config,
    )


def full_spec(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)


def sliding_spec(window: int, block_size: int = BLOCK_SIZE) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32,
                             sliding_window=window)


def make_kv_cache_config(block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS,
                         groups: int = 1, specs: Sequence[KVCacheSpec] | None = None) -> KVCacheConfig:
    """A real `KVCacheConfig`: `groups` full-attention groups of every layer, or, with `specs`, a
    hybrid model's groups, layer i in group i (as vLLM groups a 1:1 sliding/full model)."""
    if specs is None:
        kv_groups = [KVCacheGroupSpec(list(LAYER_NAMES), full_spec(block_size)) for _ in range(groups)]
    else:
        kv_groups = [KVCacheGroupSpec([LAYER_NAMES[i]], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_groups)


def make_request(req_id: str, num_tokens: int, block_size: int = BLOCK_SIZE, first_token: int = 1,
                 max_tokens: int = 16, cache_salt: str | None = None) -> Request:
    """A real vLLM request whose `block_hashes` are vLLM's chained sha256 block hashes.

    Requests built with the same `first_token` share their prefix, so share block hashes.
    """
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(first_token, first_token + num_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def kv_blocks(*groups: Sequence[int]) -> KVCacheBlocks:
    """What vLLM passes to `update_state_after_alloc`: each group's allocated blocks."""
    return KVCacheBlocks(tuple(tuple(KVCacheBlock(b) for b in ids) for ids in groups))


def _per_group(block_ids: Sequence[int] | tuple[Sequence[int], ...]) -> tuple[list[int], ...]:
    """One group's block ids as vLLM's tuple of one list; a tuple of lists (several groups) as is."""
    if isinstance(block_ids, tuple) and block_ids and not isinstance(block_ids[0], int):
        return tuple(list(ids) for ids in block_ids)
    return (list(block_ids),)


def new_req(request: Request, block_ids: Sequence[int] | tuple[Sequence[int], ...],
            num_computed_tokens: int) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids or ()),
        mm_features=[],
        sampling_params=request.sampling_params,
        pooling_params=None,
        block_ids=_per_group(block_ids),
        num_computed_tokens=num_computed_tokens,
        lora_request=None,
    )


@dataclasses.dataclass
class Cached:
    """One running (or resumed) request of a step, as `CachedRequestData` carries it."""

    req_id: str
    num_computed_tokens: int  # before this step
    # Blocks allocated this step (all blocks if resumed); a tuple of lists for several groups.
    new_block_ids: Sequence[int] | tuple[Sequence[int], ...] | None = None
    resumed: bool = False


def scheduler_output(new: Iterable[tuple[NewRequestData, int]] = (),
                     cached: Iterable[tuple[Cached, int]] = (),
                     preempted: Iterable[str] = ()) -> SchedulerOutput:
    """A real `SchedulerOutput`; `new` and `cached` pair each request with its scheduled tokens."""
    new, cached = list(new), list(cached)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [n for n, _ in new]
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[c.req_id for c, _ in cached],
        resumed_req_ids={c.req_id for c, _ in cached if c.resumed},
        new_token_ids=[[] for _ in cached],
        all_token_ids={},
        new_block_ids=[_per_group(c.new_block_ids) if c.new_block_ids is not None else None for c, _ in cached],
        num_computed_tokens=[c.num_computed_tokens for c, _ in cached],
        num_output_tokens=[0 for _ in cached],
    )
    out.num_scheduled_tokens = {n.req_id: k for n, k in new} | {c.req_id: k for c, k in cached}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.preempted_req_ids = set(preempted) or None
    return out


# ---- scheduler-side lookup ---------------------------------------------------------------------


class FakeLookupClient:
    """Stands in for `LookupClient`: answers from a set of pooled block hashes.

    `instances` records every client the scheduler built, so a test can see whether a role
    created one at all.
    """

    instances: list["FakeLookupClient"] = []
    pooled: set[bytes] = set()
    pinned = False  # whether every hit is pinned in the worker's memory (`Hit.pinned`)

    def __init__(self, lookup_rpc_port: int, dp_rank: int = 0) -> None:
        self.port, self.dp_rank = lookup_rpc_port, dp_rank
        self.calls: list[list[bytes]] = []
        self.tenants: list[str] = []  # each lookup's tenant tag
        self.closed = False
        self.skipped = 0  # lookups the real client's breaker answered without asking
        FakeLookupClient.instances.append(self)

    def lookup(self, block_hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> Hit:
        self.calls.append(list(block_hashes))
        self.tenants.append(tenant)
        hits = 0
        for h in block_hashes:
            if h not in FakeLookupClient.pooled:
                break
            hits += 1
        return Hit(hits, hits > 0 and FakeLookupClient.pinned)

    def close(self) -> None:
        self.closed = True


# ---- worker side -------------------------------------------------------------------------------


class DictBackend(Backend):
    """An in-memory backend: key -> the concatenated bytes of a block's buffers.

    A put of an existing key leaves the stored bytes alone and answers OBJECT_ALREADY_EXISTS;
    `fail_get` keys read as missing, `fail_put` keys are refused (the store is full); `get_gate`/`put_gate`, when set, hold reads/writes until the
    test opens them, so a test can observe the worker while a transfer is in flight.
    """

    name = "dict"
    can_pin = True  # as the host pools: `pins` holds each pinned key's TTL

    def __init__(self, shared: bool = False) -> None:
        self.pins: dict[str, float] = {}
        self.shared_across_processes = shared
        self.pinned = False  # whether lookups find hits pinned in this process (as `local`'s are)
        self.data: dict[str, bytes] = {}
        self.fail_get: set[str] = set()
        self.fail_put: set[str] = set()
        self.raise_on_get = False
        self.raise_on_put = False
        self.get_gate: threading.Event | None = None
        self.put_gate: threading.Event | None = None
        self.put_started = threading.Event()
        self.get_started = threading.Event()
        self.closed = False

    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        return [k in self.data for k in keys]

    def _pin(self, keys: list[str], ttl_s: float) -> list[int]:
        self.pins.update((k, ttl_s) for k in keys if k in self.data)
        return [int(ErrorCode.OK if k in self.data else ErrorCode.OBJECT_NOT_FOUND) for k in keys]

    def batch_presence(self, keys: Sequence[str]) -> list[Presence]:
        held = Presence.PINNED if self.pinned else Presence.STORED
        return [held if k in self.data else Presence.ABSENT for k in keys]

    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        self.put_started.set()
        if self.put_gate is not None:
            assert self.put_gate.wait(10), "test never opened put_gate"
        if self.raise_on_put:
            raise ConnectionError("store went away")
        codes = []
        for key, bufs in zip(keys, values, strict=True):
            if key in self.data:
                codes.append(int(ErrorCode.OBJECT_ALREADY_EXISTS))
                continue
            if key in self.fail_put:
                codes.append(int(ErrorCode.NO_AVAILABLE_HANDLE))
                continue
            self.data[key] = b"".join(np.ascontiguousarray(b).tobytes() for b in bufs)
            codes.append(int(ErrorCode.OK))
        return codes

    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        self.get_started.set()
        if self.get_gate is not None:
            assert self.get_gate.wait(10), "test never opened get_gate"
        if self.raise_on_get:
            raise ConnectionError("store went away")
        codes = []
        for key, bufs in zip(keys, values, strict=True):
            blob = self.data.get(key)
            if key in self.fail_get or blob is None:
                codes.append(int(ErrorCode.OBJECT_NOT_FOUND))
                continue
            assert len(blob) == sum(b.nbytes for b in bufs), "buffer sizes do not add up to the object"
            off = 0
            for b in bufs:
                b[...] = np.frombuffer(blob, dtype=np.uint8, count=b.nbytes, offset=off).reshape(b.shape)
                off += b.nbytes
            codes.append(int(ErrorCode.OK))
        return codes

    # The public calls are overridden, not the hooks, so that a raised error reaches the worker
    # as an exception (a real adapter's errors become codes in the base class); the hooks, which
    # the base class declares abstract, map onto them.
    def _exists(self, keys: list[str], lease: bool) -> list[bool]:
        return self.batch_exists(keys, lease)

    def _put(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return self.batch_put(keys, values)

    def _get_into(self, keys: list[str], values: list[list[np.ndarray]]) -> list[int]:
        return self.batch_get_into(keys, values)

    def close(self) -> None:
        self.closed = True


def make_kv_caches(seed: int, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> dict[str, torch.Tensor]:
    """Per-layer CPU KV caches shaped like vLLM's CPU backend, filled with distinct random values."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(num_blocks, 2, block_size, KV_HEADS * HEAD_DIM, generator=g) for name in LAYER_NAMES}


def block_hash(i: int) -> bytes:
    """A stand-in for vLLM's 32-byte block hash."""
    return i.to_bytes(4, "big") * 8
