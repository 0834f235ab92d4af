"""Engine operations beside requests: sleep, wake-up, prefix-cache reset (vLLM's sleep mode
and reset_prefix_cache). The frontend asks the scheduler (EngineControl), which answers
with a Stats message under the same query id (numbers only: "ok", "is_sleeping", ...); the
scheduler tells every worker rank (WorkerControl) on the plans' own pipe, so a worker sleeps
after the plans sent before it, and rank 0 says when it is done (WorkerControlDone)."""

from __future__ import annotations

import msgspec

WEIGHTS, KV_CACHE = "weights", "kv_cache"
WAKE_TAGS = (WEIGHTS, KV_CACHE)  # what wake_up may bring back, separately


def check_wake_tags(tags: list[str] | None) -> list[str]:
    """The parts to wake: tags, or all of them; ValueError naming an unknown tag."""
    if tags is None:
        return list(WAKE_TAGS)
    if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags):
        raise ValueError(f"wake_up tags must be a list of {', '.join(WAKE_TAGS)}, got {tags!r}")
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"wake_up tags must be among {', '.join(WAKE_TAGS)}, got {unknown}")
    return list(tags)


class EngineControl(msgspec.Struct, array_like=True, frozen=True, tag="engine_control"):
    """frontend → scheduler: op is "sleep", "wake_up", "is_sleeping" or "reset_prefix_cache"."""

    query_id: int
    op: str
    level: int = 1  # sleep: 1 (weights to host memory, KV cache dropped) or 2 (both dropped)
    tags: list[str] | None = None  # wake_up: "weights", "kv_cache"; None: both


class WorkerControl(msgspec.Struct, array_like=True, frozen=True, tag="worker_control"):
    """scheduler (its executor) → every worker rank: "sleep" (at level) or "wake_up" (tags)."""

    op: str
    level: int = 1
    tags: list[str] | None = None


class WorkerControlDone(msgspec.Struct, array_like=True, frozen=True, tag="worker_control_done"):
    """worker rank 0 → scheduler: the WorkerControl is done (error: why it failed)."""

    op: str
    error: str | None = None
