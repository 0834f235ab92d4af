"""What both backends do to a constraint before their library sees it."""

from __future__ import annotations

import json
import re
from typing import Any

from messages.errors import InvalidRequestError
from messages.structured_outputs import StructuredOutputsParams

# json_object asks for any JSON object (OpenAI's meaning), not any JSON value
ANY_OBJECT_SCHEMA = {"type": "object"}

# The whitespace a JSON grammar allows between tokens when free whitespace is on (the
# default): at most one line break, after at most 4 spaces or tabs, then at most 128 of them
# (indentation). Compact JSON, json.dumps' ", " and ": ", and pretty-printed JSON (any indent,
# CRLF too, nested up to 128 / indent levels) all stay reachable; a weak model can no longer
# write newlines or spaces until max_tokens (xgrammar's and llguidance's own rule is any run).
MAX_SPACES_BEFORE_NEWLINE = 4
MAX_INDENT = 128
JSON_WHITESPACE_REGEX = rf"[ \t]{{0,{MAX_SPACES_BEFORE_NEWLINE}}}(\r?\n[ \t]{{0,{MAX_INDENT}}})?"
JSON_WHITESPACE_EBNF = rf'[ \t]{{0,{MAX_SPACES_BEFORE_NEWLINE}}} (("\r")? "\n" [ \t]{{0,{MAX_INDENT}}})?'


def json_schema(constraint: StructuredOutputsParams) -> dict[str, Any] | bool:
    """The schema a json / json_object constraint asks for, with additionalProperties false
    on every object schema that does not say otherwise when disable_additional_properties."""
    if constraint.json_object:
        schema: Any = dict(ANY_OBJECT_SCHEMA)
    else:
        schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
    if constraint.disable_additional_properties:
        schema = _no_additional_properties(schema)
    return schema


def _no_additional_properties(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _no_additional_properties(value) for key, value in schema.items()}
    if (result.get("type") == "object" or "properties" in result) and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the choices (JSON string literals escape them)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def is_ebnf(grammar: str) -> bool:
    """GBNF/EBNF rules are written `name ::= ...`; Lark's `name: ...`."""
    return "::=" in grammar


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def invalid(constraint: StructuredOutputsParams, error: Exception) -> InvalidRequestError:
    kind = constraint.kind
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar", "structural_tag": "structural tag"}[kind]
    # xgrammar's messages start "[time] file.cc:line: "
    message = _SOURCE_PREFIX.sub("", str(error).strip()).strip() or type(error).__name__
    return InvalidRequestError(f"invalid {what}: {message}",
                               param=f"structured_outputs.{kind}")
