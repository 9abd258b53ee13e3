"""The pool engine: offset allocator, SSD tier and Mooncake-master semantics.

Plain Python + numpy on purpose: the same code runs in-process (``local``
backend) and inside the host-shared daemon, neither of which may import vLLM or
torch. One copy kernel (``streamcopy``) is compiled by llvmlite where it is
installed; without it the copies are numpy's.
"""

from kvpool.store.allocator import OffsetAllocator
from kvpool.store.disk import DiskPolicy, DiskTier
from kvpool.store.engine import PoolEngine
from kvpool.store.engine_config import EngineConfig
from kvpool.store.records import Allocation, Lease, LookupLease, ReapReport

__all__ = [
    "Allocation",
    "DiskPolicy",
    "DiskTier",
    "EngineConfig",
    "Lease",
    "LookupLease",
    "OffsetAllocator",
    "PoolEngine",
    "ReapReport",
]
