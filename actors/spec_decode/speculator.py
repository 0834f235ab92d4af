"""The worker's side of speculative decoding: proposes drafts for a step's decodes from
each request's own history (ngram, suffix) or with a draft model (draft_model.py, which
also keeps its own KV cache up with the step) and verifies them against the target's
logits of all 1 + d positions, computed in the same step (the drafts ride as a causal
chunk after the decode's token).

Receives from the model runner the requests that leave and, per step, the decodes the
plan granted drafts (StepPlan.num_lookahead_tokens) and their logits rows; sends
nothing; owns the proposer (prompt lookup, or suffix decoding with its tries, fed each
request's tokens as they come).

The worker holds every token of a request, its own in-flight samples included, so it
proposes without the scheduler ever seeing a draft, and async scheduling stays on. It is
authoritative for where a request stands: a decode that accepted a drafts advances its
num_computed_tokens by 1 + a, ahead of the scheduler's count until that result arrives
(actors/scheduler/speculation.py). Rejected drafts' KV stays in its slots as garbage and
is overwritten when those positions are computed for real. Under tensor parallelism every
rank proposes the same drafts from the same history (both proposers are deterministic),
and rank 0, which holds the logits, verifies and broadcasts what was emitted; a draft
model runs with tensor parallelism 1 only (refused otherwise at start-up)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from actors.config.speculative import SpeculativeConfig, may_speculate
from actors.spec_decode.ngram import NgramProposer
from actors.spec_decode.rejection import greedy_accept, rejection_sample
from actors.spec_decode.suffix import SuffixDecodingProposer
from actors.layers.random_sampling import filtered_probs
from actors.layers.sampler import argmax_tokens, position_seed

if TYPE_CHECKING:
    from actors.spec_decode.draft_model import DraftModel
    from actors.worker.cached_request import CachedRequest
    from actors.layers.sampler import Sampler


class Speculator:
    """Drafts and verification for one worker rank."""

    def __init__(self, config: SpeculativeConfig, block_size: int, max_model_len: int,
                 draft: DraftModel | None = None) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.ngram = NgramProposer.from_config(config) if config.method == "ngram" else None
        self.suffix = SuffixDecodingProposer.from_config(config) if config.method == "suffix" else None
        self.draft = draft if config.method == "draft_model" else None  # draft_model.py
        if self.ngram is None and self.suffix is None and self.draft is None:
            raise ValueError(f"speculative_config: method {config.method} is not supported by the worker")
        self._num_fed: dict[str, int] = {}  # suffix: request_id -> its tokens fed to the proposer

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft model's KV cache: the target's block count, the same block ids."""
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)

    def propose_step(self, num_lookahead_tokens: dict[str, int],  # request_id -> drafts granted
                     scheduled: list[tuple[CachedRequest, int]]) -> StepDrafts:
        """The step's drafts, appended to their requests' tokens. The draft model runs every
        step (its cache follows every token the target computes); the other proposers only
        where the plan granted drafts."""
        drafts, draft_probs = {}, {}
        if self.draft is not None:
            caps = {request.request_id: self.draft_cap(request, n, num_lookahead_tokens.get(request.request_id, 0))
                    for request, n in scheduled}
            for request_id, (request_drafts, q) in self.draft.propose(scheduled, caps).items():
                drafts[request_id] = request_drafts
                if q is not None:
                    draft_probs[request_id] = q
        elif num_lookahead_tokens:
            for request, num_tokens in scheduled:
                request_drafts = self.propose(request, num_tokens, num_lookahead_tokens.get(request.request_id, 0))
                if request_drafts:
                    drafts[request.request_id] = request_drafts
        if drafts:
            for request, _ in scheduled:
                request.token_ids.extend(drafts.get(request.request_id, ()))
        return StepDrafts(drafts, draft_probs)

    def remove_request(self, request_id: str, token_ids: list[int] | None) -> None:
        """A request leaves (finished, aborted or preempted): suffix decoding keeps its
        output for later requests."""
        if self.draft is not None:
            self.draft.remove_request(request_id)
        if self.suffix is None or request_id not in self._num_fed:
            return
        if token_ids is not None:
            self._feed(request_id, token_ids)
        self.suffix.stop_request(request_id)
        del self._num_fed[request_id]

    def draft_cap(self, request: CachedRequest, num_scheduled: int, num_granted: int) -> int:
        """The most drafts one request of the step may get; 0 unless it decodes (its chunk
        is its last token), was granted drafts and may speculate now."""
        num_tokens = len(request.token_ids)
        params = request.params
        if (num_granted <= 0 or num_scheduled != 1 or request.num_computed_tokens != num_tokens - 1
                or request.pooling is not None or not may_speculate(params)
                or num_tokens - request.num_prompt_tokens < params.min_tokens):
            return 0
        # never past the reserved slots, max_model_len or max_tokens: the scheduler reserved
        # KV for the worst case and stops the request at its limit anyway
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + params.max_tokens)
        return max(0, min(num_granted, len(request.block_ids) * self.block_size - num_tokens, limit - num_tokens - 1))

    def propose(self, request: CachedRequest, num_scheduled: int, num_granted: int) -> list[int]:
        """Drafts for one request of the step from its own history (ngram, suffix); []
        where draft_cap is 0."""
        cap = self.draft_cap(request, num_scheduled, num_granted)
        if cap <= 0:
            return []
        if self.ngram is not None:
            return self.ngram.propose_one(np.asarray(request.token_ids, dtype=np.int64), cap)
        if request.request_id not in self._num_fed:
            self.suffix.start_request(request.request_id, request.token_ids[:request.num_prompt_tokens])
            self._num_fed[request.request_id] = request.num_prompt_tokens
        self._feed(request.request_id, request.token_ids)
        return self.suffix.propose(request.request_id, cap)

    def _feed(self, request_id: str, token_ids: list[int]) -> None:
        fed = self._num_fed[request_id]
        if len(token_ids) > fed:
            self.suffix.add_tokens(request_id, token_ids[fed:])
            self._num_fed[request_id] = len(token_ids)

    @staticmethod
    def verify(logits: torch.Tensor,  # [sum of 1 + d_i, vocab] fp32: request i's rows, in order
               requests: list[CachedRequest], drafts: list[list[int]],
               draft_probs: list[torch.Tensor | None] | None = None,  # request i's q [d_i, vocab], or None
               ) -> list[list[int]]:
        """The tokens each request emits: its accepted drafts, then the target's token (the
        correction at the first rejection, or the bonus after the last draft). Greedy
        requests accept while the argmax agrees (exactly greedy decoding); sampled ones by
        rejection sampling, against the draft model's q where there is one, else with
        one-hot drafts; a seeded request from its own generator seeded by (seed, output
        position), so its output is reproducible."""
        device, vocab = logits.device, logits.shape[-1]
        num_requests, width = len(requests), max(len(d) for d in drafts)
        # request i's scored rows, padded with its first row (never emitted past its drafts)
        row_index = torch.zeros(num_requests, width + 1, dtype=torch.long)
        draft_tokens = torch.zeros(num_requests, width, dtype=torch.long)
        start = 0
        for i, request_drafts in enumerate(drafts):
            num_rows = 1 + len(request_drafts)
            row_index[i] = start
            row_index[i, :num_rows] = torch.arange(start, start + num_rows)
            draft_tokens[i, :len(request_drafts)] = torch.tensor(request_drafts, dtype=torch.long)
            start += num_rows
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        emitted: list[list[int]] = [[] for _ in requests]
        greedy = [i for i, request in enumerate(requests) if request.params.is_greedy]
        sampled = [i for i, request in enumerate(requests) if not request.params.is_greedy]
        if greedy:
            rows = logits[row_index[greedy].flatten().to(device)]
            target_argmax = argmax_tokens(rows).view(len(greedy), width + 1).cpu()
            num_accepted, tokens = greedy_accept(draft_tokens[greedy], target_argmax, num_draft[greedy])
            for j, i in enumerate(greedy):
                emitted[i] = tokens[j, :int(num_accepted[j]) + 1].tolist()
        if sampled:
            params = [requests[i].params for i in sampled]
            repeat = width + 1  # every scored row of a request takes its parameters
            probs = filtered_probs(logits[row_index[sampled].flatten().to(device)],
                                   [p.temperature for p in params for _ in range(repeat)],
                                   [p.top_k for p in params for _ in range(repeat)],
                                   [p.top_p for p in params for _ in range(repeat)],
                                   [p.min_p for p in params for _ in range(repeat)]).view(len(sampled), repeat, vocab)
            generators = [None if requests[i].params.seed is None else torch.Generator(device).manual_seed(
                position_seed(requests[i].params.seed, len(requests[i].token_ids) - requests[i].num_prompt_tokens))
                for i in sampled]
            num_accepted, tokens = rejection_sample(draft_tokens[sampled].to(device), num_draft[sampled].to(device),
                                                    _padded_draft_probs(draft_probs, sampled, width, vocab, device),
                                                    probs, generators)
            for j, i in enumerate(sampled):
                emitted[i] = tokens[j, :int(num_accepted[j]) + 1].tolist()
        return emitted


def _padded_draft_probs(draft_probs: list[torch.Tensor | None] | None, rows: list[int], width: int, vocab: int,
                        device: torch.device) -> torch.Tensor | None:
    """q of the given requests as one [n, width, vocab] tensor, zero past each one's drafts
    (never read there); None for one-hot drafts."""
    if draft_probs is None or all(draft_probs[i] is None for i in rows):
        return None
    padded = torch.zeros(len(rows), width, vocab, dtype=torch.float32, device=device)
    for j, i in enumerate(rows):
        padded[j, :len(draft_probs[i])] = draft_probs[i]
    return padded


class StepDrafts:
    """One step's speculated decodes: their drafts (appended to their tokens for the step),
    the draft model's q of the sampled ones, their logits rows, and what verification
    emitted for them."""

    def __init__(self, drafts: dict[str, list[int]], draft_probs: dict[str, torch.Tensor] | None = None) -> None:
        self.drafts = drafts  # request_id -> drafts, for the decodes that have some
        self.draft_probs = draft_probs or {}  # request_id -> q [drafts, vocab]: sampled requests, draft_model
        self.requests: list[CachedRequest] = []  # the speculated requests, in the order of their rows

    def __len__(self) -> int:
        return len(self.drafts)

    def num_drafts(self, request: CachedRequest) -> int:
        return len(self.drafts.get(request.request_id, ()))

    def split_rows(self, sample_rows: list[int], samplers: list[CachedRequest]
                   ) -> tuple[list[int], list[CachedRequest], list[int]]:
        """The rows and requests the sampler samples (the others), and the speculated
        requests' rows: every scored position, 1 + d each (their sample row is their last)."""
        if not self.drafts:  # no speculation this step: the per-step path stays as it was
            return sample_rows, samplers, []
        plain_rows, plain, spec_rows = [], [], []
        for row, request in zip(sample_rows, samplers):
            num_drafts = self.num_drafts(request)
            if num_drafts:
                self.requests.append(request)
                spec_rows += range(row - num_drafts, row + 1)
            else:
                plain_rows.append(row)
                plain.append(request)
        return plain_rows, plain, spec_rows

    def verify(self, logits: torch.Tensor) -> list[list[int]]:  # logits: [rows of split_rows' spec_rows, vocab]
        return Speculator.verify(logits, self.requests, [self.drafts[r.request_id] for r in self.requests],
                                 [self.draft_probs.get(r.request_id) for r in self.requests] if self.draft_probs
                                 else None)

    @property
    def width(self) -> int:
        """The most tokens one request may emit this step."""
        return 1 + max((len(d) for d in self.drafts.values()), default=0)

    def apply(self, emitted: list[list[int]], sampler: Sampler | None) -> None:
        """The drafts leave each request's tokens and what it emitted (accepted drafts, then
        one) joins; it advances by that much. The rejected positions' KV stays past
        num_computed_tokens as garbage, overwritten when those positions are computed.
        sampler: the rank's Sampler where it sampled (its outputs move on too), else None."""
        for request, tokens in zip(self.requests, emitted):
            del request.token_ids[len(request.token_ids) - len(self.drafts[request.request_id]):]
            request.token_ids.extend(tokens)
            request.num_computed_tokens += len(tokens)
            if sampler is not None:
                sampler.extend_output(request.request_id, tokens)

    def result_fields(self, emitted: list[list[int]]) -> dict:
        """StepResult's accepted_token_ids and num_draft_tokens."""
        return {"accepted_token_ids": {r.request_id: tokens[:-1] for r, tokens in zip(self.requests, emitted)
                                       if len(tokens) > 1},
                "num_draft_tokens": {r.request_id: len(self.drafts[r.request_id]) for r in self.requests}}
