"""AsyncClient's engine operations (vLLM's names): sleep(level), wake_up(tags),
is_sleeping(), reset_prefix_cache(). Each is one EngineControl query to the scheduler
(actors/scheduler/control.py), answered under its query id like get_stats()."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from messages.control import EngineControl, check_wake_tags

# sleeping waits for the plans in flight and for every worker to free its memory
_CONTROL_TIMEOUT_S = 300.0


class EngineControlMixin:
    """Mixed into AsyncClient (actors/frontend/client.py), whose query plumbing it uses."""

    async def _query(self, build: Callable[[int], Any], timeout: float) -> dict:
        """Sends the scheduler build(query_id) and waits (bounded) for the Stats answering it;
        get_stats() and the operations below share this."""
        self.check_health()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._stats_queries[query_id] = future
        try:
            self._to_scheduler.send(build(query_id))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats_queries.pop(query_id, None)

    async def _control(self, op: str, level: int = 1, tags: list[str] | None = None) -> dict:
        return await self._query(lambda query_id: EngineControl(query_id, op, level, tags), _CONTROL_TIMEOUT_S)

    async def sleep(self, level: int = 1) -> None:
        """Frees the engine's memory until wake_up(): level 1 drops the KV cache and moves the
        weights to host memory, level 2 drops both (wake_up reloads the weights). Running
        requests are preempted first and resume after wake_up, their output unchanged;
        requests sent meanwhile wait."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        reply = await self._control("sleep", level=level)
        if not reply["ok"]:
            raise RuntimeError("the engine could not sleep (a worker failed to free its memory; see its log)")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Brings back what sleep() freed: tags "weights" and/or "kv_cache" (None: both);
        requests run again once both are back."""
        reply = await self._control("wake_up", tags=check_wake_tags(tags))
        if not reply["ok"]:
            raise RuntimeError("the engine could not wake up (a worker failed to reload; see its log)")

    async def is_sleeping(self) -> bool:
        return bool((await self._control("is_sleeping"))["is_sleeping"])

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing changed) while requests hold
        KV blocks, whose cached entries could not all be dropped safely."""
        return bool((await self._control("reset_prefix_cache"))["ok"])
