"""GET /metrics under vLLM's names, against the shared server: every metric a vLLM
dashboard reads is there with vLLM's type and labels, and after a mix of requests
(streaming or not, chat, n=2, ending on length, on a stop token, on a client that
leaves) the counters and histograms agree with what the responses said. Other tests
share the server, so each test compares two scrapes taken around its own requests."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import MODEL_NAME, scrape_metrics, sse_events, wait_until_idle

IDLE_TIMEOUT_S = 10.0

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
LATENCY_HISTOGRAMS = ["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                      "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                      "vllm:request_inference_time_seconds", "vllm:time_to_first_token_seconds"]
# one observation per engine request
REQUEST_HISTOGRAMS = [*LATENCY_HISTOGRAMS, "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                      "vllm:request_params_n", "vllm:request_params_max_tokens"]
HISTOGRAMS = [*REQUEST_HISTOGRAMS, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:iteration_tokens_total"]

PROMPT = list(range(5, 45))  # 40 tokens: two full KV blocks a second request finds in the prefix cache


@pytest.fixture(scope="module")
def vocab_size(long_context_llama_dir) -> int:
    return json.loads((Path(long_context_llama_dir) / "config.json").read_text())["vocab_size"]


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_every_vllm_metric_is_exposed_with_vllm_types_and_labels(http):
    families = {family.name: family for family in text_string_to_metric_families(http.get("/metrics").text)}
    expected = {**{name: "gauge" for name in GAUGES}, **{name: "counter" for name in COUNTERS},
                **{name: "histogram" for name in HISTOGRAMS}}
    for name, metric_type in expected.items():
        assert name in families, f"{name} is missing"
        family = families[name]
        assert family.type == metric_type, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL_NAME and sample.labels["engine"] == "0", sample
    reasons = {sample.labels["finished_reason"] for sample in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    # vLLM's buckets
    iteration_bounds = [s.labels["le"] for s in families["vllm:iteration_tokens_total"].samples
                        if s.name.endswith("_bucket")]
    assert iteration_bounds == [f"{b}.0" for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                    16384)] + ["+Inf"]
    n_bounds = [s.labels["le"] for s in families["vllm:request_params_n"].samples if s.name.endswith("_bucket")]
    assert n_bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) > 0
    assert families["troupe_http_requests"].type == "counter"  # troupe's own, where vLLM has none


def _run(http: httpx.Client, route: str, body: dict) -> tuple[dict, list[str]]:
    """Sends one request; its usage and its choices' finish reasons."""
    response = http.post(route, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        result = response.json()
        return result["usage"], [choice["finish_reason"] for choice in result["choices"]]
    events = sse_events(response.text)
    reasons = [choice["finish_reason"] for event in events for choice in event["choices"] if choice["finish_reason"]]
    return events[-1]["usage"], reasons


def test_counts_and_latencies_agree_with_the_requests_sent(http, vocab_size):
    wait_until_idle(http, IDLE_TIMEOUT_S)
    before = scrape_metrics(http)
    requests = [  # (route, body); one engine request each
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0.0}),
        # the same prompt again, streamed: its first two blocks come from the prefix cache
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": [7, 8, 9], "n": 2, "max_tokens": 3, "ignore_eos": True, "seed": 1}),
        # every token is a stop token: ends with "stop" on its first
        ("/v1/completions", {"prompt": [11, 12, 13], "max_tokens": 8, "stop_token_ids": list(range(vocab_size))}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True,
                                  "ignore_eos": True, "stream_options": {"include_usage": True}}),
    ]
    usages, reasons = [], []
    for route, body in requests:
        usage, finish_reasons = _run(http, route, body)
        assert len(finish_reasons) == body.get("n", 1)
        usages.append(usage)
        reasons += finish_reasons
    after = wait_until_idle(http, IDLE_TIMEOUT_S)
    num_requests = len(requests)
    num_prompt_tokens = sum(usage["prompt_tokens"] for usage in usages)
    num_generation_tokens = sum(usage["completion_tokens"] for usage in usages)
    assert reasons == ["length"] * 4 + ["stop", "length"] and usages[3]["completion_tokens"] == 1

    def change(key: str) -> float:
        return delta(before, after, key)

    # tokens and finishes, as the responses counted them
    assert change("vllm:prompt_tokens_total") == num_prompt_tokens
    assert change("vllm:generation_tokens_total") == num_generation_tokens
    for reason in ("stop", "length", "abort"):
        assert change(f'vllm:request_success_total{{finished_reason="{reason}"}}') == reasons.count(reason), reason
    # one observation per request
    for name in REQUEST_HISTOGRAMS:
        assert change(f"{name}_count") == num_requests, name
        assert change(f'{name}_bucket{{le="+Inf"}}') == num_requests, name
    assert change("vllm:request_prompt_tokens_sum") == num_prompt_tokens
    assert change("vllm:request_generation_tokens_sum") == num_generation_tokens
    assert change("vllm:request_params_n_sum") == sum(body.get("n", 1) for _, body in requests)
    assert change("vllm:request_params_max_tokens_sum") == sum(body["max_tokens"] for _, body in requests)

    # a request's time splits into queue + prefill + decode (each finished on a token)
    e2e = change("vllm:e2e_request_latency_seconds_sum")
    queue, prefill, decode = (change(f"vllm:request_{phase}_time_seconds_sum") for phase in ("queue", "prefill",
                                                                                             "decode"))
    assert queue > 0 and prefill > 0 and decode > 0
    assert queue + prefill + decode == pytest.approx(e2e, abs=1e-3)
    assert change("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-3)
    assert change("vllm:time_to_first_token_seconds_sum") <= e2e

    # one inter-token gap per step of a request after its first: exact for n=1, and for n=2
    # between its longest completion's and the sum of both (a sibling may start a step later)
    gaps_n1 = sum(usage["completion_tokens"] - 1 for usage, (_, body) in zip(usages, requests) if body.get("n", 1) == 1)
    gaps = change("vllm:inter_token_latency_seconds_count")
    assert gaps_n1 + 3 - 1 <= gaps <= gaps_n1 + 6 - 1
    assert change("vllm:time_per_output_token_seconds_count") == gaps  # vLLM's older name, the same gaps
    # per request that made more than one token: all but the one that stopped on its first
    assert change("vllm:request_time_per_output_token_seconds_count") == num_requests - 1

    # per engine step: the tokens sampled, plus each request's prompt at its first token
    assert change("vllm:iteration_tokens_total_sum") == num_prompt_tokens + num_generation_tokens
    assert 1 <= change("vllm:iteration_tokens_total_count") <= num_generation_tokens
    # every admitted sequence looks its tokens up in the prefix cache; the repeated prompt hits
    assert change("vllm:prefix_cache_queries_total") >= num_prompt_tokens
    assert change("vllm:prefix_cache_hits_total") >= 32
    assert change("vllm:num_preemptions_total") >= 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0


def test_a_client_that_leaves_counts_as_an_aborted_request(http):
    wait_until_idle(http, IDLE_TIMEOUT_S)
    before = scrape_metrics(http)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    after = wait_until_idle(http, IDLE_TIMEOUT_S)
    assert delta(before, after, 'vllm:request_success_total{finished_reason="abort"}') == 1
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "vllm:request_params_max_tokens_sum") == 2000
    assert delta(before, after, "vllm:generation_tokens_total") >= 1
