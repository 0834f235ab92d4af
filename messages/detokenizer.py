"""What the detokenizer receives: the requests to track, each step's new tokens, and
aborts, all from the scheduler (one pipe, so a TrackRequest always comes before the
request's first tokens)."""

from __future__ import annotations

import msgspec

from messages.common import Ping, SamplingParams, Shutdown
from messages.scheduler import AbortRequest, TokenLogprobs


class NewTokens(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="new_tokens"):
    """scheduler → detokenizer: tokens one completion gained in one step, and whether it
    finished. Field order is the wire format: append fields, never reorder."""

    request_id: str  # the user's request id (not the scheduler's per-completion id)
    index: int  # which of the request's n completions
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt positions finished this step
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # time.monotonic() when the sequence was first scheduled; on its first token's update only
    first_scheduled_time: float | None = None


class StepOutputs(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="step_outputs"):
    """scheduler → detokenizer: every NewTokens of one step, in one message."""

    step_id: int
    updates: list[NewTokens]


class TrackRequest(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="track"):
    """scheduler → detokenizer: a request the scheduler accepted; its outputs follow."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


DetokenizerInbox = StepOutputs | TrackRequest | AbortRequest | Ping | Shutdown
