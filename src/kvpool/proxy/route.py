"""Routing PD-mixed requests: the policy's choice among the candidates, and what came of it.

:class:`MixedRouter` asks a :class:`kvpool.routing.Router` (the policies are written there, once,
and shared with the planner) which candidate takes a request, with each candidate's requests in
flight as its load, and counts every decision and its outcome. It forgets an instance's
recorded prefixes when the registry says the instance was removed or came back up after being
down: it may have restarted with an empty prefix cache.

Counters (:data:`COUNTERS`; ``GET /routing`` shows them in total, per reason of
:data:`kvpool.routing.REASONS` and per instance):

``decisions``
    routing decisions, one per attempt (a retry on another instance is a decision too);
``answered``
    decisions whose instance answered 200;
``reported``
    answered with ``usage.prompt_tokens_details.cached_tokens`` (vLLM reports it with
    ``--enable-prompt-tokens-details``; a stream only with ``stream_options.include_usage``);
``hits``
    reported with cached tokens > 0: the instance reused a prefix (its own prefix cache or
    the pool: vLLM reports the two together);
``predicted_hits``
    reported where the policy expected a match (matched blocks > 0);
``predicted_and_hit``
    both: the prediction came true;
``matched_blocks``
    the predicted matched blocks of the reported decisions, summed;
``predicted_tokens``
    the same for token-id prompts, in tokens (matched blocks x ``--routing-block-size``), to
    set against ``cached_tokens`` of those prompts: ``cached_tokens_of_token_prompts``;
``cached_tokens``, ``prompt_tokens``
    the instances' own counts, summed over the reported decisions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvpool.proxy.config import ProxyConfig
from kvpool.proxy.registry import Instance, Registry
from kvpool.routing import REASONS, Decision, Router

COUNTERS = ("decisions", "answered", "reported", "hits", "predicted_hits", "predicted_and_hit",
            "matched_blocks", "predicted_tokens", "cached_tokens_of_token_prompts", "cached_tokens",
            "prompt_tokens")


def _zero() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


@dataclasses.dataclass
class Routed:
    """One decision, kept until its outcome is known."""

    instance: Instance
    decision: Decision
    kind: str  # the chain's kind (kvpool.proxy.prefix.KINDS)
    settled: bool = False


class MixedRouter:
    """Picks the PD-mixed instance for each request with the configured policy and counts each
    decision and its outcome (module docstring)."""

    def __init__(self, registry: Registry, config: ProxyConfig) -> None:
        self.config = config
        self.router = Router(config.routing_policy, capacity_blocks=config.routing_capacity_blocks,
                             load_factor=config.routing_load_factor)
        self.total = _zero()
        self.by_reason = {r: _zero() for r in REASONS}
        self.by_instance: dict[str, dict[str, int]] = {}
        self.forgotten = 0  # times an instance's prefixes were dropped (removed, or back up)
        registry.listeners.append(self._on_change)

    def _on_change(self, inst: Instance, event: str) -> None:
        self.router.forget(inst.key)
        self.forgotten += 1

    def choose(self, candidates: list[Instance], chain: list[int], kind: str) -> Routed:
        """The policy's choice of ``candidates`` for a request with this chain, counted."""
        decision = self.router.choose([i.key for i in candidates], [i.in_flight for i in candidates], chain)
        inst = next(i for i in candidates if i.key == decision.instance)
        for counters in self._targets(inst.key, decision.reason):
            counters["decisions"] += 1
        return Routed(inst, decision, kind)

    def settle(self, routed: Routed, answered: bool, usage: Any = None) -> None:
        """Count the outcome of a decision once: ``usage`` is the answer's usage record, if any."""
        if routed.settled:
            return
        routed.settled = True
        if not answered:
            return
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        reported = isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        matched = routed.decision.matched_blocks
        for c in self._targets(routed.instance.key, routed.decision.reason):
            c["answered"] += 1
            if not reported:
                continue
            c["reported"] += 1
            c["hits"] += cached > 0
            c["predicted_hits"] += matched > 0
            c["predicted_and_hit"] += matched > 0 and cached > 0
            c["matched_blocks"] += matched
            c["cached_tokens"] += cached
            if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
                c["prompt_tokens"] += prompt
            if routed.kind == "tokens":
                c["predicted_tokens"] += matched * self.config.routing_block_size
                c["cached_tokens_of_token_prompts"] += cached

    def _targets(self, key: str, reason: str) -> tuple[dict[str, int], ...]:
        inst = self.by_instance.setdefault(key, _zero())
        return self.total, self.by_reason[reason], inst

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /routing`` answers."""
        return {
            "policy": self.router.policy,
            "block_size": self.config.routing_block_size,
            "block_chars": self.config.routing_block_chars,
            "load_factor": self.router.load_factor,
            "capacity_blocks": self.router.capacity_blocks,
            "forgotten": self.forgotten,
            "total": dict(self.total),
            "by_reason": {r: dict(c) for r, c in self.by_reason.items()},
            "by_instance": {k: dict(c) for k, c in self.by_instance.items()},
        }
