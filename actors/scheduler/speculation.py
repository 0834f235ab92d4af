"""The scheduler's side of speculative decoding: how many drafts a decode may verify, the
KV slots that takes, and the reconciliation of a result that carries accepted drafts.

The worker proposes and verifies (actors/spec_decode/speculator.py); the scheduler never sees a
draft. It grants each eligible decode up to k drafts (charged to the step's token budget,
StepPlan.num_lookahead_tokens) and reserves their KV slots. Under async scheduling a
plan is built before the previous result says how many drafts were accepted, so the
worker may already be ahead of the scheduler by the drafts of every unresolved plan:

    worker's num_computed_tokens <= scheduler's + sum of the drafts granted in plans in flight

Hence the reservation: the scheduler's computed tokens, plus the drafts still in flight,
plus this step's 1 + drafts. The worker is authoritative for where a request stands
(ContinuingRequest.num_computed_tokens is a lower bound); the scheduler catches up when a
result comes: it appends the accepted drafts and the sampled token one by one with the
stop checks after each (the tail past a stop or a limit is discarded) and advances its
num_computed_tokens by the accepted drafts. Prefix caching offers only blocks whose every
token the scheduler knows verified, so no cached block holds a rejected draft's KV.

A grant costs the step's budget and KV slots whether or not the worker finds drafts, and
on a workload with nothing to copy it finds none: k of every decode's budget then went
unused (at a server's 512-token steps and 64 decodes, 384 of them, which prefills would
have had). So a sequence whose grant came back with no drafts is granted none for its next
1, 2, 4, ... up to MAX_DRY_BACKOFF (16) decodes (a probe each time), and as much as ever once the
worker proposes again."""

from __future__ import annotations

from actors.scheduler.request import Sequence
from actors.config.speculative import SpeculativeConfig, may_speculate

MAX_DRY_BACKOFF = 16  # decodes a sequence goes at most without drafts between two dry probes


class DraftSlots:
    """Grants drafts per decode and counts what came of them (vLLM's spec-decode metrics)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.num_drafts = 0  # decodes that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens  # accepted at draft position i

    def step_allows(self, running: list[Sequence]) -> bool:
        """No drafts in a step with disable_by_batch_size decodes or more: the batch is then
        compute-bound and verifying drafts costs more than it saves."""
        if self.disable_by_batch_size is None or len(running) < self.disable_by_batch_size:
            return True
        num_decodes = sum(1 for seq in running
                          if seq.num_computed_tokens >= seq.num_prompt_tokens and not seq.last_token_in_flight)
        return num_decodes < self.disable_by_batch_size

    def grant(self, seq: Sequence, num_new_tokens: int, budget: int) -> int:
        """Drafts seq may verify after this step's token: k for a decode whose sampling
        allows them, fewer when the budget is short, 0 for anything else."""
        is_decode = num_new_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_total_tokens \
            and seq.num_computed_tokens >= seq.num_prompt_tokens
        if not is_decode or seq.pooling_params is not None or not may_speculate(seq.params):
            return 0
        if seq.num_total_tokens - seq.num_prompt_tokens < seq.params.min_tokens:
            return 0  # EOS and stop tokens are masked until then: the worker would not draft
        if seq.num_dry_grants_to_skip:  # its last grant found nothing to draft (the module docstring)
            seq.num_dry_grants_to_skip -= 1
            return 0
        # tokens it may emit past this step's one: the worker caps its drafts by the same limit
        room = seq.max_num_tokens - seq.num_total_tokens - 1
        return max(0, min(self.num_speculative_tokens, budget - num_new_tokens, room))

    def observe(self, seq: Sequence, num_granted: int, num_draft_tokens: int, num_accepted: int) -> None:
        """A decode's result: num_granted drafts allowed, num_draft_tokens proposed."""
        if num_granted and not num_draft_tokens:  # a dry grant: skip the next ones, longer each time
            seq.dry_backoff = min(MAX_DRY_BACKOFF, max(1, 2 * seq.dry_backoff))
            seq.num_dry_grants_to_skip = seq.dry_backoff
        elif num_draft_tokens:
            seq.dry_backoff = seq.num_dry_grants_to_skip = 0
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(self.num_accepted_tokens_per_pos))):
            self.num_accepted_tokens_per_pos[position] += 1

    def stats(self) -> dict[str, int]:
        stats = {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                 "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for position, count in enumerate(self.num_accepted_tokens_per_pos):
            stats[f"spec_decode_num_accepted_tokens_pos_{position}"] = count
        return stats


def append_until_stop(seq: Sequence, token_ids: list[int], eos_token_ids: tuple[int, ...]
                      ) -> tuple[list[int], tuple[str, int | None] | None]:
    """Appends a step's tokens (accepted drafts, then the sampled one) one by one, checking
    the stop conditions after each: (the tokens kept, the stop that ended seq or None)."""
    for count, token_id in enumerate(token_ids, start=1):
        seq.append_token(token_id)
        stop = seq.stop_condition(eos_token_ids)
        if stop is not None:
            return token_ids[:count], stop
    return token_ids, None


def acceptance_summary(stats: dict) -> dict[str, float]:
    """From the scheduler's stats (GetStats, LLM.scheduler.stats()): the share of draft
    tokens accepted and the mean acceptance length (tokens a speculated decode emits: its
    accepted drafts + 1, vLLM's definition); zeros when nothing was drafted."""
    num_drafts = stats.get("spec_decode_num_drafts", 0)
    num_draft_tokens = stats.get("spec_decode_num_draft_tokens", 0)
    num_accepted = stats.get("spec_decode_num_accepted_tokens", 0)
    return {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted,
            "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            "mean_acceptance_length": 1 + num_accepted / num_drafts if num_drafts else 0.0}
