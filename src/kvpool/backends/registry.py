"""Every backend, declared once: name, config schema, factory, doctor check, capabilities."""

from __future__ import annotations

from kvpool.backends.base import Backend
from kvpool.config import KVPoolConfig
from kvpool.errors import ConfigError


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
