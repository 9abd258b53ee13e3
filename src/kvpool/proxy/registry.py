"""The proxy's instances: their load, their health, and least-loaded selection.

No I/O and no locks: the proxy is one asyncio event loop and every method here runs to
completion without awaiting, so the state is consistent between any two awaits.

Selection (:meth:`Registry.pick`) among the instances of one role:

1. candidates: the healthy instances this request has not tried yet. A retry takes nothing
   else: an instance that just failed or timed out for this request is never tried again by
   it (a hung instance would otherwise cost the client one timeout per retry). For a first
   attempt only, when no instance is healthy, any of them (a last resort, so a request is
   not refused just because the health probe has not yet seen an instance come back);
2. the least loaded wins: fewest requests in flight, then fewest estimated tokens in flight,
   then the one picked least recently (round-robin among equals).

An instance that fails a request is marked down (out of rotation) until the background
health probe (``health.py``) or a later successful request sees it healthy.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from collections.abc import Collection
from typing import Any

from kvpool.proxy.config import Endpoint

logger = logging.getLogger("kvpool.proxy")


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: object) -> Role:
        aliases = {"prefill": cls.PREFILL, "prefiller": cls.PREFILL, "p": cls.PREFILL,
                   "decode": cls.DECODE, "decoder": cls.DECODE, "d": cls.DECODE}
        role = aliases.get(str(value).strip().lower()) if isinstance(value, str) else None
        if role is None:
            raise ValueError(f'"type" must be "prefill" or "decode", not {value!r}')
        return role


@dataclasses.dataclass(eq=False)
class Instance:
    role: Role
    endpoint: Endpoint
    healthy: bool = True
    in_flight: int = 0
    token_load: int = 0
    last_pick: int = 0  # sequence number of the last time it was picked; 0 = never
    requests: int = 0  # attempts sent to it, in total
    failures: int = 0  # attempts that failed (connection error, timeout, 5xx)
    last_error: str | None = None
    down_since: float | None = None
    # Added with POST /instances/add rather than given on the command line: such an instance
    # gets the client's Authorization header only with --forward-authorization all.
    added_at_runtime: bool = False

    @property
    def key(self) -> str:
        return self.endpoint.key

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.role.value,
            "host": self.endpoint.host,
            "port": self.endpoint.port,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "token_load": self.token_load,
            "requests": self.requests,
            "failures": self.failures,
            "last_error": self.last_error,
            "added_at_runtime": self.added_at_runtime,
        }


class Lease:
    """One request's share of an instance's load; :meth:`release` (idempotent) gives it back."""

    def __init__(self, instance: Instance, tokens: int) -> None:
        self.instance = instance
        self.tokens = tokens
        self._held = True
        instance.in_flight += 1
        instance.token_load += tokens
        instance.requests += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.instance.in_flight -= 1
            self.instance.token_load -= self.tokens


class Registry:
    def __init__(self, prefillers: Collection[Endpoint] = (), decoders: Collection[Endpoint] = ()) -> None:
        self._instances: dict[Role, dict[str, Instance]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._seq = itertools.count(1)
        for ep in prefillers:
            self.add(Role.PREFILL, ep)
        for ep in decoders:
            self.add(Role.DECODE, ep)

    def instances(self, role: Role) -> list[Instance]:
        return list(self._instances[role].values())

    def all(self) -> list[Instance]:
        return self.instances(Role.PREFILL) + self.instances(Role.DECODE)

    def get(self, role: Role, endpoint: Endpoint) -> Instance | None:
        return self._instances[role].get(endpoint.key)

    def add(self, role: Role, endpoint: Endpoint, healthy: bool = True,
            added_at_runtime: bool = False) -> Instance | None:
        """Add an instance; None if it is already there."""
        if endpoint.key in self._instances[role]:
            return None
        inst = Instance(role, endpoint, healthy=healthy, added_at_runtime=added_at_runtime)
        if not healthy:
            inst.down_since = time.monotonic()
            inst.last_error = "added; waiting for its first successful health probe"
        self._instances[role][endpoint.key] = inst
        logger.info("added %s instance %s%s", role.value, endpoint.key, "" if healthy else " (not healthy yet)")
        return inst

    def remove(self, role: Role, endpoint: Endpoint) -> Instance | None:
        """Take an instance out for good (requests in flight on it finish); None if absent."""
        inst = self._instances[role].pop(endpoint.key, None)
        if inst is not None:
            logger.info("removed %s instance %s", role.value, endpoint.key)
        return inst

    def pick(self, role: Role, exclude: Collection[Instance] = ()) -> Instance | None:
        """The least-loaded instance of ``role`` not in ``exclude`` (see the module docstring).

        None if there is none: no instance at all, or (``exclude`` given: a retry) no healthy
        instance this request has not tried.
        """
        pool = self.instances(role)
        candidates = [i for i in pool if i.healthy and i not in exclude]
        if not candidates and not exclude:
            candidates = pool
        if not candidates:
            return None
        best = min(candidates, key=lambda i: (i.in_flight, i.token_load, i.last_pick))
        best.last_pick = next(self._seq)
        return best

    def lease(self, instance: Instance, tokens: int = 0) -> Lease:
        return Lease(instance, max(0, tokens))

    def mark_down(self, instance: Instance, reason: str) -> None:
        instance.failures += 1
        instance.last_error = reason
        if instance.healthy:
            instance.healthy = False
            instance.down_since = time.monotonic()
            logger.warning("%s instance %s taken out of rotation: %s", instance.role.value, instance.key, reason)

    def mark_up(self, instance: Instance) -> None:
        if not instance.healthy:
            instance.healthy = True
            instance.down_since = None
            logger.info("%s instance %s back in rotation", instance.role.value, instance.key)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role in Role:
            pool = self.instances(role)
            out[f"{role.value}_instances"] = len(pool)
            out[f"healthy_{role.value}_instances"] = sum(i.healthy for i in pool)
        return out

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {f"{role.value}_instances": [i.to_dict() for i in self.instances(role)] for role in Role}
