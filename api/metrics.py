"""GET /metrics: Prometheus text.

The server's own counters (requests by route and status, prompt and generated tokens,
latency histograms) live in a registry of this server, not prometheus_client's global
one, so two servers in one process never share counts. The engine's gauges (running and
waiting requests, KV-cache usage) are read from the scheduler when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                            1.0, 2.5)

# scheduler stat -> (metric name, help, is a counter)
_ENGINE_STATS = {
    "num_running": ("troupe_num_requests_running", "Requests the scheduler is running.", False),
    "num_waiting": ("troupe_num_requests_waiting", "Requests waiting for the scheduler to run them.", False),
    "kv_cache_usage": ("troupe_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", False),
    "num_held_blocks": ("troupe_kv_cache_blocks_held", "KV-cache blocks held by requests.", False),
    "num_total_blocks": ("troupe_kv_cache_blocks_total", "KV-cache blocks in the pool.", False),
    "num_preemptions": ("troupe_num_preemptions", "Requests preempted for lack of KV blocks.", True),
    "num_prefix_query_tokens": ("troupe_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                True),
    "num_prefix_hit_tokens": ("troupe_prefix_cache_hits", "Prompt tokens found in the prefix cache.", True),
}


class _EngineStatsCollector:
    """Exposes the last scheduler stats fetched (refreshed on each scrape)."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        for key, (name, documentation, is_counter) in _ENGINE_STATS.items():
            if key not in self.stats:
                continue
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(name, documentation, value=self.stats[key])


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("troupe_http_requests", "HTTP requests answered, by route and status code.",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("troupe_prompt_tokens", "Prompt tokens of the requests served.",
                                     registry=self.registry)
        self.generation_tokens = Counter("troupe_generation_tokens", "Tokens generated.", registry=self.registry)
        self.time_to_first_token = Histogram(
            "troupe_time_to_first_token_seconds", "From a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.time_per_output_token = Histogram(
            "troupe_time_per_output_token_seconds", "Mean time between a request's generated tokens.",
            buckets=_TOKEN_LATENCY_BUCKETS_S, registry=self.registry)
        self.request_latency = Histogram(
            "troupe_e2e_request_latency_seconds", "From a request's arrival to its last token.",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._engine_stats = _EngineStatsCollector()
        self.registry.register(self._engine_stats)

    def render(self, engine_stats: dict[str, float] | None) -> bytes:
        """The Prometheus text; engine_stats None (the engine did not answer) leaves the
        engine's gauges out rather than reporting stale values."""
        self._engine_stats.stats = engine_stats or {}
        return generate_latest(self.registry)
