"""The background health probe: ``GET /health`` on every instance, every ``--health-interval``.

vLLM's OpenAI server answers ``/health`` with 200 while its engine is alive. An instance that
answers 200 is (back) in rotation; one that refuses the connection or answers anything else is
out of it at once, so a dead instance stops receiving requests even before a request fails on
it, and one that comes back (or finishes starting) rejoins within one interval.

A probe that times out is different: a server that is alive but slow to answer (a long prefill
holding its cores, a host starved by its neighbours) would flap out of rotation and send all
traffic, and every prefix it caches, to the others. So an instance leaves on timeouts only after
``timeouts_allowed`` of them in a row; any answer resets the count. A request that fails on it
takes it out regardless (``forward.py``).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvpool.proxy.registry import Instance, Registry

logger = logging.getLogger("kvpool.proxy")


class HealthChecker:
    """Probes every registered instance each `interval` and marks it in or out of rotation
    (module docstring: refusals at once, timeouts after `timeouts_allowed` in a row)."""

    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval: float, timeout: float,
                 timeouts_allowed: int = 1) -> None:
        self.registry = registry
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.timeouts_allowed = timeouts_allowed

    async def probe(self, inst: Instance) -> bool:
        """Probe one instance and update its state; whether it is healthy."""
        try:
            resp = await self.client.get(f"{inst.base_url}/health", timeout=self.timeout)
        except httpx.TimeoutException as exc:
            inst.probe_timeouts += 1
            reason = (f"health probe timed out after {self.timeout:g} s ({type(exc).__name__}), "
                      f"{inst.probe_timeouts} time(s) in a row")
            if inst.healthy and inst.probe_timeouts < self.timeouts_allowed:
                logger.info("%s instance %s: %s; stays in rotation until %d in a row", inst.role.value,
                            inst.key, reason, self.timeouts_allowed)
                return True
        except httpx.HTTPError as exc:
            reason = f"health probe failed: {type(exc).__name__}: {exc}".rstrip(": ")
        else:
            inst.probe_timeouts = 0
            if resp.status_code == 200:
                logger.debug("health probe of %s: 200", inst.key)
                self.registry.mark_up(inst)
                return True
            reason = f"health probe answered HTTP {resp.status_code}"
        logger.debug("health probe of %s: %s", inst.key, reason)  # a change of state is logged louder
        if inst.healthy:
            self.registry.mark_down(inst, reason)
        else:
            inst.last_error = reason
        return False

    async def check_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in self.registry.all()))

    async def run(self) -> None:
        """Probe forever (until cancelled), one sweep per interval, starting at once."""
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the probing
                logger.exception("health sweep failed")
            await asyncio.sleep(self.interval)
