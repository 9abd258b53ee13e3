"""Scheduler side of the connector: how much of a prompt the pool holds, and per-step plans.

Invariants:
- A load covers whole pooled blocks after those vLLM already computed locally, and never the
  whole prompt: when every block hits, one token is given back so vLLM computes logits.
- Only full prompt blocks are saved, each once per request; blocks loaded from the pool are
  not saved again. The worker also skips keys already pooled (another request may have won).
- A block computed over a block that failed to load is never saved: the worker drops such saves
  (`BlockTask.prior_block_ids`), and when vLLM reports the failed blocks the request's saves
  rewind to its first failed block, so what vLLM recomputes is saved then. A request is never
  offered again the blocks from its first failed one on: vLLM recomputes them.
- A request with IO sent to the workers is not freed until the workers report it done: in
  finished_sending, or, when it finished while its async load was in flight, in the
  finished_recving vLLM itself waits for (never both: vLLM forgets a request once freed).
- With several KV cache groups (hybrid attention), a block position has a block in each group:
  loads and saves carry one task per group, with that group's block ids, and never vLLM's null
  block (a position out of a sliding window). A hit is what every group can serve
  (`kvpool.vllm.groups`), ends on a whole block (a prompt that hits whole gives its last block
  back, as vLLM's own prefix cache does for such models), and loads asynchronously: vLLM takes
  a failed load of such a model only by request, and then recomputes the request whole.
- A Mamba group's states are saved where vLLM names them (boundary hand-offs), never by
  position: a block of its table holds a state only at the boundary vLLM cached, and only until
  the next one. A hit loads the state at its end and nothing before it. A state the request
  itself loaded or got from vLLM's cache is not saved again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from kvpool.config import KVPoolConfig
from kvpool.errors import ConfigError
from kvpool.keys import tenant_tag
from kvpool.tracefile import BlockHashLog
from kvpool.vllm.control import DEFAULT, RequestControl, request_control
from kvpool.vllm.events import PoolEventLog, events_enabled, pool_medium
from kvpool.vllm.groups import NULL_BLOCK_ID, PoolGroup, loads_by_request, pool_groups, state_chunking_problem
from kvpool.vllm.lookup import LookupClient
from kvpool.vllm.metadata import BlockTask, KVPoolMetadata
from kvpool.vllm.stats import KVPoolStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


@dataclasses.dataclass
class _LoadPlan:
    start_block: int
    end_block: int
    is_async: bool  # reported through vLLM's async protocol (else loaded in the computing step)


@dataclasses.dataclass
class _RequestState:
    request: Request  # its block_hashes grow as tokens are added
    # Per KV cache group (vLLM's group order), the request's block table.
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) are pooled or queued for saving
    has_io: bool = False
    # An async load sent, its finished_recving not seen yet: vLLM itself holds the blocks.
    async_loading: bool = False
    # Blocks from this one on failed to load for this request once: never offered to it again,
    # or a block the store keeps failing would be retried instead of recomputed.
    pool_limit: int | None = None
    load_start: int = 0  # the first block of its last load (several groups: where a failure rewinds to)
    reused_upto: int = 0  # blocks [0, reused_upto) came from vLLM's cache or the pool, not computed here
    control: RequestControl = DEFAULT  # what the request asked of the pool (`control.py`)
    pin_s: float = 0.0  # its blocks' pin once moved: its `pin_s` as the instance allows it
    tenant: str = ""  # its cache_salt's tag in its keys (`kvpool.keys.tenant_tag`)


def _held(group: PoolGroup, ids: list[int], span: range) -> list[int]:
    """The positions in `span` a group has a block at: a sliding, chunked or Mamba group's table
    holds vLLM's null block where the KV or state is gone."""
    return [i for i in span if i < len(ids) and not (group.frees_early and ids[i] == NULL_BLOCK_ID)]


def _blocks(group: PoolGroup, hashes: list[bytes], ids: list[int], span: range) -> list[tuple[bytes, int]]:
    """(block hash, vLLM block id) of the positions in `span` a group has a block at (`_held`)."""
    return [(hashes[i], ids[i]) for i in _held(group, ids, span)]


def _task(state: _RequestState, group: int, pairs: list[tuple[bytes, int]], **kw: Any) -> BlockTask:
    """A load or save of (hash, block id) pairs of one group, for the request of ``state``."""
    return BlockTask(req_id=state.request.request_id, block_hashes=[h for h, _ in pairs],
                     block_ids=[b for _, b in pairs], group=group, pin_s=state.pin_s, tenant=state.tenant, **kw)


def check_hash_seed(hash_algo: str) -> None:
    """Refuse a configuration whose block hashes would differ between processes.

    vLLM seeds its chained block hash from PYTHONHASHSEED when set; otherwise sha256-family
    hashes use a fixed seed (shareable) but xxhash ones a random per-process seed, which would
    make every key of this instance unique to it: no other instance, and no restart, would hit.
    """
    if hash_algo in _NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            "prefix_caching_hash_algo", hash_algo,
            "sha256 (the default), or set PYTHONHASHSEED to the same value on every instance: "
            "xxhash block hashes are randomly seeded per process otherwise",
        )


class PoolScheduler:
    """The scheduler process's half of the connector: asks worker rank 0 how many leading blocks
    of a prompt the pool holds, and turns vLLM's allocations into each step's loads and saves
    (`KVPoolMetadata`). It never touches KV bytes or the store."""

    def __init__(self, vllm_config: VllmConfig, config: KVPoolConfig, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self._cache_config = vllm_config.cache_config
        self._groups = pool_groups(kv_cache_config, self.block_size, getattr(kv_cache_config, "hash_block_size", None))
        self._hybrid = loads_by_request(self._groups)
        self._state_groups = {g.index for g in self._groups if not g.positional}
        self._load_async = config.load_async or self._hybrid
        # Without load_async a hybrid model's load still runs in the step that hands it over, on
        # the worker's own threads; only its report takes vLLM's async path (by request).
        self._load_in_step = self._hybrid and not config.load_async
        # vLLM can be told of a failed load of a model with several groups only by request,
        # through its async protocol, which costs the request one engine step. A load that cannot
        # fail needs no report: a hit the lookup found pinned in worker rank 0's own memory
        # (`Hit.pinned`) is loaded synchronously, in the step that computes after it. Not for
        # state groups: a state must be in place before the step starts (`loads_by_request`).
        self._sync_when_pinned = self._load_in_step and all(g.positional for g in self._groups)
        if self._load_in_step:
            logger.info("kvpool: %d KV cache groups (%s): a pool load is reported to vLLM by request, "
                        "so that a failed one is recomputed whole%s", len(self._groups),
                        ", ".join(g.describe() for g in self._groups),
                        "; one pinned in this instance's memory cannot fail and loads in the step that "
                        "computes" if self._sync_when_pinned else "")
        check_hash_seed(vllm_config.cache_config.prefix_caching_hash_algo)
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        self._client = LookupClient(config.lookup_rpc_port, dp_rank) if config.loads else None
        self._hash_log = BlockHashLog(config.block_hash_log, self.block_size) if config.block_hash_log else None
        # KV events for the pool's blocks (`kvpool.vllm.events`), when vLLM publishes events.
        parallel = vllm_config.parallel_config
        self._events = PoolEventLog(parallel.tensor_parallel_size * parallel.pipeline_parallel_size, self.block_size,
                                    pool_medium(config.backend)) if events_enabled(vllm_config) else None
        self._plans: dict[str, _LoadPlan] = {}
        self._local_blocks: dict[str, int] = {}  # request -> blocks vLLM's prefix cache supplies
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTask] = []
        self._finished_state_saves: list[BlockTask] = []  # Mamba states of requests that just finished
        self._warned_hash_size = False
        self._warned_pin = False
        self._checked_chunking = False
        self.chunking_problem: str | None = None  # why this model's states are not pooled, once known
        self._finished_with_io: list[str] = []
        self._awaiting_free: set[str] = set()
        self._step_has_sync_loads = False  # this step's saves carry prior_block_ids
        self._last_step_had_sync_loads = False
        self._stats = KVPoolStats()
        self._skipped_seen = 0  # the lookup client's `skipped` at the last get_stats

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # Blocks vLLM's own prefix cache supplies were computed here earlier (and saved then) or
        # loaded from the pool: offering them to the pool again on every turn of a conversation
        # would only cost put-if-absent round trips. The last call before allocation counts.
        self._local_blocks[request.request_id] = num_computed_tokens // self.block_size
        if self._client is None or not self._hashed_per_block(request) or self._control(request).skip_load:
            return 0, False
        hashes = request.block_hashes
        if (state := self._requests.get(request.request_id)) is not None and state.pool_limit is not None:
            hashes = hashes[:state.pool_limit]
        start = num_computed_tokens // self.block_size
        if self._hybrid:
            # Hits end on whole blocks: a prompt that hits whole gives its last block back.
            hashes = hashes[:(request.num_tokens - 1) // self.block_size]
        if len(hashes) <= start:
            return 0, False
        hit = self._client.lookup(hashes[start:], start, self._requests[request.request_id].tenant)
        hit_blocks = start + hit.blocks
        # Full hit: give one token back, so vLLM has a token to compute logits from.
        hit_tokens = min(hit_blocks * self.block_size, request.num_tokens - 1)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        # The lookup's lease pins the hit until its TTL; the load runs in this step's forward.
        is_async = self._load_async and not (self._sync_when_pinned and hit.pinned)
        self._plans[request.request_id] = _LoadPlan(start, hit_blocks, is_async)
        return hit_tokens - num_computed_tokens, is_async

    def _control(self, request: Request) -> RequestControl:
        """The request's own switches, read once (a bad value is said once, and ignored)."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
            state.control, problem = request_control(request.kv_transfer_params)
            if problem:
                logger.warning("kvpool: request %s: %s", request.request_id, problem)
            state.pin_s = min(state.control.pin_s, self.config.request_pin_max_s)
            state.tenant = tenant_tag(request.cache_salt)
            if state.control.pin_s and not state.pin_s and not self._warned_pin:
                self._warned_pin = True
                logger.warning("kvpool: request %s asked to pin its blocks (pin_s=%s), which this instance does not "
                               "allow (request_pin_max_s is 0); served without the pin", request.request_id,
                               state.control.pin_s)
        return state.control

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._control(request)
        state = self._requests[request.request_id]
        looked_up = request.request_id in self._local_blocks
        local_blocks = self._local_blocks.pop(request.request_id, 0)
        state.saved_upto = max(state.saved_upto, local_blocks)
        state.reused_upto = max(state.reused_upto, local_blocks)
        # Only an allocation that followed a lookup says where the prompt's KV came from; vLLM
        # allocates again, without one, when it schedules a request whose async load is done.
        if self._client is not None and looked_up:
            local = min(local_blocks * self.block_size, request.num_prompt_tokens)
            pool = min(num_external_tokens, request.num_prompt_tokens - local)
            self._stats.add("local_tokens", local)
            self._stats.add("pool_tokens", pool)
            self._stats.add("computed_tokens", request.num_prompt_tokens - local - pool)
        plan = self._plans.pop(request.request_id, None)
        if plan is None or num_external_tokens == 0:
            return
        # Another connector (MultiConnector) or vLLM may grant fewer tokens than we offered.
        end = min(plan.end_block, -(-(plan.start_block * self.block_size + num_external_tokens) // self.block_size))
        if not plan.is_async and self._hybrid and end != plan.end_block:
            # A shorter hit needs other sliding-window blocks than the lookup pinned; vLLM would
            # stop on a failed load of them rather than compute over it (never a wrong answer).
            logger.warning("kvpool: request %s was granted %d of the %d pinned blocks offered; its load "
                           "is no longer pinned", request.request_id, end, plan.end_block)
        # An async load's failures arrive before the request is scheduled.
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        hashes = request.block_hashes
        for group in self._groups:
            pairs = _blocks(group, hashes, state.block_ids[group.index], group.load_span(plan.start_block, end))
            if pairs:
                self._pending_loads.append(_task(state, group.index, pairs, is_async=plan.is_async,
                                                 in_step=plan.is_async and self._load_in_step))
        state.saved_upto = max(state.saved_upto, end)
        state.reused_upto = max(state.reused_upto, end)
        state.load_start = plan.start_block
        state.has_io = True
        state.async_loading = plan.is_async

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPoolMetadata:
        if not self._checked_chunking:
            # Checked at the first step, not at start-up: vLLM changes the block size after it
            # built this object (`state_chunking_problem`).
            self._checked_chunking = True
            self.chunking_problem = state_chunking_problem(self._groups, self.block_size, self._cache_config.block_size)
            if self.chunking_problem:
                logger.error("kvpool: %s", self.chunking_problem)
        meta = KVPoolMetadata(loads=self._pending_loads, finished_with_io=self._finished_with_io,
                              preempted=sorted(scheduler_output.preempted_req_ids or ()))
        self._pending_loads, self._finished_with_io = [], []
        if not self.config.saves:
            return meta
        # A sync load's failures are known only after the forward pass that used its blocks, and
        # with async scheduling only after the next step is planned too: that step's saves also
        # name the blocks they were computed over.
        sync_loads = any(not t.is_async for t in meta.loads)
        self._step_has_sync_loads = sync_loads or self._last_step_had_sync_loads
        self._last_step_had_sync_loads = sync_loads
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for table, ids in zip(state.block_ids, new_ids):
                    table.extend(ids)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_save(state, computed, meta)
        if self._state_groups:
            self._plan_state_saves(scheduler_output, meta)
        return meta

    def _plan_state_saves(self, scheduler_output: SchedulerOutput, meta: KVPoolMetadata) -> None:
        """The Mamba states vLLM cached this step (its boundary hand-offs: group, block, tokens),
        saved before the step returns: vLLM writes them in this step's forward pass and may
        reuse the block two steps later."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        for req_id, entries in offloads.items():
            if (state := self._requests.get(req_id)) is not None:
                meta.saves += self._state_tasks(state, entries, save_now=True)
        meta.saves += self._finished_state_saves
        self._finished_state_saves = []

    def _state_tasks(self, state: _RequestState, entries: list[tuple[int, int, int]], save_now: bool) -> list[BlockTask]:
        """Save tasks for the states of (group, block, tokens) entries: only states of the
        prompt, at a whole block, computed by this request (not one it loaded or found in vLLM's
        cache)."""
        req = state.request
        if state.control.skip_save or not self._hashed_per_block(req):
            return []
        by_group: dict[int, list[tuple[bytes, int]]] = {}
        for group, block_id, boundary in entries:
            last = boundary // self.block_size - 1  # the block the state ends
            if (group not in self._state_groups or block_id == NULL_BLOCK_ID or boundary % self.block_size
                    or boundary > req.num_prompt_tokens or last < state.reused_upto
                    or last >= len(req.block_hashes)):
                continue
            by_group.setdefault(group, []).append((req.block_hashes[last], block_id))
            if self._events is not None:
                self._events.planned(group, req.block_hashes, [last], req.all_token_ids)
        if by_group:
            state.has_io = True
        return [_task(state, group, pairs, save_now=save_now) for group, pairs in by_group.items()]

    def register_finished_partial_tail(self, request: Request, entries: list[tuple[int, int, int]]) -> bool:
        """A finishing request's last prompt state that vLLM kept in its own table block (the
        "partial tail": a chunk did not end there, the forward pass exported it): saved at the
        next step, its blocks held until then (the request's delayed free, `request_finished`)."""
        state = self._requests.get(request.request_id)
        # One that finishes during its own async load is freed by vLLM, not held for us.
        if state is None or state.async_loading or not self._state_groups or not self.config.saves:
            return False
        tasks = self._state_tasks(state, entries, save_now=False)
        self._finished_state_saves += tasks
        return bool(tasks)

    def _hashed_per_block(self, request: Request) -> bool:
        """Whether vLLM hashes this request per pool block. A finer hash (vLLM's
        `--prefix-match-unit`, or a hybrid model whose groups got other block sizes) would put a
        block's bytes under the hash of a shorter prefix, which another prompt may share: such a
        request is neither looked up nor saved, and that is said once."""
        if len(request.block_hashes) <= request.num_tokens // self.block_size:
            return True
        if not self._warned_hash_size:
            self._warned_hash_size = True
            logger.error("kvpool: vLLM hashes prompts in units smaller than the %d-token block (%d hashes for %d "
                         "tokens); kvpool neither looks up nor saves them. Unset --prefix-match-unit",
                         self.block_size, len(request.block_hashes), request.num_tokens)
        return False

    def _plan_save(self, state: _RequestState, computed_tokens: int, meta: KVPoolMetadata) -> None:
        req = state.request
        if not state.block_ids or state.control.skip_save or not self._hashed_per_block(req):
            return
        # Decoding fills blocks too (prompt and answer hash as one sequence): saved on request.
        decode = self.config.save_decode_cache if state.control.save_decode is None else state.control.save_decode
        end = (computed_tokens if decode else min(computed_tokens, req.num_prompt_tokens)) // self.block_size
        end = min(end, len(req.block_hashes), *(len(state.block_ids[g.index]) for g in self._groups))
        if end <= state.saved_upto:
            return
        start, hashes = state.saved_upto, req.block_hashes
        for group in self._groups:
            if not group.positional:
                continue  # its states are saved where vLLM names them (_plan_state_saves)
            ids = state.block_ids[group.index]
            held = _held(group, ids, range(start, end))
            pairs = [(hashes[i], ids[i]) for i in held]
            if pairs and self._events is not None:
                self._events.planned(group.index, hashes, held, req.all_token_ids)
            if pairs:
                # Sync loads (single-group models only) may fail after this step's saves were planned.
                meta.saves.append(_task(state, group.index, pairs, save_now=group.frees_early,
                                        prior_block_ids=ids[:start] if self._step_has_sync_loads else []))
        state.saved_upto = end
        state.has_io = True

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self._hash_log is not None:
            self._hash_log.record(request.arrival_time, request.num_prompt_tokens, request.num_output_tokens,
                                  request.block_hashes)
        self._plans.pop(req_id, None)
        self._local_blocks.pop(req_id, None)
        state = self._requests.pop(req_id, None)
        if state is None or not state.has_io:
            return False, None
        if state.async_loading:
            # Finished in WAITING_FOR_REMOTE_KVS (aborted, or failed by kv_load_failure_policy):
            # vLLM keeps the blocks until finished_recving and then frees the request at once.
            # Holding them too would have the workers report it in finished_sending as well,
            # for a request vLLM no longer knows. It was never scheduled with these blocks, so
            # no save reads them.
            return False, None
        self._finished_with_io.append(req_id)
        self._awaiting_free.add(req_id)
        return True, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._events is not None:
            self._events.reported(getattr(connector_output, "kv_cache_events", None))
        for req_id in connector_output.finished_sending or ():
            self._awaiting_free.discard(req_id)
        for req_id in connector_output.finished_recving or ():
            if (state := self._requests.get(req_id)) is not None:
                state.async_loading = False
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            # Several groups: vLLM recomputes the request whole; what it loaded is offered again
            # neither to it nor for saving (its recompute is saved).
            if (state := self._requests.get(req_id)) is not None:
                state.saved_upto = min(state.saved_upto, state.load_start)
                state.pool_limit = state.load_start if state.pool_limit is None else min(state.pool_limit, state.load_start)
        failed = connector_output.invalid_block_ids
        if failed and self._hybrid:
            logger.error("kvpool: block-level load errors %s on a model with several KV cache groups; "
                         "ignored (this connector reports them by request)", sorted(failed)[:8])
        elif failed:
            # vLLM recomputes each affected request from its first failed block; the worker did
            # not save what was computed over it, so those blocks are offered again once recomputed.
            for state in self._requests.values():
                table = state.block_ids[0] if state.block_ids else []
                first = next((i for i, b in enumerate(table[:state.saved_upto]) if b in failed), None)
                if first is not None:
                    state.saved_upto = first
                    state.pool_limit = first if state.pool_limit is None else min(state.pool_limit, first)

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV events ready since the last call, for vLLM's publisher."""
        return self._events.take() if self._events is not None else []

    def get_stats(self) -> KVPoolStats | None:
        """This interval's prompt tokens by source (counted at allocation: a preempted request
        that is scheduled again counts again, as in vLLM's own prefix-cache counters)."""
        if self._client is not None and self._client.skipped > self._skipped_seen:
            self._stats.add("lookups_skipped", self._client.skipped - self._skipped_seen)
            self._skipped_seen = self._client.skipped
        snap = self._stats.take()
        return None if snap.is_empty() else snap

    def has_pending_block_frees(self) -> bool:
        return bool(self._awaiting_free)

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._hash_log is not None:
            self._hash_log.close()
