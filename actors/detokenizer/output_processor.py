"""Detokenization: the scheduler's NewTokens become RequestOutput deltas.

OutputProcessor is the plain logic (the offline engine calls it in-process). It owns one
incremental decoder per live completion (incremental_decode.py; byte_level_decode.py for
byte-level BPE), which holds back a UTF-8 character split across tokens, so the streamed
pieces concatenate to exactly the decode of all ids. It matches stop strings,
holding back text that may be the start of one while streaming, and reports the
completions a stop string ended so the scheduler can finish them.

Most updates are one token of a request with one completion, no stop strings and no
logprobs, that goes on: process() gives those their delta at once (append_token), with
no tokenizer call when the decoder knows the token's text, as it runs once per sequence
and step.

The actor around it is actor.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from actors.detokenizer.byte_level_decode import ByteLevelDecoder
from actors.detokenizer.incremental_decode import IncrementalDecoder, decoder_factory
from actors.detokenizer.merge_outputs import merge_delta  # noqa: F401 - re-exported: where callers import it
from actors.detokenizer.stop_strings import StopStrings
from messages.common import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from messages.detokenizer import NewTokens, StepOutputs
from messages.scheduler import TokenLogprobs


@dataclass
class StopMatch:
    request_id: str
    index: int
    stop: str


class TokenTexts:
    """The text of single tokens, for logprobs; memoized, as the same few thousand ids
    come up again and again."""

    def __init__(self, backend) -> None:
        self.backend = backend  # a `tokenizers` Tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    def logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return {token_id: Logprob(logprob, rank, self(token_id))
                for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}


class CompletionDecoder:
    """Text, stop-string and delivery state of one completion."""

    def __init__(self, index: int, params: SamplingParams, decoder: IncrementalDecoder | ByteLevelDecoder) -> None:
        self.index = index
        self.params = params
        self.decoder = decoder
        # its tokens need no stop-string matching and no logprobs: append_token() may take them
        self.plain = not params.stop_strings and params.logprobs is None
        self._text = ""  # what may be shown: stable decoded text, cut at a stop string (the text property)
        self._text_is_behind = False  # append_token() added to the decoder's stable text only
        # the stop strings' progress through text, advanced by what each token adds (stop_strings.py)
        self.stop_strings = StopStrings(params.stop_strings) if params.stop_strings else None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # what earlier deltas carried: text[:num_sent_chars], token_ids[:num_sent_tokens], ...
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.num_sent_logprobs = 0

    def append(self, token_texts: TokenTexts, update: NewTokens) -> str | None:
        """Adds the tokens and their text; returns the stop string that matched, if any.
        Several tokens at once (a speculated step's accepted drafts) are matched one by
        one, so a stop string ends the output at the token that completed it, as it would
        have without speculation: the tokens after it are dropped."""
        if len(update.new_token_ids) > 1 and self.params.stop_strings:
            last = len(update.new_token_ids) - 1
            for i, token_id in enumerate(update.new_token_ids):
                one = msgspec.structs.replace(
                    update, new_token_ids=[token_id],
                    new_logprobs=update.new_logprobs[i:i + 1] if update.new_logprobs else update.new_logprobs,
                    finish_reason=update.finish_reason if i == last else None,
                    stop_reason=update.stop_reason if i == last else None)
                stop = self._append(token_texts, one)
                if stop is not None:
                    return stop
            return None
        return self._append(token_texts, update)

    def append_token(self, token_id: int) -> str | None:
        """A plain completion's unfinished step of one token whose text needs no decode
        (IncrementalDecoder.add_token): appends it and returns its text, which is the whole
        of the step's delta (nothing is held back without stop strings), counted as sent;
        None, and nothing changed, when append() must take it."""
        piece = self.decoder.add_token(token_id)
        if piece is None:
            return None
        self.token_ids.append(token_id)
        # text catches up with the decoder when read: copying the text so far each step
        # would make a step's cost grow with the output's length
        self._text_is_behind = True
        self.num_sent_chars += len(piece)
        self.num_sent_tokens = len(self.token_ids)
        return piece

    @property
    def text(self) -> str:
        if self._text_is_behind:  # (a plain completion: its text is all of the decoder's stable text)
            self._text, self._text_is_behind = self.decoder.stable_text, False
        return self._text

    @text.setter
    def text(self, text: str) -> None:
        self._text, self._text_is_behind = text, False

    def _append(self, token_texts: TokenTexts, update: NewTokens) -> str | None:
        self.token_ids.extend(update.new_token_ids)
        # a stop token id or EOS ends the text without being part of it (as in vLLM)
        hidden_last = (update.finish_reason == "stop" and not isinstance(update.stop_reason, str)
                       and not self.params.include_stop_str_in_output)
        old_len = len(self.text)
        self.decoder.add(update.new_token_ids[:-1] if hidden_last else update.new_token_ids)
        # once the sequence has ended, nothing more can complete a split character
        self.text = self.decoder.text if update.finish_reason is not None else self.decoder.stable_text
        if self.stop_strings is not None:  # (text only grows: the decoder's stable text is a prefix of the whole)
            self.stop_strings.feed(self.text[old_len:])
        if self.logprobs is not None and update.new_logprobs:
            for entry in update.new_logprobs:
                self.logprobs.append(token_texts.logprob_dict(entry))
                self.cumulative_logprob += entry.logprobs[0]
        return self._match_stop(old_len)

    def _match_stop(self, old_len: int) -> str | None:
        if self.stop_strings is None or not self.stop_strings.completed:
            return None
        for index, stop in enumerate(self.params.stop_strings):
            if index not in self.stop_strings.completed:
                continue
            # only a match that ends in the new text is new (the first stop string listed wins, as before)
            position = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if position != -1:
                end = position + len(stop) if self.params.include_stop_str_in_output else position
                self.text = self.text[:end]
                return stop
        return None

    def finish(self, finish_reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    def _held_back_chars(self) -> int:
        """How many trailing characters could still grow into a stop string."""
        return 0 if self.stop_strings is None else self.stop_strings.held_back()

    def take_delta(self) -> CompletionOutput:
        """What is new since the last delta (all of it once finished)."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self._held_back_chars()
        end = max(end, self.num_sent_chars)
        delta = CompletionOutput(index=self.index, text=self.text[self.num_sent_chars:end],
                                 token_ids=self.token_ids[self.num_sent_tokens:],
                                 cumulative_logprob=self.cumulative_logprob,
                                 finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        if self.logprobs is not None:
            delta.logprobs = self.logprobs[self.num_sent_logprobs:]
            self.num_sent_logprobs = len(self.logprobs)
        self.num_sent_chars = end
        self.num_sent_tokens = len(self.token_ids)
        return delta

    def whole(self) -> CompletionOutput:
        """Everything so far, as its deltas add up once it finished (then none is held back)."""
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, make_decoder: Callable[[], IncrementalDecoder | ByteLevelDecoder]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.completions = [CompletionDecoder(i, params, make_decoder()) for i in range(params.n)]
        # its one completion when plain, once the request's first delta went out: process()
        # gives that completion's one-token steps their deltas the short way
        self.plain_completion: CompletionDecoder | None = None
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.new_prompt_logprobs: list[dict[int, Logprob] | None] = []  # not yet in a delta
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []  # all of them, for whole_output()
        self.got_prompt_logprobs = False
        self.num_cached_tokens = 0
        self.num_finished = 0
        self.sent_first = False
        self.first_scheduled_time: float | None = None
        self.new_metrics: RequestMetrics | None = None  # not yet in a delta

    def note_first_scheduled(self, first_scheduled_time: float) -> None:
        """A completion was first scheduled; the request was when the first of them was."""
        if self.first_scheduled_time is None or first_scheduled_time < self.first_scheduled_time:
            self.first_scheduled_time = first_scheduled_time
            self.new_metrics = RequestMetrics(first_scheduled_time=first_scheduled_time)

    def whole_output(self) -> RequestOutput:
        """The request's whole output once it finished or was aborted: what merging all its
        deltas gives (merge_delta), built from the state instead."""
        metrics = RequestMetrics(first_scheduled_time=self.first_scheduled_time) \
            if self.first_scheduled_time is not None else None
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs or None,
                             outputs=[completion.whole() for completion in self.completions],
                             finished=all(c.finish_reason is not None for c in self.completions),
                             num_cached_tokens=self.num_cached_tokens, metrics=metrics)


class OutputProcessor:
    """Keeps the decoding state of every live request and turns each step's NewTokens into
    one RequestOutput delta per request that changed.

    makes_deltas=False is for a caller that wants each request's whole output when it ends
    (RequestState.whole_output; the offline engine), not the text step by step: a plain
    step then makes no delta (the others still do, one carries the finish)."""

    def __init__(self, tokenizer, makes_deltas: bool = True) -> None:
        self.makes_deltas = makes_deltas
        # a transformers tokenizer or a `tokenizers` Tokenizer: only the latter's decode is used
        self.backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.token_texts = TokenTexts(self.backend)
        self.requests: dict[str, RequestState] = {}
        # skip_special_tokens -> what makes a completion's decoder (sharing what it learns of each token)
        self._decoder_factories: dict[bool, Callable[[], IncrementalDecoder | ByteLevelDecoder]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        skip = params.skip_special_tokens
        if skip not in self._decoder_factories:
            self._decoder_factories[skip] = decoder_factory(self.backend, skip)
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params,
                                                 self._decoder_factories[skip])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forgets the request; returns its last delta, every unfinished completion
        marked "abort", or None when it was not live."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish("abort", None)
        return self._delta(state, state.completions, finished=True)

    def process(self, step: StepOutputs) -> tuple[list[RequestOutput], list[StopMatch]]:
        """Applies one step's outputs. Returns the deltas and the stop-string matches the
        scheduler must be told about."""
        deltas: list[RequestOutput] = []
        updates = step.updates
        requests, makes_deltas = self.requests, self.makes_deltas
        for request_id, index, token_id in zip(step.decode_request_ids, step.decode_indexes, step.decode_token_ids):
            state = requests.get(request_id)
            if state is None:
                continue  # aborted meanwhile
            # most of a step: a plain completion gains one token and goes on; its delta at once
            completion = state.plain_completion
            if completion is not None and (text := completion.append_token(token_id)) is not None:
                if makes_deltas:
                    output = CompletionOutput(index=completion.index, text=text, token_ids=[token_id])
                    deltas.append(RequestOutput(request_id=request_id, prompt=state.prompt, outputs=[output],
                                                num_cached_tokens=state.num_cached_tokens))
                continue
            if updates is step.updates:
                updates = list(updates)
            updates.append(NewTokens(request_id, index, [token_id]))
        return deltas, self._apply_updates(updates, deltas)

    def _apply_updates(self, updates: list[NewTokens], deltas: list[RequestOutput]) -> list[StopMatch]:
        """The general path: each update applied to its completion, one delta per request
        (appended to deltas); the stop strings that matched."""
        # request_id -> (its delta's place in deltas, its completions that changed)
        changed: dict[str, tuple[int, list[CompletionDecoder]]] = {}
        stops: list[StopMatch] = []
        for update in updates:
            state = self.requests.get(update.request_id)
            if state is None:
                continue  # aborted meanwhile
            state.num_cached_tokens = max(state.num_cached_tokens, update.num_cached_tokens)
            if update.first_scheduled_time is not None:
                state.note_first_scheduled(update.first_scheduled_time)
            if update.prompt_logprobs and state.wants_prompt_logprobs:
                if not state.got_prompt_logprobs:
                    state.new_prompt_logprobs.append(None)  # the first prompt token has none
                    state.prompt_logprobs.append(None)
                    state.got_prompt_logprobs = True
                new = [self.token_texts.logprob_dict(e) for e in update.prompt_logprobs]
                state.new_prompt_logprobs += new
                state.prompt_logprobs += new
            if update.request_id not in changed:
                changed[update.request_id] = (len(deltas), [])
                deltas.append(None)  # (filled below)
            completions = changed[update.request_id][1]
            completion = state.completions[update.index]
            if completion.finish_reason is not None:
                continue
            completions.append(completion)
            stop = completion.append(self.token_texts, update)
            if stop is not None:
                completion.finish("stop", stop)
                stops.append(StopMatch(update.request_id, update.index, stop))
            elif update.finish_reason is not None:
                completion.finish(update.finish_reason, update.stop_reason)
            if completion.finish_reason is not None:
                state.num_finished += 1
        for request_id, (position, completions) in changed.items():
            state = self.requests[request_id]
            finished = state.num_finished == len(state.completions)
            if finished:
                del self.requests[request_id]
            deltas[position] = self._delta(state, completions, finished)
        return stops

    @staticmethod
    def _delta(state: RequestState, completions: list[CompletionDecoder], finished: bool) -> RequestOutput:
        delta = RequestOutput(request_id=state.request_id, prompt=state.prompt,
                              outputs=[c.take_delta() for c in completions], finished=finished,
                              num_cached_tokens=state.num_cached_tokens)
        if not state.sent_first:
            delta.prompt_token_ids = state.prompt_token_ids
            state.sent_first = True
            if len(state.completions) == 1 and state.completions[0].plain:
                state.plain_completion = state.completions[0]
        if state.new_prompt_logprobs:
            delta.prompt_logprobs, state.new_prompt_logprobs = state.new_prompt_logprobs, []
        if state.new_metrics is not None:
            delta.metrics, state.new_metrics = state.new_metrics, None
        return delta
