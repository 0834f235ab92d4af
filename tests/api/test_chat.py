"""POST /v1/chat/completions through the official openai package (async client), against
the shared server. Greedy outputs are checked against the in-process engine (LLM.chat)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from actors import LLM, SamplingParams
from tests.api.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]


@pytest_asyncio.fixture(scope="module")
async def client(server):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def expected(long_context_llama_dir):
    """What the engine itself answers to MESSAGES, greedily, 10 tokens."""
    llm = LLM(long_context_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=512, seed=0)
    return llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]


async def test_greedy_chat_matches_the_engine_streaming_and_not(client, expected):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_completion_tokens=10,
                  extra_body={"ignore_eos": True})
    whole, stream = await asyncio.gather(client.chat.completions.create(**kwargs),
                                         client.chat.completions.create(stream=True, **kwargs))
    chunks = [chunk async for chunk in stream]
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


async def test_n_2_streams_both_choices_and_usage_last(client):
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8, seed=7,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


async def test_default_max_tokens_is_the_context_left(client, http):
    # a conversation that leaves about 40 tokens of context, so the test is quick
    def num_tokens(repeats: int) -> int:
        messages = [{"role": "user", "content": "The quick brown fox. " * repeats}]
        return http.post("/tokenize", json={"messages": messages}).json()["count"]

    per_repeat = (num_tokens(200) - num_tokens(100)) / 100
    repeats = 100 + int((MAX_MODEL_LEN - 40 - num_tokens(100)) / per_repeat)
    assert MAX_MODEL_LEN - 100 < num_tokens(repeats) < MAX_MODEL_LEN - 5
    # ignore_eos: a tiny random model may end its turn early
    result = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "The quick brown fox. " * repeats}],
        extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == num_tokens(repeats)
    assert result.usage.total_tokens == MAX_MODEL_LEN


async def test_logprobs_list_the_sampled_token_and_the_top_ones(client):
    result = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                                  temperature=0.0, logprobs=True, top_logprobs=3,
                                                  extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [top.logprob for top in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                     reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token


async def test_stop_string_and_penalties_are_applied(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=0.0,
                  extra_body={"ignore_eos": True})
    free = (await client.chat.completions.create(**kwargs)).choices[0].message.content
    stop = next(free[i:i + 2] for i in range(6, len(free) - 2) if free[i:i + 2] not in free[:i])
    stopped = await client.chat.completions.create(stop=stop, **kwargs)
    assert stopped.choices[0].message.content == free[:free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    penalized = await client.chat.completions.create(presence_penalty=2.0, frequency_penalty=2.0, user="u1",
                                                     **kwargs)
    assert penalized.choices[0].message.content != free


async def test_text_response_format_and_tool_choice_none_are_accepted(client, expected):
    result = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_completion_tokens=10,
        response_format={"type": "text"}, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        extra_body={"ignore_eos": True})
    assert result.choices[0].message.content == expected.outputs[0].text
