"""Per-sequence scheduling state.

A request with n completions becomes n Sequences, each scheduled on its own with its
own block table; the worker only ever sees sequence ids (`seq_id`). A Sequence's
tokens are its prompt followed by the tokens sampled so far; `num_computed_tokens` of
them have their KV in the blocks of `block_ids`. The block fields (block_ids,
block_hashes, num_cached_blocks) are written by the KVCacheManager alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from actors.scheduler.block_pool import BlockHash
from messages.common import SamplingParams
from messages.lora import LoRARequest
from messages.pooling import PoolingParams
from messages.scheduler import TokenLogprobs

if TYPE_CHECKING:
    from actors.scheduler.kv_tiers import SwappedKV


@dataclass(frozen=True, slots=True)
class ExtraHashKeys:
    """What a request's KV depends on besides its token ids: the prefix cache shares a
    block only between requests whose keys are equal (vLLM's block-hash extra keys)."""

    adapter_id: str | None = None  # the LoRA adapter the request runs with, None for the base model
    cache_salt: str | None = None  # the client's salt: only requests sending the same one share
    # (content hash, first placeholder position, placeholder count) per multimodal input:
    # equal placeholder tokens stand for different images
    mm_inputs: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, adapter_id: str | None, cache_salt: str | None, mm_inputs: list | None = None
           ) -> ExtraHashKeys | None:
        """A request's keys (mm_inputs: its MultiModalInputs); None when it has none."""
        if adapter_id is None and cache_salt is None and not mm_inputs:
            return None
        return cls(adapter_id, cache_salt, tuple((mm.content_hash, mm.offset, mm.length) for mm in mm_inputs or ()))


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # new, or preempted (then its KV is gone and is recomputed)
    RUNNING = enum.auto()  # holds blocks; scheduled every step the budget allows
    FINISHED = enum.auto()  # stopped, length-capped or aborted; blocks returned


class Sequence:
    """One completion of a request, as the scheduler tracks it."""

    def __init__(self, seq_id: str, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, max_seq_len: int, extra_hash_keys: ExtraHashKeys | None = None) -> None:
        self.seq_id = seq_id  # the id the worker knows: request_id, or f"{request_id}#{index}"
        self.request_id = request_id  # the user's request id
        self.index = index  # which of the request's n completions
        self.params = params  # with n == 1 and this completion's seed
        self.token_ids = list(prompt_token_ids)  # prompt, then sampled tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens this sequence may reach: max_model_len, the whole KV pool, or
        # prompt + max_tokens, whichever is least.
        self.max_num_tokens = max_seq_len
        if params.max_tokens is not None:
            self.max_num_tokens = min(max_seq_len, self.num_prompt_tokens + params.max_tokens)

        self.status = SequenceStatus.WAITING
        self.block_ids: list[int] = []  # block table: block i holds tokens [i*bs, (i+1)*bs)
        # with layer groups (hybrid_kv_cache.py): the other groups' tables, and each group's
        # leading entries a sliding window has freed
        self.group_block_ids: list[list[int]] = []
        self.num_skipped_blocks: list[int] = []
        # Leading tokens whose KV is in block_ids, or is being computed by a plan in flight.
        self.num_computed_tokens = 0
        # Tokens sampled by plans in flight that the scheduler has not seen yet: the worker
        # feeds each to the next decode itself (async scheduling).
        self.num_pending_tokens = 0
        # Drafts granted to plans in flight (speculative decoding): the worker may be up to
        # this many tokens ahead of num_computed_tokens (actors/scheduler/speculation.py).
        self.num_drafts_in_flight = 0
        # speculation: decodes to skip granting drafts, after grants the worker found nothing for
        self.num_dry_grants_to_skip = 0
        self.dry_backoff = 0  # the last skip's length: doubles while grants stay dry
        self.generation = 0  # bumped when the blocks are released: results of older plans are stale
        self.num_cached_blocks = 0  # leading blocks already offered to the prefix cache
        self.block_hashes: list[BlockHash] = []  # keys of its leading full blocks, grown lazily
        self.extra_hash_keys = extra_hash_keys  # None: its KV depends on its tokens alone
        self.lora_request: LoRARequest | None = None  # the adapter it runs with
        self.pooling_params: PoolingParams | None = None  # a pooling request: prefill only, then pooled
        self.mm_inputs: list | None = None  # its images (messages.multimodal.MultiModalInput), for the workers
        self.pools_every_token = False  # its pooling reads every prompt row (MEAN, CLS, ALL), not just the last
        self.times_overtaken = 0  # later sequences admitted while max_loras held it back
        self.priority = 0  # lower is served first (the priority policy; 0 under FCFS)
        self.arrival_order = 0  # the scheduler's count of requests added before this one
        self.sent_to_worker = False  # the worker holds state for seq_id
        self.swapped: SwappedKV | None = None  # waiting with its KV in the host tier (kv_tiers.py)
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.was_admitted = False
        self.first_scheduled_time: float | None = None  # time.monotonic() at its first admission
        self.prompt_computed = False  # the whole prompt was computed at least once
        # n > 1: the sibling whose prompt blocks this one waits for, to share them.
        self.prefix_source: Sequence | None = None
        self.next_prompt_logprob_pos = 1  # first prompt position whose logprob is not yet delivered
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # the scheduler's per-step shortcuts (updates.py), set when it adds the sequence: the
        # token ids that may stop it (a sampled token outside them cannot), and whether its
        # samples need nothing but the token (no logprobs, no pooling)
        self.stopping_token_ids: frozenset[int] = frozenset()
        self.decodes_plainly = False

    def must_wait(self, ids_to_drop: dict[str, None]) -> bool:
        """Whether its admission must wait: its id is reused and the worker has yet to drop
        the old state (ids_to_drop), or (n > 1) the sibling whose prompt blocks it shares
        has yet to compute them."""
        if self.seq_id in ids_to_drop:
            return True
        source = self.prefix_source
        if source is not None and (source.prompt_computed or source.is_finished):
            self.prefix_source = source = None
        return source is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled by plans still in flight."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def last_token_in_flight(self) -> bool:
        """Its last allowed token is being sampled: computing more would overshoot."""
        return self.num_pending_tokens > 0 and self.num_total_tokens >= self.max_num_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all delivered. Such a sequence skips
        prefix-cache hits: a cached token's logprob is never computed."""
        return (self.params.prompt_logprobs is not None
                and self.next_prompt_logprob_pos < self.num_prompt_tokens)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether it may start from cached blocks: not when it owes prompt logprobs or pools
        every prompt row, as a cached token's logprob or hidden state is never computed."""
        return not self.owes_prompt_logprobs and not self.pools_every_token

    def take_prompt_logprobs(self, num_computed_before: int,
                             entries: list[TokenLogprobs] | None) -> list[TokenLogprobs] | None:
        """The prompt logprobs of this step not delivered before. Entry i is the logprob
        of prompt position num_computed_before + 1 + i; a sequence recomputed after a
        preemption gets some positions twice, and they are sent once."""
        if not entries or self.params.prompt_logprobs is None:
            return None
        first_pos = num_computed_before + 1
        start = max(0, self.next_prompt_logprob_pos - first_pos)
        end = max(start, min(len(entries), self.num_prompt_tokens - first_pos))
        self.next_prompt_logprob_pos = max(self.next_prompt_logprob_pos, first_pos + end)
        return entries[start:end] or None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def params_stop_token_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The token ids stop_condition() may stop at: the stop token ids, and EOS unless ignored."""
        eos = () if self.params.ignore_eos else eos_token_ids
        return frozenset((*(self.params.stop_token_ids or ()), *eos))

    def stop_condition(self, eos_token_ids: tuple[int, ...]) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) when the last sampled token ends the sequence.

        A stop token or EOS ends it only once min_tokens outputs exist; both are checked
        before the length limits, so a stop on the last allowed token reads "stop"."""
        last_token_id = self.token_ids[-1]
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            if params.stop_token_ids and last_token_id in params.stop_token_ids:
                return "stop", last_token_id
            if not params.ignore_eos and last_token_id in eos_token_ids:
                return "stop", None
        if self.num_tokens >= self.max_num_tokens:
            return "length", None
        return None

    def finish(self, finish_reason: str, stop_reason: int | str | None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, kv_cache_tokens: int, kv_cache_shape: str,
                      pooling: bool) -> None:
    """ValueError when a prompt can never run: a generation prompt needs room for one output
    token, a pooling prompt only for itself."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt_token_ids must not be empty")
    room = "" if pooling else ", which leaves no room for output"
    if num_prompt_tokens > max_model_len - (0 if pooling else 1):
        raise ValueError(f"prompt has {num_prompt_tokens} tokens{room}: max_model_len is {max_model_len}"
                         + ("" if pooling else " (prompt + output tokens)"))
    if num_prompt_tokens > kv_cache_tokens - (0 if pooling else 1):
        raise ValueError(f"prompt has {num_prompt_tokens} tokens{room} in the KV cache: it holds "
                         f"{kv_cache_tokens} tokens ({kv_cache_shape})")


def make_sequences(request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_seq_len: int,
                   share_prefix: bool, extra_hash_keys: ExtraHashKeys | None = None) -> list[Sequence]:
    """A request's n sequences. Each gets its own seed (seed + index); prompt logprobs
    belong to the request, so only completion 0 computes them, which also lets its
    siblings take the prompt from the prefix cache (share_prefix: they wait for it)."""
    sequences = []
    for index in range(params.n):
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        seed = params.seed if params.seed is None else params.seed + index
        prompt_logprobs = params.prompt_logprobs if index == 0 else None
        seq_params = msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
        sequences.append(Sequence(seq_id, request_id, index, prompt_token_ids, seq_params, max_seq_len,
                                  extra_hash_keys))
    for seq in sequences:
        if share_prefix and seq is not sequences[0]:
            # it waits until the first has computed (and cached) the prompt, then computes
            # only the prompt's last partial block
            seq.prefix_source = sequences[0]
    return sequences
