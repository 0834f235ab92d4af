"""tool_choice, as vLLM serves it: which tools a request may call and how the calls are
found in the output.

- "none": the model answers in text (the tools are still rendered into the prompt).
- "auto" (the default when tools are sent): the model decides; the server's
  --tool-call-parser reads calls out of its text (needs --enable-auto-tool-choice).
- "required": the output is constrained to a JSON array of one or more calls
  `[{"name": ..., "parameters": {...}}]` (one when parallel_tool_calls is false).
- a named function `{"type": "function", "function": {"name": ...}}`: the output is
  constrained to that function's arguments object.

Both constraints allow JSON's whitespace as vLLM's do, in bounded runs (a line break and
indentation at most: actors/structured_output/specs.py). They allowed none before, and a
small model given no way to end a call but `]` kept writing `, {` and another call until
max_tokens cut one off mid-string; a call the output did not finish is never returned.

Constrained outputs are read with ConstrainedCallParser, a ToolParser like the others,
so streaming works the same way for every choice. `tools` are in the chat-completions
form `[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`."""

from __future__ import annotations

from typing import Any

import jsonschema

from actors.errors import InvalidRequestError
from api.request_limits import check_tools_size
from api.responses import ToolCall
from api.tool_parsers.base import ExtractedToolCalls, PartialCall, ToolParser, find, make_tool_call
from api.tool_parsers.json_scan import scan_call_object
from messages.structured_outputs import StructuredOutputsParams

_EMPTY_OBJECT_SCHEMA = {"type": "object", "properties": {}}
_TOOL_FIELDS = {"name", "description", "parameters", "strict"}


def check_tools(tools: list | None, tool_choice: str | dict | None, auto_tools_enabled: bool) -> str | dict:
    """The request's tool_choice with its default filled in ("auto" with tools, else
    "none"); InvalidRequestError naming "tools" or "tool_choice" for a malformed tool, a
    choice that names no sent tool, or "auto" on a server without a tool parser."""
    if tools is not None:
        _check_tool_list(tools)
        check_tools_size(tools)
    if tool_choice is None:
        if not tools:
            return "none"
        if not auto_tools_enabled:
            raise InvalidRequestError(
                "tools without a tool_choice mean tool_choice 'auto', which needs the server started with "
                "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice 'none', 'required' or a "
                "named function", param="tools")
        return "auto"
    if tool_choice in ("none", "auto") and not tools:
        return "none"
    if tool_choice == "auto":
        if not auto_tools_enabled:
            raise InvalidRequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                      "and --tool-call-parser", param="tool_choice")
        return tool_choice
    if tool_choice == "none":
        return tool_choice
    if not tools:
        raise InvalidRequestError("tool_choice other than 'none' or 'auto' needs tools", param="tool_choice")
    if tool_choice == "required":
        return tool_choice
    name = named_function(tool_choice)
    if name is None:
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools",
                                  param="tool_choice")
    return tool_choice


def named_function(tool_choice: str | dict | None) -> str | None:
    """The function a named tool_choice names (the chat form, or the Responses API's
    flat `{"type": "function", "name": ...}`), else None."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
    return name if isinstance(name, str) else None


def tool_choice_constraint(tools: list[dict], tool_choice: str | dict | None,
                           parallel_tool_calls: bool | None) -> StructuredOutputsParams | None:
    """The constraint that makes the output a valid call: for "required" an array of
    calls, for a named function its arguments object; None for "none", "auto" and None."""
    if tool_choice == "required":
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"type": "object", "anyOf": [_call_schema(tool) for tool in tools]}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    name = named_function(tool_choice)
    if name is None:
        return None
    functions = [tool["function"] for tool in tools if tool["function"]["name"] == name]
    if not functions:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools",
                                  param="tool_choice")
    return StructuredOutputsParams(json=_parameters(functions[0]))


def calls_from_constrained_output(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """The calls a constrained output holds: for a named function one call whose
    arguments are the output's JSON object; for "required" one per array item."""
    return ConstrainedCallParser(tool_choice).extract_tool_calls(text).tool_calls


class ConstrainedCallParser(ToolParser):
    """Reads the output of a required or named tool_choice. A call's arguments are the
    output's own text of its object, so a stream's fragments and the whole message agree.
    The whole message holds only the calls the output finished: one that max_tokens cut off
    (its arguments unterminated JSON) is left out, and an output with none is content."""

    def __init__(self, tool_choice: str | dict) -> None:
        super().__init__(None)
        self.function_name = None if tool_choice == "required" else named_function(tool_choice)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        finished = [call for call, done in self._calls(text, None) if done and call.name is not None]
        if not finished:
            return ExtractedToolCalls(content=text or None)
        return ExtractedToolCalls(content=None, tool_calls=[make_tool_call(call.name, call.arguments)
                                                            for call in finished])

    def partial(self, text: str, state: dict | None = None) -> tuple[str, list[PartialCall]]:
        return "", [call for call, _ in self._calls(text, state)]

    def _calls(self, text: str, state: dict | None) -> list[tuple[PartialCall, bool]]:
        """Each call begun so far, and whether its object closed."""
        start = _first_of(text, "{" if self.function_name is not None else "[", 0, state)
        if start is None:
            return []
        if self.function_name is not None:
            end = scan_call_object(text, start, state).end
            return [(PartialCall(self.function_name, text[start:end or len(text)]), end is not None)]
        calls = []
        position = _first_of(text, "{", start + 1, state)
        while position is not None:
            scan = scan_call_object(text, position, state)
            closed = scan.end is not None and scan.arguments_end is not None
            calls.append((PartialCall(scan.name, scan.arguments_text(text)), closed))
            if scan.end is None:
                break
            position = _first_of(text, "{", scan.end, state)
        return calls


def _first_of(text: str, char: str, start: int, state: dict | None = None) -> int | None:
    index = find(text, char, start, state)
    return None if index < 0 else index


def _call_schema(tool: dict) -> dict:
    function = tool["function"]
    return {"properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": _parameters(function)},
            "required": ["name", "parameters"], "additionalProperties": False}


def _parameters(function: dict) -> dict:
    return function.get("parameters") or _EMPTY_OBJECT_SCHEMA


def _check_tool_list(tools: Any) -> None:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    names = set()
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{param} must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                      param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{param}.function.name must be a non-empty string", param="tools")
        if name in names:
            raise InvalidRequestError(f"{param}: two tools are named {name!r}", param="tools")
        names.add(name)
        unknown = sorted(set(function) - _TOOL_FIELDS)
        if unknown:
            raise InvalidRequestError(f"{param}.function has unknown fields {', '.join(unknown)}", param="tools")
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise InvalidRequestError(f"{param}.function.description must be a string", param="tools")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise InvalidRequestError(f"{param}.function.parameters must be a JSON schema object", param="tools")
            try:
                jsonschema.validators.validator_for(parameters).check_schema(parameters)
            except jsonschema.SchemaError as error:
                raise InvalidRequestError(f"{param}.function.parameters is not a valid JSON schema: {error.message}",
                                          param="tools") from None
