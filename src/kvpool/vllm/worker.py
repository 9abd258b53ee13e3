"""Worker side of the connector: KV cache <-> pool copies, lookup serving, load-error reports.

Invariants:
- Every block a load was asked for either holds its pooled bytes when the forward pass reads it
  or is reported to vLLM as a load error (`get_block_ids_with_load_errors`, or with the async
  request's finish), so vLLM recomputes it: a failed, partial or timed-out load never passes as
  KV. In layerwise mode a layer the forward pass did not wait for counts as not loaded.
- A save reads a block only while vLLM keeps it allocated: the scheduler delays the free of a
  request with saves in flight until `get_finished` reports them done, and a preempted request's
  saves are drained before its blocks can be rewritten (`handle_preemptions`).
- A block computed in a step over a block whose load failed in that step, or in the step
  before (planned before the failure was reported, with async scheduling), is never saved.
- The pool is touched only through `Backend` and the copier; nothing here knows which store it is.
- With several KV cache groups (hybrid models), each group has its own layers, layout, keys and
  copier (`GroupIO`), and a block id means a block of the task's own group only. A save of a
  group whose blocks vLLM frees while the request runs (sliding window, chunked local, a Mamba
  state) reads them before `wait_for_save` returns. A failed load of such a model is reported
  by request (`failed_recving`): vLLM cannot map block ids of several groups back to requests.
  Only a load that cannot fail runs synchronously there: one whose every block the lookup found
  pinned in this process's memory (`Hit.pinned`), loaded before the lease's TTL. Should it fail
  all the same, it is reported as block load errors, on which vLLM stops rather than compute.
- With `share_across_tp`, a block's value per KV head holds exactly that head's bytes, in the
  same order whatever the TP size that wrote it; a block loads only if every head it needs does.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvpool.backends import Backend, create_backend
from kvpool.backends.base import Presence
from kvpool.backends.faults import FaultInjectingBackend
from kvpool.backends.registry import REGISTRY
from kvpool.config import KVPoolConfig
from kvpool.device.copy import Copier, DirectCopier, load_direct, make_copier
from kvpool.device.layout import KVLayout
from kvpool.errors import ConfigError, ErrorCode, code_name, is_stored
from kvpool.keys import KeyScheme, model_key_name, prefill_stage_schemes
from kvpool.vllm.events import STORED, Marker, PoolEventReport, dropped_markers, events_enabled
from kvpool.vllm.groups import PoolGroup, alignment_blocks, loads_by_request, longest_hit, pool_groups
from kvpool.vllm.lookup import Hit, LookupServer
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.pins import RequestPins
from kvpool.vllm.stats import COUNTERS, KVPoolStats
from kvpool.vllm.transfer import LOAD, SAVE, TransferThread

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# How long shutdown and preemption wait for saves in flight before giving up on them.
DRAIN_TIMEOUT_S = 60.0
# Where a layer's load has not arrived after this long, the forward pass goes on without it and
# the step's loaded blocks are reported as load errors (vLLM recomputes them).
LAYER_WAIT_TIMEOUT_S = 60.0


# The text-model config fields that change the KV a token gets (keys are rotated by RoPE).
_ROPE_FIELDS = ("rope_scaling", "rope_parameters", "rope_theta")


def values_identity(model_config: ModelConfig, cache_dtype: str = "auto") -> str:
    """What besides the layout decides the KV values of a token, as canonical text.

    Two instances serving the same model name from other weights (a revision, a quantization)
    or at another compute dtype or RoPE scaling compute other KV for the same tokens; with the
    same key they would load each other's blocks and answer differently from a cold prefill.
    A quantized KV cache (`--kv-cache-dtype fp8_e4m3`, `fp8_e5m2`, ...) stores the same tensor
    dtype (bytes) for encodings that read differently, so its name is part of it too (left out
    for `auto`, so unquantized caches keep their keys).
    Only fields that are plain data and equal on every process of one deployment go in: a
    field that differed per process (an address, a path) would make every lookup miss.
    """
    text = model_config.hf_text_config
    fields = {
        "revision": model_config.revision,
        "code_revision": model_config.code_revision,
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype),
        "rope": {name: getattr(text, name, None) for name in _ROPE_FIELDS},
    }
    if cache_dtype != "auto":
        fields["kv_cache_dtype"] = cache_dtype
    return json.dumps(fields, sort_keys=True, default=str)


class _LayerLoads:
    """One step's synchronous loads in layerwise mode.

    Invariant: once `arrived[i]` is set, layer i of every block in `tasks` either holds its
    pooled bytes or is in `failed`; the loader sets the layers in order, so the forward pass
    waiting on layer i never waits for a later layer.
    """

    def __init__(self, tasks: list[BlockTask], num_layers: int) -> None:
        self.tasks = tasks
        self.arrived = [threading.Event() for _ in range(num_layers)]
        self.failed: set[int] = set()
        self.waited = 0  # layers the forward pass waited for (vLLM's per-layer hook ran)


@dataclasses.dataclass
class GroupIO:
    """Everything the worker needs to move one KV cache group's blocks: its layers' views, its
    keys, its data path, and where its values are put ((key scheme, layers) per value: one for
    this rank's own key, or one per prefill PP stage when a decode node puts for PP prefill
    nodes)."""

    group: PoolGroup
    layout: KVLayout
    scheme: KeyScheme
    copier: Copier
    put_targets: list[tuple[KeyScheme, range]]


class PoolWorker:
    """One worker process's half of the connector: its backend client, its KV layout and copier,
    the transfer thread its saves and async loads run on, and (TP/PP rank 0) the lookup server
    the scheduler asks. Built by `KVPoolConnector` in the worker role; unusable until
    `register_kv_caches`."""

    def __init__(self, vllm_config: VllmConfig, config: KVPoolConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        self.config = config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        tp, pp = get_tp_group(), get_pp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.pp_rank, self.pp_size = pp.rank_in_group, pp.world_size
        self.dp_rank = vllm_config.parallel_config.data_parallel_rank
        self.backend: Backend | None = None
        # Per KV cache group, by vLLM's group id; the first group's layout and scheme are also
        # `layout` and `scheme` (the only ones of a single-group model).
        self.groups: dict[int, GroupIO] = {}
        self.layout: KVLayout | None = None
        self.scheme: KeyScheme | None = None
        self._align = 1  # a hit ends on a multiple of this many blocks
        self._failures_by_request = False  # vLLM takes failed loads by request (kvpool.vllm.groups)
        self._lookup: LookupServer | None = None
        self._transfer = TransferThread()
        # Layerwise loads run beside the transfer thread, so a save in progress never delays the
        # layer the forward pass is waiting for.
        self._layer_loader: TransferThread | None = None
        self._layer_loads: _LayerLoads | None = None
        self._layers_saved: set[int] = set()  # layers of this step already queued by save_kv_layer
        self._lock = threading.Lock()  # guards the sets below, shared with the transfer thread
        self._load_errors: set[int] = set()
        # This step's failed sync loads, kept for wait_for_save: with speculative decoding vLLM
        # calls it after get_block_ids_with_load_errors has handed `_load_errors` over. Touched
        # only on vLLM's thread, so outside the lock.
        self._step_load_errors: set[int] = set()
        # The previous step's: with async scheduling vLLM planned this step before it saw them.
        self._last_step_load_errors: set[int] = set()
        self._async_done: dict[str, set[int]] = {}  # req_id -> failed block ids
        self._failed_recving: set[str] = set()  # several groups: async loads that failed, by request
        self._awaiting_free: set[str] = set()
        self._stats = KVPoolStats()
        # KV events (`kvpool.vllm.events`): the blocks whose part this worker stored, appended by
        # the transfer thread, drained by vLLM's thread each step; None when vLLM publishes none.
        self._stored: collections.deque[Marker] | None = (collections.deque() if events_enabled(vllm_config)
                                                           else None)
        self._log_stats = KVPoolStats()
        self._last_log = time.monotonic()
        self._reported_depth = 0  # transfer_queue_depth at the last report
        self._backend_seen: dict[str, int] = {}  # the backend's counter totals at the last get_stats

    # ---- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        block_size = self._vllm_config.cache_config.block_size
        groups = pool_groups(self._kv_cache_config, block_size, getattr(self._kv_cache_config, "hash_block_size", None))
        if loads_by_request(groups) and self.config.use_layerwise:
            raise ConfigError("use_layerwise", True,
                              f"false for a model with {len(groups)} KV cache groups or a Mamba state "
                              "(hybrid models): layerwise transfer moves one attention group's layers")
        if loads_by_request(groups) and self.config.prefill_pp_size:
            raise ConfigError("prefill_pp_size", self.config.prefill_pp_size,
                              f"unset for a model with {len(groups)} KV cache groups or a Mamba state (hybrid models)")
        if self.config.use_layerwise and (self.pp_size > 1 or self.config.prefill_pp_size):
            raise ConfigError(
                "use_layerwise", True,
                f"false with pipeline parallelism (pp_size={self.pp_size}, prefill_pp_size="
                f"{self.config.prefill_pp_size}): a layerwise key names a layer of one stage")
        per_head = self._per_head_values()
        # A staging buffer per group would multiply its memory: the groups share the budget.
        staging = self.config.staging_buffer_size // len(groups)
        for group in groups:
            self.groups[group.index] = self._group_io(group, kv_caches, per_head, staging)
        first = self.groups[groups[0].index]
        self.layout, self.scheme = first.layout, first.scheme
        self._align = alignment_blocks(self._kv_cache_config, block_size) if len(groups) > 1 else 1
        self._failures_by_request = loads_by_request(groups)
        shared = REGISTRY[self.config.backend].capabilities.shared_across_processes
        if (self.tp_size > 1 or self.pp_size > 1) and not shared:
            raise ConfigError(
                "backend", self.config.backend,
                "a backend shared by all worker processes when tensor/pipeline parallel size > 1 "
                f"(tp={self.tp_size}, pp={self.pp_size}); `local` lives inside one process",
            )
        backend = create_backend(self.config, client_name=f"vllm-dp{self.dp_rank}-tp{self.tp_rank}-pp{self.pp_rank}")
        if self.config.inject_load_failure_every:
            backend = FaultInjectingBackend(backend, self.config.inject_load_failure_every)
        self.backend = backend
        self._pins = RequestPins(backend)
        if self.scheme.layers:
            self._layer_loader = TransferThread(name="kvpool-layer-load")
        if self.tp_rank == 0 and self.pp_rank == 0 and self.config.loads:
            self._lookup = LookupServer(self.config.lookup_rpc_port, self.dp_rank, self._lookup_hit)
        logger.info(
            "kvpool worker ready: backend=%s role=%s key=%s; %s; %s%s",
            backend.name, self.config.kv_role, self.scheme.key(b"\0" * 4),
            "; ".join(f"group {io.group.index} ({io.group.describe()}): {io.layout.block_bytes} bytes per block "
                      f"in {len(io.layout.layers)} layers" for io in self.groups.values()),
            first.copier.describe(),
            "; layerwise: one value per block and layer" if self.scheme.layers else "",
        )

    def _per_head_values(self) -> bool:
        """Whether attention blocks are stored one value per KV head (`share_across_tp`). Not
        for MLA, whose latent cache is one value every rank holds anyway; and only where vLLM
        lays the cache out head-major (e.g. LBHNC), so a head's bytes of a block are runs of
        their own."""
        if not self.config.share_across_tp or self._vllm_config.model_config.use_mla:
            return False
        order = str(getattr(self._kv_cache_config, "kv_cache_layout", None) or "")
        if not ("H" in order and "N" in order and order.index("H") < order.index("N")):
            raise ConfigError("share_across_tp", True,
                              f"false for this KV cache: vLLM lays it out as {order or 'an unnamed layout'}, "
                              "not head-major (heads before tokens), so a head's bytes are not a value of their own")
        return True

    def _group_io(self, group: PoolGroup, kv_caches: dict[str, torch.Tensor], per_head: bool,
                  staging: int) -> GroupIO:
        """One group's layers as a layout, its key scheme, where its values go, and its copier."""
        from vllm.platforms import current_platform

        mc = self._vllm_config.model_config
        spec = self._kv_cache_config.kv_cache_groups[group.index].kv_cache_spec
        caches = {name: kv_caches[name] for name in group.layer_names if name in kv_caches}
        if not caches:
            raise ConfigError(f"kv_cache_groups[{group.index}]", type(spec).__name__,
                              "a group whose layers have KV cache tensors of their own in this worker")
        total_kv_heads = mc.get_total_num_kv_heads()
        # A full-attention group's layout string is what it was before groups had kinds, so
        # dense models keep their keys; a window, chunk or state is part of what the bytes mean.
        extra = "" if group.kind in ("full", "mla") else f":{group.describe()}"
        heads = total_kv_heads if per_head and group.positional else 0  # a Mamba state stays per rank
        try:
            layout = KVLayout(
                caches,
                num_blocks=self._kv_cache_config.num_blocks,
                block_size=group.block_size,
                num_layers_total=mc.get_total_num_hidden_layers(),
                cache_layout=f"{current_platform.device_type}:{type(spec).__name__}{extra}",
                heads=max(1, total_kv_heads // self.tp_size) if heads else 0,
            )
        except ValueError as e:
            if not heads:
                raise
            raise ConfigError("share_across_tp", True, f"false for this KV cache: {e}") from None
        kv_shards = 1 if mc.use_mla else min(self.tp_size, total_kv_heads)
        scheme = KeyScheme(
            model=model_key_name(mc.model),
            layout=layout.info.fingerprint(
                values=values_identity(mc, str(getattr(self._vllm_config.cache_config, "cache_dtype", "auto")))),
            tp_rank=self.tp_rank, tp_size=self.tp_size,
            kv_shards=self.tp_size if group.per_rank else kv_shards,
            pp_rank=self.pp_rank, pp_size=self.pp_size, group=group.index,
            layers=len(layout.layers) if self.config.use_layerwise else 0,
            heads=heads,
        )
        put_targets = [(scheme, range(len(layout.layers)))]
        # Only a decode node (kv_consumer) puts for the prefill nodes' PP stages; the flag means
        # nothing on other roles (docs/configuration.md, roles).
        if (self.config.kv_role == "kv_consumer" and self.config.consumer_is_to_put
                and self.config.prefill_pp_size and self.pp_size == 1):
            from vllm.distributed.utils import get_pp_indices

            n, size = len(layout.layers), self.config.prefill_pp_size
            partition = self.config.prefill_pp_layer_partition or [
                end - start for start, end in (get_pp_indices(n, p, size) for p in range(size))]
            put_targets = prefill_stage_schemes(scheme, n, size, partition)
        return GroupIO(group, layout, scheme, make_copier(layout, self.config.transfer_path, staging), put_targets)

    # ---- lookup (rank 0) ------------------------------------------------------------------

    def _lookup_hit(self, block_hashes: Sequence[bytes], start: int = 0, tenant: str = "") -> Hit:
        """The hit on the blocks after the prompt's first `start`: a group's block counts only
        when its keys exist for every TP shard and PP stage, and a hit needs of each group the
        blocks its kind needs (`kvpool.vllm.groups.longest_hit`). Pinned when every key of those
        blocks is `Presence.PINNED`: then their load cannot fail before the lease's TTL."""
        assert self.backend is not None and self.groups
        ios = list(self.groups.values())
        flat: list[str] = []
        ends: list[int] = []  # per (group, block): where its keys end in `flat`
        for io in ios:
            for h in block_hashes:
                flat += io.scheme.all_rank_keys(h, tenant)
                ends.append(len(flat))
        presence = self.backend.batch_presence(flat)
        if len(ends) == len(flat):  # one key per block (TP and PP 1, or MLA): no slicing
            found = [p is not Presence.ABSENT for p in presence]
            pinned = [p is Presence.PINNED for p in presence]
        else:
            found, pinned, i = [], [], 0
            for end in ends:
                found.append(Presence.ABSENT not in presence[i:end])
                pinned.append(all(p is Presence.PINNED for p in presence[i:end]))
                i = end
        n = len(block_hashes)
        hits = longest_hit([io.group for io in ios], start, [found[g * n:(g + 1) * n] for g in range(len(ios))],
                           self._align)
        self._count(lookups=1, lookup_hit_blocks=hits)
        return Hit(hits, hits > 0 and all(pinned[g * n + b - start] for g, io in enumerate(ios)
                                          for b in io.group.needed_blocks(start, start + hits)))

    # ---- loads ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        sync, in_step = [], []
        for task in meta.loads:
            if task.is_async and task.in_step:
                in_step.append(task)
            elif task.is_async:
                self._transfer.submit(LOAD, task.req_id, lambda t=task: self._finish_async_load(t))
            else:
                sync.append(task)
        # The request is not in this step's forward pass: the copy runs now, on this thread's
        # copy team, and the request is reported done in this step's results.
        for task, failed in zip(in_step, self._load_tasks(in_step)):
            self._async_loaded(task, failed)
        if sync and self._failures_by_request:
            self._count(pinned_loads=len({t.req_id for t in sync}))
        if sync and self._layer_loader is not None:
            # Layer by layer on the loader thread; the forward pass waits per layer.
            loads = self._layer_loads = _LayerLoads(sync, len(self.layout.layers))
            self._layer_loader.submit(LOAD, "layerwise", lambda: self._run_layer_loads(loads))
            return
        for failed in self._load_tasks(sync):
            self._step_load_errors |= failed
            with self._lock:
                self._load_errors |= failed

    def _run_layer_loads(self, loads: _LayerLoads) -> None:
        try:
            for layer, arrived in enumerate(loads.arrived):
                for task in loads.tasks:
                    loads.failed |= self._load(task, range(layer, layer + 1), count_blocks=layer == 0)
                arrived.set()
        finally:  # an unexpected error: the forward pass must not wait for layers that never come
            if not loads.arrived[-1].is_set():
                loads.failed |= {b for t in loads.tasks for b in t.block_ids}
                for arrived in loads.arrived:
                    arrived.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        loads = self._layer_loads
        if loads is None or self.layout is None:
            return
        layer = self.layout.index_of(layer_name)
        if layer is None:
            return
        if not loads.arrived[layer].wait(LAYER_WAIT_TIMEOUT_S):
            logger.error("kvpool: layer %s did not arrive in %.0f s; its blocks will be recomputed",
                         layer_name, LAYER_WAIT_TIMEOUT_S)
            loads.failed |= {b for t in loads.tasks for b in t.block_ids}
        loads.waited += 1
        self._count(layer_loads_waited=1)

    def _finish_layer_loads(self) -> None:
        """End of the step: every layer has arrived (or failed) and its errors are known."""
        loads, self._layer_loads = self._layer_loads, None
        if loads is None:
            return
        if not loads.arrived[-1].wait(LAYER_WAIT_TIMEOUT_S):
            loads.failed |= {b for t in loads.tasks for b in t.block_ids}
        if loads.waited < len(loads.arrived):
            # The forward pass ran without waiting for some layers (the platform skipped vLLM's
            # per-layer hooks): those layers may have been computed from partly loaded KV.
            logger.error("kvpool: the forward pass waited for %d of %d loaded layers; these blocks "
                         "are reported as load errors and recomputed", loads.waited, len(loads.arrived))
            loads.failed |= {b for t in loads.tasks for b in t.block_ids}
        self._step_load_errors |= loads.failed
        with self._lock:
            self._load_errors |= loads.failed

    def _finish_async_load(self, task: BlockTask) -> None:
        self._async_loaded(task, self._load_or_fail(task))

    def _async_loaded(self, task: BlockTask, failed: set[int]) -> None:
        with self._lock:
            # A request's loads (one task per group) finish together: its last task reports it.
            self._async_done[task.req_id] = self._async_done.get(task.req_id, set()) | failed
            if failed and self._failures_by_request:
                self._failed_recving.add(task.req_id)

    def _load_or_fail(self, task: BlockTask) -> set[int]:
        """`_load`, with an unexpected error (a bug, not a store's failure, which `_load` turns
        into codes) failing every block of the task: raised from a sync load it would end vLLM's
        step, and from an async one the request would never be reported and wait forever."""
        try:
            return self._load(task)
        except Exception:
            logger.exception("kvpool: the load of %d blocks for %s raised; they are reported as load "
                             "errors and recomputed", len(task.block_ids), task.req_id)
            return set(task.block_ids)

    def _load(self, task: BlockTask, layers: range | None = None, count_blocks: bool = True) -> set[int]:
        """Copy a request's pooled blocks (all layers, or the given ones in layerwise mode) into
        its vLLM blocks; returns the block ids that failed."""
        assert self.backend is not None
        io = self.groups[task.group]
        if layers is None and io.scheme.layers:  # a layerwise async load: every layer in turn
            failed: set[int] = set()
            for layer in range(io.scheme.layers):
                failed |= self._load(task, range(layer, layer + 1), count_blocks=layer == 0)
            return failed
        t0 = time.perf_counter()
        layers = range(len(io.layout.layers)) if layers is None else layers
        keys = io.scheme.keys(task.block_hashes, layers.start if io.scheme.layers else None, task.tenant)
        try:
            codes = io.copier.load(keys, task.block_ids, layers, self.backend.batch_get_into)
        except Exception as e:  # the store went away: every block of this load failed
            logger.warning("kvpool load of %d blocks for %s failed: %s", len(task.block_ids), task.req_id, e)
            codes = [int(ErrorCode.RPC_FAIL)] * len(task.block_ids)
        seconds = time.perf_counter() - t0
        self._observe("load", seconds, codes if count_blocks else ())
        return self._settle_load(task, codes, len(layers), seconds, count_blocks)

    def _load_tasks(self, tasks: Sequence[BlockTask]) -> list[set[int]]:
        """Each task's failed block ids (as `_load_or_fail`), the tasks of groups that copy
        directly loaded in one backend batch: a model with several KV cache groups has one task
        per group, and a batch per group would cost a store call each."""
        together = [i for i, t in enumerate(tasks)
                    if isinstance(self.groups[t.group].copier, DirectCopier) and not self.groups[t.group].scheme.layers]
        if len(together) < 2:
            return [self._load_or_fail(t) for t in tasks]
        failed = dict(zip(together, self._load_together([tasks[i] for i in together])))
        return [failed[i] if i in failed else self._load_or_fail(t) for i, t in enumerate(tasks)]

    def _load_together(self, tasks: list[BlockTask]) -> list[set[int]]:
        assert self.backend is not None
        t0 = time.perf_counter()
        ios = [self.groups[t.group] for t in tasks]
        loads = [(io.copier, io.scheme.keys(t.block_hashes, None, t.tenant), t.block_ids, range(len(io.layout.layers)))
                 for io, t in zip(ios, tasks)]
        try:
            codes = load_direct(loads, self.backend.batch_get_into)
        except Exception as e:  # the store went away (or a bug): every block of these loads failed
            logger.warning("kvpool load of %d blocks for %s failed: %s", sum(len(t.block_ids) for t in tasks),
                           ", ".join(sorted({t.req_id for t in tasks})), e)
            codes = [[int(ErrorCode.RPC_FAIL)] * len(t.block_ids) for t in tasks]
        seconds = time.perf_counter() - t0
        self._observe("load", seconds, [c for cs in codes for c in cs])
        return [self._settle_load(t, cs, len(io.layout.layers), seconds / len(tasks))
                for t, cs, io in zip(tasks, codes, ios)]

    def _settle_load(self, task: BlockTask, codes: Sequence[int], layers: int, seconds: float,
                     count_blocks: bool = True) -> set[int]:
        """A load's outcome counted and, where blocks failed, said; its failed block ids."""
        failed = {b for b, c in zip(task.block_ids, codes) if c != ErrorCode.OK}
        ok = len(task.block_ids) - len(failed)
        if failed:
            first_bad = next(c for c in codes if c != ErrorCode.OK)
            logger.warning(
                "kvpool: %d of %d blocks of request %s failed to load (%s); vLLM will handle them "
                "per kv_load_failure_policy", len(failed), len(task.block_ids), task.req_id, code_name(first_bad),
            )
        io = self.groups[task.group]
        self._count(load_blocks=ok if count_blocks else 0, load_bytes=ok * io.layout.layer_block_bytes * layers,
                    load_time_s=seconds, load_failed_blocks=len(failed) if count_blocks else 0)
        if task.pin_s and count_blocks and ok:  # off the step's path: the loads are what it waits for
            moved = [b not in failed for b in task.block_ids]
            self._transfer.submit(SAVE, task.req_id, lambda: self._pins.pin(task, [io.scheme], moved))
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        if errors and self._failures_by_request:
            logger.error("kvpool: %d blocks of a pinned load failed (a step that came after the lookup lease's "
                         "TTL?); vLLM cannot take block errors of a model with several KV cache groups and "
                         "stops rather than compute over them. Raise default_kv_lease_ttl_ms", len(errors))
        return errors

    # ---- saves ------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        # On the CPU backend the forward pass has finished writing the KV cache when this runs,
        # so the copy can happen later on the transfer thread; the blocks stay allocated until
        # the request's save is reported done (delayed free) or, if preempted, drained first.
        assert self.scheme is not None and self.groups
        self._finish_layer_loads()
        saved_layers, self._layers_saved = self._layers_saved, set()
        # Each group's first rank of a shard writes it (a Mamba state is every rank's own).
        untainted = self._untainted(meta.saves)
        saves = [t for t in untainted if self.groups[t.group].scheme.is_writer]
        if self._stored is not None:  # a rank that writes nothing of a block has its part stored
            for t in untainted:
                if not self.groups[t.group].scheme.is_writer:
                    self._stored.extend((STORED, t.group, h) for h in t.block_hashes)
        # The step's last call: its failures taint only the next step's saves computed over them.
        self._last_step_load_errors, self._step_load_errors = self._step_load_errors, set()
        if not saves:
            return
        ready = next(iter(self.groups.values())).copier.written()
        for task in saves:
            if self.scheme.layers:  # the layers save_kv_layer did not send (a hook that never ran)
                for layer in sorted(set(range(self.scheme.layers)) - saved_layers):
                    self._transfer.submit(SAVE, task.req_id, lambda t=task, i=layer: self._save_layer(t, i, ready))
            elif task.save_now:
                # vLLM may free these blocks (out of the window) when it schedules the next step,
                # and hand them to a request whose load or forward pass rewrites them.
                self._save(task, ready)
            else:
                self._transfer.submit(SAVE, task.req_id, lambda t=task: self._save(t, ready))
        if self.config.save_sync and meta.saves:
            # The step's output (for a prefill node: the answer the proxy is waiting for) is
            # only returned once its blocks are in the pool, so a decode node finds them.
            if not self._transfer.wait({t.req_id for t in meta.saves}, timeout=DRAIN_TIMEOUT_S):
                logger.error("kvpool: saves of this step did not finish in %.0f s", DRAIN_TIMEOUT_S)

    def save_kv_layer(self, layer_name: str, meta: KVPoolMetadata) -> None:
        """Layerwise mode: layer `layer_name` of this step's blocks is written; send it now."""
        if self.scheme is None or not self.scheme.layers or not self.scheme.is_writer or not meta.saves:
            return
        assert self.layout is not None
        layer = self.layout.index_of(layer_name)
        if layer is None:
            return
        ready = self.groups[self.scheme.group].copier.written()
        self._layers_saved.add(layer)
        self._count(layer_saves_sent=1)
        # The loader sets layers in order and this one has arrived, so every failure in layers
        # up to here is known; this layer's KV was computed from those layers only.
        for task in self._untainted(meta.saves, count=False):
            self._transfer.submit(SAVE, task.req_id, lambda t=task: self._save_layer(t, layer, ready))

    def _untainted(self, saves: list[BlockTask], count: bool = True) -> list[BlockTask]:
        """The saves whose request holds no block that failed to load in this step (or, before
        them, in the last step).

        A sync load's failures are known only after the forward pass that used the blocks, so
        the blocks a request computed in this step may hold KV derived from bytes that never
        arrived. Those are not saved; vLLM recomputes the request and the scheduler, told of
        the failed blocks, offers them again (`PoolScheduler.update_connector_output`).
        """
        loads = self._layer_loads
        failed = set(self._step_load_errors)
        if loads is not None:
            failed |= loads.failed
        # With async scheduling a step is planned before the last step's failures reach vLLM: a
        # save computed over one of those blocks is dropped too. A save of the failed block itself
        # is vLLM's recompute of it (its first failed block, planned after the report): kept.
        earlier = self._last_step_load_errors
        if not failed and not earlier:
            return saves
        kept = [t for t in saves if failed.isdisjoint(t.prior_block_ids) and failed.isdisjoint(t.block_ids)
                and earlier.isdisjoint(t.prior_block_ids)]
        dropped = sum(len(t.block_ids) for t in saves) - sum(len(t.block_ids) for t in kept)
        if dropped and count:
            self._count(save_dropped_blocks=dropped)
            logger.warning("kvpool: not saving %d blocks computed over blocks whose load failed in this step",
                           dropped)
        return kept

    def _save(self, task: BlockTask, ready=None) -> None:
        # A block is in the pool once every target (a prefill PP stage's layers, or all) holds it.
        targets = self.groups[task.group].put_targets
        results = [self._save_values(task, scheme, layers, ready) for scheme, layers in targets]
        stored = [all(r) for r in zip(*results)] if results else []
        self._note_stored(task, stored)
        self._pins.pin(task, [scheme for scheme, _ in targets], stored)

    def _save_layer(self, task: BlockTask, layer: int, ready=None) -> None:
        assert self.scheme is not None
        last = layer == self.scheme.layers - 1
        stored = self._save_values(task, self.scheme, range(layer, layer + 1), ready, count_blocks=last)
        if last:  # a block is in the pool once its last layer is
            self._note_stored(task, stored)
            self._pins.pin(task, [self.scheme], stored)

    def _note_stored(self, task: BlockTask, stored: list[bool]) -> None:
        if self._stored is not None:
            self._stored.extend((STORED, task.group, h) for h, ok in zip(task.block_hashes, stored) if ok)

    def _save_values(self, task: BlockTask, scheme: KeyScheme, layers: range, ready=None,
                     count_blocks: bool = True) -> list[bool]:
        """Save the task's values of ``scheme``'s ``layers``; per block, whether all of them are
        in the pool now."""
        assert self.backend is not None
        io = self.groups[task.group]
        t0 = time.perf_counter()
        keys = scheme.keys(task.block_hashes, layers.start if scheme.layers else None, task.tenant)
        try:
            # One call, no existence check first: the backend's put is put-if-absent and says
            # OBJECT_ALREADY_EXISTS for a block the pool has (some stores say OK for both).
            codes = io.copier.save(keys, task.block_ids, layers, self.backend.batch_put, ready)
        except Exception as e:
            logger.warning("kvpool save of %d blocks for %s failed: %s", len(task.block_ids), task.req_id, e)
            self._count(save_failed_blocks=len(task.block_ids) if count_blocks else 0)
            self._observe("save", time.perf_counter() - t0, [int(ErrorCode.RPC_FAIL)] * len(task.block_ids) if count_blocks else ())
            return [False] * len(task.block_ids)
        skipped = sum(1 for c in codes if c == ErrorCode.OBJECT_ALREADY_EXISTS)
        failed = sum(1 for c in codes if not is_stored(c))
        if failed:
            first_bad = next(c for c in codes if not is_stored(c))
            logger.warning("kvpool: %d of %d blocks of %s were not saved (%s)",
                           failed, len(task.block_ids), task.req_id, code_name(first_bad))
        saved = len(task.block_ids) - skipped - failed
        value_bytes = io.layout.layer_block_bytes * len(layers)
        if not count_blocks:  # layerwise: a block counts once, with its last layer
            saved_blocks = skipped_blocks = failed_blocks = 0
        else:
            saved_blocks, skipped_blocks, failed_blocks = saved, skipped, failed
        seconds = time.perf_counter() - t0
        self._count(save_blocks=saved_blocks, save_bytes=saved * value_bytes,
                    save_time_s=seconds, save_skipped_blocks=skipped_blocks,
                    save_failed_blocks=failed_blocks)
        self._observe("save", seconds, [c for c in codes if not is_stored(c)] if count_blocks else ())
        per = len(codes) // max(1, len(task.block_ids))  # a block's values: one, or one per head
        return [all(is_stored(c) for c in codes[i * per : (i + 1) * per]) for i in range(len(task.block_ids))]

    def handle_preemptions(self, meta: KVPoolMetadata) -> None:
        # A preempted request's blocks are freed and may be rewritten in this very step: its
        # saves must finish reading them first, or the pool would store another request's KV.
        if meta.preempted and not self._transfer.wait(set(meta.preempted), timeout=DRAIN_TIMEOUT_S):
            logger.error("kvpool: saves of preempted requests %s did not finish in %.0f s",
                         meta.preempted, DRAIN_TIMEOUT_S)

    # ---- completion -------------------------------------------------------------------------

    def get_finished(self, meta: KVPoolMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves are done (their blocks may be freed), and whose async loads are."""
        sending, recving, _ = self.get_transfer_results(meta)
        return sending, recving

    def get_transfer_results(self, meta: KVPoolMetadata | None) -> tuple[set[str] | None, set[str] | None, set[str]]:
        """`get_finished`, and of the loads done the ones that failed in a model with several
        KV cache groups: vLLM takes those by request (a single-group model reports the failed
        blocks instead, in `get_block_ids_with_load_errors`)."""
        if meta is not None:
            self._awaiting_free.update(meta.finished_with_io)
        done_sending = {r for r in self._awaiting_free if not self._transfer.is_pending(r)}
        self._awaiting_free -= done_sending
        with self._lock:
            # A request whose load has a task still queued (another group's) is not done yet.
            done = {r: f for r, f in self._async_done.items() if not self._transfer.is_pending(r)}
            for r in done:
                del self._async_done[r]
            failed_recving = self._failed_recving & done.keys()
            self._failed_recving -= failed_recving
            if not self._failures_by_request:
                for failed in done.values():
                    # Reported in the same step as the request's finish, as vLLM requires.
                    self._load_errors |= failed
        return done_sending or None, set(done) or None, failed_recving

    # ---- stats and shutdown -----------------------------------------------------------------

    def _count(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._stats.add(k, v)

    def _observe(self, op: str, seconds: float, codes: Sequence[int]) -> None:
        """One transfer's duration, and its failed blocks by error code (OK codes ignored)."""
        with self._lock:
            self._stats.observe(f"{op}_seconds", seconds)
            for code in codes:
                if code != ErrorCode.OK:
                    self._stats.fail(f"{op}_failures", code_name(code), 1)

    def get_kv_events(self) -> PoolEventReport | None:
        """This step's report for vLLM's KV events (None when vLLM publishes none): the blocks
        whose part this worker stored, and those its pool dropped. An empty report too: every
        worker counts toward the step's."""
        if self._stored is None:
            return None
        markers = []
        while self._stored:
            markers.append(self._stored.popleft())
        removed = self.backend.take_removed() if self.backend is not None else None
        return PoolEventReport(markers + dropped_markers(removed or ()))

    def get_stats(self) -> KVPoolStats | None:
        if self.backend is not None:
            guard = self.backend.guard_stats()
            # The backend's running totals, under the names this worker counts them by.
            totals = {"store_timeouts": guard["timeouts"], "store_calls_skipped": guard["breaker_rejected"],
                      **{k: v for k, v in self.backend.tier_stats().items() if k in COUNTERS}}
            seen, self._backend_seen = self._backend_seen, totals
            self._count(**{k: v - seen.get(k, 0) for k, v in totals.items() if v != seen.get(k, 0)})
        depth = self._transfer.depth() + (self._layer_loader.depth() if self._layer_loader is not None else 0)
        with self._lock:
            snap = self._stats.take()
        # A level is sent when it changed too, so a queue that drained reads 0, not its last depth.
        report = not snap.is_empty() or depth != self._reported_depth
        if report:
            snap.data["transfer_queue_depth"] = self._reported_depth = depth
        self._log_stats.aggregate(snap)
        now = time.monotonic()
        if now - self._last_log >= self.config.stats_log_interval_s:
            if not self._log_stats.is_empty():
                logger.info("kvpool (tp%d pp%d): %s", self.tp_rank, self.pp_rank,
                            ", ".join(f"{k}={v}" for k, v in self._log_stats.reduce().items()))
            self._log_stats = KVPoolStats()
            self._last_log = now
        return snap if report else None

    def shutdown(self) -> None:
        if self._layer_loader is not None:
            self._layer_loader.close(timeout=DRAIN_TIMEOUT_S)
        self._transfer.close(timeout=DRAIN_TIMEOUT_S)
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
