"""Tracing from the offline LLM (otlp_traces_endpoint=...): one span per request, with the
token counts of its output; with tracing off no OpenTelemetry module is loaded; asking for
it without the packages fails at start-up, naming what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors import LLM, SamplingParams
from actors.engine.args import EngineArgs
from actors.tracing.spans import TracingUnavailableError
from tests.api.otlp_receiver import OTLPReceiver, serve_http


def test_llm_exports_a_span_per_request(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = OTLPReceiver()
    collector, endpoint = serve_http(receiver)
    try:
        llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB", otlp_traces_endpoint=endpoint)
        outputs = llm.generate(["a b c", "d e"], [SamplingParams(max_tokens=4, ignore_eos=True),
                                                  SamplingParams(max_tokens=9, ignore_eos=True)], use_tqdm=False)
        spans = receiver.wait_for(2)
        llm.engine.traces.tracer.shutdown()
    finally:
        collector.shutdown()
    counts = sorted(span.attributes["gen_ai.usage.completion_tokens"] for span in spans)
    assert counts == [4, 9] and len(spans) == 2
    by_id = {span.attributes["gen_ai.request.id"]: span for span in spans}
    for output in outputs:
        span = by_id[output.request_id]
        assert span.attributes["gen_ai.usage.prompt_tokens"] == len(output.prompt_token_ids)
        assert span.attributes["gen_ai.latency.time_to_first_token"] <= span.attributes["gen_ai.latency.e2e"]


def test_tracing_off_loads_no_opentelemetry(tiny_llama_dir):
    code = ("import sys; from actors import LLM, SamplingParams; import api.app; "
            f"LLM({tiny_llama_dir!r}, kv_cache_memory='16MiB').generate('a', SamplingParams(max_tokens=2), "
            "use_tqdm=False); print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_tracing_without_the_packages_is_a_start_up_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(TracingUnavailableError, match=r"pip install 'troupe\[tracing\]'"):
        EngineArgs(otlp_traces_endpoint="http://127.0.0.1:4317").check()


async def test_async_client_exports_a_span_per_request_including_an_abandoned_one(tiny_llama_dir, monkeypatch):
    import asyncio

    from actors import AsyncClient

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = OTLPReceiver()
    collector, endpoint = serve_http(receiver)
    try:
        async with asyncio.timeout(120):
            async with AsyncClient(tiny_llama_dir, kv_cache_memory="16MiB", otlp_traces_endpoint=endpoint) as client:
                whole = await client.generate("a b c", SamplingParams(max_tokens=5, ignore_eos=True))
                stream = client.generate("d e", SamplingParams(max_tokens=50, ignore_eos=True))
                async for _ in stream:
                    break
                await stream.aclose()  # left after the first delta: aborted, and still one span
                spans = await asyncio.to_thread(receiver.wait_for, 2)
    finally:
        collector.shutdown()
    assert len(spans) == 2
    done = next(s for s in spans if s.attributes["gen_ai.request.max_tokens"] == 5)
    assert done.attributes["gen_ai.usage.completion_tokens"] == len(whole.outputs[0].token_ids) == 5
    assert done.attributes["gen_ai.usage.prompt_tokens"] == len(whole.prompt_token_ids)
