"""The OpenAI API's request bodies, as msgspec Structs, and how they become SamplingParams.

Decoding a body with msgspec checks every type (a string where a number belongs is a
ValidationError, answered with 400, never a crash); building SamplingParams checks every
range (InvalidRequestError naming the field, also 400). Unknown fields are ignored, as
OpenAI's own server and vLLM's do, so newer clients keep working.

Optional fields are `X | None = None`: some clients send an explicit null for "not set",
and null must then mean the default, not a type error."""

from __future__ import annotations

import msgspec

from actors.errors import InvalidRequestError
from messages.common import MAX_LOGPROBS, SamplingParams


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False  # a last chunk with `choices: []` and the request's usage


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None  # None: up to the context left
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1  # never None after decoding (see __post_init__)
    stream: bool | None = False  # never None after decoding
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and ignored: troupe keeps no per-user state
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings -> bias in [-100, 100]

    def __post_init__(self) -> None:
        # OpenAI's API takes null for these too, and the openai package sends null when a
        # caller passes n=None or stream=None: the default is filled in once, here, so the
        # rest of the server sees plain values
        self.n = _or(self.n, 1)
        self.stream = _or(self.stream, False)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; raises InvalidRequestError for a value out of range."""
        self.check_stream_options()
        return SamplingParams(
            n=self.n, temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias())

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
    echo: bool | None = False  # the prompt precedes each completion's text (and its logprobs); None: False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo = _or(self.echo, False)

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
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # only "text" is supported; the input processor rejects the others
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        """The plain dict the chat template renders."""
        message: dict = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            message["content"] = [msgspec.structs.asdict(part) for part in self.content]
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False  # None: False
    top_logprobs: int | None = None  # with logprobs: how many alternatives per token (0-20)
    add_generation_prompt: bool = True  # extension: end the rendered prompt with the assistant's turn
    # troupe generates free text: asking for JSON or for tool calls is refused rather than
    # quietly answered with text the client would then fail to parse
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = _or(self.logprobs, False)

    def to_sampling_params(self) -> SamplingParams:
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(f"response_format {self.response_format.get('type')!r} is not supported; "
                                      "troupe generates free text (response_format type 'text')",
                                      param="response_format")
        if self.tools and self.tool_choice != "none":
            raise InvalidRequestError("tool calling is not supported; send no tools, or tool_choice 'none'",
                                      param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                      param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def message_dicts(self) -> list[dict]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return [message.to_dict() for message in self.messages]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt, or messages rendered with the chat template (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
