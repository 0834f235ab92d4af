"""Per-sequence scheduling state.

A request with n completions becomes n Sequences, each scheduled on its own with its
own block table; the worker only ever sees sequence ids (`seq_id`). A Sequence's
tokens are its prompt followed by the tokens sampled so far; `num_computed_tokens` of
them have their KV in the blocks of `block_ids`.
"""

from __future__ import annotations

import enum

from actors.scheduler.block_pool import BlockHash, hash_block_tokens
from messages.common import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # new, or preempted (then its KV is gone and is recomputed)
    RUNNING = enum.auto()  # holds blocks; scheduled every step the budget allows
    FINISHED = enum.auto()  # stopped, length-capped or aborted; blocks returned


class Sequence:
    """One completion of a request, as the scheduler tracks it."""

    def __init__(self, seq_id: str, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, max_seq_len: int) -> None:
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
        # Leading tokens whose KV is in block_ids, or is being computed by a plan in flight.
        self.num_computed_tokens = 0
        # Tokens sampled by plans in flight that the scheduler has not seen yet: the worker
        # feeds each to the next decode itself (async scheduling).
        self.num_pending_tokens = 0
        self.generation = 0  # bumped when the blocks are released: results of older plans are stale
        self.num_cached_blocks = 0  # leading blocks already offered to the prefix cache
        self.block_hashes: list[BlockHash] = []  # keys of its leading full blocks, grown lazily
        self.root_hash: BlockHash | None = None  # the first block's parent: set by a cache_salt
        self.sent_to_worker = False  # the worker holds state for seq_id
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.was_admitted = False
        self.first_scheduled_time: float | None = None  # time.monotonic() at its first admission
        self.prompt_computed = False  # the whole prompt was computed at least once
        # n > 1: the sibling whose prompt blocks this one waits for, to share them.
        self.prefix_source: Sequence | None = None
        self.next_prompt_logprob_pos = 1  # first prompt position whose logprob is not yet delivered
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

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

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Prefix-cache keys of every full block of its known tokens (computed or not)."""
        num_full_blocks = len(self.token_ids) // block_size
        for block_index in range(len(self.block_hashes), num_full_blocks):
            parent_hash = self.block_hashes[-1] if self.block_hashes else self.root_hash
            start = block_index * block_size
            self.block_hashes.append(hash_block_tokens(parent_hash, self.token_ids[start:start + block_size]))
        return self.block_hashes

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

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
