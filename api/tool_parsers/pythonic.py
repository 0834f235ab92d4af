"""pythonic: calls written as a Python list of function calls with literal keyword
arguments (Llama 3.2/4's, and many small models'):

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

Parsed with `ast`: only literal values (strings, numbers, booleans, None, lists, dicts);
anything else makes the whole output content, and so does text that `ast` cannot take
(nested past its limits: MemoryError, RecursionError). Streamed, each call is sent whole
once its closing parenthesis has arrived; the list is scanned only as far as it grew, and
each closed element parsed once."""

from __future__ import annotations

import ast
import json

from api.tool_parsers.base import ExtractedToolCalls, PartialCall, ToolParser, make_tool_call


class PythonicToolParser(ToolParser):
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = _parse_calls(text.strip())
        if calls is None:
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(content=None, tool_calls=[make_tool_call(name, args) for name, args in calls])

    def partial(self, text: str, state: dict | None = None) -> tuple[str, list[PartialCall]]:
        start = len(text) - len(text.lstrip()) if state is None or "start" not in state else state["start"]
        if start == len(text):
            return "", []
        if text[start] != "[":
            return text, []
        state = {} if state is None else state
        state["start"] = start  # where the list opens, found once
        scanner = state.get("elements") or state.setdefault("elements", _ElementScanner(start))
        parsed_elements: dict[int, list[tuple[str, str]] | None] = state.setdefault("parsed", {})
        calls = []
        for element_start, element_end in scanner.advance(text):
            if element_start not in parsed_elements:  # a closed element never changes: parsed once
                parsed_elements[element_start] = _parse_calls(f"[{text[element_start:element_end]}]")
            parsed = parsed_elements[element_start]
            if not parsed:
                break
            calls += [PartialCall(name, args) for name, args in parsed]
        return "", calls


def _parse_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) per call of a list of calls, or None when text is not one."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # (a NUL; nesting past the parser's limits)
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if None in arguments:  # **kwargs
            return None
        calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class _ElementScanner:
    """The list's elements whose text is complete (followed by "," or "]" at the list's own
    level), skipping brackets and quotes inside them, as (start, end) spans of the stream's
    text; advance() reads only what the text added since its last call."""

    def __init__(self, list_start: int) -> None:
        self.index = list_start  # the next character to read (the list's "[" first)
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.element_start = list_start + 1
        self.closed = False  # the list itself closed: nothing after it is read
        self.spans: list[tuple[int, int]] = []  # the elements closed so far, blank ones left out

    def advance(self, text: str) -> list[tuple[int, int]]:
        index = self.index
        while index < len(text) and not self.closed:
            char = text[index]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = None
            elif char in "'\"":
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 0:  # the list itself closed
                    self._close(text, index)
                    self.closed = True
            elif char == "," and self.depth == 1:
                self._close(text, index)
                self.element_start = index + 1
            index += 1
        self.index = index
        return self.spans

    def _close(self, text: str, end: int) -> None:
        if text[self.element_start:end].strip():
            self.spans.append((self.element_start, end))
