"""POST /v1/chat/completions: one engine request, rendered with the chat template by the
input processor; n choices.

The reply's role is the server's --response-role, or, when the request continues its
last message (no generation prompt), that message's role, as vLLM. With echo, a reply
whose role is the last message's starts with that message's content."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from actors.chat_template import normalise_message
from api.engine_requests import EngineRequests
from api.output import UsageCounter, prompt_logprobs_field, token_text
from api.protocol import ChatCompletionRequest
from api.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                           ChatLogprobs, ChatTokenLogprob, DeltaMessage, TopLogprob, Usage)
from api.serving_beam_search import beam_response, beam_usage, run_beam_searches
from api.serving import ServingContext, read_json, respond
from messages.common import CompletionOutput, Logprob, RequestOutput


class _Reply:
    """What every choice of one chat request shares: its role, the echoed text, and how
    its logprobs and token ids are shown."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, messages: list[dict]) -> None:
        last = messages[-1]
        self.role = ctx.settings.response_role if body.add_generation_prompt else last["role"]
        # the last message as the chat template sees it (text parts joined)
        self.echo = normalise_message(last)["content"] if body.echo and last["role"] == self.role else ""
        self.num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.tokens_as_ids = ctx.tokens_as_ids(body.return_tokens_as_token_ids)
        self.wants_token_ids = bool(body.return_token_ids)

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
    body = await read_json(request, ChatCompletionRequest, ctx.settings.max_body_bytes)
    model = ctx.check_model(body.model_name)
    params = None if body.use_beam_search else body.to_sampling_params(ctx.client.config.max_logprobs)
    messages = body.message_dicts()
    options = body.chat_options(ctx.settings.chat_template)
    chat_kwargs = dict(add_generation_prompt=options.add_generation_prompt,
                       continue_final_message=options.continue_final_message, chat_template=options.chat_template,
                       chat_template_kwargs=options.chat_template_kwargs, documents=options.documents)
    reply = _Reply(ctx, body, messages)
    response_id, engine_ids = ctx.request_ids(request, body.request_id, "chatcmpl", 1)

    def whole_response(outputs: list[RequestOutput], usage: Usage) -> ChatCompletionResponse:
        output = outputs[0]
        choices = [ChatChoice(index=completion.index,
                              message=AssistantMessage(content=reply.echo + completion.text, role=reply.role),
                              logprobs=reply.logprobs(completion), finish_reason=completion.finish_reason,
                              stop_reason=completion.stop_reason,
                              token_ids=completion.token_ids if reply.wants_token_ids else UNSET)
                   for completion in output.outputs]
        return ChatCompletionResponse(
            id=response_id, model=model, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs_field(output.prompt_logprobs),
            prompt_token_ids=output.prompt_token_ids if reply.wants_token_ids else UNSET)

    if body.use_beam_search:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        beam_params = body.beam_search_params(max_tokens, ctx.max_model_len)
        outputs = await run_beam_searches(ctx, request, [
            lambda: ctx.client.beam_search_chat(messages, beam_params, **chat_kwargs)])
        whole = whole_response(outputs, beam_usage(outputs))
        # streamed, each finished beam is one chunk with the whole message
        chunks = [ChatCompletionChunk(id=response_id, model=model, created=whole.created,
                                      usage=None if body.include_usage else UNSET, choices=[ChatChunkChoice(
                                          index=choice.index, delta=DeltaMessage(role=choice.message.role,
                                                                                 content=choice.message.content),
                                          finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                          token_ids=choice.token_ids)])
                  for choice in whole.choices]
        if body.include_usage:
            chunks.append(ChatCompletionChunk(id=response_id, model=model, created=whole.created, choices=[],
                                              usage=whole.usage))
        return beam_response(body.stream, whole, chunks)
    requests = ctx.open(engine_ids, lambda engine_id, _: ctx.client.chat(
        messages, params, request_id=engine_id, add_special_tokens=body.add_special_tokens, priority=body.priority,
        cache_salt=body.cache_salt, **chat_kwargs), params)
    return await respond(request, requests, body.stream,
                         lambda: _chunks(ctx, response_id, model, body, requests, reply),
                         lambda outputs: whole_response(outputs, ctx.usage(requests)))


def _utf8(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8"))


async def _chunks(ctx: ServingContext, response_id: str, model: str, body: ChatCompletionRequest,
                  requests: EngineRequests, reply: _Reply) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())
    usage_field = None if body.include_usage else UNSET  # OpenAI sends "usage": null until the last chunk
    counter = UsageCounter() if body.continuous_usage else None
    started: set[int] = set()  # choices whose first chunk (the one with the role) is sent
    prompt_token_ids: list[int] = []
    async for _, delta in requests.deltas():
        if delta.prompt_token_ids:
            prompt_token_ids = delta.prompt_token_ids
        if counter is not None:
            counter.note_prompt(0, delta)
        for completion in delta.outputs:
            first = completion.index not in started
            usage = counter.add(0, completion) if counter is not None else usage_field
            # tokens whose text is held back (a split character) make a chunk only for their token ids
            wants_tokens = reply.num_top_logprobs is not None or reply.wants_token_ids
            wanted = completion.text or completion.finish_reason or (wants_tokens and completion.token_ids)
            if not (first or wanted):
                continue
            started.add(completion.index)
            # the first chunk opens the message: its role, and the echoed text before what is new
            text = (reply.echo if first else "") + completion.text
            message = DeltaMessage(role=reply.role if first else UNSET, content=text if text or first else UNSET)
            choice = ChatChunkChoice(index=completion.index, delta=message, logprobs=reply.logprobs(completion),
                                     finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
            chunk = ChatCompletionChunk(id=response_id, model=model, created=created, choices=[choice], usage=usage)
            if reply.wants_token_ids:
                choice.token_ids = completion.token_ids
                if first:
                    chunk.prompt_token_ids = prompt_token_ids
            yield chunk
    if body.include_usage:
        yield ChatCompletionChunk(id=response_id, model=model, created=created, choices=[], usage=ctx.usage(requests))
