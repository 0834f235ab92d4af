"""What the scheduler counts for /metrics: the tokens of each step as vLLM counts them
(the tokens sampled, plus a request's prompt in the step of its first token), and when
each sequence was first scheduled, sent with its first token."""

from __future__ import annotations

import time

from tests.scheduler.scheduler_harness import FakeWorker, make_params, make_scheduler, run_to_end


def test_each_step_counts_its_sampled_tokens_and_the_prompts_that_got_their_first():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", list(range(20)), make_params(max_tokens=3))
    run_to_end(scheduler, worker)
    # prefill in chunks of 8, 8 and 4: the first two sample nothing and are not counted;
    # the third samples a's first token (20 + 1), then two decodes (1 each)
    histogram = scheduler.stats()["iteration_tokens"]
    assert histogram.bounds[:3] == [1, 8, 16]
    assert histogram.counts[:5] == [2, 0, 0, 1, 0] and sum(histogram.counts) == 3
    assert histogram.total == 20 + 3


def test_a_request_with_two_completions_counts_its_prompt_once():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("b", list(range(10)), make_params(max_tokens=2, n=2))
    run_to_end(scheduler, worker)
    assert scheduler.stats()["iteration_tokens"].total == 10 + 2 * 2


def test_first_scheduled_time_comes_with_a_sequences_first_token_only():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(4, 64)
    before = time.monotonic()
    scheduler.add_request("a", list(range(12)), make_params(max_tokens=3))
    stamps = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        stamps += [output.first_scheduled_time for output in scheduler.update(plan, worker.step(plan)).new_tokens()]
    # chunks of 8 and 4, then two decodes: three outputs, the first carries the stamp of
    # the first chunk's admission
    assert len(stamps) == 3 and stamps[1:] == [None, None]
    assert before <= stamps[0] <= time.monotonic()
