"""Reading a tool call's JSON object `{"name": ..., "arguments": {...}}` while it is still
being generated: the name once its string is closed, and where the arguments object
starts and (once closed) ends.

A call's arguments are the model's own text of that object, sliced out of the output,
so what a stream sends piece by piece and what the whole response holds are the same
string (re-serialising a partly parsed object could not promise that).

A stream's text only grows, so CallScanner keeps where its scan stopped and reads only
what was added since: a call of n characters streamed in d deltas costs O(n) scanning, not
O(n x d) (the output re-read at every delta made long calls quadratic on the API's loop)."""

from __future__ import annotations

import json
from dataclasses import dataclass

# the keys a call object names its arguments by: hermes and the OpenAI shape say
# "arguments", Llama 3's JSON calls and vLLM's `required` grammar say "parameters"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallScan:
    """What is known of one call object so far; indexes into the scanned text."""

    name: str | None = None  # once the name's string is closed
    arguments_start: int | None = None  # the arguments object's "{"
    arguments_end: int | None = None  # just past its "}", once closed
    end: int | None = None  # just past the call object's "}", once closed

    def arguments_text(self, text: str, limit: int | None = None) -> str:
        """The arguments' text so far (a prefix of the final text; "" before it starts),
        within text[:limit]."""
        if self.arguments_start is None:
            return ""
        return text[self.arguments_start:self.arguments_end or (len(text) if limit is None else limit)]


class CallScanner:
    """The scan of the JSON object that opens at a position ("{"), resumable: advance()
    reads only the characters added since its last call."""

    def __init__(self, start: int) -> None:
        self.scan = CallScan()
        self.index = start  # the next character to read
        self.depth = 0
        self.in_string = self.escaped = self.expecting_key = False
        self.string_start = 0
        self.key: str | None = None  # the outer object's key whose value is being read

    def advance(self, text: str, limit: int | None = None) -> CallScan:
        """The scan as far as text[:limit] goes (text: the same stream's, grown or not)."""
        scan = self.scan
        stop = len(text) if limit is None else limit
        index = self.index
        while index < stop and scan.end is None:
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 1:
                        self.key = _closed_outer_string(text[self.string_start:index + 1], self.expecting_key,
                                                        self.key, scan)
                        self.expecting_key = False
            elif char == '"':
                self.in_string, self.string_start = True, index
            elif char in "{[":
                self.depth += 1
                if self.depth == 1:
                    self.expecting_key = True
                elif self.depth == 2 and char == "{" and self.key in ARGUMENT_KEYS and scan.arguments_start is None:
                    scan.arguments_start = index
            elif char in "}]":
                if self.depth == 2 and char == "}" and scan.arguments_start is not None and scan.arguments_end is None:
                    scan.arguments_end = index + 1
                self.depth -= 1
                if self.depth == 0:
                    scan.end = index + 1
            elif char == "," and self.depth == 1:
                self.expecting_key, self.key = True, None
            index += 1
        self.index = index
        return scan


def scan_call_object(text: str, start: int, state: dict | None = None, limit: int | None = None) -> CallScan:
    """Scans the JSON object that opens at text[start] ("{"), as far as text[:limit] goes;
    state (a stream's, see ToolParser.partial): its scan resumes where the last one stopped."""
    assert text[start] == "{"
    if state is None:
        return CallScanner(start).advance(text, limit)
    scanner = state.get(("scan", start))
    if scanner is None:
        scanner = state[("scan", start)] = CallScanner(start)
    return scanner.advance(text, limit)


def _closed_outer_string(literal: str, is_key: bool, key: str | None, scan: CallScan) -> str | None:
    """A string of the call object itself closed: a key (returned as the key now being
    read) or a value (the name, when the key was "name")."""
    try:
        value = json.loads(literal)
    except ValueError:
        return key
    if is_key:
        return value
    if key == "name" and scan.name is None:
        scan.name = value
    return key


def call_arguments(body: str, start: int, decoded: dict) -> str:
    """The arguments text of a whole, parsed call object (decoded) that opens at
    body[start]: the model's own text of the object, or, when the arguments are not an
    object (a JSON-encoded string, or missing), that string or "{}"."""
    scan = scan_call_object(body, start)
    if scan.arguments_start is not None and scan.arguments_end is not None:
        return body[scan.arguments_start:scan.arguments_end]
    for key in ARGUMENT_KEYS:
        if key in decoded:
            value = decoded[key]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return "{}"
