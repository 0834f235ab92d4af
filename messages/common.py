"""Structs shared by several inboxes: what a user asks for (SamplingParams) and what
they get back (RequestOutput). No torch, no tokenizer imports here."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from messages.errors import InvalidRequestError
from messages.structured_outputs import StructuredOutputsParams

__all__ = ["InvalidRequestError", "SamplingParams", "StructuredOutputsParams"]

# The most top logprobs a request may ask for, per token: vLLM's default max_logprobs
# (the engine argument max_logprobs, --max-logprobs, changes it).
MAX_LOGPROBS = 20
# seed is a signed 64-bit integer, as in vLLM
_SEED_RANGE = (-(2**63), 2**63 - 1)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Field names and defaults follow vLLM; invalid values
    raise ValueError naming the field at construction (and when decoded from a message)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (as their token sequences)
    # keep only the last k prompt tokens (-1: the last max_model_len - 1)
    truncate_prompt_tokens: int | None = None
    # fast tokenizers (troupe's) never put spaces around special tokens, as in vLLM with them
    spaces_between_special_tokens: bool = True
    # bad_words as token-id sequences, filled in by the input processor (with and without a
    # leading space, as vLLM): what the sampler reads
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM V0's per-request logits processors, run by the worker on each step's logits row:
    # fn(output_ids, logits_row) -> logits_row or fn(prompt_ids, output_ids, logits_row) ->
    # logits_row. Callables in this process; across processes their qualified names
    # ("module:function", with_named_processors), which a worker imports only when the engine
    # was started allowing them (--logits-processors). Never bytes: nothing a message carries
    # is unpickled. Not an HTTP field.
    logits_processors: list[Any] | None = None
    # what the output must look like (a JSON schema, a regex, a grammar, a choice)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):  # vLLM accepts the fields as a dict too
            self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def with_named_processors(self) -> SamplingParams:
        """These parameters with their logits processors as qualified names, to cross to a
        worker process (which resolves them from the engine's allow-list)."""
        if not self.logits_processors or all(isinstance(f, str) for f in self.logits_processors):
            return self
        return msgspec.structs.replace(self, logits_processors=[
            f if isinstance(f, str) else processor_name(f) for f in self.logits_processors])

    def validate(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be positive, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None:
            _check(_SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1], "seed",
                   f"must be a signed 64-bit integer, in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:  # the upper bound is the engine's max_logprobs (the input processor checks)
                _check(value >= 0, name, f"must be non-negative, got {value}")
        for stop in self.stop_strings:
            _check(isinstance(stop, str) and stop != "", "stop", "stop strings must be non-empty")
        for token_id in self.stop_token_ids or []:
            _check(token_id >= 0, "stop_token_ids", f"must be non-negative, got {token_id}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(isinstance(token_id, int) and token_id >= 0, "logit_bias",
                   f"keys must be non-negative token ids, got {token_id!r}")
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")
            for token_id in self.allowed_token_ids:
                _check(token_id >= 0, "allowed_token_ids", f"must be non-negative token ids, got {token_id}")
        for word in self.bad_words or []:
            _check(isinstance(word, str) and word.strip() != "", "bad_words", f"must be non-empty words, got {word!r}")
        for function in self.logits_processors or []:
            # bytes are how pickled processors travelled once: refused here, which is also where
            # a message is decoded, so no worker ever sees them
            _check(not isinstance(function, (bytes, bytearray, memoryview)), "logits_processors",
                   "must name processors ('module:function'), not carry them pickled")
            _check(callable(function) or (isinstance(function, str) and _QUALIFIED_NAME.fullmatch(function)),
                   "logits_processors", f"must be callables or qualified names ('module:function'), got {function!r}")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        if self.truncate_prompt_tokens is not None:
            _check(self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
                   f"must be -1 (the model's limit) or at least 1, got {self.truncate_prompt_tokens}")


# "package.module:attribute" (or "package.module.attribute"): what a worker imports
_QUALIFIED_NAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*([:.][A-Za-z_][\w]*)")


def processor_name(function: object) -> str:
    """A logits processor's qualified name ("module:function", or "module:Class", of which
    the worker makes one instance per request), as a worker process imports it: at the top
    level of an importable module (no lambda, no local function, nothing defined in the
    __main__ script, which the worker does not run). An instance has no name of its own:
    name its class, or a module-level instance by string."""
    _check(isinstance(function, type) or hasattr(function, "__qualname__"), "logits_processors",
           f"{function!r} is an instance, which cannot be named for the worker process; pass its class "
           "(one instance per request) or a function")
    module, qualname = getattr(function, "__module__", None), function.__qualname__
    _check(module not in (None, "__main__"), "logits_processors",
           f"{function!r} is defined in the __main__ script, which the worker process cannot import; "
           "move it to an importable module")
    _check("<" not in qualname and "." not in qualname, "logits_processors",
           f"{function!r} cannot be named for the worker process (a lambda, a local function or a method); "
           "define it at the top level of an importable module")
    return f"{module}:{qualname}"


def _structured_outputs(fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as error:
        raise InvalidRequestError(f"structured_outputs: {error}", param="structured_outputs") from None


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{field} {message}", param=field)


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    """The log-probability of one token at one position, with its rank in the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# position -> {token_id: Logprob}; prompt logprobs start with None for the first token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


class CompletionOutput(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One of a request's n completions.

    A delta of one goes to the frontend each step for each running request: its fields at
    their defaults are left off the wire (omit_defaults), and it is never part of a
    reference cycle, so the garbage collector need not track it (gc=False), which makes
    decoding a step's deltas a third cheaper."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """When the engine handled a request, for latency metrics. Times are time.monotonic()
    on the machine that runs the scheduler, which is the frontend's (only workers run
    elsewhere), so they compare with the frontend's own clock; None until known."""

    first_scheduled_time: float | None = None  # the first of its completions got KV blocks and a step


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What a request has produced: the whole of it (offline) or a delta (streaming).
    (omit_defaults and gc=False: as CompletionOutput's.)"""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = msgspec.field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # the request's timing so far; on a delta only when it changed


class Shutdown(msgspec.Struct, array_like=True, frozen=True, tag="shutdown"):
    """launcher or signal handler → any actor: stop taking work, close sockets, exit 0."""

    reason: str = ""


class Ping(msgspec.Struct, array_like=True, frozen=True, tag="ping"):
    """launcher → any actor: answer with a Pong to the frontend (a health check that an
    actor's loop is turning, not just that its process exists)."""

    ping_id: int
