"""use_beam_search over HTTP: the n choices are Hugging Face's n beams, token for token and
in order, on /v1/completions and /v1/chat/completions, whole or streamed; fields a beam
search would ignore are refused by name."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from actors import BeamSearchParams
from tests.frontend.test_beam_search import hf_beams
from tests.api.conftest import sse_events
from tests.api.test_errors import assert_openai_error

PROMPTS = [[5, 9, 14, 22, 31, 40], [100, 7, 7, 250, 3]]


@pytest.fixture(scope="module")
def hf_model(long_context_llama_dir):
    return AutoModelForCausalLM.from_pretrained(long_context_llama_dir, dtype="float32").eval()


@pytest.mark.parametrize("beam_width, length_penalty", [(3, 1.0), (2, 0.5)])
def test_completion_beams_are_hfs_beams_in_order(http, hf_model, beam_width, length_penalty):
    body = {"prompt": PROMPTS, "max_tokens": 7, "n": beam_width, "use_beam_search": True,
            "length_penalty": length_penalty, "return_token_ids": True}
    response = http.post("/v1/completions", json=body).json()
    params = BeamSearchParams(beam_width=beam_width, max_tokens=7, length_penalty=length_penalty)
    for prompt_index, prompt in enumerate(PROMPTS):
        choices = response["choices"][prompt_index * beam_width:(prompt_index + 1) * beam_width]
        assert [choice["index"] for choice in choices] == list(range(prompt_index * beam_width,
                                                                     (prompt_index + 1) * beam_width))
        assert [choice["token_ids"] for choice in choices] == [tokens for tokens, _ in hf_beams(hf_model, prompt,
                                                                                                  params)]
    assert response["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    streamed = sse_events(http.post("/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}).text)
    assert [event["choices"][0]["token_ids"] for event in streamed[:-1]] == \
        [choice["token_ids"] for choice in response["choices"]]
    assert streamed[-1]["usage"] == response["usage"]


def test_chat_beams_are_hfs_beams_of_the_rendered_prompt(http, hf_model):
    messages = [{"role": "user", "content": "Hello world! How are you?"}]
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"messages": messages, "max_completion_tokens": 6, "n": 3, "use_beam_search": True,
            "return_token_ids": True}
    response = http.post("/v1/chat/completions", json=body).json()
    expected = hf_beams(hf_model, prompt, BeamSearchParams(beam_width=3, max_tokens=6))
    assert [choice["token_ids"] for choice in response["choices"]] == [tokens for tokens, _ in expected]
    assert all(choice["message"]["role"] == "assistant" for choice in response["choices"])


@pytest.mark.parametrize("field, value", [("stop", ["x"]), ("top_p", 0.5), ("logit_bias", {"5": 1}),
                                          ("min_tokens", 2), ("prompt_logprobs", 1)])
def test_fields_a_beam_search_would_ignore_are_refused(http, field, value):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "use_beam_search": True, field: value}
    assert_openai_error(http.post("/v1/completions", json=body), 400, param=field)
