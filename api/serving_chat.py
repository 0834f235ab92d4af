"""POST /v1/chat/completions: one engine request, rendered with the model's chat template
by the input processor; n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from api.engine_requests import EngineRequests
from api.protocol import ChatCompletionRequest
from api.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                           ChatLogprobs, ChatTokenLogprob, DeltaMessage, TopLogprob)
from api.serving import ServingContext, read_json, respond
from messages.common import CompletionOutput, Logprob, RequestOutput


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    body = await read_json(request, ChatCompletionRequest, ctx.settings.max_body_bytes)
    model = ctx.check_model(body.model)
    params = body.to_sampling_params()
    messages = body.message_dicts()
    num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    requests = ctx.open([request_id], lambda engine_id, _: ctx.client.chat(
        messages, params, request_id=engine_id, add_generation_prompt=body.add_generation_prompt), params)

    def whole_response(outputs: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=completion.index, message=AssistantMessage(content=completion.text),
                              logprobs=_logprobs(completion, num_top_logprobs),
                              finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
                   for completion in outputs[0].outputs]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=requests.usage)

    return await respond(request, requests, body.stream,
                         lambda: _chunks(request_id, model, body, requests, num_top_logprobs), whole_response)


def _logprobs(completion: CompletionOutput, num_top_logprobs: int | None) -> ChatLogprobs | None:
    if num_top_logprobs is None:
        return None
    return ChatLogprobs(content=[_token_logprob(token_id, entry, num_top_logprobs)
                                 for token_id, entry in zip(completion.token_ids, completion.logprobs or [])])


def _token_logprob(token_id: int, entry: dict[int, Logprob], num_top_logprobs: int) -> ChatTokenLogprob:
    chosen = entry[token_id]  # the engine always lists the sampled token
    # the entry holds the sampled token and the top ones; only the top num_top_logprobs are asked for
    top = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 0)[:num_top_logprobs]
    return ChatTokenLogprob(token=chosen.decoded_token or "", logprob=chosen.logprob,
                            bytes=_utf8(chosen.decoded_token), top_logprobs=[
                                TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                           bytes=_utf8(lp.decoded_token)) for _, lp in top])


def _utf8(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8"))


async def _chunks(request_id: str, model: str, body: ChatCompletionRequest, requests: EngineRequests,
                  num_top_logprobs: int | None) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())
    usage_field = None if body.include_usage else UNSET  # OpenAI sends "usage": null until the last chunk
    started: set[int] = set()  # choices whose first chunk (the one with the role) is sent
    async for _, delta in requests.deltas():
        for completion in delta.outputs:
            first = completion.index not in started
            # tokens whose text is held back (a split character) make a chunk only for their logprobs
            wanted = completion.text or completion.finish_reason or (num_top_logprobs is not None and completion.token_ids)
            if not (first or wanted):
                continue
            started.add(completion.index)
            message = DeltaMessage(role="assistant" if first else UNSET,
                                   content=completion.text if completion.text or first else UNSET)
            choice = ChatChunkChoice(index=completion.index, delta=message,
                                     logprobs=_logprobs(completion, num_top_logprobs),
                                     finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
            yield ChatCompletionChunk(id=request_id, model=model, created=created, choices=[choice],
                                      usage=usage_field)
    if body.include_usage:
        yield ChatCompletionChunk(id=request_id, model=model, created=created, choices=[], usage=requests.usage)
