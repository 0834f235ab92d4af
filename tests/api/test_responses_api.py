"""The Responses API (POST /v1/responses) through the real openai client on the shared
server (a tiny random Llama): text and message-list input, instructions,
max_output_tokens, streaming events, previous_response_id, text.format json_schema,
function tools, and 400/404s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.conftest import API_KEY, MODEL_NAME

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120.0) as client:
        yield client


def test_text_input_gives_a_message_with_usage(client):
    response = client.responses.create(model=MODEL_NAME, input="Say something.", max_output_tokens=8,
                                       temperature=0.0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output_text == response.output[0].content[0].text
    assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.usage.output_tokens == 8:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_lists_reach_the_prompt(client):
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, temperature=0.0)
    richer = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", max_output_tokens=2, temperature=0.0,
        input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]}])
    assert richer.usage.input_tokens > plain.usage.input_tokens + 5
    assert richer.instructions == "Be brief."


def test_streamed_events_build_the_same_text(client):
    kwargs = dict(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=16, temperature=0.0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert "response.output_text.done" in kinds and "response.output_item.done" in kinds


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=4,
                                    temperature=0.0)
    second = client.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=4,
                                     temperature=0.0, previous_response_id=first.id)
    alone = client.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=4,
                                    temperature=0.0)
    # the second prompt holds the first exchange: its input and its output
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.input_tokens - 3
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_text_format_json_schema_validates(client):
    response = client.responses.create(
        model=MODEL_NAME, input="Answer as JSON.", max_output_tokens=400, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_tool_returns_valid_arguments(client, stream):
    kwargs = dict(model=MODEL_NAME, input="Weather?", tools=[WEATHER], max_output_tokens=400, temperature=1.0,
                  tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert fragments == response.output[0].arguments
    else:
        response = client.responses.create(**kwargs)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_required_tool_choice_and_a_function_result_round_trip(client):
    first = client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=400)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=4, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "-3 C, snow"}])
    assert answer.output[0].type == "message"


@pytest.mark.parametrize("kwargs, status, param", [
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objecct"}}}}, 400, "text"),
    ({"extra_body": {"reasoning": {"effort": "high"}}}, 400, "reasoning"),
    ({"extra_body": {"background": True}}, 400, "background"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
])
def test_bad_requests_name_the_field(client, kwargs, status, param):
    kwargs = {"input": "Hi", **kwargs}
    with pytest.raises(openai.APIStatusError) as raised:
        client.responses.create(model=MODEL_NAME, max_output_tokens=4, **kwargs)
    assert raised.value.status_code == status and raised.value.body["param"] == param
    assert client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2).output
