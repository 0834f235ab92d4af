"""The OpenAI API's request bodies, as msgspec Structs, with vLLM's extensions, and how
they become SamplingParams.

Decoding a body with msgspec checks every type (a string where a number belongs is a
ValidationError, answered with 400, never a crash); building SamplingParams checks every
range (InvalidRequestError naming the field, also 400); what needs the model (token ids
in the vocabulary, logprobs within max_logprobs, the prompt's length) the input
processor checks, for every route alike. Fields troupe knows but does not implement are
refused by name (fields.py); other unknown fields are accepted and logged once, as vLLM.

Optional fields are `X | None = None`: some clients send an explicit null for "not set",
and null must then mean the default, not a type error."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from actors.frontend.beam_search import BeamSearchParams
from actors.errors import InvalidRequestError
from api.request_limits import check_sampling_fields
from api.structured_fields import StructuredFields
from messages.common import SamplingParams
from messages.input_processor import ChatOptions


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False  # a last chunk with `choices: []` and the request's usage
    continuous_usage_stats: bool | None = False  # with include_usage: usage on every chunk (vLLM)


class SamplingRequest(StructuredFields, kw_only=True):
    """The fields /v1/completions and /v1/chat/completions share (the structured-output
    ones in StructuredFields)."""

    model: str | None = None  # None or "": the (first) served model
    max_tokens: int | None = None  # None: up to the context left
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1  # never None after decoding (see __post_init__)
    best_of: int | None = None  # only best_of == n (or null): troupe returns every completion it runs
    stream: bool | None = False  # never None after decoding
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings -> bias in [-100, 100]
    user: str | None = None  # accepted and ignored: troupe keeps no per-user state
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0  # beam search only
    use_beam_search: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None  # the prompt's and each completion's token ids in the response
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:<id>"; null: the server's flag
    priority: int = 0
    request_id: str | None = None  # the response's id (after "cmpl-"/"chatcmpl-"); X-Request-Id wins
    cache_salt: str | None = None  # prefix-cache entries shared only with requests of the same salt
    echo: bool | None = False  # never None after decoding

    def __post_init__(self) -> None:
        # OpenAI's API takes null for these too, and the openai package sends null when a
        # caller passes n=None or stream=None: the default is filled in once, here, so the
        # rest of the server sees plain values
        self.n = _or(self.n, 1)
        self.stream = _or(self.stream, False)
        self.echo = _or(self.echo, False)

    def check_limits(self, vocab_size: int) -> None:
        """The bounds of api/request_limits.py (n, stop, stop_token_ids, bad_words, logit_bias,
        allowed_token_ids): a 400 naming the field past one."""
        check_sampling_fields(self.n, self.stop, self.stop_token_ids, self.bad_words, self.logit_bias,
                              self.allowed_token_ids, vocab_size)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of must equal n ({self.n}) or be null: troupe returns every "
                                      "completion it generates", param="best_of")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs are not available when stream is true",
                                      param="prompt_logprobs")
        if not self.use_beam_search and self.length_penalty != 1.0:
            raise InvalidRequestError("length_penalty applies to beam search only; set use_beam_search",
                                      param="length_penalty")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def model_name(self) -> str | None:
        return self.model or None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises InvalidRequestError for a value out of range."""
        self.check_common()
        return SamplingParams(
            n=self.n, temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, structured_outputs=self.structured_outputs_params())

    def beam_search_params(self, max_tokens: int | None, max_model_len: int) -> BeamSearchParams:
        """use_beam_search's parameters: n beams; InvalidRequestError for a field the search
        would ignore."""
        self.check_common()
        if self.structured_outputs_params() is not None:
            raise InvalidRequestError("structured output does not apply to beam search (use_beam_search)",
                                      param="use_beam_search")
        for name, unset_values in _NOT_FOR_BEAM_SEARCH.items():
            if getattr(self, name, None) not in unset_values:
                raise InvalidRequestError(f"{name} does not apply to beam search (use_beam_search)", param=name)
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens or max_model_len,
                                ignore_eos=self.ignore_eos, temperature=_or(self.temperature, 0.0),
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          param="logit_bias") from None
        return bias


# Fields a beam search has no use for, with the values that mean "not set": set to anything
# else, they would be silently ignored, so they are refused.
_NOT_FOR_BEAM_SEARCH = {
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "min_tokens": (0,), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "cache_salt": (None,),
    "logprobs": (None, False), "top_logprobs": (None,),
}


def _or(value, default):
    return default if value is None else value


# A completion prompt: a string, a list of strings, a list of token ids, or a list of
# token-id lists. (msgspec allows one list type per union, so the shape is checked below.)
PromptField = str | list[str | int | list[int]]
Prompt = str | list[int]


class CompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/completions."""

    prompt: PromptField
    max_tokens: int | None = 16  # OpenAI's default for completions; null: up to the context left
    logprobs: int | None = None  # top logprobs per token (the sampled token is always listed too)
    add_special_tokens: bool = True  # the tokenizer's BOS before a text prompt

    def prompts(self) -> list[Prompt]:
        """The prompts this request asks for, one engine request each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of token-id lists", param="prompt")

    def to_sampling_params(self) -> SamplingParams:
        # echo with logprobs scores the prompt too
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # "text", or "image_url" (a vision model's; the input processor rejects the others)
    text: str | None = None
    image_url: dict | None = None  # {"url": a base64 data URL, "detail": ...}


class HistoryFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON object's text


class HistoryToolCall(msgspec.Struct, kw_only=True):
    """A call in an earlier assistant message."""

    function: HistoryFunctionCall
    id: str | None = None
    type: str = "function"

    def to_dict(self) -> dict:
        # templates (Qwen2's, Llama 3's) write the arguments with tojson: they want the
        # object, not its text, as vLLM hands them
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        call: dict = {"type": self.type, "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None  # an assistant's calls (its content then often null)
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's name; also `reasoning`)
    reasoning: str | None = None

    def to_dict(self) -> dict:
        """The plain dict the chat template renders."""
        message: dict = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            message["content"] = [msgspec.structs.asdict(part) for part in self.content]
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False  # never None after decoding
    top_logprobs: int | None = None  # with logprobs: how many alternatives per token
    # vLLM's chat-template options
    add_generation_prompt: bool = True  # end the rendered prompt with the assistant's turn
    continue_final_message: bool = False  # continue the last (assistant) message instead
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False  # the template already holds BOS
    # tool calling (api/tool_calls.py checks them): OpenAI's function tools
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # false: at most one call
    modalities: list[str] | None = None  # only ["text"]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = _or(self.logprobs, False)

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise InvalidRequestError("only the text modality is supported", param="modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= max_logprobs:
            raise InvalidRequestError(f"top_logprobs must be in [0, {max_logprobs}] (the server's max_logprobs), "
                                      f"got {self.top_logprobs}", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs)

    def message_dicts(self) -> list[dict]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return [message.to_dict() for message in self.messages]

    def chat_options(self, default_template: str | None, render_tools: bool = True) -> ChatOptions:
        return ChatOptions(add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message,
                           chat_template=self.chat_template or default_template,
                           chat_template_kwargs=self.chat_template_kwargs, documents=self.documents,
                           tools=self.tools if render_tools else None)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt, or messages rendered with the chat template (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False  # also each token's string
    # with messages: the chat template's options
    continue_final_message: bool = False  # the last message stays open, for the model to continue
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's
    chat_template_kwargs: dict | None = None  # more variables for the template
    documents: list[dict[str, Any]] | None = None  # for retrieval-augmented templates


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
