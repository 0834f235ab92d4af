"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat
path (one engine request, rendered with the chat template; tools, tool_choice and
reasoning read as /v1/chat/completions reads them, api/chat_parsing.py).

Streamed, a response is OpenAI's sequence of typed events, each with a sequence number:
response.created and .in_progress; for the text, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done; for each
function call, output_item.added, function_call_arguments.delta..., .done,
output_item.done; and response.completed with the whole response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.errors import InvalidRequestError
from api.chat_parsing import ChoiceStream, DeltaParts, OutputParsing, reasoning_markers_of
from api.engine_requests import EngineRequests
from api.errors import APIError
from api.responses_protocol import (ResponseObject, ResponsesRequest, ResponseUsage, function_call_item,
                                    input_messages, message_item, new_id, output_messages)
from api.serving import ServingContext, json_response, read_json, respond
from api.tool_calls import check_tools, tool_choice_constraint
from messages.common import RequestOutput

def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r} (store: false, forgotten past the "
                         "server's --responses-store-size, or from before the server started)", param=param,
                    code="not_found")


async def retrieve_response(ctx: ServingContext, request: Request) -> Response:
    entry = ctx.responses.get(request.path_params["response_id"])
    if entry is None:
        raise _not_found(request.path_params["response_id"])
    return json_response(entry[0])


async def create_response(ctx: ServingContext, request: Request) -> Response:
    ctx.require_generation("/v1/responses")
    body = await read_json(request, ResponsesRequest, ctx.settings.max_body_bytes)
    body.check()
    model, lora_request = ctx.resolve_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = ctx.responses.get(body.previous_response_id)
        if entry is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = entry[1]
    settings = ctx.settings
    tools = body.chat_tools()
    tool_choice = check_tools(tools, body.chat_tool_choice(),
                              settings.enable_auto_tool_choice and settings.tool_call_parser is not None)
    params = body.sampling_params()
    constraint = tool_choice_constraint(tools or [], tool_choice, body.parallel_tool_calls)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError("a required or named tool_choice cannot be combined with text.format",
                                      param="tool_choice")
        params = msgspec.structs.replace(params, structured_outputs=constraint)
    messages = body.messages(history)
    conversation = history + input_messages(body.input)
    parsing = OutputParsing(tool_choice, settings.tool_call_parser, body.parallel_tool_calls,
                            ctx.client.config.reasoning_parser, await reasoning_markers_of(ctx.client))
    response_id = new_id("resp")
    _, engine_ids = ctx.request_ids(request, None, "resp", 1)
    requests = ctx.open(engine_ids, lambda engine_id, _: ctx.client.chat(
        messages, params, request_id=engine_id, tools=tools, lora_request=lora_request), params, request.headers)
    template = ResponseObject(
        id=response_id, model=model, status="in_progress", instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        tools=body.tools or [], tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text=body.text or {"format": {"type": "text"}}, previous_response_id=body.previous_response_id,
        metadata=body.metadata, store=body.store is not False, user=body.user)

    def finished(output: RequestOutput, items: list[dict[str, Any]]) -> ResponseObject:
        completion = output.outputs[0]
        incomplete = completion.finish_reason == "length"
        usage = ctx.usage(requests)
        response = msgspec.structs.replace(
            template, status="incomplete" if incomplete else "completed", output=items,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens,
                                input_tokens_details={"cached_tokens": requests.num_cached_tokens}))
        if response.store:
            ctx.responses.put(response, conversation + output_messages([i for i in items if i["type"] != "reasoning"]))
        return response

    def whole(outputs: list[RequestOutput]) -> ResponseObject:
        output = outputs[0]
        completion = output.outputs[0]
        parsed = parsing.parse(completion.text, output.prompt_token_ids)
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        items = [message_item(parsed.content or "", status)] if parsed.content or not parsed.tool_calls else []
        items += [function_call_item(call.function.name, call.function.arguments, call.id)
                  for call in parsed.tool_calls]
        # the reasoning last, where a stream (which sends no reasoning events) has it too
        items += [_reasoning_item(parsed.reasoning)] if parsed.reasoning else []
        return finished(output, items)

    return await respond(request, requests, bool(body.stream),
                         lambda: _events(template, requests, parsing, finished), whole)


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class _EventStream:
    """Turns one choice's parsed deltas into the Responses API's events."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output so far, in output order
        self.message: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def add(self, parts: DeltaParts) -> list[dict[str, Any]]:
        self.reasoning += parts.reasoning
        events = []
        if parts.content:
            if self.message is None:
                self.message = message_item("", "in_progress")
                self.message["content"] = []
                self.items.append(self.message)
                index = len(self.items) - 1
                events.append(self.event("response.output_item.added", output_index=index, item=dict(self.message)))
                self.message["content"] = [{"type": "output_text", "text": "", "annotations": []}]
                events.append(self.event("response.content_part.added", item_id=self.message["id"],
                                         output_index=index, content_index=0, part=self.message["content"][0]))
            self.message["content"][0]["text"] += parts.content
            events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                     output_index=self.items.index(self.message), content_index=0,
                                     delta=parts.content, logprobs=[]))
        for call in parts.tool_calls:
            item = self.calls.get(call.index)
            if item is None:
                item = function_call_item(call.function.name, "", call.id, "in_progress")
                self.calls[call.index] = item
                self.items.append(item)
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=dict(item)))
            fragment = call.function.arguments if isinstance(call.function.arguments, str) else ""
            if fragment:
                item["arguments"] += fragment
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=fragment))
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        events = []
        for index, item in enumerate(self.items):
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                         content_index=0, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def _events(template: ResponseObject, requests: EngineRequests, parsing: OutputParsing,
                  finished) -> AsyncIterator[dict[str, Any]]:
    stream = _EventStream()
    yield stream.event("response.created", response=template)
    yield stream.event("response.in_progress", response=template)
    choice: ChoiceStream | None = None
    prompt_token_ids: list[int] = []
    output: RequestOutput | None = None
    async for _, delta in requests.deltas():
        output = delta
        prompt_token_ids = delta.prompt_token_ids or prompt_token_ids
        for completion in delta.outputs:
            if choice is None:
                choice = parsing.stream(prompt_token_ids)
            parts = choice.feed(completion.text)
            if completion.finish_reason is not None:
                parts = parts.add(choice.finish())
            for event in stream.add(parts):
                yield event
    assert output is not None and output.outputs, "an engine request ended without any output"
    status = "incomplete" if output.outputs[-1].finish_reason == "length" else "completed"
    if not stream.items:  # an empty answer is still a message, as OpenAI's
        stream.message = message_item("", "in_progress")
        stream.items.append(stream.message)
        yield stream.event("response.output_item.added", output_index=0, item=stream.message)
    for event in stream.close(status):
        yield event
    items = stream.items + ([_reasoning_item(stream.reasoning)] if stream.reasoning else [])
    yield stream.event("response.completed", response=finished(output, items))
