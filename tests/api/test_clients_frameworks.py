"""LangChain's ChatOpenAI (langchain-openai) and LiteLLM (`openai/` and `hosted_vllm/`
providers) as clients of the shared server: invoke, stream, batch.

Neither package is small enough for the test extra (langchain-openai brings about 10 MB of
wheels in 20 packages, langsmith and zstandard among them; litellm alone is a 41 MB wheel
and brings boto3), so these tests send the requests those packages send — captured from
langchain-openai 1.7.3 and litellm 1.106.2 run against this server — byte for byte where
it matters (litellm's hosted_vllm provider writes its JSON with json.dumps' spaces), and
read the answers the way they do."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, MODEL_NAME

MESSAGES = [{"content": "You are terse.", "role": "system"}, {"content": "Hello world!", "role": "user"}]
LITELLM_MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
JSON_HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def sse_chunks(lines) -> list[dict]:
    """The JSON chunks of an SSE stream, as both packages' stream readers take them."""
    chunks = []
    for line in lines:
        data = line.removeprefix("data:").strip()
        if data and data != "[DONE]":
            chunks.append(json.loads(data))
    return chunks


def post_stream(http: httpx.Client, path: str, **request) -> list[dict]:
    with http.stream("POST", path, **request) as response:
        assert response.status_code == 200, response.read()
        return sse_chunks(response.iter_lines())


# ---- LangChain ChatOpenAI(model=..., base_url=..., api_key=..., temperature=0, max_tokens=8) ----

def chat_openai_body(stream: bool, messages: list[dict] = MESSAGES) -> dict:
    # its defaults with a base_url: max_tokens goes out as max_completion_tokens, and no
    # stream_options unless stream_usage=True
    return {"model": MODEL_NAME, "stream": stream, "messages": messages, "max_completion_tokens": 8,
            "temperature": 0.0}


def langchain_message(response: dict) -> dict:
    """What ChatOpenAI makes of a whole response: the AIMessage's content, its
    response_metadata and usage_metadata."""
    assert not response.get("error")
    choice = response["choices"][0]
    usage = response.get("usage") or {}
    return {"content": choice["message"].get("content") or "", "role": choice["message"]["role"],
            "finish_reason": choice.get("finish_reason"), "model_name": response.get("model"),
            "usage": (usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens"))}


def langchain_stream(chunks: list[dict]) -> dict:
    """What ChatOpenAI's stream adds up to: content deltas, the finish reason, and usage only
    from a chunk with no choices."""
    content, finish_reason, usage = "", None, None
    for chunk in chunks:
        if not chunk.get("choices"):
            usage = chunk.get("usage")
            continue
        choice = chunk["choices"][0]
        if choice["delta"] is None:
            continue
        content += choice["delta"].get("content") or ""
        finish_reason = choice.get("finish_reason") or finish_reason
    return {"content": content, "finish_reason": finish_reason, "usage": usage}


def test_langchain_invoke_and_stream_agree(http):
    invoked = langchain_message(http.post("/v1/chat/completions", json=chat_openai_body(False)).json())
    # (no ignore_eos from LangChain: the tiny model may end its turn before 8 tokens)
    assert invoked["role"] == "assistant" and invoked["finish_reason"] in ("length", "stop")
    assert invoked["model_name"] == MODEL_NAME and 0 < invoked["usage"][1] <= 8
    assert invoked["usage"][0] + invoked["usage"][1] == invoked["usage"][2]
    streamed = langchain_stream(post_stream(http, "/v1/chat/completions", json=chat_openai_body(True)))
    assert streamed == {"content": invoked["content"], "finish_reason": invoked["finish_reason"], "usage": None}


async def test_langchain_batch_runs_the_invocations_concurrently(server, http):
    conversations = [MESSAGES, [{"content": "The quick brown fox", "role": "user"}]]
    alone = [langchain_message(http.post("/v1/chat/completions", json=chat_openai_body(False, m)).json())
             for m in conversations]
    async with httpx.AsyncClient(base_url=server.url, headers=JSON_HEADERS, timeout=60.0) as client:
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat_openai_body(False, m))
                                           for m in conversations))
    assert [langchain_message(response.json()) for response in responses] == alone


def test_langchain_stream_usage_with_logprobs_and_penalties(http):
    # ChatOpenAI(max_completion_tokens=8, streaming=True, stream_usage=True, top_p=0.9,
    #            frequency_penalty=0.1, presence_penalty=0.1, logprobs=True, top_logprobs=2)
    body = {"model": MODEL_NAME, "stream": True, "messages": [{"content": "Hi", "role": "user"}],
            "frequency_penalty": 0.1, "logprobs": True, "max_completion_tokens": 8, "presence_penalty": 0.1,
            "stream_options": {"include_usage": True}, "top_logprobs": 2, "top_p": 0.9}
    chunks = post_stream(http, "/v1/chat/completions", json=body)
    streamed = langchain_stream(chunks)
    assert streamed["usage"]["prompt_tokens"] > 0 and streamed["finish_reason"] in ("length", "stop")
    # response_metadata["logprobs"]["content"]: one entry per token, each with its top 2
    entries = [entry for chunk in chunks if chunk["choices"] and chunk["choices"][0].get("logprobs")
               for entry in chunk["choices"][0]["logprobs"]["content"]]
    assert len(entries) == streamed["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and isinstance(entry["bytes"], list) for entry in entries)


def test_langchain_n_2_with_stop_and_seed(http):
    # ChatOpenAI(max_tokens=8, n=2, stop=["\n"], seed=3).generate(...): no temperature sent
    body = {"model": MODEL_NAME, "stream": False, "messages": [{"content": "Hi", "role": "user"}],
            "max_completion_tokens": 8, "n": 2, "seed": 3, "stop": ["\n"]}
    response = http.post("/v1/chat/completions", json=body).json()
    assert sorted(choice["index"] for choice in response["choices"]) == [0, 1]
    assert all("\n" not in choice["message"]["content"] for choice in response["choices"])
    assert response["usage"]["completion_tokens"] <= 16
    assert http.post("/v1/chat/completions", json=body).json()["choices"] == response["choices"]  # seeded


# ---- LiteLLM: litellm.completion(model="openai/<name>" | "hosted_vllm/<name>", api_base=..., api_key=...) ----

@pytest.fixture(scope="module")
def openai_client(server):
    # the openai/ provider calls the openai package's client with litellm's own kwargs
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


def test_litellm_openai_provider_completion_stream_and_text(openai_client):
    whole = openai_client.chat.completions.create(messages=LITELLM_MESSAGES, model=MODEL_NAME, max_tokens=8,
                                                  temperature=0)
    chunks = list(openai_client.chat.completions.create(messages=LITELLM_MESSAGES, model=MODEL_NAME, max_tokens=8,
                                                        stream=True, stream_options={"include_usage": True},
                                                        temperature=0))
    # litellm's stream wrapper and stream_chunk_builder: content deltas joined, usage from the last chunk
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage and whole.choices[0].finish_reason in ("length", "stop")
    text = openai_client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8,
                                            temperature=0)  # litellm.text_completion
    assert text.usage.completion_tokens <= 8 and text.choices[0].finish_reason in ("length", "stop")


def hosted_vllm_body(messages: list[dict], **stream) -> str:
    # litellm's hosted_vllm provider: its own HTTP handler, json.dumps (with spaces), this key order
    return json.dumps({"model": MODEL_NAME, "messages": messages, "temperature": 0, **stream, "max_tokens": 8})


def test_litellm_hosted_vllm_completion_and_stream(http):
    whole = http.post("/v1/chat/completions", content=hosted_vllm_body(LITELLM_MESSAGES), headers=JSON_HEADERS)
    assert whole.status_code == 200
    message = whole.json()["choices"][0]["message"]
    for stream in ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}):
        chunks = post_stream(http, "/v1/chat/completions", content=hosted_vllm_body(LITELLM_MESSAGES, **stream),
                             headers=JSON_HEADERS)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
            message["content"]
        assert (chunks[-1].get("usage") == whole.json()["usage"]) == ("stream_options" in stream)


async def test_litellm_hosted_vllm_batch_completion(server, http):
    # litellm.batch_completion: one request per conversation, run concurrently
    conversations = [LITELLM_MESSAGES, [{"role": "user", "content": "The quick brown fox"}]]
    alone = [http.post("/v1/chat/completions", content=hosted_vllm_body(m), headers=JSON_HEADERS).json()
             for m in conversations]
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", content=hosted_vllm_body(m),
                                                       headers=JSON_HEADERS) for m in conversations))
    assert [r.json()["choices"] for r in responses] == [a["choices"] for a in alone]
