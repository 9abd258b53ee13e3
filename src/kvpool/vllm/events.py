"""KV events for the pool: the blocks kvpool stores in and drops from it, as vLLM's own
`BlockStored` / `BlockRemoved`, so that vLLM's `--kv-events-config` publisher sends them beside
its prefix cache's events and a router (llm-d's indexer, Dynamo's router) learns which prompts
the pool can serve.

How they travel (vLLM's connector KV-events protocol):

* every step each worker reports the blocks whose save it finished (`STORED`: group and block
  hash) and the blocks its own pool dropped (`DROPPED`), in a `PoolEventReport`, an empty one
  too, so that every worker counts toward the step;
* vLLM merges the workers' reports (`add_events`, `increment_workers`) and hands them to the
  scheduler (`update_connector_output`);
* the scheduler's `PoolEventLog` turns a block every worker stored (each TP rank and PP stage
  holds a part of it) into one `BlockStored`, with the token ids and parent hash it noted when
  it planned the save, and a block any worker dropped into a `BlockRemoved` (it is no longer
  whole in the pool); `take_events` hands them to vLLM's publisher.

Invariant: a `BlockStored` is published only once every worker stored its part, so a subscriber
never learns of a block a lookup would miss for a part that failed; a `BlockRemoved` follows the
first part that leaves. The events' ``medium`` says where the pool keeps the block (vLLM's
``CPU`` for host memory, ``STORAGE`` for a distributed store) and, where vLLM's event has the
field, ``ownership`` is ``kvpool``, so a router can tell pool blocks from vLLM's own.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvpool.keys import block_of

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # a vLLM that publishes hashes as they are
    maybe_convert_block_hash = None

logger = logging.getLogger(__name__)

STORED = 0
DROPPED = 1
OWNERSHIP = "kvpool"
# Saves planned whose token ids the scheduler keeps until their workers report them: a save that
# never completes (its worker failed it) must not hold memory for good.
PLANNED_LIMIT = 1 << 17

Marker = tuple[int, int, bytes]  # (STORED or DROPPED, KV cache group, block hash)


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with `enable_kv_cache_events`)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return cfg is not None and bool(getattr(cfg, "enable_kv_cache_events", False))


def pool_medium(backend: str) -> str:
    """The events' medium for a pool on ``backend``: host memory, or a distributed store."""
    return "CPU" if backend in ("local", "server") else "STORAGE"


def _external(block_hash: bytes) -> Any:
    """The hash as vLLM's events carry it (bytes, or an int where vLLM is told to)."""
    return block_hash if maybe_convert_block_hash is None else maybe_convert_block_hash(block_hash)


def _event(cls: type, **fields: Any) -> KVCacheEvent:
    """``cls(**fields)`` without the fields this vLLM's event does not have (they grew over releases)."""
    known = getattr(cls, "__struct_fields__", ())
    return cls(**{k: v for k, v in fields.items() if k in known})


class PoolEventReport(KVConnectorKVEvents):
    """What the workers finished in a step: `Marker`s, and how many workers' reports were merged."""

    def __init__(self, markers: Iterable[Marker] = (), workers: int = 1) -> None:
        self._markers: list[Marker] = list(markers)
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._markers.extend(events)

    def aggregate(self) -> PoolEventReport:
        return self  # the scheduler's `PoolEventLog` counts the workers' parts

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._markers)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._markers.clear()

    def __repr__(self) -> str:
        return f"<PoolEventReport workers={self._workers} markers={len(self._markers)}>"


def dropped_markers(keys: Sequence[str]) -> list[Marker]:
    """DROPPED markers for pool keys that left a worker's pool (a block once per report)."""
    seen: dict[tuple[int, bytes], None] = {}
    for key in keys:
        block = block_of(key)
        if block is not None:
            seen[block] = None
    return [(DROPPED, group, h) for group, h in seen]


@dataclasses.dataclass(frozen=True)
class _Planned:
    token_ids: list[int]
    parent: bytes | None


class PoolEventLog:
    """The scheduler's half: notes each planned save's token ids, counts the workers' reports,
    and keeps the events for vLLM's publisher (see the module docstring).

    ``workers``: how many workers hold a part of every block (TP size x PP size); ``medium``:
    where the pool keeps blocks."""

    def __init__(self, workers: int, block_size: int, medium: str) -> None:
        self._workers = workers
        self._block_size = block_size
        self._medium = medium
        self._planned: collections.OrderedDict[tuple[int, bytes], _Planned] = collections.OrderedDict()
        # Blocks some but not all workers reported stored (bounded as `_planned` is).
        self._parts: collections.OrderedDict[tuple[int, bytes], int] = collections.OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def planned(self, group: int, hashes: Sequence[bytes], indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """A save of the blocks ``indices`` of a request (its block ``hashes`` and ``token_ids``)
        into ``group`` was planned."""
        bs = self._block_size
        for i in indices:
            self._planned[group, hashes[i]] = _Planned(list(token_ids[i * bs : (i + 1) * bs]),
                                                       hashes[i - 1] if i else None)
        while len(self._planned) > PLANNED_LIMIT:
            self._planned.popitem(last=False)

    def reported(self, report: KVConnectorKVEvents | None) -> None:
        """The workers' merged report of a step."""
        if not isinstance(report, PoolEventReport):
            return
        for kind, group, block_hash in report.get_all_events():
            block = (group, block_hash)
            if kind == DROPPED:
                self._parts.pop(block, None)
                self._ready.append(_event(BlockRemoved, block_hashes=[_external(block_hash)], medium=self._medium,
                                          group_idx=group, ownership=OWNERSHIP))
                continue
            parts = self._parts.get(block, 0) + 1
            if parts < self._workers:
                self._parts[block] = parts
                if len(self._parts) > PLANNED_LIMIT:
                    self._parts.popitem(last=False)
                continue
            self._parts.pop(block, None)
            planned = self._planned.pop(block, None)
            self._ready.append(_event(
                BlockStored, block_hashes=[_external(block_hash)],
                parent_block_hash=_external(planned.parent) if planned and planned.parent else None,
                token_ids=planned.token_ids if planned else [], block_size=self._block_size, lora_id=None,
                medium=self._medium, lora_name=None, group_idx=group, ownership=OWNERSHIP))

    def take(self) -> list[KVCacheEvent]:
        """The events ready since the last call, in the order they became ready."""
        out, self._ready = self._ready, []
        return out
