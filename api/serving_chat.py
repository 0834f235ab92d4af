"""POST /v1/chat/completions: one engine request, rendered with the chat template by the
input processor; n choices.

The reply's role is the server's --response-role, or, when the request continues its
last message (no generation prompt), that message's role, as vLLM. With echo, a reply
whose role is the last message's starts with that message's content.

With tools (api/tool_calls.py) or a reasoning parser (api/reasoning/), each choice's text
is read by api/chat_parsing.py: reasoning into `reasoning_content`, calls into
`tool_calls` (finish_reason "tool_calls" when the model chose them), the rest `content`;
streamed, as OpenAI's deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

import msgspec

from actors.input_processor.chat_template import normalise_message
from actors.errors import InvalidRequestError
from api.chat_parsing import ChoiceStream, DeltaParts, OutputParsing, reasoning_markers_of
from api.engine_requests import EngineRequests
from api.output import UsageCounter, prompt_logprobs_field, token_text
from api.protocol import ChatCompletionRequest
from api.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                           ChatLogprobs, ChatTokenLogprob, DeltaMessage, TopLogprob, Usage)
from api.serving_beam_search import beam_response, beam_usage, run_beam_searches
from api.serving import ServingContext, read_json, respond
from api.tool_calls import check_tools, tool_choice_constraint
from messages.common import CompletionOutput, Logprob, RequestOutput, SamplingParams


class _Reply:
    """What every choice of one chat request shares: its role, the echoed text, and how
    its logprobs and token ids are shown."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, messages: list[dict],
                 parsing: OutputParsing) -> None:
        self.parsing = parsing
        last = messages[-1]
        self.role = ctx.settings.response_role if body.add_generation_prompt else last["role"]
        # the last message as the chat template sees it (text parts joined)
        self.echo = normalise_message(last)["content"] if body.echo and last["role"] == self.role else ""
        self.num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.tokens_as_ids = ctx.tokens_as_ids(body.return_tokens_as_token_ids)
        self.wants_token_ids = bool(body.return_token_ids)

    def message(self, completion: CompletionOutput, prompt_token_ids: list[int]) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish_reason."""
        parsing = self.parsing
        if not parsing.active:
            return AssistantMessage(content=self.echo + completion.text, role=self.role), completion.finish_reason
        parsed = parsing.parse(completion.text, prompt_token_ids)
        content = self.echo + parsed.content if self.echo else parsed.content
        message = AssistantMessage(content=content, role=self.role)
        if parsing.tool_parser is not None:
            message.tool_calls = parsed.tool_calls
        if parsing.reasoning_parser is not None:
            message.reasoning_content = message.reasoning = parsed.reasoning
        return message, parsing.finish_reason(completion.finish_reason, bool(parsed.tool_calls))

    def delta(self, completion: CompletionOutput, stream: ChoiceStream | None,
              first: bool) -> tuple[DeltaMessage, str | None]:
        """A streamed choice's next delta and finish_reason (None until it ends)."""
        finish_reason = completion.finish_reason
        if stream is None:
            parts = DeltaParts(content=completion.text)
        else:
            parts = stream.feed(completion.text)
            if finish_reason is not None:
                parts = parts.add(stream.finish())
                finish_reason = self.parsing.finish_reason(finish_reason, stream.called)
        # the first chunk opens the message: its role, and the echoed text before what is new
        content = (self.echo if first else "") + parts.content
        message = DeltaMessage(role=self.role if first else UNSET, content=content if content or first else UNSET,
                               tool_calls=parts.tool_calls or UNSET)
        if parts.reasoning:
            message.reasoning_content = message.reasoning = parts.reasoning
        return message, finish_reason

    def logprobs(self, completion: CompletionOutput) -> ChatLogprobs | None:
        if self.num_top_logprobs is None:
            return None
        return ChatLogprobs(content=[self._token_logprob(token_id, entry)
                                     for token_id, entry in zip(completion.token_ids, completion.logprobs or [])])

    def _token_logprob(self, token_id: int, entry: dict[int, Logprob]) -> ChatTokenLogprob:
        chosen = entry[token_id]  # the engine always lists the sampled token
        # the entry holds the sampled token and the top ones; only the top num_top_logprobs are asked for
        top = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)
        text = token_text(token_id, chosen, self.tokens_as_ids)
        return ChatTokenLogprob(token=text, logprob=chosen.logprob, bytes=_utf8(chosen.decoded_token),
                                top_logprobs=[TopLogprob(token=token_text(top_id, lp, self.tokens_as_ids),
                                                         logprob=lp.logprob, bytes=_utf8(lp.decoded_token))
                                              for top_id, lp in top[:self.num_top_logprobs]])


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    ctx.require_generation("/v1/chat/completions")
    body = await read_json(request, ChatCompletionRequest, ctx.settings.max_body_bytes)
    model, lora_request = ctx.resolve_model(body.model_name)
    body.check_limits(ctx.client.config.model.vocab_size)
    ctx.check_chat_template(body.chat_template)
    settings = ctx.settings
    tool_choice = check_tools(body.tools, body.tool_choice,
                              settings.enable_auto_tool_choice and settings.tool_call_parser is not None)
    if body.use_beam_search and tool_choice != "none":
        raise InvalidRequestError("tool calls are not read from beam search; send tool_choice 'none'",
                                  param="tool_choice")
    params = None if body.use_beam_search else _with_tool_constraint(
        body.to_sampling_params(ctx.client.config.max_logprobs), body, tool_choice)
    messages = body.message_dicts()
    options = body.chat_options(settings.chat_template, render_tools=not (
        tool_choice == "none" and settings.exclude_tools_when_tool_choice_none))
    chat_kwargs = dict(add_generation_prompt=options.add_generation_prompt,
                       continue_final_message=options.continue_final_message, chat_template=options.chat_template,
                       chat_template_kwargs=options.chat_template_kwargs, documents=options.documents,
                       tools=options.tools, lora_request=lora_request)
    parsing = OutputParsing(tool_choice, settings.tool_call_parser, body.parallel_tool_calls,
                            ctx.client.config.reasoning_parser, await reasoning_markers_of(ctx.client))
    reply = _Reply(ctx, body, messages, parsing)
    response_id, engine_ids = ctx.request_ids(request, body.request_id, "chatcmpl", 1)

    def whole_response(outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        output = outputs[0]
        choices = []
        for completion in output.outputs:
            message, finish_reason = reply.message(completion, output.prompt_token_ids)
            choices.append(ChatChoice(index=completion.index, message=message, logprobs=reply.logprobs(completion),
                                      finish_reason=finish_reason, stop_reason=completion.stop_reason,
                                      token_ids=completion.token_ids if reply.wants_token_ids else None))
        return ChatCompletionResponse(
            id=response_id, model=model, choices=choices, usage=usage,
            prompt_logprobs=None if output.prompt_logprobs is None else prompt_logprobs_field(output.prompt_logprobs),
            prompt_token_ids=output.prompt_token_ids if reply.wants_token_ids else None)

    if body.use_beam_search:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        beam_params = body.beam_search_params(max_tokens, ctx.max_model_len)
        outputs = await run_beam_searches(ctx, request, [
            lambda: ctx.client.beam_search_chat(messages, beam_params, **chat_kwargs)], beam_params.beam_width)
        whole = whole_response(outputs, beam_usage(outputs))
        # streamed, each finished beam is one chunk with the whole message
        chunks = [ChatCompletionChunk(id=response_id, model=model, created=whole.created,
                                      usage=None if body.include_usage else UNSET, choices=[ChatChunkChoice(
                                          index=choice.index, delta=_whole_delta(choice.message),
                                          finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                          token_ids=UNSET if choice.token_ids is None else choice.token_ids)])
                  for choice in whole.choices]
        if body.include_usage:
            chunks.append(ChatCompletionChunk(id=response_id, model=model, created=whole.created, choices=[],
                                              usage=whole.usage))
        return beam_response(body.stream, whole, chunks)
    requests = ctx.open(engine_ids, lambda engine_id, _: ctx.client.chat(
        messages, params, request_id=engine_id, add_special_tokens=body.add_special_tokens, priority=body.priority,
        cache_salt=body.cache_salt, **chat_kwargs), params, request.headers)
    return await respond(request, requests, body.stream,
                         lambda: _chunks(ctx, response_id, model, body, requests, reply),
                         lambda outputs: whole_response(outputs, ctx.usage(requests)))


def _with_tool_constraint(params: SamplingParams, body: ChatCompletionRequest,
                          tool_choice: str | dict) -> SamplingParams:
    """The sampling parameters with the constraint a required or named tool_choice needs."""
    constraint = tool_choice_constraint(body.tools or [], tool_choice, body.parallel_tool_calls)
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError("a required or named tool_choice constrains the output itself; it cannot be "
                                  "combined with response_format or another structured output", param="tool_choice")
    return msgspec.structs.replace(params, structured_outputs=constraint)


def _whole_delta(message: AssistantMessage) -> DeltaMessage:
    return DeltaMessage(role=message.role, content=message.content if message.content is not None else UNSET,
                        reasoning_content=message.reasoning_content or UNSET, reasoning=message.reasoning or UNSET)


def _utf8(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8"))


async def _chunks(ctx: ServingContext, response_id: str, model: str, body: ChatCompletionRequest,
                  requests: EngineRequests, reply: _Reply) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())
    usage_field = None if body.include_usage else UNSET  # OpenAI sends "usage": null until the last chunk
    counter = UsageCounter() if body.continuous_usage else None
    streams: dict[int, ChoiceStream | None] = {}  # choice index -> its parsing; a key once its first chunk is sent
    prompt_token_ids: list[int] = []
    async for _, delta in requests.deltas():
        if delta.prompt_token_ids:
            prompt_token_ids = delta.prompt_token_ids
        if counter is not None:
            counter.note_prompt(0, delta)
        for completion in delta.outputs:
            first = completion.index not in streams
            if first:
                streams[completion.index] = reply.parsing.stream(prompt_token_ids) if reply.parsing.active else None
            usage = counter.add(0, completion) if counter is not None else usage_field
            message, finish_reason = reply.delta(completion, streams[completion.index], first)
            # tokens whose text is held back (a split character, a possible marker) make a
            # chunk only for their token ids
            wants_tokens = reply.num_top_logprobs is not None or reply.wants_token_ids
            has_text = message.content or message.tool_calls or message.reasoning_content
            if not (first or has_text or finish_reason or (wants_tokens and completion.token_ids)):
                continue
            choice = ChatChunkChoice(index=completion.index, delta=message, logprobs=reply.logprobs(completion),
                                     finish_reason=finish_reason, stop_reason=completion.stop_reason)
            chunk = ChatCompletionChunk(id=response_id, model=model, created=created, choices=[choice], usage=usage)
            if reply.wants_token_ids:
                choice.token_ids = completion.token_ids
                if first:
                    chunk.prompt_token_ids = prompt_token_ids
            yield chunk
    if body.include_usage:
        yield ChatCompletionChunk(id=response_id, model=model, created=created, choices=[], usage=ctx.usage(requests))
