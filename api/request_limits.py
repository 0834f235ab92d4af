"""The bounds on request fields that the engine would otherwise take at any size: each a
documented number (docs/security.md), OpenAI's or vLLM's where they have one, checked at the
edge so that a request past one is a 400 naming the field before anything runs.

Why each matters: `n` multiplies every cost of a request (admission counts it too:
ServingContext.open); stop strings are scanned by the detokenizer at every token; stop
token ids, bad words and logit bias are applied by the sampler at every step; a tool list
and a schema are rendered into the prompt and compiled into a grammar; metadata is kept
with every stored response."""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any

from actors.config import DEFAULT_MAX_N_SEQUENCES, max_n_sequences  # noqa: F401 - the bound's default, named here too
from actors.errors import InvalidRequestError
from actors.config.structured_output import DEFAULT_MAX_GRAMMAR_BYTES

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's
MAX_TOOLS = 128  # OpenAI's
MAX_TOOL_BYTES = 64 * 2**10  # one tool's definition, as JSON
# a structured output's schema, regex, grammar or choices, as JSON: the engine's one bound,
# --max-grammar-bytes (its default here); a server checks its own value (max_schema_bytes)
MAX_SCHEMA_BYTES = DEFAULT_MAX_GRAMMAR_BYTES
MAX_METADATA_KEYS = 16  # OpenAI's, for /v1/responses metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_sampling_fields(n: int, stop: str | list[str] | None, stop_token_ids: list[int] | None,
                          bad_words: list[str] | None, logit_bias: dict[str, float] | None,
                          allowed_token_ids: list[int] | None, vocab_size: int) -> None:
    """The bounds of the sampling fields /v1/completions and /v1/chat/completions share."""
    limit = max_n_sequences()
    if n > limit:
        raise InvalidRequestError(f"n must be at most {limit}, got {n}", param="n")
    stops = [stop] if isinstance(stop, str) else stop or []
    _check_count("stop", len(stops), MAX_STOP_STRINGS, "strings")
    _check_lengths("stop", stops, MAX_STOP_STRING_CHARS)
    _check_count("stop_token_ids", len(stop_token_ids or ()), MAX_STOP_TOKEN_IDS, "token ids")
    _check_count("bad_words", len(bad_words or ()), MAX_BAD_WORDS, "words")
    _check_lengths("bad_words", bad_words or [], MAX_BAD_WORD_CHARS)
    _check_count("logit_bias", len(logit_bias or ()), MAX_LOGIT_BIAS_ENTRIES, "entries")
    # a token id listed twice allows nothing more: more ids than the vocabulary has are padding
    _check_count("allowed_token_ids", len(allowed_token_ids or ()), vocab_size, "token ids")


def check_tools_size(tools: list[Any] | None, param: str = "tools") -> None:
    """At most MAX_TOOLS tools, each at most MAX_TOOL_BYTES as JSON."""
    if not tools:
        return
    _check_count(param, len(tools), MAX_TOOLS, "tools")
    for index, tool in enumerate(tools):
        size = json_size(tool)
        if size > MAX_TOOL_BYTES:
            raise InvalidRequestError(f"{param}[{index}] is {size} bytes as JSON; at most {MAX_TOOL_BYTES} are allowed",
                                      param=param)


# the serving engine's --max-grammar-bytes, set for each request's handling (api/app.py)
max_schema_bytes: ContextVar[int] = ContextVar("max_schema_bytes", default=MAX_SCHEMA_BYTES)


def check_schema_size(param: str, constraint: Any) -> None:
    """A structured output's schema (or regex, grammar, choices) at most --max-grammar-bytes as JSON."""
    if constraint is None:
        return
    size, limit = json_size(constraint), max_schema_bytes.get()
    if size > limit:
        raise InvalidRequestError(f"{param} is {size} bytes as JSON, more than this server's limit of {limit} "
                                  "(--max-grammar-bytes)", param=param)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on a response's metadata: 16 pairs, keys of 64 characters, values of 512."""
    if metadata is None:
        return
    _check_count("metadata", len(metadata), MAX_METADATA_KEYS, "keys")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequestError(f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters, got one "
                                      f"of {len(key)}", param="metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(f"metadata values must be at most {MAX_METADATA_VALUE_CHARS} characters; the "
                                      f"value of {key!r} has {len(value)}", param="metadata")


def json_size(value: Any) -> int:
    """The bytes of value as compact JSON (a string counts as its UTF-8 bytes)."""
    if isinstance(value, str):
        return len(value.encode())
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode())


def _check_count(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(f"{param} may hold at most {limit} {what}, got {count}", param=param)


def _check_lengths(param: str, texts: list[str], limit: int) -> None:
    for text in texts:
        if isinstance(text, str) and len(text) > limit:
            raise InvalidRequestError(f"each of {param} must be at most {limit} characters, got one of {len(text)}",
                                      param=param)
