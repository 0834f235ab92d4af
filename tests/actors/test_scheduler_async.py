"""Scheduler: async scheduling (plans built before the previous result) and a randomized soak
test of its invariants with one or two plans in flight (FakeWorker: scheduler_harness.py)."""

from __future__ import annotations

import random
import zlib

import pytest

from actors.scheduler import Scheduler
from messages.common import SamplingParams
from messages.scheduler import StepResult
from messages.worker import StepPlan
from tests.actors.scheduler_harness import EOS, SAMPLED, Completion, FakeWorker, make_params, make_scheduler


def test_next_plan_decodes_the_pending_token_before_the_result_arrives():
    # async scheduling: plan 1 is built while plan 0's result is still out
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=2))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 3} and second.num_scheduled_tokens == {"a": 1}
    assert second.continuing_requests[0].num_computed_tokens == 3
    # its second token is the last allowed one: nothing more until a result comes
    assert scheduler.schedule().num_scheduled_tokens == {}
    outputs = scheduler.update(first, worker.step(first)) + scheduler.update(second, worker.step(second))
    assert [o.new_token_ids for o in outputs] == [[SAMPLED], [SAMPLED]]
    assert outputs[-1].finish_reason == "length" and not scheduler.has_unfinished()


def test_a_token_sampled_after_the_finish_is_discarded():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64, token_fn=lambda seq_id, position: EOS)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=10, ignore_eos=False))
    first, second = scheduler.schedule(), scheduler.schedule()
    results = worker.step(first), worker.step(second)
    outputs = scheduler.update(first, results[0])
    assert outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == [EOS]
    assert scheduler.update(second, results[1]) == []
    drop = scheduler.schedule()
    assert drop.finished_request_ids == ["a"] and not drop.num_scheduled_tokens
    worker.step(drop)
    assert worker.states == {} and scheduler.block_pool.num_free_blocks == 64


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


@pytest.mark.parametrize("plans_in_flight", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_random_soak_keeps_invariants_and_completes_every_request(seed, plans_in_flight):
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([2, 4]), rng.randint(6, 16)
    capacity = block_size * num_blocks
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                               max_num_batched_tokens=rng.randint(4, 24), max_num_seqs=rng.randint(1, 6),
                               enable_prefix_caching=seed % 4 != 3)
    worker = FakeWorker(block_size, num_blocks,
                        token_fn=lambda seq_id, position: 10 + zlib.crc32(f"{seq_id}:{position}".encode()) % 50)
    prefixes = [[rng.randint(10, 60) for _ in range(capacity // 2)] for _ in range(3)]
    expected: dict[tuple[str, int], tuple[SamplingParams, list[int]]] = {}  # completion -> (params, prompt)
    aborted: set[str] = set()
    completions: dict[tuple[str, int], Completion] = {}
    in_flight: list[tuple[StepPlan, StepResult]] = []
    num_requests = 0
    for _ in range(3000):
        if num_requests < 40 and rng.random() < 0.4:
            request_id = f"req{num_requests}"
            num_requests += 1
            prompt_len = rng.randint(1, capacity // 2)
            prompt = rng.choice(prefixes)[:prompt_len - 1] + [rng.randint(10, 60)]
            params = make_params(max_tokens=rng.randint(1, capacity // 2), n=rng.choice([1, 1, 2, 3]),
                                 prompt_logprobs=rng.choice([None, None, 1]))
            scheduler.add_request(request_id, prompt, params)
            for index in range(params.n):
                expected[(request_id, index)] = (params, prompt)
        if rng.random() < 0.03 and scheduler.sequences:
            request_id = rng.choice(list(scheduler.sequences.values())).request_id
            scheduler.abort_request(request_id)
            aborted.add(request_id)
        plan = scheduler.schedule()
        assert sum(plan.num_scheduled_tokens.values()) <= scheduler.max_num_batched_tokens
        # the worker runs plans in order; with 2 in flight, a result is applied only after
        # the next plan is built, as the scheduler actor does
        in_flight.append((plan, worker.step(plan)))
        if plans_in_flight == 1:
            sent = {seq.seq_id for seq in scheduler.sequences.values() if seq.sent_to_worker}
            assert set(worker.states) == sent
        if len(in_flight) < plans_in_flight and plan.num_scheduled_tokens:
            continue
        plan, result = in_flight.pop(0)
        for output in scheduler.update(plan, result):
            completion = completions.setdefault((output.request_id, output.index), Completion())
            assert completion.finish_reason is None
            completion.token_ids += output.new_token_ids
            completion.finish_reason = output.finish_reason
            completion.prompt_logprob_positions += [e.ranks[0] for e in output.prompt_logprobs or []]
        check_invariants(scheduler)
        if num_requests == 40 and not scheduler.has_unfinished() and not in_flight:
            break
    assert not scheduler.has_unfinished()
    worker.step(scheduler.schedule())  # flush the last drops
    assert worker.states == {}
    assert scheduler.block_pool.num_free_blocks == num_blocks
    for (request_id, index), (params, prompt) in expected.items():
        if request_id in aborted:
            continue
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        completion = completions[(request_id, index)]
        assert completion.finish_reason == "length"
        positions = range(len(prompt), len(prompt) + params.max_tokens)
        assert completion.token_ids == [worker.token_fn(seq_id, p) for p in positions]
        # Prompt logprobs: each position once, in order, for completion 0 only, even
        # across preemptions that recompute the prompt.
        asked = params.prompt_logprobs is not None and index == 0
        assert completion.prompt_logprob_positions == (list(range(1, len(prompt))) if asked else [])
