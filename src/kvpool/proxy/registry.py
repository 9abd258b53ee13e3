"""The proxy's instances: their load, their health, and which of them a request may go to.

No I/O and no locks: the proxy is one asyncio event loop and every method here runs to
completion without awaiting, so the state is consistent between any two awaits.

Selection (:meth:`Registry.pick`) among the instances of one role:

1. candidates: the healthy instances this request has not tried yet. A retry takes nothing
   else: an instance that just failed or timed out for this request is never tried again by
   it (a hung instance would otherwise cost the client one timeout per retry). For a first
   attempt only, when no instance is healthy, any of them (a last resort, so a request is
   not refused just because the health probe has not yet seen an instance come back);
2. the least loaded wins: fewest requests in flight, then fewest estimated tokens in flight,
   then the one picked least recently (round-robin among equals). PD-mixed instances are
   chosen among the same candidates by the routing policy instead (``choose``).

An instance that fails a request is marked down (out of rotation) until the background
health probe (``health.py``) or a later successful request sees it healthy.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from kvpool.proxy.config import Endpoint

logger = logging.getLogger("kvpool.proxy")


class Role(str, enum.Enum):
    """What an instance serves: the prefill or the decode of a PD pair, or whole requests."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # a PD-mixed (kv_both) instance: serves the whole request

    @classmethod
    def parse(cls, value: object) -> Role:
        aliases = {"prefill": cls.PREFILL, "prefiller": cls.PREFILL, "p": cls.PREFILL,
                   "decode": cls.DECODE, "decoder": cls.DECODE, "d": cls.DECODE,
                   "mixed": cls.MIXED, "instance": cls.MIXED, "m": cls.MIXED}
        role = aliases.get(str(value).strip().lower()) if isinstance(value, str) else None
        if role is None:
            raise ValueError(f'"type" must be "prefill", "decode" or "mixed", not {value!r}')
        return role


@dataclasses.dataclass(eq=False)
class Instance:
    """One vLLM instance behind the proxy: its health, its load, and what was sent to it."""

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
    probe_timeouts: int = 0  # health probes in a row that timed out (health.py)
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
            "probe_timeouts": self.probe_timeouts,
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


# Told when an instance may have lost its local prefix cache: "removed", or "up" after being
# down (it may have restarted empty). The router forgets what it recorded for it.
Listener = Callable[[Instance, str], None]


PD_ROLES = (Role.PREFILL, Role.DECODE)
MIXED_ROLES = (Role.MIXED,)


class Registry:
    """The instances of one proxy: prefill and decode ones (PD mode) or PD-mixed ones (mixed
    mode, when ``instances`` are given), never both."""

    def __init__(self, prefillers: Collection[Endpoint] = (), decoders: Collection[Endpoint] = (),
                 instances: Collection[Endpoint] = (), mixed: bool | None = None) -> None:
        self.roles = MIXED_ROLES if (bool(instances) if mixed is None else mixed) else PD_ROLES
        self._instances: dict[Role, dict[str, Instance]] = {role: {} for role in Role}
        self._seq = itertools.count(1)
        self.listeners: list[Listener] = []
        for ep in prefillers:
            self.add(Role.PREFILL, ep)
        for ep in decoders:
            self.add(Role.DECODE, ep)
        for ep in instances:
            self.add(Role.MIXED, ep)

    def _tell(self, inst: Instance, event: str) -> None:
        for listener in self.listeners:
            listener(inst, event)

    def instances(self, role: Role) -> list[Instance]:
        return list(self._instances[role].values())

    def all(self) -> list[Instance]:
        return [i for role in self.roles for i in self.instances(role)]

    def get(self, role: Role, endpoint: Endpoint) -> Instance | None:
        return self._instances[role].get(endpoint.key)

    def check_role(self, role: Role) -> None:
        """:class:`ValueError`, saying what to send instead, if this proxy's mode has no ``role``."""
        if role not in self.roles:
            mode = "PD-mixed (--instance-*)" if self.roles == MIXED_ROLES else "PD (--prefiller-*/--decoder-*)"
            raise ValueError(f'this proxy runs in {mode} mode and takes "type": '
                             f'{" or ".join(repr(r.value) for r in self.roles)}, not {role.value!r}')

    def add(self, role: Role, endpoint: Endpoint, healthy: bool = True,
            added_at_runtime: bool = False) -> Instance | None:
        """Add an instance; None if it is already there. :class:`ValueError` for a role this
        proxy's mode does not serve."""
        self.check_role(role)
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
            self._tell(inst, "removed")
        return inst

    def candidates(self, role: Role, exclude: Collection[Instance] = ()) -> list[Instance]:
        """The instances of ``role`` a request may go to now (rule 1 of the module docstring)."""
        pool = self.instances(role)
        candidates = [i for i in pool if i.healthy and i not in exclude]
        if not candidates and not exclude:
            candidates = pool
        return candidates

    def pick(self, role: Role, exclude: Collection[Instance] = (),
             choose: Callable[[list[Instance]], Instance] | None = None) -> Instance | None:
        """The least-loaded instance of ``role`` not in ``exclude`` (see the module docstring),
        or the one ``choose`` takes of those candidates.

        None if there is none: no instance at all, or (``exclude`` given: a retry) no healthy
        instance this request has not tried.
        """
        candidates = self.candidates(role, exclude)
        if not candidates:
            return None
        if choose is not None:
            best = choose(candidates)
            if best not in candidates:  # a policy must never send a request where it may not go
                raise RuntimeError(f"the routing policy chose {best!r}, not one of the candidates")
        else:
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
            self._tell(instance, "up")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role in self.roles:
            pool = self.instances(role)
            out[f"{role.value}_instances"] = len(pool)
            out[f"healthy_{role.value}_instances"] = sum(i.healthy for i in pool)
        return out

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {f"{role.value}_instances": [i.to_dict() for i in self.instances(role)] for role in self.roles}
