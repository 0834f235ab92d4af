"""What a plan in flight asked of each sequence, kept until its result comes, and the
check that a result answers its plan."""

from __future__ import annotations

from dataclasses import dataclass

from actors.scheduler.request import Sequence
from messages.scheduler import StepResult
from messages.worker import StepPlan


@dataclass
class ScheduledSequence:
    """What one plan asked of one sequence, kept until the plan's result is applied."""

    seq: Sequence
    generation: int  # the sequence's generation when scheduled
    num_computed_before: int
    num_new_tokens: int
    samples: bool  # the step reaches the end of its tokens, so it samples one
    num_drafts: int = 0  # drafts the worker may verify after the step's token (speculative decoding)


def check_result(plan: StepPlan, result: StepResult, scheduled: dict[str, ScheduledSequence]) -> None:
    """ValueError when the result does not answer the plan."""
    if result.step_id != plan.step_id:
        raise ValueError(f"StepResult is for step {result.step_id}, the plan is step {plan.step_id}")
    if len(result.sampled_token_ids) != len(result.request_ids):
        raise ValueError("StepResult needs one sampled_token_ids entry per request_ids entry")
    if result.logprobs is not None and len(result.logprobs) != len(result.request_ids):
        raise ValueError("StepResult needs one logprobs entry per request_ids entry")
    sampled_ids = set(result.request_ids)
    for seq_id, entry in scheduled.items():
        if entry.samples and seq_id not in sampled_ids and seq_id not in result.pooled:
            raise ValueError(f"StepResult has no sampled token for {seq_id!r}, which computed all its tokens")
        if len(result.accepted_token_ids.get(seq_id, ())) > entry.num_drafts:
            raise ValueError(f"StepResult accepts more drafts for {seq_id!r} than its plan allowed "
                             f"({entry.num_drafts})")


def advance(seq: Sequence, num_new_tokens: int, num_drafts: int = 0) -> ScheduledSequence:
    """Counts the step's tokens as computed now, so the next plan can be built before
    this one's result; a step that reaches the end samples a token, pending till then
    (its accepted drafts, if any, count when the result comes)."""
    entry = ScheduledSequence(seq, seq.generation, seq.num_computed_tokens, num_new_tokens, False, num_drafts)
    seq.num_drafts_in_flight += num_drafts
    seq.num_computed_tokens += num_new_tokens
    if seq.num_computed_tokens == seq.num_total_tokens:
        entry.samples = True
        seq.num_pending_tokens += 1
    return entry
