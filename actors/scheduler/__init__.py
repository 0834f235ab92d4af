"""Scheduling: the KV block pool with prefix caching (block_pool), the block tables of
sequences over it (kv_cache_manager), per-sequence state (request) and the
continuous-batching scheduler (scheduler). Plain objects, no sockets."""

from actors.scheduler.block_pool import BlockPool
from actors.scheduler.kv_cache_manager import KVCacheManager
from actors.scheduler.scheduler import Scheduler

__all__ = ["BlockPool", "KVCacheManager", "Scheduler"]
