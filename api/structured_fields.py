"""The request fields that ask for structured output, as one StructuredOutputsParams:
OpenAI's `response_format` (json_object, json_schema, and vLLM's structural_tag), vLLM's
`structured_outputs` object, and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (with `guided_whitespace_pattern`) fields.

A request sets at most one of them. The constraint is checked here, so a bad schema,
regex or grammar is a 400 naming the field the client sent; the input processor checks
it again against the engine's backend (and names structured_outputs' own fields)."""

from __future__ import annotations

import importlib
import json
import threading
from typing import Any

import msgspec

from actors.errors import InvalidRequestError
from api.request_limits import check_schema_size
from messages.structured_outputs import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredFields(msgspec.Struct, kw_only=True):
    """The fields, shared by /v1/completions and /v1/chat/completions (mixed into their bodies)."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint the request asks for (checked), or None; InvalidRequestError naming the field."""
        for field in ("response_format", "structured_outputs", *_GUIDED, "structural_tag"):
            check_schema_size(field, getattr(self, field))
        sources = [(name, value) for name, value in self._sources() if value is not None]
        if not sources:
            if self.guided_whitespace_pattern is not None:
                raise InvalidRequestError("guided_whitespace_pattern needs guided_json (or another JSON constraint)",
                                          param="guided_whitespace_pattern")
            return None
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise InvalidRequestError(f"ask for one kind of structured output at a time; got {names}",
                                      param=sources[1][0])
        field, constraint = sources[0]
        if self.guided_whitespace_pattern is not None:
            constraint = msgspec.structs.replace(constraint, whitespace_pattern=self.guided_whitespace_pattern)
        check_constraint_of(field, constraint)
        return constraint

    def _sources(self):
        yield "response_format", response_format_constraint(self.response_format)
        if self.structured_outputs is not None:
            yield "structured_outputs", _build("structured_outputs", self.structured_outputs)
        for field, name in _GUIDED.items():
            value = getattr(self, field)
            if value is not None:
                yield field, _build(field, {name: value})
        if self.structural_tag is not None:
            yield "structural_tag", _build("structural_tag", {"structural_tag": self.structural_tag})


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The constraint OpenAI's response_format asks for (unchecked), or None for text."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", {"json_object": True})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise InvalidRequestError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                                      "{...}}}", param="response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("response_format json_schema.schema must be a JSON schema object",
                                      param="response_format")
        return _build("response_format", {"json": schema if isinstance(schema, dict) else json.dumps(schema)})
    if kind == "structural_tag":
        return _build("response_format", {"structural_tag": json.dumps(response_format)})
    raise InvalidRequestError(f"response_format type must be text, json_object, json_schema or structural_tag; got "
                              f"{kind!r}", param="response_format")


def _build(field: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as error:  # an unknown key in structured_outputs
        raise InvalidRequestError(f"{field}: {error}", param=field) from None
    except InvalidRequestError as error:
        raise InvalidRequestError(str(error), param=field) from None


def check_constraint_of(field: str, constraint: StructuredOutputsParams) -> None:
    """The grammar check, naming `field`: with xgrammar, or llguidance for what only it has
    (a whitespace pattern). The engine's own backend checks again before queueing."""
    from actors.structured_output import check_constraint

    check_constraint(constraint, "guidance" if constraint.whitespace_pattern is not None else "xgrammar", field)


def warm_up() -> None:
    """Imports the grammar libraries on a thread (xgrammar's import takes 1.5 s), so the
    first structured request does not hold the server's event loop that long."""
    def load() -> None:
        for module in ("actors.structured_output.xgrammar_backend", "actors.structured_output.guidance_backend"):
            importlib.import_module(module)

    threading.Thread(target=load, name="troupe-grammar-import", daemon=True).start()
