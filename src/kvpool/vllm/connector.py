"""`KVPoolConnector`: vLLM's KV connector facade, delegating to the scheduler or worker side.

vLLM builds the connector twice, once per role; each instance creates only its own half.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpool.config import load_config
from kvpool.vllm.events import PoolEventReport
from kvpool.vllm.metadata import KVPoolMetadata
from kvpool.vllm.stats import KVPoolStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpool.vllm.prom import KVPoolPromMetrics


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's v1 KV connector for a kvpool pool (``kv_connector: KVPoolConnector`` or, as the
    spec names it, ``AscendStoreConnector``).

    It supports vLLM's hybrid KV cache manager (`SupportsHMA`), so vLLM keeps it on: models
    with sliding-window or chunked-local layers run as they do without a connector, and every
    KV cache group is pooled (`kvpool.vllm.groups`).

    Every call is forwarded to the half its role owns: ``PoolScheduler`` (lookups and each
    step's load and save plans, no KV bytes) in the scheduler process, ``PoolWorker`` (the
    copies between vLLM's KV cache and the store) in each worker. The worker's per-step calls
    act on the ``KVPoolMetadata`` vLLM bound for that step, and do nothing without one.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = load_config(ktc.kv_connector_extra_config, ktc.kv_role)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvpool.vllm.scheduler import PoolScheduler

            self._scheduler = PoolScheduler(vllm_config, self.config, kv_cache_config)
        else:
            from kvpool.vllm.worker import PoolWorker

            self._worker = PoolWorker(vllm_config, self.config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        # A pool is a cache: a save dropped by preemption is only a future miss.
        return False

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def _meta(self) -> KVPoolMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVPoolMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if (meta := self._meta()) is not None:
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Only layerwise loads arrive during the forward pass; the others finish in
        # start_load_kv (sync) or before the request is scheduled (async).
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # Layerwise: the layer leaves now; otherwise whole blocks leave in wait_for_save.
        if (meta := self._meta()) is not None:
            self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        if (meta := self._meta()) is not None:
            self._worker.wait_for_save(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVPoolMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.get_transfer_results(self._meta())
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> PoolEventReport | None:
        return self._worker.get_kv_events()

    def get_kv_connector_stats(self) -> KVPoolStats | None:
        # Both roles: vLLM adds the scheduler's (prompt tokens by source) to the workers'.
        half = self._worker if self._worker is not None else self._scheduler
        return half.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolStats:
        return KVPoolStats.from_data(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPoolPromMetrics:
        from kvpool.vllm.prom import KVPoolPromMetrics

        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def register_finished_partial_tail(self, request: Request, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        return self._scheduler.register_finished_partial_tail(request, partial_tail_offloads)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_block_frees()


# The spec's connector name, so its configs work unchanged with kv_connector_module_path too.
AscendStoreConnector = KVPoolConnector
