"""Scheduler: chunked prefill, decode-first batching, FCFS admission, prefix-cache
reuse, preemption, aborts, n > 1 fan-out, finish reasons.

A FakeWorker (scheduler_harness.py) plays the worker's side of the StepPlan contract: it keeps per-sequence
state from the diffs, writes each computed token into its KV slot and checks, before
every step, that the slots it would attend to hold the sequence's own tokens (so a
wrong prefix-cache hit or a block written by two sequences fails loudly)."""

from __future__ import annotations

import pytest

from messages.scheduler import StepResult
from tests.scheduler.scheduler_harness import (EOS, SAMPLED, FakeWorker, generate, make_params, make_scheduler, run_step,
                                           run_to_end)


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", list(range(20)), make_params())
    plan = run_step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"a": 8}
    assert plan.new_requests[0].block_ids == [0, 1] and plan.new_requests[0].num_computed_tokens == 0
    plan = run_step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"a": 8}
    assert [(c.new_block_ids, c.num_computed_tokens) for c in plan.continuing_requests] == [([2, 3], 8)]
    plan = run_step(scheduler, worker)  # the last 4 prompt tokens: samples the first output
    assert plan.num_scheduled_tokens == {"a": 4}
    assert scheduler.sequences["a"].token_ids[20:] == [SAMPLED]
    plan = run_step(scheduler, worker)  # decode of position 20 opens a sixth block
    assert plan.num_scheduled_tokens == {"a": 1}
    assert [(c.new_block_ids, c.num_computed_tokens) for c in plan.continuing_requests] == [([5], 20)]
    assert scheduler.stats()["num_computed_prefill_tokens"] == 20


def test_decodes_are_scheduled_before_new_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3, 4], make_params(max_tokens=5))
    run_step(scheduler, worker)
    scheduler.add_request("b", list(range(20)), make_params())
    # a's decode takes 1 token of the budget first; b's prefill gets the other 7.
    assert list(run_step(scheduler, worker).num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert list(run_step(scheduler, worker).num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert list(run_step(scheduler, worker).num_scheduled_tokens.items()) == [("a", 1), ("b", 6)]


def test_max_num_seqs_caps_running_sequences():
    scheduler = make_scheduler(max_num_seqs=2)
    worker = FakeWorker(4, 64)
    for request_id in "abc":
        scheduler.add_request(request_id, [1, 2, 3], make_params(max_tokens=2))
    assert set(run_step(scheduler, worker).num_scheduled_tokens) == {"a", "b"}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert set(run_step(scheduler, worker).num_scheduled_tokens) == {"a", "b"}  # both finish
    plan = run_step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"c": 3} and plan.finished_request_ids == ["a", "b"]


def test_waiting_requests_are_admitted_first_come_first_served():
    # Token budget: a takes 6, b the remaining 4 as a first chunk, c waits.
    scheduler = make_scheduler(max_num_batched_tokens=10)
    worker = FakeWorker(4, 64)
    for request_id in "abc":
        scheduler.add_request(request_id, list(range(6)), make_params())
    assert list(run_step(scheduler, worker).num_scheduled_tokens.items()) == [("a", 6), ("b", 4)]


def test_a_waiting_request_that_does_not_fit_is_not_overtaken():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots
    worker = FakeWorker(4, 4)
    scheduler.add_request("a", list(range(10)), make_params(max_tokens=1))  # 3 blocks
    scheduler.add_request("b", list(range(50, 58)), make_params(max_tokens=1))  # 2 blocks: no room
    scheduler.add_request("c", [9], make_params(max_tokens=1))  # 1 block would fit, must not jump b
    assert run_step(scheduler, worker).num_scheduled_tokens == {"a": 10}
    assert run_step(scheduler, worker).num_scheduled_tokens == {"b": 8, "c": 1}


# ---- prefix cache ----

def test_second_request_reuses_the_cached_prefix_blocks():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    shared = list(range(100, 108))  # two full blocks
    scheduler.add_request("a", shared + [1, 2, 3, 4], make_params(max_tokens=3))
    first = run_step(scheduler, worker).new_requests[0]
    assert first.block_ids == [0, 1, 2]
    scheduler.add_request("b", shared + [5, 6, 7], make_params(max_tokens=2))
    plan = run_step(scheduler, worker)
    (second,) = plan.new_requests
    # a's decode ran first and took block 3 for its 13th token.
    assert second.num_computed_tokens == 8 and second.block_ids == [0, 1, 4]
    assert plan.num_scheduled_tokens["b"] == 3
    assert scheduler.block_pool.ref_count(0) == 2 and scheduler.block_pool.ref_count(2) == 1
    stats = scheduler.stats()
    assert stats["num_prefix_hit_tokens"] == 8 and stats["num_prefix_query_tokens"] == 12 + 11
    assert stats["num_computed_prefill_tokens"] == 12 + 3


def test_identical_prompt_hit_leaves_one_block_to_compute():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    prompt = list(range(100, 112))  # exactly three blocks
    scheduler.add_request("a", prompt, make_params(max_tokens=1))
    completions = run_to_end(scheduler, worker)
    scheduler.add_request("b", prompt, make_params(max_tokens=1))
    plan = run_step(scheduler, worker, completions)
    # Capped at prompt_len - 1 tokens, rounded down to blocks: 8 of 12, not 12.
    assert plan.new_requests[0].num_computed_tokens == 8
    assert plan.new_requests[0].block_ids[:2] == [0, 1]
    assert plan.num_scheduled_tokens == {"b": 4}
    assert completions[("b", 0)].num_cached_tokens == 8
    assert completions[("a", 0)].num_cached_tokens == 0


def test_prompt_logprobs_request_does_not_read_the_cache():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    worker = FakeWorker(4, 64)
    prompt = list(range(100, 110))
    scheduler.add_request("a", prompt, make_params(max_tokens=1))
    run_to_end(scheduler, worker)
    scheduler.add_request("b", prompt, make_params(max_tokens=1, prompt_logprobs=1))
    completions = {}
    plan = run_step(scheduler, worker, completions)
    assert plan.new_requests[0].num_computed_tokens == 0
    run_to_end(scheduler, worker, completions)
    assert completions[("b", 0)].prompt_logprob_positions == list(range(1, 10))


def test_n_completions_share_the_prompt_blocks():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("r", list(range(10)), make_params(max_tokens=3, seed=5, n=4))
    plan = run_step(scheduler, worker)  # the siblings wait for completion 0's prompt
    assert [new.request_id for new in plan.new_requests] == ["r#0"]
    plan = run_step(scheduler, worker)
    assert [(new.request_id, new.block_ids, new.num_computed_tokens) for new in plan.new_requests] == [
        ("r#1", [0, 1, 3], 8), ("r#2", [0, 1, 4], 8), ("r#3", [0, 1, 5], 8)]
    assert [new.params.seed for new in plan.new_requests] == [6, 7, 8]
    assert all(new.params.n == 1 for new in plan.new_requests)
    assert [scheduler.block_pool.ref_count(b) for b in range(6)] == [4, 4, 1, 1, 1, 1]
    assert plan.num_scheduled_tokens == {"r#0": 1, "r#1": 2, "r#2": 2, "r#3": 2}
    completions = run_to_end(scheduler, worker)
    assert sorted(completions) == [("r", i) for i in range(4)]
    assert scheduler.block_pool.num_free_blocks == 64


def test_n_completions_without_prefix_caching_compute_their_own_prompt():
    scheduler = make_scheduler(enable_prefix_caching=False)
    worker = FakeWorker(4, 64)
    scheduler.add_request("r", list(range(10)), make_params(max_tokens=2, n=2))
    plan = run_step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"r#0": 10, "r#1": 10}
    assert [new.block_ids for new in plan.new_requests] == [[0, 1, 2], [3, 4, 5]]


# ---- preemption and abort ----

def test_newest_request_is_preempted_and_resumes_with_identical_tokens():
    scheduler = make_scheduler(num_blocks=4)  # 16 token slots, block_size 4
    worker = FakeWorker(4, 4)
    completions = {}
    scheduler.add_request("a", list(range(6)), make_params(max_tokens=4))
    scheduler.add_request("b", list(range(50, 56)), make_params(max_tokens=4))
    for _ in range(3):  # both prefill, then decode until each holds 9 tokens in 2 full blocks
        run_step(scheduler, worker, completions)
    # a needs a third block: b, the newest, is preempted; its tail block is evicted first.
    plan = run_step(scheduler, worker, completions)
    assert plan.num_scheduled_tokens == {"a": 1} and plan.finished_request_ids == ["b"]
    assert plan.continuing_requests[0].new_block_ids == [3]
    assert scheduler.stats()["num_preemptions"] == 1 and list(scheduler.waiting)[0].seq_id == "b"
    assert completions[("a", 0)].finish_reason == "length"
    # b comes back as a new request: prompt + 3 outputs, its surviving head block reused.
    plan = run_step(scheduler, worker, completions)
    (resumed,) = plan.new_requests
    assert resumed.token_ids == list(range(50, 56)) + [SAMPLED] * 3 and resumed.num_prompt_tokens == 6
    assert resumed.num_computed_tokens == 4 and resumed.block_ids == [2, 3, 1]
    assert plan.finished_request_ids == ["a"]
    assert completions[("b", 0)].token_ids == [SAMPLED] * 4 and completions[("b", 0)].finish_reason == "length"
    assert not scheduler.has_unfinished()
    assert scheduler.block_pool.num_free_blocks == 4


def test_abort_frees_blocks_and_lists_the_id_once():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", list(range(10)), make_params())
    scheduler.add_request("w", list(range(10)), make_params())
    run_step(scheduler, worker)
    scheduler.abort_request("a")
    scheduler.abort_request("unknown")
    assert scheduler.num_running == 1 and scheduler.block_pool.num_free_blocks == 64 - 3
    plan = run_step(scheduler, worker)
    assert plan.finished_request_ids == ["a"] and "a" not in plan.num_scheduled_tokens
    assert run_step(scheduler, worker).finished_request_ids == []
    # A request the worker never saw is not listed.
    scheduler.add_request("never_sent", [1], make_params())
    scheduler.abort_request("never_sent")
    scheduler.abort_request("w")
    assert scheduler.schedule().finished_request_ids == ["w"]
    assert scheduler.block_pool.num_free_blocks == 64


def test_result_for_a_request_aborted_after_schedule_is_dropped():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3], make_params())
    plan = scheduler.schedule()
    scheduler.abort_request("a")
    assert scheduler.update(plan, worker.step(plan)).new_tokens() == []
    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.block_pool.num_free_blocks == 64


def test_stop_string_finish_frees_the_sequence():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=10))
    run_step(scheduler, worker)
    scheduler.finish_sequence("a", 0, "stop", "\n\n")
    scheduler.finish_sequence("a", 0, "stop", "\n\n")  # already finished: ignored
    assert not scheduler.has_unfinished()
    assert scheduler.schedule().finished_request_ids == ["a"]
    assert scheduler.block_pool.num_free_blocks == 64


def test_a_reused_request_id_waits_for_the_old_state_to_be_dropped():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3], make_params(max_tokens=1))
    run_step(scheduler, worker)
    scheduler.add_request("a", [4, 5, 6], make_params(max_tokens=1))
    plan = run_step(scheduler, worker)
    assert plan.finished_request_ids == ["a"] and plan.num_scheduled_tokens == {}
    assert run_step(scheduler, worker).num_scheduled_tokens == {"a": 3}


# ---- finish reasons ----

def test_stop_token_id_finishes_with_the_token_as_stop_reason():
    completion = generate(3, [5, 9, 6], max_tokens=5, stop_token_ids=[9])
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == ([5, 9], "stop", 9)


def test_eos_finishes_unless_ignored():
    completion = generate(3, [5, EOS, 6], max_tokens=3, ignore_eos=False)
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == ([5, EOS], "stop", None)
    completion = generate(3, [5, EOS, 6], max_tokens=3, ignore_eos=True)
    assert (completion.token_ids, completion.finish_reason) == ([5, EOS, 6], "length")


def test_min_tokens_defers_stop_tokens_and_eos():
    completion = generate(3, [9, EOS, EOS, EOS], max_tokens=5, min_tokens=3, ignore_eos=False,
                          stop_token_ids=[9])
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == ([9, EOS, EOS], "stop", None)


def test_length_limits():
    completion = generate(3, [5] * 10, max_tokens=4)
    assert (len(completion.token_ids), completion.finish_reason) == (4, "length")
    completion = generate(6, [5] * 10, max_model_len=8, max_tokens=None)
    assert (len(completion.token_ids), completion.finish_reason) == (2, "length")


# ---- bad input and misuse ----

def test_invalid_requests_raise_value_error():
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)  # 16 token slots
    scheduler.add_request("a", [1], make_params())
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request("a", [1], make_params())
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request("b", [], make_params())
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request("b", [1] * 32, make_params())
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request("b", [1] * 16, make_params())
    scheduler.add_request("c", [1], make_params(n=2))
    with pytest.raises(ValueError, match="c#1"):
        scheduler.add_request("c#1", [1], make_params())
    assert scheduler.num_waiting == 3


def test_mismatched_results_raise():
    scheduler = make_scheduler()
    worker = FakeWorker(4, 64)
    scheduler.add_request("a", [1, 2, 3], make_params())
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="step"):
        scheduler.update(plan, StepResult(plan.step_id + 1, ["a"], [SAMPLED]))
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(plan, StepResult(plan.step_id, [], []))
    assert len(scheduler.update(plan, worker.step(plan)).new_tokens()) == 1
