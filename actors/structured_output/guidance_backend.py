"""The llguidance backend (--structured-outputs-backend guidance): a grammar is only
checked ahead; each matcher computes its masks lazily, walking the token trie."""

from __future__ import annotations


import llguidance
import llguidance.hf
import llguidance.torch
import torch

from actors.structured_output.specs import JSON_WHITESPACE_REGEX, choice_grammar, invalid, is_ebnf, json_schema
from messages.errors import InvalidRequestError
from messages.structured_outputs import StructuredOutputsParams


def grammar_text(constraint: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar (a JSON document)."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        options: dict = {"whitespace_flexible": not constraint.disable_any_whitespace}
        if constraint.whitespace_pattern is not None:
            options["whitespace_pattern"] = constraint.whitespace_pattern
        elif not constraint.disable_any_whitespace:
            options["whitespace_pattern"] = JSON_WHITESPACE_REGEX  # bounded runs (specs.py)
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema(constraint), defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_lark(choice_grammar(constraint.choice)))
    if kind == "grammar":
        text = constraint.grammar
        return llguidance.LLMatcher.grammar_from_lark(_lark(text) if is_ebnf(text) else text)
    raise InvalidRequestError("structured_outputs.structural_tag needs the xgrammar backend "
                              "(--structured-outputs-backend xgrammar)", param="structured_outputs.structural_tag")


def _lark(ebnf: str) -> str:
    """llguidance's Lark reads GBNF rules once `::=` is Lark's `:`; GBNF starts at `root`,
    Lark at `start`."""
    return "start: root\n" + ebnf.replace("::=", ":")


def check_grammar(constraint: StructuredOutputsParams) -> None:
    try:
        grammar = grammar_text(constraint)
    except InvalidRequestError:
        raise
    except Exception as error:  # noqa: BLE001 - llguidance raises ValueError and others
        raise invalid(constraint, error) from None
    ok, message = _validate(grammar)
    if not ok:
        raise invalid(constraint, ValueError(message))


def _validate(grammar: str, tokenizer=None) -> tuple[bool, str]:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return not is_error, "; ".join(messages)


class GuidanceMatcher:
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        eos = stop_token_ids[0] if stop_token_ids else None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, constraint: StructuredOutputsParams) -> str:
        try:
            grammar = grammar_text(constraint)
        except InvalidRequestError:
            raise
        except Exception as error:  # noqa: BLE001
            raise invalid(constraint, error) from None
        ok, message = _validate(grammar, self._tokenizer)
        if not ok:
            raise invalid(constraint, ValueError(message))
        return grammar

    def matcher(self, compiled: str) -> GuidanceMatcher:
        return GuidanceMatcher(self._tokenizer, compiled)
