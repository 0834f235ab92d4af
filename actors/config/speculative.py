"""SpeculativeConfig: vLLM's `--speculative-config` JSON (or `LLM(speculative_config=...)`
dict), validated at start-up so a bad config fails before serving. Torch-free, so every
actor process can import it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from actors.config.json_flags import parse_json_object
from messages.common import SamplingParams

METHODS = ("ngram", "suffix", "draft_model")

# vLLM's defaults: both n-gram bounds fall back to 5 when neither is given, and to each
# other when one is; the suffix defaults are Arctic Inference's (and vLLM's).
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_SUFFIX_MAX_TREE_DEPTH = 24
DEFAULT_SUFFIX_MAX_CACHED_REQUESTS = 10000
DEFAULT_SUFFIX_MAX_SPEC_FACTOR = 1.0
DEFAULT_SUFFIX_MIN_TOKEN_PROB = 0.1


@dataclass(frozen=True)
class SpeculativeConfig:
    """How decode steps are speculated; one per engine."""

    method: str  # one of METHODS
    num_speculative_tokens: int  # k: drafts proposed (and lookahead slots reserved) per decode
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int | None = None  # ngram: longest suffix n-gram matched
    suffix_decoding_max_tree_depth: int = DEFAULT_SUFFIX_MAX_TREE_DEPTH  # suffix: longest path kept
    suffix_decoding_max_cached_requests: int = DEFAULT_SUFFIX_MAX_CACHED_REQUESTS  # suffix: global cache, in requests
    suffix_decoding_max_spec_factor: float = DEFAULT_SUFFIX_MAX_SPEC_FACTOR  # suffix: drafts per matched token
    suffix_decoding_min_token_prob: float = DEFAULT_SUFFIX_MIN_TOKEN_PROB  # suffix: stop below this probability
    model: str | None = None  # draft_model: path of the draft (same tokenizer as the target)
    disable_by_batch_size: int | None = None  # no speculation in a step with at least this many requests


_KNOWN_KEYS = frozenset(f.name for f in fields(SpeculativeConfig))


def _int_field(raw: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    # bool is an int subclass; `true` for a count is a typo, not 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"speculative_config: {name} must be >= {minimum}, got {value}")
    return value


def _float_field(raw: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"speculative_config: {name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be in [{low}, {high}], got {value}")
    return float(value)


def _method(raw: dict[str, Any]) -> str:
    method = raw.get("method")
    if method is None:
        # vLLM infers the method from `model`: "ngram" names the proposer, anything else a draft
        model = raw.get("model")
        if model is None:
            raise ValueError("speculative_config: method is required (one of ngram, suffix, draft_model)")
        return "ngram" if model == "ngram" else "draft_model"
    if method == "[ngram]":  # vLLM's older spelling
        return "ngram"
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
    return method


def _prompt_lookup(raw: dict[str, Any]) -> tuple[int, int]:
    low = _int_field(raw, "prompt_lookup_min", None, 1)
    high = _int_field(raw, "prompt_lookup_max", None, 1)
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    elif low is None:
        low = high
    elif high is None:
        high = low
    assert low is not None and high is not None
    if low > high:
        raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
    return low, high


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from vLLM's JSON string or dict; None (or "") means no speculation.
    Raises ValueError naming the offending field."""
    if value is None or value == "":
        return None
    value = parse_json_object(value, "speculative_config")
    unknown = sorted(set(value) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown field {', '.join(unknown)}")
    method = _method(value)
    model = value.get("model")
    if method == "draft_model" and not model:
        raise ValueError("speculative_config: model (the draft's path) is required for method draft_model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config: model must be a path string, got {model!r}")
    max_tree_depth = _int_field(value, "suffix_decoding_max_tree_depth", DEFAULT_SUFFIX_MAX_TREE_DEPTH, 1)
    assert max_tree_depth is not None
    # vLLM lets suffix decoding default k to the tree depth: the adaptive length then bounds it
    default_k = max_tree_depth if method == "suffix" else None
    num_speculative_tokens = _int_field(value, "num_speculative_tokens", default_k, 1)
    if num_speculative_tokens is None:
        raise ValueError(f"speculative_config: num_speculative_tokens is required for method {method}")
    low, high = _prompt_lookup(value) if method == "ngram" else (None, None)
    max_cached = _int_field(value, "suffix_decoding_max_cached_requests", DEFAULT_SUFFIX_MAX_CACHED_REQUESTS, 0)
    assert max_cached is not None
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        suffix_decoding_max_tree_depth=max_tree_depth,
        suffix_decoding_max_cached_requests=max_cached,
        suffix_decoding_max_spec_factor=_float_field(
            value, "suffix_decoding_max_spec_factor", DEFAULT_SUFFIX_MAX_SPEC_FACTOR, 0.0, float("inf")),
        suffix_decoding_min_token_prob=_float_field(
            value, "suffix_decoding_min_token_prob", DEFAULT_SUFFIX_MIN_TOKEN_PROB, 0.0, 1.0),
        model=model if method == "draft_model" else None,
        # a batch of one is never compute-bound, so vLLM rejects thresholds below 2
        disable_by_batch_size=_int_field(value, "disable_by_batch_size", None, 2),
    )


def check_engine_fit(config: SpeculativeConfig, *, pooling: bool, max_num_batched_tokens: int) -> None:
    """ValueError, at start-up, for a speculative config this engine cannot run."""
    if pooling:
        raise ValueError("speculative_config: a pooling model does not generate tokens, so it cannot speculate")
    if 1 + config.num_speculative_tokens > max_num_batched_tokens:
        raise ValueError(f"speculative_config: num_speculative_tokens ({config.num_speculative_tokens}) + 1 must "
                         f"fit in max_num_batched_tokens ({max_num_batched_tokens}): a decode verifies 1 + k tokens")


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request's sampling allows drafts: its distribution at a draft position must
    not depend on the drafts before it (penalties, bad words and grammars read the output so
    far; custom processors might) and it must need nothing per position (logprobs). What
    changes as it decodes (min_tokens) the worker checks step by step."""
    return (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and not params.bad_words_token_ids and not params.logits_processors
            and params.structured_outputs is None and params.logprobs is None)
