"""Tool calling and reasoning through a real server and the official openai client, on a
tiny random Llama whose tokenizer has <tool_call>, <think> and their closing tags as
tokens and a Qwen2-style chat template that renders tools.

A random model never writes a call by itself: tool_choice "required" and a named
function are constrained by the server; "auto" is shown a call by constraining the
output's text to one (structured_outputs regex), which the hermes parser then reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL_NAME, REPO_ROOT, ServerProcess
from tests.api.test_errors import assert_openai_error

TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}{{ '<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # ids 384 to 387
THINK_END_ID = 387
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "metric"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(model=MODEL_NAME, temperature=0.0, max_tokens=120)


@pytest.fixture(scope="module")
def tool_model_dir(make_tiny_model, tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    source = make_tiny_model("llama", vocab_size=388, max_position_embeddings=2048)
    target = str(tmp_path_factory.mktemp("tool_model"))
    shutil.copytree(source, target, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(MARKERS)  # plain added tokens, as Qwen's: decoded even when skipping special tokens
    assert tokenizer.convert_tokens_to_ids(MARKERS) == [384, 385, 386, 387]
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


def start(model_dir: str, folder, *flags: str):
    server = ServerProcess(model_dir, folder / "server.log", "--max-model-len", "2048", *flags)
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def tool_server(tool_model_dir, tmp_path_factory):
    server, client = start(tool_model_dir, tmp_path_factory.mktemp("tools"), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes")
    try:
        yield server, client
    finally:
        client.close()
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(tool_server):
    return tool_server[1]


@pytest.fixture(scope="module")
def http(tool_server):
    with httpx.Client(base_url=tool_server[0].url, timeout=120.0) as client:
        yield client


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str | None]:
    """The calls a stream's deltas reassemble into, and its finish_reason."""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[index]) for index in sorted(calls)], finish_reason


@pytest.mark.parametrize("seed", range(3))
def test_named_function_always_gets_valid_arguments(client, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=seed, **{**GREEDY, "temperature": 1.0})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    assert_valid_calls(message.tool_calls)
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's, for a named function
    calls, finish_reason = streamed_calls(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish_reason == "stop"


@pytest.mark.parametrize("seed", range(3))
def test_required_always_calls_a_tool_with_valid_arguments(client, seed):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
                  **{**GREEDY, "temperature": 1.0})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert len(message.tool_calls) == 1 and message.content is None
    assert_valid_calls(message.tool_calls)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls, finish_reason = streamed_calls(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish_reason == "tool_calls"


def test_a_required_call_cut_off_by_max_tokens_is_never_returned_half_written(client):
    """Cut at every length from the name's end to past the call's: each returned call is whole
    JSON (a cut one, its arguments an unterminated string, used to be returned); a cut-off
    output with no whole call comes back as content, finish_reason "length"."""
    cut_inside_arguments = 0
    for max_tokens in range(8, 80, 6):
        choice = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                **{**GREEDY, "max_tokens": max_tokens}).choices[0]
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice.finish_reason == "length" and not choice.message.tool_calls:
            assert choice.message.content.startswith("[")
            cut_inside_arguments += '"parameters"' in choice.message.content
    assert cut_inside_arguments  # the cut fell inside a call's arguments at least once


HERMES_CALL = (r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Oslo)", "metric": true\}\}\n</tool_call>')


def test_auto_reads_a_hermes_call_and_answers_its_result(client, http):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, extra_body={"structured_outputs": {"regex": HERMES_CALL}}, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.content == "Checking."
    assert_valid_calls(message.tool_calls)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls, finish_reason = streamed_calls(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish_reason == "tool_calls"
    # the call and its result go back in the history, and the model answers
    history = MESSAGES + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C, sunny"}]
    answer = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", max_tokens=5,
                                            model=MODEL_NAME, extra_body={"return_token_ids": True})
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tools_and_calls_in_history_render_as_hugging_face_renders_them(tool_model_dir, http):
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "metric": false}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    body = {"messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2, "return_token_ids": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    # the template gets the arguments as an object, as vLLM hands them over
    hf_call = {**call, "function": {**call["function"], "arguments": {"city": "Oslo", "metric": False}}}
    hf_history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [hf_call]}, history[2]]
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    text = tokenizer.apply_chat_template(hf_history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Oslo", "metric": false}' in text and '"name": "get_time"' in text
    assert response.json()["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_exclude_tools_flag_leaves_tools_out_only_for_tool_choice_none(http):
    # this server renders tools even with tool_choice "none" (vLLM's default)
    with_tools = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
                                                         "max_tokens": 1, "return_token_ids": True}).json()
    without = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                      "return_token_ids": True}).json()
    assert len(with_tools["prompt_token_ids"]) > len(without["prompt_token_ids"])


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "use_beam_search": True}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(http, fields, param):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **fields}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert http.get("/health").status_code == 200


def test_auto_needs_the_server_flags(tool_model_dir, tmp_path):
    server, client = start(tool_model_dir, tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
            assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="tools")
            assert_openai_error(http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"}), 400,
                                param="tool_choice")
            # required and named choices need no parser
            named = {"type": "function", "function": {"name": "get_time"}}
            response = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=named, **GREEDY)
            assert_valid_calls(response.choices[0].message.tool_calls)
    finally:
        client.close()
        assert server.stop() == 0, server.log()


def test_reasoning_is_split_from_content_whole_and_streamed(tool_model_dir, tmp_path):
    server, client = start(tool_model_dir, tmp_path, "--reasoning-parser", "deepseek_r1")
    # </think> first (a bias), then content the constraint shapes (it holds from </think> on)
    extra = {"logit_bias": {str(THINK_END_ID): 100}, "structured_outputs": {"regex": "ok[a-z]{2,6}"}}
    try:
        kwargs = dict(messages=MESSAGES, extra_body=extra, **GREEDY)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content == "" and message.content.startswith("ok")
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == ("", message.content)
        # free text never closes its reasoning: all of it is reasoning, streamed alike
        free = dict(messages=MESSAGES, model=MODEL_NAME, temperature=0.0, max_tokens=12,
                    extra_body={"ignore_eos": True})
        message = client.chat.completions.create(**free).choices[0].message
        streamed = "".join(getattr(choice.delta, "reasoning_content", None) or ""
                           for chunk in client.chat.completions.create(stream=True, **free)
                           for choice in chunk.choices)
        assert message.content is None and message.reasoning_content and streamed == message.reasoning_content
    finally:
        client.close()
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "hermes, llama3_json, pythonic"),
])
def test_tool_flags_are_checked_at_start_up(tool_model_dir, flags, message):
    result = subprocess.run([sys.executable, "-m", "actors.launch", "--model", tool_model_dir, *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 2 and message in result.stderr, result.stderr
