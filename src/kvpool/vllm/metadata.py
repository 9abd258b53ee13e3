"""What the scheduler tells the workers each step: blocks to load, blocks to save, frees to hold."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass
class BlockTask:
    """Copy the blocks `block_hashes[i]` <-> vLLM block `block_ids[i]` of KV cache group `group`
    for one request (a model with several groups gets one task per group)."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    is_async: bool = False  # loads only: reported via get_finished (vLLM waits in WAITING_FOR_REMOTE_KVS)
    # Async loads only: run in start_load_kv, on the worker's own threads, rather than on the
    # transfer thread (a hybrid model without load_async: vLLM's protocol is async, the copy is not).
    in_step: bool = False
    group: int = 0  # vLLM's KV cache group id: block ids are per group
    # Saves only: read the blocks before the step returns (vLLM may free them at the next one).
    save_now: bool = False
    # Saves only, in a step with loads or the step after one: the request's blocks before
    # `block_ids`, which this step's computation of them attended over. A save whose request
    # holds a block that failed to load in this step (or, among these, in the last one) is
    # dropped: its KV may have been computed from wrong bytes.
    prior_block_ids: list[int] = dataclasses.field(default_factory=list)
    # Once moved, keep these blocks in the host pool's memory this many seconds (the request's
    # `pin_s`, cut to `request_pin_max_s`); 0: no pin.
    pin_s: float = 0.0
    tenant: str = ""  # the request's `kvpool.keys.tenant_tag` (its cache_salt's), part of its keys


@dataclasses.dataclass
class KVPoolMetadata(KVConnectorMetadata):
    """One step's plan, built by the scheduler and bound in every worker: the blocks to load
    before the forward pass, the blocks to save after it, and which requests' blocks vLLM must
    not reuse until their IO is reported done."""

    loads: list[BlockTask] = dataclasses.field(default_factory=list)
    saves: list[BlockTask] = dataclasses.field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until this worker reports their IO done.
    finished_with_io: list[str] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
