"""vLLM's API flags on a server of their own: --chat-template (a file), --response-role,
--return-tokens-as-token-ids, --enable-prompt-tokens-details (with cache_salt keeping
prefix-cache entries apart) and --max-logprobs."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import ServerProcess, sse_events
from tests.api.test_errors import assert_openai_error

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
# 40 tokens: two full blocks of 16 can come from the prefix cache
LONG_PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def flags_http(long_context_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api_flags")
    template_file = folder / "template.jinja"
    template_file.write_text(TEMPLATE)
    server = ServerProcess(long_context_llama_dir, folder / "server.log", "--chat-template", str(template_file),
                           "--response-role", "bot", "--return-tokens-as-token-ids",
                           "--enable-prompt-tokens-details", "--max-logprobs", "3")
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            yield client
    finally:
        assert server.stop() == 0, server.log()


def test_the_chat_template_file_renders_chats_that_send_none(flags_http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True}
    rendered = flags_http.post("/v1/chat/completions", json=body).json()["prompt_token_ids"]
    expected = flags_http.post("/tokenize", json={"prompt": "<user>hi>", "add_special_tokens": False}).json()
    assert rendered == expected["tokens"]
    assert flags_http.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"] == expected["tokens"]


def test_the_response_role_names_generated_messages(flags_http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert flags_http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
    events = sse_events(flags_http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[0]["choices"][0]["delta"]["role"] == "bot"


def test_tokens_are_token_ids_by_default_and_a_request_may_say_otherwise(flags_http):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.0, "logprobs": 1}
    tokens = flags_http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in tokens)
    texts = flags_http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert not any(token.startswith("token_id:") for token in texts["choices"][0]["logprobs"]["tokens"])


def test_max_logprobs_bounds_logprobs_and_prompt_logprobs(flags_http):
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    assert flags_http.post("/v1/completions", json={**body, "logprobs": 3}).status_code == 200
    assert_openai_error(flags_http.post("/v1/completions", json={**body, "logprobs": 4}), 400, param="logprobs")
    assert_openai_error(flags_http.post("/v1/completions", json={**body, "prompt_logprobs": 4}), 400,
                        param="prompt_logprobs")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 4}
    assert_openai_error(flags_http.post("/v1/chat/completions", json=chat), 400, param="top_logprobs")


def cached_tokens(http: httpx.Client, prompt: list[int], **fields) -> int:
    body = {"prompt": prompt, "max_tokens": 1, **fields}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_cached_prompt_tokens_are_reported_and_cache_salt_keeps_entries_apart(flags_http):
    prompt = LONG_PROMPT
    assert cached_tokens(flags_http, prompt) == 0
    assert cached_tokens(flags_http, prompt) == 32  # two full blocks of 16 from the first request
    assert cached_tokens(flags_http, prompt, cache_salt="alice") == 0  # a salt shares nothing unsalted
    assert cached_tokens(flags_http, prompt, cache_salt="alice") == 32
    assert cached_tokens(flags_http, prompt, cache_salt="bob") == 0
    chat = {"messages": [{"role": "user", "content": "x " * 40}], "max_tokens": 1, "cache_salt": "carol"}
    first = flags_http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]
    again = flags_http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] > 0
