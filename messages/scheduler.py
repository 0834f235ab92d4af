"""What the scheduler receives. For now: the worker's StepResult."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Log-probabilities at one position: the chosen token first, then the top-k
    (the chosen token may appear again among them)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # rank of each token in the vocabulary, 1 = most likely


class StepResult(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="result"):
    """worker (rank 0) → scheduler: what one StepPlan produced. Field order is the
    wire format: append fields, never reorder."""

    step_id: int
    request_ids: list[str]  # requests that sampled a token this step, in batch order
    sampled_token_ids: list[int]  # one per entry of request_ids
    logprobs: list[TokenLogprobs] | None = None  # one per entry of request_ids, when any asked
    # request_id -> logprobs of prompt tokens: entry i is prompt token c + 1 + i given the
    # tokens before it, where c is the request's num_computed_tokens before this step
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
