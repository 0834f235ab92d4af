"""POST /v1/completions through the official openai package (sync client) and raw HTTP,
against the shared server. Greedy outputs are checked against the in-process engine
(LLM) on the same model."""

from __future__ import annotations

import openai
import pytest

from actors import LLM, SamplingParams
from tests.api.conftest import API_KEY, MODEL_NAME, sse_events

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def llm(long_context_llama_dir) -> LLM:
    return LLM(long_context_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=512, seed=0)


def test_greedy_completion_matches_the_engine(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert [choice.text for choice in result.choices] == [out.outputs[0].text for out in expected]
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in result.choices)
    num_prompt_tokens = sum(len(out.prompt_token_ids) for out in expected)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (num_prompt_tokens, 36)
    assert result.usage.total_tokens == num_prompt_tokens + 36
    assert result.model == MODEL_NAME and result.object == "text_completion"


def test_streamed_completion_concatenates_to_the_whole_one(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0.0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # include_usage: every chunk says usage null, a last one with no choices carries it
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_default_max_tokens_is_16_and_n_2_numbers_choices_per_prompt(client):
    result = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], n=2, temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 4 * 16


def test_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(free[i:i + 2] for i in range(8, len(free) - 2) if free[i:i + 2] not in free[:i])
    for stream in (False, True):
        result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0.0,
                                           stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in result] if stream else result.choices
        assert "".join(c.text for c in choices) == free[:free.index(stop)]
        assert choices[-1].finish_reason == "stop"


def test_logprobs_and_echo(client):
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0.0,
                                       logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text.startswith(PROMPTS[2])
    logprobs = choice.logprobs
    num_tokens = result.usage.prompt_tokens + 5
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == num_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # the first prompt token
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(num_tokens)]
    for token, logprob, top in zip(logprobs.tokens[-5:], logprobs.token_logprobs[-5:], logprobs.top_logprobs[-5:]):
        assert top[token] == logprob <= 0.0  # greedy: the sampled token is the most likely
        assert logprob == max(top.values()) and 1 <= len(top) <= 3


def test_raw_stream_is_well_formed_sse(http):
    response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "stream": True,
                                                  "ignore_eos": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert all(event["object"] == "text_completion" and "usage" not in event for event in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_logit_bias_forces_a_token(client, llm):
    token = llm.tokenizer.encode(" fox", add_special_tokens=False)[0]
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0.0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert result.choices[0].text == llm.tokenizer.decode([token] * 4)
