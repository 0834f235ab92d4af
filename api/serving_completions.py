"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n +
completion index, as OpenAI numbers them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from api.engine_requests import EngineRequests
from api.output import UsageCounter, prompt_logprobs_field, token_text
from api.protocol import CompletionRequest, Prompt
from api.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage, with_vllm_nulls
from api.serving_beam_search import beam_response, beam_usage, run_beam_searches
from api.serving import ServingContext, read_json, respond
from messages.common import CompletionOutput, Logprob, RequestOutput


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    ctx.require_generation("/v1/completions")
    body = await read_json(request, CompletionRequest, ctx.settings.max_body_bytes)
    model, lora_request = ctx.resolve_model(body.model_name)
    body.check_limits(ctx.client.config.model.vocab_size)
    params = None if body.use_beam_search else body.to_sampling_params()
    prompts = body.prompts()
    ctx.check_prompt_tokens(prompts)
    response_id, engine_ids = ctx.request_ids(request, body.request_id, "cmpl", len(prompts))
    echoes = await _echo_texts(ctx, prompts) if body.echo else None
    tokenizer = await ctx.client.get_tokenizer() if body.echo and body.logprobs is not None else None
    choices = _Choices(body, echoes, tokenizer, ctx.tokens_as_ids(body.return_tokens_as_token_ids))

    def whole_response(outputs: list[RequestOutput], usage: Usage) -> CompletionResponse:
        for prompt_index, output in enumerate(outputs):
            choices.note_prompt(prompt_index, output)
        return with_vllm_nulls(CompletionResponse(id=response_id, model=model, usage=usage,
                                                  choices=[choices.choice(prompt_index, completion, whole=output)
                                                           for prompt_index, output in enumerate(outputs)
                                                           for completion in output.outputs]))

    if body.use_beam_search:
        beam_params = body.beam_search_params(body.max_tokens, ctx.max_model_len)
        outputs = await run_beam_searches(ctx, request, [
            lambda prompt=prompt: ctx.client.beam_search(prompt, beam_params, lora_request=lora_request)
            for prompt in prompts], beam_params.beam_width)
        whole = whole_response(outputs, beam_usage(outputs))
        # streamed, each finished beam is a chunk (the choices are whole already)
        chunks = [CompletionResponse(id=response_id, model=model, created=whole.created, choices=[choice],
                                     usage=None if body.include_usage else UNSET) for choice in whole.choices]
        if body.include_usage:
            chunks.append(CompletionResponse(id=response_id, model=model, created=whole.created, choices=[],
                                             usage=whole.usage))
        return beam_response(body.stream, whole, chunks)
    requests = ctx.open(engine_ids, lambda engine_id, index: ctx.client.generate(
        ctx.engine_prompt(prompts[index], body.cache_salt), params, request_id=engine_id,
        add_special_tokens=body.add_special_tokens, priority=body.priority,
        lora_request=lora_request), params, request.headers)
    return await respond(request, requests, body.stream,
                         lambda: _chunks(ctx, response_id, model, body, requests, choices),
                         lambda outputs: whole_response(outputs, ctx.usage(requests)))


async def _echo_texts(ctx: ServingContext, prompts: list[Prompt]) -> list[str]:
    tokenizer = await ctx.client.get_tokenizer() if any(isinstance(p, list) for p in prompts) else None
    return [prompt if isinstance(prompt, str) else tokenizer.decode(prompt) for prompt in prompts]


class _Choices:
    """Builds choices from deltas or whole outputs, remembering per choice what was sent
    (the echoed prompt goes first, and logprobs' text_offset runs on across chunks)."""

    def __init__(self, body: CompletionRequest, echoes: list[str] | None, tokenizer, tokens_as_ids: bool) -> None:
        self.n = body.n
        self.wants_logprobs = body.logprobs is not None
        self.wants_token_ids = bool(body.return_token_ids)
        self.tokens_as_ids = tokens_as_ids
        self.echoes = echoes
        self.tokenizer = tokenizer  # set when the prompt's logprobs are echoed
        self.text_offsets: dict[int, int] = {}  # choice index -> characters sent so far
        # prompt index -> its prompt logprobs so far (chunked prefill spreads them over deltas)
        self.prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}
        self.prompt_token_ids: dict[int, list[int]] = {}

    def note_prompt(self, prompt_index: int, output: RequestOutput) -> None:
        """Keeps what a delta says about the prompt, for the echo of its logprobs."""
        if output.prompt_token_ids:
            self.prompt_token_ids[prompt_index] = output.prompt_token_ids
        if output.prompt_logprobs:
            self.prompt_logprobs.setdefault(prompt_index, []).extend(output.prompt_logprobs)

    def choice(self, prompt_index: int, completion: CompletionOutput,
               whole: RequestOutput | None = None) -> CompletionChoice:
        """The choice of a completion's delta (streaming) or whole output (whole: its request's)."""
        index = prompt_index * self.n + completion.index
        first = index not in self.text_offsets
        text = completion.text
        logprobs = CompletionLogprobs() if self.wants_logprobs else None
        offset = self.text_offsets.get(index, 0)
        if first and self.echoes is not None:
            echo = self.echoes[prompt_index]
            if logprobs is not None:
                self._add_prompt_logprobs(logprobs, prompt_index)
            text = echo + text
            offset = len(echo)
        if logprobs is not None:
            _add_logprobs(logprobs, completion.token_ids, completion.logprobs or [], offset, self.tokens_as_ids)
        self.text_offsets[index] = offset + len(completion.text)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                                  stop_reason=completion.stop_reason)
        if whole is not None and whole.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_field(whole.prompt_logprobs)
        if self.wants_token_ids:
            choice.token_ids = completion.token_ids
            if first:
                choice.prompt_token_ids = self.prompt_token_ids.get(prompt_index, [])
        return choice

    def _add_prompt_logprobs(self, logprobs: CompletionLogprobs, prompt_index: int) -> None:
        entries = self.prompt_logprobs.get(prompt_index, [])
        token_ids = self.prompt_token_ids.get(prompt_index, [])
        if entries and entries[0] is None:
            # the first prompt token has no logprob, and so no text from the engine
            first_text = (f"token_id:{token_ids[0]}" if self.tokens_as_ids
                          else self.tokenizer.decode(token_ids[:1]))
            logprobs.tokens.append(first_text)
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
            logprobs.text_offset.append(0)
            _add_logprobs(logprobs, token_ids[1:], entries[1:], len(first_text), self.tokens_as_ids)


def _add_logprobs(logprobs: CompletionLogprobs, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                  offset: int, tokens_as_ids: bool) -> None:
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id) if entry else None
        text = token_text(token_id, chosen, tokens_as_ids)
        logprobs.tokens.append(text)
        logprobs.token_logprobs.append(chosen.logprob if chosen else None)
        # the engine lists the sampled token first, then the top ones by rank
        logprobs.top_logprobs.append({token_text(top_id, lp, tokens_as_ids): lp.logprob
                                      for top_id, lp in entry.items()} if entry else None)
        logprobs.text_offset.append(offset)
        offset += len(text)


async def _chunks(ctx: ServingContext, response_id: str, model: str, body: CompletionRequest,
                  requests: EngineRequests, choices: _Choices) -> AsyncIterator[CompletionResponse]:
    created = int(time.time())
    usage_field = None if body.include_usage else UNSET  # OpenAI sends "usage": null until the last chunk
    counter = UsageCounter() if body.continuous_usage else None
    async for prompt_index, delta in requests.deltas():
        choices.note_prompt(prompt_index, delta)
        if counter is not None:
            counter.note_prompt(prompt_index, delta)
        for completion in delta.outputs:
            # tokens whose text is held back (a split character) make a chunk only for their token ids
            wants_tokens = choices.wants_logprobs or choices.wants_token_ids
            if not (completion.text or completion.finish_reason or (wants_tokens and completion.token_ids)):
                if counter is not None:
                    counter.add(prompt_index, completion)
                continue
            usage = usage_field
            if counter is not None:  # vLLM's continuous usage: this choice's tokens so far
                usage = counter.add(prompt_index, completion)
            yield CompletionResponse(id=response_id, model=model, created=created, usage=usage,
                                     choices=[choices.choice(prompt_index, completion)])
    if body.include_usage:
        yield CompletionResponse(id=response_id, model=model, created=created, choices=[], usage=ctx.usage(requests))
