"""What the scheduler counts for /metrics beyond its plain counters, cheap enough to
update every step: a list increment, no Prometheus objects (those live in the API)."""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from messages.frontend import HistogramSnapshot

if TYPE_CHECKING:
    from actors.scheduler.scheduler import Scheduler

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


def scheduler_stats(scheduler: Scheduler) -> dict[str, float | int | str | HistogramSnapshot]:
    """The scheduler's counters, as GetStats answers them (the API's /metrics reads them)."""
    stats = {
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        **scheduler.kv_cache_manager.stats(),
        "num_computed_prefill_tokens": scheduler.num_computed_prefill_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "iteration_tokens": scheduler.iteration_tokens.snapshot(),
    }
    if scheduler.kv_tiers is not None:  # the host tier's swaps, spills and hits
        stats.update(scheduler.kv_tiers.stats())
    if scheduler.draft_slots is not None:  # vLLM's spec_decode counters, per draft position too
        stats.update(scheduler.draft_slots.stats())
    if scheduler.max_loras:  # vLLM's lora_requests_info: the adapters' names, comma-separated
        stats["max_lora"] = scheduler.max_loras
        for name, queue in (("running_lora_adapters", scheduler.running), ("waiting_lora_adapters", scheduler.waiting)):
            stats[name] = ",".join(sorted({seq.lora_request.lora_name for seq in queue if seq.lora_request}))
    return stats
