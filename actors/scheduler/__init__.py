"""Scheduling: the KV block pool with prefix caching (block_pool), per-sequence state
(request) and the continuous-batching scheduler (scheduler). Plain objects, no sockets."""

from actors.scheduler.block_pool import BlockPool
from actors.scheduler.scheduler import Scheduler

__all__ = ["BlockPool", "Scheduler"]
