"""llama3_json: Llama 3.1/3.2's JSON tool calls: the output is one or more objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by ";", possibly after
`<|python_tag|>`. An output that does not start that way, or does not parse, is content."""

from __future__ import annotations

import json

from api.tool_parsers.base import ExtractedToolCalls, PartialCall, ToolParser, make_tool_call
from api.tool_parsers.json_scan import call_arguments, scan_call_object

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        position = _calls_start(text)
        if position is None or position >= len(text):
            return ExtractedToolCalls(content=text)
        decoder = json.JSONDecoder()
        calls = []
        while position < len(text):
            try:
                decoded, end = decoder.raw_decode(text, position)
            except ValueError:
                return ExtractedToolCalls(content=text)
            if not isinstance(decoded, dict) or not isinstance(decoded.get("name"), str):
                return ExtractedToolCalls(content=text)
            calls.append(make_tool_call(decoded["name"], call_arguments(text, position, decoded)))
            position = _skip(text, end)
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def partial(self, text: str, state: dict | None = None) -> tuple[str, list[PartialCall]]:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return "", []  # it may yet become a call
        position = _calls_start(text)
        if position is None:
            return text, []
        calls = []
        while position < len(text) and text[position] == "{":
            scan = scan_call_object(text, position, state)
            calls.append(PartialCall(scan.name, scan.arguments_text(text)))
            if scan.end is None:
                break
            position = _skip(text, scan.end)
        return "", calls


def _calls_start(text: str) -> int | None:
    """Where the first call object starts, or None when the output is not calls."""
    position = _skip(text, 0, " \t\r\n")
    if text.startswith(PYTHON_TAG, position):
        position = _skip(text, position + len(PYTHON_TAG), " \t\r\n")
    if position < len(text) and text[position] != "{":
        return None
    return position


def _skip(text: str, position: int, characters: str = _SEPARATORS) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position
