"""The background health probe: ``GET /health`` on every instance, every ``--health-interval``.

vLLM's OpenAI server answers ``/health`` with 200 while its engine is alive. An instance that
answers 200 is (back) in rotation; one that refuses the connection, times out or answers
anything else is out of it, so a dead instance stops receiving requests even before a request
fails on it, and one that comes back (or finishes starting) rejoins within one interval.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvpool.proxy.registry import Instance, Registry

logger = logging.getLogger("kvpool.proxy")


class HealthChecker:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        self.registry = registry
        self.client = client
        self.interval = interval
        self.timeout = timeout

    async def probe(self, inst: Instance) -> bool:
        """Probe one instance and update its state; whether it is healthy."""
        try:
            resp = await self.client.get(f"{inst.base_url}/health", timeout=self.timeout)
        except httpx.HTTPError as exc:
            reason = f"health probe failed: {type(exc).__name__}: {exc}".rstrip(": ")
        else:
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
