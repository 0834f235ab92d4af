"""What every tool parser shares: the parsed result (ExtractedToolCalls), the ToolParser
base, and ToolCallStreamer, which turns a parser's view of a growing output into
OpenAI's streamed deltas.

A parser answers two questions about an output text: the whole answer
(extract_tool_calls, for a finished output) and what is already certain of a text that
is still growing (partial: the content so far, each call's name once known and its
arguments so far). The streamer sends only what is new since its last answer, and at the
end sends what the whole answer adds, so the deltas of a stream concatenate to the
non-streamed message.

A stream's partial() gets the stream's own state, where a parser keeps how far it has
read (its scans, the markers it searched for), so each delta costs what it adds, not the
whole output again."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from api.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


def new_tool_call_id() -> str:
    """A unique id for one call, vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments))


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text that is not a call; None when there is none
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class PartialCall:
    name: str | None  # None until the whole name is known
    arguments: str  # the arguments' text so far: a prefix of the final text


class ToolParser:
    """Parses tool calls out of a model's output. Constructed with the tokenizer (or None)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished output, and the content around them. Text that does not
        parse as calls is content."""
        raise NotImplementedError

    def partial(self, text: str, state: dict | None = None) -> tuple[str, list[PartialCall]]:
        """What is certain of an unfinished output: the content so far (held back where
        it may be the start of a call's markup) and the calls begun so far. state: the
        stream's, kept between its calls (text then only grows), or None for one text."""
        raise NotImplementedError

    def streamer(self, max_calls: int | None = None) -> ToolCallStreamer:
        return ToolCallStreamer(self, max_calls)


class ToolCallStreamer:
    """One choice's stream: fed each text delta, it returns the content delta and the
    tool-call deltas that are new. max_calls: 1 when parallel_tool_calls is false."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.state: dict = {}  # the parser's scans of this stream's text, resumed at each delta
        self.sent_content = ""
        self.sent_arguments: list[str] = []  # per call started: the arguments sent so far

    @property
    def num_calls(self) -> int:
        return len(self.sent_arguments)

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        content, calls = self.parser.partial(self.text, self.state)
        return self._new_parts(content, calls)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What the whole output adds to what was sent (held-back text, a call that only
        parses once complete)."""
        final = self.parser.extract_tool_calls(self.text)
        calls = [PartialCall(call.function.name, call.function.arguments) for call in final.tool_calls]
        return self._new_parts(final.content or "", calls)

    def _new_parts(self, content: str, calls: list[PartialCall]) -> tuple[str, list[DeltaToolCall]]:
        content_delta = ""
        # content only grows; a final answer that disagrees with what was sent adds nothing
        if content.startswith(self.sent_content):
            content_delta = content[len(self.sent_content):]
            self.sent_content = content
        deltas = []
        for index, call in enumerate(calls[:self.max_calls]):
            if call.name is None:
                break
            if index == len(self.sent_arguments):
                self.sent_arguments.append(call.arguments)
                deltas.append(DeltaToolCall(index=index, id=new_tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            sent = self.sent_arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.sent_arguments[index] = call.arguments
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=call.arguments[len(sent):])))
        return content_delta, deltas


def find(text: str, marker: str, start: int, state: dict | None) -> int:
    """text.find(marker, start), searching only what the text added since the stream's last
    search for the same marker from the same start (state: the stream's; None: one text)."""
    if state is None:
        return text.find(marker, start)
    found = state.get(("found", marker, start))
    if found is not None:
        return found
    index = text.find(marker, state.get(("searched", marker, start), start))
    if index >= 0:
        state[("found", marker, start)] = index
    else:  # next time from where the marker could still begin (it may straddle this end)
        state[("searched", marker, start)] = max(start, len(text) - len(marker) + 1)
    return index


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of text might be the start of marker (held back
    from content until the next delta says)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
