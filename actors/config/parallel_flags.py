"""The checks of the distributed engine arguments: pipeline_parallel_size,
data_parallel_size and distributed_executor_backend, alone (check_distributed_flags, before
the model is read) and against the model and the other features (check_distributed).

What is not built is refused by name, never ignored. Light to import: no torch, no ray."""

from __future__ import annotations

import importlib.util
from typing import Any

from actors.config.env import engine_key
from actors.config.model import ModelConfig

EXECUTOR_BACKENDS = ("mp", "ray")
# how the frontend spreads requests over data-parallel replicas (actors/frontend/prefix_routing.py)
ROUTING_LOGICS = ("leastloaded", "prefixaware")
RAY_EXTRA_HINT = "pip install 'troupe[ray]' (or pip install ray)"


def check_distributed_flags(args: Any) -> None:
    """ValueError naming the field, for what needs neither the model nor the device."""
    pp, dp = args.pipeline_parallel_size, args.data_parallel_size
    if args.distributed_executor_backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                         f"got {args.distributed_executor_backend!r}")
    if args.routing_logic not in ROUTING_LOGICS:
        raise ValueError(f"routing_logic must be one of {', '.join(ROUTING_LOGICS)}, got {args.routing_logic!r}")
    if args.routing_logic == "prefixaware" and dp == 1:
        raise ValueError("routing_logic='prefixaware' routes between replicas: it needs data_parallel_size > 1")
    if dp > 1 and args.nnodes > 1:
        raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported")
    if pp > 1:
        for name in ("enable_lora", "speculative_config", "gpu_memory_utilization"):
            if getattr(args, name) not in (None, False):
                raise ValueError(f"pipeline_parallel_size > 1 does not support {name} yet")
    if pp > 1 and (args.swap_space or args.kv_offload_size or args.kv_offload_dir):
        raise ValueError("pipeline_parallel_size > 1 does not support the host or disk KV tier (swap_space, "
                         "kv_offload_size, kv_offload_dir) yet")
    if dp > 1 and args.kv_offload_dir:  # one directory would be written by every replica at once
        raise ValueError("data_parallel_size > 1 does not support kv_offload_dir yet")
    if dp > 1 and args.enable_lora:
        raise ValueError("data_parallel_size > 1 does not support enable_lora yet")
    if dp > 1 and args.distributed_executor_backend == "ray":
        raise ValueError("data_parallel_size > 1 with distributed_executor_backend='ray' is not supported yet")
    if args.distributed_executor_backend == "ray":
        if args.nnodes > 1:
            raise ValueError("distributed_executor_backend='ray' places every rank itself: leave nnodes at 1 "
                             "(the Ray cluster spans the machines)")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"distributed_executor_backend='ray' needs the ray package: {RAY_EXTRA_HINT}")
    if args.nnodes > 1:
        engine_key()  # every node needs the shared secret: say so before anything starts


def check_distributed(args: Any, model: ModelConfig, pooler: Any) -> None:
    """ValueError naming the field, for what pipeline parallelism does not fit in the model."""
    pp = args.pipeline_parallel_size
    if pp == 1:
        return
    if model.num_hidden_layers < pp:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {model.num_hidden_layers} layers")
    if pooler is not None or model.is_encoder or not model.can_generate:
        raise ValueError("pipeline_parallel_size > 1 does not support pooling models (runner 'pooling') yet")


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The layers of one pipeline stage: an even split, the remainder one each to the
    earliest stages (so the last stage, which also runs the LM head and the sampler, never
    holds more than another)."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def runs_in_process(parallel: Any) -> bool:
    """Whether LLM runs the engine core in its own process: one worker, no Ray, one replica."""
    return (parallel.world_size == 1 and parallel.distributed_executor_backend == "mp"
            and parallel.data_parallel_size == 1)
