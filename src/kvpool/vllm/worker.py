"""Worker side of the connector: KV cache <-> pool copies, lookup serving, load-error reports."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from kvpool.backends import Backend, create_backend
from kvpool.backends.faults import FaultInjectingBackend
from kvpool.backends.registry import REGISTRY
from kvpool.config import KVPoolConfig
from kvpool.errors import ConfigError, ErrorCode, is_stored
from kvpool.keys import KeyScheme, model_key_name, prefill_stage_schemes
from kvpool.vllm.layout import KVLayout
from kvpool.vllm.lookup import LookupServer
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.stats import KVPoolStats
from kvpool.vllm.transfer import LOAD, SAVE, TransferThread

logger = logging.getLogger(__name__)

# How long shutdown and preemption wait for saves in flight before giving up on them.
DRAIN_TIMEOUT_S = 60.0


class PoolWorker:
    def __init__(self, vllm_config, config: KVPoolConfig, kv_cache_config) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        self.config = config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        tp, pp = get_tp_group(), get_pp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.pp_rank, self.pp_size = pp.rank_in_group, pp.world_size
        self.dp_rank = vllm_config.parallel_config.data_parallel_rank
        self.backend: Backend | None = None
        self.layout: KVLayout | None = None
        self.scheme: KeyScheme | None = None
        # (key scheme, layers) per value a block is saved as: one for this rank's own key, or one
        # per prefill PP stage when a decode node puts for PP prefill nodes.
        self._put_targets: list[tuple[KeyScheme, range]] = []
        self._lookup: LookupServer | None = None
        self._transfer = TransferThread()
        self._lock = threading.Lock()  # guards the sets below, shared with the transfer thread
        self._load_errors: set[int] = set()
        self._async_done: dict[str, set[int]] = {}  # req_id -> failed block ids
        self._awaiting_free: set[str] = set()
        self._stats = KVPoolStats()
        self._log_stats = KVPoolStats()
        self._last_log = time.monotonic()

    # ---- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self._vllm_config.model_config
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        from vllm.platforms import current_platform

        self.layout = KVLayout(
            kv_caches,
            num_blocks=self._kv_cache_config.num_blocks,
            block_size=self._vllm_config.cache_config.block_size,
            num_layers_total=mc.get_total_num_hidden_layers(),
            cache_layout=f"{current_platform.device_type}:{type(spec).__name__}",
        )
        total_kv_heads = mc.get_total_num_kv_heads()
        kv_shards = 1 if mc.use_mla else min(self.tp_size, total_kv_heads)
        self.scheme = KeyScheme(
            model=model_key_name(mc.model),
            layout=self.layout.info.fingerprint(),
            tp_rank=self.tp_rank, tp_size=self.tp_size, kv_shards=kv_shards,
            pp_rank=self.pp_rank, pp_size=self.pp_size,
        )
        self._put_targets = [(self.scheme, range(len(self.layout.layers)))]
        # Only a decode node (kv_consumer) puts for the prefill nodes' PP stages; the flag means
        # nothing on other roles (docs/configuration.md, roles).
        if (self.config.kv_role == "kv_consumer" and self.config.consumer_is_to_put
                and self.config.prefill_pp_size and self.pp_size == 1):
            from vllm.distributed.utils import get_pp_indices

            n, size = len(self.layout.layers), self.config.prefill_pp_size
            partition = self.config.prefill_pp_layer_partition or [
                end - start for start, end in (get_pp_indices(n, p, size) for p in range(size))]
            self._put_targets = prefill_stage_schemes(self.scheme, n, size, partition)
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
        if self.tp_rank == 0 and self.pp_rank == 0 and self.config.loads:
            self._lookup = LookupServer(self.config.lookup_rpc_port, self.dp_rank, self._count_hits)
        logger.info(
            "kvpool worker ready: backend=%s role=%s key=%s block=%d bytes in %d layers",
            backend.name, self.config.kv_role, self.scheme.key(b"\0" * 4), self.layout.block_bytes,
            len(self.layout.layers),
        )

    # ---- lookup (rank 0) ------------------------------------------------------------------

    def _count_hits(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks whose keys exist for every TP shard and PP stage."""
        assert self.scheme is not None and self.backend is not None
        per_block = [self.scheme.all_rank_keys(h) for h in block_hashes]
        flat = [k for ks in per_block for k in ks]
        found = self.backend.batch_exists(flat, lease=True)
        hits, i = 0, 0
        for ks in per_block:
            if not all(found[i:i + len(ks)]):
                break
            i += len(ks)
            hits += 1
        self._count(lookups=1, lookup_hit_blocks=hits)
        return hits

    # ---- loads ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        for task in meta.loads:
            if task.is_async:
                self._transfer.submit(LOAD, task.req_id, lambda t=task: self._finish_async_load(t))
            else:
                failed = self._load(task)
                with self._lock:
                    self._load_errors |= failed

    def _finish_async_load(self, task: BlockTask) -> None:
        failed = self._load(task)
        with self._lock:
            self._async_done[task.req_id] = failed

    def _load(self, task: BlockTask) -> set[int]:
        """Copy a request's pooled blocks into its vLLM blocks; returns the block ids that failed."""
        assert self.scheme is not None and self.backend is not None and self.layout is not None
        t0 = time.perf_counter()
        keys = self.scheme.keys(task.block_hashes)
        try:
            codes = self.backend.batch_get_into(keys, [self.layout.block_buffers(b) for b in task.block_ids])
        except Exception as e:  # the store went away: every block of this load failed
            logger.warning("kvpool load of %d blocks for %s failed: %s", len(keys), task.req_id, e)
            codes = [int(ErrorCode.RPC_FAIL)] * len(keys)
        failed = {b for b, c in zip(task.block_ids, codes) if c != ErrorCode.OK}
        ok = len(keys) - len(failed)
        if failed:
            first_bad = next(c for c in codes if c != ErrorCode.OK)
            logger.warning(
                "kvpool: %d of %d blocks of request %s failed to load (%s); vLLM will handle them "
                "per kv_load_failure_policy", len(failed), len(keys), task.req_id, ErrorCode(first_bad).name,
            )
        self._count(load_blocks=ok, load_bytes=ok * self.layout.block_bytes,
                    load_time_s=time.perf_counter() - t0, load_failed_blocks=len(failed))
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        # On the CPU backend the forward pass has finished writing the KV cache when this runs,
        # so the copy can happen later on the transfer thread; the blocks stay allocated until
        # the request's save is reported done (delayed free) or, if preempted, drained first.
        assert self.scheme is not None
        if not self.scheme.is_writer:
            return
        for task in meta.saves:
            self._transfer.submit(SAVE, task.req_id, lambda t=task: self._save(t))
        if self.config.save_sync and meta.saves:
            # The step's output (for a prefill node: the answer the proxy is waiting for) is
            # only returned once its blocks are in the pool, so a decode node finds them.
            if not self._transfer.wait({t.req_id for t in meta.saves}, timeout=DRAIN_TIMEOUT_S):
                logger.error("kvpool: saves of this step did not finish in %.0f s", DRAIN_TIMEOUT_S)

    def _save(self, task: BlockTask) -> None:
        for scheme, layers in self._put_targets:
            self._save_values(task, scheme, layers)

    def _save_values(self, task: BlockTask, scheme: KeyScheme, layers: range) -> None:
        assert self.backend is not None and self.layout is not None
        t0 = time.perf_counter()
        keys = scheme.keys(task.block_hashes)
        try:
            # One call, no existence check first: the backend's put is put-if-absent and says
            # OBJECT_ALREADY_EXISTS for a block the pool has (some stores say OK for both).
            codes = self.backend.batch_put(keys, [self.layout.stage_buffers(b, layers) for b in task.block_ids])
        except Exception as e:
            logger.warning("kvpool save of %d blocks for %s failed: %s", len(keys), task.req_id, e)
            self._count(save_failed_blocks=len(keys))
            return
        skipped = sum(1 for c in codes if c == ErrorCode.OBJECT_ALREADY_EXISTS)
        failed = sum(1 for c in codes if not is_stored(c))
        if failed:
            first_bad = next(c for c in codes if not is_stored(c))
            logger.warning("kvpool: %d of %d blocks of %s were not saved (%s)",
                           failed, len(keys), task.req_id, ErrorCode(first_bad).name)
        saved = len(keys) - skipped - failed
        value_bytes = sum(s.shape[1] for layer in self.layout.layers[layers.start:layers.stop] for s in layer.segments)
        self._count(save_blocks=saved, save_bytes=saved * value_bytes,
                    save_time_s=time.perf_counter() - t0, save_skipped_blocks=skipped,
                    save_failed_blocks=failed)

    def handle_preemptions(self, meta: KVPoolMetadata) -> None:
        # A preempted request's blocks are freed and may be rewritten in this very step: its
        # saves must finish reading them first, or the pool would store another request's KV.
        if meta.preempted and not self._transfer.wait(set(meta.preempted), timeout=DRAIN_TIMEOUT_S):
            logger.error("kvpool: saves of preempted requests %s did not finish in %.0f s",
                         meta.preempted, DRAIN_TIMEOUT_S)

    # ---- completion -------------------------------------------------------------------------

    def get_finished(self, meta: KVPoolMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        if meta is not None:
            self._awaiting_free.update(meta.finished_with_io)
        done_sending = {r for r in self._awaiting_free if not self._transfer.is_pending(r)}
        self._awaiting_free -= done_sending
        with self._lock:
            done, self._async_done = self._async_done, {}
            for failed in done.values():
                # Reported in the same step as the request's finish, as vLLM requires.
                self._load_errors |= failed
        return done_sending or None, set(done) or None

    # ---- stats and shutdown -----------------------------------------------------------------

    def _count(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self._stats.add(k, v)

    def get_stats(self) -> KVPoolStats | None:
        with self._lock:
            snap = self._stats.take()
        self._log_stats.aggregate(snap)
        now = time.monotonic()
        if now - self._last_log >= self.config.stats_log_interval_s:
            if not self._log_stats.is_empty():
                logger.info("kvpool (tp%d pp%d): %s", self.tp_rank, self.pp_rank,
                            ", ".join(f"{k}={v}" for k, v in self._log_stats.reduce().items()))
            self._log_stats = KVPoolStats()
            self._last_log = now
        return None if snap.is_empty() else snap

    def shutdown(self) -> None:
        self._transfer.close(timeout=DRAIN_TIMEOUT_S)
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
