"""StepTimer: the scheduler builds the second plan in flight a lead time before the
running step is predicted to end, not at once, so that requests arriving during a long
step join the next one; short steps get their next plan at once."""

from __future__ import annotations

import pytest

from actors.scheduler.step_timing import StepTimer


def run_steps(timer: StepTimer, steps: list[tuple[int, float]], start: float = 0.0) -> float:
    """Steps one after the other, each sent when the one before ended; the end time."""
    now = start
    for step_id, (tokens, seconds) in enumerate(steps):
        timer.sent(step_id, tokens, now)
        now += seconds
        timer.finished(step_id, now)
    return now


def test_no_waiting_before_enough_steps_were_measured():
    timer = StepTimer()
    now = run_steps(timer, [(2048, 4.0)] * 3)
    timer.sent(99, 2048, now)
    assert timer.predict(2048) is None
    assert timer.dispatch_delay(now) == 0.0


def test_the_fitted_line_predicts_steps_of_other_sizes():
    timer = StepTimer()
    # 0.2 s a step plus 2 ms a token
    now = run_steps(timer, [(tokens, 0.2 + 0.002 * tokens) for tokens in (64, 512, 64, 300, 64, 512)])
    assert timer.predict(1000) == pytest.approx(2.2, rel=1e-6)
    timer.sent(7, 512, now)
    # built 15% of the predicted 1.224 s before the end: ~1.04 s from now, less as time passes
    assert timer.dispatch_delay(now) == pytest.approx(1.224 * 0.85, rel=1e-6)
    assert timer.dispatch_delay(now + 0.5) == pytest.approx(1.224 * 0.85 - 0.5, rel=1e-6)
    assert timer.dispatch_delay(now + 2.0) == 0.0


def test_short_steps_get_their_next_plan_at_once():
    timer = StepTimer()
    now = run_steps(timer, [(64, 0.015)] * 8)
    timer.sent(8, 64, now)
    assert timer.dispatch_delay(now) == 0.0


def test_a_queued_step_starts_when_the_one_before_it_ends():
    timer = StepTimer()
    now = run_steps(timer, [(100, 1.0)] * 5)
    timer.sent(5, 100, now)
    timer.sent(6, 100, now + 0.1)  # queued behind step 5
    assert timer.dispatch_delay(now + 0.1) == 0.0  # two in flight: not the timer's business
    timer.finished(5, now + 1.0)
    assert timer.predict(100) == pytest.approx(1.0)
    # step 6 started at now + 1.0, not when it was sent
    assert timer.dispatch_delay(now + 1.0) == pytest.approx(0.85)
