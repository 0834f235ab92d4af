"""Detokenizer logic: turns the scheduler's NewTokens into RequestOutputs.

Owns one decode stream per live completion (the `tokenizers` DecodeStream handles
multi-byte characters split across tokens), matches stop strings, and reports which
completions a stop string ended so the scheduler can finish them. Plain object: the
offline LLM calls it in-process; the detokenizer actor wraps it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from messages.common import CompletionOutput, Logprob, RequestOutput, SamplingParams
from messages.detokenizer import NewTokens
from messages.scheduler import TokenLogprobs


@dataclass
class StopMatch:
    request_id: str
    index: int
    stop: str


class CompletionDecoder:
    """Text and stop-string state of one completion."""

    def __init__(self, index: int, params: SamplingParams) -> None:
        self.output = CompletionOutput(index=index)
        self.params = params
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.want_logprobs = params.logprobs is not None
        if self.want_logprobs:
            self.output.logprobs = []
            self.output.cumulative_logprob = 0.0

    def append(self, tokenizer, update: NewTokens) -> str | None:
        """Adds the tokens' text; returns the stop string that matched, if any."""
        output = self.output
        output.token_ids.extend(update.new_token_ids)
        hidden_last = (update.finish_reason == "stop" and isinstance(update.stop_reason, int)
                       and not self.params.include_stop_str_in_output)
        tokens = update.new_token_ids[:-1] if hidden_last else update.new_token_ids
        old_len = len(output.text)
        for token_id in tokens:
            piece = self.stream.step(tokenizer.backend_tokenizer, token_id)
            if piece:
                output.text += piece
        if self.want_logprobs and update.new_logprobs:
            for entry in update.new_logprobs:
                output.logprobs.append(to_logprob_dict(tokenizer, entry))
                output.cumulative_logprob += entry.logprobs[0]
        return self._match_stop(old_len)

    def _match_stop(self, old_len: int) -> str | None:
        text = self.output.text
        for stop in self.params.stop_strings:
            # only a match that ends in the new text is new
            position = text.find(stop, max(0, old_len - len(stop) + 1))
            if position != -1:
                end = position + len(stop) if self.params.include_stop_str_in_output else position
                self.output.text = text[:end]
                return stop
        return None


def to_logprob_dict(tokenizer, entry: TokenLogprobs) -> dict[int, Logprob]:
    return {token_id: Logprob(logprob, rank, tokenizer.decode([token_id]))
            for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}


@dataclass
class RequestState:
    output: RequestOutput
    completions: list[CompletionDecoder]
    num_finished: int = 0
    prompt_logprobs: list = field(default_factory=list)


class OutputProcessor:
    """Keeps a RequestOutput per live request, cumulative (what offline generate returns)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        output = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids)
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = [None]
        completions = [CompletionDecoder(i, params) for i in range(params.n)]
        output.outputs = [c.output for c in completions]
        self.requests[request_id] = RequestState(output, completions)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for completion in state.completions:
            if completion.output.finish_reason is None:
                completion.output.finish_reason = "abort"
        state.output.finished = True
        return state.output

    def process(self, updates: list[NewTokens]) -> tuple[list[RequestOutput], list[StopMatch]]:
        """Applies one step's updates. Returns the requests that finished and the stop-string
        matches the scheduler must be told about."""
        finished: list[RequestOutput] = []
        stops: list[StopMatch] = []
        for update in updates:
            state = self.requests.get(update.request_id)
            if state is None:
                continue  # aborted meanwhile
            output = state.output
            output.num_cached_tokens = max(output.num_cached_tokens, update.num_cached_tokens)
            if update.prompt_logprobs and update.index == 0 and output.prompt_logprobs is not None:
                output.prompt_logprobs += [to_logprob_dict(self.tokenizer, e) for e in update.prompt_logprobs]
            completion = state.completions[update.index]
            if completion.output.finish_reason is not None:
                continue
            stop = completion.append(self.tokenizer, update)
            if stop is not None:
                completion.output.finish_reason, completion.output.stop_reason = "stop", stop
                stops.append(StopMatch(update.request_id, update.index, stop))
            elif update.finish_reason is not None:
                completion.output.finish_reason = update.finish_reason
                completion.output.stop_reason = update.stop_reason
            if completion.output.finish_reason is not None:
                state.num_finished += 1
                if state.num_finished == len(state.completions):
                    output.finished = True
                    finished.append(self.requests.pop(update.request_id).output)
        return finished, stops
