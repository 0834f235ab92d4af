"""The xgrammar backend: one GrammarCompiler per model (its cache shared by every request),
a GrammarMatcher per request."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from actors.structured_output.specs import JSON_WHITESPACE_EBNF, choice_grammar, invalid, is_ebnf, json_schema
from messages.structured_outputs import StructuredOutputsParams
from messages.errors import InvalidRequestError

# compiled grammars kept by the compiler's own cache (bytes); xgrammar's default is unbounded
COMPILER_CACHE_BYTES = 256 * 2**20


def check_grammar(constraint: StructuredOutputsParams) -> None:
    """Builds the constraint's grammar (no tokenizer): InvalidRequestError if it cannot."""
    try:
        _grammar(constraint)
    except InvalidRequestError:
        raise
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own types
        raise invalid(constraint, error) from None


def _grammar(constraint: StructuredOutputsParams) -> xgr.Grammar:
    if constraint.whitespace_pattern is not None:
        raise InvalidRequestError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                                  "start the engine with --structured-outputs-backend guidance",
                                  param="structured_outputs.whitespace_pattern")
    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema = json_schema(constraint)
        _refuse_unenforced(schema)
        grammar = xgr.Grammar.from_json_schema(json.dumps(_bounded_strings_as_patterns(schema)),
                                               any_whitespace=not constraint.disable_any_whitespace)
        return grammar if constraint.disable_any_whitespace else _bounded_whitespace(grammar)
    if kind == "regex":
        return xgr.Grammar.from_regex(constraint.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(constraint.choice))
    if kind == "grammar":
        text = constraint.grammar
        return xgr.Grammar.from_ebnf(text) if is_ebnf(text) else xgr.Grammar.from_lark(text)
    return xgr.Grammar.from_structural_tag(_current_structural_tag(constraint.structural_tag))


# xgrammar 0.2.8's rule for free whitespace, as its EBNF prints it
_ANY_WHITESPACE = "[ \\n\\r\\t]*"


def _bounded_whitespace(grammar: xgr.Grammar) -> xgr.Grammar:
    """The JSON grammar with every run of free whitespace bounded (specs.JSON_WHITESPACE_EBNF):
    xgrammar takes no whitespace rule of its own, so its EBNF is rewritten."""
    text = str(grammar)
    if _ANY_WHITESPACE not in text:
        return grammar  # (compact everywhere: nothing to bound)
    bounded = text.replace(_ANY_WHITESPACE, "json_whitespace")
    assert "\\n\\r\\t]" not in bounded, "xgrammar spells whitespace another way: bound it here too"
    return xgr.Grammar.from_ebnf(f"{bounded}\njson_whitespace ::= {JSON_WHITESPACE_EBNF}\n")


def _current_structural_tag(text: str) -> str:
    """vLLM's first structural-tag form (`structures` of begin/schema/end and `triggers`)
    in xgrammar's current one (a `format` of triggered tags); the current one unchanged."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or "structures" not in tag:
        return text
    tags = [{"begin": item["begin"], "content": {"type": "json_schema", "json_schema": item.get("schema", {})},
             "end": item["end"]} for item in tag["structures"]]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}})


# keywords xgrammar 0.2.8 accepts without enforcing (a document breaking them matched):
# refused, so a schema never quietly promises more than the output keeps (oneOf is kept
# and enforced as anyOf; allOf with one entry, pydantic's way of wrapping a $ref, is kept)
UNENFORCED_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "contains", "minContains", "maxContains",
                       "dependentRequired", "dependentSchemas", "dependencies")
# keywords whose value is data or a map of names to schemas, not a schema
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "description", "title"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _refuse_unenforced(schema: Any) -> None:
    if isinstance(schema, list):
        for item in schema:
            _refuse_unenforced(item)
        return
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        if keyword in UNENFORCED_KEYWORDS and value is not False:
            raise InvalidRequestError(f"the JSON schema keyword {keyword!r} is not supported by the xgrammar backend "
                                      "(the output could not be guaranteed to follow it)",
                                      param="structured_outputs.json")
        if keyword == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequestError("allOf with more than one schema is not supported by the xgrammar backend (the "
                                      "output could not be guaranteed to follow it)", param="structured_outputs.json")
        if keyword in _DATA_KEYWORDS:
            continue
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            _refuse_unenforced(list(value.values()))
        else:
            _refuse_unenforced(value)


# One JSON string character, unescaped, as a positive class: every code point from U+0020 but
# quote, backslash and the UTF-16 surrogates (the astral range written as its characters, as
# xgrammar's regex reads no \U escape). xgrammar 0.2.8 compiles a negated class to byte
# sequences that are not all UTF-8 (a surrogate's or an overlong form's bytes got through,
# each decoded to U+FFFD, so a bounded string came out longer than maxLength); a positive
# class of ranges compiles to exactly the UTF-8 encodings of its code points.
_STRING_CHAR = "[ !#-\\[\\]-\\ud7ff\\ue000-\\uffff\U00010000-\U0010ffff]"


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """xgrammar 0.2.8 spells a string with minLength/maxLength as any characters but quote,
    backslash, CR and LF, so control characters (invalid inside JSON strings) get through
    (the unbounded string rule excludes them). Such strings become the equivalent pattern
    of valid UTF-8 characters without control characters (and without escapes: a subset of
    what the schema allows)."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in result or "maxLength" in result
    if result.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & result.keys():
        low, high = result.pop("minLength", 0), result.pop("maxLength", "")
        result["pattern"] = "^%s{%s,%s}$" % (_STRING_CHAR, low, high)
    return result


def _lowest_cpu_priority() -> None:
    """A compile thread's initializer: it runs on the CPU time the process's other threads
    leave (Linux's SCHED_IDLE, set by thread id), so a compile that takes seconds does not
    slow the worker's steps, whose threads, waking hundreds of times a step, preempt it at
    once (at nice 19, with xgrammar's 8 threads, plain requests took 2x as long beside a
    compile). For good: an unprivileged thread may not raise its priority again. The price:
    a CPU saturated by steps leaves a compile little time, and past --grammar-compile-timeout
    its request is refused."""
    thread_id = threading.get_native_id()
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, 19)
        except (AttributeError, OSError):
            pass  # neither: the compile shares the CPU as any thread does


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # one thread a compile (xgrammar's default is 8), the caller's: one of these, of the
        # lowest priority, which only the C++ compile runs on (it releases the GIL; a thread of
        # that priority holding the GIL would stall the worker's step loop behind it)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
        self._compile_threads = ThreadPoolExecutor(2, thread_name_prefix="troupe-grammar-idle",
                                                   initializer=_lowest_cpu_priority)

    def compile(self, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            grammar = _grammar(constraint)  # (Python, which holds the GIL: here, at the caller's priority)
            return self._compile_threads.submit(self._compiler.compile_grammar, grammar).result()
        except InvalidRequestError:
            raise
        except Exception as error:  # noqa: BLE001
            raise invalid(constraint, error) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)
