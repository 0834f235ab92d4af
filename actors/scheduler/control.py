"""The scheduler actor's engine operations (messages/control.py): sleep, wake-up and
prefix-cache reset, ordered with the steps.

sleep: the scheduler stops building plans, waits for those in flight, preempts every
running request (its KV is recomputed after waking: the output does not change), forgets
the prefix cache (the KV cache is about to go), then tells the workers, which free their
memory (actors/worker/sleep_mode.py). Requests that arrive meanwhile wait in the queue;
wake_up brings weights and KV cache back (both, or one tag at a time) and steps resume
once both are back. reset_prefix_cache is refused while a request holds KV blocks: their
cached entries could not all be dropped, and a trainer resetting after a weight update must
not be served stale KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from messages.control import KV_CACHE, WAKE_TAGS, WEIGHTS, EngineControl, WorkerControl, WorkerControlDone
from messages.frontend import Stats

if TYPE_CHECKING:
    from actors.scheduler.actor import SchedulerActor
    from actors.scheduler.scheduler import Scheduler


def preempt_all(scheduler: Scheduler) -> int:
    """Preempts every running sequence before a sleep (no plan may be in flight); the number
    preempted. The disk tier's unsent saves are dropped: they would read the KV cache after it."""
    count = len(scheduler.running)
    if scheduler.kv_tiers is not None:
        scheduler.kv_tiers.drop_saves()
    while scheduler.running:
        # newest first, so the waiting queue keeps their order; recomputed, never swapped:
        # the device cache is about to go, and the swap-outs would run after it came back
        scheduler._preempt(scheduler.running.pop(), recompute=True)
    return count


def reset_prefix_cache(scheduler: Scheduler) -> bool:
    """Forgets every cached block, or returns False (and changes nothing) while any sequence
    holds blocks."""
    pool = scheduler.block_pool
    if pool.num_free_blocks < pool.num_blocks:
        return False
    pool.reset_prefix_cache()
    if scheduler.kv_tiers is not None:
        scheduler.kv_tiers.reset_cache()
        for seq in scheduler.waiting:  # (weights may have changed: their KV is recomputed too)
            scheduler.kv_tiers.drop_swapped(seq)
    return True


class EngineControlState:
    """Sleep and wake-up in the scheduler actor: what is asleep, and the queries waiting."""

    def __init__(self, actor: SchedulerActor) -> None:
        self.actor = actor
        self.asleep: set[str] = set()  # WEIGHTS, KV_CACHE
        self._sleep_level = 1
        self._draining = False  # a sleep waits for the plans in flight
        self._sleep_queries: list[int] = []
        self._wake_queue: list[tuple[int, list[str]]] = []  # (query id, tags), in order
        self._worker_busy: str | None = None  # the WorkerControl op the workers have not finished

    @property
    def holds_steps(self) -> bool:
        """No plan may be built: asleep, or on the way to or from it."""
        return bool(self.asleep) or self._draining or self._worker_busy is not None

    def request(self, message: EngineControl) -> None:
        scheduler = self.actor.scheduler
        if message.op == "is_sleeping":
            self._reply(message.query_id, True, is_sleeping=bool(self.asleep) or self._draining)
        elif message.op == "reset_prefix_cache":
            self._reply(message.query_id, not self.actor.plans_in_flight and reset_prefix_cache(scheduler))
        elif message.op == "sleep":
            if self.asleep == set(WAKE_TAGS) and self._worker_busy is None:
                self._reply(message.query_id, True)  # asleep already
                return
            self._sleep_queries.append(message.query_id)
            self._sleep_level = max(self._sleep_level if self._draining else 1, message.level)
            self._draining = True
            self.progress()
        elif message.op == "wake_up":
            self._wake_queue.append((message.query_id, list(message.tags or WAKE_TAGS)))
            self.progress()
        else:
            self._reply(message.query_id, False)

    def progress(self) -> None:
        """Moves on when it can: after a result, a worker's answer or a query."""
        actor = self.actor
        if self._worker_busy is not None:
            return
        if self._draining and not actor.plans_in_flight:
            self._draining = False
            preempt_all(actor.scheduler)
            actor.scheduler.block_pool.reset_prefix_cache()
            self._send(WorkerControl("sleep", level=self._sleep_level))
            return
        while self._wake_queue and not self._draining:
            query_id, tags = self._wake_queue[0]
            if not self.asleep.intersection(tags):
                self._wake_queue.pop(0)
                self._reply(query_id, True)  # awake already
                continue
            self._send(WorkerControl("wake_up", tags=tags))
            return

    def worker_done(self, message: WorkerControlDone) -> None:
        op, self._worker_busy = self._worker_busy, None
        ok = message.error is None
        if op == "sleep":
            if ok:
                self.asleep = {WEIGHTS, KV_CACHE}
            for query_id in self._sleep_queries:
                self._reply(query_id, ok)
            self._sleep_queries = []
        elif op == "wake_up":
            query_id, tags = self._wake_queue.pop(0)
            if ok:
                self.asleep.difference_update(tags)
            self._reply(query_id, ok)
        self.progress()

    def _send(self, message: WorkerControl) -> None:
        self._worker_busy = message.op
        self.actor.executor.submit(message)

    def _reply(self, query_id: int, ok: bool, **values: float) -> None:
        self.actor.to_frontend.send(Stats(query_id=query_id, stats={"ok": float(ok), **{
            name: float(value) for name, value in values.items()}}))
