"""What the scheduler receives: tokenized requests, aborts, stop-string finishes from the
detokenizer, the worker's StepResult, and stats queries."""

from __future__ import annotations

import msgspec

from messages.common import Ping, SamplingParams, Shutdown
from messages.control import EngineControl, WorkerControlDone
from messages.lora import LoRARequest
from messages.multimodal import MultiModalInput
from messages.pooling import PooledData, PoolingParams


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Log-probabilities at one position: the chosen token first, then the top-k
    (the chosen token may appear again among them)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # rank of each token in the vocabulary, 1 = most likely


class StepResult(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="result"):
    """worker (rank 0) → scheduler: what one StepPlan produced. Field order is
    the wire format: append fields, never reorder."""

    step_id: int
    request_ids: list[str]  # requests that sampled a token this step, in batch order
    sampled_token_ids: list[int]  # one per entry of request_ids
    logprobs: list[TokenLogprobs] | None = None  # one per entry of request_ids, when any asked
    # request_id -> logprobs of prompt tokens: entry i is prompt token c + 1 + i given the
    # tokens before it, where c is the request's num_computed_tokens before this step
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # request_id -> the pooled output of each pooling request whose prompt ended this step
    pooled: dict[str, PooledData] = msgspec.field(default_factory=dict)
    # speculative decoding: request_id -> the drafts it accepted, emitted in order before its
    # sampled_token_ids entry (the correction or bonus token); absent: none accepted
    accepted_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    num_draft_tokens: dict[str, int] = msgspec.field(default_factory=dict)  # request_id -> drafts verified
    # the disk tier: host blocks of the plan's blocks_to_load whose file was missing, short,
    # corrupt or stale (their tokens are recomputed)
    failed_loads: list[int] = msgspec.field(default_factory=list)


class TokenizedRequest(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="tokenized"):
    """input_processor → scheduler: a validated request, ready to queue."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None  # prefix-cache entries are shared only between equal salts
    priority: int = 0
    lora_request: LoRARequest | None = None  # checked against the model by the input processor
    pooling_params: PoolingParams | None = None  # a pooling request: prefill only, then its pooled output
    mm_inputs: list[MultiModalInput] | None = None  # its images, in prompt order (a vision model's)


class AbortRequest(msgspec.Struct, array_like=True, frozen=True, tag="abort"):
    """frontend → scheduler (→ detokenizer): drop a request wherever it is; its blocks are
    freed. An id not (yet) known is remembered, so a request still being tokenized is
    dropped when it arrives."""

    request_id: str


class FinishRequest(msgspec.Struct, array_like=True, frozen=True, tag="finish"):
    """detokenizer → scheduler: a stop string ended one completion of a request."""

    request_id: str
    index: int  # which of the request's n completions
    stop: str  # the stop string that matched


class GetStats(msgspec.Struct, array_like=True, frozen=True, tag="get_stats"):
    """frontend → scheduler: send back a Stats message with this query_id."""

    query_id: int


class GrammarCompiled(msgspec.Struct, array_like=True, frozen=True, tag="grammar_compiled"):
    """worker (the rank that samples) → scheduler: a CompileGrammar's request may be
    scheduled now (its grammar is ready), or must be refused (error, naming param)."""

    request_id: str
    error: str | None = None
    param: str | None = None


SchedulerInbox = (StepResult | TokenizedRequest | AbortRequest | FinishRequest | GetStats | EngineControl
                  | WorkerControlDone | GrammarCompiled | Ping | Shutdown)
