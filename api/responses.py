"""The OpenAI API's response bodies, as msgspec Structs.

Fields that OpenAI sends as null are plain `X | None`; fields it leaves out in some
messages (a stream chunk's `usage` unless include_usage is set, a chat delta's `role`
after the first chunk) default to msgspec.UNSET, which the encoder omits. A whole
(non-streaming) response carries every field vLLM always sends, null when unused
(`prompt_logprobs`, `prompt_token_ids`, `token_ids`, `system_fingerprint`, ...): clients
read them as attributes (the openai package's `choice.prompt_logprobs`), and vLLM's tests
look for the keys; streamed chunks stay lean."""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET, UnsetType


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details; left out otherwise
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET

    def add(self, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.completion_tokens += num_completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens


class LogprobEntry(msgspec.Struct):
    """vLLM's shape of one token's logprob in prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# position -> {token id: its logprob}; the first prompt token has none. vLLM's extensions
# are left out of a response unless asked for (every streamed chunk would carry them).
PromptLogprobsField = list[dict[int, LogprobEntry] | None] | UnsetType


# ---- /v1/completions ----

class CompletionLogprobs(msgspec.Struct):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)  # where each token starts in the choice's text


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while streaming
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM's extension)
    # vLLM's extensions: prompt_logprobs when asked; token ids with return_token_ids
    prompt_logprobs: PromptLogprobsField | None = UNSET
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    token_ids: list[int] | None | UnsetType = UNSET


class CompletionResponse(msgspec.Struct):
    """A whole completion, and (object "text_completion" too) each streamed chunk."""

    id: str
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    usage: Usage | None | UnsetType = UNSET
    # vLLM's always-present fields of a whole response (with_vllm_nulls), absent from chunks
    system_fingerprint: str | None | UnsetType = UNSET
    service_tier: str | None | UnsetType = UNSET
    kv_transfer_params: dict | None | UnsetType = UNSET


def with_vllm_nulls(response: CompletionResponse) -> CompletionResponse:
    """A whole completion with every field vLLM always sends, null where unused."""
    for struct, names in ((response, ("system_fingerprint", "service_tier", "kv_transfer_params")),
                          *((choice, ("prompt_logprobs", "prompt_token_ids", "token_ids"))
                            for choice in response.choices)):
        for name in names:
            if getattr(struct, name) is UNSET:
                setattr(struct, name, None)
    return response


# ---- /v1/chat/completions ----

class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct):
    name: str | UnsetType = UNSET  # on a call's first delta only
    arguments: str | UnsetType = UNSET  # the next fragment of the arguments' text


class DeltaToolCall(msgspec.Struct):
    """A streamed piece of a tool call: the first carries id, type and name; the rest
    carry argument fragments that concatenate to the call's arguments."""

    index: int  # which call of the choice
    function: DeltaFunctionCall
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"  # the server's --response-role, or the continued message's role
    # with tools: the calls the model made (content then null when it said nothing else)
    tool_calls: list[ToolCall] | UnsetType = UNSET
    # with --reasoning-parser: the text between <think> and </think> (vLLM sends it under both names)
    reasoning_content: str | None | UnsetType = UNSET
    reasoning: str | None | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    """A whole chat completion: every field vLLM always sends, null where unused."""

    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    prompt_logprobs: list[dict[int, LogprobEntry] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    system_fingerprint: str | None = None
    service_tier: str | None = None
    kv_transfer_params: dict | None = None


class DeltaMessage(msgspec.Struct):
    role: str | UnsetType = UNSET  # "assistant", on a choice's first chunk only
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # with --reasoning-parser; also sent as `reasoning`
    reasoning: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids


class ChatCompletionChunk(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids, on a choice's first chunk


# ---- models, tokens, version ----

class ModelCard(msgspec.Struct):
    id: str
    root: str  # the served name (vLLM shows the model's directory; troupe keeps its paths to itself)
    max_model_len: int
    object: str = "model"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "troupe"
    parent: str | None = None  # a LoRA adapter's base model (its served name), as vLLM; None for a base model


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when asked for (return_token_strs); else null, as vLLM


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str
