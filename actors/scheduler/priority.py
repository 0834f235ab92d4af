"""Priority scheduling (`--scheduling-policy priority`), as vLLM's: a request's `priority`
(lower is more urgent), ties broken by arrival. PriorityScheduler is the FCFS Scheduler
with its queues kept in that order: the waiting queue, and the running list (the least
urgent last), so wherever the scheduler preempts "the last running sequence" (a decode
short of blocks) it takes the least urgent one; and before each step a waiting sequence
more urgent than the least urgent running one makes room for itself when it would not get
in (max_num_seqs reached, or its first chunk's blocks not free).

Equal priorities are served first come first served, so none of them starves another; a
request of lower priority waits while more urgent ones keep coming, as in vLLM."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from actors.scheduler.encoder_budget import EncoderBudget
from actors.scheduler.kv_cache_manager import KVCacheManager
from actors.scheduler.kv_tiers import KVTiers
from actors.scheduler.request import Sequence
from actors.scheduler.scheduler import Scheduler
from messages.worker import StepPlan


def urgency(seq: Sequence) -> tuple[int, int]:
    """The order of service: priority, then arrival."""
    return seq.priority, seq.arrival_order


class WaitingQueue:
    """The waiting sequences by urgency, with the deque methods the scheduler uses (append
    and appendleft both insert in order: a preempted sequence goes back where its urgency puts it)."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._sequences: list[Sequence] = []

    def append(self, seq: Sequence) -> None:
        key = urgency(seq)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._sequences.insert(index, seq)

    appendleft = append

    def extendleft(self, sequences: Iterable[Sequence]) -> None:
        for seq in sequences:
            self.append(seq)

    def popleft(self) -> Sequence:
        self._keys.pop(0)
        return self._sequences.pop(0)

    def remove(self, seq: Sequence) -> None:
        index = self._sequences.index(seq)
        del self._keys[index], self._sequences[index]

    def __getitem__(self, index: int) -> Sequence:
        return self._sequences[index]

    def __len__(self) -> int:
        return len(self._sequences)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._sequences)


def make_room_for_urgent(scheduler: Scheduler, budget: int) -> None:
    """Before a step: while the most urgent waiting sequence is more urgent than the least
    urgent running one and would not get in (max_num_seqs reached, or its first chunk's
    blocks not free), preempts the latter (it waits again, its KV recomputed later)."""
    waiting, running = scheduler.waiting, scheduler.running
    while waiting and running:
        head, victim = waiting[0], running[-1]
        if urgency(head) >= urgency(victim) or head.must_wait(scheduler._ids_to_drop):
            return
        if len(running) < scheduler.max_num_seqs and first_chunk_fits(scheduler.kv_cache_manager, head, budget):
            return
        running.pop()
        scheduler._preempt(victim)


def first_chunk_fits(kv_cache: KVCacheManager, seq: Sequence, budget: int) -> bool:
    """Whether a waiting sequence's first chunk (up to budget tokens past its cached prefix)
    would get its blocks now."""
    hit_block_ids, num_hit_tokens = kv_cache.get_computed_blocks(seq)
    num_tokens = num_hit_tokens + min(seq.num_tokens - num_hit_tokens, budget)
    return kv_cache.can_fit(seq, num_tokens, hit_block_ids)


class PriorityScheduler(Scheduler):
    """The scheduler under the priority policy (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = WaitingQueue()
        self._num_arrivals = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, *, priority: int = 0,
                    **kwargs) -> None:
        """Scheduler.add_request, queued by priority (lower first), then arrival."""
        super().add_request(request_id, prompt_token_ids, params, **kwargs)
        self._num_arrivals += 1
        for seq_id in self._request_id_to_seq_ids[request_id]:
            seq = self.sequences[seq_id]
            self.waiting.remove(seq)  # queued before its key was known
            seq.priority, seq.arrival_order = priority, self._num_arrivals
            self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        make_room_for_urgent(self, self.max_num_batched_tokens)
        plan = super().schedule()
        self.running.sort(key=urgency)  # this step's admissions were appended: back in order
        return plan


def make_scheduler(scheduler_config, *args, kv_tiers: KVTiers | None = None, **kwargs) -> Scheduler:
    """The scheduler of the config's policy, with the host KV tier if there is one."""
    cls = PriorityScheduler if scheduler_config.scheduling_policy == "priority" else Scheduler
    scheduler = cls(scheduler_config, *args, **kwargs)
    if scheduler_config.max_num_encoder_input_tokens is not None:
        scheduler.encoder_budget = EncoderBudget(scheduler_config.max_num_encoder_input_tokens)
    if kv_tiers is not None:
        scheduler.kv_tiers = kv_tiers
        kv_tiers.attach(scheduler.block_pool)
    return scheduler
