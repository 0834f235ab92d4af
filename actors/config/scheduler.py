"""The scheduler's configuration (SchedulerConfig). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step
    max_model_len: int = 2048  # prompt + output tokens of one request
    # Build plan N+1 while the worker runs plan N (two plans in flight), so the worker
    # never waits for the scheduler between decode steps.
    async_scheduling: bool = True
    # Split a long prompt over steps; off for encoders, whose tokens attend to the whole prompt
    enable_chunked_prefill: bool = True
    # "fcfs": first come, first served; "priority": by each request's priority (lower first),
    # then arrival, preempting less urgent running requests (actors/scheduler/priority.py)
    scheduling_policy: str = "fcfs"
    # vLLM's: the most image tokens whose vision encoding one step may start (encoder_budget.py); None: no limit
    max_num_encoder_input_tokens: int | None = None
