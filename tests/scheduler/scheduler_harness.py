"""The scheduler tests' harness: a FakeWorker that plays the worker's side of the StepPlan
contract (per-sequence state from the diffs, each computed token written into its KV slot,
and a check before every step that the slots it attends to hold its own tokens), and helpers
that run requests to the end."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.config import CacheConfig, SchedulerConfig
from actors.scheduler import Scheduler
from actors.scheduler.priority import make_scheduler as build_scheduler
from messages.common import SamplingParams
from messages.scheduler import StepResult, TokenLogprobs
from messages.worker import StepPlan

EOS = 2
SAMPLED = 7  # the token the default FakeWorker samples


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, max_model_len: int = 256,
                   enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs") -> Scheduler:
    return build_scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                           max_model_len=max_model_len, scheduling_policy=scheduling_policy),
                           CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
                           num_blocks=num_blocks, eos_token_ids=(EOS,))


def make_params(max_tokens: int | None = 4, ignore_eos: bool = True, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **kwargs)


@dataclass
class WorkerSequence:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    """The worker's bookkeeping without a model. token_fn(seq_id, position) is the token
    sampled at that position; prompt logprob entries carry their position as rank."""

    def __init__(self, block_size: int, num_blocks: int,
                 token_fn: Callable[[str, int], int] = lambda seq_id, position: SAMPLED) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.states: dict[str, WorkerSequence] = {}
        self.kv_slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_request_ids:
            assert seq_id in self.states, f"drop of {seq_id} the worker never had"
            del self.states[seq_id]
        for new in plan.new_requests:
            assert new.request_id not in self.states
            self.states[new.request_id] = WorkerSequence(list(new.token_ids), new.num_prompt_tokens,
                                                         list(new.block_ids), new.num_computed_tokens)
        listed = {new.request_id for new in plan.new_requests}
        for cont in plan.continuing_requests:
            state = self.states[cont.request_id]
            assert state.num_computed_tokens == cont.num_computed_tokens
            state.block_ids += cont.new_block_ids
            listed.add(cont.request_id)
        assert listed == set(plan.num_scheduled_tokens)

        request_ids, sampled, prompt_logprobs = [], [], {}
        for seq_id, num_new in plan.num_scheduled_tokens.items():
            state = self.states[seq_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            assert 0 < num_new and end <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= end, "block table too short"
            for position in range(end):
                block_id, offset = state.block_ids[position // self.block_size], position % self.block_size
                if position < start:
                    assert self.kv_slots[block_id][offset] == state.token_ids[position], "stale KV"
                else:
                    self.kv_slots[block_id][offset] = state.token_ids[position]
            state.num_computed_tokens = end
            last_prompt_position = min(end, state.num_prompt_tokens - 1)
            if last_prompt_position > start:
                prompt_logprobs[seq_id] = [TokenLogprobs([state.token_ids[p]], [-1.0], [p])
                                           for p in range(start + 1, last_prompt_position + 1)]
            if end == len(state.token_ids):
                token_id = self.token_fn(seq_id, end)
                state.token_ids.append(token_id)
                request_ids.append(seq_id)
                sampled.append(token_id)
        return StepResult(plan.step_id, request_ids, sampled, prompt_logprobs=prompt_logprobs)


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprob_positions: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


def run_step(scheduler: Scheduler, worker: FakeWorker, completions: dict | None = None) -> StepPlan:
    plan = scheduler.schedule()
    for output in scheduler.update(plan, worker.step(plan)).new_tokens():
        if completions is not None:
            completion = completions.setdefault((output.request_id, output.index), Completion())
            assert completion.finish_reason is None, "tokens after the finish"
            completion.token_ids += output.new_token_ids
            completion.finish_reason, completion.stop_reason = output.finish_reason, output.stop_reason
            completion.prompt_logprob_positions += [e.ranks[0] for e in output.prompt_logprobs or []]
            # (a plain decode, a StepOutputs column, does not repeat it: it is on the first token)
            completion.num_cached_tokens = max(completion.num_cached_tokens, output.num_cached_tokens)
    return plan


def run_to_end(scheduler: Scheduler, worker: FakeWorker, completions: dict | None = None,
               max_steps: int = 1000) -> dict:
    completions = {} if completions is None else completions
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return completions
        run_step(scheduler, worker, completions)
    raise AssertionError("requests did not finish")


def generate(prompt_len: int, output_tokens: list[int], max_model_len: int = 256, **params) -> Completion:
    """One request whose worker samples output_tokens in order."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    worker = FakeWorker(4, 64, token_fn=lambda seq_id, position: output_tokens[position - prompt_len])
    scheduler.add_request("r", list(range(10, 10 + prompt_len)), make_params(**params))
    return run_to_end(scheduler, worker)[("r", 0)]


# ---- batching ----


# ---- soak ----

def check_invariants(scheduler: Scheduler) -> None:
    pool = scheduler.block_pool
    holders: dict[int, int] = {}
    for seq in scheduler.sequences.values():
        assert len(set(seq.block_ids)) == len(seq.block_ids), f"{seq} holds a block twice"
        if seq in scheduler.waiting:
            assert seq.block_ids == [] and seq.num_computed_tokens == 0
        for block_id in seq.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for seq in scheduler.running:
        # Blocks that will receive new KV belong to this sequence alone.
        for block_id in seq.block_ids[seq.num_computed_tokens // pool.block_size:]:
            assert pool.ref_count(block_id) == 1, f"{seq} would write shared block {block_id}"
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) == holders.get(block_id, 0)
        if holders.get(block_id, 0) > 1:
            assert pool.block_hash(block_id) is not None, "shared block not in the prefix cache"
    assert pool.num_free_blocks == pool.num_blocks - len(holders)
    assert scheduler.num_running <= scheduler.max_num_seqs
    assert scheduler.num_running + scheduler.num_waiting == len(scheduler.sequences)


@dataclass
class SoakResult:
    expected: dict[tuple[str, int], tuple[SamplingParams, list[int]]]  # completion -> (params, prompt)
    aborted: set[str]
    completions: dict[tuple[str, int], Completion]


def soak(scheduler: Scheduler, worker, rng: random.Random, plans_in_flight: int, num_requests: int,
         max_prompt_len: int, make_request_params: Callable[[random.Random], SamplingParams],
         abort_rate: float = 0.03) -> SoakResult:
    """Random arrivals (prompts sharing prefixes), aborts and steps with one or two plans in
    flight until every request is done, the invariants checked after every result (a plan's
    scheduled tokens, drafts included, within the budget). With two in flight a result is
    applied only after the next plan is built, as the scheduler actor does."""
    prefixes = [[rng.randint(10, 60) for _ in range(max_prompt_len)] for _ in range(3)]
    result = SoakResult({}, set(), {})
    in_flight: list[tuple[StepPlan, StepResult]] = []
    num_added = 0
    for _ in range(3000):
        if num_added < num_requests and rng.random() < 0.4:
            request_id = f"req{num_added}"
            num_added += 1
            prompt_len = rng.randint(1, max_prompt_len)
            prompt = rng.choice(prefixes)[:prompt_len - 1] + [rng.randint(10, 60)]
            params = make_request_params(rng)
            scheduler.add_request(request_id, prompt, params)
            for index in range(params.n):
                result.expected[(request_id, index)] = (params, prompt)
        if rng.random() < abort_rate and scheduler.sequences:
            request_id = rng.choice(list(scheduler.sequences.values())).request_id
            scheduler.abort_request(request_id)
            result.aborted.add(request_id)
        plan = scheduler.schedule()
        num_tokens = sum(plan.num_scheduled_tokens.values()) + sum(plan.num_lookahead_tokens.values())
        assert num_tokens <= scheduler.max_num_batched_tokens
        in_flight.append((plan, worker.step(plan)))
        if plans_in_flight == 1:
            sent = {seq.seq_id for seq in scheduler.sequences.values() if seq.sent_to_worker}
            assert set(worker.states) == sent
        if len(in_flight) < plans_in_flight and plan.num_scheduled_tokens:
            continue
        plan, step_result = in_flight.pop(0)
        for output in scheduler.update(plan, step_result).new_tokens():
            completion = result.completions.setdefault((output.request_id, output.index), Completion())
            assert completion.finish_reason is None, "tokens after the finish"
            completion.token_ids += output.new_token_ids
            completion.finish_reason = output.finish_reason
            completion.prompt_logprob_positions += [e.ranks[0] for e in output.prompt_logprobs or []]
        check_invariants(scheduler)
        if num_added == num_requests and not scheduler.has_unfinished() and not in_flight:
            break
    assert not scheduler.has_unfinished()
    worker.step(scheduler.schedule())  # flush the last drops
    assert worker.states == {}
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
    return result
