"""Every request field the engine would take at any size has a bound (api/request_limits.py,
docs/security.md): past it a 400 names the field, at it the request runs, and n counts in
admission, so a request of many sequences is turned away like many requests."""

from __future__ import annotations

import time

import httpx
import pytest

from api import request_limits as limits
from tests.api.conftest import wait_until_idle
from tests.api.test_errors import assert_openai_error

COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.0}
RESPONSE = {"input": "Hi", "max_output_tokens": 2}


def _tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


def _big_schema(num_bytes: int) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "description": "x" * num_bytes}}}


# (route, the body's fields past a bound, the param the 400 names)
PAST_THE_BOUND = [
    ("/v1/completions", {"n": limits.DEFAULT_MAX_N_SEQUENCES + 1}, "n"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(limits.MAX_STOP_STRINGS + 1)]}, "stop"),
    ("/v1/completions", {"stop": "x" * (limits.MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("/v1/completions", {"stop_token_ids": [5] * (limits.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("/v1/completions", {"bad_words": ["w"] * (limits.MAX_BAD_WORDS + 1)}, "bad_words"),
    ("/v1/completions", {"bad_words": ["w" * (limits.MAX_BAD_WORD_CHARS + 1)]}, "bad_words"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [5] * 100_000}, "allowed_token_ids"),
    ("/v1/completions", {"guided_json": _big_schema(limits.MAX_SCHEMA_BYTES)}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a" * (limits.MAX_SCHEMA_BYTES + 1)}, "guided_regex"),
    ("/v1/chat/completions", {"n": limits.DEFAULT_MAX_N_SEQUENCES + 1}, "n"),
    ("/v1/chat/completions", {"stop": ["x" * (limits.MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": _big_schema(limits.MAX_SCHEMA_BYTES)}}}, "response_format"),
    ("/v1/chat/completions", {"tools": [_tool(f"f{i}") for i in range(limits.MAX_TOOLS + 1)],
                              "tool_choice": "none"}, "tools"),
    ("/v1/chat/completions", {"tools": [_tool("f", "d" * limits.MAX_TOOL_BYTES)], "tool_choice": "none"}, "tools"),
    ("/v1/responses", {"metadata": {f"k{i}": "v" for i in range(limits.MAX_METADATA_KEYS + 1)}}, "metadata"),
    ("/v1/responses", {"metadata": {"k": "v" * (limits.MAX_METADATA_VALUE_CHARS + 1)}}, "metadata"),
    ("/v1/responses", {"metadata": {"k" * (limits.MAX_METADATA_KEY_CHARS + 1): "v"}}, "metadata"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "big",
                                           "schema": _big_schema(limits.MAX_SCHEMA_BYTES)}}}, "text"),
]
BASE = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/responses": RESPONSE}


@pytest.mark.parametrize("route, fields, param", PAST_THE_BOUND)
def test_a_field_past_its_bound_is_a_400_naming_it(http, route, fields, param):
    assert_openai_error(http.post(route, json={**BASE[route], **fields}), 400, param=param)


def test_fields_at_their_bounds_run(http):
    at_bounds = {"stop": ["x" * limits.MAX_STOP_STRING_CHARS] + [f"s{i}" for i in range(limits.MAX_STOP_STRINGS - 1)],
                 "stop_token_ids": [5] * limits.MAX_STOP_TOKEN_IDS,
                 "logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES)}}
    assert http.post("/v1/completions", json={**COMPLETION, **at_bounds}).status_code == 200
    metadata = {("k" * (limits.MAX_METADATA_KEY_CHARS - 2)) + f"{i:02d}": "v" * limits.MAX_METADATA_VALUE_CHARS
                for i in range(limits.MAX_METADATA_KEYS)}
    response = http.post("/v1/responses", json={**RESPONSE, "metadata": metadata})
    assert response.status_code == 200 and response.json()["metadata"] == metadata


def test_more_sequences_than_the_server_ever_runs_is_a_400_naming_n(http):
    # the shared server admits 256 running + 44 waiting sequences: 3 prompts x n=128 never fit
    body = {**COMPLETION, "prompt": [[5, 6], [7, 8], [9, 10]], "n": 128}
    error = assert_openai_error(http.post("/v1/completions", json=body), 400, param="n")
    assert "384 sequences" in error["message"]


def test_n_counts_in_back_pressure(http):
    """A request of 3 prompts x n=100 holds 300 sequences, the whole gate: the next request
    is turned away with 503 until it ends (admission counted prompts, so n=100 was 3)."""
    hog = {**COMPLETION, "prompt": [[5, 6], [7, 8], [9, 10]], "n": 100, "max_tokens": 1000, "ignore_eos": True,
           "temperature": 1.0, "stream": True}
    with http.stream("POST", "/v1/completions", json=hog) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_bytes()
        next(chunks)  # admitted and under way
        turned_away = http.post("/v1/completions", json=COMPLETION)
        assert turned_away.status_code == 503 and turned_away.headers["retry-after"] == "1", turned_away.text
    # leaving the stream aborts its sequences and frees the gate
    wait_until_idle(http, timeout=30.0)
    deadline = time.monotonic() + 10.0
    while (response := http.post("/v1/completions", json=COMPLETION)).status_code == 503:
        assert time.monotonic() < deadline, "the gate did not reopen"
        time.sleep(0.05)
    assert response.status_code == 200


def test_beam_search_counts_its_beams(http):
    # 16 prompts of 20 beams each run 320 requests a step: past the 300 the server runs
    body = {**COMPLETION, "prompt": [[5, i] for i in range(16)], "n": 20, "use_beam_search": True}
    assert_openai_error(http.post("/v1/completions", json=body), 400, param="n")
    assert http.post("/v1/completions", json={**COMPLETION, "n": 2, "use_beam_search": True}).status_code == 200


def test_vllm_max_n_sequences_sets_the_bound(monkeypatch):
    from actors.config import max_n_sequences

    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    assert max_n_sequences() == 4
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "nonsense")
    assert max_n_sequences() == limits.DEFAULT_MAX_N_SEQUENCES


def test_a_good_request_after_all_of_them_gets_its_answer(http: httpx.Client):
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert http.get("/health").status_code == 200
