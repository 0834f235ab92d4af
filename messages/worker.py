"""What each worker receives: the scheduler's StepPlan.

A StepPlan is a diff, as in vLLM V1: a request's whole token list and sampling
parameters travel once (NewRequest); after that a step names the request, its new
block ids and how many tokens to compute (ContinuingRequest). The worker keeps
per-request state and appends its own sampled tokens, so a decode step costs a few
bytes per request.
"""

from __future__ import annotations

import msgspec

from messages.common import Ping, SamplingParams, Shutdown
from messages.control import WorkerControl
from messages.lora import LoRARequest
from messages.multimodal import MultiModalInput
from messages.pooling import PoolingParams
from messages.structured_outputs import StructuredOutputsParams


class NewRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request the worker has no state for: a fresh one, or one resumed after
    preemption (then token_ids also holds the tokens generated before it)."""

    request_id: str
    token_ids: list[int]  # prompt tokens, then output tokens already generated
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt
    params: SamplingParams
    block_ids: list[int]  # the request's block table so far
    num_computed_tokens: int  # leading tokens whose KV is already cached (prefix hit)
    lora_request: LoRARequest | None = None  # the adapter it runs with (loaded on first use)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled
    mm_inputs: list[MultiModalInput] | None = None  # its images (sent again on resumption: recomputed)


class ContinuingRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request the worker already holds."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # tokens with KV in the cache before this step


class StepPlan(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="plan"):
    """scheduler (its executor) → every worker rank: what to compute in one model step.

    Every request in num_scheduled_tokens is in new_requests or continuing_requests.
    A request samples a token this step when its computed tokens reach the end of its
    known tokens. Field order is the wire format: append fields, never reorder."""

    step_id: int
    new_requests: list[NewRequest]
    continuing_requests: list[ContinuingRequest]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens to compute this step
    finished_request_ids: list[str]  # drop their state (finished, aborted or preempted)
    # request_id -> drafts the worker may verify after the step's one token (speculative
    # decoding: charged to the step's budget, KV slots reserved); absent: none
    num_lookahead_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # the host KV tier (actors/scheduler/kv_tiers.py): block copies run at the step's start,
    # before its forward, swap-outs (device block, host block) first, then swap-ins
    # (host block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # the disk tier: (device block, hash) to write to disk after the swap-outs (in the
    # background), and (hash, host block) to read from disk before the swap-ins; rank 0
    # answers a plan with loads even when it schedules no token (StepResult.failed_loads)
    blocks_to_save: list[tuple[int, bytes]] = msgspec.field(default_factory=list)
    blocks_to_load: list[tuple[bytes, int]] = msgspec.field(default_factory=list)


class CompileGrammar(msgspec.Struct, array_like=True, frozen=True, tag="compile_grammar"):
    """scheduler (its executor) → every worker rank: compile a request's grammar before the
    request is scheduled; the rank that samples answers with GrammarCompiled, the others
    ignore it (actors/structured_output/grammar_compiles.py)."""

    request_id: str
    constraint: StructuredOutputsParams


WorkerInbox = StepPlan | WorkerControl | CompileGrammar | Ping | Shutdown
