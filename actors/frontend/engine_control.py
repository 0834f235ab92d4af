"""AsyncClient's engine operations (vLLM's names): sleep(level), wake_up(tags),
is_sleeping(), reset_prefix_cache(). Each is one EngineControl query to the scheduler
(actors/scheduler/control.py), answered under its query id like get_stats()."""

from __future__ import annotations


from messages.control import check_wake_tags

class EngineControlMixin:
    """Mixed into AsyncClient (actors/frontend/client.py); its _control is the engine's
    (EngineClient._control: actors/frontend/engine_client.py)."""

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
