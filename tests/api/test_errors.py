"""Every client error gets its status and an OpenAI-shaped body, and none of them reaches
or hurts the engine: after hundreds of bad requests a good one still gets the same answer."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import API_KEY, AUTH, MAX_MODEL_LEN, MODEL_NAME, wait_until_idle

GOOD = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (route, JSON body or raw bytes, the param the error names, its code)
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x",', None, "invalid_json"),
    ("/v1/completions", b"", None, "invalid_json"),
    ("/v1/completions", b'["a list, not an object"]', None, None),
    ("/v1/completions", {"max_tokens": 3}, "prompt", None),  # no prompt
    ("/v1/completions", {**GOOD, "prompt": 5}, "prompt", None),
    ("/v1/completions", {**GOOD, "prompt": [5, "six"]}, "prompt", None),
    ("/v1/completions", {**GOOD, "prompt": []}, "prompt", None),
    ("/v1/completions", {**GOOD, "prompt": ""}, "prompt", None),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, "temperature", None),
    ("/v1/completions", {**GOOD, "n": 1.5}, "n", None),
    ("/v1/completions", {**GOOD, "stream": "yes"}, "stream", None),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, "temperature", None),
    ("/v1/completions", {**GOOD, "top_p": 0.0}, "top_p", None),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {**GOOD, "n": 0}, "n", None),
    ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs", None),
    ("/v1/completions", {**GOOD, "presence_penalty": 3}, "presence_penalty", None),
    ("/v1/completions", {**GOOD, "min_p": 1.5}, "min_p", None),
    ("/v1/completions", {**GOOD, "stop": [""]}, "stop", None),
    ("/v1/completions", {**GOOD, "prompt": [5] * (MAX_MODEL_LEN + 10)}, "prompt", None),
    ("/v1/completions", {**GOOD, "prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN}, "max_tokens", None),
    ("/v1/completions", {**GOOD, "prompt": [5, 10**6]}, "prompt", None),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"seven": 1}}, "logit_bias", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"7": 101}}, "logit_bias", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"-3": 1}}, "logit_bias", None),
    ("/v1/completions", {**GOOD, "logit_bias": {str(10**6): 1}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [  # an image to a text-only model
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, "messages", None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format", None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, "tokens", None),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert (error["param"], error["code"]) == (param, code)
    return error


@pytest.mark.parametrize("route, body, param, code", BAD_REQUESTS)
def test_bad_request_gets_400_naming_the_field(http, route, body, param, code):
    if isinstance(body, bytes):
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(route, json=body)
    assert_openai_error(response, 400, param, code)


@pytest.mark.parametrize("route, body", [("/v1/completions", {**GOOD, "model": "gpt-4"}),
                                         ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}),
                                         ("/detokenize", {"model": "gpt-4", "tokens": [5]})])
def test_an_unknown_model_gets_404_as_vllm_answers_it(http, route, body):
    # vLLM's shape, not OpenAI's: its NotFoundError type and the status as the code
    response = http.post(route, json=body)
    assert response.status_code == 404, response.text
    assert response.json() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}


# every route of the shared server that runs the model or shows its state, and a path no route has
GUARDED_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                  ("POST", "/v1/responses"), ("GET", "/v1/responses/resp-1"), ("POST", "/invocations"),
                  ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/pooling"), ("POST", "/classify"),
                  ("POST", "/score"), ("POST", "/v1/score"), ("POST", "/rerank"), ("POST", "/v2/rerank"),
                  ("GET", "/metrics"), ("GET", "/load"), ("GET", "/version"), ("GET", "/tokenizer_info"),
                  ("POST", "/sleep"), ("GET", "/no/such/route")]


def test_api_key_is_required_on_every_route_but_the_health_checks(server):
    for method, path in GUARDED_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{server.url}{path}", json=GOOD, headers=headers)
            assert_openai_error(response, 401, code="invalid_api_key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ping").status_code == 200 and httpx.post(f"{server.url}/ping").status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert [card["id"] for card in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/version", headers=AUTH).status_code == 200


def test_too_many_or_too_large_headers_are_refused_and_the_server_serves_on(http, server):
    many = [(f"x-filler-{i}", "1") for i in range(300)]
    assert_openai_error(http.get("/v1/models", headers=many), 431, code="headers_too_large")
    # past --h11-max-incomplete-event-size (64 KiB): 400 from h11 when the block is still arriving, else 431
    response = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "x-big": "a" * (100 * 2**10)})
    assert response.status_code in (400, 431)
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_unknown_route_is_404_and_wrong_method_405(http):
    assert_openai_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_openai_error(http.get("/v1/completions"), 405, code="method_not_allowed")


def test_body_over_the_limit_is_413_with_or_without_a_length(http):
    big = b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}'
    assert_openai_error(http.post("/v1/completions", content=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit holds while reading
        for start in range(0, len(big), 2**16):
            yield big[start:start + 2**16]

    assert_openai_error(http.post("/v1/completions", content=chunked()), 413, code="request_too_large")


def test_200_bad_requests_then_a_good_one_gets_the_same_answer(http):
    before = http.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
    for i in range(200):
        route, body, param, code = BAD_REQUESTS[i % len(BAD_REQUESTS)]
        if isinstance(body, bytes):
            response = http.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(route, json=body)
        assert response.status_code == 400
    after = http.post("/v1/completions", json=GOOD)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    wait_until_idle(http, timeout=5.0)
