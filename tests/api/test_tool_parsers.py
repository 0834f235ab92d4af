"""Tool parsers on canned outputs: the whole answer (calls, the content around them,
malformed calls left as content), and the same outputs streamed in pieces cut at random
token boundaries of SmolLM2's tokenizer, whose deltas must concatenate to the whole
answer. Also the constrained outputs of tool_choice "required" and a named function."""

from __future__ import annotations

import json
import random

import pytest

from api.tool_calls import ConstrainedCallParser
from api.tool_parsers import get_tool_parser

WEATHER = {"city": "Paris", "days": [1, {"unit": "°C \"}"}], "ok": True}
HERMES_TWO = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
              + json.dumps(WEATHER, ensure_ascii=False) + '}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')

# (parser, output, expected content, expected [(name, arguments as an object)])
CASES = [
    ("hermes", HERMES_TWO, "Let me check.", [("get_weather", WEATHER), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),
    ("hermes", "No call here, only <tool text.", "No call here, only <tool text.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": </tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"x": </tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", {"x": 2})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {"y": [2]}}',
     None, [("f", {"x": 1}), ("g", {"y": [2]})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1', '{"name": "f", "parameters": {"x": 1', []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(zone=\'CET\', exact=True, extra=None)]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET", "exact": True, "extra": None})]),
    ("pythonic", '[f(items=[1, 2], spec={"a": "b)"})]', None, [("f", {"items": [1, 2], "spec": {"a": "b)"}})]),
    ("pythonic", "Sure, here it is.", "Sure, here it is.", []),
    ("pythonic", "[f(x=open('file'))]", "[f(x=open('file'))]", []),
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def token_pieces(tokenizer, text: str, seed: int) -> list[str]:
    """text cut at random token boundaries: runs of one to three tokens."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [end for _, end in encoding["offset_mapping"]]
    rng = random.Random(seed)
    cuts, index = [], 0
    while index < len(offsets) - 1:
        index += rng.randint(1, 3)
        cuts.append(offsets[min(index, len(offsets) - 1)])
    cuts = sorted({cut for cut in cuts if 0 < cut < len(text)}) + [len(text)]
    starts = [0] + cuts[:-1]
    return [text[start:end] for start, end in zip(starts, cuts)]


def stream(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Feeds pieces through a streamer: the content, the reassembled calls, every delta."""
    streamer = parser.streamer()
    content, calls, deltas = "", {}, []
    for output in [streamer.feed(piece) for piece in pieces] + [streamer.finish()]:
        text, call_deltas = output
        content += text
        for delta in call_deltas:
            deltas.append(delta)
            if delta.index not in calls:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
    return content, [tuple(calls[index]) for index in sorted(calls)], deltas


@pytest.mark.parametrize("name, output, content, expected", CASES)
def test_whole_output_gives_the_calls_and_the_content(name, output, content, expected):
    extracted = get_tool_parser(name)().extract_tool_calls(output)
    assert extracted.content == content
    assert [(call.function.name, json.loads(call.function.arguments)) for call in extracted.tool_calls] == expected
    ids = [call.id for call in extracted.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)
    assert all(call.type == "function" for call in extracted.tool_calls)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name, output, content, expected", CASES)
def test_streamed_deltas_reassemble_the_whole_answer(smollm2_tokenizer, name, output, content, expected, seed):
    parser = get_tool_parser(name)()
    whole = parser.extract_tool_calls(output)
    streamed_content, calls, deltas = stream(parser, token_pieces(smollm2_tokenizer, output, seed))
    if whole.tool_calls or not deltas:
        assert streamed_content == (whole.content or "")
        assert calls == [(call.function.name, call.function.arguments) for call in whole.tool_calls]
    else:
        # a call found malformed only at its end was already streamed (as in vLLM): what
        # was sent as content is still the start of the whole answer's content
        assert whole.content.startswith(streamed_content)
    # OpenAI's shape: a call's first delta has its id, type and name; later ones only arguments
    seen = set()
    for delta in deltas:
        if delta.index in seen:
            assert delta.id is msgspec_unset() and delta.function.name is msgspec_unset()
        else:
            assert delta.id and delta.type == "function" and delta.function.name
            seen.add(delta.index)


def test_arguments_stream_in_fragments_while_the_call_is_generated(smollm2_tokenizer):
    pieces = token_pieces(smollm2_tokenizer, HERMES_TWO, seed=0)
    _, _, deltas = stream(get_tool_parser("hermes")(), pieces)
    fragments = [d for d in deltas if d.index == 0 and d.function.arguments]
    assert len(fragments) > 3  # sent as it arrives, not once at the end


def test_content_before_a_hermes_call_holds_back_a_partial_tag():
    streamer = get_tool_parser("hermes")().streamer()
    assert streamer.feed("Hello <tool_") == ("Hello ", [])
    assert streamer.feed("call>") == ("", [])
    content, deltas = streamer.feed('{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "" and deltas[0].function.name == "f"


def test_parallel_tool_calls_false_streams_only_the_first_call():
    streamer = get_tool_parser("hermes")().streamer(max_calls=1)
    _, deltas = streamer.feed(HERMES_TWO)
    assert {delta.index for delta in deltas} == {0}


@pytest.mark.parametrize("tool_choice, output, expected", [
    ("required", '[{"name":"f","parameters":{"x":1}},{"name":"g","parameters":{}}]', [("f", {"x": 1}), ("g", {})]),
    ({"type": "function", "function": {"name": "f"}}, '{"x":[1,2],"y":"}"}', [("f", {"x": [1, 2], "y": "}"})]),
])
def test_constrained_outputs_stream_like_the_whole(smollm2_tokenizer, tool_choice, output, expected):
    parser = ConstrainedCallParser(tool_choice)
    whole = parser.extract_tool_calls(output)
    assert whole.content is None
    assert [(call.function.name, json.loads(call.function.arguments)) for call in whole.tool_calls] == expected
    for seed in range(4):
        content, calls, _ = stream(parser, token_pieces(smollm2_tokenizer, output, seed))
        assert content == "" and calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_unknown_parser_name_is_an_error():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def msgspec_unset():
    from msgspec import UNSET

    return UNSET


def test_required_schema_takes_one_call_per_tool_and_one_call_without_parallel_calls():
    import jsonschema

    from api.tool_calls import tool_choice_constraint

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "g"}}]  # no parameters: an empty object
    parallel = tool_choice_constraint(tools, "required", None).json
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}], parallel)
    for bad in ([], [{"name": "f", "parameters": {}}], [{"name": "h", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, parallel)
    single = tool_choice_constraint(tools, "required", False).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}] * 2, single)
    named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "f"}}, None)
    # JSON's whitespace in bounded runs, as vLLM's any-whitespace (a compact grammar left a small
    # model no way out of an array but another call)
    assert named.json == tools[0]["function"]["parameters"] and not named.disable_any_whitespace
    assert not tool_choice_constraint(tools, "required", None).disable_any_whitespace
    assert tool_choice_constraint(tools, "auto", None) is None and tool_choice_constraint(tools, "none", None) is None


# ---- long outputs: the stream reads each delta once ----

LONG_ARGUMENT = "w" * 200_000
LONG_OUTPUTS = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"text": "' + LONG_ARGUMENT + '"}}\n</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"text": "' + LONG_ARGUMENT + '"}}',
    "pythonic": "[" + ('f(text="' + LONG_ARGUMENT[:50_000] + '"), ') * 4 + "g(n=1)]",
    "required": '[{"name": "f", "parameters": {"text": "' + LONG_ARGUMENT + '"}}]',
}


@pytest.mark.parametrize("name", list(LONG_OUTPUTS))
def test_a_long_call_streamed_in_small_deltas_costs_its_length_not_its_square(name):
    """10,000 deltas of 20 characters: re-reading the output at every delta scanned 10^9
    characters in Python (minutes); reading only what each delta adds takes well under a second."""
    import time

    parser = ConstrainedCallParser("required") if name == "required" else get_tool_parser(name)()
    text = LONG_OUTPUTS[name]
    start = time.monotonic()
    content, calls, _ = stream(parser, [text[index:index + 20] for index in range(0, len(text), 20)])
    elapsed = time.monotonic() - start
    whole = parser.extract_tool_calls(text)
    assert calls == [(call.function.name, call.function.arguments) for call in whole.tool_calls] and calls
    assert elapsed < 10.0, f"{elapsed:.1f} s"


@pytest.mark.parametrize("output", ["[f(a=" + "-" * 100_000 + "1)]", "[f(a=" + "-" * 5_000 + "1)]",
                                    "[f(a=" + "not " * 5_000 + "1)]", "[f(a=" + "[" * 5_000 + "]" * 5_000 + ")]"])
def test_pythonic_output_nested_past_pythons_limits_is_content(output):
    """ast raises MemoryError or RecursionError on such text (once a 500): it is content."""
    parser = get_tool_parser("pythonic")()
    assert parser.extract_tool_calls(output).content == output
    content, calls, _ = stream(parser, [output[index:index + 1000] for index in range(0, len(output), 1000)])
    assert calls == [] and content == output


def test_a_constrained_call_that_max_tokens_cut_off_is_not_returned():
    """The whole message holds the calls the output finished; a cut one (unterminated JSON
    in its arguments) is left out, and with none finished the text is content."""
    required = ConstrainedCallParser("required")
    cut = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"text": "unfinis'
    assert [(call.function.name, call.function.arguments) for call in required.extract_tool_calls(cut).tool_calls] \
        == [("f", '{"x": 1}')]
    only_cut = '[{"name": "g", "parameters": {"text": "unfinis'
    assert required.extract_tool_calls(only_cut).tool_calls == [] and \
        required.extract_tool_calls(only_cut).content == only_cut
    named = ConstrainedCallParser({"type": "function", "function": {"name": "g"}})
    assert named.extract_tool_calls('{"text": "unfinis').tool_calls == []

