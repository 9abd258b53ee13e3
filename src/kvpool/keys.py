"""Pool keys: which bytes a key names, and a fingerprint of what makes those bytes compatible.

A key names one block (`block_size` tokens) of one KV-cache group, for all layers held by one
TP shard and PP stage:

    {model}@{layout}@tp{shard}/{shards}@pp{pp_rank}/{pp_size}@g{group}@{block_hash_hex}

A block of a request with a `cache_salt` names its tenant after the model: `{model}~{tag}@...`
(`tenant_tag`), so a pool can keep per-tenant budgets and clear one tenant's blocks.

In layerwise mode (`use_layerwise`) a block is stored as one value per layer, under the block's
key with `@l{layer}` appended, so a load can move layer i while layer i-1 computes. The two
modes never read each other's values.

With `share_across_tp`, a block is stored as one value per KV head instead of one per TP shard:
`@h{head}/{heads}` takes the place of `@tp{shard}/{shards}`, and a rank reads and writes the
heads it holds, so instances of any TP size assemble their heads from the same values.

The block hash is vLLM's chained prefix hash, so it already covers LoRA, multimodal inputs and
`cache_salt`. The layout fingerprint makes an instance with another dtype, block size, head
split or layer count miss instead of loading bytes it would misread, and one whose weights
compute other values for the same tokens (another revision, quantization, compute dtype or
RoPE scaling of the same model name) miss instead of loading KV that would change its answers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Sequence

_HEX = re.compile(r"(?:[0-9a-f]{2})+")
# A tenant's keys: `{model}~{tag}@...` (`tenant_tag`); `~` is never in a model's key name.
TENANT_MARK = "~"
TENANT_TAG_HEX = 12
# Keys are ASCII and bounded so every backend (Yuanrong: 1024 bytes) can store them unchanged.
_MODEL_NAME_MAX = 96


@dataclasses.dataclass(frozen=True)
class LayoutInfo:
    """What must match for two instances' KV bytes to be interchangeable."""

    dtype: str
    block_size: int
    block_shape: tuple[int, ...]  # one layer's block, block dimension removed
    num_layers_total: int  # of the whole model, so every PP stage computes the same fingerprint
    cache_layout: str  # e.g. the attention backend name

    def fingerprint(self, values: str = "") -> str:
        """12 hex digits over the layout and ``values``: a description of what computes the KV
        values (revision, quantization, ...), which must be the same text on every instance that
        should share blocks."""
        fields = dataclasses.asdict(self)
        if values:
            fields["values"] = values
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def valid_key(key: object, max_bytes: int | None = None) -> bool:
    """The one rule for a pool key, wherever one is checked (every backend, the server's client,
    the engine): a non-empty str, of at most `max_bytes` UTF-8 bytes where a bound is given."""
    if not isinstance(key, str) or not key:
        return False
    # A str has at most 4 UTF-8 bytes per character: encode only keys that could be too long.
    return max_bytes is None or len(key) * 4 <= max_bytes or len(key.encode("utf-8", "surrogatepass")) <= max_bytes


def model_key_name(model: str) -> str:
    """A short, key-safe name for the model: its real path for local models, else its name."""
    if os.path.isdir(model):
        model = os.path.realpath(model)
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in model.strip("/"))
    if len(safe) > _MODEL_NAME_MAX:
        digest = hashlib.sha256(model.encode()).hexdigest()[:16]
        safe = safe[-(_MODEL_NAME_MAX - 17):] + "-" + digest
    return safe


@dataclasses.dataclass(frozen=True)
class KeyScheme:
    """Builds pool keys for one instance's parallel layout.

    `kv_shards` is the number of distinct KV-head slices across TP ranks: equal to the TP size
    when every rank holds different heads, smaller when ranks replicate heads (KV heads < TP, or
    MLA where all ranks hold the same latent cache). Ranks of one shard share a key and only the
    first of them writes it.
    """

    model: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    kv_shards: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    group: int = 0
    layers: int = 0  # layerwise: values per block (one per layer); 0: one value per block
    # share_across_tp: the model's KV heads, one value per head and block; 0: one value per shard.
    heads: int = 0

    def __post_init__(self) -> None:
        if self.tp_size % self.kv_shards:
            raise ValueError(f"tp_size={self.tp_size} is not a multiple of kv_shards={self.kv_shards}")
        if self.heads and self.heads % self.tp_size and self.tp_size % self.heads:
            raise ValueError(f"heads={self.heads} neither divides nor is divided by tp_size={self.tp_size}")

    @property
    def shard(self) -> int:
        return self.tp_rank // (self.tp_size // self.kv_shards)

    @property
    def head_range(self) -> range:
        """The KV heads this rank holds (per-head values only): its own slice, or, with fewer heads
        than ranks, the one head it shares with its neighbours."""
        if self.heads >= self.tp_size:
            per = self.heads // self.tp_size
            return range(self.tp_rank * per, (self.tp_rank + 1) * per)
        head = self.tp_rank * self.heads // self.tp_size
        return range(head, head + 1)

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes its keys (of ranks holding the same heads, the first does)."""
        if self.heads:
            return self.heads >= self.tp_size or self.tp_rank % (self.tp_size // self.heads) == 0
        return self.tp_rank % (self.tp_size // self.kv_shards) == 0

    @functools.cached_property
    def _prefixes(self) -> dict[tuple[int, int, str], str]:
        # Every key of a (shard, PP stage, tenant) starts alike: a lookup builds hundreds per prompt.
        return {}

    def _prefix(self, shard: int, pp_rank: int, tenant: str = "") -> str:
        prefix = self._prefixes.get((shard, pp_rank, tenant))
        if prefix is None:
            part = f"h{shard}/{self.heads}" if self.heads else f"tp{shard}/{self.kv_shards}"
            owner = f"{self.model}{TENANT_MARK}{tenant}" if tenant else self.model
            prefix = f"{owner}@{self.layout}@{part}@pp{pp_rank}/{self.pp_size}@g{self.group}@"
            self._prefixes[shard, pp_rank, tenant] = prefix
        return prefix

    def key(self, block_hash: bytes, shard: int | None = None, pp_rank: int | None = None,
            layer: int | None = None, tenant: str = "") -> str:
        """The key of one value: of `shard` (per-head values: of head `shard`), of `tenant`'s
        blocks (`tenant_tag`; "" for a request without a cache_salt)."""
        s = (self.shard if not self.heads else self.head_range.start) if shard is None else shard
        key = self._prefix(s, self.pp_rank if pp_rank is None else pp_rank, tenant) + block_hash.hex()
        return key if layer is None else f"{key}@l{layer}"

    def keys(self, block_hashes: Sequence[bytes], layer: int | None = None, tenant: str = "") -> list[str]:
        """This rank's keys for the given blocks (in layerwise mode, for one layer); per-head
        values: each block's heads in turn."""
        if (layer is None) != (self.layers == 0):
            raise ValueError(f"layer={layer} for a key scheme with layers={self.layers}")
        if self.heads:
            return [self.key(h, head, layer=layer, tenant=tenant) for h in block_hashes for head in self.head_range]
        return [self.key(h, layer=layer, tenant=tenant) for h in block_hashes]

    def _all_rank_parts(self, tenant: str) -> list[tuple[str, str]]:
        """What comes before and after the block hash in each of `all_rank_keys`."""
        parts = self._rank_parts.get(tenant)
        if parts is None:
            layers = [f"@l{layer}" for layer in range(self.layers)] if self.layers else [""]
            parts = self._rank_parts[tenant] = [(self._prefix(s, p, tenant), layer) for p in range(self.pp_size)
                                                for s in range(self.heads or self.kv_shards) for layer in layers]
        return parts

    @functools.cached_property
    def _rank_parts(self) -> dict[str, list[tuple[str, str]]]:
        return {}

    def all_rank_keys(self, block_hash: bytes, tenant: str = "") -> list[str]:
        """The keys of every shard (or head), PP stage (and layer) for one block: a block is a hit
        only if all exist."""
        h = block_hash.hex()
        return [prefix + h + layer for prefix, layer in self._all_rank_parts(tenant)]


def tenant_tag(cache_salt: str | None) -> str:
    """The tenant part of the keys of requests with this `cache_salt` (12 hex digits of its
    SHA-256, so a key never shows the salt); "" without one. The block hash already keeps
    tenants' blocks apart (vLLM folds the salt into it); the tag lets a pool tell whose a block
    is: per-tenant budgets, usage and clearing."""
    if not cache_salt:
        return ""
    return hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:TENANT_TAG_HEX]


def owner_of(key: str) -> tuple[str, str]:
    """(model, tenant tag) of a key of this format (tenant "" for a block without a salt); a key
    of another format is its own model."""
    at = key.find("@")
    model, _, tenant = (key if at < 0 else key[:at]).partition(TENANT_MARK)
    return model, tenant


def key_parts(key: str) -> tuple[str, str, str] | None:
    """A key of this format cut around its block hash: (what comes before it, the hash in hex,
    what comes after it), e.g. ``("m@fp@tp0/1@pp0/1@g0@", "ab12...", "@l3")``; None for a key of
    another format. Every key of one block is its parts' first and last around the same hash."""
    head, _, last = key.rpartition("@")
    suffix = ""
    if last[:1] == "l" and last[1:].isdigit():  # layerwise: @l{layer}
        suffix = "@" + last
        head, _, last = head.rpartition("@")
    group = head.rpartition("@")[2]
    if not head or group[:1] != "g" or not group[1:].isdigit() or not _HEX.fullmatch(last):
        return None
    return head + "@", last, suffix


def block_of(key: str) -> tuple[int, bytes] | None:
    """The KV cache group and block hash a key of this format names (any shard, stage or
    layer); None for a key of another format."""
    parts = key_parts(key)
    if parts is None:
        return None
    return int(parts[0].rsplit("@", 2)[1][1:]), bytes.fromhex(parts[1])


def prefill_stage_schemes(scheme: KeyScheme, num_layers: int, prefill_pp_size: int,
                          partition: Sequence[int]) -> list[tuple[KeyScheme, range]]:
    """Where a decode node without PP puts a block so that PP prefill stages find it.

    Each prefill stage reads only its own layers under its own `pp` key, so the decode node
    writes one value per stage: that stage's slice of the layers under that stage's key.
    `partition` gives the layers per stage (the caller takes vLLM's split when none is configured).
    """
    if len(partition) != prefill_pp_size or sum(partition) != num_layers:
        from kvpool.errors import ConfigError

        raise ConfigError(
            "prefill_pp_layer_partition", ",".join(map(str, partition)),
            f"layer counts that add up to the model's {num_layers} layers",
        )
    targets, start = [], 0
    for stage, count in enumerate(partition):
        targets.append((dataclasses.replace(scheme, pp_rank=stage, pp_size=prefill_pp_size),
                        range(start, start + count)))
        start += count
    return targets
