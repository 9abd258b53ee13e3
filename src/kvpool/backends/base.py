"""The protocol every backend implements, and the factory that picks one from the config.

Values are passed as lists of 1-D uint8 numpy views (one per layer segment of a block), so a
backend copies straight between vLLM's KV cache and its store with no intermediate buffer.
Every call is a batch and returns one Mooncake-compatible code per key: a failure of one key
never hides the others, and the caller turns failed keys into vLLM load errors.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from kvpool.config import KVPoolConfig
from kvpool.errors import ConfigError

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


def create_backend(config: KVPoolConfig, client_name: str) -> Backend:
    """Build the backend named by `config.backend`."""
    if config.backend == "local":
        from kvpool.backends.local import LocalBackend

        return LocalBackend(config.local, client_name)
    if config.backend == "server":
        from kvpool.backends.pool_server import ServerBackend

        return ServerBackend(config.server_socket, client_name)
    # The distributed stores: each module imports its client library only when built, and
    # raises ConfigError naming the pip package when it is missing.
    if config.backend == "redis":
        from kvpool.backends.redis import RedisBackend

        return RedisBackend(config.redis, client_name)
    if config.backend == "mooncake":
        from kvpool.backends.mooncake import MooncakeBackend

        return MooncakeBackend.from_config(config, client_name)
    if config.backend == "yuanrong":
        from kvpool.backends.yuanrong import YuanrongBackend

        return YuanrongBackend.from_config(config, client_name)
    if config.backend == "memcache":
        from kvpool.backends.memcache import MemcacheBackend

        return MemcacheBackend.from_config(config, client_name)
    raise ConfigError(
        "backend", config.backend, "a backend this kvpool release ships: local, server, mooncake, yuanrong, memcache, redis"
    )
