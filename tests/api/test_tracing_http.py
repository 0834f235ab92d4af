"""--otlp-traces-endpoint: a real server exports one `llm_request` span per engine request
to a collector started by the test (HTTP/protobuf and gRPC), with vLLM's gen_ai
attributes, token counts that match the responses' usage, times in order, and the
caller's trace as parent when the request carries a traceparent header. A collector that
is down costs requests nothing."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from tests.api.conftest import ServerProcess, served
from tests.api.otlp_receiver import OTLPReceiver, serve_grpc, serve_http

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@contextlib.contextmanager
def traced_server(model_dir: str, log_dir, endpoint: str, *flags: str):
    process = ServerProcess(model_dir, log_dir / "server.log", "--log-level", "warning",
                            "--otlp-traces-endpoint", endpoint, *flags)
    with contextlib.contextmanager(served)(process) as server:
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            yield http


def completion(http: httpx.Client, headers: dict | None = None, **body) -> dict:
    response = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": 0.0,
                                                  "ignore_eos": True, **body}, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def test_each_request_exports_one_span_with_vllms_attributes(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export batches every 100 ms, not 5 s
    receiver = OTLPReceiver()
    collector, endpoint = serve_http(receiver)
    try:
        with traced_server(tiny_llama_dir, tmp_path, endpoint, "--collect-detailed-traces", "all") as http:
            plain = completion(http, max_tokens=5, top_p=0.9)
            linked = completion(http, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}, max_tokens=7)
            several = completion(http, prompt=["a b", "c d e"], max_tokens=3, n=2, temperature=0.5, seed=1)
            spans = receiver.wait_for(4)
            time.sleep(0.5)
            assert len(receiver.spans) == 4  # exactly one per engine request: 1 + 1 + 2 prompts
    finally:
        collector.shutdown()
    assert {span.name for span in spans} == {"llm_request"} and len({span.span_id for span in spans}) == 4
    by_max_tokens = {}
    for span in spans:
        by_max_tokens.setdefault(span.attributes["gen_ai.request.max_tokens"], []).append(span)
    first, = by_max_tokens[5]
    assert first.attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert first.attributes["gen_ai.usage.prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert first.attributes["gen_ai.usage.completion_tokens"] == plain["usage"]["completion_tokens"] == 5
    assert first.attributes["gen_ai.response.model"] and first.attributes["gen_ai.request.n"] == 1
    link, = by_max_tokens[7]
    assert link.trace_id == TRACE_ID and link.parent_span_id == PARENT_SPAN_ID
    assert first.trace_id != TRACE_ID and not first.parent_span_id  # no header: a trace of its own
    pair = by_max_tokens[3]
    assert sorted(s.attributes["gen_ai.usage.completion_tokens"] for s in pair) == [6, 6]  # n=2 x 3 tokens
    assert sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in pair) == several["usage"]["prompt_tokens"]
    assert linked["usage"]["completion_tokens"] == 7
    for span in spans:
        a = span.attributes
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
            <= a["gen_ai.latency.e2e"]
        assert a["gen_ai.latency.time_in_model_prefill"] >= 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
        assert span.end_ns - span.start_ns == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=2e6)


def test_grpc_export_and_a_collector_that_is_down(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = OTLPReceiver()
    collector, endpoint = serve_grpc(receiver)
    try:
        with traced_server(tiny_llama_dir, tmp_path, endpoint) as http:  # gRPC: the default protocol
            completion(http)
            span, = receiver.wait_for(1)
            assert "gen_ai.latency.time_in_model_prefill" not in span.attributes  # not detailed
    finally:
        collector.stop(0)
    # nothing listens on the collector's port any more: requests neither fail nor wait for it
    (tmp_path / "down").mkdir()
    with traced_server(tiny_llama_dir, tmp_path / "down", endpoint) as http:
        start = time.monotonic()
        for _ in range(5):
            completion(http)
        assert time.monotonic() - start < 10
