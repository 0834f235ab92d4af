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
    """scheduler → detokenizer: what one step gave each completion, in one message.

    Most completions of a step are plain decodes: one token, no logprobs, not their first
    token and not finished. Those travel as columns (decode_*), one entry each, rather
    than a NewTokens each (which would say the same: NewTokens(request_id, index,
    [token_id])); the others as NewTokens. Field order is the wire format: append fields,
    never reorder."""

    step_id: int
    updates: list[NewTokens]
    decode_request_ids: list[str] = msgspec.field(default_factory=list)  # the user's request ids
    decode_indexes: list[int] = msgspec.field(default_factory=list)  # which of the request's n completions
    decode_token_ids: list[int] = msgspec.field(default_factory=list)  # the one token each gained

    def new_tokens(self) -> list[NewTokens]:
        """Every completion's update as a NewTokens: the updates, then the decodes."""
        return self.updates + [NewTokens(request_id, index, [token_id]) for request_id, index, token_id
                               in zip(self.decode_request_ids, self.decode_indexes, self.decode_token_ids)]

    def is_empty(self) -> bool:
        return not self.updates and not self.decode_request_ids


class TrackRequest(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="track"):
    """scheduler → detokenizer: a request the scheduler accepted; its outputs follow."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


DetokenizerInbox = StepOutputs | TrackRequest | AbortRequest | Ping | Shutdown
