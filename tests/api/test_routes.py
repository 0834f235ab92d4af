"""vLLM's routes and server flags beyond the OpenAI API, against real servers: /tokenize in
vLLM's shapes (checked against the tokenizer itself), SageMaker's /ping and /invocations,
/load, /tokenizer_info, CORS, X-Request-Id, --root-path, --uds and --disable-log-requests.

The shared server covers the defaults; one more server, on a Unix socket behind a root
path with every optional flag on, covers the flags."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import API_KEY, AUTH, MODEL_NAME, ServerProcess, sse_events
from tests.api.test_errors import assert_openai_error
from tests.api.test_launch import launch

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
ROOT_PATH = "/llm"
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


def test_invocations_logs_no_field_of_its_endpoints_as_unknown(http, server):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "an_invented_field": 1}
    assert http.post("/invocations", json=body).status_code == 200
    log = server.log()
    assert "'temperature'" not in log and "'top_p'" not in log and "'max_tokens'" not in log, log
    assert "ignoring the unknown request field 'an_invented_field'" in log  # the endpoint's own check still runs


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


# ---- the flags: one server on a Unix socket with all of them ----

def test_help_lists_the_flags_and_bad_values_fail_at_once(tmp_path):
    result = launch("--help")
    assert result.returncode == 0
    for flag in ("--uds", "--root-path", "--allowed-origins", "--allowed-methods", "--allowed-headers",
                 "--allow-credentials", "--enable-request-id-headers", "--disable-log-requests",
                 "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint"):
        assert flag in result.stdout
    result = launch("--allowed-origins", "*")
    assert result.returncode == 2 and "--allowed-origins: expected a JSON list of strings" in result.stderr
    result = launch("--root-path", "llm/")
    assert result.returncode == 2 and "--root-path must start with '/'" in result.stderr
    # a socket that cannot be made fails before the model loads
    result = launch("--uds", str(tmp_path / "missing" / "troupe.sock"), timeout=30.0)
    assert result.returncode == 1 and "cannot listen on unix:" in result.stderr and result.stdout == ""


@pytest.fixture(scope="module")
def socket_dir():
    """A short directory: a Unix socket's path must fit in 108 bytes."""
    path = tempfile.mkdtemp(prefix="troupe-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def flag_server(long_context_llama_dir, tmp_path_factory, socket_dir):
    process = ServerProcess(
        long_context_llama_dir, tmp_path_factory.mktemp("flag_server") / "server.log",
        "--uds", os.path.join(socket_dir, "troupe.sock"), "--root-path", ROOT_PATH, "--api-key", API_KEY,
        "--allowed-origins", f'["{APP_ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
        "--allowed-headers", '["authorization", "content-type"]', "--allow-credentials",
        "--enable-request-id-headers", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
        "--allow-unauthenticated-metrics", "--disable-log-requests", "--log-level", "info")
    try:
        yield process
    finally:
        if process.popen.poll() is None:  # the last test stops it; a run that skipped that one
            process.stop()
        elif process.leftover_pids():
            process.kill()


@pytest.fixture(scope="module")
def uds_http(flag_server, socket_dir):
    """A client of the flag server over its Unix socket, with the API key."""
    transport = httpx.HTTPTransport(uds=os.path.join(socket_dir, "troupe.sock"))
    with httpx.Client(transport=transport, base_url="http://troupe", headers=AUTH, timeout=60.0) as client:
        yield client


def test_uds_serves_on_the_socket_and_says_so(flag_server, socket_dir, uds_http):
    path = os.path.join(socket_dir, "troupe.sock")
    assert flag_server.ready_line == f"Serving {MODEL_NAME} on unix:{path}"
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert uds_http.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME


def test_root_path_prefixes_urls_and_the_api_key_still_guards_v1(uds_http):
    # the proxy strips the prefix; the server puts it back where it names its own URLs
    error = assert_openai_error(uds_http.get("/nope"), 404, code="not_found")
    assert error["message"] == f"no route GET {ROOT_PATH}/nope"
    assert_openai_error(uds_http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401,
                        code="invalid_api_key")
    # metrics label requests by route, below the prefix
    assert 'route="/v1/models",status="401"' in uds_http.get("/metrics").text


@pytest.mark.parametrize("prefix", ["", ROOT_PATH])
@pytest.mark.parametrize("api_key", [API_KEY, "wrong"])
def test_root_path_serves_v1_with_and_without_the_prefix(flag_server, socket_dir, prefix, api_key):
    """vLLM's test_root_path: under --root-path /llm, /llm/v1 answers as /v1 does, the API key
    guarding both."""
    transport = httpx.HTTPTransport(uds=os.path.join(socket_dir, "troupe.sock"))
    with httpx.Client(transport=transport, timeout=60.0) as http_client, \
            openai.OpenAI(base_url=f"http://troupe{prefix}/v1", api_key=api_key, http_client=http_client,
                          max_retries=0) as client:
        create = lambda: client.chat.completions.create(  # noqa: E731
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "tell me a saying"},
                                                      {"role": "assistant", "content": "An apple a day"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
        if api_key != API_KEY:
            with pytest.raises(openai.AuthenticationError):
                create()
            return
        reply = create()
        assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason in ("stop", "length")


def test_a_requests_own_chat_template_needs_the_trust_flag(uds_http):
    """vLLM's --trust-request-chat-template: without it (this server) a request's own template
    is refused by name, on every route that renders one; the server's own still renders."""
    messages = [{"role": "user", "content": "Hi"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for route in ("/v1/chat/completions", "/tokenize"):
        error = assert_openai_error(uds_http.post(route, json={"messages": messages, "chat_template": template,
                                                               "max_tokens": 2}), 400, "chat_template")
        assert "--trust-request-chat-template" in error["message"]
        assert uds_http.post(route, json={"messages": messages, "max_tokens": 2}).status_code == 200


def test_metrics_open_without_the_key_only_with_the_flag(flag_server, socket_dir, server):
    transport = httpx.HTTPTransport(uds=os.path.join(socket_dir, "troupe.sock"))
    with httpx.Client(transport=transport, base_url="http://troupe", timeout=60.0) as no_key:
        assert no_key.get("/metrics").status_code == 200  # --allow-unauthenticated-metrics
        assert no_key.get("/load").status_code == 401 and no_key.get("/version").status_code == 401
    assert_openai_error(httpx.get(f"{server.url}/metrics"), 401, code="invalid_api_key")  # without the flag


def test_request_id_header_is_echoed_or_made(uds_http):
    assert uds_http.get("/health", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
    made = uds_http.get("/health").headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    # errors and streams carry it too
    assert uds_http.get("/nope", headers={"X-Request-Id": "trace-43"}).headers["x-request-id"] == "trace-43"
    with uds_http.stream("POST", "/v1/completions", headers={"X-Request-Id": "trace-44"},
                         json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as stream:
        assert stream.headers["x-request-id"] == "trace-44"
        stream.read()


def wait_for_load(client: httpx.Client, load: int, timeout: float = 10.0) -> None:
    """Until /load reads load: a request counts until its app call returns, just after its
    last bytes are sent."""
    deadline = time.monotonic() + timeout
    while (current := client.get("/load").json()) != {"server_load": load}:
        assert time.monotonic() < deadline, f"/load reads {current}, not {load}, {timeout} s later"
        time.sleep(0.05)


def test_load_counts_a_streaming_request_while_it_runs(uds_http):
    wait_for_load(uds_http, 0)
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with uds_http.stream("POST", "/v1/completions", json=body) as stream:
        chunks = stream.iter_bytes()  # kept: a dropped iterator closes the stream, a disconnect
        next(chunks)  # the stream is under way
        assert uds_http.get("/load").json() == {"server_load": 1}
    # leaving the stream disconnects: the request ends and the count with it
    wait_for_load(uds_http, 0)


def test_tokenizer_info_gives_the_tokenizers_config(uds_http, tokenizer):
    info = uds_http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == tokenizer.model_max_length
    assert "vocab_file" not in info and "merges_file" not in info  # its files are the server's own business
    # added tokens are objects, as tokenizer_config.json holds them and vLLM serves them
    assert info["added_tokens_decoder"]["0"] == {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
    assert len(info["added_tokens_decoder"]) == len(tokenizer.added_tokens_decoder)

def test_lm_evals_remote_tokenizer_probe_works_with_the_flag(uds_http):
    """lm-eval's tokenizer_backend "auto" reads /tokenizer_info for eos_token, then takes
    the EOS id from /tokenize (vLLM serves the route under the same flag)."""
    info = uds_http.get("/tokenizer_info")
    assert info.status_code == 200 and "eos_token" in info.json()
    eos = uds_http.post("/tokenize", json={"prompt": info.json()["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == 0



def test_cors_allows_only_the_allowed_origin_with_credentials(uds_http):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = uds_http.options("/v1/completions", headers={"Origin": APP_ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == APP_ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert allowed.headers["access-control-allow-methods"] == "GET, POST"
    assert uds_http.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight}).status_code \
        == 400
    assert uds_http.options("/v1/completions", headers={"Origin": APP_ORIGIN, **preflight,
                                                        "Access-Control-Request-Method": "DELETE"}).status_code == 400
    assert "access-control-allow-origin" not in uds_http.get("/health", headers={"Origin": "https://evil.example"}).headers


def test_disable_log_requests_leaves_no_request_line_and_stopping_removes_the_socket(flag_server, socket_dir,
                                                                                   uds_http):
    # last in this file: it stops the flag server
    assert uds_http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert flag_server.stop() == 0
    log = flag_server.log()
    assert '"POST /' not in log and '"GET /' not in log, log
    assert not os.path.exists(os.path.join(socket_dir, "troupe.sock"))
    assert not flag_server.leftover_pids()

