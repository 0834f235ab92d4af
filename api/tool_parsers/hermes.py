"""hermes: Qwen2/Qwen3 (and Hermes) models' tool calls, one JSON object per
`<tool_call>...</tool_call>` block:

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first block is content; a block that is not valid JSON makes the whole
output content (vLLM's rule)."""

from __future__ import annotations

import json
import re

from api.tool_parsers.base import ExtractedToolCalls, PartialCall, ToolParser, find, held_back, make_tool_call
from api.tool_parsers.json_scan import call_arguments, scan_call_object

START, END = "<tool_call>", "</tool_call>"
# a closed block, or the last one left open (the output ended inside it)
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(content=text)
        calls = []
        for match in _BLOCK.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = _parse_call(body)
            if call is None:
                return ExtractedToolCalls(content=text)
            calls.append(call)
        content = text[:text.index(START)]
        return ExtractedToolCalls(content=content or None, tool_calls=calls)

    def partial(self, text: str, state: dict | None = None) -> tuple[str, list[PartialCall]]:
        first = find(text, START, 0, state)
        if first < 0:
            return text[:len(text) - held_back(text, START)], []
        calls = []
        position = first
        while position >= 0:
            body_start = position + len(START)
            block_end = find(text, END, body_start, state)
            limit = len(text) if block_end < 0 else block_end  # a call never reads past its block
            brace = _first_non_space(text, body_start, limit)
            if brace is None or text[brace] != "{":
                break
            scan = scan_call_object(text, brace, state, limit)
            calls.append(PartialCall(scan.name, scan.arguments_text(text, limit)))
            if scan.end is None:
                break
            position = find(text, START, scan.end, state)
        return text[:first], calls


def _parse_call(body: str):
    start = _first_non_space(body, 0)
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("name"), str) or start is None:
        return None
    return make_tool_call(decoded["name"], call_arguments(body, start, decoded))


def _first_non_space(text: str, start: int, limit: int | None = None) -> int | None:
    for index in range(start, len(text) if limit is None else limit):
        if not text[index].isspace():
            return index
    return None
