"""The operator's controller for a host pool: what it holds for a prompt, per model, and how to
pin, unpin and clear it (served over HTTP by `server/metrics.py` behind the admin token; the
`kvpool ctl` command is its client; docs/control.md has the API).

The controller speaks in models and block hashes, the two things an operator can name: a model
is the first part of its keys (`kvpool.keys.model_key_name`: a model directory's real path made
key-safe, or the served name), a prompt is its chain of vLLM block hashes (`kvpool ctl` computes
them from text or token ids the way vLLM does). One block of one model is many keys (a key per
KV-cache group, TP shard or KV head, PP stage and, layerwise, layer; `kvpool.keys`); which ones
the pool has seen of a model is read from the keys it holds, so the controller needs no
registration and works for any instance layout.

Every call reads a snapshot of the pool's keys, O(objects): an operator's tool, not a data path.
Each call that changes state is logged at INFO and counted (`kvpool_controller_calls`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import msgspec

from kvpool.errors import ErrorCode
from kvpool.config import Tenant
from kvpool.keys import TENANT_MARK, key_parts, owner_of, tenant_tag
from kvpool.metrics.catalog import CONTROL_OPS
from kvpool.store.controls import MAX_PIN_S, Contents
from kvpool.store.engine import PoolEngine

logger = logging.getLogger(__name__)

MAX_HASHES = 1 << 16  # block hashes per call: a 1M-token prompt at 16-token blocks
_Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{2,128}$")]
_Model = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern="^[^@~]+$")]
_Salt = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Blocks(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt of one model: its block hashes in order (lowercase hex), and the cache_salt its
    requests carry, if any (its blocks are that tenant's)."""

    model: _Model
    block_hashes: Annotated[list[_Hex], msgspec.Meta(min_length=1, max_length=MAX_HASHES)]
    cache_salt: _Salt | None = None


class Pin(Blocks, forbid_unknown_fields=True, kw_only=True):
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_PIN_S)]


class Clear(msgspec.Struct, forbid_unknown_fields=True):
    """What to remove, one of: a model's keys, a tenant's (by its cache_salt, or its name in the
    server's tenants file), or (``all``) every key."""

    model: _Model | None = None
    cache_salt: _Salt | None = None
    tenant: _Name | None = None
    all: bool = False


# The calls (the metrics catalog's list, whose counters they feed), by route name: the body
# each reads (None: a GET without one).
_BODIES: dict[str, type[msgspec.Struct]] = {"lookup": Blocks, "pin": Pin, "unpin": Blocks, "clear": Clear}
REQUESTS: dict[str, type[msgspec.Struct] | None] = {op: _BODIES.get(op) for op in CONTROL_OPS}
CHANGES_STATE = ("pin", "unpin", "clear")


class RequestError(ValueError):
    """A call's body is not what the route reads (an HTTP 400 with this message)."""


@dataclasses.dataclass
class _Family:
    """The keys of one (model, layout, KV-cache group): each block's keys are ``prefix + hash +
    suffix`` for every (prefix, suffix) seen."""

    parts: set[tuple[str, str]] = dataclasses.field(default_factory=set)

    @functools.cached_property
    def _ordered(self) -> list[tuple[str, str]]:  # read once every part was added
        return sorted(self.parts)

    def keys(self, hex_hash: str) -> list[str]:
        return [prefix + hex_hash + suffix for prefix, suffix in self._ordered]


def _families(keys: Iterable[str], model: str, tenant: str) -> dict[tuple[str, str], _Family]:
    """The (layout, group) families of ``model``'s blocks of ``tenant`` (a tag; "": no salt)
    among ``keys``."""
    # One cut per key (a million keys take about a second), the full parse once per family.
    start = f"{model}{TENANT_MARK}{tenant}@" if tenant else model + "@"
    found: dict[tuple[str, str], str] = {}
    for key in keys:
        if not key.startswith(start):
            continue
        head, _, last = key.rpartition("@")
        if last[:1] == "l" and last[1:].isdigit():  # layerwise: the hash is one further
            found.setdefault((head.rpartition("@")[0], last), key)
        else:
            found.setdefault((head, ""), key)
    out: dict[tuple[str, str], _Family] = collections.defaultdict(_Family)
    for key in found.values():
        parts = key_parts(key)
        if parts is None:
            continue
        prefix, _, suffix = parts
        fields = prefix.split("@")  # model, layout, shard, stage, group, ""
        out[fields[1], fields[-2]].parts.add((prefix, suffix))
    return out


def _leading(flags: list[bool]) -> int:
    """How many of ``flags`` are true before the first false."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


class Controller:
    """The controller's calls over one engine; ``call(name, body)`` answers a route."""

    def __init__(self, engine: PoolEngine, tenants: Sequence[Tenant] = ()) -> None:
        self._engine = engine
        self.tenants = {t.tag: t for t in tenants}
        self._by_name = {t.name: t for t in tenants}
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(REQUESTS, 0)
        self.refused = 0  # calls without the right token

    def stats(self) -> dict[str, int]:
        """The controller's counters, as the server's stats entries `control_<call>`."""
        with self._lock:
            out = {f"control_{name}": n for name, n in self.counts.items()}
            out["control_refused"] = self.refused
        out["pinned_objects"] = self._engine.controls.pinned_count()
        return out

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """Per tenant of the tenants file, by name: (memory bytes it takes, its budget)."""
        return {self._name(tag): usage for tag, usage in self._engine.controls.tenant_usage().items()}

    def note_refused(self) -> None:
        with self._lock:
            self.refused += 1

    def call(self, name: str, body: bytes) -> dict[str, Any]:
        """Answer route ``name`` with its JSON ``body``; RequestError for a body it cannot read,
        KeyError for an unknown route."""
        kind = REQUESTS[name]
        request = None
        if kind is not None:
            try:
                request = msgspec.json.decode(body or b"{}", type=kind)
            except msgspec.DecodeError as exc:
                raise RequestError(f"{name}: {exc}; see docs/control.md for the body it reads") from None
        answer = getattr(self, "_" + name)(request)
        with self._lock:
            self.counts[name] += 1
        if name in CHANGES_STATE:
            shown = msgspec.to_builtins(request)
            if shown.get("cache_salt") is not None:
                shown["cache_salt"] = "(hidden)"  # a tenant's secret: the log names its tag
                shown["tenant"] = self._name(tenant_tag(request.cache_salt))
            logger.info("controller %s %s: %s", name, json.dumps(shown)[:300], answer)
        return answer

    # ---- the calls ---------------------------------------------------------------------------

    def _usage(self, _: None) -> dict[str, Any]:
        contents = self._engine.controls.contents()
        zero = dict(memory_objects=0, memory_bytes=0, ssd_objects=0, ssd_bytes=0, pinned_objects=0)
        models: dict[str, dict[str, int]] = {}
        tenants: dict[str, dict[str, int]] = {}
        for tier, held in (("memory", contents.memory), ("ssd", contents.ssd), ("pinned", contents.pinned)):
            for key, size in held.items():
                model, tag = owner_of(key)
                for usage in (models.setdefault(model, dict(zero)), tenants.setdefault(self._name(tag), dict(zero))):
                    usage[f"{tier}_objects"] += 1
                    if tier != "pinned":
                        usage[f"{tier}_bytes"] += size
        for tag, (used, budget) in self._engine.controls.tenant_usage().items():
            usage = tenants.setdefault(self._name(tag), dict(zero))
            usage.update(budget_bytes=budget, budget_used_bytes=used)
        total = {field: sum(m[field] for m in models.values()) for field in zero}
        return {"models": dict(sorted(models.items())), "tenants": dict(sorted(tenants.items())), "total": total}

    def _name(self, tag: str) -> str:
        """How usage names a tenant: its name in the tenants file, "tag:<tag>" for a salt the
        file does not name, "" for requests without one."""
        tenant = self.tenants.get(tag)
        return tenant.name if tenant is not None else (f"tag:{tag}" if tag else "")

    def _lookup(self, request: Blocks) -> dict[str, Any]:
        contents = self._engine.controls.contents()
        families = _families([*contents.memory, *contents.ssd], request.model, tenant_tag(request.cache_salt))
        layouts: dict[str, dict[str, Any]] = {}
        for (layout, group), family in sorted(families.items()):
            tiers: dict[str, list[bool]] = {"memory": [], "ssd": [], "pool": [], "pinned": []}
            for hex_hash in request.block_hashes:
                keys = family.keys(hex_hash)
                tiers["memory"].append(all(k in contents.memory for k in keys))
                tiers["ssd"].append(all(k in contents.ssd for k in keys))
                tiers["pool"].append(all(k in contents.memory or k in contents.ssd for k in keys))
                tiers["pinned"].append(all(k in contents.pinned for k in keys))
            entry = {tier: _leading(tiers[tier]) for tier in ("memory", "ssd", "pool")}
            entry["present"], entry["pinned"] = sum(tiers["pool"]), sum(tiers["pinned"])
            layouts.setdefault(layout, {"groups": {}})["groups"][group] = entry
        for entry in layouts.values():
            entry["hit_blocks"] = min(g["pool"] for g in entry["groups"].values())
        return {"model": request.model, "blocks": len(request.block_hashes), "layouts": layouts,
                "hit_blocks": max((e["hit_blocks"] for e in layouts.values()), default=0)}

    def _block_keys(self, request: Blocks, contents: Contents) -> list[str]:
        families = _families([*contents.memory, *contents.ssd], request.model, tenant_tag(request.cache_salt)).values()
        return [k for h in request.block_hashes for f in families for k in f.keys(h)]

    def _pin(self, request: Pin) -> dict[str, int]:
        keys = self._block_keys(request, self._engine.controls.contents())
        codes = self._engine.controls.pin(keys, request.ttl_s)
        return _tally(codes, {ErrorCode.OK: "pinned", ErrorCode.OBJECT_NOT_FOUND: "absent",
                              ErrorCode.NO_AVAILABLE_HANDLE: "over_pin_share"})

    def _unpin(self, request: Blocks) -> dict[str, int]:
        keys = self._block_keys(request, self._engine.controls.contents())
        codes = self._engine.controls.unpin(keys)
        return _tally(codes, {ErrorCode.OK: "unpinned", ErrorCode.OBJECT_NOT_FOUND: "not_pinned"})

    def _clear(self, request: Clear) -> dict[str, int]:
        chosen = [request.model is not None, request.cache_salt is not None, request.tenant is not None, request.all]
        if sum(chosen) != 1:
            raise RequestError('clear: give one of "model" (a model\'s keys), "cache_salt" or "tenant" (a '
                               'tenant\'s, by its salt or its name in the tenants file) or "all": true')
        if request.tenant is not None and request.tenant not in self._by_name:
            raise RequestError(f"clear: no tenant {request.tenant!r} in the server's tenants file (it has "
                               f"{', '.join(sorted(self._by_name)) or 'none'})")
        tag = tenant_tag(request.cache_salt) if request.cache_salt is not None else (
            self._by_name[request.tenant].tag if request.tenant is not None else None)
        contents = self._engine.controls.contents()

        def chosen_key(key: str) -> bool:
            model, owner = owner_of(key)
            return request.all or model == request.model or (tag is not None and owner == tag)

        keys = [k for k in dict.fromkeys([*contents.memory, *contents.ssd]) if chosen_key(k)]
        self._engine.controls.unpin([k for k in keys if k in contents.pinned])
        codes = [self._engine.remove(k) for k in keys]
        # A key a reader holds right now stays (its lease ends in a moment): "busy" says how many.
        return _tally(codes, {ErrorCode.OK: "removed", ErrorCode.OBJECT_NOT_FOUND: "removed",
                              ErrorCode.OBJECT_HAS_LEASE: "busy"})


def _tally(codes: Iterable[ErrorCode], names: dict[ErrorCode, str]) -> dict[str, int]:
    out = dict.fromkeys(names.values(), 0)
    out["failed"] = 0
    for code in codes:
        out[names.get(code, "failed")] += 1
    return out
