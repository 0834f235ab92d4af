"""A rank's concrete device and dtype, and the KV pool's size: what the model runner is
built with, before any tensor exists."""

from __future__ import annotations

import dataclasses

import torch

from actors.config.kv_groups import engine_kv_layout
from actors.config import EngineConfig
from actors.layers.tensor_parallel import TensorParallel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_block_bytes(engine: EngineConfig, parallel: TensorParallel = TensorParallel()) -> int:
    """Bytes one KV block takes across all layers (keys and values) on one rank, the
    speculative draft model's cache included (it has the same blocks: draft_model.py)."""
    m = engine.model
    element = torch.empty((), dtype=DTYPES[engine.dtype]).element_size()
    num_kv_heads = parallel.num_kv_heads(m)
    # a block holds one layer group's layers (actors/config/kv_groups.py): all of them without groups
    layers = engine_kv_layout(engine).layers_per_group
    target_bytes = 2 * layers * num_kv_heads * m.head_dim * engine.cache.block_size * element
    draft = engine.draft_model  # (tensor parallelism 1: all its heads on this rank)
    if draft is None:
        return target_bytes
    return target_bytes + 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim \
        * engine.cache.block_size * element


def num_kv_blocks(engine: EngineConfig, parallel: TensorParallel = TensorParallel()) -> int:
    """The pool size: num_kv_blocks if given, else what kv_cache_memory holds (per rank)."""
    cache = engine.cache
    block_bytes = kv_block_bytes(engine, parallel)
    blocks = cache.num_kv_blocks or cache.kv_cache_memory // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory ({cache.kv_cache_memory} bytes) holds no KV block of {block_bytes} bytes")
    return blocks


def resolve_device(engine: EngineConfig, rank: int = 0) -> EngineConfig:
    """The config with a concrete device for this rank and a concrete dtype: "auto" picks
    CUDA when there is one (rank r on GPU r) and float32 on the CPU, bfloat16 on CUDA."""
    device = engine.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
        if ":" not in device:
            num_devices = torch.cuda.device_count()
            if rank >= num_devices:
                raise ValueError(f"tensor_parallel_size {engine.parallel.tensor_parallel_size} needs as many GPUs; "
                                 f"{num_devices} are visible")
            device = f"cuda:{rank}"
    dtype = engine.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if (device, dtype) == (engine.device, engine.dtype):
        return engine
    return dataclasses.replace(engine, device=device, dtype=dtype)
