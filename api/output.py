"""Pieces of responses that completions and chat build alike: vLLM's prompt_logprobs,
a logprob's token text (or "token_id:<id>"), and per-choice usage while streaming."""

from __future__ import annotations

from msgspec import UNSET

from api.responses import LogprobEntry, PromptLogprobsField, Usage
from messages.common import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


def prompt_logprobs_field(entries: PromptLogprobs | None) -> PromptLogprobsField:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: logprob}."""
    if entries is None:
        return UNSET
    return [None if entry is None else {token_id: LogprobEntry(lp.logprob, lp.rank, lp.decoded_token)
                                        for token_id, lp in entry.items()}
            for entry in entries]


def token_text(token_id: int, logprob: Logprob | None, as_token_ids: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 alone)."""
    if as_token_ids:
        return f"token_id:{token_id}"
    return (logprob.decoded_token if logprob else None) or ""


class UsageCounter:
    """vLLM's continuous usage stats: each streamed chunk carries its choice's usage so far
    (its prompt's tokens and the tokens that choice has generated)."""

    def __init__(self) -> None:
        self._num_prompt_tokens: dict[int, int] = {}  # prompt index -> its length
        self._num_generated: dict[tuple[int, int], int] = {}  # (prompt index, completion index) -> tokens

    def note_prompt(self, prompt_index: int, delta: RequestOutput) -> None:
        if delta.prompt_token_ids:
            self._num_prompt_tokens[prompt_index] = len(delta.prompt_token_ids)

    def add(self, prompt_index: int, completion: CompletionOutput) -> Usage:
        key = (prompt_index, completion.index)
        self._num_generated[key] = self._num_generated.get(key, 0) + len(completion.token_ids)
        num_prompt, num_generated = self._num_prompt_tokens.get(prompt_index, 0), self._num_generated[key]
        return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated)
