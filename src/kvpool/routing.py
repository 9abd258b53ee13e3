"""Request routing policies: which of several PD-mixed instances should serve a request.

Pure logic, no I/O and no clock: ``kvpool proxy`` asks a :class:`Router` once per request with
the candidates' current loads, and ``kvpool plan`` asks the same router while it replays a
trace, so a plan predicts the routing the proxy will do.

A request is described by its *prefix chain*: one hash per leading block, each hash covering
that block and every block before it (as the pool's keys do). Two requests share their first
``n`` chain hashes exactly when they share their first ``n`` blocks, so the length of the
leading run of a request's chain that an instance has seen estimates how many of its blocks
that instance still has in its local prefix cache.

Policies (``POLICIES`` is the list; everything else derives from it):

``round_robin``
    each candidate in turn, whatever the request.
``least_loaded``
    the candidate with the least load (requests in flight); ties go to the one chosen least
    recently, so equal instances rotate.
``prefix_aware``
    the candidate whose seen chains cover the longest leading run of this request's chain,
    among those within the load bound; no match (or no candidate within the bound has one)
    falls back to ``least_loaded``. A match counts when it reaches the end of a request the instance served
    (a conversation's next turn: the instance also holds the answer, which no request showed
    the router), or else covers at least ``min_match`` (0.3) of the request's chain: a system
    prompt every request starts with matches everywhere it has been, and following it would
    pile every new conversation onto one instance. The bound is that of consistent hashing with bounded
    loads: a candidate may take the request only while its load is below
    ``ceil(load_factor * (total_load + 1) / candidates)``, so one hot prefix can never pin one
    instance while the others sit idle (with ``load_factor`` 1.25 and two instances, the
    favoured one may run at most about 1.25 times its fair share).

Invariants:

* :meth:`Router.choose` always returns one of the candidates it was given (never an instance
  it was not offered: candidates are the caller's healthy, untried instances);
* the chosen instance records the request's chain, so the next request with that prefix finds
  it there; each instance remembers at most ``capacity_blocks`` chain hashes, least recently
  used first out, approximating an instance's own bounded prefix cache;
* with one candidate every policy chooses it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence

import numpy as np
import xxhash

POLICIES = ("round_robin", "least_loaded", "prefix_aware")

# Why a candidate was chosen (the proxy counts decisions by these).
REASONS = ("round_robin", "least_loaded", "prefix_match", "load_bound")


@dataclasses.dataclass(frozen=True)
class Decision:
    """The chosen candidate, why, and how many leading blocks it is expected to hold already."""

    instance: Hashable
    reason: str
    matched_blocks: int = 0


def token_chain(tokens: Sequence[int] | np.ndarray, block_size: int, max_blocks: int = 64) -> list[int]:
    """Chain hashes of the whole ``block_size``-token blocks at the start of ``tokens``.

    Only whole blocks count (a partial block is never cached by vLLM or the pool), and at most
    ``max_blocks`` of them: a route is decided by the leading blocks, and hashing a 100K-token
    prompt in full would cost the proxy more than the decision is worth.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size!r} is invalid: expected a positive int of tokens")
    arr = np.asarray(tokens, dtype=np.int64)
    blocks = min(len(arr) // block_size, max_blocks)
    return _chain(arr[i * block_size:(i + 1) * block_size].tobytes() for i in range(blocks))


def text_chain(text: str, block_chars: int, max_blocks: int = 64) -> list[int]:
    """Chain hashes of the whole ``block_chars``-character blocks at the start of ``text``.

    For prompts sent as text, which the proxy does not tokenize: equal leading text is equal
    leading tokens, so equal text blocks are as good a signal as equal token blocks.
    """
    if block_chars <= 0:
        raise ValueError(f"block_chars={block_chars!r} is invalid: expected a positive int of characters")
    blocks = min(len(text) // block_chars, max_blocks)
    return _chain(text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
                  for i in range(blocks))


def id_chain(block_ids: Sequence[int]) -> list[int]:
    """Chain hashes of blocks that already have ids (a trace's ``hash_ids``): equal ids, equal blocks."""
    return _chain(int(b).to_bytes(8, "little", signed=True) for b in block_ids)


def _chain(blocks: collections.abc.Iterable[bytes]) -> list[int]:
    out: list[int] = []
    prev = 0
    for data in blocks:
        prev = xxhash.xxh3_64_intdigest(data, seed=prev)
        out.append(prev)
    return out


class Router:
    """One routing policy over a changing set of instances (see the module docstring).

    Not thread-safe: the proxy runs on one event loop and calls it between awaits.
    """

    def __init__(self, policy: str, capacity_blocks: int = 100_000, load_factor: float = 1.25,
                 min_match: float = 0.3) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: expected one of {', '.join(POLICIES)}")
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks={capacity_blocks!r} is invalid: expected a positive int")
        if not isinstance(load_factor, (int, float)) or isinstance(load_factor, bool) or load_factor < 1:
            raise ValueError(f"load_factor={load_factor!r} is invalid: expected a number >= 1, e.g. 1.25")
        if not isinstance(min_match, (int, float)) or isinstance(min_match, bool) or not 0 <= min_match <= 1:
            raise ValueError(f"min_match={min_match!r} is invalid: expected a share in [0, 1], e.g. 0.5")
        self.policy = policy
        self.min_match = float(min_match)
        self.capacity_blocks = capacity_blocks
        self.load_factor = float(load_factor)
        # instance -> chain hash -> whether a recorded request ended there; least recent first.
        self._seen: dict[Hashable, collections.OrderedDict[int, bool]] = {}
        self._last_chosen: dict[Hashable, int] = {}
        self._turn = itertools.count(1)
        self._rr = 0

    def choose(self, candidates: Sequence[Hashable], loads: Sequence[int], chain: Sequence[int] = ()) -> Decision:
        """Pick one of ``candidates`` (``loads[i]`` is the load of ``candidates[i]``) for a request
        whose prefix chain is ``chain``, and record the chain on the chosen one."""
        if not candidates:
            raise ValueError("choose() needs at least one candidate")
        if len(loads) != len(candidates):
            raise ValueError(f"{len(loads)} loads for {len(candidates)} candidates")
        if self.policy == "round_robin":
            pick, reason, matched = candidates[self._rr % len(candidates)], "round_robin", 0
            self._rr += 1
        elif self.policy == "least_loaded":
            pick, reason, matched = self._least_loaded(candidates, loads), "least_loaded", 0
        else:
            pick, reason, matched = self._prefix_aware(candidates, loads, chain)
        self._last_chosen[pick] = next(self._turn)
        self._record(pick, chain)
        return Decision(pick, reason, matched)

    def matched(self, instance: Hashable, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` ``instance`` has seen (without touching its LRU)."""
        seen = self._seen.get(instance)
        if not seen:
            return 0
        n = 0
        for h in chain:
            if h not in seen:
                break
            n += 1
        return n

    def forget(self, instance: Hashable) -> None:
        """Drop what ``instance`` was recorded to hold (it was removed, or restarted empty)."""
        self._seen.pop(instance, None)
        self._last_chosen.pop(instance, None)

    def _least_loaded(self, candidates: Sequence[Hashable], loads: Sequence[int]) -> Hashable:
        best = min(range(len(candidates)), key=lambda i: (loads[i], self._last_chosen.get(candidates[i], 0)))
        return candidates[best]

    def _prefix_aware(self, candidates: Sequence[Hashable], loads: Sequence[int],
                      chain: Sequence[int]) -> tuple[Hashable, str, int]:
        bound = math.ceil(self.load_factor * (sum(loads) + 1) / len(candidates))
        best_i, best_n, capped_n = -1, 0, 0
        for i, inst in enumerate(candidates):
            n = self.matched(inst, chain)
            if n == 0 or (n < self.min_match * len(chain) and not self._seen[inst][chain[n - 1]]):
                continue
            if loads[i] >= bound:
                capped_n = max(capped_n, n)
            elif n > best_n or (n == best_n and loads[i] < loads[best_i]):
                best_i, best_n = i, n
        if best_i >= 0:
            return candidates[best_i], "prefix_match", best_n
        pick = self._least_loaded(candidates, loads)
        return pick, ("load_bound" if capped_n else "least_loaded"), self.matched(pick, chain)

    def _record(self, instance: Hashable, chain: Sequence[int]) -> None:
        if not chain:
            return
        seen = self._seen.setdefault(instance, collections.OrderedDict())
        last = chain[-1]
        for h in chain:
            seen[h] = seen.get(h, False) or h == last
            seen.move_to_end(h)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)
