"""lm-evaluation-harness's `local-completions` and `local-chat-completions` models against the
shared server, request for request. lm-eval itself pulls in datasets, evaluate, sacrebleu,
scikit-learn and more, so this is a small faithful client of lm_eval/models/api_models.py and
openai_completions.py: the same encoding of (context, continuation) pairs, the same batched
payloads of token-id prompts, and the same parsing of the answers. The loglikelihoods it
computes are checked against Hugging Face transformers on the served model, in float32."""

from __future__ import annotations

import pytest
import torch

from tests.api.conftest import API_KEY, MODEL_NAME

SEED = 1234  # lm-eval's default seed, sent with every request
MAX_LENGTH = 2048 - 1  # its default max_length, less the one generated token
HEADER = {"Authorization": f"Bearer {API_KEY}"}  # from OPENAI_API_KEY


@pytest.fixture(scope="module")
def tokenizer(long_context_llama_dir):
    """lm-eval's huggingface tokenizer backend, on the served model's directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(long_context_llama_dir)


@pytest.fixture(scope="module")
def hf_model(long_context_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(long_context_llama_dir, dtype=torch.float32).eval()


def tok_encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens: trailing spaces of
    the context move to the continuation, and the continuation is whatever the whole text's
    tokens have past the context's. An empty context is the tokenizer's BOS token alone."""
    if not context:
        return [tokenizer.bos_token_id], tok_encode(tokenizer, continuation)
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tok_encode(tokenizer, context + continuation)
    context_enc = tok_encode(tokenizer, context)
    return context_enc, whole[len(context_enc):]


def loglikelihoods(http, tokenizer, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(sum of the continuation's logprobs, whether it is the greedy continuation) per request,
    as local-completions computes them: one batched request, longest first."""
    pairs = [encode_pair(tokenizer, context, continuation) for context, continuation in requests]
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0] + pairs[i][1]))
    inputs = [(pairs[i][0] + pairs[i][1])[-MAX_LENGTH:] for i in order]
    ctxlens = [len(pairs[i][0]) - max(0, len(pairs[i][0]) + len(pairs[i][1]) - MAX_LENGTH) for i in order]
    payload = {"model": MODEL_NAME, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": SEED, "echo": True}
    response = http.post("/v1/completions", json=payload, headers=HEADER)
    response.raise_for_status()
    results: list[tuple[float, bool]] = []
    for choice, ctxlen in zip(sorted(response.json()["choices"], key=lambda c: c["index"]), ctxlens):
        # the echoed prompt's logprobs, less the context's and the one generated token
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(logprob == max(top.values()) for logprob, top in zip(token_logprobs, top_logprobs))
        results.append((sum(token_logprobs), is_greedy))
    by_request = [None] * len(requests)
    for position, index in enumerate(order):
        by_request[index] = results[position]
    return by_request


def hf_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> tuple[list[float], bool]:
    """The continuation's per-token logprobs and greediness, from transformers."""
    context_enc, continuation_enc = encode_pair(tokenizer, context, continuation)
    tokens = context_enc + continuation_enc
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    positions = range(len(context_enc), len(tokens))
    per_token = [logprobs[i - 1, tokens[i]].item() for i in positions]
    return per_token, all(logprobs[i - 1].argmax().item() == tokens[i] for i in positions)


def greedy_continuation(hf_model, tokenizer, contexts: list[str]) -> tuple[str, str]:
    """A (context, continuation) whose continuation is the model's greedy next token and
    survives lm-eval's re-encoding (a byte-level token may not decode to whole characters)."""
    for context in contexts:
        context_enc = tok_encode(tokenizer, context)
        with torch.no_grad():
            token = hf_model(torch.tensor([context_enc])).logits[0, -1].argmax().item()
        continuation = tokenizer.decode([token])
        if encode_pair(tokenizer, context, continuation) == (context_enc, [token]):
            return context, continuation
    raise AssertionError("no context among these has a greedy next token that re-encodes to itself")


def test_loglikelihood_matches_transformers(http, tokenizer, hf_model):
    contexts = ["The quick brown fox", "Hello world! How are you", "Once upon a time", "1 2 3 4", "def add(a, b):"]
    requests = [("The quick brown fox", " jumps over the lazy dog."),
                ("Paris is the capital of ", "France."),  # the trailing space moves to the continuation
                ("", "Hello world!"),  # an empty context: the BOS token stands in
                ("小猫在花园里", "玩。"),
                greedy_continuation(hf_model, tokenizer, contexts)]
    results = loglikelihoods(http, tokenizer, requests)
    for (context, continuation), (total, is_greedy) in zip(requests, results):
        per_token, hf_greedy = hf_loglikelihood(hf_model, tokenizer, context, continuation)
        assert total == pytest.approx(sum(per_token), abs=1e-4 * len(per_token)), (context, continuation)
        assert is_greedy == hf_greedy, (context, continuation)
    assert results[-1][1] and not results[0][1]


def test_loglikelihood_of_one_request_equals_it_in_a_batch(http, tokenizer):
    # batching (and its reordering) must not change any request's numbers
    requests = [("The quick brown fox", " jumps"), ("Hello", " world!"), ("Once upon a", " time")]
    batched = loglikelihoods(http, tokenizer, requests)
    alone = [loglikelihoods(http, tokenizer, [request])[0] for request in requests]
    for (batched_total, batched_greedy), (total, greedy) in zip(batched, alone):
        assert batched_total == pytest.approx(total, abs=1e-4) and batched_greedy == greedy


def free_text(http, path: str, body: dict) -> str:
    choice = http.post(path, json={**body, "max_tokens": 24, "temperature": 0}).json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def a_stop_in(text: str) -> str:
    """Two characters of text, first seen past its start: a stop string that cuts it. Not one
    with U+FFFD, which stands for bytes of a character the model never completed."""
    return next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2] not in text[:i + 1] and "\ufffd" not in text[i:i + 2])


def cut_at_first(text: str, stops: list[str]) -> str:
    return text[:min((text.find(stop) for stop in stops if stop in text), default=len(text))]


def test_generate_until_stops_at_the_first_stop_string(http, tokenizer):
    contexts = ["The quick brown fox", "Paris is the capital of France. Berlin is"]
    encodings = [tok_encode(tokenizer, context) for context in contexts]
    frees = [free_text(http, "/v1/completions", {"model": MODEL_NAME, "prompt": [tokens]}) for tokens in encodings]
    stops = [a_stop_in(free) for free in frees]
    # one task's gen_kwargs: lm-eval batches requests with equal gen_kwargs, so one stop list
    gen_kwargs = {"until": stops, "do_sample": False, "temperature": 0.0, "max_gen_toks": 24}
    stop = [*gen_kwargs["until"], tokenizer.eos_token]  # lm-eval adds the EOS string
    payload = {"prompt": [tokens[-(MAX_LENGTH - 24):] for tokens in encodings], "model": MODEL_NAME,
               "max_tokens": gen_kwargs["max_gen_toks"], "temperature": gen_kwargs["temperature"], "stop": stop,
               "seed": SEED}
    response = http.post("/v1/completions", json=payload, headers=HEADER)
    response.raise_for_status()
    choices = response.json()["choices"]
    texts: list[str | None] = [None] * len(choices)
    for choice in choices:
        texts[choice["index"]] = choice["text"]
    assert texts == [cut_at_first(free, stops) for free in frees]


def test_local_chat_completions_generates_until_a_stop(http):
    # the chat arrives as lm-eval re-loads it from JSON: each message carries "type": "text"
    messages = [{"role": "user", "content": "Hello world! How are you today?", "type": "text"}]
    free = free_text(http, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages})
    until = ["\n\n", a_stop_in(free), "Question:", "</s>", "never sent: lm-eval keeps four"]
    payload = {"messages": messages, "model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "stop": until[:4],
               "seed": SEED}
    response = http.post("/v1/chat/completions", json=payload, headers=HEADER)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == cut_at_first(free, until[:4])
    assert choice["finish_reason"] == "stop"
