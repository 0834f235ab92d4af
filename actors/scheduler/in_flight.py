"""What a plan in flight asked of each sequence, kept until its result comes, and the
check that a result answers its plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.scheduler.request import Sequence
from messages.scheduler import StepResult
from messages.worker import StepPlan

# What one plan asked of one sequence, kept until the plan's result is applied:
#   (seq, its generation when scheduled, num_computed_before, num_new_tokens, samples, num_drafts)
# samples: the step reaches the end of its tokens, so it samples one; num_drafts: drafts the
# worker may verify after the step's token (speculative decoding). A plain tuple: one is made
# per sequence and step, and a dataclass cost four times as much to make.
ScheduledSequence = tuple[Sequence, int, int, int, bool, int]


@dataclass
class PlanInFlight:
    """What one plan asked, in plan order, until its result is applied."""

    entries: list[ScheduledSequence] = field(default_factory=list)
    sampling_ids: set[str] = field(default_factory=set)  # seq ids the plan has sample a token


def check_result(plan: StepPlan, result: StepResult, in_flight: PlanInFlight) -> dict[str, int]:
    """seq id -> its row in the result's sampled_token_ids; ValueError when the result does
    not answer the plan."""
    if result.step_id != plan.step_id:
        raise ValueError(f"StepResult is for step {result.step_id}, the plan is step {plan.step_id}")
    num_sampled = len(result.request_ids)
    if len(result.sampled_token_ids) != num_sampled:
        raise ValueError("StepResult needs one sampled_token_ids entry per request_ids entry")
    if result.logprobs is not None and len(result.logprobs) != num_sampled:
        raise ValueError("StepResult needs one logprobs entry per request_ids entry")
    sample_index = dict(zip(result.request_ids, range(num_sampled)))
    if not sample_index.keys() >= in_flight.sampling_ids:  # (a set check in C: no loop here)
        for seq_id in in_flight.sampling_ids:
            if seq_id not in sample_index and seq_id not in result.pooled:
                raise ValueError(f"StepResult has no sampled token for {seq_id!r}, which computed all its tokens")
    if result.accepted_token_ids:
        num_drafts = {seq.seq_id: drafts for seq, _, _, _, _, drafts in in_flight.entries}
        for seq_id, accepted in result.accepted_token_ids.items():
            if seq_id in num_drafts and len(accepted) > num_drafts[seq_id]:
                raise ValueError(f"StepResult accepts more drafts for {seq_id!r} than its plan allowed "
                                 f"({num_drafts[seq_id]})")
    return sample_index


def advance(in_flight: PlanInFlight, seq: Sequence, num_new_tokens: int, num_drafts: int = 0) -> None:
    """Counts the step's tokens as computed now, so the next plan can be built before
    this one's result; a step that reaches the end samples a token, pending till then
    (its accepted drafts, if any, count when the result comes)."""
    num_computed_before = seq.num_computed_tokens
    seq.num_computed_tokens = num_computed = num_computed_before + num_new_tokens
    samples = num_computed == len(seq.token_ids) + seq.num_pending_tokens
    if samples:
        seq.num_pending_tokens += 1
        in_flight.sampling_ids.add(seq.seq_id)
    if num_drafts:
        seq.num_drafts_in_flight += num_drafts
    in_flight.entries.append((seq, seq.generation, num_computed_before, num_new_tokens, samples, num_drafts))
