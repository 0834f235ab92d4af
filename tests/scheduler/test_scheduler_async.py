"""Scheduler: async scheduling (plans built before the previous result) and a randomized soak
test of its invariants with one or two plans in flight (FakeWorker: scheduler_harness.py)."""

from __future__ import annotations

import random
import zlib

import pytest

from tests.scheduler.scheduler_harness import EOS, SAMPLED, FakeWorker, make_params, make_scheduler, soak


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
    outputs = (scheduler.update(first, worker.step(first)).new_tokens()
               + scheduler.update(second, worker.step(second)).new_tokens())
    assert [o.new_token_ids for o in outputs] == [[SAMPLED], [SAMPLED]]
    assert outputs[-1].finish_reason == "length" and not scheduler.has_unfinished()


def test_a_token_sampled_after_the_finish_is_discarded():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64, token_fn=lambda seq_id, position: EOS)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=10, ignore_eos=False))
    first, second = scheduler.schedule(), scheduler.schedule()
    results = worker.step(first), worker.step(second)
    outputs = scheduler.update(first, results[0]).new_tokens()
    assert outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == [EOS]
    assert scheduler.update(second, results[1]).new_tokens() == []
    drop = scheduler.schedule()
    assert drop.finished_request_ids == ["a"] and not drop.num_scheduled_tokens
    worker.step(drop)
    assert worker.states == {} and scheduler.block_pool.num_free_blocks == 64


# ---- soak ----

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
    outcome = soak(scheduler, worker, rng, plans_in_flight, num_requests=40, max_prompt_len=capacity // 2,
                   make_request_params=lambda rng: make_params(max_tokens=rng.randint(1, capacity // 2),
                                                               n=rng.choice([1, 1, 2, 3]),
                                                               prompt_logprobs=rng.choice([None, None, 1])))
    expected, aborted, completions = outcome.expected, outcome.aborted, outcome.completions
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
