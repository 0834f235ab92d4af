"""Beam search over the engine's own requests, with vLLM's call shapes and Hugging Face's
selection rule.

Each step runs every live beam as one ordinary engine request: prompt + the beam's tokens,
max_tokens=1, greedy, asking for the top logprobs (troupe reports the model's raw
log-softmax). All beams of all prompts of a step go to the engine together, so they are
scheduled as one batch. Nothing is copied between beams: a step's requests find the full
KV blocks of their shared prefix (the prompt, and the tokens of common ancestors) in the
prefix cache and take one more reference on them in the block pool; only each beam's last
partial block is computed again.

Selection and scoring follow transformers' `_beam_search` (generation/utils.py), so that
`model.generate(num_beams=n, num_return_sequences=n, do_sample=False, ...)` on the same
weights returns the same beams in the same order:
  - the candidates are every (beam, token) scored by the beam's cumulative logprob plus the
    token's, best first; the first `beam_width` that do not stop continue as the beams;
  - a candidate stops on an EOS token (unless ignore_eos) or at the last allowed token;
    only a stopping candidate among the first `beam_width` enters the finished set, scored
    cumulative logprob / (generated tokens, EOS included) ** length_penalty; the finished
    set keeps the best `beam_width`, and is the result, best first;
  - the search ends at max_tokens, or once the finished set is full and (early_stopping=True)
    at once, or (False, HF's default) when the best live beam's cumulative logprob divided
    by its own length ** length_penalty cannot beat the worst finished score, or ("never")
    the same with max_tokens as the length when length_penalty > 0.
vLLM differs in two ways we do not copy: it scores by the whole sequence's length, prompt
included, and it keeps every EOS candidate, not only those among the best `beam_width`.

Candidates come from each beam's top `beam_width + number of EOS ids` tokens: enough for
the exact choice above, since at most that many of one beam's tokens can come before the
`beam_width`-th continuing candidate (HF looks at the top `max(2, 1 + EOS ids) * beam_width`
over all beams, which never changes the choice). Temperature has no effect on the beams
(as in vLLM V1, the logprobs are the model's own); it is accepted for vLLM's call shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from messages.common import (MAX_LOGPROBS, CompletionOutput, InvalidRequestError, Logprob, RequestOutput,
                             SamplingParams)

from actors.frontend.prompts import split_prompt
from messages.input_processor import ChatOptions

if TYPE_CHECKING:
    from actors.frontend.client import AsyncClient
    from actors.input_processor.processor import InputProcessor
    from messages.lora import LoRARequest

# A prompt as LLM.generate takes it, or vLLM's dict prompts.
BeamPrompt = str | list[int] | dict[str, Any]


class BeamSearchParams(msgspec.Struct, kw_only=True, frozen=True):
    """vLLM's beam search parameters, plus transformers' early_stopping (True, False or
    "never"; False is HF's default). Invalid values raise InvalidRequestError naming the
    field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_LOGPROBS, "beam_width",
                 f"must be an integer in [1, {MAX_LOGPROBS}], got {self.beam_width!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"must be a positive integer, got {self.max_tokens!r}")
        _require(_is_real(self.temperature) and self.temperature >= 0.0, "temperature",
                 f"must be a non-negative number, got {self.temperature!r}")
        _require(_is_real(self.length_penalty) and math.isfinite(self.length_penalty), "length_penalty",
                 f"must be a finite number, got {self.length_penalty!r}")
        _require(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
                 f"must be true, false or \"never\", got {self.early_stopping!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: tokens holds the prompt then the output (with its EOS token
    when it ended in one); logprobs has one {token_id: Logprob} per output token (the
    top tokens the beam was chosen among); text is the whole sequence's text, the EOS
    token's own text only when include_stop_str_in_output."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    stop_reason: int | str | None = None  # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's best beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(order=True)
class _Finished:
    sort_key: float  # -score, so that sorting puts the best first
    beam: BeamSearchSequence = field(compare=False)


class BeamSearch:
    """One prompt's search, as plain state: requests() are the next step's engine
    prompts (one per live beam), advance() takes their top logprobs, in the same order."""

    def __init__(self, prompt_token_ids: list[int], prompt: str | None, params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        # like a request's max_tokens, the output stops where the context ends
        self.max_new_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.running = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.finished: list[_Finished] = []
        self.num_generated = 0
        self.done = False

    @property
    def num_logprobs(self) -> int:
        """Top tokens needed per beam for the exact choice (see the module docstring)."""
        return self.params.beam_width + len(self.eos_token_ids)

    def requests(self) -> list[list[int]]:
        return [] if self.done else [beam.tokens for beam in self.running]

    def advance(self, top_logprobs: list[dict[int, Logprob]]) -> None:
        """One step: top_logprobs[i] holds running beam i's next-token logprobs."""
        assert not self.done and len(top_logprobs) == len(self.running)
        width = self.params.beam_width
        self.num_generated += 1
        last_step = self.num_generated >= self.max_new_tokens
        # 1. Every candidate, best cumulative logprob first; ties go to the earlier beam,
        #    then the lower token id, as the flat index of HF's topk over beams x vocab.
        candidates = sorted(
            ((beam.cum_logprob + entry.logprob, beam_index, token_id)
             for beam_index, (beam, entries) in enumerate(zip(self.running, top_logprobs))
             for token_id, entry in entries.items()),
            key=lambda c: (-c[0], c[1], c[2]))
        # 2. The first `width` candidates that do not stop continue; those that stop count
        #    only from among the first `width` (the rest are HF's spares and are dropped).
        next_running: list[BeamSearchSequence] = []
        for position, (cum_logprob, beam_index, token_id) in enumerate(candidates):
            if position >= width and (last_step or len(next_running) == width):
                break
            stops = last_step or token_id in self.eos_token_ids
            if stops and position >= width:
                continue
            parent = self.running[beam_index]
            beam = BeamSearchSequence(tokens=parent.tokens + [token_id],
                                      logprobs=parent.logprobs + [top_logprobs[beam_index]],
                                      cum_logprob=cum_logprob)
            if stops:
                self._finish(beam, token_id)
            else:
                next_running.append(beam)
        self.running = next_running
        self.done = last_step or self._cannot_improve()

    def _finish(self, beam: BeamSearchSequence, token_id: int) -> None:
        if token_id in self.eos_token_ids:
            beam.finish_reason, beam.stop_reason = "stop", token_id
        else:
            beam.finish_reason = "length"
        score = beam.cum_logprob / (self.num_generated ** self.params.length_penalty)
        # sorted() is stable: an equal score stays behind those already finished, as in HF's merge
        self.finished = sorted([*self.finished, _Finished(-score, beam)])[:self.params.beam_width]

    def _cannot_improve(self) -> bool:
        """HF's stopping rule once every finished slot is taken (see the module docstring)."""
        params = self.params
        if not self.running:
            return True  # no token but EOS left to any beam (a vocabulary smaller than the beam)
        if len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = self.num_generated
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            length = self.max_new_tokens
        best_running_score = self.running[0].cum_logprob / (length ** params.length_penalty)
        worst_finished_score = -self.finished[-1].sort_key
        return best_running_score <= worst_finished_score

    def output(self, tokenizer) -> BeamSearchOutput:
        """The finished beams, best first, with their text."""
        assert self.done
        sequences = [entry.beam for entry in self.finished]
        for beam in sequences:
            beam.text = tokenizer.decode(self._text_tokens(beam.tokens))
        return BeamSearchOutput(sequences)

    def request_output(self, request_id: str, tokenizer) -> RequestOutput:
        """The finished beams as one finished RequestOutput, one CompletionOutput per beam,
        best first (what the serving layer renders as choices)."""
        assert self.done
        num_prompt_tokens = len(self.prompt_token_ids)
        completions = [
            CompletionOutput(index=index, text=tokenizer.decode(self._text_tokens(beam.tokens)[num_prompt_tokens:]),
                             token_ids=beam.tokens[num_prompt_tokens:], cumulative_logprob=beam.cum_logprob,
                             logprobs=beam.logprobs, finish_reason=beam.finish_reason,
                             stop_reason=beam.stop_reason)
            for index, beam in enumerate(entry.beam for entry in self.finished)]
        return RequestOutput(request_id=request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=completions, finished=True)

    def _text_tokens(self, tokens: list[int]) -> list[int]:
        if tokens[-1] in self.eos_token_ids and not self.params.include_stop_str_in_output:
            return tokens[:-1]
        return tokens


class BeamSearchBatch:
    """The searches of several prompts, stepped together: each step's requests() go to the
    engine as one batch with step_params, and advance() takes their outputs in order."""

    def __init__(self, searches: list[BeamSearch], max_logprobs: int = MAX_LOGPROBS) -> None:
        self.searches = searches
        num_logprobs = max((search.num_logprobs for search in searches), default=1)
        if num_logprobs > max_logprobs:
            raise InvalidRequestError(
                f"beam_width plus the model's {num_logprobs - searches[0].params.beam_width} EOS tokens "
                f"must be at most max_logprobs ({max_logprobs}), got beam_width {searches[0].params.beam_width}",
                param="beam_width")
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=num_logprobs, ignore_eos=True)
        self._num_requests_per_search: list[int] = []

    @classmethod
    def from_prompts(cls, prompts: Sequence[BeamPrompt], params: BeamSearchParams, inputs: InputProcessor,
                     eos_token_ids: Sequence[int]) -> BeamSearchBatch:
        """Tokenizes and checks every prompt first, so a bad one raises InvalidRequestError
        before any request is sent."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be BeamSearchParams, got {type(params).__name__}",
                                      param="params")
        params.validate()
        step_check = SamplingParams(max_tokens=1)
        searches = []
        for prompt in prompts:
            text, token_ids = inputs.process(split_prompt(prompt)[0], step_check)
            searches.append(BeamSearch(token_ids, text, params, eos_token_ids, inputs.max_model_len))
        return cls(searches, inputs.max_logprobs)

    @property
    def done(self) -> bool:
        return all(search.done for search in self.searches)

    def requests(self) -> list[list[int]]:
        per_search = [search.requests() for search in self.searches]
        self._num_requests_per_search = [len(requests) for requests in per_search]
        return [tokens for requests in per_search for tokens in requests]

    def per_request(self, per_search: Sequence[Any]) -> list[Any]:
        """One value per search (a prompt's LoRA adapter...) as one per request of the last requests()."""
        return [value for value, count in zip(per_search, self._num_requests_per_search) for _ in range(count)]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """outputs: the engine's answers to the last requests(), in order."""
        start = 0
        for search, num_requests in zip(self.searches, self._num_requests_per_search):
            if num_requests:
                search.advance([_top_logprobs(output) for output in outputs[start:start + num_requests]])
            start += num_requests
        assert start == len(outputs), f"{len(outputs)} outputs for {start} beam requests"


class AsyncBeamSearch:
    """AsyncClient's beam search (AsyncClient inherits these methods): each step sends the
    live beams through generate_batch at once, as ordinary requests the scheduler batches.
    Cancelling the call aborts the step's requests."""

    async def beam_search(self: AsyncClient, prompt: BeamPrompt, params: BeamSearchParams,
                          request_id: str | None = None, lora_request: LoRARequest | None = None) -> RequestOutput:
        """The finished beams of one prompt (a string, token ids or a vLLM dict prompt) as one
        finished RequestOutput: outputs[i] is beam i, best first, with its text (no EOS text
        unless include_stop_str_in_output), token_ids (the output, its EOS included),
        cumulative_logprob, logprobs and finish_reason ("stop" on EOS, else "length").
        Raises InvalidRequestError for a bad prompt or parameter, EngineDeadError when the
        engine is dead. lora_request: the adapter every beam runs with."""
        inputs = await self._beam_search_inputs()
        batch = BeamSearchBatch.from_prompts([prompt], params, inputs, self.config.model.eos_token_ids)
        return await self._run_beam_search(batch, request_id, inputs.tokenizer, lora_request)

    async def beam_search_chat(self: AsyncClient, messages: list[dict[str, Any]], params: BeamSearchParams,
                               request_id: str | None = None, add_generation_prompt: bool = True, *,
                               continue_final_message: bool = False, chat_template: str | None = None,
                               chat_template_kwargs: dict[str, Any] | None = None,
                               documents: list[dict[str, Any]] | None = None,
                               tools: list[dict[str, Any]] | None = None,
                               lora_request: LoRARequest | None = None) -> RequestOutput:
        """beam_search() for a conversation, rendered with the chat template (chat_template,
        else the model's) and chat()'s options."""
        inputs = await self._beam_search_inputs()
        options = ChatOptions(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                              chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                              documents=documents, tools=tools)
        token_ids = inputs.render_chat(messages, options)
        batch = BeamSearchBatch.from_prompts([token_ids], params, inputs, self.config.model.eos_token_ids)
        return await self._run_beam_search(batch, request_id, inputs.tokenizer, lora_request)

    async def _beam_search_inputs(self: AsyncClient) -> InputProcessor:
        from actors.input_processor.processor import InputProcessor

        self.check_health()
        tokenizer = await self.get_tokenizer()
        return InputProcessor(tokenizer, self.config.model.vocab_size, self.config.scheduler.max_model_len,
                              self.config.max_logprobs)

    async def _run_beam_search(self: AsyncClient, batch: BeamSearchBatch, request_id: str | None,
                               tokenizer, lora_request: LoRARequest | None) -> RequestOutput:
        request_id = self._new_id(request_id)
        while not batch.done:
            batch.advance(await self.generate_batch(batch.requests(), batch.step_params, use_tqdm=False,
                                                    lora_request=lora_request))
        return batch.searches[0].request_output(request_id, tokenizer)


def _top_logprobs(output: RequestOutput) -> dict[int, Logprob]:
    completion = output.outputs[0]
    if not completion.logprobs:
        raise RuntimeError(f"beam request {output.request_id} ended without logprobs "
                           f"(finish_reason {completion.finish_reason!r})")
    return completion.logprobs[0]


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} {message}", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
