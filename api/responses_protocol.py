"""The OpenAI Responses API's request body and response objects (POST /v1/responses), and
how a request becomes a chat conversation and sampling parameters.

A request's input (a string, or a list of message / function_call / function_call_output
items) is turned into chat messages, after the stored conversation of its
previous_response_id and its instructions (a system message, not carried to later
responses, as OpenAI); the chat template renders them, so tools, tool results and
reasoning work as in /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from actors.errors import InvalidRequestError
from api.protocol import ChatMessage
from api.request_limits import check_metadata, check_schema_size
from api.structured_fields import StructuredFields, check_constraint_of, response_format_constraint
from messages.common import SamplingParams


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response, as OpenAI returns it (and GET /v1/responses/{id} again)."""

    id: str
    model: str
    object: str = "response"
    created_at: int = msgspec.field(default_factory=lambda: int(time.time()))
    status: str = "completed"  # "in_progress" while streaming, "incomplete" past max_output_tokens
    output: list[dict[str, Any]] = msgspec.field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    truncation: str = "disabled"
    user: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(name: str, arguments: str, call_id: str, status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesRequest(StructuredFields, kw_only=True):
    """POST /v1/responses. text.format asks for structured output (StructuredFields' other
    fields, vLLM's extensions, work too)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None  # only "disabled": troupe never drops input to fit
    # OpenAI's fields troupe does not implement: a 400 naming them when set
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        for name in ("reasoning", "prompt", "conversation"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)
        if self.background:
            raise InvalidRequestError("background responses are not supported", param="background")
        if self.include:
            raise InvalidRequestError("include is not supported by this server", param="include")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported by /v1/responses", param="top_logprobs")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError("truncation must be 'disabled'", param="truncation")
        check_metadata(self.metadata)
        check_schema_size("text", self.text)
        if self.response_format is not None:  # the chat field; here the format is text.format
            raise InvalidRequestError("use text.format instead of response_format", param="response_format")
        for tool in self.tools or []:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise InvalidRequestError("only function tools are supported (type 'function')", param="tools")

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in chat-completions form."""
        if self.tools is None:
            return None
        return [{"type": "function", "function": {key: tool[key] for key in
                                                  ("name", "description", "parameters", "strict") if key in tool}}
                for tool in self.tools]

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters: text.format becomes the structured output."""
        constraint = self.structured_outputs_params()
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise InvalidRequestError("text.format must be an object", param="text")
            as_chat = dict(fmt)
            if fmt.get("type") == "json_schema":  # the chat form nests the schema one level down
                as_chat["json_schema"] = {"name": fmt.get("name"), "schema": fmt.get("schema")}
            try:
                text_constraint = response_format_constraint(as_chat)
                if text_constraint is not None:
                    check_constraint_of("text", text_constraint)
            except InvalidRequestError as error:
                raise InvalidRequestError(str(error).replace("response_format", "text.format"), param="text") \
                    from None
            if text_constraint is not None and constraint is not None:
                raise InvalidRequestError("text.format and another structured output cannot both be set",
                                          param="text")
            constraint = constraint or text_constraint
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                              max_tokens=self.max_output_tokens, structured_outputs=constraint)

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages: instructions, the stored conversation, then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + history + input_messages(self.input)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses input as chat messages (consecutive function calls: one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequestError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise InvalidRequestError("input items must be objects", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_chat_message({"role": item.get("role"), "content": _text(item.get("content"))}))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(_chat_message({"role": "assistant", "tool_calls": [call]})
                                                  ["tool_calls"][0])
            else:
                messages.append(_chat_message({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(_chat_message({"role": "tool", "tool_call_id": item.get("call_id"),
                                           "content": output if isinstance(output, str) else _text(output)}))
        else:
            raise InvalidRequestError(f"input items of type {kind!r} are not supported (message, function_call, "
                                      "function_call_output)", param="input")
    return messages


def _text(content: Any) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") in
                                         ("input_text", "output_text", "text") for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise InvalidRequestError("message content must be a string or a list of input_text parts", param="input")


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    try:
        return msgspec.convert(message, ChatMessage).to_dict()
    except msgspec.ValidationError as error:
        raise InvalidRequestError(f"input: {error}", param="input") from None


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up request continues from."""
    return input_messages([{"type": "message", "role": "assistant", "content": item["content"]}
                           if item["type"] == "message" else item for item in output]) if output else []
