"""What the scheduler counts for /metrics beyond its plain counters, cheap enough to
update every step: a list increment, no Prometheus objects (those live in the API)."""

from __future__ import annotations

from bisect import bisect_left

from messages.frontend import HistogramSnapshot

# vLLM's buckets for vllm:iteration_tokens_total, the tokens of one engine step
ITERATION_TOKENS_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class CountHistogram:
    """Observed counts by bucket: value v lands in the first bucket whose bound is >= v
    (Prometheus's `le`), or in the last one, above every bound."""

    def __init__(self, bounds: tuple[int, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative
        self.total = 0

    def observe(self, value: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(bounds=list(self.bounds), counts=list(self.counts), total=self.total)
