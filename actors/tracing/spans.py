"""OpenTelemetry request spans, as vLLM exports them: one `llm_request` span (kind SERVER)
per finished engine request, from its arrival to its end, with vLLM's `gen_ai.*`
attributes; a child of the caller's trace when the HTTP request carried a W3C
`traceparent` header.

Export is the SDK's BatchSpanProcessor: ending a span only queues it, a background thread
sends batches over OTLP (gRPC, or HTTP/protobuf when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
says so, as vLLM), so a collector that is down or slow costs a request nothing: its spans
wait in a bounded queue and are dropped past it. The OpenTelemetry packages are the
optional extra `troupe[tracing]`; nothing here imports them until a tracer is made, so
with tracing off no OpenTelemetry module is loaded."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from actors.config.env import otel_service_name, otlp_traces_protocol

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, what a span's parent comes from
DETAILED_TRACES = ("model", "worker", "all")  # vLLM's --collect-detailed-traces choices
_SHUTDOWN_TIMEOUT_S = 2.0  # at exit, spans still queued get this long to leave


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), so dashboards built for it read troupe's."""

    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class TracingUnavailableError(ValueError):
    """Tracing was asked for, and the OpenTelemetry packages are not installed."""


def check_tracing_available() -> None:
    """Raises TracingUnavailableError, with what to install, when the packages are missing."""
    import importlib.util

    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            raise TracingUnavailableError(
                f"otlp_traces_endpoint needs the OpenTelemetry packages ({module} is not installed): "
                "pip install 'troupe[tracing]'")


@dataclass(frozen=True)
class RequestTrace:
    """What one finished engine request's span says. Times are time.monotonic()."""

    request_id: str
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    num_prompt_tokens: int
    num_completion_tokens: int
    arrival: float
    first_scheduled: float  # admitted by the scheduler (the end of its time in queue)
    first_token: float
    last_token: float
    end: float


class RequestTracer:
    """Exports one span per finished request to an OTLP endpoint."""

    def __init__(self, endpoint: str, detailed: bool = False, service_name: str = "troupe") -> None:
        check_tracing_available()
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        protocol = otlp_traces_protocol()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=5)
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=5)
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} is not supported "
                             "(grpc or http/protobuf)")
        resource = Resource.create({"service.name": otel_service_name(service_name)})
        # its own exit hook would wait for a collector that is down: shutdown() bounds that
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("troupe")
        self._kind = trace.SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self.detailed = detailed
        self._shut_down = False
        self.endpoint = endpoint
        atexit.register(self.shutdown)

    def record(self, request: RequestTrace, trace_headers: Mapping[str, str] | None = None) -> None:
        """Queues the request's span (the export happens on the SDK's thread)."""
        parent = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        # the span's times are wall-clock nanoseconds: the monotonic ones shifted by now's offset
        offset = time.time() - time.monotonic()

        def nanoseconds(moment: float) -> int:
            return int((moment + offset) * 1e9)

        queue = request.first_scheduled - request.arrival
        attributes = {
            SpanAttributes.REQUEST_ID: request.request_id,
            SpanAttributes.RESPONSE_MODEL: request.model,
            SpanAttributes.REQUEST_TEMPERATURE: request.temperature,
            SpanAttributes.REQUEST_TOP_P: request.top_p,
            SpanAttributes.REQUEST_N: request.n,
            SpanAttributes.USAGE_NUM_SEQUENCES: request.n,
            SpanAttributes.USAGE_PROMPT_TOKENS: request.num_prompt_tokens,
            SpanAttributes.USAGE_COMPLETION_TOKENS: request.num_completion_tokens,
            SpanAttributes.LATENCY_TIME_IN_QUEUE: queue,
            SpanAttributes.LATENCY_TIME_TO_FIRST_TOKEN: request.first_token - request.arrival,
            SpanAttributes.LATENCY_E2E: request.end - request.arrival,
        }
        if request.max_tokens is not None:
            attributes[SpanAttributes.REQUEST_MAX_TOKENS] = request.max_tokens
        if self.detailed:
            prefill = request.first_token - request.first_scheduled
            decode = request.last_token - request.first_token
            attributes[SpanAttributes.LATENCY_TIME_IN_MODEL_PREFILL] = prefill
            attributes[SpanAttributes.LATENCY_TIME_IN_MODEL_DECODE] = decode
            attributes[SpanAttributes.LATENCY_TIME_IN_MODEL_INFERENCE] = prefill + decode
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind, attributes=attributes,
                                       start_time=nanoseconds(request.arrival))
        span.end(end_time=nanoseconds(request.end))

    def shutdown(self) -> None:
        """Sends what is queued, waiting at most _SHUTDOWN_TIMEOUT_S (a collector that is
        down must not hold the process at exit); idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        thread = threading.Thread(target=self._provider.shutdown, name="troupe-tracing-shutdown", daemon=True)
        thread.start()
        thread.join(_SHUTDOWN_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("tracing: spans still queued for %s were dropped at exit", self.endpoint)


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an HTTP request, or None when it has none."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


class EngineRequestTraces:
    """The timelines of the requests an in-process engine (EngineCore, behind LLM) runs,
    each recorded as a span when it finishes (the server records its own, with the
    caller's trace context, in api/metrics.py)."""

    def __init__(self, tracer: RequestTracer, model: str) -> None:
        self.tracer = tracer
        self.model = model
        self._live: dict[str, dict] = {}

    def added(self, request_id: str, params, num_prompt_tokens: int) -> None:
        self._live[request_id] = {"params": params, "prompt": num_prompt_tokens, "arrival": time.monotonic(),
                                  "scheduled": None, "first": None, "last": None, "tokens": 0}

    def delta(self, delta) -> None:  # a RequestOutput delta
        live = self._live.get(delta.request_id)
        if live is None:
            return
        now = time.monotonic()
        if delta.prompt_token_ids:
            live["prompt"] = len(delta.prompt_token_ids)
        if delta.metrics is not None and delta.metrics.first_scheduled_time is not None:
            live["scheduled"] = delta.metrics.first_scheduled_time
        num_new = sum(len(completion.token_ids) for completion in delta.outputs)
        if num_new:
            live["tokens"] += num_new
            live["first"] = live["first"] or now
            live["last"] = now
        if delta.finished:
            self.finished(delta.request_id, now)

    def finished(self, request_id: str, now: float | None = None) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        now = time.monotonic() if now is None else now
        first = live["first"] or now
        scheduled = min(max(live["scheduled"] or first, live["arrival"]), first)
        params = live["params"]
        self.tracer.record(RequestTrace(
            request_id=request_id, model=self.model, max_tokens=params.max_tokens, temperature=params.temperature,
            top_p=params.top_p, n=params.n, num_prompt_tokens=live["prompt"], num_completion_tokens=live["tokens"],
            arrival=live["arrival"], first_scheduled=scheduled, first_token=first, last_token=live["last"] or first,
            end=now))


class ClientTracingMixin:
    """AsyncClient's spans (with otlp_traces_endpoint): one per request it runs, for callers
    that use it directly (and LLM with several devices, which runs one). The HTTP server
    records its own spans, which carry its served model name and the caller's trace
    context, and turns these off (records_spans = False)."""

    records_spans = True
    _request_tracer: RequestTracer | None = None

    def _traced(self, deltas, request) -> object:  # (AsyncIterator[RequestOutput], AddRequest)
        config = self.config
        if not self.records_spans or config is None or not config.otlp_traces_endpoint:
            return deltas
        if self._request_tracer is None:
            self._request_tracer = RequestTracer(config.otlp_traces_endpoint, config.collect_detailed_traces is not None)
        traces = EngineRequestTraces(self._request_tracer, config.model.model_path)
        return _observed(deltas, traces, request.request_id, request.params)


async def _observed(deltas, traces: EngineRequestTraces, request_id: str, params):
    """The deltas, unchanged, with the request's timeline recorded as they pass; its span
    when it finishes, or when the caller leaves (an abort)."""
    traces.added(request_id, params, 0)  # (its prompt's length comes with the first delta)
    started = False
    try:
        async for delta in deltas:
            started = True
            traces.delta(delta)
            yield delta
    finally:
        if started:  # a request refused before it ran has no span
            traces.finished(request_id)
        await deltas.aclose()
