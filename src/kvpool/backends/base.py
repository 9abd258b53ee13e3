"""The protocol every backend implements.

Values are passed as lists of 1-D uint8 numpy views (one per layer segment of a block), so a
backend copies straight between vLLM's KV cache and its store with no intermediate buffer.
Every call is a batch and returns one Mooncake-compatible code per key: a failure of one key
never hides the others, and the caller turns failed keys into vLLM load errors.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np


Buffers = Sequence[np.ndarray]


class Backend(abc.ABC):
    """A pooled key -> bytes store reachable from a vLLM worker process."""

    name: str = "base"
    # Whether every process of an instance sees the same pool (needed for TP/PP > 1).
    shared_across_processes: bool = False

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str], lease: bool = False) -> list[bool]:
        """Which keys are stored. With `lease`, hits are protected from eviction for the lease TTL."""

    @abc.abstractmethod
    def batch_put(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        """Store each key's buffers back to back; an existing key is a successful no-op."""

    @abc.abstractmethod
    def batch_get_into(self, keys: Sequence[str], values: Sequence[Buffers]) -> list[int]:
        """Copy each key's bytes into its buffers (whose sizes must add up to the object's)."""

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release the backend's resources; flushes what its tiers promise to keep."""
