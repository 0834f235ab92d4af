"""GET /metrics: Prometheus text under vLLM's metric names, types, labels and buckets, so
that dashboards built for vLLM work unchanged.

Every engine metric carries vLLM's labels: model_name (the first served model name) and
engine ("0": troupe runs one scheduler). What is measured where:
- Per request, here in the API, from each engine request's deltas (RequestStats): the
  prompt and generation token counters, time to first token, inter-token latency (each
  gap between a request's steps), its latency split into queue (arrival → first
  scheduled, the scheduler's stamp that rides on RequestOutput.metrics), prefill (→ first
  token) and decode (→ last token), its token counts and the n and max_tokens it asked
  for. A request is one engine request (one prompt) with its n completions; only
  vllm:request_success counts completions, by finish reason, as each has its own.
- Per step, in the scheduler, fetched when /metrics is scraped: running and waiting
  requests, KV-cache usage, preemptions, prefix-cache queries and hits (in tokens),
  speculative decoding's drafts and accepted tokens (per draft position too), and
  the tokens of each step (vLLM's count: the tokens sampled plus the prompt of each
  request whose first token came).
Troupe keeps its own names only where vLLM has none: HTTP requests by route and status,
KV blocks held. Everything lives in a registry of this server, not prometheus_client's
global one, so two servers in one process never share counts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from actors.config import EngineConfig
from actors.tracing.spans import RequestTrace, RequestTracer
from messages.common import RequestOutput, SamplingParams
from messages.frontend import HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LABEL_NAMES = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, in seconds
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                        20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)

# scheduler stat -> (vLLM's metric name, help); gauges, then counters (rendered name_total)
_ENGINE_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "num_held_blocks": ("troupe_kv_cache_blocks_held", "KV-cache blocks held by requests."),
    # the host KV tier (only when there is one)
    "num_swapped": ("vllm:num_requests_swapped", "Number of requests swapped to CPU."),
    "num_free_host_blocks": ("troupe_host_kv_blocks_free", "Host KV-tier blocks free or evictable."),
}
_ENGINE_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "num_prefix_query_tokens": ("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens."),
    "num_prefix_hit_tokens": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions_swap": ("troupe_num_preemptions_swap", "Preemptions that swapped the KV to the host tier."),
    "num_blocks_swapped_out": ("troupe_kv_blocks_swapped_out", "KV blocks copied to the host tier."),
    "num_blocks_swapped_in": ("troupe_kv_blocks_swapped_in", "KV blocks copied back from the host tier."),
    "num_external_prefix_query_tokens": ("vllm:external_prefix_cache_queries",
                                         "External prefix cache queries, in terms of number of queried tokens."),
    "num_external_prefix_hit_tokens": ("vllm:external_prefix_cache_hits",
                                       "External prefix cache hits, in terms of number of cached tokens."),
    # speculative decoding (only when it is configured)
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}
# the scheduler's stat of draft position i is this prefix + str(i) (actors/scheduler/speculation.py)
_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_pos_"


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_labels(config: EngineConfig, num_gpu_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels: the cache config as vLLM names it, values as str()."""
    cache = config.cache
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": "auto",  # the KV cache takes the model's dtype
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(None if cache.gpu_memory_utilization else cache.kv_cache_memory),
        "num_gpu_blocks": str(num_gpu_blocks),  # the KV blocks of the pool, whatever the device
        "num_gpu_blocks_override": str(cache.num_kv_blocks),
    }


class _EngineStatsCollector:
    """The scheduler's stats fetched for the current scrape, and the cache config."""

    def __init__(self, label_values: tuple[str, str], config: EngineConfig) -> None:
        self.label_values = label_values
        self.config = config
        self.stats: dict = {}
        self.num_gpu_blocks: int | None = None  # known from the first stats on

    def update(self, stats: dict | None) -> None:
        # None (the engine did not answer) leaves the engine's numbers out rather than stale
        self.stats = stats or {}
        if "num_total_blocks" in self.stats:
            self.num_gpu_blocks = int(self.stats["num_total_blocks"])

    def collect(self) -> Iterator[Metric]:
        labels = list(LABEL_NAMES)
        for families, family_type in ((_ENGINE_GAUGES, GaugeMetricFamily), (_ENGINE_COUNTERS, CounterMetricFamily)):
            for key, (name, documentation) in families.items():
                if key in self.stats:
                    family = family_type(name, documentation, labels=labels)
                    family.add_metric(self.label_values, self.stats[key])
                    yield family
        per_position = sorted((int(key[len(_ACCEPTED_PER_POS):]), value) for key, value in self.stats.items()
                              if key.startswith(_ACCEPTED_PER_POS))
        if per_position:
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft's position.", labels=[*labels, "position"])
            for position, value in per_position:
                family.add_metric([*self.label_values, str(position)], value)
            yield family
        iteration_tokens = self.stats.get("iteration_tokens")
        if isinstance(iteration_tokens, HistogramSnapshot):
            yield self._histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  iteration_tokens)
        if "running_lora_adapters" in self.stats:
            # vLLM's: a gauge of the scrape's time whose labels carry the adapters in use
            names = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=names)
            family.add_metric([str(self.stats[name]) for name in names], time.time())
            yield family
        if self.num_gpu_blocks is not None:
            info = cache_config_labels(self.config, self.num_gpu_blocks)
            # an info metric as vLLM makes one: a gauge of 1 whose labels carry the values
            family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=[*labels, *info])
            family.add_metric([*self.label_values, *info.values()], 1)
            yield family

    def _histogram(self, name: str, documentation: str, snapshot: HistogramSnapshot) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip([*snapshot.bounds, float("inf")], snapshot.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(name, documentation, labels=list(LABEL_NAMES))
        family.add_metric(self.label_values, buckets, sum_value=snapshot.total)
        return family


class ServerMetrics:
    """The server's metrics: the API's own, observed as requests go, and the engine's,
    fetched per scrape (render)."""

    def __init__(self, model_name: str, config: EngineConfig) -> None:
        self.registry = CollectorRegistry()
        self.max_model_len = config.scheduler.max_model_len
        label_values = (model_name, "0")
        token_buckets = one_two_five_buckets(self.max_model_len)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABEL_NAMES, registry=self.registry).labels(*label_values)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, LABEL_NAMES, buckets=buckets,
                             registry=self.registry).labels(*label_values)

        self.requests = Counter("troupe_http_requests", "HTTP requests answered, by route and status code.",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABEL_NAMES, "finished_reason"], registry=self.registry)
        # every reason from the start, at 0, so that rate() sees a reason's first request
        self.request_success = {reason: success.labels(*label_values, reason) for reason in FINISH_REASONS}

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _TTFT_BUCKETS_S)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _TOKEN_GAP_BUCKETS_S)
        # vLLM's older name for the same observations, still emitted beside the new one
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.",
                                               _TOKEN_GAP_BUCKETS_S)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", _TOKEN_GAP_BUCKETS_S)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             _REQUEST_LATENCY_BUCKETS_S)
        # phase -> its histogram: queue (arrival to first scheduled), prefill (to the first
        # token), decode (to the last token), inference (prefill + decode)
        self.request_phase_time = {
            phase: histogram(f"vllm:request_{phase}_time_seconds",
                             f"Histogram of time spent in {vllm_phase} phase for request.", _REQUEST_LATENCY_BUCKETS_S)
            for phase, vllm_phase in (("queue", "WAITING"), ("inference", "RUNNING"), ("prefill", "PREFILL"),
                                      ("decode", "DECODE"))}
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                          _N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self._engine_stats = _EngineStatsCollector(label_values, config)
        self.registry.register(self._engine_stats)

    def on_pooling_finished(self, num_prompt_tokens: int, seconds: float) -> None:
        """A pooled output returned (an embedding, a classification, a score): vLLM finishes
        a pooling request as stopped, with its prompt tokens and nothing generated."""
        self.request_success["stop"].inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.e2e_request_latency.observe(seconds)

    def render(self, engine_stats: dict | None) -> bytes:
        """The Prometheus text; engine_stats None (the engine did not answer) leaves the
        engine's gauges and counters out rather than reporting stale values."""
        self._engine_stats.update(engine_stats)
        return generate_latest(self.registry)


@dataclass(frozen=True)
class RequestSpanInfo:
    """With tracing on, one engine request's span: its tracer, ids and parameters."""

    tracer: RequestTracer
    request_id: str
    model: str
    params: SamplingParams
    trace_headers: dict[str, str] | None  # the HTTP request's traceparent / tracestate

    def record(self, stats: RequestStats, scheduled: float, first_token: float, last_token: float,
               end: float) -> None:
        params = self.params
        self.tracer.record(RequestTrace(
            request_id=self.request_id, model=self.model, max_tokens=params.max_tokens,
            temperature=params.temperature, top_p=params.top_p, n=params.n,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_completion_tokens=sum(stats.num_tokens_by_completion.values()), arrival=stats.arrival,
            first_scheduled=scheduled, first_token=first_token, last_token=last_token, end=end),
            self.trace_headers)


class RequestStats:
    """One engine request's timeline as the API sees it (time.monotonic(), the clock of
    the scheduler's stamp too), observed into ServerMetrics as its deltas come: counters
    and token gaps at once, the per-request histograms when it ends."""

    def __init__(self, metrics: ServerMetrics, n: int, max_tokens: int | None,
                 trace: RequestSpanInfo | None = None) -> None:
        self._metrics = metrics
        self._trace = trace  # with tracing on: what the request's span needs besides the timeline
        self._n = n
        self._max_tokens = max_tokens  # None: up to max_model_len
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_prompt_tokens = 0
        self.num_tokens_by_completion: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}  # completion index -> finish_reason
        self.ended = False

    def on_delta(self, delta: RequestOutput) -> int:
        """Records a delta; returns how many tokens it brought (the usage counts them too)."""
        now = time.monotonic()
        metrics = self._metrics
        if delta.prompt_token_ids:
            self.num_prompt_tokens = len(delta.prompt_token_ids)
            metrics.prompt_tokens.inc(self.num_prompt_tokens)
        if delta.metrics is not None and delta.metrics.first_scheduled_time is not None:
            self.first_scheduled = delta.metrics.first_scheduled_time
        num_new = 0
        for completion in delta.outputs:
            if completion.token_ids:
                num_new += len(completion.token_ids)
                counts = self.num_tokens_by_completion
                counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finish_reasons[completion.index] = completion.finish_reason
        if num_new:
            metrics.generation_tokens.inc(num_new)
            if self.last_token is None:
                self.first_token = now
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                # one gap per step of the request (its n completions advance together)
                metrics.inter_token_latency.observe(now - self.last_token)
                metrics.time_per_output_token.observe(now - self.last_token)
            self.last_token = now
        if delta.finished:
            self._end(now)
        return num_new

    def on_cancelled(self) -> None:
        """The client left first: the request was aborted, with its unfinished completions."""
        if not self.ended:
            self._end(time.monotonic())

    def _end(self, now: float) -> None:
        self.ended = True
        metrics = self._metrics
        for index in range(self._n):
            metrics.request_success[self.finish_reasons.get(index, "abort")].inc()
        # a request ended before a token (aborted) spent its time waiting, or in prefill
        first_token = self.first_token if self.first_token is not None else now
        last_token = self.last_token if self.last_token is not None else first_token
        scheduled = first_token if self.first_scheduled is None else self.first_scheduled
        scheduled = min(max(scheduled, self.arrival), first_token)
        prefill, decode = first_token - scheduled, last_token - first_token
        metrics.e2e_request_latency.observe(now - self.arrival)
        phase_time = metrics.request_phase_time
        phase_time["queue"].observe(scheduled - self.arrival)
        phase_time["prefill"].observe(prefill)
        phase_time["decode"].observe(decode)
        phase_time["inference"].observe(prefill + decode)
        num_steps = max(self.num_tokens_by_completion.values(), default=0) - 1  # the n completions share them
        if num_steps > 0:
            metrics.request_time_per_output_token.observe(decode / num_steps)
        metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.observe(sum(self.num_tokens_by_completion.values()))
        metrics.request_params_n.observe(self._n)
        max_tokens = self._max_tokens
        if max_tokens is None:
            max_tokens = max(metrics.max_model_len - self.num_prompt_tokens, 0)
        metrics.request_params_max_tokens.observe(max_tokens)
        if self._trace is not None:
            self._trace.record(self, scheduled, first_token, last_token, now)
