"""The official openai package, unchanged, against the shared server: what test_completions.py
(sync completions) and test_chat.py (async chat) leave out — the async client on
completions, the sync client on chat, raw and streaming-raw responses, n > 1 streams of
several prompts, and the models routes."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from tests.api.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME

PROMPTS = ["The quick brown fox", "Hello world!"]
MESSAGES = [{"role": "user", "content": "Hello world!"}]
# a tiny random model may end its turn at once: ignore_eos makes every length exact
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


@pytest_asyncio.fixture(scope="module")
async def async_client(server):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=60.0) as client:
        yield client


async def test_async_client_streams_the_completion_it_returns_whole(async_client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.0, extra_body=IGNORE_EOS)
    whole = await async_client.completions.create(**kwargs)
    stream = await async_client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 12


def test_sync_client_streams_chat_with_usage_last(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0.0,
                  extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_n_2_stream_of_two_prompts_matches_the_whole_response(client):
    # seeded sampling: the stream and the whole response draw the same tokens
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS, n=2, max_tokens=6, temperature=1.0, seed=7, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed: dict[int, str] = {}
    finish_reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish_reasons[choice.index] = choice.finish_reason
    # OpenAI's numbering: prompt index * n + completion index
    assert streamed == {choice.index: choice.text for choice in whole.choices}
    assert sorted(streamed) == [0, 1, 2, 3] and set(finish_reasons.values()) == {"length"} and len(finish_reasons) == 4
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 4 * 6


def test_raw_response_carries_status_headers_and_parses(client):
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3,
                                                       extra_body=IGNORE_EOS)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/json")
    completion = raw.parse()
    assert isinstance(completion, openai.types.Completion) and completion.usage.completion_tokens == 3
    raw_chat = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3,
                                                                 extra_body=IGNORE_EOS)
    assert raw_chat.parse().choices[0].message.role == "assistant"


def test_streaming_raw_response_is_server_sent_events(client):
    with client.chat.completions.with_streaming_response.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                                                stream=True, extra_body=IGNORE_EOS) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])


async def test_async_raw_response_of_a_chat_stream(async_client):
    raw = await async_client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, stream=True, extra_body=IGNORE_EOS)
    assert raw.status_code == 200
    chunks = [chunk async for chunk in raw.parse()]  # parse() of a stream is the AsyncStream itself
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_list_names_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model" and models.data[0].owned_by
    # vLLM's extra fields, which vllm bench serve reads (root) to find the tokenizer
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN and models.data[0].model_extra["root"]


async def test_async_models_list(async_client):
    assert [model.id async for model in async_client.models.list()] == [MODEL_NAME]


def test_bad_request_raises_the_typed_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN + 1)
    assert error.value.status_code == 400 and error.value.param == "max_tokens"


def test_arguments_passed_as_none_mean_the_defaults(client):
    # the openai package sends an explicit null for an argument passed as None, as wrappers
    # do with n=kwargs.get("n"); OpenAI's API reads null as "not set"
    kwargs = dict(model=MODEL_NAME, max_tokens=4, temperature=0.0, extra_body=IGNORE_EOS)
    nulls = dict(n=None, stream=None, logprobs=None, seed=None, stop=None, stream_options=None)
    plain = client.completions.create(prompt=PROMPTS[0], **kwargs)
    completion = client.completions.create(prompt=PROMPTS[0], echo=None, **nulls, **kwargs)
    assert [(c.index, c.text, c.logprobs) for c in completion.choices] == [(0, plain.choices[0].text, None)]
    plain_chat = client.chat.completions.create(messages=MESSAGES, **kwargs)
    chat = client.chat.completions.create(messages=MESSAGES, top_logprobs=None, **nulls, **kwargs)
    assert [(c.index, c.message.content, c.logprobs) for c in chat.choices] == \
        [(0, plain_chat.choices[0].message.content, None)]


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
