"""The scheduler's side of speculative decoding against a worker that speculates without a
model (SpeculatingWorker): drafts granted and charged, KV slots reserved for where the
worker may already be, results with accepted drafts reconciled (stops inside a run cut
the tail), and a randomized soak with one or two plans in flight that checks every slot
a step reads holds its own verified token (so no rejected draft's KV is ever reused)."""

from __future__ import annotations

import random
import zlib

import msgspec
import pytest

from actors.config import CacheConfig, SchedulerConfig
from actors.scheduler import Scheduler
from actors.scheduler.speculation import acceptance_summary
from actors.config.speculative import SpeculativeConfig
from messages.scheduler import StepResult
from messages.worker import StepPlan
from tests.scheduler.scheduler_harness import EOS, WorkerSequence, make_params, soak

WRONG = 99  # a draft the worker's "model" never samples


def make_speculating_scheduler(k: int = 3, num_blocks: int = 64, block_size: int = 4,
                               max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                               enable_prefix_caching: bool = True, disable_by_batch_size: int | None = None
                               ) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=256),
                     CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
                     num_blocks=num_blocks, eos_token_ids=(EOS,),
                     speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                                                   prompt_lookup_max=1, disable_by_batch_size=disable_by_batch_size))


class SpeculatingWorker:
    """The worker's bookkeeping with speculation and no model: token_fn(seq_id, position) is
    the target's token at a position; draft_ok(seq_id, position) whether the draft proposed
    there is right (else it is WRONG). Every computed position's token is written into its
    KV slot, and before a step every slot it attends to must hold the sequence's own token."""

    def __init__(self, block_size: int, num_blocks: int, token_fn, draft_ok) -> None:
        self.block_size = block_size
        self.token_fn, self.draft_ok = token_fn, draft_ok
        self.states: dict[str, WorkerSequence] = {}
        self.limits: dict[str, int] = {}  # seq_id -> the most tokens it may have (prompt + max_tokens)
        self.kv_slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def _slot(self, state: WorkerSequence, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_request_ids:
            del self.states[seq_id]
        for new in plan.new_requests:
            self.states[new.request_id] = WorkerSequence(list(new.token_ids), new.num_prompt_tokens,
                                                         list(new.block_ids), new.num_computed_tokens)
            self.limits[new.request_id] = new.num_prompt_tokens + new.params.max_tokens
        for cont in plan.continuing_requests:
            state = self.states[cont.request_id]
            assert cont.num_computed_tokens <= state.num_computed_tokens, "the scheduler is ahead of the worker"
            state.block_ids += cont.new_block_ids
        request_ids, sampled, accepted, num_drafts = [], [], {}, {}
        for seq_id, num_new in plan.num_scheduled_tokens.items():
            state = self.states[seq_id]
            start = state.num_computed_tokens
            granted = plan.num_lookahead_tokens.get(seq_id, 0)
            drafts = []
            if granted and num_new == 1 and start == len(state.token_ids) - 1:
                cap = min(granted, len(state.block_ids) * self.block_size - len(state.token_ids),
                          self.limits[seq_id] - len(state.token_ids) - 1)
                drafts = [self.token_fn(seq_id, len(state.token_ids) + i)
                          if self.draft_ok(seq_id, len(state.token_ids) + i) else WRONG for i in range(max(cap, 0))]
            tokens = state.token_ids + drafts
            end = start + num_new + len(drafts)
            assert len(state.block_ids) * self.block_size >= end, "block table too short"
            for position in range(end):
                block_id, offset = self._slot(state, position)
                if position < start:
                    assert self.kv_slots[block_id][offset] == tokens[position], "stale or draft KV read"
                else:
                    self.kv_slots[block_id][offset] = tokens[position]
            if end < len(tokens):  # a prefill chunk short of the end: nothing sampled
                state.num_computed_tokens = end
                continue
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == self.token_fn(seq_id, len(state.token_ids)):
                state.token_ids.append(drafts[num_accepted])
                num_accepted += 1
            token_id = self.token_fn(seq_id, len(state.token_ids))
            state.token_ids.append(token_id)
            state.num_computed_tokens = start + num_new + num_accepted
            request_ids.append(seq_id)
            sampled.append(token_id)
            if drafts:
                num_drafts[seq_id] = len(drafts)
            if num_accepted:
                accepted[seq_id] = drafts[:num_accepted]
        return StepResult(plan.step_id, request_ids, sampled, accepted_token_ids=accepted,
                          num_draft_tokens=num_drafts)


def target(seq_id: str, position: int) -> int:
    return 10 + zlib.crc32(f"{seq_id}:{position}".encode()) % 50


def test_a_decode_is_granted_k_drafts_charged_to_the_budget_with_slots_for_them():
    scheduler = make_speculating_scheduler(k=3, max_num_batched_tokens=64)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2, 3, 4, 5], make_params(max_tokens=20))
    prefill = scheduler.schedule()
    assert prefill.num_lookahead_tokens == {}  # a prompt chunk verifies no drafts
    scheduler.update(prefill, worker.step(prefill))
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens == {"a": 1} and decode.num_lookahead_tokens == {"a": 3}
    # computed 5, this step's token and 3 drafts: 9 slots, 3 blocks of 4
    assert len(scheduler.sequences["a"].block_ids) == 3
    outputs = scheduler.update(decode, worker.step(decode)).new_tokens()
    assert outputs[0].new_token_ids == [target("a", p) for p in range(6, 10)]  # 3 accepted + the bonus
    seq = scheduler.sequences["a"]
    assert seq.num_computed_tokens == 9 and seq.num_tokens == 10 and seq.num_drafts_in_flight == 0
    assert scheduler.stats()["spec_decode_num_accepted_tokens"] == 3


def test_the_second_plan_in_flight_reserves_slots_for_the_drafts_of_the_first():
    scheduler = make_speculating_scheduler(k=3)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2, 3, 4, 5, 6, 7], make_params(max_tokens=40))
    prefill = scheduler.schedule()
    scheduler.update(prefill, worker.step(prefill))
    first, second = scheduler.schedule(), scheduler.schedule()
    # the worker may be 3 ahead when it runs the second: 8 computed + 3 + 1 + 3 drafts = 15 slots
    assert second.continuing_requests[0].num_computed_tokens == 8
    assert len(scheduler.sequences["a"].block_ids) * 4 >= 15
    results = worker.step(first), worker.step(second)
    assert worker.states["a"].num_computed_tokens == 7 + 4 + 4  # each step: its token and 3 accepted drafts
    outputs = scheduler.update(first, results[0]).new_tokens() + scheduler.update(second, results[1]).new_tokens()
    assert [t for o in outputs for t in o.new_token_ids] == [target("a", p) for p in range(8, 16)]
    assert scheduler.sequences["a"].num_computed_tokens == 15


def test_a_stop_token_inside_an_accepted_run_discards_the_tail():
    # the target emits EOS at position 7: drafts 6, 7, 8 are all right, only 6 and 7 count
    def token_fn(seq_id, position):
        return EOS if position == 7 else target(seq_id, position)
    scheduler = make_speculating_scheduler(k=3)
    worker = SpeculatingWorker(4, 64, token_fn, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2, 3, 4, 5], make_params(max_tokens=20, ignore_eos=False))
    prefill = scheduler.schedule()
    scheduler.update(prefill, worker.step(prefill))
    decode = scheduler.schedule()
    outputs = scheduler.update(decode, worker.step(decode)).new_tokens()
    assert outputs[0].new_token_ids == [target("a", 6), EOS] and outputs[0].finish_reason == "stop"
    assert not scheduler.has_unfinished() and scheduler.block_pool.num_free_blocks == 64


def test_drafts_stop_at_max_tokens_and_the_budget():
    scheduler = make_speculating_scheduler(k=5, max_num_batched_tokens=3)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2], make_params(max_tokens=3))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.step(plan))
    decode = scheduler.schedule()
    assert decode.num_lookahead_tokens == {"a": 1}  # 1 output + this step's + 1 draft = max_tokens 3
    outputs = scheduler.update(decode, worker.step(decode)).new_tokens()
    assert outputs[0].new_token_ids == [target("a", 3), target("a", 4)] and outputs[0].finish_reason == "length"


def test_no_drafts_in_a_step_with_disable_by_batch_size_decodes():
    scheduler = make_speculating_scheduler(k=2, disable_by_batch_size=2)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=8))
    scheduler.add_request("b", [4, 5, 6], make_params(max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.step(plan))
    assert scheduler.schedule().num_lookahead_tokens == {}


def test_requests_whose_sampling_reads_the_output_get_no_drafts():
    scheduler = make_speculating_scheduler(k=2)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("penalized", [1, 2, 3], make_params(max_tokens=8, repetition_penalty=1.2))
    scheduler.add_request("logprobs", [1, 2, 3], make_params(max_tokens=8, logprobs=1))
    scheduler.add_request("plain", [1, 2, 3], make_params(max_tokens=8))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.step(plan))
    assert scheduler.schedule().num_lookahead_tokens == {"plain": 2}


@pytest.mark.parametrize("plans_in_flight", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_random_soak_with_speculation_gives_the_target_tokens_and_reads_no_draft_kv(seed, plans_in_flight):
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([2, 4]), rng.randint(8, 20)
    capacity = block_size * num_blocks
    scheduler = make_speculating_scheduler(k=rng.randint(1, 4), num_blocks=num_blocks, block_size=block_size,
                                           max_num_batched_tokens=rng.randint(6, 24), max_num_seqs=rng.randint(1, 6),
                                           enable_prefix_caching=seed % 3 != 2)
    acceptance = rng.choice([0.3, 0.7, 0.95])

    def token_fn(seq_id: str, position: int) -> int:
        return EOS if zlib.crc32(f"eos{seq_id}:{position}".encode()) % 40 == 0 else target(seq_id, position)

    worker = SpeculatingWorker(block_size, num_blocks, token_fn,
                               lambda seq_id, position: zlib.crc32(f"d{seq_id}:{position}".encode()) % 100
                               < acceptance * 100)
    outcome = soak(scheduler, worker, rng, plans_in_flight, num_requests=30, max_prompt_len=capacity // 3,
                   make_request_params=lambda rng: make_params(max_tokens=rng.randint(1, capacity // 2),
                                                               n=rng.choice([1, 1, 2]), ignore_eos=rng.random() < 0.5),
                   abort_rate=0.02)
    stats = scheduler.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    for (request_id, index), (params, prompt) in outcome.expected.items():
        if request_id in outcome.aborted:
            continue
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        tokens = [token_fn(seq_id, p) for p in range(len(prompt), len(prompt) + params.max_tokens)]
        if not params.ignore_eos and EOS in tokens:
            tokens = tokens[:tokens.index(EOS) + 1]
        assert outcome.completions[(request_id, index)].token_ids == tokens


def test_acceptance_summary_from_the_stats():
    scheduler = make_speculating_scheduler(k=3)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: position % 4 != 0)
    scheduler.add_request("a", [1, 2, 3, 4, 5], make_params(max_tokens=30))
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update(plan, worker.step(plan))
    stats = scheduler.stats()
    summary = acceptance_summary(stats)
    assert 0 < summary["acceptance_rate"] < 1
    assert summary["acceptance_rate"] == \
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    assert summary["mean_acceptance_length"] == 1 + stats["spec_decode_num_accepted_tokens"] / \
        stats["spec_decode_num_drafts"]
    assert acceptance_summary({})["mean_acceptance_length"] == 0.0


def test_no_drafts_until_min_tokens_are_out():
    scheduler = make_speculating_scheduler(k=2)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: False)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=8, min_tokens=3, ignore_eos=False))
    granted = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        granted.append(plan.num_lookahead_tokens.get("a", 0))
        scheduler.update(plan, worker.step(plan))
    # outputs before each step: 0 (prompt), 1, 2, 3, ...: drafts from the step after the third
    assert granted[:4] == [0, 0, 0, 2]


def test_a_decode_whose_grants_find_nothing_to_draft_is_granted_none_for_longer_and_longer():
    scheduler = make_speculating_scheduler(k=3, max_num_batched_tokens=64)
    worker = SpeculatingWorker(4, 64, target, lambda seq_id, position: True)
    scheduler.add_request("a", [1, 2, 3, 4, 5], make_params(max_tokens=120))
    granted = []
    for step in range(42):  # step 0 is the prompt, then one decode a step
        plan = scheduler.schedule()
        granted.append(plan.num_lookahead_tokens.get("a", 0))
        nothing_to_copy = step < 25  # the worker's history offers nothing to draft, then it does
        scheduler.update(plan, worker.step(msgspec.structs.replace(plan, num_lookahead_tokens={})
                                           if nothing_to_copy else plan))
    # a dry grant skips the next 1, 2, 4, 8, 16 (at most) decodes; a fruitful one ends that
    assert [step for step, drafts in enumerate(granted) if drafts] == [1, 3, 6, 11, 20, 37, 38, 39, 40, 41]
    assert set(granted) == {0, 3}
    # the budget went to the probes only, not to 3 phantom drafts a decode
    assert sum(granted[:37]) == 5 * 3
