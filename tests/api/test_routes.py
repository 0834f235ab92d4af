"""vLLM's routes beyond the OpenAI API, against the shared server: /tokenize in vLLM's
shapes (checked against the tokenizer itself), SageMaker's /ping and /invocations, /load,
and CORS as vLLM's defaults set it."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import API_KEY, AUTH, MODEL_NAME, sse_events
from tests.api.test_errors import assert_openai_error

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tokenizer(long_context_llama_dir):
    """The oracle: the model's own tokenizer."""
    return AutoTokenizer.from_pretrained(long_context_llama_dir)


@pytest.fixture(scope="module")
def openai_client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


# ---- /tokenize and /detokenize ----

def test_tokenize_a_prompt_gives_the_tokenizers_ids_and_strings(http, tokenizer):
    text = "The quick brown fox 🦊 jumps"
    body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    expected = tokenizer.encode(text)
    assert body == {"count": len(expected), "max_model_len": 2048, "tokens": expected,
                    "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    # token strings only when asked for: null otherwise, as vLLM
    assert http.post("/tokenize", json={"prompt": text, "model": MODEL_NAME}).json()["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": expected}).json() == {"prompt": tokenizer.decode(expected)}


def test_tokenize_messages_gives_what_the_chat_template_renders(http, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    body = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    assert tokenizer.decode(body["tokens"]).endswith("<|im_start|>assistant\n")

    without_prompt = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_prompt["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False), add_special_tokens=False)


def test_tokenize_continues_the_final_message_when_asked(http, tokenizer):
    prefilled = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = http.post("/tokenize", json={"messages": prefilled, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()
    # the assistant's message stays open: no end-of-turn after it
    assert tokenizer.decode(body["tokens"]).endswith("<|im_start|>assistant\nThe answer is")
    assert body["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(
        prefilled, tokenize=False, continue_final_message=True), add_special_tokens=False)


def test_tokenize_renders_the_requests_own_chat_template_with_its_kwargs(http, tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    body = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "chat_template": template,
                                        "chat_template_kwargs": {"shout": True}}).json()
    assert body["tokens"] == tokenizer.encode("[user]Hi!", add_special_tokens=False)


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),  # add_generation_prompt too
    ({"messages": MESSAGES, "chat_template": "{% if %}"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": MESSAGES, "chat_template_kwargs": ["not", "a", "dict"]}, "chat_template_kwargs"),
])
def test_tokenize_refuses_what_it_cannot_render(http, body, param):
    assert_openai_error(http.post("/tokenize", json=body), 400, param)


# ---- SageMaker's /ping and /invocations, /load, optional routes off by default ----

def test_ping_answers_like_health_on_get_and_post(http):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_invocations_serves_a_completion_or_a_chat_by_the_body(http, openai_client):
    completion = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
    expected = openai_client.completions.create(model=MODEL_NAME, **completion).choices[0].text
    whole = http.post("/invocations", json=completion).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == expected
    streamed = sse_events(http.post("/invocations", json={**completion, "stream": True}).text)
    assert "".join(event["choices"][0]["text"] for event in streamed) == expected

    chat = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0}
    expected = openai_client.chat.completions.create(model=MODEL_NAME, **chat).choices[0].message.content
    whole = http.post("/invocations", json=chat).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == expected
    streamed = sse_events(http.post("/invocations", json={**chat, "stream": True}).text)
    assert streamed[0]["object"] == "chat.completion.chunk"
    assert "".join(event["choices"][0]["delta"].get("content", "") for event in streamed) == expected


def test_invocations_refuses_a_body_that_is_neither(http):
    assert_openai_error(http.post("/invocations", json={"max_tokens": 3}), 400)
    assert_openai_error(http.post("/invocations", content=b"{not json"), 400, code="invalid_json")
    # the endpoint it picks checks the rest, naming the field
    assert_openai_error(http.post("/invocations", json={"prompt": "x", "max_tokens": -1}), 400, "max_tokens")


def test_without_their_flags_load_reads_0_and_tokenizer_info_is_absent(http):
    assert http.get("/load").json() == {"server_load": 0}
    assert_openai_error(http.get("/tokenizer_info"), 404, code="not_found")
    assert "x-request-id" not in http.get("/health").headers


def test_cors_allows_any_origin_by_default_and_preflights_need_no_api_key(server):
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    response = httpx.get(f"{server.url}/v1/models", headers={"Origin": APP_ORIGIN, **AUTH})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
