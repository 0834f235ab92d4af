"""The priority policy (actors/scheduler/priority.py) on the plain scheduler with the
FakeWorker (which checks every KV slot a step attends to): who is admitted, who is
preempted for whom, and that every request still finishes with its own tokens."""

from __future__ import annotations

import pytest

from actors.scheduler.priority import PriorityScheduler
from tests.scheduler.scheduler_harness import FakeWorker, make_params, make_scheduler, run_step, run_to_end


def prompt(first: int, length: int = 8) -> list[int]:
    return list(range(first, first + length))


def admitted(plan) -> list[str]:
    return [new.request_id for new in plan.new_requests]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    assert isinstance(scheduler, PriorityScheduler)
    worker = FakeWorker(4, 64)
    for request_id, priority in (("late-low", 3), ("first-mid", 1), ("second-mid", 1), ("urgent", -2)):
        scheduler.add_request(request_id, prompt(10), make_params(max_tokens=2), priority=priority)
    order = []
    while scheduler.has_unfinished():
        order += admitted(run_step(scheduler, worker))
    assert order == ["urgent", "first-mid", "second-mid", "late-low"]


def test_an_urgent_request_preempts_the_least_urgent_running_one_at_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    worker = FakeWorker(4, 64)
    scheduler.add_request("low-old", prompt(10), make_params(max_tokens=12), priority=5)
    scheduler.add_request("low-new", prompt(30), make_params(max_tokens=12), priority=5)
    completions: dict = {}
    run_step(scheduler, worker, completions)
    run_step(scheduler, worker, completions)
    scheduler.add_request("urgent", prompt(50), make_params(max_tokens=3), priority=0)
    plan = run_step(scheduler, worker, completions)
    assert admitted(plan) == ["urgent"]
    assert "low-new" in plan.finished_request_ids  # preempted (dropped from the worker), not low-old
    assert [seq.request_id for seq in scheduler.waiting] == ["low-new"]
    assert scheduler.num_preemptions == 1
    run_to_end(scheduler, worker, completions)
    assert {key: len(c.token_ids) for key, c in completions.items()} == {
        ("low-old", 0): 12, ("low-new", 0): 12, ("urgent", 0): 3}


def test_an_urgent_request_preempts_for_blocks_and_equal_priorities_do_not():
    # 12 blocks of 4: the two running requests (8 + 12 tokens each) take all of them
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=8, scheduling_policy="priority")
    worker = FakeWorker(4, 10)
    scheduler.add_request("a", prompt(10), make_params(max_tokens=12), priority=1)
    scheduler.add_request("b", prompt(30), make_params(max_tokens=12), priority=1)
    completions: dict = {}
    for _ in range(6):
        run_step(scheduler, worker, completions)
    scheduler.add_request("same", prompt(50, 12), make_params(max_tokens=2), priority=1)
    assert admitted(run_step(scheduler, worker, completions)) == []  # equal priority: it waits its turn
    assert scheduler.num_preemptions == 0
    scheduler.add_request("urgent", prompt(70, 12), make_params(max_tokens=2), priority=0)
    plan = run_step(scheduler, worker, completions)
    assert "urgent" in admitted(plan) and scheduler.num_preemptions >= 1
    run_to_end(scheduler, worker, completions)
    assert all(c.finish_reason == "length" for c in completions.values()) and len(completions) == 4


def test_a_decode_short_of_blocks_preempts_the_least_urgent_not_the_newest():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=8, scheduling_policy="priority")
    worker = FakeWorker(4, 8)
    scheduler.add_request("background", prompt(10), make_params(max_tokens=20), priority=9)
    completions: dict = {}
    run_step(scheduler, worker, completions)
    scheduler.add_request("foreground", prompt(40), make_params(max_tokens=20), priority=0)
    waited = set()
    while scheduler.has_unfinished():
        run_step(scheduler, worker, completions)
        waited |= {seq.request_id for seq in scheduler.waiting}
    assert scheduler.num_preemptions >= 1 and waited == {"background"}
    assert len(completions[("foreground", 0)].token_ids) == 20 == len(completions[("background", 0)].token_ids)


def test_fcfs_refuses_a_priority_and_priority_keeps_n_completions_together():
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        make_scheduler().add_request("r", prompt(10), make_params(), priority=1)
    scheduler = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    scheduler.add_request("pair", prompt(10), make_params(max_tokens=2, n=2, seed=1), priority=2)
    scheduler.add_request("one", prompt(30), make_params(max_tokens=2), priority=1)
    completions = run_to_end(scheduler, FakeWorker(4, 64))
    assert set(completions) == {("pair", 0), ("pair", 1), ("one", 0)}
