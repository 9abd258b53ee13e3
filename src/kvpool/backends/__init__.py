"""Storage backends: one protocol (`base.Backend`), one adapter per store."""

from kvpool.backends.base import Backend
from kvpool.backends.registry import create_backend

__all__ = ["Backend", "create_backend"]
