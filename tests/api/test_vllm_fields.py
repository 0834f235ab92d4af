"""vLLM's request fields on /v1/completions and /v1/chat/completions, each against the
real server: prompt_logprobs, return_token_ids, return_tokens_as_token_ids,
allowed_token_ids, bad_words, truncate_prompt_tokens, request ids, continuous usage."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, AUTH, sse_events

PROMPT = [5, 9, 14, 22, 31, 40, 52, 61]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Hello world! How are you?"}]


def tokenize(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_prompt_logprobs_score_each_prompt_token_as_echo_does(http):
    body = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY, "prompt_logprobs": 2}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(PROMPT) and scored[0] is None
    echoed = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY, "max_tokens": 1, "echo": True,
                                                 "logprobs": 0}).json()["choices"][0]["logprobs"]
    for position, entry in enumerate(scored[1:], start=1):
        chosen = entry[str(PROMPT[position])]
        assert chosen["logprob"] == pytest.approx(echoed["token_logprobs"][position], abs=1e-5)
        assert chosen["rank"] >= 1 and isinstance(chosen["decoded_token"], str)
        assert len(entry) <= 3  # the prompt token and the top 2
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_return_token_ids_whole_and_streamed(http):
    body = {"prompt": PROMPT, **GREEDY, "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == GREEDY["max_tokens"]
    chunks = [event["choices"][0] for event in sse_events(http.post("/v1/completions",
                                                                    json={**body, "stream": True}).text)]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert [t for chunk in chunks for t in chunk["token_ids"]] == choice["token_ids"]
    assert "".join(chunk["text"] for chunk in chunks) == choice["text"]

    chat_body = {"messages": CHAT, **GREEDY, "return_token_ids": True}
    chat = http.post("/v1/chat/completions", json=chat_body).json()
    rendered = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat["prompt_token_ids"] == rendered and len(chat["choices"][0]["token_ids"]) == GREEDY["max_tokens"]
    events = sse_events(http.post("/v1/chat/completions", json={**chat_body, "stream": True}).text)
    assert events[0]["prompt_token_ids"] == rendered
    assert [t for event in events for t in event["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids_in_both_logprob_shapes(http):
    body = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY, "logprobs": 1, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert body["logprobs"]["tokens"] == [f"token_id:{t}" for t in body["token_ids"]]
    assert all(key.startswith("token_id:") for top in body["logprobs"]["top_logprobs"] for key in top)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 2,
                                                   "return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = chat.json()["choices"][0]
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_allowed_token_ids_confine_sampling(http):
    allowed = [7, 11, 13]
    for route, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        body = {**base, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                "allowed_token_ids": allowed, "return_token_ids": True}
        token_ids = http.post(route, json=body).json()["choices"][0]["token_ids"]
        assert len(token_ids) == 12 and set(token_ids) <= set(allowed)


def test_bad_words_are_never_generated(http):
    dog, the = tokenize(http, " dog"), tokenize(http, " the")
    assert len(dog) == 1 and len(the) == 1, "the tiny tokenizer has whole-word tokens for these"
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "allowed_token_ids": dog + the, "return_token_ids": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert dog[0] in free, "without bad_words the sampler should pick ' dog' sometimes"
    banned = http.post("/v1/completions", json={**body, "bad_words": ["dog"]}).json()["choices"][0]["token_ids"]
    assert banned == the * 8


def test_truncate_prompt_tokens_keeps_the_last_ones(http):
    body = {"prompt": PROMPT, **GREEDY, "truncate_prompt_tokens": 3, "return_token_ids": True}
    truncated = http.post("/v1/completions", json=body).json()
    assert truncated["usage"]["prompt_tokens"] == 3 and truncated["choices"][0]["prompt_token_ids"] == PROMPT[-3:]
    short = http.post("/v1/completions", json={"prompt": PROMPT[-3:], **GREEDY}).json()
    assert truncated["choices"][0]["text"] == short["choices"][0]["text"]


def test_request_id_from_the_body_or_the_header(http):
    body = {"prompt": PROMPT, **GREEDY, "request_id": "my-request"}
    assert http.post("/v1/completions", json=body).json()["id"] == "cmpl-my-request"
    headers = {"X-Request-Id": "from-header"}
    assert http.post("/v1/completions", json=body, headers=headers).json()["id"] == "cmpl-from-header"
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY, "request_id": "c1"}).json()
    assert chat["id"] == "chatcmpl-c1"


async def test_two_requests_may_share_a_request_id(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    try:
        replies = await asyncio.gather(*[client.completions.create(
            model="", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"request_id": "same"})
            for _ in range(2)])
    finally:
        await client.close()
    assert [reply.id for reply in replies] == ["cmpl-same", "cmpl-same"]
    assert replies[0].choices[0].text == replies[1].choices[0].text


def test_continuous_usage_stats_put_usage_on_every_chunk(http):
    body = {"prompt": PROMPT, **GREEDY, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(http.post("/v1/completions", json=body).text)
    *chunks, last = events
    by_choice: dict[int, list[int]] = {}
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == len(PROMPT)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        by_choice.setdefault(chunk["choices"][0]["index"], []).append(usage["completion_tokens"])
    for counts in by_choice.values():
        assert counts == sorted(counts) and counts[-1] == GREEDY["max_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * GREEDY["max_tokens"]
    chat_events = sse_events(http.post("/v1/chat/completions", json={
        "messages": CHAT, **GREEDY, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text)
    assert all(event["usage"] is not None for event in chat_events)


def test_the_openai_client_reaches_the_extensions_through_extra_body(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0.0,
                                      extra_body={"return_token_ids": True, "prompt_logprobs": 0})
    choice = reply.choices[0].model_dump()
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 4
    assert len(choice["prompt_logprobs"]) == len(PROMPT)


def test_best_of_equal_to_n_and_user_are_accepted(http):
    body = {"prompt": PROMPT, **GREEDY, "n": 2, "best_of": 2, "user": "someone"}
    assert len(http.post("/v1/completions", json=body, headers=AUTH).json()["choices"]) == 2


def test_whole_responses_carry_vllms_always_sent_fields_as_null(server, http):
    """vLLM sends these in every whole response, null when unused; the openai package then
    reads choice.prompt_logprobs (an AttributeError without the key), and vLLM's own tests
    look for the keys. Streamed chunks stay lean."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    completion = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
    choice = completion.choices[0]
    assert (choice.prompt_logprobs, choice.prompt_token_ids, choice.token_ids) == (None, None, None)
    assert completion.system_fingerprint is None and completion.service_tier is None
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2)
    assert (chat.prompt_logprobs, chat.prompt_token_ids, chat.choices[0].token_ids) == (None, None, None)
    assert chat.system_fingerprint is None and chat.service_tier is None
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        whole = http.post(route, json={**body, **GREEDY}).json()
        assert {"system_fingerprint", "service_tier", "kv_transfer_params"} <= whole.keys()
        assert whole["system_fingerprint"] is None
        events = sse_events(http.post(route, json={**body, **GREEDY, "stream": True}).text)
        assert all("system_fingerprint" not in event and "token_ids" not in event["choices"][0] for event in events)
